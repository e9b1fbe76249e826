"""Routing replay on the megatron backend (CPU), run as a script: ``python
megatron_routing_case.py OUT.json MODEL_DIR [--packing]``.

A bfloat16 engine samples prompts and records the experts of every token it fed (as in
``tests/trainer/test_moe_routing.py``); the megatron actor (float32: the same weights, other
numerics) computes the old log-probs without and with routing replay, its experts split over
2 gloo processes (expert 2, data 2: each process the log-probs of half the batch). Rank 0 writes
the rollout/training log-prob mismatch (mean, max) of both, the routers' own agreement with
the engine (``routing_stats``) and the share of the engine's choices the replaying forward used.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import megatron_cases


def _worker(rank: int, world: int, port: int, model_dir: str, out: str, packing: bool) -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ppojob_api.training import TrainerConfig
    from ppojob_trainer.backends.megatron_backend import MegatronPolicyTrainer
    from ppojob_trainer.backends.megatron_routing import agreement, token_major
    from ppojob_trainer.distributed import identity
    from ppojob_trainer.workers.actor import logprob_mismatch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_moe_routing import rollout

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    batch = rollout(Path(model_dir))  # the same samples on both ranks (one seed)
    n = batch["response_ids"].shape[0]
    mine = {k: v[rank * n // 2 : (rank + 1) * n // 2] for k, v in batch.items()}
    shard = identity("actor", rank, world, 1, 1, 1, 2)
    result: dict[str, object] = {}
    for replay in ("none", "rollout"):
        cfg = TrainerConfig.model_validate(
            {
                "roles": {
                    "actor": {
                        "replicas": 2,
                        "backend": "megatron",
                        "parallelism": {"expert": 2},
                    }
                },
                "algorithm": {"advantageEstimator": "grpo", "routingReplay": replay},
                "data": {"temperature": 1.0},
                "training": {"packing": packing, "microBatchSize": 8},
            }
        )
        actor = MegatronPolicyTrainer(cfg, Path(model_dir), shard, need_reference=False)
        logp = actor.logprobs(mine)
        mism = logprob_mismatch(mine["rollout_logprobs"], logp, mine["response_mask"])
        sums = torch.tensor(
            [mism["logprob_diff_sum"], float(mine["response_mask"].sum())], dtype=torch.float64
        )
        dist.all_reduce(sums)
        top = torch.tensor([mism["logprob_diff_max"]])
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        result[replay] = [float(sums[0] / sums[1]), float(top)]
        if replay == "rollout":
            stats = actor.routing_stats()
            counts = torch.tensor([stats["router_agree_sum"], stats["router_choices"]])
            dist.all_reduce(counts)
            result["own_agreement"] = float(counts[0] / counts[1])
            # one forward of all the worker's rows: did it use the engine's experts?
            mb = actor.m._align_for_experts([actor.m._inputs(dict(mine))])[0]
            routes = [token_major(mb[k]) for k in ("_routes", "_valid")]
            actor.m.measure_routing = True
            with torch.no_grad():
                actor.m.run(mine, n, lambda o, m: (o.new_zeros(()), None), forward_only=True)
            same, total = agreement(actor.m.routers["model"], *routes, which="used")
            counts = torch.tensor([same, total])
            dist.all_reduce(counts)
            result["used_agreement"] = counts.tolist()
        ps.destroy_model_parallel()
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    from ppojob_trainer.distributed import free_port

    out, model_dir = sys.argv[1], sys.argv[2]
    packing = "--packing" in sys.argv[3:]
    megatron_cases.start(_worker, (2, free_port(), model_dir, out, packing), 2)


if __name__ == "__main__":
    main()
