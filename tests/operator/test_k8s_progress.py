"""KubernetesProgressReporter: throttled, always writes on finish, never raises."""

from __future__ import annotations

import pytest

from ppojob_trainer.k8s_progress import KubernetesProgressReporter


class FakeApi:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    def patch_namespaced_custom_object_status(self, group, version, ns, plural, name, body):
        if self.fail:
            raise RuntimeError("API down")
        self.calls.append((group, version, ns, plural, name, body))


def test_throttles_and_writes_on_finish():
    t = [0.0]
    api = FakeApi()
    rep = KubernetesProgressReporter("j", "ns", api=api, min_interval=5, clock=lambda: t[0])
    rep.start(total_steps=100)
    for step in range(1, 10):
        t[0] += 1
        rep.report(
            step,
            {
                "step": step,
                "reward_mean": step / 10,
                "kl": 0.1,
                "value_loss": 1.0,
                "tokens_per_second": 10.0,
            },
        )
    rep.finish({"step": 100, "reward_mean": 1.0})
    steps = [c[5]["status"]["progress"].get("step") for c in api.calls]
    # start, the first report (even within min_interval of the start), then one per 5 s, finish
    assert steps == [0, 1, 6, 100]
    p = api.calls[1][5]["status"]["progress"]
    assert p["rewardMean"] == 0.1 and p["totalSteps"] == 100 and p["updatedAt"]
    assert api.calls[0][:5] == ("ppojob.io", "v1alpha1", "ns", "ppojobs", "j")


def test_api_errors_never_raise(monkeypatch):
    rep = KubernetesProgressReporter("j", "ns", api=FakeApi(fail=True))
    rep.start(10)
    rep.report(1, {"reward_mean": float("nan")})
    rep.finish({})
    assert rep.failures == 3


def test_from_env(monkeypatch):
    monkeypatch.delenv("PPOJOB_NAME", raising=False)
    assert KubernetesProgressReporter.from_env() is None
    monkeypatch.setenv("PPOJOB_NAME", "j")
    monkeypatch.setenv("PPOJOB_NAMESPACE", "ns")
    rep = KubernetesProgressReporter.from_env()
    assert rep is not None and (rep.name, rep.namespace) == ("j", "ns")


def test_the_loops_own_metric_names_reach_the_status():
    """The loop sends `reward/mean`, `kl/mean`, ...; the status gets rewardMean, kl, ... (and the
    loop's summary calls the final reward `final_reward`)."""
    api = FakeApi()
    rep = KubernetesProgressReporter("j", "ns", api=api, min_interval=0)
    rep.start(total_steps=2)
    rep.report(
        1,
        {
            "reward/mean": 0.25,
            "kl/mean": 0.5,
            "critic/vf_loss": 2.0,
            "time/tokens_per_second": 99.0,
            "actor/pg_loss": 1.0,
        },
    )
    rep.finish({"steps": 2, "final_reward": 0.75, "wall_s": 3.0})
    p1 = api.calls[1][5]["status"]["progress"]
    assert (p1["rewardMean"], p1["kl"], p1["valueLoss"], p1["tokensPerSecond"]) == (
        0.25,
        0.5,
        2.0,
        99.0,
    )
    p2 = api.calls[2][5]["status"]["progress"]
    assert p2["rewardMean"] == 0.75 and p2["step"] == 2


@pytest.mark.parametrize(
    ("call", "key", "line"),
    [
        ("fail", "error", "the rollout worker could not start: data.rewardFunction: 'nope:f'"),
        ("warn", "warning", "GracePeriodTooShort: spec.failurePolicy.terminationGracePeriod..."),
    ],
)
def test_a_failure_or_warning_is_written_for_the_operator_and_cleared_by_the_next_start(
    call: str, key: str, line: str
) -> None:
    api = FakeApi()
    rep = KubernetesProgressReporter("j", "ns", api=api)
    getattr(rep, call)(line)
    assert api.calls[-1][5]["status"]["progress"][key] == line
    rep.start(total_steps=3)
    assert api.calls[-1][5]["status"]["progress"][key] is None


def test_phase_times_mismatch_and_entropy_reach_the_status():
    """time/<phase>, the step time, the log-prob mismatch and the entropy go into status.progress
    (the operator exports them as Prometheus metrics); a phase the step did not run is cleared
    (null in the merge patch), not left over from an earlier step."""
    api = FakeApi()
    rep = KubernetesProgressReporter("j", "ns", api=api, min_interval=0)
    rep.start(total_steps=2)
    rep.report(
        1,
        {
            "reward/mean": 0.5,
            "time/step": 2.5,
            "time/generate": 1.0,
            "time/train_actor": 0.75,
            "time/weight_sync": 0.125,
            "rollout/logprob_diff_mean": 0.01,
            "rollout/logprob_diff_max": 0.5,
            "actor/entropy": 1.5,
        },
    )
    p = api.calls[1][5]["status"]["progress"]
    assert (p["stepSeconds"], p["logprobDiffMean"], p["logprobDiffMax"], p["entropy"]) == (
        2.5,
        0.01,
        0.5,
        1.5,
    )
    assert p["phaseSeconds"] == {
        "generate": 1.0,
        "prepare": None,
        "values": None,
        "trainCritic": None,
        "trainActor": 0.75,
        "weightSync": 0.125,
    }
    rep.report(2, {"reward/mean": 0.5})
    assert "phaseSeconds" not in api.calls[2][5]["status"]["progress"]


def test_kept_checkpoints_reach_the_status():
    api = FakeApi()
    rep = KubernetesProgressReporter("j", "ns", api=api, min_interval=3600)
    rep.start(total_steps=4)
    rep.report(1, {"reward/mean": 0.5})
    rep.checkpointed([(2, "/ckpt/step-000002"), (4, "/ckpt/step-000004")])  # never throttled
    assert api.calls[-1][5]["status"]["progress"]["checkpoints"] == [
        {"step": 2, "path": "/ckpt/step-000002"},
        {"step": 4, "path": "/ckpt/step-000004"},
    ]


def test_weight_version_and_staleness_reach_the_status():
    """Issue 40 (weight sync as a subsystem): the version the engines reported after the
    step's sync (`weights/version`), the oldest version the step's samples were generated with
    (`rollout/version`, whole numbers) and the rollout staleness go into status.progress."""
    api = FakeApi()
    rep = KubernetesProgressReporter("j", "ns", api=api, min_interval=0)
    rep.start(total_steps=3)
    rep.report(
        2,
        {
            "weights/version": 3.0,
            "rollout/version": 2.0,
            "staleness/mean": 0.75,
            "staleness/max": 1.0,
        },
    )
    p = api.calls[1][5]["status"]["progress"]
    assert (p["weightVersion"], p["rolloutVersion"]) == (3, 2)
    assert isinstance(p["weightVersion"], int) and isinstance(p["rolloutVersion"], int)
    assert (p["stalenessMean"], p["stalenessMax"]) == (0.75, 1.0)
