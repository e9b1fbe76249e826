"""The phases of the sharded megatron checkpoint test (issue 40, finding 4), run as a script:

``python megatron_ckpt_cases.py MODEL_DIR ROOT NAME,WORLD,TP,PP,LOAD_FROM,SAVE_TO[,EP] [...]``

runs the phases one after the other; each (in ROOT/NAME as its WORKDIR) starts WORLD processes
in one gloo world (tensor TP x pipeline PP x data WORLD / (TP x PP), a MoE model's experts over
EP of the data-parallel ranks),
builds a megatron actor and critic from MODEL_DIR and, when LOAD_FROM is not ``-``, loads that
checkpoint and compares the gathered, HF-named state (``_Sharded.state_dict``: weights, both Adam
moments, Adam's step, the update count; layout-independent) bit for bit with the one the saving
phase recorded beside it (``oracle.pt``). Then one actor and one critic update, and a save to
SAVE_TO (not ``-``) measuring what each rank writes and every object collective's pickled size
during the save; the phase records its own gathered state as SAVE_TO/../<name>.oracle.pt.
Rank 0 writes WORKDIR/result.json. Fresh processes per phase keep megatron-core's
process-global state apart: this script imports torch, megatron-core and the backend once and
forks each phase's processes from that (still undistributed, single-threaded) parent, so no
phase pays the imports again.
"""

from __future__ import annotations

import json
import pickle
import re
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

OBJECT_COLLECTIVES = (
    "gather_object",
    "all_gather_object",
    "broadcast_object_list",
    "scatter_object_list",
)
_SHARD_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def _oracle(actor, critic) -> dict | None:  # type: ignore[no-untyped-def]
    state = {"actor": actor.m.state_dict(), "critic": critic.m.state_dict()}
    return state if state["actor"] else None


def _diff(a: object, b: object, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ (tensors: bit for bit)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(set(a) ^ set(b))[:4]}"]
        return [d for k in a for d in _diff(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [f"{where}: tensors differ"]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _state_bytes(trainer) -> int:  # type: ignore[no-untyped-def]
    """Bytes of this rank's shard of the weights and both Adam moments (fp32)."""
    params = [p for p in trainer.m.model.parameters() if p.requires_grad]
    return sum(3 * p.numel() * p.element_size() for p in params)


def _written(directory: Path, world: int) -> list[int]:
    """Bytes each rank wrote into ``directory``: ``torch_dist``'s ``__<rank>_<n>.distcp`` files
    are that rank's; every other file is counted as rank 0's (the only writer of common files,
    and the leader that wrote the single ``state.pt`` of before)."""
    per_rank = [0] * world
    for f in directory.rglob("*"):
        if f.is_file():
            m = _SHARD_FILE.match(f.name)
            per_rank[int(m.group(1)) if m else 0] += f.stat().st_size
    return per_rank


def _spy_object_collectives(sizes: list[int]) -> dict:  # type: ignore[type-arg]
    import torch.distributed as dist

    saved = {n: getattr(dist, n) for n in OBJECT_COLLECTIVES}

    def wrap(name, fn):  # type: ignore[no-untyped-def]
        def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
            import inspect

            bound = inspect.signature(fn).bind(*args, **kwargs).arguments
            key = {"all_gather_object": "obj", "gather_object": "obj"}.get(name)
            obj = bound[key] if key else next(iter(bound.values()))
            sizes.append(len(pickle.dumps(obj)))
            return fn(*args, **kwargs)

        return spy

    for n, fn in saved.items():
        setattr(dist, n, wrap(n, fn))
    return saved


def _worker(rank: int, world: int, port: int, argv: list[str]) -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron_cases import _batch, _cfg, _layout, _policy_loss, _value_loss

    from ppojob_trainer.backends.megatron_backend import (
        MegatronPolicyTrainer,
        MegatronValueTrainer,
    )

    tp, pp, model_dir, work, load_from, save_to, ep = argv
    tp, pp, ep, work = int(tp), int(pp), int(ep), Path(work)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    cfg = _cfg(tp, pp, 2, ep, adamEps=1e-3)
    shard = _layout(rank, tp, pp, world, ep)
    actor = MegatronPolicyTrainer(
        cfg, Path(model_dir), shard, need_reference=False, total_updates=8
    )
    critic = MegatronValueTrainer(cfg, Path(model_dir), shard, total_updates=8)
    out: dict[str, object] = {"world": world, "tp": tp, "pp": pp, "dp": shard.dp_size}
    if load_from != "-":
        src = Path(load_from)
        actor.load_checkpoint(src / "actor", shard)
        critic.load_checkpoint(src / "critic", shard)
        now = _oracle(actor, critic)
        if now is not None:
            saved = torch.load(f"{src}.oracle.pt", weights_only=True)
            out["load_diffs"] = _diff(saved, now)[:10]
            out["loaded_updates"] = now["actor"]["updates"]
    n = 8
    batch = _batch(n, seed=11 + (0 if load_from == "-" else 1))
    lo, hi = shard.dp_rank * n // shard.dp_size, (shard.dp_rank + 1) * n // shard.dp_size
    mine = {k: v[lo:hi] for k, v in batch.items()}
    actor.update(mine, _policy_loss(cfg), 2)
    critic.update(mine, _value_loss, 2)
    if save_to != "-":
        dst = Path(save_to)
        sizes: list[int] = []
        saved_fns = _spy_object_collectives(sizes)
        try:
            actor.save_checkpoint(dst / "actor", shard)
            critic.save_checkpoint(dst / "critic", shard)
        finally:
            for name, fn in saved_fns.items():
                setattr(dist, name, fn)
        dist.barrier()
        mine_bytes = torch.tensor([_state_bytes(actor), _state_bytes(critic)], dtype=torch.int64)
        per_rank = [torch.zeros_like(mine_bytes) for _ in range(world)]
        dist.all_gather(per_rank, mine_bytes)
        largest = torch.tensor([max(sizes, default=0)], dtype=torch.int64)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        state = _oracle(actor, critic)
        if state is not None:
            torch.save(state, f"{dst}.oracle.pt")
            out["written"] = {role: _written(dst / role, world) for role in ("actor", "critic")}
            out["shard_bytes"] = {
                role: [int(b[i]) for b in per_rank] for i, role in enumerate(("actor", "critic"))
            }
            out["largest_object_collective"] = int(largest)
    if rank == 0:
        (work / "result.json").write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()


def main() -> None:
    from megatron_cases import start

    from ppojob_trainer.distributed import free_port

    model_dir, root, phases = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    for phase in phases:
        name, world, tp, pp, load_from, save_to, *ep = phase.split(",")
        work = root / name
        work.mkdir(parents=True, exist_ok=True)
        argv = [tp, pp, model_dir, str(work), load_from, save_to, ep[0] if ep else "1"]
        start(_worker, (int(world), free_port(), argv), int(world))


if __name__ == "__main__":
    main()
