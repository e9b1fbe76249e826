"""Sizes that cannot work, found before anything starts."""

from __future__ import annotations

from ppojob_api.problems import Problem
from ppojob_api.quantity import is_bare_number, quantity_value
from ppojob_api.training import TrainingHalf
from ppojob_api.trainspec.constants import BUILTIN_CONTEXT, BUILTIN_SHAPES

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def quantity_bytes(value: str) -> float:
    """A Kubernetes quantity (`4Gi`, `512M`, `1000`, `500m`, `2e9`) as a number (bytes for
    memory)."""
    return quantity_value(value)


def _gib(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} bytes"


def shown_memory(memory: str) -> str:
    """A memory quantity as a message shows it (a bare number says it is bytes)."""
    if is_bare_number(memory):
        return f"{memory} bytes (a bare number is bytes, as in Kubernetes: write 2Gi for 2 GiB)"
    return memory


def check_sizes(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """Sizes that cannot work, found before anything starts (a small independent bound, not a
    memory plan): a sequence longer than a built-in model's context, and a rollout or training
    batch whose KV cache or activations alone exceed a CPU pod's memory. Lower bounds only, so a
    job this refuses could never have run."""
    data, roles = half.data, half.roles
    path = half.model.path
    if not path.startswith("builtin:") or path[8:] not in BUILTIN_SHAPES:
        return []  # real models: the backend's memory plan sizes them from the model's config
    problems: list[Problem] = []
    seq = data.max_prompt_length + data.max_response_length
    if seq > BUILTIN_CONTEXT:
        problems.append(
            Problem(
                f"{prefix}.data.maxResponseLength",
                f"maxPromptLength + maxResponseLength = {data.max_prompt_length} + "
                f"{data.max_response_length} = {seq} tokens, but {path} takes at most "
                f"{BUILTIN_CONTEXT}",
                f"keep maxPromptLength + maxResponseLength <= {BUILTIN_CONTEXT}",
            )
        )
        return problems
    hidden, inter, layers = BUILTIN_SHAPES[path[8:]]
    width = _DTYPE_BYTES[half.model.dtype]
    n = data.samples_per_step
    for name, per_token, what in (
        ("rollout", 2 * layers * hidden * width, "KV cache of its share of the rollout batch"),
        ("actor", layers * (4 * hidden + 2 * inter) * 4, "activations of one micro-batch"),
    ):
        spec = getattr(roles, name)
        owner = roles.actor if getattr(spec, "colocate_with_actor", False) else spec
        if owner.resources.gpus:
            continue  # GPU memory is the backend's memory plan's business
        workers = max(roles.workers_of(name), 1)
        dp = max(workers // spec.parallelism.model_parallel, 1)
        share = -(-n // dp)
        if name == "actor":
            mini = half.training.mini_batch_size or n
            share = half.training.micro_batch_size or max(mini // dp, 1)
        need = share * seq * per_token
        have = quantity_bytes(owner.resources.memory)  # a CPU pod's (GPU pods skipped)
        if need > have:
            where = "actor" if owner is roles.actor else name
            problems.append(
                Problem(
                    f"{prefix}.roles.{where}.resources.memory",
                    f"the {name}'s {what} ({share} samples x {seq} tokens) needs at least "
                    f"{_gib(need)}, more than the pod's {shown_memory(owner.resources.memory)}",
                    "raise the memory, or lower rolloutBatchSize, samplesPerPrompt, "
                    "maxResponseLength or microBatchSize",
                )
            )
    return problems


# What the megatron backend splits in the built-in models (models.BUILTIN_MODELS, which needs
# torch): family, hidden, intermediate, layers, heads, key/value heads, vocabulary. A trainer test
