"""Pure tests of the RayJob -> PPOJob status mapping."""

from __future__ import annotations

import pytest

from ppojob_api.problems import Problem
from ppojob_api.validation import validate_manifest
from ppojob_operator import builders
from ppojob_operator.status import desired_status, invalid_status, phase_of, status_patch
from tests.helpers.manifests import base_manifest

JOB = validate_manifest(base_manifest())


def rayjob(dep="", js="", **extra):
    rj = builders.build_children(JOB, namespace="ns1")[-1]
    rj["status"] = {"jobDeploymentStatus": dep, "jobStatus": js, **extra}
    return rj


@pytest.mark.parametrize(
    ("dep", "js", "phase"),
    [
        ("", "", "Pending"),
        ("New", "", "Pending"),
        ("Initializing", "", "Initializing"),
        ("Running", "PENDING", "Initializing"),
        ("Running", "RUNNING", "Running"),
        ("Complete", "SUCCEEDED", "Succeeded"),
        ("Complete", "FAILED", "Failed"),
        ("Failed", "FAILED", "Failed"),
        ("ValidationFailed", "", "Failed"),
        ("Retrying", "", "Initializing"),
        ("Suspending", "", "Suspended"),
        ("Suspended", "", "Suspended"),
    ],
)
def test_phase_mapping(dep, js, phase):
    assert phase_of(rayjob(dep, js), suspend=False, kueue=False)[0] == phase


def test_kueue_waiting_is_pending():
    assert phase_of(rayjob("Suspended"), suspend=False, kueue=True)[:2] == (
        "Pending",
        "WaitingForAdmission",
    )
    assert phase_of(rayjob("Suspended"), suspend=True, kueue=True)[0] == "Suspended"


@pytest.mark.parametrize(
    ("dep", "js", "kueue", "reason"),
    [
        ("Suspended", "", True, "WaitingForAdmission"),
        ("", "", True, "WaitingForAdmission"),
        ("", "", False, "RayJobCreated"),
        ("Initializing", "", False, "RayJobInitializing"),
        ("Running", "PENDING", False, "Submitting"),
    ],
)
def test_pending_and_initializing_reasons_show_on_the_running_condition(dep, js, kueue, reason):
    """Pending and Initializing have no condition of their own: their reason and message are on
    ``Running`` (False), where ``kubectl describe`` shows them."""
    st = desired_status(
        JOB,
        rayjob(dep, js),
        generation=1,
        previous=None,
        now="T",
        scheduler="kueue" if kueue else "none",
    )
    running = next(c for c in st["conditions"] if c["type"] == "Running")
    assert running["status"] == "False" and running["reason"] == reason
    assert running["message"]
    others = [c for c in st["conditions"] if c["type"] in ("Succeeded", "Failed", "Suspended")]
    assert {c["reason"] for c in others} == {st["phase"]}


def test_failure_carries_rayjob_reason_and_message():
    rj = rayjob(
        "Failed",
        "FAILED",
        reason="DeadlineExceeded",
        message="ran past 3600s",
        startTime="t0",
        endTime="t1",
    )
    st = desired_status(JOB, rj, generation=3, previous=None, now="T")
    assert st["phase"] == "Failed" and st["completionTime"] == "t1" and st["startTime"] == "t0"
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed == {
        "type": "Failed",
        "status": "True",
        "reason": "DeadlineExceeded",
        "message": "ran past 3600s",
        "observedGeneration": 3,
        "lastTransitionTime": "T",
    }
    assert st["observedGeneration"] == 3 and st["rayJobName"] == "demo" and st["gpus"] == 0


def test_transition_times_kept_and_no_patch_when_unchanged():
    rj = rayjob("Running", "RUNNING", dashboardURL="demo-head:8265")
    first = desired_status(JOB, rj, generation=1, previous=None, now="T1")
    again = desired_status(JOB, rj, generation=1, previous=first, now="T2")
    assert again == first and status_patch(first, again) == {}
    assert first["dashboardURL"] == "demo-head:8265"
    done = desired_status(
        JOB, rayjob("Complete", "SUCCEEDED"), generation=1, previous=first, now="T3"
    )
    times = {c["type"]: c["lastTransitionTime"] for c in done["conditions"]}
    assert times["Valid"] == "T1" and times["Running"] == "T3" and times["Succeeded"] == "T3"
    assert status_patch(first, done)["dashboardURL"] is None  # gone from RayJob: removed


def test_spec_change_refused_condition_names_fields():
    changed = validate_manifest(base_manifest(training={"steps": 5}, suspend=True))
    st = desired_status(changed, rayjob("Running", "RUNNING"), generation=2, previous=None, now="T")
    cond = next(c for c in st["conditions"] if c["type"] == "SpecApplied")
    assert cond["status"] == "False" and cond["reason"] == "SpecChangeRefused"
    assert cond["message"].split("changed: ")[1].startswith("spec.training.steps.")


def test_invalid_status():
    st = invalid_status(
        [Problem("spec.image", "is empty", "set it")], generation=1, previous=None, now="T"
    )
    assert st["phase"] == "Invalid"
    assert st["conditions"][0]["reason"] == "InvalidSpec"
    assert "spec.image" in st["conditions"][0]["message"]


def test_kuberay_validation_failure_is_failed_with_its_reason():
    rj = rayjob("ValidationFailed", "", reason="ValidationFailed", message="bad rayStartParams")
    st = desired_status(JOB, rj, generation=1, previous=None, now="T")
    assert st["phase"] == "Failed"
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert (failed["status"], failed["reason"], failed["message"]) == (
        "True",
        "ValidationFailed",
        "bad rayStartParams",
    )


def test_the_trainers_failure_line_is_the_failed_conditions_message():
    line = "the rollout worker could not start: data.rewardFunction: 'nope:f': cannot import"
    rj = rayjob("Failed", "FAILED", reason="AppFailed", message="Job entrypoint command failed")
    st = desired_status(JOB, rj, generation=1, previous=None, now="T", trainer_error=line)
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert (failed["status"], failed["reason"], failed["message"]) == (
        "True",
        "TrainerFailed",
        line,
    )
    # a stale error of an earlier attempt says nothing while the job runs
    running = desired_status(
        JOB, rayjob("Running", "RUNNING"), generation=1, previous=None, now="T", trainer_error=line
    )
    assert all(c["message"] != line for c in running["conditions"])


def test_invalid_edit_of_a_running_job_keeps_its_running_status():
    """Item 10: only SpecApplied turns False; phase, rayJobName, dashboardURL, gpus and
    startTime still follow the RayJob."""
    from ppojob_operator.status import invalid_edit_status

    rj = rayjob(
        "Running",
        "RUNNING",
        dashboardURL="demo-head-svc:8265",
        startTime="2026-01-01T00:00:00Z",
        rayClusterName="demo-abcde",
    )
    running = desired_status(JOB, rj, generation=1, previous=None, now="t0")
    problems = [Problem("spec.roles.actor.replicas", "must be >= 1", "set 1 or more")]
    out = invalid_edit_status(
        rj, problems, name="demo", suspend=False, generation=2, previous=running, now="t1"
    )
    for key in ("phase", "rayJobName", "dashboardURL", "gpus", "startTime", "rayClusterName"):
        assert out[key] == running[key], key
    assert out["phase"] == "Running"
    conds = {c["type"]: c for c in out["conditions"]}
    assert conds["SpecApplied"]["status"] == "False"
    assert conds["SpecApplied"]["reason"] == "InvalidSpec"
    assert "spec.roles.actor.replicas" in conds["SpecApplied"]["message"]
    assert conds["Valid"]["status"] == "True" and conds["Running"]["status"] == "True"
    assert conds["Running"]["lastTransitionTime"] == "t0"
    # and when the run ends meanwhile, the phase still follows the RayJob
    rj["status"].update(jobDeploymentStatus="Complete", jobStatus="SUCCEEDED")
    out = invalid_edit_status(
        rj, problems, name="demo", suspend=False, generation=2, previous=out, now="t2"
    )
    assert out["phase"] == "Succeeded"


def test_gang_timeout_reason_reaches_the_failed_condition():
    """Item 2: the trainer's `ppojob-train: GangIncomplete: ...` line, kept by Ray in the job's
    message, becomes the PPOJob's Failed reason."""
    msg = (
        "Job entrypoint command failed with exit code 2, last available logs:\n"
        "ppojob-train: GangIncomplete: not every pod of the job joined the Ray cluster within "
        "600s (spec.scheduling.timeoutSeconds): ppojob-actor: 2 of 4 GPUs joined (1 of 2 pods)"
    )
    rj = rayjob("Complete", "FAILED", message=msg)
    st = desired_status(JOB, rj, generation=1, previous=None, now="t")
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert st["phase"] == "Failed"
    assert failed["reason"] == "GangIncomplete"
    assert "ppojob-actor: 2 of 4 GPUs joined" in failed["message"]
    # the same reason through the trainer's status.progress.error
    err = "GangIncomplete: not every pod of the job joined the Ray cluster within 600s"
    st = desired_status(
        JOB, rayjob("Failed", "FAILED"), generation=1, previous=None, now="t", trainer_error=err
    )
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert (failed["reason"], failed["message"]) == ("GangIncomplete", err)
