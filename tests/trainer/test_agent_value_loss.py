"""The critic's value loss in a multi-turn step (issue 25) leaves the environment's tokens out:
driven through :meth:`CriticWorker.train`'s own loss function with a stand-in value model, on
fixed tensors. Changing the values, old values or returns at environment-token positions leaves
the loss and its gradient as they were; changing them at a model token does not."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

from ppojob_trainer.distributed import ShardIdentity
from ppojob_trainer.manifest import config_from_doc
from ppojob_trainer.workers import handoff
from ppojob_trainer.workers.critic import CriticWorker

TINY = yaml.safe_load(
    (Path(__file__).resolve().parents[2] / "examples" / "ppojob-tiny.yaml").read_text()
)

# Two samples, response width 6: [model, model, env, env, model, pad] and
# [model, env, model, model, pad, pad]; the environment's tokens are in response_mask (the
# model reads them) but not in action_mask.
RESPONSE = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
ACTION = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 1, 1, 0, 0]], dtype=torch.bool)
ENV = RESPONSE & ~ACTION
VALUES = torch.tensor([[0.1, 0.4, -0.3, 0.2, 0.5, 0.0], [0.3, 0.0, -0.2, 0.6, 0.0, 0.0]])
OLD = torch.tensor([[0.0, 0.3, -0.1, 0.1, 0.45, 0.0], [0.25, 0.1, 0.0, 0.5, 0.0, 0.0]])
RETURNS = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.5, 0.5, 0.0, 0.0]])


class _StandInValueModel:
    """The critic's trainer: its values are fixed tensors; each update records the loss and
    the gradient of the loss with respect to the values."""

    def __init__(self, values: torch.Tensor) -> None:
        self.v = values
        self.seen: list[tuple[float, torch.Tensor]] = []

    def values(self, batch: dict) -> torch.Tensor:
        return self.v.clone()

    def update(self, mb: dict, loss_fn: Any, micro: int, agg: str) -> dict[str, float]:
        assert mb["returns"].shape == self.v.shape  # one mini-batch: both rows, in order
        values = self.v.clone().requires_grad_()
        loss, metrics = loss_fn(values, mb)
        loss.backward()
        self.seen.append((float(loss.detach()), values.grad.clone()))
        return {k: float(v) for k, v in metrics.items()}


def _loss_and_grad(
    values: torch.Tensor, old: torch.Tensor, returns: torch.Tensor, monkeypatch: Any
) -> tuple[float, torch.Tensor]:
    doc = copy.deepcopy(TINY)
    doc["spec"]["algorithm"] = {"advantageEstimator": "gae", "valueClip": 0.2}
    cfg = config_from_doc(doc)
    worker = object.__new__(CriticWorker)
    worker.cfg, worker.shard, worker.group = cfg, ShardIdentity("critic"), None
    worker.settings = cfg.critic_training()
    worker.range = (0, 2)
    worker.whole = None
    worker.trainer = _StandInValueModel(values)
    worker.batch = {
        "prompt_ids": torch.ones(2, 3, dtype=torch.long),
        "prompt_mask": torch.ones(2, 3, dtype=torch.bool),
        "response_ids": torch.ones(2, 6, dtype=torch.long),
        "response_mask": RESPONSE.clone(),
        "action_mask": ACTION.clone(),
        "old_values": old,
    }
    monkeypatch.setattr(handoff, "ray", SimpleNamespace(get=lambda ref: ref))
    worker.train(1, [([returns], {})], [(0, 2)], updates=1)
    loss, grad = worker.trainer.seen[0]
    return loss, grad


def test_the_value_loss_ignores_the_environment_tokens(monkeypatch: Any) -> None:
    base_loss, base_grad = _loss_and_grad(VALUES, OLD, RETURNS, monkeypatch)
    assert base_loss > 0
    # no gradient reaches an environment token's value; every model token gets one
    assert bool((base_grad[ENV] == 0).all())
    assert bool((base_grad[ACTION] != 0).all())

    # values, old values and returns changed wildly on the environment's tokens only
    noise = torch.tensor([[0.0, 0.0, 7.0, -5.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0, 0.0, 0.0]])
    assert bool((noise[ENV] != 0).all()) and bool((noise[~ENV] == 0).all())
    loss, grad = _loss_and_grad(VALUES + noise, OLD - noise, RETURNS + 2 * noise, monkeypatch)
    assert loss == pytest.approx(base_loss, rel=1e-6)
    assert torch.allclose(grad, base_grad)


@pytest.mark.parametrize("where", [(0, 1), (1, 2)])
def test_the_value_loss_sees_the_model_tokens(where: tuple[int, int], monkeypatch: Any) -> None:
    base_loss, base_grad = _loss_and_grad(VALUES, OLD, RETURNS, monkeypatch)
    assert bool(ACTION[where])
    returns = RETURNS.clone()
    returns[where] += 3.0
    loss, grad = _loss_and_grad(VALUES, OLD, returns, monkeypatch)
    assert loss != pytest.approx(base_loss, rel=1e-3)
    assert not torch.allclose(grad, base_grad)
