"""A prepared GPU check of the torch backend: one process, torch + transformers only.

    python bench/gpu_check.py                       # ~1.2B random-init Llama, bf16, cuda:0
    python bench/gpu_check.py --device cpu --tiny   # the same code path, tiny model, on the CPU

Builds a random-init Llama (the Llama-3.2-1B shape by default; nothing is downloaded), saves it to
a temporary directory and runs a few PPO steps through the real backend classes
(``TorchGenerationEngine``, ``TorchPolicyTrainer`` with a reference model, ``TorchValueTrainer``):
generate -> old/ref log-probs and values -> critic update -> actor update -> weight sync. No
Ray, Megatron or SGLang. Prints the step time, tokens/s, the training MFU and the peak memory.

MFU: the model FLOPs of the log-prob/value forwards and the two updates, counted by
``bench/flops.py`` on the micro-batches the backend actually runs (each trimmed to its own longest
prompt and response): every block's matmuls on every processed position, causal attention
pairs, the LM head only on response positions (the value head on all), no embedding FLOPs, an
update = 3 x its forward; over the time of those phases and the device's dense bf16 peak.

Checks that the master weights are float32 on the device, the reference and the engine hold
bfloat16, and every output is finite; exits 1 on any device or dtype error (or any other
failure), 0 otherwise.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "api"), str(ROOT / "trainer"), str(ROOT / "bench")]

from flops import micro_batches, total_flops  # noqa: E402

# dense bf16 peak FLOP/s by device name (spec sheets)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


class CheckError(RuntimeError):
    """A device or dtype expectation failed."""


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise CheckError(what)


def _peak_memory(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def run(args: argparse.Namespace) -> dict[str, float]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ppojob_api.training import TrainingSettings
    from ppojob_trainer import algorithms as A
    from ppojob_trainer.backends.torch_backend import (
        TorchGenerationEngine,
        TorchPolicyTrainer,
        TorchValueTrainer,
    )
    from ppojob_trainer.models import count_parameters, quiet_transformers

    quiet_transformers()
    device = torch.device(args.device)
    if device.type == "cuda":
        _expect(torch.cuda.is_available(), "--device cuda but torch sees no GPU")
        torch.cuda.set_device(device)
    if args.tiny:
        shape = dict(
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
        )
    else:  # the Llama-3.2-1B shape, 1.24B parameters
        shape = dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            tie_word_embeddings=True,
        )
    cfg = LlamaConfig(
        **shape, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    torch.manual_seed(0)
    b, p_len, r_len = args.batch, args.prompt_len, args.response_len
    with tempfile.TemporaryDirectory() as tmp:
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        n_params = count_parameters(model)
        model.save_pretrained(tmp)
        del model
        print(f"model: random-init Llama, {n_params:,} parameters, device {device}")
        settings = TrainingSettings(
            learning_rate=1e-6,
            micro_batch_size=args.micro_batch,
            gradient_checkpointing=args.gradient_checkpointing,
        )
        engine = TorchGenerationEngine(tmp, "bfloat16", [2], 0, device=str(device))
        actor = TorchPolicyTrainer(
            tmp,
            "bfloat16",
            settings,
            total_updates=args.steps,
            temperature=1.0,
            need_reference=True,
            device=str(device),
        )
        critic = TorchValueTrainer(
            tmp, "bfloat16", settings, total_updates=args.steps, seed=0, device=str(device)
        )
    for name, module, dtype in (
        ("actor master weights", actor.model, torch.float32),
        ("critic master weights", critic.model, torch.float32),
        ("reference", actor.reference, torch.bfloat16),
        ("rollout engine", engine.model, torch.bfloat16),
    ):
        found = {(q.device.type, q.dtype) for q in module.parameters()}
        want = {(device.type, dtype)}
        _expect(found == want, f"{name}: expected {want}, found {sorted(map(str, found))}")

    def policy_loss(logp, ent, mb):
        loss, m = A.policy_loss(logp, mb["old_logprobs"], mb["advantages"], mb["response_mask"])
        kl = A.kl_loss(logp, mb["ref_logprobs"], mb["response_mask"], "low_var_kl", "token-mean")
        return loss + 0.001 * kl, {"pg_loss": loss.detach(), **m}

    def value_loss(values, mb):
        loss, m = A.value_loss(values, mb["old_values"], mb["returns"], mb["response_mask"], 0.2)
        return loss, {"vf_loss": loss.detach(), **m}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    gen = torch.Generator().manual_seed(1)
    rows = []
    for step in range(args.steps):
        prompts = torch.randint(3, cfg.vocab_size, (b, p_len), generator=gen)
        pmask = torch.ones(b, p_len, dtype=torch.bool)
        sync()
        t0 = time.perf_counter()
        out = engine.generate(
            prompts, pmask, max_new_tokens=r_len, temperature=1.0, top_p=1.0, seed=step
        )
        sync()
        t1 = time.perf_counter()
        batch = {
            "prompt_ids": prompts,
            "prompt_mask": pmask,
            "response_ids": out.response_ids,
            "response_mask": out.response_mask,
        }
        batch["old_logprobs"] = actor.logprobs(batch)
        batch["ref_logprobs"] = actor.logprobs(batch, reference=True)
        batch["old_values"] = critic.values(batch)
        scores = torch.rand(b, generator=gen)
        rewards = A.shape_token_rewards(scores, out.response_mask)
        adv, ret = A.compute_advantages(
            "gae",
            token_rewards=rewards,
            scores=scores,
            values=batch["old_values"],
            mask=out.response_mask,
            group_ids=torch.arange(b),
            gamma=1.0,
            lam=0.95,
            whiten=True,
        )
        batch["advantages"], batch["returns"] = adv, ret
        sync()
        t2 = time.perf_counter()
        cm = critic.update(batch, value_loss, args.micro_batch)
        am = actor.update(batch, policy_loss, args.micro_batch)
        sync()
        t3 = time.perf_counter()
        engine.update_weights(actor.export_weights())
        sync()
        t4 = time.perf_counter()
        for key, val in {**batch, "rollout_logprobs": out.logprobs}.items():
            if val.is_floating_point():
                _expect(bool(torch.isfinite(val).all()), f"step {step}: {key} is not finite")
        for key, val in {**am, **cm}.items():
            _expect(math.isfinite(val), f"step {step}: metric {key} = {val}")
        tokens = int(out.response_mask.sum()) + b * p_len
        micros = micro_batches(pmask, out.response_mask, args.micro_batch)
        # forwards: old and reference log-probs, values; updates: critic and actor
        flops = 2 * total_flops(shape, micros, train=False) + total_flops(
            shape, micros, train=False, head="value"
        )
        flops += total_flops(shape, micros, train=True, head="value")
        flops += total_flops(shape, micros, train=True)
        rows.append(
            {
                "generate": t1 - t0,
                "forward": t2 - t1,
                "train": t3 - t2,
                "sync": t4 - t3,
                "step": t4 - t0,
                "tokens": tokens,
                "flops": flops,
            }
        )
        print(
            f"step {step}: {t4 - t0:7.3f} s (generate {t1 - t0:.3f}, log-probs/values "
            f"{t2 - t1:.3f}, critic+actor update {t3 - t2:.3f}, weight sync {t4 - t3:.3f}); "
            f"pg_loss {am['pg_loss']:.4f} vf_loss {cm['vf_loss']:.4f}"
        )

    timed = rows[1:] or rows  # the first step includes warm-up
    step_s = sum(r["step"] for r in timed) / len(timed)
    train_s = sum(r["train"] + r["forward"] for r in timed) / len(timed)
    train_flops = sum(r["flops"] for r in timed) / len(timed)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    mfu = train_flops / train_s / (peak * 1e12) if peak else float("nan")
    figures = {
        "step_s": step_s,
        "tokens_per_s": sum(r["tokens"] for r in timed) / len(timed) / step_s,
        "train_mfu": mfu,
        "train_tflop": train_flops / 1e12,
        "train_s": train_s,
        "peak_memory_gib": _peak_memory(device),
    }
    print(
        f"device {name}: step {step_s:.3f} s, {figures['tokens_per_s']:.0f} tokens/s, "
        f"training MFU {mfu:.1%} ({train_flops / 1e12:.6g} model TFLOP in {train_s:.6g} s of "
        f"forwards and updates, peak {peak} TFLOP/s), peak memory "
        f"{figures['peak_memory_gib']:.2f} GiB"
    )
    return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (for a CPU run)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--peak-tflops", type=float, help="the device's peak bf16 TFLOP/s")
    args = ap.parse_args()
    if args.tiny:
        args.batch, args.micro_batch = min(args.batch, 4), min(args.micro_batch, 2)
        args.prompt_len, args.response_len = min(args.prompt_len, 8), min(args.response_len, 8)
    try:
        run(args)
    except CheckError as exc:
        print(f"gpu_check: FAILED: {exc}", file=sys.stderr)
        return 1
    except Exception:  # a device or dtype mismatch inside torch surfaces as RuntimeError
        traceback.print_exc()
        print("gpu_check: FAILED (see the traceback above)", file=sys.stderr)
        return 1
    print("gpu_check: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
