"""Packing and token-budget micro-batches, and LoRA vs full fine-tuning, on the CPU.

    python bench/packing_lora.py                # both parts (a few minutes on 2 cores)
    python bench/packing_lora.py --part packing # or --part lora
    python bench/packing_lora.py --threads 2 --repeats 3
    python bench/packing_lora.py --samples 16 --hidden 64 --layers 2 --repeats 1  # a loaded box
    python bench/packing_lora.py --hidden 1024 --layers 2 --threads 1  # a width one trains

Model: a small real architecture, Qwen2 (grouped-query attention, RMSNorm, SwiGLU) randomly
initialised from a tiny config (hidden 128, 4 layers, 4 heads / 2 KV heads, MLP 384, vocabulary
2048: 1.3 M parameters), float32, saved to a temporary directory; no download. ``--hidden`` and
``--layers`` change its size (MLP 3x hidden; from hidden 1024 heads of 128, as Qwen2.5-1.5B/7B:
8 at 1024). Everything runs through the torch backend's real ``TorchPolicyTrainer`` (the actor),
in this process.

Packing (``--part packing``): 32 sequences per update, prompts of 8..32 tokens and responses
of 8..256 tokens drawn uniformly (seeded): a skewed task where the longest response is ~32x
the shortest. Three ways to cut the same mini-batch (and a fourth for comparison, below), all
with the same memory bound of
``8 x (32 + 256) = 2304`` tokens per micro-batch:
  - ``padded``: 8 samples per micro-batch in the batch's order, each padded to its own
    longest prompt and response (today's default: ``microBatchSize: 8``);
  - ``padded+budget``: ``maxTokensPerMicroBatch: 2304`` without packing (longest first, so each
    micro-batch holds samples of similar length: less padding);
  - ``packed+budget``: ``packing: true`` and ``maxTokensPerMicroBatch: 2304`` (sequences
    concatenated without padding, first-fit decreasing by tokens).
For each: the median over ``--repeats`` runs (after one warm-up) of one no-grad log-prob pass
(what old/ref log-probs cost) and one optimizer update (forward, backward, AdamW); the repeats
run in rounds, each timing every layout once, so a change of the machine's load between rounds
reaches all of them alike (each update's times are printed too). Tokens/s
counts the real (unpadded) prompt + response tokens of the mini-batch over that time, so it is
comparable across the three. Each row prints its speed-up over ``padded`` and over the row
before it (the budget over padded; packing over the budget alone), and what its micro-batches
were as the model got them (a hook on the input embedding during the warm-up update: the
trainer's own cut, not a formula): how many, the padding share of the token positions they
processed, and the linear bound, processed / real tokens: the most that removing the padding
can give a cost linear in tokens (attention, quadratic in a row's length, and per-micro-batch
overheads can give more; a summary line sets the measured gains beside these bounds).

LoRA (``--part lora``): the same model, 16 sequences of 32 + 96 tokens, full fine-tuning vs LoRA
rank 8 on q/k/v/o (alpha 16), both with a KL reference (kl coefficient > 0: full fine-tuning
holds a frozen reference copy; LoRA uses the base model with the adapters disabled). Figures:
median update time; the training state's bytes counted from the real tensors (weights,
gradients, AdamW moments, the reference copy); and one weight sync: its bytes and seconds, the
actor's ``export_weights()`` (what the sync sends) and a torch rollout engine's
``update_weights()`` of it in this process (a copy per weight; with LoRA, base + B A for each
adapted weight), median of max(repeats, 5) each, in float32 (the bench's dtype: the full export
then casts nothing) and in bfloat16 (the export dtype a bfloat16 run has: the float32 masters
cast once); no transfer between processes is timed. The adapters' share is also counted, not
measured, for real models (``memory_plan.Shape.lora_params``, the arithmetic ``ppojob
validate`` uses; checked against the bytes sent for the bench's model).

The machine is shared (2 cores, other jobs running): times are noisy; ratios within one run
are what to read (``--threads 1`` is steadier on a loaded machine: two threads of one process
wait on each other there). CPU attention has no varlen kernel; with packing the trainer switches
the model's ``sdpa`` attention to ``packed_attention``, which attends within each sequence of
the packed row in turn. The row ``packed, dense mask`` measures the way before it, for
comparison: transformers' block-diagonal mask over the whole row, quadratic in its length.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "api"), str(ROOT / "trainer")]
if TYPE_CHECKING:
    from bench.records import Figure

import torch  # noqa: E402

from ppojob_api.training import LoraSpec, TrainingSettings  # noqa: E402
from ppojob_trainer.backends.torch_backend import policy as torch_policy  # noqa: E402
from ppojob_trainer.backends.torch_backend.policy import TorchPolicyTrainer  # noqa: E402

BUDGET = 8 * (32 + 256)


def heads(hidden: int) -> int:
    """Attention heads: the toy's 4 (of 32 at hidden 128), and from hidden 1024 an even number
    of heads of about 128 (Qwen2.5-1.5B/7B's head width; even: 2 KV heads share them)."""
    return max(4, 2 * (hidden // 256))


def build_model(directory: Path, hidden: int = 128, layers: int = 4) -> Path:
    """A random-init Qwen2 of a tiny config, saved as a HF model directory."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads(hidden),
        num_key_value_heads=2,
        intermediate_size=3 * hidden,
        vocab_size=2048,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    Qwen2ForCausalLM(config).save_pretrained(str(directory))
    return directory


def skewed_batch(
    n: int, prompt: tuple[int, int], response: tuple[int, int], seed: int
) -> dict[str, torch.Tensor]:
    """``n`` samples: left-padded prompts and right-padded responses of uniform random lengths
    in the given (inclusive) ranges, with old log-probs and advantages."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(prompt[0], prompt[1] + 1, (n,), generator=g)
    rlen = torch.randint(response[0], response[1] + 1, (n,), generator=g)
    p, t = int(plen.max()), int(rlen.max())
    pmask = torch.arange(p)[None, :] >= (p - plen)[:, None]
    rmask = torch.arange(t)[None, :] < rlen[:, None]
    return {
        "prompt_ids": torch.where(pmask, torch.randint(1, 2048, (n, p), generator=g), 0),
        "prompt_mask": pmask,
        "response_ids": torch.where(rmask, torch.randint(1, 2048, (n, t), generator=g), 0),
        "response_mask": rmask,
        "old_logprobs": -torch.rand(n, t, generator=g) * 8,
        "advantages": torch.randn(n, t, generator=g),
    }


def loss_fn(logp, ent, mb):
    from ppojob_trainer.algorithms import policy_loss

    loss, _ = policy_loss(logp, mb["old_logprobs"], mb["advantages"], mb["response_mask"])
    return loss, {}


def timed(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class InputCounter:
    """The shapes of the token ids each model call of the trainer gets, while active: a hook on
    the model's input embedding, so it sees the micro-batches exactly as the trainer cut and
    padded (or packed) them: rows x columns, padding included."""

    def __init__(self, t: TorchPolicyTrainer) -> None:
        self.embedding = t.lm.get_input_embeddings()
        self.shapes: list[tuple[int, ...]] = []

    def __enter__(self) -> InputCounter:
        self.shapes = []
        self.handle = self.embedding.register_forward_pre_hook(
            lambda m, args: self.shapes.append(tuple(args[0].shape))
        )
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    @property
    def processed(self) -> int:
        """Token positions the model processed, padding included."""
        return sum(math.prod(s) for s in self.shapes)


def trainer(model_dir: Path, **settings) -> TorchPolicyTrainer:
    lora = settings.pop("lora", None)
    return TorchPolicyTrainer(
        model_dir,
        "float32",
        TrainingSettings(learning_rate=1e-5, **settings),
        total_updates=100,
        temperature=1.0,
        need_reference=True,  # KL on: full fine-tuning holds a reference copy
        need_entropy=False,
        lora=lora,
    )


def bench_packing(model_dir: Path, repeats: int, n: int = 32) -> dict[str, dict[str, float]]:
    batch = skewed_batch(n, (8, 32), (8, 256), seed=1)
    tokens = int(batch["prompt_mask"].sum() + batch["response_mask"].sum())
    print(
        f"packing: {n} samples, {tokens} real tokens (mean {tokens / n:.0f}/sample); "
        f"memory bound {BUDGET} tokens per micro-batch",
        flush=True,
    )
    layouts = {
        "padded": dict(micro_batch_size=8),
        "padded+budget": dict(max_tokens_per_micro_batch=BUDGET),
        "packed+budget": dict(packing=True, max_tokens_per_micro_batch=BUDGET),
        "packed, dense mask": dict(packing=True, max_tokens_per_micro_batch=BUDGET),
    }
    print(
        "  tok/s: real tokens / median update time; vs padded, vs the row before; micro-batches"
        " of the update as the model got them: count, padding share of the positions it"
        " processed, linear bound = processed / real (the most that removing the padding can"
        " give a cost linear in tokens)",
        flush=True,
    )
    trainers, counted = {}, {}
    for name, kw in layouts.items():
        if name == "packed, dense mask":  # the model keeps sdpa: the block-diagonal mask
            with mock.patch.object(torch_policy, "use_packed_attention", lambda m: False):
                t = trainers[name] = trainer(model_dir, **kw)
        else:
            t = trainers[name] = trainer(model_dir, **kw)
        fwd_in, upd_in = InputCounter(t), InputCounter(t)
        with fwd_in:  # the warm-ups, counted
            t.logprobs(batch)
        with upd_in:
            t.update(batch, loss_fn, 8)
        counted[name] = fwd_in, upd_in
    # the repeats in rounds, each timing every layout once: a change of the machine's load
    # between rounds reaches all rows alike
    times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in layouts}
    for r in range(repeats):
        t_round = time.perf_counter()
        for name, t in trainers.items():
            fwd, upd = times[name]
            t0 = time.perf_counter()
            t.logprobs(batch)
            fwd.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            t.update(batch, loss_fn, 8)
            upd.append(time.perf_counter() - t0)
        print(f"  round {r + 1}/{repeats}: {time.perf_counter() - t_round:.0f} s", flush=True)
    out: dict[str, dict[str, float]] = {}
    prev = None
    for name in layouts:
        fwd, upd = (statistics.median(x) for x in times[name])
        fwd_in, upd_in = counted[name]
        processed = upd_in.processed
        o = out[name] = {
            "logprobs_s": fwd,
            "update_s": upd,
            "tok_s": tokens / upd,
            "micro_batches": len(upd_in.shapes),
            "processed": processed,
            "padding": 1 - tokens / processed,
            "bound": processed / tokens,
            "logprobs_processed": fwd_in.processed,
        }
        vs_padded = out["padded"]["update_s"] / upd
        vs_prev = f"{out[prev]['update_s'] / upd:5.2f}x" if prev is not None else "    -"
        print(
            f"  {name:18s} update {upd:7.2f} s {tokens / upd:8.0f} tok/s  vs padded "
            f"{vs_padded:5.2f}x  vs previous {vs_prev}   {o['micro_batches']:2d} micro-batches, "
            f"{processed} positions, padding {100 * o['padding']:4.1f} %, linear bound "
            f"{o['bound']:.2f}x   | log-probs {fwd:6.2f} s {tokens / fwd:8.0f} tok/s "
            f"(vs padded {out['padded']['logprobs_s'] / fwd:.2f}x)",
            flush=True,
        )
        if fwd_in.processed != processed:
            print(f"    (the log-prob pass processed {fwd_in.processed} positions)", flush=True)
        print(
            "    update times: " + ", ".join(f"{x:.2f}" for x in times[name][1]) + " s",
            flush=True,
        )
        prev = name
    pad, bud, pak = out["padded"], out["padded+budget"], out["packed+budget"]
    print(
        "  at a cost linear in tokens: the budget alone would give "
        f"{pad['processed'] / bud['processed']:.2f}x"
        f" (measured {pad['update_s'] / bud['update_s']:.2f}x), packing on top"
        f" {bud['processed'] / pak['processed']:.2f}x (measured"
        f" {bud['update_s'] / pak['update_s']:.2f}x), both {pad['bound']:.2f}x (measured"
        f" {pad['update_s'] / pak['update_s']:.2f}x)",
        flush=True,
    )
    return out


def state_bytes(t: TorchPolicyTrainer) -> dict[str, int]:
    def size(ts) -> int:
        return sum(x.numel() * x.element_size() for x in ts)

    opt = [v for st in t.opt.optimizer.state.values() for v in st.values() if v.dim() > 0]
    return {
        "weights": size(t.model.parameters()),
        "grads": size(p for p in t.opt.params),  # one gradient per trainable parameter
        "adam": size(opt),
        "reference": size(t.reference.parameters()) if t.reference is not None else 0,
    }


def tensor_bytes(ts) -> int:
    return sum(x.numel() * x.element_size() for x in ts)


def sync_times(t: TorchPolicyTrainer, model_dir: Path, dtype: str, repeats: int) -> dict:
    """One weight sync to a torch engine in this process, in ``dtype``: the actor's
    ``export_weights()`` (what the sync sends: full weights, or the adapters alone) and the
    engine's ``update_weights()`` of them (a copy of each weight; with adapters, base + B A for
    each adapted weight), median seconds of each; the bytes sent. No transfer between
    processes or machines is in it. ``bfloat16``: the trainer's export dtype set as a bfloat16
    run's is (its float32 masters cast once in the export; an engine in bfloat16)."""
    from ppojob_trainer.backends.torch_backend.generation import TorchGenerationEngine

    own = t.dtype
    t.dtype = getattr(torch, dtype)
    try:
        engine = TorchGenerationEngine(model_dir, dtype, stop_ids=[0], pad_id=0)
        export = timed(t.export_weights, repeats)
        weights = t.export_weights()
        load = timed(lambda: engine.update_weights(weights), repeats)
    finally:
        t.dtype = own
    return {"bytes": tensor_bytes(weights.values()), "export_s": export, "load_s": load}


def bench_lora(model_dir: Path, repeats: int) -> dict[str, dict[str, float]]:
    from ppojob_api.memory_plan import KNOWN_SHAPES, Shape

    batch = skewed_batch(16, (32, 32), (96, 96), seed=2)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    lora = LoraSpec(rank=8, alpha=16, target_modules=targets)
    out: dict[str, dict] = {}
    print("LoRA: 16 samples x (32 + 96) tokens, rank 8 on q/k/v/o, KL reference on")
    trainers = {"full": trainer(model_dir), "lora": trainer(model_dir, lora=lora)}
    for name, t in trainers.items():  # bytes first: they do not depend on the machine's load
        t.update(batch, loss_fn, 16)  # one update: gradients and AdamW state exist
        mem = state_bytes(t)
        sync = tensor_bytes(t.export_weights().values())
        out[name] = {"state_bytes": sum(mem.values()), "sync_bytes": sync}
        parts = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in mem.items())
        print(
            f"  {name:5s} state {sum(mem.values()) / 2**20:6.2f} MiB ({parts})   "
            f"sync {sync / 2**20:7.4f} MiB/step",
            flush=True,
        )
    f, lo = out["full"], out["lora"]
    print(
        f"  LoRA vs full: state {100 * lo['state_bytes'] / f['state_bytes']:.0f} %, sync bytes "
        f"{100 * lo['sync_bytes'] / f['sync_bytes']:.2f} % of full",
        flush=True,
    )
    # the same shares counted (memory_plan.Shape, the arithmetic `ppojob validate` uses): this
    # model first (it must agree with the bytes measured above), then real models
    c = trainers["full"].lm.config
    shape = Shape(
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.intermediate_size,
        c.vocab_size,
        tied=bool(c.tie_word_embeddings),
        qkv_bias=True,
    )
    counted = {"this model": shape}
    counted.update({k: KNOWN_SHAPES[k] for k in ("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-7B")})
    for label, s in counted.items():
        a = s.lora_params(8, targets)
        print(
            f"  counted, not measured: {label}: {s.params / 1e6:,.1f} M parameters, rank-8 q/k/v/o "
            f"adapters {a / 1e6:.3f} M = {100 * a / s.params:.3f} %; a bfloat16 sync "
            f"{2 * a / 2**20:,.2f} MiB vs {2 * s.params / 2**20:,.1f} MiB",
            flush=True,
        )
    real = sum(p.numel() for p in trainers["full"].lm.parameters())
    if (real, f["sync_bytes"] // 4, lo["sync_bytes"] // 4) == (
        shape.params,
        shape.params,
        shape.lora_params(8, targets),
    ):
        print("  (this model's counted parameters = the parameters and float32 bytes sent)")
    else:
        print(
            f"  !! counted vs measured differ: {shape.params} / {shape.lora_params(8, targets)} "
            f"counted, {real} parameters, {f['sync_bytes'] // 4} / {lo['sync_bytes'] // 4} sent",
            flush=True,
        )
    for dtype in ("float32", "bfloat16"):
        for name, t in trainers.items():
            s = sync_times(t, model_dir, dtype, max(repeats, 5))  # cheap: more repeats
            out[name][f"sync_{dtype}"] = s
            print(
                f"  {name:5s} sync in {dtype:8s}: {s['bytes'] / 2**20:8.3f} MiB, export "
                f"{1e3 * s['export_s']:8.2f} ms, engine load {1e3 * s['load_s']:8.2f} ms, "
                f"together {1e3 * (s['export_s'] + s['load_s']):8.2f} ms",
                flush=True,
            )
        a, b = out["full"][f"sync_{dtype}"], out["lora"][f"sync_{dtype}"]
        print(
            f"  LoRA's time / full's, {dtype}: export {b['export_s'] / a['export_s']:.2f}, engine "
            f"load {b['load_s'] / a['load_s']:.2f}, together "
            f"{(b['export_s'] + b['load_s']) / (a['export_s'] + a['load_s']):.2f} (bytes "
            f"{100 * b['bytes'] / a['bytes']:.2f} %)",
            flush=True,
        )
    for name, t in trainers.items():
        upd = timed(lambda t=t: t.update(batch, loss_fn, 16), repeats)
        out[name]["update_s"] = upd
        print(f"  {name:5s} update {upd:6.3f} s", flush=True)
    print(f"  LoRA vs full: update {f['update_s'] / lo['update_s']:.2f}x faster", flush=True)
    return out


def packing_figures(out: dict[str, dict[str, float]]) -> dict[str, Figure]:
    """The packing part's printed figures per layout: the update's seconds, its speed-up over
    padded and over the layout before (``<layout>.update``, ``.update_vs_padded``,
    ``.update_vs_previous``; layouts named as in bench/README.md's tables)."""
    from bench.records import Figure

    names = {"padded": "padded", "padded+budget": "budget", "packed+budget": "packed_budget"}
    figures: dict[str, Figure] = {}
    prev = None
    for name, o in out.items():
        key = names.get(name) or re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
        figures[f"{key}.update"] = Figure(o["update_s"], "s", 2)
        if prev is not None:
            figures[f"{key}.update_vs_padded"] = Figure(
                out["padded"]["update_s"] / o["update_s"], "x", 2
            )
            figures[f"{key}.update_vs_previous"] = Figure(prev / o["update_s"], "x", 2)
        prev = o["update_s"]
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["packing", "lora", "all"], default="all")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", type=int, default=32, help="samples of the packing batch")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size (MLP: 3x)")
    ap.add_argument("--layers", type=int, default=4)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.records import add_record_arguments, command_line, write_record

    add_record_arguments(ap, "packing")  # the packing part's figures
    args = ap.parse_args(argv)
    if args.record and args.part == "lora":
        ap.error("--record writes the packing part's figures: the LoRA part has no record yet")
    from safetensors.torch import load_file

    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.repeats}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "qwen2-tiny", args.hidden, args.layers)
        n_params = sum(
            t.numel() for f in model_dir.glob("*.safetensors") for t in load_file(f).values()
        )
        print(
            f"model: Qwen2, hidden {args.hidden}, {args.layers} layers, {heads(args.hidden)} "
            f"heads / 2 KV heads, MLP {3 * args.hidden}, vocabulary 2048: "
            f"{n_params / 1e6:.1f} M parameters",
            flush=True,
        )
        if args.part in ("packing", "all"):
            packing = bench_packing(model_dir, args.repeats, args.samples)
            if args.record:
                command = None if argv is None else command_line([__file__, *argv])
                write_record(args.record, packing_figures(packing), command, load=args.load)
        if args.part in ("lora", "all"):
            bench_lora(model_dir, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
