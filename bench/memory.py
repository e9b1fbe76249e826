"""Memory plan of a PPOJob per GPU process, by part; and a check of the plan against the real peak.

    python bench/memory.py examples/ppojob-7b-megatron-volcano.yaml           # the plan
    python bench/memory.py examples/ppojob-qwen3-moe-megatron-ep.yaml         # a MoE plan
    python bench/memory.py FILE --set roles.actor.backend=torch ...           # another layout
    python bench/memory.py --measure                                          # plan vs CPU peak
    python bench/memory.py FILE --record NAME     # also write bench/records/NAME.json (records.py)

The plan (``ppojob_api.memory_plan``) is arithmetic over the model's shape and the spec. For a
mixture-of-experts model (the Qwen3-30B-A3B-shaped example, plan only: no GPU here) it also
prints the experts' share: parameters, active parameters, and the experts' bf16 weights per
actor rank under the role's expert parallelism.
``--measure`` checks it: for a few small random-init Llama models it runs two real actor (or
critic) updates through the torch backend on the CPU, in a fresh process with glibc's mmap
threshold pinned (so freed tensors go back to the OS), and compares the peak resident memory
added by building the trainer and updating (``VmHWM`` - RSS before) with the plan's peak of the
same configuration (states + update transient).

Fit and validation rows are disjoint. ``FIT`` are the configurations the plan's activation and
logits coefficients were chosen on (``memory_plan.TrainedModel.update_transient``, commit
a77f8bf): their error is in-sample and printed as such. ``HELD_OUT`` were not used to choose
anything (another attention layout (GQA), hidden size, MLP ratio and sequence length, and
checkpointing and the critic on a new shape): their worst error is the validation figure, and
``--measure`` exits 1 when it exceeds 20 %. As a check of the fit itself, the bench also fits
one scale ``k`` of the plan's transient (least squares on the FIT rows: measured - states ~ k x
transient) and prints the held-out error of the plan with ``k``; ``k`` near 1 means the shipped
coefficients are the fit's optimum.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "api"), str(ROOT / "trainer"), str(ROOT / "operator"), str(ROOT)]

from bench.records import Figure, add_record_arguments, write_record  # noqa: E402
from ppojob_api.memory_plan import (  # noqa: E402
    GiB,
    Shape,
    TrainedModel,
    format_plan,
    gpu_gib_of,
    plan_job,
    resolve_shape,
)

# (name, shape, role, micro batch, sequence length, gradient checkpointing)
Row = tuple[str, Shape, str, int, int, bool]
# the rows the plan's coefficients were chosen on
FIT: list[Row] = [
    ("actor 21M fp32", Shape(512, 4, 8, 8, 1408, 8000), "actor", 8, 128, False),
    ("actor 21M fp32 ckpt", Shape(512, 4, 8, 8, 1408, 8000), "actor", 8, 128, True),
    ("actor 34M fp32 vocab 32k", Shape(384, 6, 6, 2, 1024, 32000), "actor", 4, 256, False),
    ("critic 21M fp32", Shape(512, 4, 8, 8, 1408, 8000), "critic", 8, 128, False),
]
# validation rows: not used to choose anything
HELD_OUT: list[Row] = [
    ("actor 45M GQA", Shape(768, 4, 12, 4, 2048, 16000), "actor", 2, 512, False),
    ("actor 45M GQA ckpt", Shape(768, 4, 12, 4, 2048, 16000), "actor", 2, 512, True),
    ("critic 45M GQA", Shape(768, 4, 12, 4, 2048, 16000), "critic", 2, 512, False),
    ("actor 15M MLP x8 seq 384", Shape(256, 6, 4, 4, 2048, 8000), "actor", 4, 384, False),
]


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _child(spec: dict) -> None:
    """One measurement, in this (fresh) process: peak RSS added by building + 2 updates."""
    import torch

    from ppojob_api.training import TrainingSettings
    from ppojob_trainer.backends.torch_backend.policy import TorchPolicyTrainer
    from ppojob_trainer.backends.torch_backend.value import TorchValueTrainer

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    torch.manual_seed(0)
    n, t = spec["micro"], spec["seq"] // 2
    vocab = spec["vocab"]
    batch = {
        "prompt_ids": torch.randint(0, vocab, (n, t)),
        "prompt_mask": torch.ones(n, t, dtype=torch.bool),
        "response_ids": torch.randint(0, vocab, (n, t)),
        "response_mask": torch.ones(n, t, dtype=torch.bool),
        "returns": torch.zeros(n, t),
    }
    settings = TrainingSettings(gradient_checkpointing=spec["ckpt"])
    # code, not data: import what building the trainer imports before taking the baseline
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModel, AutoModelForCausalLM  # noqa: F401
    from transformers.masking_utils import create_causal_mask  # noqa: F401

    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
        f.write("5")
    before = _rss("VmRSS")
    if spec["role"] == "actor":
        trainer = TorchPolicyTrainer(
            spec["dir"],
            "float32",
            settings,
            total_updates=2,
            temperature=1.0,
            need_reference=False,
            need_entropy=True,
        )

        def run() -> None:
            trainer.update(batch, lambda lp, ent, mb: (-lp.mean(), {}), micro_batch_size=n)
    else:
        trainer = TorchValueTrainer(spec["dir"], "float32", settings, total_updates=2, seed=0)

        def run() -> None:
            trainer.update(batch, lambda v, mb: ((v - mb["returns"]).pow(2).mean(), {}), n)

    for _ in range(2):  # the second update runs with the optimizer state in place
        run()
    print(json.dumps({"peak": _rss("VmHWM") - before}))


def _measured_peak(tmp: Path, row: Row) -> int:
    """Peak bytes added by building the trainer and two updates, in a fresh process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    name, shape, role, micro, seq, ckpt = row
    path = tmp / name.replace(" ", "_")
    cfg = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        tie_word_embeddings=shape.tied,
        max_position_embeddings=4096,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    spec = {
        "dir": str(path),
        "role": role,
        "micro": micro,
        "seq": seq,
        "ckpt": ckpt,
        "vocab": shape.vocab,
    }
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "MALLOC_TRIM_THRESHOLD_": "0",
        "PYTHONPATH": os.pathsep.join(str(ROOT / d) for d in ("api", "trainer", "operator")),
    }
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]


def _planned(row: Row) -> tuple[float, float]:
    """(states, update transient) of the plan, in bytes."""
    _, shape, role, micro, seq, ckpt = row
    model = TrainedModel(
        shape,
        dtype="float32",
        micro_batch=micro,
        seq_len=seq,
        gradient_checkpointing=ckpt,
        lm_head=role == "actor",
    )
    return sum(model.states().values()), sum(model.update_transient().values())


def measure() -> int:
    from ppojob_trainer.models import quiet_transformers

    quiet_transformers()
    results: dict[str, list[tuple[Row, float, float, int]]] = {"fit": [], "held-out": []}
    print(f"{'configuration':<28} {'set':<9} {'plan GiB':>9} {'measured GiB':>13} {'error':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for label, rows in (("fit", FIT), ("held-out", HELD_OUT)):
            for row in rows:
                measured = _measured_peak(Path(tmp), row)
                states, transient = _planned(row)
                planned = states + transient
                err = (planned - measured) / measured
                results[label].append((row, states, transient, measured))
                print(
                    f"{row[0]:<28} {label:<9} {planned / GiB:9.3f} {measured / GiB:13.3f} "
                    f"{err:+7.1%}",
                    flush=True,
                )

    def worst(label: str, k: float = 1.0) -> float:
        return max(abs((s + k * t - m) / m) for _, s, t, m in results[label])

    # least squares of (measured - states) ~ k x transient over the FIT rows
    fit = results["fit"]
    k = sum(t * (m - s) for _, s, t, m in fit) / sum(t * t for _, s, t, m in fit)
    held = worst("held-out")
    print(
        f"fit rows (in-sample: the plan's coefficients were chosen on them): worst error "
        f"{worst('fit'):.1%}"
    )
    print(f"held-out rows (validation): worst error {held:.1%} (limit 20%)")
    print(
        f"refit on the fit rows: transient x {k:.3f}; held-out worst error with it "
        f"{worst('held-out', k):.1%} (in-sample {worst('fit', k):.1%})"
    )
    return 0 if held <= 0.20 else 1


def _experts_line(shape: Shape, actor: object) -> str:
    """A MoE model's figures: parameters, active ones, and the experts' weights per actor rank
    (model.dtype bytes; megatron: / tensor / expert)."""
    mp = actor.parallelism  # type: ignore[attr-defined]
    megatron = actor.backend == "megatron"  # type: ignore[attr-defined]
    ep, tp = (mp.expert, mp.tensor) if megatron else (1, 1)
    per_rank = 2 * shape.expert_params / (ep * tp * (mp.pipeline if megatron else 1))
    return (
        f"experts: {shape.experts} per MoE block (top-{shape.experts_per_token}), "
        f"{shape.moe_layers} MoE blocks; {shape.params / 1e9:.2f}B parameters "
        f"({shape.expert_params / 1e9:.2f}B in experts, {shape.active_params / 1e9:.2f}B active "
        f"per token); expert weights per actor rank {per_rank / GiB:.2f} GiB in bf16 "
        f"(expert {ep}, tensor {tp}; {2 * shape.expert_params / GiB:.2f} GiB whole)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("manifest", nargs="?", help="a PPOJob manifest")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a spec field (as ppojob run --set)",
    )
    ap.add_argument("--gpu-gib", type=float, help="GPU memory; default: from the node selector")
    ap.add_argument("--measure", action="store_true", help="check the plan against CPU peaks")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    add_record_arguments(ap, "memory")  # each process's planned peak
    args = ap.parse_args()
    if args.child:
        _child(json.loads(args.child))
        return 0
    if args.measure:
        return measure()
    if not args.manifest:
        ap.error("give a manifest, or --measure")
    from ppojob_trainer.manifest import load_manifest, parse_set

    _, cfg = load_manifest(args.manifest, [parse_set(s) for s in args.set])
    actor = cfg.roles.actor
    gib = args.gpu_gib or gpu_gib_of(actor.node_selector, actor.resources.gpu_memory)
    plans = plan_job(cfg, gib)
    if not plans:
        print(
            f"unknown model shape for {cfg.model.path!r}: give a local directory with a "
            "config.json, or add it to memory_plan.KNOWN_SHAPES"
        )
        return 2
    print(f"{args.manifest}: model {cfg.model.path}, dtype {cfg.model.dtype}, GPU {gib:.0f} GiB")
    shape = resolve_shape(cfg.model.path)
    if shape is not None and shape.experts:
        print(_experts_line(shape, actor))
    print(format_plan(plans, gib))
    if args.record:
        figures = {f"{p.name}.peak": Figure(p.peak / GiB, "GiB", 2) for p in plans}
        write_record(args.record, figures, load=args.load)
    return 0 if all(p.peak <= gib * GiB for p in plans) else 1


if __name__ == "__main__":
    sys.exit(main())
