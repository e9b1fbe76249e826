"""Pure: which jobs a KubeRay installation can run (issue 10, items 3, 7, 8)."""

from __future__ import annotations

import pytest

from ppojob_api.validation import validate_manifest
from ppojob_operator.capabilities import refusal, sidecar_supported
from tests.helpers.manifests import base_manifest
from tests.helpers.ophelpers import RAYJOB_CRD, pre_1_5


def test_sidecar_support_is_read_from_the_rayjob_crd() -> None:
    assert sidecar_supported(RAYJOB_CRD) is True
    assert sidecar_supported(pre_1_5(RAYJOB_CRD)) is False
    assert sidecar_supported(None) is None


def job(**spec):
    return validate_manifest(base_manifest(**spec))


@pytest.mark.parametrize(
    ("spec", "kwargs", "reason"),
    [
        ({}, {"sidecar": False}, "KubeRayTooOld"),
        ({"submissionMode": "K8sJobMode"}, {"sidecar": False}, None),
        ({}, {"sidecar": True}, None),
        ({}, {"sidecar": None}, None),
        (
            {"scheduling": {"gangScheduler": "volcano"}},
            {"kuberay_batch_scheduler": ""},
            "BatchSchedulerMismatch",
        ),
        (
            {"scheduling": {"gangScheduler": "volcano"}},
            {"kuberay_batch_scheduler": "volcano"},
            None,
        ),
        (
            {"scheduling": {"gangScheduler": "none"}},
            {"kuberay_batch_scheduler": "volcano"},
            "BatchSchedulerMismatch",
        ),
        ({}, {"kuberay_batch_scheduler": "scheduler-plugins"}, "BatchSchedulerMismatch"),
        # gangScheduler unset: the operator's default decides
        ({"scheduling": {"queue": "q"}}, {"gang_default": "kueue"}, None),
        (
            {"scheduling": {"queue": "q"}},
            {"gang_default": "volcano", "kuberay_batch_scheduler": "volcano"},
            None,
        ),
        ({}, {"gang_default": "kueue"}, "QueueRequired"),
        (
            {"scheduling": {"gangScheduler": "kueue", "queue": "q"}},
            {"missing_crd": "workloads.kueue.x-k8s.io"},
            "SchedulerNotInstalled",
        ),
        ({"scheduling": {"queue": "Team_A"}}, {"gang_default": "kueue"}, "InvalidQueue"),
        ({"scheduling": {"queue": "team-a"}}, {"gang_default": "kueue"}, None),
        ({"scheduling": {"queue": "q"}}, {}, "NoGangScheduler"),
        (
            {"scheduling": {"queue": "q"}},
            {"gang_default": "volcano", "kuberay_batch_scheduler": ""},
            "BatchSchedulerMismatch",
        ),
    ],
)
def test_refusals(spec, kwargs, reason) -> None:
    args = {"gang_default": None, "kuberay_batch_scheduler": None, "sidecar": None, **kwargs}
    got = refusal(job(**spec), **args)
    assert (got[0] if got else None) == reason, got
    if got:
        assert got[1]  # a message saying what to change
