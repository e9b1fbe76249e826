"""Every collective the torch and megatron backends issue, under the collective-device check
(``tests/helpers/collective_check.py``: every group named "nccl", every tensor our code hands
to a collective must have been placed for it), on 2 gloo processes.

Run as a script (``python collective_device_cases.py OUT_DIR MODEL_DIR``); each rank writes
``OUT_DIR/rank<r>.json``: per case, the sites of the judged calls and the violations.
``tests/trainer/backends/test_collective_devices.py`` asserts on them; a separate process keeps
megatron-core's process-global state out of pytest's.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

WORLD = 2
BUDGET = 14  # tokens per micro-batch: rows of unequal length give the ranks unequal counts


def _batch(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p, t = 4, 6
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return {
        "prompt_ids": torch.randint(4, 14, (n, p), generator=g),
        "prompt_mask": torch.ones(n, p, dtype=torch.bool),
        "response_ids": torch.randint(4, 14, (n, t), generator=g).masked_fill(~mask, 0),
        "response_mask": mask,
        "old_logprobs": -torch.rand(n, t, generator=g) * 3,
        "advantages": torch.randn(n, t, generator=g),
        "returns": torch.randn(n, t, generator=g),
        "old_values": torch.zeros(n, t),
    }


def _mine(rank: int, seed: int = 11) -> dict[str, torch.Tensor]:
    # rank 1's rows are longer: under a token budget it needs more micro-batches than rank 0
    full = _batch(8, seed)
    order = full["response_mask"].sum(1).argsort()
    rows = order[:4] if rank == 0 else order[4:]
    return {k: v[rows] for k, v in full.items()}


def _policy_loss(logp: Any, ent: Any, mb: dict[str, torch.Tensor]) -> Any:
    from ppojob_trainer import algorithms as A

    loss, _ = A.policy_loss(
        logp,
        mb["old_logprobs"],
        mb["advantages"],
        mb["response_mask"],
        entropy=ent,
        entropy_coef=0.01,
    )
    return loss, {"pg_loss": loss.detach()}


def _torch_case(rank: int, model_dir: str, group: Any, **settings: Any) -> None:
    from ppojob_api.training import TrainingSettings
    from ppojob_trainer.backends.torch_backend.policy import TorchPolicyTrainer

    s = TrainingSettings(learning_rate=1e-2, grad_clip=1.0, **settings)
    actor = TorchPolicyTrainer(
        model_dir,
        "float32",
        s,
        total_updates=2,
        temperature=1.0,
        need_reference=False,
        entropy_grad=True,
        group=group,
        dp_size=WORLD,
    )
    batch = _mine(rank)
    actor.logprobs(batch)
    actor.update(batch, _policy_loss, micro_batch_size=2)


def _megatron_case(
    rank: int,
    model_dir: str,
    tp: int,
    pp: int,
    ep: int = 1,
    aux: float = 0.0,
    **training: Any,
) -> None:
    from megatron.core import parallel_state as ps

    from ppojob_api.training import TrainerConfig
    from ppojob_trainer import models
    from ppojob_trainer.backends.megatron_backend import MegatronPolicyTrainer
    from ppojob_trainer.distributed import identity

    if ep > 1 or aux:  # a mixture-of-experts model beside the dense one (the same cache)
        model_dir = str(models.materialize_builtin("tiny-mixtral", 5, Path(model_dir).parents[1]))
    par = {"tensor": tp, "pipeline": pp, "expert": ep}
    cfg = TrainerConfig.model_validate(
        {
            "roles": {"actor": {"replicas": 2, "backend": "megatron", "parallelism": par}},
            "algorithm": {"entropyCoefficient": 0.01, "routerAuxLossCoefficient": aux},
            "data": {"rolloutBatchSize": 4, "samplesPerPrompt": 2},
            "training": {"learningRate": 1e-2, "seed": 3, "microBatchSize": 2, **training},
        }
    )
    shard = identity("actor", rank, WORLD, tp, pp, 1, ep)
    actor = MegatronPolicyTrainer(
        cfg, Path(model_dir), shard, need_reference=False, total_updates=4
    )
    batch = _mine(rank) if shard.dp_size > 1 else _batch(8, 11)
    actor.logprobs(batch)
    actor.update(batch, _policy_loss, 2)  # the entropy's gradient flows (coefficient > 0)
    actor.entropy_grad = False  # the entropy as a metric only: its no-grad all-reduces
    actor.update(batch, _policy_loss, 2)
    stream = actor.export_weight_stream(1 << 12)
    for i in range(len(stream.plan)):
        stream.bucket(i)
    ps.destroy_model_parallel()


def cases(model_dir: str, group: Any) -> dict[str, Callable[[int], None]]:
    return {
        "torch/fsdp+budget": lambda r: _torch_case(
            r, model_dir, group, sharding="fsdp", max_tokens_per_micro_batch=BUDGET
        ),
        "torch/replicas": lambda r: _torch_case(r, model_dir, group, sharding="none"),
        "torch/replicas+budget": lambda r: _torch_case(
            r, model_dir, group, sharding="none", max_tokens_per_micro_batch=BUDGET
        ),
        "megatron/tp2": lambda r: _megatron_case(r, model_dir, 2, 1),
        "megatron/pp2": lambda r: _megatron_case(r, model_dir, 1, 2),
        # a MoE model's load-balancing loss: its value summed over the stages
        "megatron/pp2+aux": lambda r: _megatron_case(r, model_dir, 1, 2, aux=0.01),
        "megatron/dp2": lambda r: _megatron_case(r, model_dir, 1, 1),
        "megatron/dp2+budget": lambda r: _megatron_case(
            r, model_dir, 1, 1, maxTokensPerMicroBatch=BUDGET
        ),
        # experts over the two ranks; the budget gives them different micro-batch counts
        "megatron/ep2+budget": lambda r: _megatron_case(
            r, model_dir, 1, 1, 2, maxTokensPerMicroBatch=BUDGET
        ),
    }


def _worker(rank: int, store_path: str, model_dir: str, out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from tests.helpers.collective_check import nccl_check

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    group = dist.new_group(list(range(WORLD)), backend="gloo")
    only = os.environ.get("CASES")
    results = {}
    for name, run in cases(model_dir, group).items():
        if only and name not in only.split(","):
            continue
        with nccl_check() as log:
            run(rank)
        results[name] = {"sites": sorted(log.sites()), "violations": log.violations}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    out_dir, model_dir = sys.argv[1], sys.argv[2]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = str(Path(out_dir) / "store")
    mp.spawn(_worker, args=(store, model_dir, out_dir), nprocs=WORLD)


if __name__ == "__main__":
    main()
