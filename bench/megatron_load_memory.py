"""Peak host memory per rank of loading a Hugging Face model into the megatron backend (CPU, gloo).

    python bench/megatron_load_memory.py                      # tensor 1 and 2, with a reference
    python bench/megatron_load_memory.py --tp 2 --json OUT    # one layout, figures as JSON

Method: a random Llama checkpoint (fp32 safetensors, vocabulary 32, hidden 1024, intermediate
4096, 16 heads over 8 key/value groups, ``--layers`` layers: about 67 MB a layer) is written to a
temporary directory. For each tensor size, that many processes join one gloo world over
127.0.0.1 and each builds the actor (``MegatronPolicyTrainer``; ``--no-reference`` without its
frozen reference copy) from the directory. Before the build every process has imported what the
build imports (transformers, its Llama modules, megatron-core's GPTModel) and joined megatron's
groups; then its peak resident memory is reset (``/proc/self/clear_refs`` 5) and after the build
read (``VmHWM``): the figure is that peak less the resident memory just before (``added``), next
to what the rank's models hold (``shard``: the bytes of its parameters, both copies with a
reference; tensor-parallel weights 1/tp of the model, norms whole). glibc returns freed
tensors to the OS at once (``MALLOC_MMAP_THRESHOLD_=65536``, ``MALLOC_TRIM_THRESHOLD_=0``, as in
bench/memory.py), so the peak is what the load needed at its worst, not what the allocator kept.
``added - shard`` is the load's overhead over the shard it must hold anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


def write_random_llama(directory: Path, layers: int = 6, seed: int = 0) -> int:
    """A random fp32 Llama checkpoint (``config.json`` + ``model.safetensors``) in
    ``directory``, written tensor by tensor's worth of memory; returns its weight bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    hidden, inter, heads, kv, vocab = 1024, 4096, 16, 8, 32
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    config.architectures = ["LlamaForCausalLM"]
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(directory))
    d = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * d, hidden),
            p + "self_attn.k_proj.weight": (kv * d, hidden),
            p + "self_attn.v_proj.weight": (kv * d, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * d),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    g = torch.Generator().manual_seed(seed)
    tensors = {
        k: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.02)
        for k, s in shapes.items()
    }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _worker(rank: int, world: int, port: int, model_dir: str, reference: bool, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    import megatron.core.models.gpt  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401

    from ppojob_api.training import TrainerConfig
    from ppojob_trainer.backends.megatron_backend import MegatronPolicyTrainer
    from ppojob_trainer.backends.megatron_parallel import init_parallel
    from ppojob_trainer.distributed import identity

    cfg = TrainerConfig.model_validate(
        {
            "roles": {
                "actor": {
                    "replicas": world,
                    "backend": "megatron",
                    "parallelism": {"tensor": world},
                },
            },
            "algorithm": {"advantageEstimator": "grpo"},
        }
    )
    shard = identity("actor", rank, world, world, 1, 1)
    init_parallel(shard, "cpu", 0)
    import gc

    gc.collect()
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) from here
    actor = MegatronPolicyTrainer(cfg, Path(model_dir), shard, need_reference=reference)
    peak = _status("VmHWM")
    held = [actor.m.model] + ([actor.m.reference] if actor.m.reference is not None else [])
    shard_bytes = sum(p.numel() * p.element_size() for m in held for p in m.parameters())
    result = {"rank": rank, "added": peak - before, "shard": shard_bytes, "before": before}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _spawn_main() -> None:
    import torch.multiprocessing as mp

    from ppojob_trainer.distributed import free_port

    model_dir, world, reference, out = (
        sys.argv[2],
        int(sys.argv[3]),
        sys.argv[4] == "1",
        sys.argv[5],
    )
    mp.spawn(_worker, args=(world, free_port(), model_dir, reference, out), nprocs=world)


def measure(model_dir: Path, tp: int, reference: bool = True) -> list[dict[str, Any]]:
    """Per-rank figures (bytes) of building the actor at tensor size ``tp`` (a fresh process
    tree: megatron-core's state is process-global)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(str(ROOT / d) for d in ("api", "trainer", "operator", "")),
        "OMP_NUM_THREADS": "1",
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "MALLOC_TRIM_THRESHOLD_": "0",
    }
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, __file__, "--spawn", str(model_dir), str(tp), str(int(reference))]
        proc = subprocess.run(
            [*cmd, out], capture_output=True, text=True, env=env, timeout=600, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"tp {tp}: the workers failed:\n{proc.stderr[-4000:]}")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(tp)]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--spawn":
        _spawn_main()
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--json", help="write the figures here")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.records import Figure, add_record_arguments, write_record

    add_record_arguments(parser, "megatron_load_memory")
    args = parser.parse_args()
    figures: dict[str, Figure] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_bytes = write_random_llama(Path(tmp) / "model", layers=args.layers)
        print(f"model: {model_bytes / MiB:.0f} MiB fp32 ({args.layers} layers)")
        print(f"{'tp':>3} {'rank':>4} {'added MiB':>10} {'shard MiB':>10} {'overhead MiB':>13}")
        for tp in args.tp:
            for r in measure(Path(tmp) / "model", tp, reference=not args.no_reference):
                over = (r["added"] - r["shard"]) / MiB
                print(
                    f"{tp:>3} {r['rank']:>4} {r['added'] / MiB:>10.0f} {r['shard'] / MiB:>10.0f} "
                    f"{over:>13.0f}"
                )
                rows.append({"tp": tp, "model": model_bytes, **r})
                key = f"tp{tp}.rank{r['rank']}"
                mib = {"unit": "MiB", "digits": 0, "unit_shown": False}
                figures[f"{key}.added"] = Figure(r["added"] / MiB, **mib)
                figures[f"{key}.added_minus_shard"] = Figure(over, **mib)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.record:
        write_record(args.record, figures, load=args.load)


if __name__ == "__main__":
    main()
