"""Time plan of a PPOJob: estimated seconds per step, by phase, and for the whole job.

Imports neither torch nor Ray (``ppojob validate --plan`` prints it beside the memory plan). It
is arithmetic over the model's size (:mod:`ppojob_api.memory_plan` resolves the shape), the
tokens of a step, the GPUs of each role and their backends, under assumptions that are printed
with it (:data:`ASSUMPTIONS`). It is an order of magnitude to plan a budget with, not a
measurement: `ppojob run` and the job's metrics (`time/<phase>`) give the real figures.

Per step, with N the model's parameters, S = rolloutBatchSize x samplesPerPrompt samples and
T = S x (maxPromptLength + maxResponseLength) tokens (every response at its maximum length):

``generate``     per engine (its GPUs together): prefill 2 N x prompt tokens at the
                 generation MFU, then maxResponseLength decode steps, each the larger of reading
                 the weights once (bandwidth-bound) and 2 N per sequence (compute-bound)
``logprobs``     the actor's forward over T: 2 N T at the training MFU (old log-probs)
``reference``    the same for the reference model, when the KL coefficient is > 0
``values``       the critic's forward, 2 N_critic T (GAE only)
``trainCritic``  critic updates x ppoEpochs x 6 N_critic T (forward + backward = 3 forwards)
``trainActor``   ppoEpochs x 6 N T (x 4/3 under gradientCheckpointing: one more forward)
``weightSync``   the actor's weights in the model dtype over the link between processes (none
                 when the rollout engine is colocated with the torch actor: an in-process copy)

The phases run one after another (the on-policy loop), so the step time is their sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ppojob_api.memory_plan import Shape, resolve_shape


@dataclass(frozen=True)
class Hardware:
    """One GPU and the link between processes, as assumed."""

    name: str = "H100-class GPU"
    peak_tflops: float = 989.0  # dense bf16 tensor-core peak
    memory_tbps: float = 3.35  # HBM bandwidth
    link_gbps: float = 25.0  # effective weight-sync bandwidth between processes (GB/s)


# Model FLOPs utilisation of training and generation, by backend
TRAIN_MFU = {"torch": 0.30, "megatron": 0.40}
GENERATE_MFU = {"torch": 0.05, "sglang": 0.40}
# fraction of memory bandwidth a decode step achieves, by rollout backend
DECODE_BANDWIDTH = {"torch": 0.30, "sglang": 0.70}
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class TimePlan:
    """Seconds per step by phase, the steps, and the assumptions behind them."""

    phases: dict[str, float]
    steps: int
    tokens_per_step: int
    assumptions: list[str] = field(default_factory=list)

    @property
    def step_seconds(self) -> float:
        return sum(self.phases.values())

    @property
    def total_seconds(self) -> float:
        return self.step_seconds * self.steps


def _gpus(role_spec: Any) -> int:
    return role_spec.replicas * role_spec.resources.gpus


def plan_time(half: Any, shape: Shape | None = None, hw: Hardware | None = None) -> TimePlan | None:
    """The time plan of a spec's training half (a ``TrainingHalf``); None when the model's
    shape is unknown or the actor has no GPUs (a CPU job: time it with `ppojob run`)."""
    hw = hw or Hardware()
    shape = shape or resolve_shape(half.model.path)
    roles, algo, data, tr = half.roles, half.algorithm, half.data, half.training
    actor_gpus = _gpus(roles.actor)
    if shape is None or actor_gpus == 0:
        return None
    critic_spec = roles.effective_critic(algo.needs_critic)
    critic_shape = shape
    if half.model.critic_path:
        critic_shape = resolve_shape(half.model.critic_path) or shape
    # FLOPs follow the parameters a token runs through (a MoE model's top-k experts), bytes
    # (weights read per decode step, weight sync) all of them
    n, nc = float(shape.active_params), float(critic_shape.active_params)
    total = float(shape.params)
    samples = data.samples_per_step
    prompt, response = data.max_prompt_length, data.max_response_length
    tokens = samples * (prompt + response)
    peak = hw.peak_tflops * 1e12

    def train_rate(gpus: int, backend: str) -> float:
        return gpus * peak * TRAIN_MFU[backend]

    actor_rate = train_rate(actor_gpus, roles.actor.backend)
    phases: dict[str, float] = {}

    # generation, per engine: all engines work in parallel on their share of the samples
    ro = roles.rollout
    # one worker per GPU; an engine spans its tensor (model) parallel group of workers
    engines = max(roles.workers_of("rollout") // ro.parallelism.model_parallel, 1)
    ro_gpus = actor_gpus if ro.colocate_with_actor else _gpus(ro)
    per_engine = max(ro_gpus / engines, 1e-9)
    seqs = -(-samples // engines)
    gen_rate = per_engine * peak * GENERATE_MFU[ro.backend]
    weight_bytes = _BYTES[half.model.dtype] * total
    read = weight_bytes / (per_engine * hw.memory_tbps * 1e12 * DECODE_BANDWIDTH[ro.backend])
    decode_step = max(read, 2 * n * seqs / gen_rate)
    phases["generate"] = 2 * n * seqs * prompt / gen_rate + response * decode_step

    phases["logprobs"] = 2 * n * tokens / actor_rate
    if algo.kl.coefficient > 0:
        phases["reference"] = 2 * n * tokens / actor_rate
    if critic_spec is not None:
        from ppojob_api.overrides import apply_critic_overrides

        c_gpus = actor_gpus if critic_spec.colocate_with_actor else _gpus(critic_spec)
        c_rate = train_rate(max(c_gpus, 1), critic_spec.backend)
        c_settings = apply_critic_overrides(tr, critic_spec.overrides)
        phases["values"] = 2 * nc * tokens / c_rate
        passes = algo.critic_updates_per_step * c_settings.ppo_epochs
        recompute = 4 / 3 if c_settings.gradient_checkpointing else 1.0
        phases["trainCritic"] = passes * 6 * nc * tokens * recompute / c_rate
    recompute = 4 / 3 if tr.gradient_checkpointing else 1.0
    phases["trainActor"] = tr.ppo_epochs * 6 * n * tokens * recompute / actor_rate
    in_process = ro.colocate_with_actor and roles.actor.backend == "torch" and ro.backend == "torch"
    phases["weightSync"] = 0.0 if in_process else weight_bytes / (hw.link_gbps * 1e9)

    assumptions = [
        f"{hw.name}: {hw.peak_tflops:g} TFLOP/s dense bf16, {hw.memory_tbps:g} TB/s memory; "
        f"weight sync at {hw.link_gbps:g} GB/s",
        f"training MFU {TRAIN_MFU[roles.actor.backend]:.0%} ({roles.actor.backend}); "
        f"generation MFU {GENERATE_MFU[ro.backend]:.0%} and "
        f"{DECODE_BANDWIDTH[ro.backend]:.0%} of memory bandwidth per decode step ({ro.backend})",
        f"every response at maxResponseLength: {samples} samples x ({prompt} + {response}) = "
        f"{tokens} tokens per step",
        f"model {total / 1e9:.3g}B parameters"
        + (f", {n / 1e9:.3g}B active per token" if n != total else "")
        + " (2 N FLOPs per token forward, 6 N forward + backward, N active); attention, Ray and "
        "data movement other than weight sync not counted",
        f"GPUs: actor {actor_gpus}, rollout {ro_gpus} in {engines} engine(s)"
        + (" (colocated: time-shared)" if ro.colocate_with_actor else "")
        + "; phases one after another (on-policy loop)",
    ]
    return TimePlan(phases, tr.steps, tokens, assumptions)


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.2f} s"


def format_time_plan(plan: TimePlan) -> str:
    lines = [
        f"time: {plan.step_seconds:.2f} s per step, {_duration(plan.total_seconds)} for "
        f"{plan.steps} steps ({plan.tokens_per_step / max(plan.step_seconds, 1e-9):,.0f} "
        "tokens/s)"
    ]
    for name, secs in plan.phases.items():
        lines.append(f"    {name:<14} {secs:10.3f} s")
    lines += [f"    assumes: {a}" for a in plan.assumptions]
    return "\n".join(lines)


__all__ = ["Hardware", "TimePlan", "format_time_plan", "plan_time"]
