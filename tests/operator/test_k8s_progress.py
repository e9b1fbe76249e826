"""KubernetesProgressReporter: throttled, always writes on finish, never raises."""

from __future__ import annotations

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
    assert steps == [0, 5, 100]
    p = api.calls[1][5]["status"]["progress"]
    assert p["rewardMean"] == 0.5 and p["totalSteps"] == 100 and p["updatedAt"]
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
