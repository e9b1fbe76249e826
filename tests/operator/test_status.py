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
        # the Ray job ended, KubeRay not done with the RayJob (seen on real pods: a job at its
        # last step showed Initializing between Running and Succeeded)
        ("Running", "SUCCEEDED", "Running"),
        ("Running", "FAILED", "Running"),
        ("Running", "STOPPED", "Running"),
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


PREEMPTED = {
    "type": "Evicted",
    "status": "True",
    "reason": "Preempted",
    "message": "Preempted to accommodate a workload (UID: u1, JobUID: j1) due to prioritization "
    "in the ClusterQueue",
}
NO_QUOTA = {
    "type": "QuotaReserved",
    "status": "False",
    "reason": "Pending",
    "message": "couldn't assign flavors to pod set actor: insufficient quota for nvidia.com/gpu",
}


@pytest.mark.parametrize("dep", ["Suspended", "Suspending", "", "New"])
def test_kueue_says_why_it_holds_the_job(dep):
    """A preemption (Evicted by Preempted), another eviction and missing quota each show as
    such with Kueue's own message; once re-admitted (Evicted reset to False) it is gone; a job
    the user suspended stays Suspended whatever its Workload says."""
    rj = rayjob(dep)
    phase, reason, msg = phase_of(rj, suspend=False, kueue=True, workload=[PREEMPTED, NO_QUOTA])
    assert (phase, reason) == ("Pending", "KueuePreempted")
    assert PREEMPTED["message"] in msg
    other = {**PREEMPTED, "reason": "PodsReadyTimeout", "message": "pods not ready in time"}
    phase, reason, msg = phase_of(rj, suspend=False, kueue=True, workload=[other])
    assert (phase, reason) == ("Pending", "KueueEvicted") and "PodsReadyTimeout" in msg
    phase, reason, msg = phase_of(rj, suspend=False, kueue=True, workload=[NO_QUOTA])
    assert (phase, reason) == ("Pending", "WaitingForAdmission") and "insufficient quota" in msg
    readmitted = {**PREEMPTED, "status": "False", "reason": "QuotaReserved"}
    assert phase_of(rj, suspend=False, kueue=True, workload=[readmitted])[1] == (
        "WaitingForAdmission"
    )
    if dep.startswith("Suspend"):
        assert phase_of(rj, suspend=True, kueue=True, workload=[PREEMPTED])[0] == "Suspended"


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


# --- note_status: a valid job with no RayJob to follow (refused, waiting, held, RayJob lost)
GPU_JOB = validate_manifest(base_manifest(roles={"actor": {"resources": {"gpus": 2}}}))


def _conds(st):
    return {c["type"]: c for c in st["conditions"]}


def test_note_status_of_a_refused_job():
    from ppojob_operator.status import CONDITION_TYPES, note_status

    st = note_status(
        GPU_JOB,
        "Failed",
        "SchedulerMissing",
        "no volcano here",
        generation=4,
        previous=None,
        now="T",
    )
    assert [c["type"] for c in st["conditions"]] == list(CONDITION_TYPES)
    conds = _conds(st)
    assert {t: (c["status"], c["reason"], c["message"]) for t, c in conds.items()} == {
        "Valid": ("True", "SpecValid", "the spec is valid"),
        "SpecApplied": ("False", "SchedulerMissing", "no volcano here"),
        "Running": ("False", "Failed", ""),
        "Succeeded": ("False", "Failed", ""),
        "Failed": ("True", "SchedulerMissing", "no volcano here"),
        "Suspended": ("False", "Failed", ""),
    }
    assert all(
        c["observedGeneration"] == 4 and c["lastTransitionTime"] == "T" for c in conds.values()
    )
    assert (st["phase"], st["observedGeneration"], st["gpus"]) == ("Failed", 4, 2)
    assert st["reason"] == "SchedulerMissing"  # the Reason column
    assert st["completionTime"] == "T"  # a failure ends the job now
    assert set(st) == {
        "phase",
        "reason",
        "conditions",
        "observedGeneration",
        "gpus",
        "memoryPlan",
        "completionTime",
    }


def test_note_status_keeps_what_is_known_of_the_children():
    from ppojob_operator.status import note_status

    running = desired_status(
        JOB,
        rayjob(
            "Running", "RUNNING", rayClusterName="demo-x", startTime="t0", dashboardURL="d:8265"
        ),
        generation=1,
        previous=None,
        now="t0",
    )
    running["dashboardURL"] = ""  # a key without a value is not kept
    st = note_status(
        JOB, "Pending", "WaitingForName", "waiting", generation=2, previous=running, now="t1"
    )
    assert st["phase"] == "Pending"
    assert (st["rayJobName"], st["rayClusterName"], st["startTime"]) == ("demo", "demo-x", "t0")
    assert "dashboardURL" not in st and "completionTime" not in st  # Pending: not ended
    conds = _conds(st)
    assert conds["Valid"]["lastTransitionTime"] == "t0"  # still True since t0
    assert conds["Running"]["lastTransitionTime"] == "t1"  # was True, now False
    assert conds["Running"]["reason"] == "Pending"
    assert conds["Failed"]["status"] == "False" and conds["Suspended"]["status"] == "False"
    # the RayJob deleted mid-run: Failed, and the time the job ended is kept once set
    lost = note_status(JOB, "Failed", "RayJobLost", "gone", generation=2, previous=st, now="t2")
    assert lost["completionTime"] == "t2"
    again = note_status(JOB, "Failed", "RayJobLost", "gone", generation=2, previous=lost, now="t3")
    assert again["completionTime"] == "t2"
    assert _conds(again)["Failed"]["lastTransitionTime"] == "t2"


def test_note_status_of_a_held_job_without_a_generation():
    from ppojob_operator.status import note_status

    st = note_status(
        JOB, "Suspended", "Held", "held by Kueue", generation=None, previous={}, now="T"
    )
    conds = _conds(st)
    assert (conds["Suspended"]["status"], conds["Suspended"]["reason"]) == ("True", "Held")
    assert conds["Suspended"]["message"] == "held by Kueue"
    assert conds["Failed"]["reason"] == "Suspended" and conds["Failed"]["status"] == "False"
    assert all("observedGeneration" not in c for c in st["conditions"])
    assert st["observedGeneration"] is None and "completionTime" not in st


# --- the whole condition table of each phase (the module docstring's mapping)
SUSPENDED_JOB = validate_manifest(base_manifest(suspend=True))


def _table(st, generation=7, now="T"):
    assert [c["type"] for c in st["conditions"]] == [
        "Valid",
        "SpecApplied",
        "Running",
        "Succeeded",
        "Failed",
        "Suspended",
    ]
    for c in st["conditions"]:
        assert (c["observedGeneration"], c["lastTransitionTime"]) == (generation, now), c
    return {c["type"]: (c["status"], c["reason"], c["message"]) for c in st["conditions"]}


VALID = ("True", "SpecValid", "the spec is valid")
APPLIED = ("True", "SpecApplied", "the RayJob matches the spec")


def _off(phase):
    return ("False", phase, "")


@pytest.mark.parametrize(
    ("job", "dep", "js", "running", "on"),
    [
        (JOB, "Running", "RUNNING", ("True", "RayJobRunning", "the trainer is running"), None),
        (
            JOB,
            "Complete",
            "SUCCEEDED",
            _off("Succeeded"),
            ("Succeeded", "RayJobSucceeded", "the Ray job succeeded"),
        ),
        (
            JOB,
            "Complete",
            "STOPPED",
            _off("Failed"),
            ("Failed", "RayJobStopped", "jobStatus STOPPED"),
        ),
        (JOB, "Complete", "", _off("Failed"), ("Failed", "RayJobFailed", "jobStatus ")),
        (JOB, "Failed", "", _off("Failed"), ("Failed", "RayJobFailed", "the RayJob failed")),
        (
            JOB,
            "ValidationFailed",
            "",
            _off("Failed"),
            ("Failed", "ValidationFailed", "KubeRay rejected the RayJob (see its events)"),
        ),
        (
            JOB,
            "Running",
            "",
            ("False", "Submitting", "the Ray cluster is up; job status unset"),
            None,
        ),
        (
            JOB,
            "Retrying",
            "",
            ("False", "RayJobRetrying", "retrying with a new Ray cluster"),
            None,
        ),
        (
            JOB,
            "Initializing",
            "",
            ("False", "RayJobInitializing", "starting the Ray cluster"),
            None,
        ),
        (JOB, "", "", ("False", "RayJobCreated", "waiting for KubeRay"), None),
        (
            SUSPENDED_JOB,
            "",
            "",
            _off("Suspended"),
            ("Suspended", "Suspended", "the job is suspended (spec.suspend)"),
        ),
        (
            JOB,
            "Suspended",
            "",
            _off("Suspended"),
            ("Suspended", "RayJobSuspended", "the job is suspended (spec.suspend)"),
        ),
        (
            JOB,
            "Exploding",
            "",
            ("False", "UnknownDeploymentStatus", "RayJob jobDeploymentStatus 'Exploding'"),
            None,
        ),
    ],
)
def test_conditions_of_each_phase(job, dep, js, running, on):
    """Each RayJob state gives all six conditions: the phase's own True with the reason and
    message (RayJob's own when it gives some, else the operator's words), the others False
    with the phase as their reason and no message."""
    st = desired_status(job, rayjob(dep, js), generation=7, previous=None, now="T")
    table = _table(st)
    phase = (
        on[0]
        if on
        else {"RayJobRunning": "Running", "RayJobCreated": "Pending"}.get(
            running[1], "Pending" if dep == "Exploding" else "Initializing"
        )
    )
    assert st["phase"] == phase
    expected = {"Valid": VALID, "SpecApplied": APPLIED, "Running": running}
    for kind in ("Succeeded", "Failed", "Suspended"):
        expected[kind] = ("True", on[1], on[2]) if on and on[0] == kind else _off(phase)
    assert table == expected


def test_rayjob_reason_and_message_win_over_the_operators_words():
    rj = rayjob("Complete", "SUCCEEDED", message="done in 3 steps")
    assert phase_of(rj, suspend=False, kueue=False) == (
        "Succeeded",
        "RayJobSucceeded",
        "done in 3 steps",
    )
    rj = rayjob("ValidationFailed", "", reason="BadSpec", message="no head group")
    assert phase_of(rj, suspend=False, kueue=False) == ("Failed", "BadSpec", "no head group")
    rj = rayjob("Complete", "FAILED", reason="AppFailed")
    assert phase_of(rj, suspend=False, kueue=False) == ("Failed", "AppFailed", "jobStatus FAILED")


def test_a_rayjob_without_its_applied_spec_counts_as_applied():
    """A RayJob that lost (or never had) its applied-spec annotation refuses nothing."""
    rj = rayjob("Running", "RUNNING")
    del rj["metadata"]["annotations"]
    st = desired_status(JOB, rj, generation=7, previous=None, now="T")
    assert _table(st)["SpecApplied"] == APPLIED
    # a RayJob object seen without metadata at all: no name to report
    st = desired_status(JOB, {"status": rj["status"]}, generation=7, previous=None, now="T")
    assert st["rayJobName"] is None and _table(st)["SpecApplied"] == APPLIED


def test_spec_change_refused_lists_at_most_twenty_fields():
    import json

    from ppojob_operator.builders import APPLIED_SPEC_ANNOTATION

    rj = rayjob("Running", "RUNNING")
    applied = json.loads(rj["metadata"]["annotations"][APPLIED_SPEC_ANNOTATION])
    assert applied["roles"]["actor"]["nodeSelector"] == {}
    applied["roles"]["actor"]["nodeSelector"] = {f"k{i:02d}": "x" for i in range(25)}
    rj["metadata"]["annotations"][APPLIED_SPEC_ANNOTATION] = json.dumps(applied)
    st = desired_status(JOB, rj, generation=7, previous=None, now="T")
    status, reason, message = _table(st)["SpecApplied"]
    assert (status, reason) == ("False", "SpecChangeRefused")
    listed = message.split("changed: ")[1].split(". Revert")[0].split(", ")
    assert listed == [f"spec.roles.actor.nodeSelector.k{i:02d}" for i in range(20)]
    assert message.endswith(". Revert them, or delete and recreate the job")


def test_changed_fields():
    from ppojob_operator.status import changed_fields

    assert changed_fields({"a": 1, "b": {"c": 1}}, {"a": 1, "b": {"c": 2}, "d": 3}) == [
        "spec.b.c",
        "spec.d",
    ]
    assert changed_fields({"a": 1}, None) == ["spec"]
    assert changed_fields({"a": {"b": 1}}, {"a": 2}) == ["spec.a"]
    # suspend may change, at the top of the spec only; the keys after it are still compared
    assert changed_fields(
        {"suspend": True, "training": 1, "x": {"suspend": 1}},
        {"suspend": False, "training": 2, "x": {"suspend": 2}},
    ) == ["spec.training", "spec.x.suspend"]


def test_invalid_status_conditions_and_times():
    problems = [Problem("spec.image", "is empty", "set it"), Problem("spec.x", "unknown field")]
    first = invalid_status(problems, generation=3, previous=None, now="T1")
    assert first["phase"] == "Invalid" and first["observedGeneration"] == 3
    assert [
        (c["type"], c["status"], c["reason"], c["observedGeneration"], c["lastTransitionTime"])
        for c in first["conditions"]
    ] == [(t, "False", "InvalidSpec", 3, "T1") for t in CONDITION_TYPES_ORDER]
    assert (
        first["conditions"][0]["message"]
        == "spec.image: is empty (fix: set it); spec.x: unknown field"
    )
    assert all(c["message"] == "" for c in first["conditions"][1:])
    # still invalid later: the transition times stay; from a running job's status they move
    again = invalid_status(problems, generation=4, previous=first, now="T2")
    assert {c["lastTransitionTime"] for c in again["conditions"]} == {"T1"}
    running = desired_status(
        JOB, rayjob("Running", "RUNNING"), generation=1, previous=None, now="T0"
    )
    broken = invalid_status(problems, generation=2, previous=running, now="T3")
    times = {c["type"]: c["lastTransitionTime"] for c in broken["conditions"]}
    assert times == {
        "Valid": "T3",
        "SpecApplied": "T3",
        "Running": "T3",
        "Succeeded": "T0",
        "Failed": "T0",
        "Suspended": "T0",
    }


CONDITION_TYPES_ORDER = ("Valid", "SpecApplied", "Running", "Succeeded", "Failed", "Suspended")


def test_transition_time_of_a_condition_stored_without_one_is_now():
    prev = desired_status(JOB, rayjob("Running", "RUNNING"), generation=1, previous=None, now="T0")
    for c in prev["conditions"]:
        del c["lastTransitionTime"]
    st = desired_status(JOB, rayjob("Running", "RUNNING"), generation=1, previous=prev, now="T1")
    assert {c["lastTransitionTime"] for c in st["conditions"]} == {"T1"}


def test_status_patch_sets_changed_values():
    current = {"phase": "Running", "gpus": 2, "dashboardURL": "d"}
    desired = {"phase": "Succeeded", "gpus": 2, "completionTime": "t"}
    assert status_patch(current, desired) == {
        "phase": "Succeeded",
        "completionTime": "t",
        "dashboardURL": None,
    }
    assert status_patch(None, {"phase": "Pending"})["phase"] == "Pending"


def test_applied_job_is_named_and_reads_the_annotation():
    from ppojob_operator.status import applied_job

    rj = rayjob("Running", "RUNNING")
    job = applied_job(rj, "demo")
    assert job is not None and job.metadata.name == "demo"
    assert job.spec == JOB.spec
    del rj["metadata"]["annotations"]
    assert applied_job(rj, "demo") is None


def test_invalid_edit_status_keeps_generation_times_and_the_scheduler():
    from ppojob_operator.status import invalid_edit_status

    problems = [Problem("spec.image", "is empty", "set it")]
    running = desired_status(
        JOB, rayjob("Running", "RUNNING"), generation=1, previous=None, now="t0"
    )
    out = invalid_edit_status(
        rayjob("Running", "RUNNING"),
        problems,
        name="demo",
        suspend=False,
        generation=2,
        previous=running,
        now="t1",
    )
    assert out["observedGeneration"] == 2
    assert all(c["observedGeneration"] == 2 for c in out["conditions"])
    times = {c["type"]: c["lastTransitionTime"] for c in out["conditions"]}
    assert times["SpecApplied"] == "t1" and times["Running"] == "t0"
    spec_applied = next(c for c in out["conditions"] if c["type"] == "SpecApplied")
    assert spec_applied["message"] == (
        "the new spec is invalid; the running RayJob is unchanged: "
        "spec.image: is empty (fix: set it)"
    )
    # under Kueue, a suspended RayJob of an unsuspended job waits for admission
    held = invalid_edit_status(
        rayjob("Suspended"),
        problems,
        name="demo",
        suspend=False,
        generation=2,
        previous=None,
        now="t1",
        scheduler="kueue",
    )
    assert held["phase"] == "Pending"
    no_kueue = invalid_edit_status(
        rayjob("Suspended"),
        problems,
        name="demo",
        suspend=False,
        generation=2,
        previous=None,
        now="t1",
    )
    assert no_kueue["phase"] == "Suspended"


@pytest.mark.parametrize(
    ("dep", "reason"),
    [("New", "RayJobCreated"), ("", "RayJobCreated"), ("Waiting", "RayJobWaiting")],
)
def test_new_and_waiting_rayjobs(dep, reason):
    phase, got, _ = phase_of(rayjob(dep), suspend=False, kueue=False)
    assert (phase, got) == ("Pending" if reason == "RayJobCreated" else "Initializing", reason)


def test_a_finished_job_has_the_rayjobs_end_time():
    for dep, js in (("Complete", "SUCCEEDED"), ("Complete", "FAILED"), ("Failed", "")):
        st = desired_status(
            JOB, rayjob(dep, js, endTime="t9"), generation=1, previous=None, now="T"
        )
        assert st["completionTime"] == "t9", (dep, js)
    running = desired_status(
        JOB, rayjob("Running", "RUNNING", endTime="t9"), generation=1, previous=None, now="T"
    )
    assert "completionTime" not in running


def test_invalid_edit_lists_every_problem():
    from ppojob_operator.status import invalid_edit_status

    problems = [Problem("spec.a", "bad"), Problem("spec.b", "worse")]
    out = invalid_edit_status(
        rayjob("Running", "RUNNING"),
        problems,
        name="demo",
        suspend=False,
        generation=2,
        previous=None,
        now="t",
    )
    cond = next(c for c in out["conditions"] if c["type"] == "SpecApplied")
    assert cond["message"].endswith("unchanged: spec.a: bad; spec.b: worse")


def test_the_status_carries_the_memory_plan():
    """status.memoryPlan: the per-GPU peak, the colocated engine's fraction and where it came
    from, written with the operator's other keys on every status it computes."""
    from ppojob_api import memory_plan as M
    from ppojob_operator.status import OPERATOR_KEYS, note_status
    from tests.helpers.manifests import memory_base

    job = validate_manifest(memory_base())
    rj = builders.build_children(job, namespace="ns1")[-1]
    rj["status"] = {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}
    st = desired_status(job, rj, generation=1, previous=None, now="t")
    assert "memoryPlan" in OPERATOR_KEYS
    assert st["memoryPlan"] == M.memory_status(job.spec)
    assert st["memoryPlan"]["engineFractionSource"] == "auto"
    noted = note_status(job, "Pending", "Waiting", "", generation=1, previous=None, now="t")
    assert noted["memoryPlan"] == st["memoryPlan"]


def test_the_trainers_warning_line_gives_the_events_reason() -> None:
    from ppojob_operator.sync import trainer_warning

    assert trainer_warning("GracePeriodTooShort: raise it") == ("GracePeriodTooShort", "raise it")
    assert trainer_warning("no reason: here") == ("TrainerWarning", "no reason: here")
    assert trainer_warning("plain") == ("TrainerWarning", "plain")
