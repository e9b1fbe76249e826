"""A disaggregated weight sync of a 0.5B-parameter model: the actor's leader to two engines over
gloo on loopback, on the CPU: seconds, bytes and collectives per sync, against a memcpy bound.

    python bench/weight_sync.py [--syncs 3] [--bucket-mb 512] [--layers 24]

Method: the sender process makes a random model of Qwen2-0.5B's shape (hidden 896, 24 layers,
14 heads over 2 key/value groups, intermediate 4864, vocabulary 151936, tied embeddings, q/k/v
biases: 494 M parameters) in bf16, tensor by tensor from a seeded generator, under the names a
HF Qwen2 state dict has. Three processes join one weight-update group the way the trainer
forms it (``weight_sync.init_custom_group``: a TCP store on 127.0.0.1, gloo): rank 0 the sender,
ranks 1 and 2 one engine each (tensor parallel 1). Each engine is the trainer's own receiving
code: a ``GenerationEngine`` whose ``update_weights_from_distributed`` is the base class's (the
torch engine's), its weight loading replaced by keeping the tensors. The sender announces each
collective's names, dtypes and shapes to the engines through a queue (in the trainer, a Ray
call), then broadcasts. A sync is timed on the sender, from the first announcement to the last
engine's confirmation (the engines report the version they now hold, which is checked).

Two methods, alternating, ``--warmup`` syncs each not counted (the first collectives connect
gloo's pairs), then ``--syncs`` each (figures: the median):

- ``packed`` (the trainer's): ``weight_sync.broadcast_stream``: buckets of ``--bucket-mb`` MiB
  (``roles.rollout.weightSyncBucketMb``), each packed in SGLang's ``flattened_bucket`` layout and
  sent as one broadcast;
- ``per-tensor`` (before, issue 40 finding 8): the same buckets, one broadcast per tensor.

After the last sync every engine's tensors are compared with the sender's (bit for bit).

The memcpy bound: the seconds one process takes to copy the sync's bytes once per engine
(``Tensor.copy_`` of a buffer of the model's bytes into another, best of 3). A loopback
broadcast to two engines moves at least that much memory: no sync on this host can be faster.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT / "api", ROOT / "trainer"):  # (the engines' spawned processes too)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
GROUP = "bench-weights"
ENGINES = 2


def qwen2_shapes(
    layers: int = 24, hidden: int = 896, inter: int = 4864, vocab: int = 151936
) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of a Qwen2-0.5B-shaped model (tied: no ``lm_head.weight``)."""
    h, heads, kv = hidden, 14, 2
    d = h // heads
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (heads * d, h),
            p + "self_attn.k_proj.weight": (kv * d, h),
            p + "self_attn.v_proj.weight": (kv * d, h),
            p + "self_attn.q_proj.bias": (heads * d,),
            p + "self_attn.k_proj.bias": (kv * d,),
            p + "self_attn.v_proj.bias": (kv * d,),
            p + "self_attn.o_proj.weight": (h, heads * d),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    out["model.norm.weight"] = (h,)
    return out


def random_weights(shapes: Mapping[str, Sequence[int]], seed: int = 0) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        k: torch.empty(tuple(s), dtype=torch.bfloat16).uniform_(-0.05, 0.05, generator=g)
        for k, s in shapes.items()
    }


def _engine(rank: int, port: int, inbox: Any, outbox: Any) -> None:
    """One engine: joins the group, then serves ``(method, names, dtypes, shapes, last)``
    announcements until ``None``; answers each sync's end with its version, and finally its
    tensors."""
    import torch
    import torch.distributed as dist

    from ppojob_trainer.backends.base import GenerationEngine

    torch.set_num_threads(1)

    class Receiver(GenerationEngine):
        def __init__(self) -> None:
            self.weights: dict[str, torch.Tensor] = {}
            self.version = 0

        def generate(self, *a: Any, **k: Any) -> Any:  # (never asked to)
            raise NotImplementedError

        def update_weights(self, named: Mapping[str, torch.Tensor]) -> None:
            self.weights = dict(named)

    engine = Receiver()
    engine.init_weights_update_group("127.0.0.1", port, rank, 1 + ENGINES, GROUP, "gloo")
    group = engine.__dict__["_weight_groups"][GROUP][0]
    while True:
        msg = inbox.get()
        if msg is None:
            break
        kind, *rest = msg
        if kind == "packed":
            names, dtypes, shapes, last = rest
            engine.update_weights_from_distributed(
                names, dtypes, shapes, group_name=GROUP, flush_cache=last
            )
        elif kind == "per-tensor":  # (before: one broadcast per tensor)
            names, dtypes, shapes, last = rest
            pending = engine._pending_weights()
            for n, dt, s in zip(names, dtypes, shapes, strict=True):
                t = torch.empty(s, dtype=getattr(torch, dt))
                dist.broadcast(t, src=0, group=group)
                pending[n] = t
            if last:
                engine._apply_pending()
        elif kind == "end":
            engine.version = rest[0]
            outbox.put(engine.version)
        elif kind == "digest":
            outbox.put({k: _digest(v) for k, v in engine.weights.items()})


def _digest(t: Any) -> str:
    import hashlib

    import torch

    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def memcpy_seconds(nbytes: int, repeats: int = 3) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def run(
    syncs: int,
    bucket_mb: float,
    layers: int,
    warmup: int = 1,
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, Any]:
    """The figures of ``syncs`` syncs of each method (``shapes``: another model's, for tests)."""
    import torch
    import torch.distributed as dist

    from ppojob_trainer.backends.weight_sync import (
        WeightStream,
        broadcast_stream,
        bucket_meta,
        init_custom_group,
        nbytes,
    )
    from ppojob_trainer.distributed import free_port

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    weights = random_weights(shapes or qwen2_shapes(layers))
    made_s = time.perf_counter() - t0
    params = sum(v.numel() for v in weights.values())
    model_bytes = sum(nbytes(v) for v in weights.values())
    port = free_port()
    ctx = mp.get_context("spawn")
    inboxes = [ctx.Queue() for _ in range(ENGINES)]
    outbox = ctx.Queue()
    procs = [
        ctx.Process(target=_engine, args=(1 + i, port, inboxes[i], outbox)) for i in range(ENGINES)
    ]
    for p in procs:
        p.start()
    group = init_custom_group("gloo", "127.0.0.1", port, 1 + ENGINES, 0, GROUP)
    limit = int(bucket_mb * 2**20)

    def tell(msg: Any) -> None:
        for q in inboxes:
            q.put(msg)

    def confirm(version: int) -> None:
        tell(("end", version))
        held = [outbox.get() for _ in range(ENGINES)]
        assert held == [version] * ENGINES, held

    def packed(version: int) -> dict[str, float]:
        stream = WeightStream.of(weights, limit)
        t = time.perf_counter()
        stats = broadcast_stream(stream, group, "cpu", lambda *meta: tell(("packed", *meta)))
        confirm(version)
        return {
            "seconds": time.perf_counter() - t,
            "bytes": stats.bytes,
            "collectives": stats.collectives,
            "buckets": len(stream.plan),
        }

    def per_tensor(version: int) -> dict[str, float]:
        stream = WeightStream.of(weights, limit)
        t = time.perf_counter()
        sent = calls = 0
        for i, names in enumerate(stream.plan):
            bucket = stream.bucket(i)
            tell(("per-tensor", *bucket_meta(bucket, names), i == len(stream.plan) - 1))
            for n in names:
                dist.broadcast(bucket[n].contiguous(), src=0, group=group)
                sent += nbytes(bucket[n])
                calls += 1
        confirm(version)
        return {
            "seconds": time.perf_counter() - t,
            "bytes": sent,
            "collectives": calls,
            "buckets": len(stream.plan),
        }

    results: dict[str, list[dict[str, float]]] = {"packed": [], "per-tensor": []}
    version = 0
    for k in range(warmup + syncs):
        for name, method in (("packed", packed), ("per-tensor", per_tensor)):
            version += 1
            row = method(version)
            if k >= warmup:  # (the first collectives connect gloo's pairs)
                results[name].append(row)
    tell(("digest",))
    digests = [outbox.get() for _ in range(ENGINES)]
    ours = {k: _digest(v) for k, v in weights.items()}
    tell(None)
    for p in procs:
        p.join()
    return {
        "params": params,
        "model_bytes": model_bytes,
        "tensors": len(weights),
        "made_s": made_s,
        "bucket_mb": bucket_mb,
        "results": results,
        "equal": all(d == ours for d in digests),
        "memcpy_s": memcpy_seconds(model_bytes * ENGINES),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=512.0)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=1, help="syncs of each method not counted")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.records import Figure, add_record_arguments, write_record

    add_record_arguments(parser, "weight_sync")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out = run(args.syncs, args.bucket_mb, args.layers, args.warmup)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    gb = out["model_bytes"] / 1e9
    print(
        f"model: {out['params'] / 1e6:.1f} M parameters, {out['tensors']} tensors, bf16 "
        f"{gb:.3f} GB; {ENGINES} engines; buckets of {out['bucket_mb']:g} MiB; commit {commit}"
    )
    bound = out["memcpy_s"]
    print(
        f"memcpy bound (the sync's bytes copied once per engine, one process): {bound:.3f} s "
        f"({gb * ENGINES / bound:.2f} GB/s)"
    )
    print(
        f"{'method':<11} {'s/sync':>8} {'GB/s':>6} {'x bound':>8} {'bytes/sync':>12} "
        f"{'collectives':>11} {'buckets':>7}"
    )
    figures = {"memcpy_bound": Figure(bound, "s", 3, unit_shown=False)}
    for name, rows in out["results"].items():
        s = statistics.median(r["seconds"] for r in rows)
        key = f"{name.replace('-', '_')}_s_per_sync"
        figures[key] = Figure(s, "s", 3, unit_shown=False)
        r0 = rows[0]
        print(
            f"{name:<11} {s:>8.3f} {gb * ENGINES / s:>6.2f} {s / bound:>8.1f} "
            f"{int(r0['bytes']):>12} {int(r0['collectives']):>11} {int(r0['buckets']):>7}"
        )
    print("every engine holds the sender's tensors bit for bit:", out["equal"])
    if args.record:
        write_record(args.record, figures, load=args.load)


if __name__ == "__main__":
    main()
