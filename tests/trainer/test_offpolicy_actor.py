"""The actor's share of bounded staleness (issue 24), on one actor worker in this process (no
Ray cluster: the rollout part is handed over as an object whose ``ray.get`` is itself): the
importance weights of its settings weigh the policy loss, a token generated more versions ago
than maxStaleness is refused before any update, and a checkpoint taken with generation in flight
rewinds the data order to it."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from ppojob_api.training import TrainerConfig
from ppojob_trainer import models
from ppojob_trainer.algorithms import StalenessError
from ppojob_trainer.distributed import ShardIdentity
from ppojob_trainer.manifest import config_from_doc

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ppojob-tiny.yaml"


class _Ref:
    """A rollout part already in this process: what ``ray.get`` of its ref would return."""

    def __init__(self, value: Any) -> None:
        self.value = value


class _NoRay:
    @staticmethod
    def get(ref: Any, **_: Any) -> Any:
        return [_NoRay.get(r) for r in ref] if isinstance(ref, list) else ref.value


@pytest.fixture(autouse=True)
def _no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    from ppojob_trainer.workers import actor, handoff

    monkeypatch.setattr(actor, "ray", _NoRay)
    monkeypatch.setattr(handoff, "ray", _NoRay)


def _cfg(staleness: int) -> Any:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["roles"]["rollout"] = {"resources": {"cpus": 1}}
    doc["spec"]["algorithm"]["maxStaleness"] = staleness
    return config_from_doc(doc)


def _actor_cfg(**algo: object) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "algorithm": {"advantageEstimator": "grpo", **algo},
            "data": {"rolloutBatchSize": 3, "samplesPerPrompt": 4, "maxResponseLength": 8},
            "training": {"steps": 1, "learningRate": 1e-3, "seed": 3},
        }
    )


@pytest.fixture(scope="module")
def generated(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[TrainerConfig, object, dict[str, torch.Tensor]]:
    from ppojob_trainer.tasks import make_task
    from ppojob_trainer.workers.rollout import RolloutWorker

    mp = pytest.MonkeyPatch()
    mp.setenv("PPOJOB_CACHE_DIR", str(tmp_path_factory.mktemp("ppojob-cache")))

    cfg = _actor_cfg()
    path = models.resolve_model_path(cfg.model.path, cfg.training.seed)
    rollout = RolloutWorker(cfg, ShardIdentity("rollout"), path, "cpu")
    examples = make_task(cfg.data.prompts).sample(cfg.data.rollout_batch_size, random.Random(0))
    batch, _ = rollout.generate(examples, 0, seed=0, version=4)
    batch["scores"] = torch.arange(cfg.data.samples_per_step, dtype=torch.float32) % 3
    yield cfg, path, batch
    mp.undo()


def test_sequence_level_masked_weights_weigh_the_actor_loss(generated) -> None:
    from ppojob_trainer.workers.actor import ActorWorker

    _, path, batch = generated
    m = batch["response_mask"]
    n = m.shape[0]
    # the engine's log-probs of the odd samples 0.8 nat per token lower than the actor's
    shift = torch.where(torch.arange(n)[:, None] % 2 == 1, 0.8, 0.0) * m
    behaviour = batch["rollout_logprobs"] - shift
    skewed = dict(batch, rollout_logprobs=behaviour)
    setting = {"level": "sequence", "mode": "mask", "cap": 3.0}
    actor = ActorWorker(
        _actor_cfg(importanceSampling=setting, maxStaleness=1),
        ShardIdentity("actor"),
        path,
        "cpu",
        None,
    )
    _, metrics = actor.prepare([(0, n, _Ref(skewed))], None, None, 0.0, policy_version=5)
    # expected, sample by sample: W = exp(sum of its tokens' log-ratios), 0 above the cap
    old, adv = actor.batch["old_logprobs"], actor.batch["advantages"]
    total, tokens, capped, raw = 0.0, 0, 0, []
    for i in range(n):
        idx = [t for t in range(m.shape[1]) if m[i, t]]
        w = math.exp(sum(float(old[i, t] - behaviour[i, t]) for t in idx))
        raw += [w] * len(idx)
        capped += len(idx) if w > 3.0 else 0
        kept = w if w <= 3.0 else 0.0
        total += sum(kept * -float(adv[i, t]) for t in idx)  # ratio 1 at the first update
        tokens += len(idx)
    assert 0 < capped < tokens  # short odd samples stay under the cap, long ones do not
    assert metrics["is_capped"] == capped and metrics["is_tokens"] == tokens
    assert metrics["is_raw_sum"] == pytest.approx(sum(raw), rel=1e-5)
    assert metrics["staleness_hist_1"] == tokens  # generated as version 4, trained at 5
    out = actor.train(0)
    assert out["actor/pg_loss"] == pytest.approx(total / tokens, rel=1e-4, abs=1e-6)


def test_a_token_older_than_the_bound_is_never_trained_on(generated) -> None:
    from ppojob_trainer.workers.actor import ActorWorker

    _, path, batch = generated
    n = batch["response_mask"].shape[0]
    actor = ActorWorker(_actor_cfg(maxStaleness=1), ShardIdentity("actor"), path, "cpu", None)
    with pytest.raises(StalenessError, match="2 policy versions old"):
        actor.prepare([(0, n, _Ref(batch))], None, None, 0.0, policy_version=6)
    assert actor.batch is None  # nothing was prepared for training
    with pytest.raises(RuntimeError, match="before prepare"):
        actor.train(0)


def test_a_checkpoint_rewinds_the_data_order_to_the_generation_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Generation launched ahead is not in a checkpoint: the data order saved is the one before
    the earliest such step drew its prompts, so a resumed run draws them again."""
    import random as _random
    from types import SimpleNamespace

    from ppojob_trainer.algorithms import FixedKLController
    from ppojob_trainer.driver.rollouts import Generation, Rollouts
    from ppojob_trainer.driver.trainer import PPOTrainer
    from ppojob_trainer.tasks import make_task

    trainer = PPOTrainer.__new__(PPOTrainer)  # the driver's state only: no workers
    monkeypatch.setattr("ray.get", _NoRay.get)  # no worker process to ask for its RNG
    trainer.cfg = _cfg(2)
    task = make_task(trainer.cfg.data.prompts)
    trainer.rollouts = rollouts = Rollouts(trainer.cfg, None, task, None, None)  # type: ignore[arg-type]
    rollouts.data_rng = _random.Random(5)
    trainer.kl_ctl = FixedKLController(0.0)
    trainer.groups = SimpleNamespace(all_hosts=[])  # type: ignore[assignment]
    n = trainer.cfg.data.rollout_batch_size
    saved = []
    for step in (4, 5):  # two steps launched ahead, as maxStaleness 2 does
        saved.append(rollouts.data_rng.getstate())
        rollouts.pending[step] = Generation(step, [], [], [], (saved[-1], task.state()))
        task.sample(n, rollouts.data_rng)
    assert trainer.state(3)["data_rng"] == saved[0]
    rollouts.pending.pop(4)
    assert trainer.state(4)["data_rng"] == saved[1]
    rollouts.pending.clear()
    assert trainer.state(5)["data_rng"] == rollouts.data_rng.getstate()
