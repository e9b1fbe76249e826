"""The loop pieces of the algorithm pack (issue 25): dynamic sampling's assembly of a step from
picked groups, the samples the policy loss leaves out (truncated ones, a short step's fillers),
the micro-batch weights over them, and GSPO chosen by policyLoss, driven through the actor's
real loss function with a stand-in model."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

from ppojob_trainer.backends.base import Generation
from ppojob_trainer.backends.torch_backend.optimiser import _micro_weights
from ppojob_trainer.distributed import ShardIdentity
from ppojob_trainer.manifest import config_from_doc
from ppojob_trainer.workers.actor import ActorWorker, loss_rows, merge_update_metrics
from ppojob_trainer.workers.rollout import RolloutWorker, select_groups

TINY = yaml.safe_load(
    (Path(__file__).resolve().parents[2] / "examples" / "ppojob-tiny.yaml").read_text()
)


def _cfg(**algorithm: Any) -> Any:
    doc = copy.deepcopy(TINY)
    doc["spec"]["algorithm"] = {"advantageEstimator": "grpo", "kl": {"coefficient": 0}, **algorithm}
    return config_from_doc(doc)


def _batch(first_group: int, widths: int, k: int = 2) -> dict[str, torch.Tensor]:
    n = 2 * k  # two groups
    idx = torch.arange(first_group * k, first_group * k + n)
    return {
        "response_ids": torch.arange(n * widths).reshape(n, widths),
        "response_mask": torch.ones(n, widths, dtype=torch.bool),
        "prompt_ids": torch.ones(n, 1, dtype=torch.long),
        "prompt_mask": torch.ones(n, 1, dtype=torch.bool),
        "scores": idx.float(),
        "group_ids": idx // k,
        "sample_idx": idx,
    }


def test_select_groups_takes_whole_groups_renumbered_with_their_loss_flag() -> None:
    round0, round1 = _batch(0, 3), _batch(10, 2)  # groups 0, 1 and 10, 11
    out = select_groups([round0, round1], [(1, 11, True), (0, 0, True), (0, 1, False)], 8, 2)
    # rows of group 11 (samples 22, 23), then group 0 (0, 1), then group 1 (2, 3)
    assert out["scores"].tolist() == [22.0, 23.0, 0.0, 1.0, 2.0, 3.0]
    assert out["sample_idx"].tolist() == [8, 9, 10, 11, 12, 13]
    assert out["group_ids"].tolist() == [4, 4, 5, 5, 6, 6]
    assert out["in_loss"].tolist() == [True, True, True, True, False, False]
    # round 1's responses are narrower: padded, their mask false on the padding
    assert out["response_mask"][:2].tolist() == [[True, True, False]] * 2
    with pytest.raises(ValueError, match="group 5 has 0 rows"):
        select_groups([round0], [(0, 5, True)], 0, 2)


def test_loss_rows_leave_out_truncated_samples_only_when_asked_and_fillers_always() -> None:
    batch = {"truncated": torch.tensor([True, False, False]), "in_loss": torch.tensor([1, 1, 0])}
    on, off = _cfg(maskTruncatedSamples=True).algorithm, _cfg().algorithm
    assert loss_rows(batch, on).tolist() == [False, True, False]
    assert loss_rows(batch, off).tolist() == [True, True, False]
    assert loss_rows({"truncated": batch["truncated"]}, off) is None


def test_merged_metrics_average_over_the_updates_reporting_them_and_sum_skips() -> None:
    parts = [{"actor/skipped_updates": 1.0}, {"actor/pg_loss": 2.0}, {"actor/pg_loss": 4.0}]
    parts.append({"actor/pg_loss": 6.0, "actor/skipped_updates": 0.0})
    assert merge_update_metrics(parts) == {"actor/skipped_updates": 1.0, "actor/pg_loss": 4.0}


def test_micro_batch_weights_count_the_loss_mask_and_none_when_it_is_empty() -> None:
    opt = SimpleNamespace(global_count=float, dp_size=1)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    loss_mask = mask & torch.tensor([True, False, True]).unsqueeze(1)
    slices = [torch.tensor([0, 1]), torch.tensor([2])]
    # tokens in the loss: 3 (row 0) + 0 (row 1) in the first micro-batch, 1 in the second
    got = _micro_weights({"response_mask": mask, "loss_mask": loss_mask}, slices, "token-mean", opt)
    assert got == pytest.approx([3 / 4, 1 / 4])
    empty = {"response_mask": mask, "loss_mask": torch.zeros_like(mask)}
    assert _micro_weights(empty, slices, "token-mean", opt) is None


class _StandInTrainer:
    """A policy trainer whose 'model' gives log-probs old + ``shift``: runs the actor's loss
    function on each mini-batch and records the loss."""

    def __init__(self, shift: torch.Tensor) -> None:
        self.shift = shift
        self.losses: list[float] = []

    def update(self, mb: dict, loss_fn: Any, micro: int, agg: str) -> dict[str, float]:
        rows = mb["sample_idx"]
        logp = (mb["old_logprobs"] + self.shift[rows]).requires_grad_()
        loss, metrics = loss_fn(logp, None, mb)
        self.losses.append(float(loss.detach()))
        return {k: float(v) for k, v in metrics.items()}


def _train_once(cfg: Any, truncated: list[bool]) -> tuple[float, dict[str, float]]:
    worker = object.__new__(ActorWorker)
    worker.cfg, worker.shard, worker.group = cfg, ShardIdentity("actor"), None
    shift = torch.tensor([[0.1, 0.1], [0.0, -0.2]])
    worker.trainer = _StandInTrainer(shift)
    worker.whole = None
    worker.batch = {
        "response_ids": torch.zeros(2, 2, dtype=torch.long),
        "response_mask": torch.ones(2, 2, dtype=torch.bool),
        "old_logprobs": torch.zeros(2, 2),
        "rollout_logprobs": torch.zeros(2, 2),
        "advantages": torch.tensor([[1.0, 1.0], [2.0, 2.0]]),
        "truncated": torch.tensor(truncated),
        "sample_idx": torch.tensor([0, 1]),
    }
    metrics = worker.train(0)
    (loss,) = worker.trainer.losses
    return loss, metrics


def test_the_actor_leaves_truncated_samples_out_of_the_loss() -> None:
    # PPO, clip 0.2, token-mean. Sample 0: ratios e^0.1 (inside the clip), A = 1 -> -e^0.1 per
    # token; sample 1: ratios 1 and e^-0.2 = 0.819 (A = 2 > 0: unclipped) -> -2, -2 e^-0.2
    all_in = (-2 * math.exp(0.1) - 2 - 2 * math.exp(-0.2)) / 4
    loss, _ = _train_once(_cfg(), [False, True])
    assert loss == pytest.approx(all_in, rel=1e-6)  # off: the truncated sample counts
    loss, _ = _train_once(_cfg(maskTruncatedSamples=True), [False, True])
    assert loss == pytest.approx(-math.exp(0.1), rel=1e-6)  # on: only sample 0's 2 tokens


def test_policy_loss_gspo_selects_the_sequence_level_ratio() -> None:
    cfg = _cfg(policyLoss="gspo", clipRangeLow=0.3, clipRangeHigh=0.3)
    loss, metrics = _train_once(cfg, [False, False])
    # s_0 = e^0.1, s_1 = e^-0.1 (mean of 0 and -0.2); both inside the clip; token-mean:
    # (2 * -1 * s_0 + 2 * -2 * s_1) / 4
    assert loss == pytest.approx((-2 * math.exp(0.1) - 4 * math.exp(-0.1)) / 4, rel=1e-6)
    assert metrics["actor/seq_ratio_mean"] == pytest.approx(
        (math.exp(0.1) + math.exp(-0.1)) / 2, rel=1e-6
    )


def test_the_rollout_adds_the_overlong_penalty_to_the_scores_and_flags_truncation() -> None:
    cfg = _cfg(overlongShaping={"bufferLength": 4})  # the tiny example: maxResponseLength 8
    worker = object.__new__(RolloutWorker)
    worker.cfg, worker.special = cfg, {2}
    stop = 2
    ids = torch.tensor([[5, 6, stop, 0, 0, 0, 0, 0], [5] * 5 + [stop, 0, 0], [5] * 8])
    lengths = torch.tensor([3, 6, 8])
    worker.engine = SimpleNamespace(
        generate=lambda *a, **kw: Generation(ids, ids != 0, torch.zeros(3, 8), lengths)
    )
    worker.encode = lambda prompts: (prompts, torch.ones(3, 1, dtype=torch.long), None)
    worker.completions = lambda response_ids: ["c"] * 3
    worker.scorer = SimpleNamespace(
        score=lambda prompts, completions, labels: ([1.0, 1.0, 0.5], {}), report_sources=False
    )
    examples = [SimpleNamespace(prompt=p, label=None) for p in ("a", "b", "c")]
    cfg.data.samples_per_prompt = 1
    batch, metrics = worker.generate(examples, 0, seed=0)
    # L_max 8, L_cache 4: lengths 3 -> 0, 6 -> (4 - 6) / 4 = -0.5, 8 -> -1
    assert batch["scores"].tolist() == pytest.approx([1.0, 0.5, -0.5])
    assert batch["truncated"].tolist() == [False, False, True]  # only the last has no stop
    assert metrics["reward_sum"] == pytest.approx(2.5)  # the task's reward, unshaped
    assert metrics["overlong_penalty_sum"] == pytest.approx(-1.5)
    assert metrics["truncated_sum"] == 1.0


def test_an_update_with_no_sample_in_the_loss_is_skipped_not_taken() -> None:
    from ppojob_api.training import TrainingSettings
    from ppojob_trainer.backends.torch_backend.optimiser import _Optimised

    module = torch.nn.Linear(2, 1)
    opt = _Optimised(module, TrainingSettings(learningRate=0.1), 4, None, 1)
    before = [p.detach().clone() for p in module.parameters()]
    mask = torch.ones(2, 3, dtype=torch.bool)
    mb = {
        "response_ids": torch.zeros(2, 3, dtype=torch.long),
        "response_mask": mask,
        "prompt_ids": torch.zeros(2, 1, dtype=torch.long),
        "prompt_mask": torch.ones(2, 1, dtype=torch.bool),
    }

    def micro_loss(micro: dict) -> tuple[torch.Tensor, dict]:
        return module(torch.ones(1, 2)).sum(), {"pg_loss": 1.0}

    skipped = opt.accumulate(
        {**mb, "loss_mask": torch.zeros_like(mask)}, 2, "token-mean", micro_loss
    )
    assert skipped == {"skipped_updates": 1.0} and opt.updates == 0
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    taken = opt.accumulate({**mb, "loss_mask": mask}, 2, "token-mean", micro_loss)
    assert "skipped_updates" not in taken and opt.updates == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
