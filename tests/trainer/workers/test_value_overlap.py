"""The actor's prepare and the critic's values overlap (issue 24): the driver hands the actor
the refs of the critic's ``compute_values`` calls nested in a list, which Ray does not resolve
before the call, and the actor fetches them only after its log-probs."""

from __future__ import annotations

from typing import Any

import pytest
import ray
import torch

from ppojob_trainer.distributed import ShardIdentity
from ppojob_trainer.driver.trainer import PPOTrainer
from ppojob_trainer.workers.actor import ActorWorker
from tests.trainer.workers.test_workers import _cfg, _rollout_parts

pytestmark = pytest.mark.usefixtures("ray_session")  # conftest: loopback Ray + model cache


def test_prepare_computes_its_log_probs_before_it_fetches_nested_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ref of the critic's list of value refs is fetched after the old and reference
    log-probs, and gives the same advantages and returns, bit for bit, as the list itself."""
    cfg = _cfg(kl={"coefficient": 0.1})
    path, parts, batch = _rollout_parts(cfg)
    n, width = batch["response_ids"].shape
    values = torch.randn(n, width, generator=torch.Generator().manual_seed(2))
    inner = [ray.put(values)]
    resolved = ActorWorker(cfg, ShardIdentity("actor"), path, "cpu", None)
    resolved.prepare(parts, [inner], [(0, n)], 0.0)

    nested = ActorWorker(cfg, ShardIdentity("actor"), path, "cpu", None)
    outer = ray.put(inner)  # what the driver passes: the ref of compute_values' list
    events: list[str] = []
    logprobs = nested.trainer.logprobs

    def recording_logprobs(b: Any, **kw: Any) -> torch.Tensor:
        events.append("reference log-probs" if kw.get("reference") else "log-probs")
        return logprobs(b, **kw)

    real_get = ray.get

    def recording_get(refs: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(refs, ray.ObjectRef) and refs == outer:
            events.append("values")
        return real_get(refs, *args, **kwargs)

    monkeypatch.setattr(nested.trainer, "logprobs", recording_logprobs)
    monkeypatch.setattr(ray, "get", recording_get)
    nested.prepare(parts, [outer], [(0, n)], 0.0)
    monkeypatch.setattr(ray, "get", real_get)
    assert events == ["log-probs", "reference log-probs", "values"]
    assert torch.equal(nested.received_values, values)
    for key in ("old_logprobs", "ref_logprobs", "advantages", "returns"):
        assert torch.equal(nested.batch[key], resolved.batch[key]), key


class _Recording:
    """A worker's handle whose ``method.remote`` calls are recorded: (args, kwargs, ref)."""

    def __init__(self, handle: Any, method: str, calls: list[tuple[tuple, dict, Any]]) -> None:
        self._handle, self._method, self._calls = handle, method, calls

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._handle, name)
        if name != self._method:
            return method
        calls = self._calls

        class _Call:
            def remote(self, *args: Any, **kwargs: Any) -> Any:
                ref = method.remote(*args, **kwargs)
                calls.append((args, kwargs, ref))
                return ref

        return _Call()


@pytest.mark.slow
@pytest.mark.parametrize("apart", [True, False])
def test_the_loop_hands_prepare_a_separate_critics_calls_unresolved(apart: bool) -> None:
    """A critic in a process of its own: each step's prepare gets the refs of that step's
    compute_values calls as ``value_refs`` (a keyword, nested: Ray does not wait for them),
    and no value list among its positional arguments (which Ray would wait for). A critic in
    the actor's process (it computed the values before, in order): positional, as before."""
    trainer = PPOTrainer(_cfg(1, 1) if apart else _cfg(1))
    prepares: list[tuple[tuple, dict, Any]] = []
    values: list[tuple[tuple, dict, Any]] = []
    try:
        (actor,), (critic,) = trainer.hosts["actor"], trainer.hosts["critic"]
        assert (critic is not actor) == apart  # its own process, or the actor's
        trainer.groups.actor.handles = [_Recording(actor, "prepare", prepares)]
        trainer.groups.critic.handles = [_Recording(critic, "compute_values", values)]
        metrics = [trainer.step(step) for step in range(2)]
    finally:
        trainer.shutdown()
    assert all("critic/vf_loss" in m for m in metrics)
    assert len(prepares) == len(values) == 2
    for (args, kwargs, _), (_, _, ref) in zip(prepares, values, strict=True):
        gens = args[3 : 3 + len(args[0])]  # after ranges, critic ranges, KL coefficient
        if apart:
            assert args == (*args[:3], *gens)
            assert kwargs["value_refs"] == [ref]
        else:
            assert args == (*args[:3], *gens, ref)
            assert kwargs["value_refs"] is None
