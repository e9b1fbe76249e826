"""`ppojob validate --pod-security LEVEL`: a job whose pods that level refuses fails, with every
feature, the level it needs and the level named."""

from __future__ import annotations

from ppojob_cli.main import main
from tests.helpers.controlplane import ROOT

TINY = str(ROOT / "examples" / "ppojob-tiny.yaml")


def test_a_sidecarmode_job_is_refused_under_restricted_and_admitted_under_baseline(capsys) -> None:
    assert main(["validate", TINY, "--pod-security", "restricted"]) == 1
    err = capsys.readouterr().err
    assert 'refused under Pod Security "restricted" (needs "baseline")' in err, err
    assert "spec.submissionMode" in err and "ray-job-submitter" in err
    assert main(["validate", TINY, "--pod-security", "baseline"]) == 0
    out = main(
        ["validate", TINY, "--pod-security", "restricted", "--set", "submissionMode=K8sJobMode"]
    )
    assert out == 0, capsys.readouterr().err


def test_capabilities_are_refused_under_baseline(capsys) -> None:
    sets = ["--set", "submissionMode=K8sJobMode", "--set", "roles.actor.capabilities=[IPC_LOCK]"]
    assert main(["validate", TINY, "--pod-security", "baseline", *sets]) == 1
    err = capsys.readouterr().err
    assert 'refused under Pod Security "baseline" (needs "privileged")' in err, err
    assert "spec.roles.actor.capabilities: adds capability IPC_LOCK" in err
    assert main(["validate", TINY, "--pod-security", "privileged", *sets]) == 0
