"""Packing and token-budget micro-batches in the megatron backend, on the CPU.

    python bench/megatron_packing.py                      # a few minutes on 2 cores
    python bench/megatron_packing.py --samples 16 --repeats 1   # a loaded box

Method: the same model, batch and three layouts as ``bench/packing_lora.py --part packing``
(a random-init Qwen2: hidden 128, 4 layers, 4 heads / 2 KV heads, vocabulary 2048; 32
sequences, prompts of 8..32 and responses of 8..256 tokens drawn uniformly, seeded; a memory
bound of ``8 x (32 + 256) = 2304`` tokens per micro-batch: ``padded`` = 8 samples per
micro-batch padded to their own longest, ``padded+budget`` = ``maxTokensPerMicroBatch: 2304``,
``packed+budget`` = that and ``packing: true``), run through the megatron backend's real
``MegatronPolicyTrainer`` (megatron-core ``GPTModel``, local layer spec: a packed row attends
through a block-diagonal causal mask) in one process (a gloo world of 1: tensor, pipeline and
data parallel 1), float32. For each layout: the median over ``--repeats`` runs (after one
warm-up) of one no-grad log-prob pass and one optimizer update; tokens/s counts the real
(unpadded) tokens over that time. The machine is shared: read the ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "api"), str(ROOT / "trainer"), str(ROOT / "bench")]

import torch  # noqa: E402
from packing_lora import BUDGET, build_model, loss_fn, skewed_batch, timed  # noqa: E402


def actor(model_dir: Path, **training):  # type: ignore[no-untyped-def]
    from ppojob_api.training import TrainerConfig
    from ppojob_trainer.backends.megatron_backend import MegatronPolicyTrainer
    from ppojob_trainer.distributed import identity

    cfg = TrainerConfig.model_validate(
        {
            "roles": {"actor": {"backend": "megatron"}},
            "training": {"learningRate": 1e-5, **training},
            "data": {"rolloutBatchSize": 4, "samplesPerPrompt": 2},
        }
    )
    return MegatronPolicyTrainer(
        cfg, model_dir, identity("actor", 0, 1), need_reference=False, total_updates=100
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", type=int, default=32)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ppojob_trainer.distributed import free_port

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    n = args.samples
    batch = skewed_batch(n, (8, 32), (8, 256), seed=1)
    tokens = int(batch["prompt_mask"].sum() + batch["response_mask"].sum())
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.repeats}")
    print(f"megatron actor, Qwen2 hidden 128 x 4 layers; {n} samples, {tokens} real tokens")
    layouts = {
        "padded": {"microBatchSize": 8},
        "padded+budget": {"maxTokensPerMicroBatch": BUDGET},
        "packed+budget": {"packing": True, "maxTokensPerMicroBatch": BUDGET},
    }
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "qwen2-tiny")
        for name, training in layouts.items():
            a = actor(model_dir, **training)
            fwd = timed(lambda a=a: a.logprobs(batch), args.repeats)
            upd = timed(lambda a=a: a.update(batch, loss_fn, 8), args.repeats)
            out[name] = (fwd, upd)
            print(
                f"  {name:14s} log-probs {fwd:6.2f} s ({tokens / fwd:7.0f} tok/s)   "
                f"update {upd:6.2f} s ({tokens / upd:7.0f} tok/s)",
                flush=True,
            )
            ps.destroy_model_parallel()
    base = out["padded"]
    for name in ("padded+budget", "packed+budget"):
        fwd, upd = out[name]
        print(
            f"  {name} vs padded: update {base[1] / upd:.2f}x tokens/s, "
            f"log-probs {base[0] / fwd:.2f}x"
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
