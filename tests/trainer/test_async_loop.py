"""Bounded staleness (issue 24) on a local Ray (one session for the module).

End to end with the tiny example: maxStaleness 0 reproduces the synchronous loop bit for bit,
and with 1 the engines generate the next step while the actor trains, every token tagged with
the version that generated it. On one actor worker: the importance weights of its settings
weigh the policy loss, and a token generated more versions ago than maxStaleness is refused
before any update."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
import yaml

from ppojob_api.training import TrainerConfig
from ppojob_trainer import loop, models
from ppojob_trainer.algorithms import StalenessError
from ppojob_trainer.backends.base import ShardIdentity
from ppojob_trainer.loop import train
from ppojob_trainer.manifest import config_from_doc
from tests.helpers.sync_step import SynchronousTrainer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ppojob-tiny.yaml"
STEPS = 3

pytestmark = pytest.mark.usefixtures("ray_session")  # conftest: loopback Ray + model cache


class _Quiet:
    def start(self, total: int, start_step: int = 0) -> None:
        pass

    def report(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def finish(self, summary: dict[str, Any]) -> None:
        pass


def _cfg(staleness: int | None, own_engine: bool) -> Any:
    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = doc["spec"]
    spec["training"].update(steps=STEPS, checkpointInterval=0)
    if own_engine:  # actor and engine on one core each
        spec["roles"]["actor"]["resources"]["cpus"] = 1
        spec["roles"]["rollout"] = {"resources": {"cpus": 1}}
    if staleness is not None:
        spec["algorithm"]["maxStaleness"] = staleness
    return config_from_doc(doc)


def test_staleness_zero_reproduces_the_synchronous_loop_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example as `ppojob run` runs it (staleness 0, its default) against the step as it
    was before staleness existed (tests/helpers/sync_step.py), same seed: every loss, reward
    and statistic is the same float."""
    cfg = _cfg(0, own_engine=False)
    new = train(cfg, tmp_path / "new", _Quiet())
    monkeypatch.setattr(loop, "PPOTrainer", SynchronousTrainer)
    old = train(cfg, tmp_path / "old", _Quiet())
    assert len(new.history) == len(old.history) == STEPS
    keys = [
        "reward/mean",
        "response/length",
        "advantage/abs_mean",
        "rollout/logprob_diff_mean",
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/grad_norm",
        "actor/entropy",
        "critic/vf_loss",
    ]
    for key in keys:
        assert [m[key] for m in new.history] == [m[key] for m in old.history], key
    assert [m["staleness/max"] for m in new.history] == [0.0] * STEPS


def test_staleness_one_overlaps_generation_with_training_within_the_bound(
    tmp_path: Path,
) -> None:
    result = train(_cfg(1, own_engine=True), tmp_path / "async", _Quiet())
    h = result.history
    assert [m["policy/version"] for m in h] == [0.0, 1.0, 2.0]
    # step 0's samples come from the initial weights, every later step's from one version
    # before the actor's (generated while the actor trained the step before)
    assert [m["staleness/max"] for m in h] == [0.0, 1.0, 1.0]
    assert [m["staleness/mean"] for m in h] == [0.0, 1.0, 1.0]
    assert [m["staleness/share_1"] for m in h] == [0.0, 1.0, 1.0]
    # the engine generated step k+1 during step k's training (not after it)
    assert max(m["time/overlap_share"] for m in h[:-1]) > 0


# --- one actor worker: the correction and the bound it is configured with --------------------


def _actor_cfg(**algo: object) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "algorithm": {"advantageEstimator": "grpo", **algo},
            "data": {"rolloutBatchSize": 3, "samplesPerPrompt": 4, "maxResponseLength": 8},
            "training": {"steps": 1, "learningRate": 1e-3, "seed": 3},
        }
    )


@pytest.fixture(scope="module")
def generated(ray_session: None) -> tuple[TrainerConfig, object, dict[str, torch.Tensor]]:
    from ppojob_trainer.tasks import make_task
    from ppojob_trainer.workers.rollout import RolloutWorker

    cfg = _actor_cfg()
    path = models.resolve_model_path(cfg.model.path, cfg.training.seed)
    rollout = RolloutWorker(cfg, ShardIdentity("rollout"), path, "cpu")
    examples = make_task(cfg.data.prompts).sample(cfg.data.rollout_batch_size, random.Random(0))
    batch, _ = rollout.generate(examples, 0, seed=0, version=4)
    batch["scores"] = torch.arange(cfg.data.samples_per_step, dtype=torch.float32) % 3
    return cfg, path, batch


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
    _, metrics = actor.prepare([(0, n, ray.put(skewed))], None, None, 0.0, policy_version=5)
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
        actor.prepare([(0, n, ray.put(batch))], None, None, 0.0, policy_version=6)
    assert actor.batch is None  # nothing was prepared for training
    with pytest.raises(RuntimeError, match="before prepare"):
        actor.train(0)


def test_a_checkpoint_rewinds_the_data_order_to_the_generation_in_flight() -> None:
    """Generation launched ahead is not in a checkpoint: the data order saved is the one before
    the earliest such step drew its prompts, so a resumed run draws them again."""
    import random as _random

    from ppojob_trainer.algorithms import FixedKLController
    from ppojob_trainer.loop import PPOTrainer, _Generation
    from ppojob_trainer.tasks import make_task

    trainer = PPOTrainer.__new__(PPOTrainer)  # the driver's state only: no workers
    trainer.cfg = _cfg(2, own_engine=True)
    trainer.data_rng = _random.Random(5)
    trainer.task = make_task(trainer.cfg.data.prompts)
    trainer.kl_ctl = FixedKLController(0.0)
    trainer.all_hosts = []
    trainer.pending = {}
    n = trainer.cfg.data.rollout_batch_size
    saved = []
    for step in (4, 5):  # two steps launched ahead, as maxStaleness 2 does
        saved.append(trainer.data_rng.getstate())
        trainer.pending[step] = _Generation(step, [], [], [], (saved[-1], trainer.task.state()))
        trainer.task.sample(n, trainer.data_rng)
    assert trainer.state(3)["data_rng"] == saved[0]
    trainer.pending.pop(4)
    assert trainer.state(4)["data_rng"] == saved[1]
    trainer.pending.clear()
    assert trainer.state(5)["data_rng"] == trainer.data_rng.getstate()
