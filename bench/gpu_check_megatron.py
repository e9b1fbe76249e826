"""GPU check of the megatron backend: one actor update of a randomly initialised Llama.

Default on a GPU: a ~1.2B Llama (the Llama-3.2-1B shape: hidden 2048, 16 layers, 32 heads,
8 key/value heads, vocabulary 128256) in bf16, tensor parallel 1, on one GPU, through
``MegatronPolicyTrainer`` (megatron-core DDP + distributed optimizer, bf16 weights with fp32 main
weights). It prints the time of the log-prob forward and of one update (after a warm-up one), the
model FLOPs utilisation and the peak GPU memory.

MFU: the update's model FLOPs, counted by ``bench/flops.py``: every block's matmuls on every
position, causal attention pairs, the output layer on every position (megatron's GPT model
projects the whole sequence; the log-probs then pick the response positions), no embedding
FLOPs, an update = 3 x its forward; over the update's time and the GPU's dense bf16 peak.

Without a GPU it runs the same code on the CPU with a tiny Llama in float32 (``--model tiny``,
the default there), so the script's path (config, model directory, trainer, loss, update) is
checked on any machine; its MFU line then says n/a.

The GPU image has torch and transformers but not megatron-core: install its wheel first
(``pip install --no-deps megatron_core-0.16.*.whl``; the wheel is a few MB).

Usage: python bench/gpu_check_megatron.py [--model 1b|tiny] [--batch 8] [--prompt 256]
       [--response 768] [--micro 4] [--peak-tflops N]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flops import Micro, total_flops

SHAPES = {
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
}
# Dense bf16 peak TFLOP/s by device name (tensor cores, no sparsity).
PEAKS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def _model_dir(name: str, root: Path, dtype: torch.dtype) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        **SHAPES[name],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    out = root / f"llama-{name}"
    model.save_pretrained(out)
    return out


def _config(device: str, dtype: str, micro: int, batch: int) -> object:
    from ppojob_api.training import TrainerConfig

    gpus = 1 if device == "cuda" else 0
    return TrainerConfig.model_validate(
        {
            "model": {"dtype": dtype},
            "roles": {"actor": {"backend": "megatron", "resources": {"gpus": gpus}}},
            "data": {"rolloutBatchSize": batch, "samplesPerPrompt": 1},
            "training": {"learningRate": 1e-6, "microBatchSize": micro},
        }
    )


def _batch(n: int, prompt: int, response: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(n, response, dtype=torch.bool)
    return {
        "prompt_ids": torch.randint(1, vocab, (n, prompt), generator=g),
        "prompt_mask": torch.ones(n, prompt, dtype=torch.bool),
        "response_ids": torch.randint(1, vocab, (n, response), generator=g),
        "response_mask": mask,
        "old_logprobs": -torch.rand(n, response, generator=g),
        "advantages": torch.randn(n, response, generator=g),
    }


def update_flops(shape: dict[str, int], batch: int, seq: int, micro: int) -> int:
    """Model FLOPs of one update of ``batch`` unpadded rows of ``seq`` positions run ``micro``
    rows at a time, the output layer on every position (see the module docstring)."""
    micros = [
        Micro(rows=min(micro, batch - lo), seq=seq, head_positions=seq)
        for lo in range(0, batch, micro)
    ]
    return total_flops(shape, micros, train=True)


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--model", choices=sorted(SHAPES), default="1b" if cuda else "tiny")
    parser.add_argument("--batch", type=int, default=8 if cuda else 4)
    parser.add_argument("--prompt", type=int, default=256 if cuda else 8)
    parser.add_argument("--response", type=int, default=768 if cuda else 8)
    parser.add_argument("--micro", type=int, default=4 if cuda else 2)
    parser.add_argument("--peak-tflops", type=float, default=None)
    args = parser.parse_args()

    from ppojob_trainer import algorithms as A
    from ppojob_trainer.backends.base import ShardIdentity
    from ppojob_trainer.backends.megatron_backend import MegatronPolicyTrainer

    device = "cuda" if cuda else "cpu"
    dtype = "bfloat16" if cuda else "float32"
    cfg = _config(device, dtype, args.micro, args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model_dir = _model_dir(args.model, Path(tmp), torch.bfloat16 if cuda else torch.float32)
        t_save = time.perf_counter() - t0
        t0 = time.perf_counter()
        trainer = MegatronPolicyTrainer(
            cfg,
            model_dir,
            ShardIdentity("actor"),
            need_reference=False,
            total_updates=2,
            device=device,
        )
        t_build = time.perf_counter() - t0
    params = sum(p.numel() for p in trainer.m.model.parameters())
    batch = _batch(args.batch, args.prompt, args.response, SHAPES[args.model]["vocab_size"])

    def loss_fn(logp, ent, mb):  # type: ignore[no-untyped-def]
        loss, _ = A.policy_loss(
            logp,
            mb["old_logprobs"].to(logp.device),
            mb["advantages"].to(logp.device),
            mb["response_mask"].to(logp.device),
        )
        return loss, {"pg_loss": float(loss.detach())}

    def timed(fn):  # type: ignore[no-untyped-def]
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - start

    logp, t_logp = timed(lambda: trainer.logprobs(batch))
    trainer.update(batch, loss_fn, args.micro)  # warm-up (allocations, kernels)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    metrics, t_update = timed(lambda: trainer.update(batch, loss_fn, args.micro))
    seq = args.prompt + args.response
    tokens = args.batch * seq
    flops = update_flops(SHAPES[args.model], args.batch, seq, args.micro)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = args.peak_tflops or next((v for k, v in PEAKS.items() if k in name), None)
    mfu = flops / t_update / (peak * 1e12) if (cuda and peak) else None
    report = {
        "device": name,
        "model": f"llama-{args.model}",
        "parameters": params,
        "dtype": dtype,
        "batch": args.batch,
        "sequence": seq,
        "micro_batch": args.micro,
        "save_s": round(t_save, 2),
        "build_s": round(t_build, 2),
        "logprobs_s": round(t_logp, 4),
        "update_s": round(t_update, 4),
        "tokens_per_s": round(tokens / t_update, 1),
        "model_tflop": flops / 1e12,
        "mfu": None if mfu is None else round(mfu, 4),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "grad_norm": metrics["grad_norm"],
        "logprobs_finite": bool(torch.isfinite(logp).all()),
    }
    print(json.dumps(report, indent=1))
    print(
        f"megatron actor update: {report['update_s']} s, {report['tokens_per_s']} tokens/s, "
        f"MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}, peak memory "
        f"{report['peak_memory_gib'] or 'n/a'} GiB on {name}"
    )


if __name__ == "__main__":
    main()
