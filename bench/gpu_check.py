"""The prepared one-GPU check: the torch backend's PPO steps and the megatron backend's update,
resume and numerics on one device, with torch and transformers (megatron-core for its part).

    python bench/gpu_check.py                       # ~1.2B random-init Llamas, bf16, cuda:0
    python bench/gpu_check.py --device cpu --tiny   # the same code path, tiny models, on the CPU

Sections (``--sections``, default all), each printing its figures, then one table:

``torch``     a random-init Llama (the Llama-3.2-1B shape by default; nothing is downloaded),
              a few PPO steps through the real backend classes (``TorchGenerationEngine``,
              ``TorchPolicyTrainer`` with a reference model, ``TorchValueTrainer``): generate ->
              old/ref log-probs and values -> critic update -> actor update -> weight sync;
              step time, tokens/s, training MFU, peak memory; then what the allocator holds
              after training and what ``empty_cache`` gives back before a colocated engine
              wakes (the wake order: empty cache -> weights -> sync -> empty cache -> KV cache).
``megatron``  ``MegatronPolicyTrainer`` (megatron-core DDP + distributed optimizer on a GPU,
              bf16 weights with fp32 main weights) updated with the shared policy loss exactly
              as the actor worker builds it (no device moves of its own: the backend must
              place the micro-batches); log-prob forward and update times, tokens/s, MFU;
              save -> load -> step: a fresh trainer loaded from the checkpoint makes the same
              next update (max |w_resumed - w| printed; 0 expected).
``fsdp``      FSDP2 with a world of one (a file-store group: gloo on CPU, nccl on a GPU): the
              torch backend's ``TorchPolicyTrainer`` with ``sharding: fsdp`` (DTensor float32
              masters, bf16 compute through FSDP's mixed precision, a sharded reference)
              updated through the actor's real losses (clipped policy loss + low-var KL); its
              sharded checkpoint saved, loaded by a fresh trainer (max |w_loaded - w|: 0) and
              both stepped on the same batch (max |w_resumed - w|: 0 on a CPU; on a GPU at most
              1% of the update's own max |dw|, backward's summation order).

MFU: model FLOPs counted by ``bench/flops.py`` on the micro-batches the backend actually runs:
every block's matmuls on every processed position, causal attention pairs, the vocabulary head
only where logits are computed (the torch backend: response positions; megatron's GPT model:
every position), the value head on all, no embedding FLOPs, an update = 3 x its forward; over
the time of those phases and the device's dense bf16 peak.

Checks that the master weights are float32 on the device, the reference and the engine hold
bfloat16, and every output is finite; exits 1 on any device or dtype error (or any other
failure), 0 otherwise. What only a multi-GPU run can show (tensor, pipeline and data
parallelism over NCCL, SGLang engines, sleep/wake across processes) is not here.
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

from flops import Micro, micro_batches, total_flops  # noqa: E402

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
    from ppojob_trainer.backends.torch_backend.generation import TorchGenerationEngine
    from ppojob_trainer.backends.torch_backend.policy import TorchPolicyTrainer
    from ppojob_trainer.backends.torch_backend.value import TorchValueTrainer
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
    if device.type == "cuda":  # what a colocated engine's wake can take back (wake order)
        held = torch.cuda.memory_reserved(device)
        torch.cuda.empty_cache()
        figures["reserved_after_training_gib"] = held / 2**30
        figures["reserved_after_empty_cache_gib"] = torch.cuda.memory_reserved(device) / 2**30
    print(
        f"device {name}: step {step_s:.3f} s, {figures['tokens_per_s']:.0f} tokens/s, "
        f"training MFU {mfu:.1%} ({train_flops / 1e12:.6g} model TFLOP in {train_s:.6g} s of "
        f"forwards and updates, peak {peak} TFLOP/s), peak memory "
        f"{figures['peak_memory_gib']:.2f} GiB"
    )
    return figures


def _untied_shape(tiny: bool) -> dict[str, int]:
    """The Llama config sizes of the megatron and fsdp sections: the tiny one, or the
    Llama-3.2-1B shape with untied embeddings."""
    return dict(
        hidden_size=64 if tiny else 2048,
        intermediate_size=256 if tiny else 8192,
        num_hidden_layers=2 if tiny else 16,
        num_attention_heads=4 if tiny else 32,
        num_key_value_heads=2 if tiny else 8,
        vocab_size=128 if tiny else 128256,
    )


def megatron(args: argparse.Namespace) -> dict[str, float]:
    """The megatron section (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ppojob_api.training import TrainerConfig
    from ppojob_trainer import algorithms as A
    from ppojob_trainer.backends.megatron_backend import MegatronPolicyTrainer
    from ppojob_trainer.distributed import ShardIdentity

    device = torch.device(args.device)
    gpu = device.type == "cuda"
    dtype = "bfloat16" if gpu else "float32"  # the megatron backend on CPU trains in float32
    shape = _untied_shape(args.tiny)
    cfg = TrainerConfig.model_validate(
        {
            "model": {"dtype": dtype},
            "roles": {"actor": {"backend": "megatron", "resources": {"gpus": int(gpu)}}},
            "data": {"rolloutBatchSize": args.batch, "samplesPerPrompt": 1},
            "training": {"learningRate": 1e-5, "microBatchSize": args.micro_batch},
        }
    )
    b, p_len, r_len = args.batch, args.prompt_len, args.response_len
    g = torch.Generator().manual_seed(0)
    batch = {
        "prompt_ids": torch.randint(3, shape["vocab_size"], (b, p_len), generator=g),
        "prompt_mask": torch.ones(b, p_len, dtype=torch.bool),
        "response_ids": torch.randint(3, shape["vocab_size"], (b, r_len), generator=g),
        "response_mask": torch.ones(b, r_len, dtype=torch.bool),
        "old_logprobs": -torch.rand(b, r_len, generator=g),
        "advantages": torch.randn(b, r_len, generator=g),
    }

    def loss_fn(logp, ent, mb):  # the actor worker's: the batch as the backend hands it
        loss, m = A.policy_loss(logp, mb["old_logprobs"], mb["advantages"], mb["response_mask"])
        return loss, {"pg_loss": loss.detach(), **m}

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize(device)

    with tempfile.TemporaryDirectory() as tmp:
        config = LlamaConfig(
            **shape, max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).save_pretrained(tmp)
        make = lambda: MegatronPolicyTrainer(  # noqa: E731
            cfg,
            tmp,
            ShardIdentity("actor"),
            need_reference=False,
            total_updates=4,
            device=str(device),
        )
        trainer = make()
        sync()
        t0 = time.perf_counter()
        logp = trainer.logprobs(batch)
        sync()
        t_logp = time.perf_counter() - t0
        trainer.update(batch, loss_fn, args.micro_batch)  # warm-up (allocations, kernels)
        sync()
        t0 = time.perf_counter()
        metrics = trainer.update(batch, loss_fn, args.micro_batch)
        sync()
        t_update = time.perf_counter() - t0
        _expect(bool(torch.isfinite(logp).all()), "megatron log-probs are not finite")
        _expect(math.isfinite(float(metrics["grad_norm"])), f"megatron grad norm {metrics}")
        # save -> load -> step: the resumed trainer makes the uninterrupted one's next update
        state = trainer.state_dict()
        resumed = make()
        resumed.load_state_dict(state)
        trainer.update(batch, loss_fn, args.micro_batch)
        resumed.update(batch, loss_fn, args.micro_batch)
        a, r = trainer.export_weights(), resumed.export_weights()
        resume_diff = max(float((a[k].float() - r[k].float()).abs().max()) for k in a)
    seq = p_len + r_len
    micros = [
        Micro(rows=min(args.micro_batch, b - lo), seq=seq, head_positions=seq)
        for lo in range(0, b, args.micro_batch)
    ]
    flops = total_flops(shape, micros, train=True)
    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    mfu = flops / t_update / (peak * 1e12) if peak else float("nan")
    figures = {
        "megatron_logprobs_s": t_logp,
        "megatron_update_s": t_update,
        "megatron_tokens_per_s": b * seq / t_update,
        "megatron_mfu": mfu,
        "megatron_resume_max_abs": resume_diff,
    }
    print(
        f"megatron on {name} ({dtype}): log-probs {t_logp:.3f} s, update {t_update:.3f} s, "
        f"{b * seq / t_update:.0f} tokens/s, MFU {mfu:.1%}; save -> load -> step: max "
        f"|w_resumed - w| {resume_diff:.3g}"
    )
    _expect(resume_diff == 0.0, f"a resumed megatron trainer diverged by {resume_diff:.3g}")
    return figures


def fsdp(args: argparse.Namespace) -> dict[str, float]:
    """The fsdp section (see the module docstring)."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from ppojob_api.training import TrainingSettings
    from ppojob_trainer import algorithms as A
    from ppojob_trainer.backends.torch_backend.policy import TorchPolicyTrainer
    from ppojob_trainer.backends.torch_backend.sharding import full_state_dict
    from ppojob_trainer.distributed import ShardIdentity
    from ppojob_trainer.models import quiet_transformers

    quiet_transformers()
    device = torch.device(args.device)
    gpu = device.type == "cuda"

    def weights(model) -> dict[str, torch.Tensor]:  # copies (on a CPU they would alias)
        return {k: v.clone() for k, v in full_state_dict(model).items()}

    shape = _untied_shape(args.tiny)
    b, p_len, r_len = args.batch, args.prompt_len, args.response_len
    g = torch.Generator().manual_seed(0)
    batch = {
        "prompt_ids": torch.randint(3, shape["vocab_size"], (b, p_len), generator=g),
        "prompt_mask": torch.ones(b, p_len, dtype=torch.bool),
        "response_ids": torch.randint(3, shape["vocab_size"], (b, r_len), generator=g),
        "response_mask": torch.ones(b, r_len, dtype=torch.bool),
        "advantages": torch.randn(b, r_len, generator=g),
    }

    def policy_loss(logp, ent, mb):  # the actor's losses: clipped policy loss + KL to the ref
        loss, m = A.policy_loss(logp, mb["old_logprobs"], mb["advantages"], mb["response_mask"])
        kl = A.kl_loss(logp, mb["ref_logprobs"], mb["response_mask"], "low_var_kl", "token-mean")
        return loss + 0.001 * kl, {"pg_loss": loss.detach(), **m}

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize(device)

    with tempfile.TemporaryDirectory() as tmp:
        # a world of one through a file store: no listener
        store = dist.FileStore(str(Path(tmp) / "store"), 1)
        dist.init_process_group("nccl" if gpu else "gloo", store=store, rank=0, world_size=1)
        try:
            group = dist.new_group([0])
            cfg = LlamaConfig(
                **shape, max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0
            )
            torch.manual_seed(0)
            LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(Path(tmp) / "model")
            settings = TrainingSettings(
                learning_rate=1e-5, micro_batch_size=args.micro_batch, sharding="fsdp"
            )
            make = lambda: TorchPolicyTrainer(  # noqa: E731
                Path(tmp) / "model",
                "bfloat16",
                settings,
                total_updates=4,
                temperature=1.0,
                need_reference=True,
                group=group,
                dp_size=1,
                device=str(device),
            )
            actor = make()
            _expect(actor.opt.sharded, "fsdp: the actor was not wrapped with FSDP2")
            kinds = {type(q).__name__ for q in actor.model.parameters()}
            _expect(kinds == {"DTensor"}, f"fsdp: parameters are {sorted(kinds)}, not DTensors")
            batch["old_logprobs"] = actor.logprobs(batch)
            batch["ref_logprobs"] = actor.logprobs(batch, reference=True)
            before = weights(actor.model)
            sync()
            t0 = time.perf_counter()
            metrics = actor.update(batch, policy_loss, args.micro_batch)
            sync()
            t_update = time.perf_counter() - t0
            for key, val in metrics.items():
                _expect(math.isfinite(val), f"fsdp: metric {key} = {val}")
            after = weights(actor.model)
            moved = max(float((after[k] - before[k]).abs().max()) for k in after)
            # save -> load -> step: a fresh FSDP2 trainer loaded from the sharded checkpoint
            # makes the uninterrupted one's next update
            shard = ShardIdentity("actor")
            actor.save_checkpoint(Path(tmp) / "ckpt", shard)
            resumed = make()
            resumed.load_checkpoint(Path(tmp) / "ckpt", shard)
            loaded = weights(resumed.model)
            load_diff = max(float((loaded[k] - after[k]).abs().max()) for k in after)
            actor.update(batch, policy_loss, args.micro_batch)
            resumed.update(batch, policy_loss, args.micro_batch)
            a, r = weights(actor.model), weights(resumed.model)
            resume_diff = max(float((a[k] - r[k]).abs().max()) for k in a)
            masters = {q.dtype for q in actor.model.parameters()}
            _expect(masters == {torch.float32}, f"fsdp: master weights are {masters}")
        finally:
            dist.destroy_process_group()
    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    figures = {
        "fsdp_update_s": t_update,
        "fsdp_tokens_per_s": b * (p_len + r_len) / t_update,
        "fsdp_update_max_abs": moved,
        "fsdp_load_max_abs": load_diff,
        "fsdp_resume_max_abs": resume_diff,
        "fsdp_peak_memory_gib": _peak_memory(device),
    }
    print(
        f"fsdp (FSDP2, world 1) on {name}: update {t_update:.3f} s "
        f"(max |dw| {moved:.3g}, pg_loss {metrics['pg_loss']:.4f}); save -> load: max "
        f"|w_loaded - w| {load_diff:.3g}; -> step: max |w_resumed - w| {resume_diff:.3g}"
    )
    _expect(moved > 0, "fsdp: the update did not change the weights")
    _expect(load_diff == 0.0, f"fsdp: the loaded weights differ by {load_diff:.3g}")
    # a GPU's backward may sum in another order (atomics); its step is still far from a revert
    bound = 0.0 if not gpu else 1e-2 * moved
    _expect(resume_diff <= bound, f"fsdp: a resumed trainer diverged by {resume_diff:.3g}")
    return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny models (for a CPU run)")
    ap.add_argument(
        "--sections", default="torch,fsdp,megatron", help="any of torch, fsdp, megatron"
    )
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
    sections = {"torch": run, "fsdp": fsdp, "megatron": megatron}
    figures: dict[str, float] = {}
    try:
        for name in args.sections.split(","):
            figures.update(sections[name.strip()](args))
    except CheckError as exc:
        print(f"gpu_check: FAILED: {exc}", file=sys.stderr)
        return 1
    except Exception:  # a device or dtype mismatch inside torch surfaces as RuntimeError
        traceback.print_exc()
        print("gpu_check: FAILED (see the traceback above)", file=sys.stderr)
        return 1
    print(f"{'figure':<34} value")
    for key, value in figures.items():
        print(f"{key:<34} {value:.6g}")
    print("gpu_check: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
