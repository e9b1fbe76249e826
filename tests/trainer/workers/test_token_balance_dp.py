"""Token-balanced data-parallel shares on two real workers (CPU, gloo, two processes).

With ``maxTokensPerMicroBatch`` each mini-batch of the step is dealt to the data-parallel
workers by tokens (:func:`ppojob_trainer.workers.actor.mini_batch_rows`, the actor's and the
critic's path), each worker cuts its share into token-budget micro-batches and the torch
backend weighs their losses by the global token count. The step (16 samples, one mini-batch,
two epochs) has its long samples in worker 0's contiguous range, so today's split without a
budget gives worker 0 several times worker 1's tokens, and so would any cut of the step's
order or a deal by sample counts alone. Checked:

(a) the two workers' shares differ by at most one sequence's tokens (the step's longest),
    are the same size, and together hold every sample exactly once per epoch;
(b) the gradients the optimizer steps with (after the all-reduce), the gradient norms and
    the updated weights equal those of ONE process training today's way, on the whole
    mini-batch, padded, without a token budget or a group: gradients within 5e-5 (fp32 sums
    in another order; the second epoch's at weights that AdamW moved), weights within 1e-3
    (a tenth of one AdamW step of lr 1e-2: its normalised step amplifies the rounding in
    near-zero gradients). Padded and packed micro-batches, replicas and FSDP2.
    Both workers share the weighting code, so only the single process can catch a
    normalisation bug.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
WORLD = 2
MINI = 8  # samples per worker per mini-batch: the step (16) is one mini-batch, in step order
EPOCHS = 2
BUDGET = 48  # tokens per micro-batch (the longest sample: 3 + 40)
# the long responses sit at even positions of worker 0's contiguous range (samples 0-7): a
# split by ranges and a split by sample counts alone (alternating) both give worker 0 all four
PROMPT_LENS = [3, 1, 4, 2, 3, 4, 1, 2, 2, 3, 1, 4, 2, 1, 3, 4]
RESPONSE_LENS = [40, 2, 36, 3, 33, 1, 30, 2, 3, 1, 4, 2, 5, 1, 2, 3]
CASES = [("none", False), ("none", True), ("fsdp", True)]


def _batch() -> dict[str, torch.Tensor]:
    from tests.helpers.batches import mixed_batch

    return mixed_batch(PROMPT_LENS, RESPONSE_LENS, seed=3)


def _tokens(batch: dict[str, torch.Tensor]) -> list[int]:
    return (batch["prompt_mask"].sum(1) + batch["response_mask"].sum(1)).tolist()


def _capture(trainer, into: list) -> None:
    """Record the gradients the optimizer steps with (after the data-parallel reduction)."""
    step = trainer.opt.optimizer.step

    def capture(*args, **kwargs):
        grads = []
        for p in trainer.opt.params:
            g = p.grad
            grads.append((g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone())
        into.append(grads)
        return step(*args, **kwargs)

    trainer.opt.optimizer.step = capture


def _weights(trainer) -> dict[str, torch.Tensor]:
    from ppojob_trainer.backends.torch_backend.sharding import full_state_dict

    return {k: v.float() for k, v in full_state_dict(trainer.lm).items()}


def _worker(rank: int, model_dir: str, port: int, out: str) -> None:
    import torch.distributed as dist

    from ppojob_api.training import TrainingSettings
    from ppojob_trainer.backends.torch_backend.policy import TorchPolicyTrainer
    from ppojob_trainer.distributed import ShardIdentity
    from ppojob_trainer.workers.actor import balances_tokens, mini_batch_rows
    from tests.helpers.batches import ppo_policy_loss

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    group = dist.new_group(list(range(WORLD)), backend="gloo")
    shard = ShardIdentity("actor", dp_rank=rank, dp_size=WORLD)
    batch = _batch()
    n = batch["response_ids"].shape[0]

    def trainer(settings: TrainingSettings, **kw):
        return TorchPolicyTrainer(
            model_dir,
            "float32",
            settings,
            total_updates=EPOCHS,
            temperature=1.0,
            need_reference=False,
            entropy_grad=True,
            **kw,
        )

    results: dict[str, object] = {}
    for sharding, packing in CASES:
        settings = TrainingSettings(
            learning_rate=1e-2,
            grad_clip=None,
            sharding=sharding,
            packing=packing,
            max_tokens_per_micro_batch=BUDGET,
        )
        assert balances_tokens(settings, shard, group)
        gen = torch.Generator().manual_seed(5)
        shares = [r for _ in range(EPOCHS) for r in mini_batch_rows(batch, MINI, shard, gen, True)]
        # the reference: one process, no group, each whole mini-batch padded (today's update)
        single = trainer(TrainingSettings(learning_rate=1e-2, grad_clip=None))
        dp = trainer(settings, group=group, dp_size=WORLD)
        assert dp.opt.sharded == (sharding == "fsdp")
        single_grads: list = []
        dp_grads: list = []
        _capture(single, single_grads)
        _capture(dp, dp_grads)
        norms = []
        for rows in shares:
            # the whole mini-batch: both workers' shares (each worker holds the whole step)
            held = [torch.zeros_like(rows) for _ in range(WORLD)]
            dist.all_gather(held, rows, group=group)
            whole = torch.cat(held).sort().values
            s = single.update({k: v[whole] for k, v in batch.items()}, ppo_policy_loss, 2 * MINI)
            d = dp.update({k: v[rows] for k, v in batch.items()}, ppo_policy_loss, MINI)
            norms.append((s["grad_norm"], d["grad_norm"]))
        results[f"{sharding}-{packing}"] = {
            "shares": [r.tolist() for r in shares],
            "norms": norms,
            "single_grads": single_grads,
            "dp_grads": dp_grads,
            "single_weights": _weights(single),
            "dp_weights": _weights(dp),
        }
    # today's split without a token budget: this worker's contiguous range, shuffled and cut
    lo, hi = rank * n // WORLD, (rank + 1) * n // WORLD
    mine = {k: v[lo:hi] for k, v in batch.items()}
    rows = mini_batch_rows(mine, MINI, shard, torch.Generator().manual_seed(5), False)
    results["contiguous"] = [(r + lo).tolist() for r in rows]
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    import torch.multiprocessing as mp

    from ppojob_trainer import models
    from ppojob_trainer.distributed import free_port

    tmp = tmp_path_factory.mktemp("dp")
    model_dir = models.materialize_builtin("tiny-llama", 5, tmp / "cache")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_worker, args=(str(model_dir), free_port(), str(tmp)), nprocs=WORLD)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("case", [f"{s}-{p}" for s, p in CASES])
def test_shares_balance_tokens_within_one_sequence(results, case):
    tokens = _tokens(_batch())
    shares = [r[case]["shares"] for r in results]
    assert len(shares[0]) == len(shares[1]) == EPOCHS
    # every sample exactly once per epoch, each worker the same number per mini-batch
    for e in range(EPOCHS):
        assert sorted(shares[0][e] + shares[1][e]) == list(range(len(tokens)))
    for a, b in zip(*shares, strict=True):
        assert len(a) == len(b) == MINI
        loads = [sum(tokens[i] for i in a), sum(tokens[i] for i in b)]
        assert abs(loads[0] - loads[1]) <= max(tokens[i] for i in a + b), (a, b, loads)
    # the same step split by contiguous ranges (today's, without a budget) is far out of
    # balance: worker 0 holds the long samples, so the test has teeth
    contiguous = [sum(tokens[i] for mb in r["contiguous"] for i in mb) for r in results]
    assert contiguous[0] - contiguous[1] > 2 * max(tokens)


@pytest.mark.parametrize("case", [f"{s}-{p}" for s, p in CASES])
def test_gradients_equal_one_process_training_the_whole_mini_batch(results, case):
    for r in results:
        got = r[case]
        assert len(got["dp_grads"]) == len(got["single_grads"]) == EPOCHS
        for dp_g, single_g in zip(got["dp_grads"], got["single_grads"], strict=True):
            for a, b in zip(dp_g, single_g, strict=True):
                assert float(b.abs().max()) > 0
                torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)
        for single_norm, dp_norm in got["norms"]:
            assert dp_norm == pytest.approx(single_norm, rel=1e-5, abs=1e-7)
        for k, v in got["single_weights"].items():
            torch.testing.assert_close(got["dp_weights"][k], v, atol=1e-3, rtol=0)
