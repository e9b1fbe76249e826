"""Failure classes and the restart decision (ppojob_api.failures), by tables."""

from __future__ import annotations

import pytest

from ppojob_api.failures import PREEMPTED_EXIT_CODE, classify, decide, grace_problem

CLASSES = [
    # the trainer's own lines (status.progress.error, or its last log line in the RayJob message)
    (
        "Preempted: SIGTERM: finished the step in flight; 3 completed steps are in ...",
        None,
        "Disruption",
    ),
    (
        "Job entrypoint command failed with exit code 75, last available logs ...",
        None,
        "Disruption",
    ),
    ("anything", PREEMPTED_EXIT_CODE, "Disruption"),
    # KubeRay's messages (rayjob_controller.go, v1.5/v1.6)
    ("AppFailed: Ray head pod not found.", None, "Disruption"),
    (
        "The node was low on resource: memory. Container ray-worker was using 9Gi",
        None,
        "Disruption",
    ),
    ("Pod was evicted: The node had condition: [DiskPressure]", None, "Disruption"),
    (
        "a Ray worker died: The actor died because its node has died. Node Id: 1f2e",
        None,
        "Disruption",
    ),
    ("DisruptionTarget: PreemptionByScheduler", None, "Disruption"),
    (
        "Stalled: no step progress for 1800s: actor rank 1 (train) did not report",
        None,
        "Disruption",
    ),
    # application errors count
    (
        "training failed: ValueError: reward function returned 3 scores for 4 samples",
        None,
        "Application",
    ),
    ("a Ray worker died: OOMKilled", None, "Application"),
    # the submitter's `ray job submit` exits 1 whether the Ray job failed or it could not
    # submit: never the trainer's exit code 1 (a refused config)
    (
        "SubmissionFailed: Ray head pod container ray-job-submitter terminated with exit code "
        "1: Error",
        None,
        "Application",
    ),
    (
        "SubmissionFailed: Ray head pod container submitter terminated with exit code 2: Error",
        None,
        "Application",
    ),
    (
        "Job entrypoint command failed with exit code 2, last available logs ...",
        None,
        "Application",
    ),
    # never retried
    ("InvalidConfig: spec.training.steps: must be >= 1", None, "Permanent"),
    ("Job entrypoint command failed with exit code 1", None, "Permanent"),
    ("anything", 1, "Permanent"),
    (
        "the rollout worker could not start: data.rewardFunction: 'x:f': cannot import",
        None,
        "Permanent",
    ),
    ("GangIncomplete: 2 of 4 actor pods joined", None, "Permanent"),
    ("DeadlineExceeded: the RayJob ran past activeDeadlineSeconds", None, "Permanent"),
]


@pytest.mark.parametrize(("message", "code", "expected"), CLASSES)
def test_classify(message: str, code: int | None, expected: str) -> None:
    assert classify(message, exit_code=code) == expected


POLICY = dict(max_disruptions=2, on_application_error="Restart", retry_delay_seconds=30)

DECISIONS = [
    # (class, backoffLimit, counted, disruptions so far, policy changes)
    # -> action, reason, delay, counts
    ("Disruption", 0, 0, 0, {}, "Restart", "RestartingAfterDisruption", 0, False),
    ("Disruption", 0, 0, 1, {}, "Restart", "RestartingAfterDisruption", 0, False),
    ("Disruption", 0, 0, 2, {}, "Fail", "DisruptionLimitExceeded", 0, False),
    ("Disruption", 3, 3, 0, {}, "Restart", "RestartingAfterDisruption", 0, False),
    ("Disruption", 3, 0, 0, {"max_disruptions": 0}, "Fail", "DisruptionLimitExceeded", 0, False),
    ("Application", 0, 0, 0, {}, "Fail", "BackoffLimitExceeded", 0, False),
    ("Application", 2, 0, 5, {}, "Restart", "RestartingAfterError", 30, True),
    ("Application", 2, 1, 0, {}, "Restart", "RestartingAfterError", 30, True),
    ("Application", 2, 2, 0, {}, "Fail", "BackoffLimitExceeded", 0, False),
    (
        "Application",
        2,
        0,
        0,
        {"on_application_error": "Fail"},
        "Fail",
        "ApplicationError",
        0,
        False,
    ),
    ("Permanent", 5, 0, 0, {}, "Fail", "PermanentFailure", 0, False),
]


@pytest.mark.parametrize(
    ("klass", "limit", "counted", "disrupted", "changes", "action", "reason", "delay", "counts"),
    DECISIONS,
)
def test_decide(klass, limit, counted, disrupted, changes, action, reason, delay, counts) -> None:
    d = decide(
        klass,
        "the cause",
        backoff_limit=limit,
        counted_restarts=counted,
        disruption_restarts=disrupted,
        resumable=True,
        **{**POLICY, **changes},
    )
    assert (d.action, d.reason, d.delay_seconds, d.counts) == (action, reason, delay, counts)
    assert "the cause" in d.message


def test_a_restart_without_a_checkpoint_volume_says_it_starts_over() -> None:
    args = dict(backoff_limit=0, counted_restarts=0, disruption_restarts=0, **POLICY)
    assert "newest checkpoint" in decide("Disruption", "x", resumable=True, **args).message
    assert "step 0" in decide("Disruption", "x", resumable=False, **args).message


@pytest.mark.parametrize(
    ("grace", "step", "ckpt", "ok"),
    [
        (120, 30.0, 10.0, True),
        (48, 30.0, 10.0, True),
        (47, 30.0, 10.0, False),
        (5, 1.0, 4.5, False),
    ],
)
def test_grace_period_against_step_and_checkpoint_cost(grace, step, ckpt, ok) -> None:
    problem = grace_problem(grace, step, ckpt)
    assert (problem is None) == ok
    if problem:
        assert "terminationGracePeriodSeconds" in problem and "raise it to at least" in problem


def test_every_decision_reason_is_documented() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md").read_text()
    reasons = {row[6] for row in DECISIONS} | {"Preempted"}
    assert len(reasons) == 7
    assert [r for r in sorted(reasons) if f"`{r}`" not in text] == []
