"""The Pod Security level each feature of a job needs (ppojob_api.checks.podsecurity); the
table is checked against the real PodSecurity admission in tests/cluster/test_pod_security.py."""

from __future__ import annotations

import pytest

from ppojob_api.checks.podsecurity import check_pod_security, needs, required_level
from ppojob_api.validation import validate_manifest
from tests.helpers.manifests import base_manifest


def spec_of(**fields):
    return validate_manifest(base_manifest(**fields)).spec


def test_k8sjobmode_without_extras_meets_restricted() -> None:
    spec = spec_of(submissionMode="K8sJobMode")
    assert needs(spec) == [] and required_level(spec) == "restricted"
    assert check_pod_security(spec, "restricted") == []


def test_sidecarmode_needs_baseline_for_kuberays_submitter_container() -> None:
    spec = spec_of()
    assert required_level(spec) == "baseline"
    (problem,) = check_pod_security(spec, "restricted")
    assert problem.path == "spec.submissionMode" and "ray-job-submitter" in problem.message
    assert '"baseline"' in problem.message and '"restricted" refuses' in problem.message
    assert check_pod_security(spec, "baseline") == []


@pytest.mark.parametrize(
    ("fields", "path", "level"),
    [
        (
            {"roles": {"actor": {"capabilities": ["IPC_LOCK"]}}},
            "spec.roles.actor.capabilities",
            "privileged",
        ),
        (
            {"podTemplate": {"volumes": [{"name": "m", "hostPath": {"path": "/m"}}]}},
            "spec.podTemplate.volumes[0]",
            "privileged",
        ),
        (
            {"podTemplate": {"volumes": [{"name": "m", "nfs": {"server": "s", "path": "/"}}]}},
            "spec.podTemplate.volumes[0]",
            "baseline",
        ),
        (
            {
                "checkpointVolume": {"nfs": {"server": "s", "path": "/ckpt"}},
                "training": {"checkpointDir": "/checkpoints"},
            },
            "spec.checkpointVolume.nfs",
            "baseline",
        ),
    ],
)
def test_each_feature_names_the_level_it_needs(fields, path, level) -> None:
    spec = spec_of(submissionMode="K8sJobMode", **fields)
    assert [(n.path, n.level) for n in needs(spec)] == [(path, level)]
    assert required_level(spec) == level
    below = "baseline" if level == "privileged" else "restricted"
    assert [p.path for p in check_pod_security(spec, below)] == [path]
    assert check_pod_security(spec, level) == []


def test_an_emptydir_or_pvc_volume_and_a_colocated_role_need_nothing() -> None:
    spec = spec_of(
        submissionMode="K8sJobMode",
        podTemplate={"volumes": [{"name": "scratch", "emptyDir": {}}]},
    )
    assert needs(spec) == []
