"""The megatron backend's GPU optimizer path, as far as megatron-core runs it on a CPU.

Run as ``python megatron_gpu_path.py STORE_FILE RANK OUT.json`` by two processes, or once with
RANK ``both`` (forking the two from one process that imported megatron-core; one gloo
world over a ``FileStore``: no listener), each a data-parallel rank of a tiny GPTModel. Written
for ``tests/trainer/backends/test_megatron_gpu_path.py``; a separate process keeps
megatron-core's process-global state out of pytest's.

1. Gradient scale. The real ``_Sharded.update`` of each rank, on its half of an 8-row batch (its
   rows' token counts differ), through megatron-core's own ``DistributedDataParallel`` as the GPU
   path wraps it (``_Sharded._wrap_ddp``: ``calculate_per_token_loss``, distributed-optimizer
   buffers, the reduce-scatter over real gloo groups) and the ``finalize_model_grads`` function
   the GPU path installs (megatron's pipeline schedule calls it after the last micro-batch; on
   the CPU the backend's own schedule runs, so the optimizer step calls it here). The reduced
   gradient is compared with ONE single-process backward of the token-mean loss over all 8 rows.
2. The optimizer builder. The process groups are made with the arguments the GPU path uses
   (``parallel_kwargs(shard, "cuda")``) and ``_Sharded._megatron_optimizer`` is called:
   megatron-core's ``get_megatron_optimizer`` must get past its process-group setup (with gloo
   groups off it stopped there: "Intra partial data parallel group is not initialized"); what
   stops it on a CPU is its distributed optimizer's first CUDA allocation, which is recorded.
3. Resume. Past that point megatron-core's distributed optimizer is Python over torch whose
   only ties to CUDA are device arguments and type names: under :class:`CudaOnCpu` (a
   ``TorchFunctionMode`` that turns ``device="cuda"`` into the CPU, ``.cuda()`` into a no-op and
   names CPU tensors ``torch.cuda.*`` for its type checks) it builds and steps on the CPU with
   bf16 weights and fp32 main weights, over real gloo groups. Shard A updates twice, its
   ``state_dict`` is saved; shard B starts from the initial weights and loads it; both update
   once more: B must equal A (it used to return to the initial weights: its main weights were
   never reloaded, and Adam's moments were not saved).
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.overrides import TorchFunctionMode

warnings.filterwarnings("ignore")


class CudaOnCpu(TorchFunctionMode):
    """megatron-core's distributed optimizer on the CPU: ``device="cuda"`` -> CPU, ``.cuda()``
    -> itself, ``.type()`` of a CPU tensor -> its ``torch.cuda.*`` name (its type checks)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if args[0].is_cuda else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def tiny_shape():  # type: ignore[no-untyped-def]
    from ppojob_trainer.backends.megatron_convert import ModelShape

    return ModelShape(
        family="llama",
        layers=1,
        hidden=16,
        intermediate=32,
        heads=2,
        kv_heads=2,
        head_dim=8,
        vocab=32,
        max_positions=64,
        rms_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling_factor=None,
        tied=False,
        qkv_bias=False,
        pad_id=None,
    )


def global_batch(n: int = 8, p: int = 3, t: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    lengths = torch.tensor([5, 1, 2, 5, 4, 3, 5, 5])[:n]  # rank 1's half has more tokens
    return {
        "prompt_ids": torch.randint(1, 32, (n, p), generator=g),
        "prompt_mask": torch.ones(n, p, dtype=torch.bool),
        "response_ids": torch.randint(1, 32, (n, t), generator=g),
        "response_mask": torch.arange(t)[None, :] < lengths[:, None],
    }


def token_logp(output: torch.Tensor, index: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    from ppojob_trainer.backends.megatron_logprobs import _select

    return torch.log_softmax(_select(output, index).float(), -1).gather(-1, tokens[..., None])[
        ..., 0
    ]


def micro_loss(output: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """A token-mean loss over the micro-batch's own tokens (as the shared losses are)."""
    mask = mb["response_mask"].float()
    logp = token_logp(output, mb["_index"], mb["response_ids"])
    return -(logp * mask).sum() / mask.sum(), {}


def reduced_grads(ddp) -> None:  # type: ignore[no-untyped-def]
    """After the reduce-scatter each rank holds its shard of every bucket: gather the shards so
    every parameter's ``main_grad`` is the reduced gradient."""
    import torch.distributed as dist

    world = dist.get_world_size()
    for buffer in ddp.buffers:
        for bucket in buffer.buckets:
            data = bucket.grad_data
            k = data.numel() // world
            shards = [torch.empty(k, dtype=data.dtype) for _ in range(world)]
            dist.all_gather(shards, data[dist.get_rank() * k : (dist.get_rank() + 1) * k].clone())
            data.copy_(torch.cat(shards))


def gpu_shard(shape, initial: dict, rank: int):  # type: ignore[no-untyped-def]
    """A bf16 shard on the GPU path: DDP and megatron's distributed optimizer (on the CPU)."""
    from megatron.core import parallel_state as ps

    from ppojob_api.training import TrainerConfig
    from ppojob_trainer.backends.megatron_parallel import build_model, transformer_config
    from ppojob_trainer.backends.megatron_sharded import _Sharded
    from ppojob_trainer.distributed import ShardIdentity

    config = transformer_config(shape, torch.bfloat16, device="cpu", tp=1, pp=1)
    config.calculate_per_token_loss = True
    config.variable_seq_lengths = True
    model = build_model(shape, config, pre_process=True, post_process=True, value=False)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in initial.items()}, strict=False)
    m = _Sharded.__new__(_Sharded)
    m.shard, m.shape, m.config, m.model, m.value = (
        ShardIdentity("actor", dp_rank=rank, dp_size=2),
        shape,
        config,
        model,
        False,
    )
    m.device, m.gpu, m.first, m.last = torch.device("cpu"), False, True, True
    m.sequence_parallel, m.ps, m.ddp, m.updates, m.total_updates = False, ps, None, 0, 10
    m.te = False  # megatron-core's local layer spec
    m.routers, m.measure_routing = {}, False  # no routing replay
    m.router_aux_loss, m.routing_replay = 0.0, False  # nor a load-balancing loss
    m.settings = TrainerConfig.model_validate(
        {"training": {"learningRate": 1e-2, "adamEps": 1e-6, "gradClip": 1.0}}
    ).training
    m._wrap_ddp()
    with CudaOnCpu():
        m.optimizer = m._megatron_optimizer()

    def step() -> dict:  # megatron's schedule runs finalize_model_grads, then the step
        m.config.finalize_model_grads_func([m.ddp])
        with CudaOnCpu():
            return _Sharded._step(m)

    m._step = step
    return m


def resume(shape, initial: dict, rank: int, full: dict) -> dict:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    half = {k: v[4 * rank : 4 * rank + 4] for k, v in full.items()}
    a = gpu_shard(shape, initial, rank)
    for _ in range(2):
        a.update(half, 2, "token-mean", micro_loss)
    with CudaOnCpu():
        state = [a.state_dict()]
    dist.broadcast_object_list(state, src=0)  # the driver hands the leader's state to all
    b = gpu_shard(shape, initial, rank)
    with CudaOnCpu():
        b.load_state_dict(state[0])
    for shard in (a, b):
        shard.update(half, 2, "token-mean", micro_loss)
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    start = {k: v.to(torch.bfloat16) for k, v in initial.items()}
    return {
        "saved": sorted(state[0]),
        "b_vs_a": max(float((pa[n] - pb[n]).abs().max()) for n in pa),
        "a_moved": max(float((pa[n].float() - start[n].float()).abs().max()) for n in pa),
    }


def run(rank: int, store_file: str, out_path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_file, 2), rank=rank, world_size=2)
    from megatron.core import parallel_state as ps

    from ppojob_trainer.backends.megatron_inputs import _causal_mask, left_aligned
    from ppojob_trainer.backends.megatron_parallel import (
        _install_cpu_shims,
        build_model,
        parallel_kwargs,
        transformer_config,
    )
    from ppojob_trainer.backends.megatron_sharded import _Sharded
    from ppojob_trainer.distributed import ShardIdentity

    shard = ShardIdentity("actor", dp_rank=rank, dp_size=2)
    ps.initialize_model_parallel(**parallel_kwargs(shard, "cuda"))
    _install_cpu_shims(3, 0)
    shape = tiny_shape()
    config = transformer_config(shape, torch.float32, device="cpu", tp=1, pp=1)
    config.calculate_per_token_loss = True  # as _Sharded sets it
    config.variable_seq_lengths = True
    torch.manual_seed(0)
    model = build_model(shape, config, pre_process=True, post_process=True, value=False)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(p.numel()))
    initial = {k: v.clone() for k, v in model.state_dict().items() if v is not None}

    m = _Sharded.__new__(_Sharded)
    m.shard, m.shape, m.config, m.model, m.value = shard, shape, config, model, False
    m.device, m.gpu, m.first, m.last = torch.device("cpu"), False, True, True
    m.sequence_parallel, m.ps, m.ddp = False, ps, None
    m.te = False
    m.routers, m.measure_routing = {}, False  # no routing replay
    m.router_aux_loss, m.routing_replay = 0.0, False  # nor a load-balancing loss
    m.settings = SimpleNamespace(
        learning_rate=1e-3,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_eps=1e-8,
        grad_clip=1.0,
        micro_batch_size=None,
        max_tokens_per_micro_batch=None,
        packing=False,
    )
    m._wrap_ddp()
    m.optimizer = SimpleNamespace(zero_grad=lambda: None)

    def step() -> dict:  # the schedule's finalize_model_grads, then (on a GPU) the optimizer
        m.config.finalize_model_grads_func([m.ddp])
        return {}

    m._step = step
    full = global_batch()
    half = {k: v[4 * rank : 4 * rank + 4] for k, v in full.items()}
    m.update(half, 2, "token-mean", micro_loss)
    reduced_grads(m.ddp)
    got = {n: p.main_grad.clone() for n, p in model.named_parameters()}

    out: dict = {}
    if rank == 0:  # ONE single-process update on the full batch
        reference = build_model(shape, config, pre_process=True, post_process=True, value=False)
        reference.load_state_dict(initial, strict=False)
        ids, index = left_aligned(full)
        logits = reference(
            input_ids=ids, position_ids=None, attention_mask=_causal_mask(ids.shape[1], "cpu")
        )
        mask = full["response_mask"].float()
        loss = -(token_logp(logits, index, full["response_ids"]) * mask).sum() / mask.sum()
        loss.backward()
        want = {n: p.grad for n, p in reference.named_parameters()}
        num = sum(float((got[n] - want[n]).pow(2).sum()) for n in want) ** 0.5
        den = sum(float(want[n].pow(2).sum()) for n in want) ** 0.5
        norm = sum(float(got[n].pow(2).sum()) for n in want) ** 0.5
        out["grad_rel_err"] = num / den
        out["grad_norm_ratio"] = norm / den

    try:
        m._megatron_optimizer()
        out["optimizer"] = {"built": True}
    except Exception as exc:  # record where megatron-core stops on a CPU
        frames = traceback.extract_tb(exc.__traceback__)
        out["optimizer"] = {
            "built": False,
            "error": f"{type(exc).__name__}: {exc}",
            "frames": [f"{f.filename.split('site-packages/')[-1]}:{f.name}" for f in frames],
        }
    out["resume"] = resume(shape, initial, rank, full)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)
    dist.barrier()


def main() -> None:
    """``RANK`` ``both``: this process imports megatron-core and the backend once and forks the
    two ranks (fresh processes, no import of their own); a number: this process is that rank."""
    store_file, rank, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
    if rank != "both":
        run(int(rank), store_file, out_path)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from megatron_cases import start

    start(run, (store_file, out_path), 2)


if __name__ == "__main__":
    main()
