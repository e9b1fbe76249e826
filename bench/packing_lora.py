"""Packing and token-budget micro-batches, and LoRA vs full fine-tuning, on the CPU.

    python bench/packing_lora.py                # both parts (a few minutes on 2 cores)
    python bench/packing_lora.py --part packing # or --part lora
    python bench/packing_lora.py --threads 2 --repeats 3
    python bench/packing_lora.py --samples 16 --hidden 64 --layers 2 --repeats 1  # a loaded box

Model: a small real architecture, Qwen2 (grouped-query attention, RMSNorm, SwiGLU) randomly
initialised from a tiny config (hidden 128, 4 layers, 4 heads / 2 KV heads, MLP 384, vocabulary
2048: 1.2 M parameters), float32, saved to a temporary directory; no download. Everything runs
through the torch backend's real ``TorchPolicyTrainer`` (the actor), in this process.

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
(what old/ref log-probs cost) and one optimizer update (forward, backward, AdamW). Tokens/s
counts the real (unpadded) prompt + response tokens of the mini-batch over that time, so it is
comparable across the three.

LoRA (``--part lora``): the same model, 16 sequences of 32 + 96 tokens, full fine-tuning vs LoRA
rank 8 on q/k/v/o (alpha 16), both with a KL reference (kl coefficient > 0: full fine-tuning
holds a frozen reference copy; LoRA uses the base model with the adapters disabled). Figures:
median update time; the training state's bytes counted from the real tensors (weights,
gradients, AdamW moments, the reference copy); and the bytes one weight sync sends to the
rollout engines (``export_weights()``, float32 here: in bfloat16 both halve, the ratio stays).

The machine is shared (2 cores, other jobs running): times are noisy; ratios within one run
are what to read (``--threads 1`` is steadier on a loaded machine: two threads of one process
wait on each other there). CPU attention has no varlen kernel; with packing the trainer switches
the model's ``sdpa`` attention to ``packed_attention``, which attends within each sequence of
the packed row in turn. The row ``packed, dense mask`` measures the way before it, for
comparison: transformers' block-diagonal mask over the whole row, quadratic in its length.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "api"), str(ROOT / "trainer")]

import torch  # noqa: E402

from ppojob_api.training import LoraSpec, TrainingSettings  # noqa: E402
from ppojob_trainer.backends.torch_backend import policy as torch_policy  # noqa: E402
from ppojob_trainer.backends.torch_backend.policy import TorchPolicyTrainer  # noqa: E402

BUDGET = 8 * (32 + 256)


def build_model(directory: Path, hidden: int = 128, layers: int = 4) -> Path:
    """A random-init Qwen2 of a tiny config, saved as a HF model directory."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
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
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
    padded_tokens = 0
    for s in range(0, n, 8):
        rows = slice(s, s + 8)
        p = int(batch["prompt_mask"][rows].sum(1).max())
        r = int(batch["response_mask"][rows].sum(1).max())
        padded_tokens += 8 * (p + r)
    print(
        f"packing: {n} samples, {tokens} real tokens (mean {tokens / n:.0f}/sample); "
        f"micro-batches of 8 padded to their longest hold {padded_tokens} "
        f"({100 * (1 - tokens / padded_tokens):.0f} % padding); budget {BUDGET} tokens",
        flush=True,
    )
    layouts = {
        "padded": dict(micro_batch_size=8),
        "padded+budget": dict(max_tokens_per_micro_batch=BUDGET),
        "packed+budget": dict(packing=True, max_tokens_per_micro_batch=BUDGET),
        "packed, dense mask": dict(packing=True, max_tokens_per_micro_batch=BUDGET),
    }
    out = {}
    for name, kw in layouts.items():
        if name == "packed, dense mask":  # the model keeps sdpa: the block-diagonal mask
            with mock.patch.object(torch_policy, "use_packed_attention", lambda m: False):
                t = trainer(model_dir, **kw)
        else:
            t = trainer(model_dir, **kw)
        fwd = timed(lambda t=t: t.logprobs(batch), repeats)
        upd = timed(lambda t=t: t.update(batch, loss_fn, 8), repeats)
        out[name] = {"logprobs_s": fwd, "update_s": upd, "tok_s": tokens / upd}
        print(
            f"  {name:18s} log-probs {fwd:6.2f} s ({tokens / fwd:7.0f} tok/s)   "
            f"update {upd:6.2f} s ({tokens / upd:7.0f} tok/s)",
            flush=True,
        )
    base = out["padded"]
    for name in ("padded+budget", "packed+budget", "packed, dense mask"):
        o = out[name]
        print(
            f"  {name} vs padded: update {base['update_s'] / o['update_s']:.2f}x tokens/s, "
            f"log-probs {base['logprobs_s'] / o['logprobs_s']:.2f}x"
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


def bench_lora(model_dir: Path, repeats: int) -> dict[str, dict[str, float]]:
    batch = skewed_batch(16, (32, 32), (96, 96), seed=2)
    lora = LoraSpec(rank=8, alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    out = {}
    print("LoRA: 16 samples x (32 + 96) tokens, rank 8 on q/k/v/o, KL reference on")
    trainers = {"full": trainer(model_dir), "lora": trainer(model_dir, lora=lora)}
    for name, t in trainers.items():  # bytes first: they do not depend on the machine's load
        t.update(batch, loss_fn, 16)  # one update: gradients and AdamW state exist
        mem = state_bytes(t)
        sync = sum(x.numel() * x.element_size() for x in t.export_weights().values())
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
    for name, t in trainers.items():
        upd = timed(lambda t=t: t.update(batch, loss_fn, 16), repeats)
        out[name]["update_s"] = upd
        print(f"  {name:5s} update {upd:6.3f} s", flush=True)
    print(f"  LoRA vs full: update {f['update_s'] / lo['update_s']:.2f}x faster", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["packing", "lora", "all"], default="all")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", type=int, default=32, help="samples of the packing batch")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size (MLP: 3x)")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.repeats}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "qwen2-tiny", args.hidden, args.layers)
        print(f"model: Qwen2, hidden {args.hidden}, {args.layers} layers, vocabulary 2048")
        if args.part in ("packing", "all"):
            bench_packing(model_dir, args.repeats, args.samples)
        if args.part in ("lora", "all"):
            bench_lora(model_dir, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
