"""The memory plan's verdict (``ppojob_api.memory_plan``): a job whose plan does not fit its GPUs
is refused, by `ppojob validate`, by the operator before any pod starts, and by the trainer at
start (where a model directory on a volume makes its shape known)."""

from __future__ import annotations

from ppojob_api.memory_plan import plan_problems
from ppojob_api.problems import Problem
from ppojob_api.training import TrainingHalf


def check_memory_plan(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """Every process on a GPU fits it, and a colocated sglang engine wakes after step 1 (its
    gpuMemoryFraction as written, or the plan's when unset). Judged only on a spec with no other
    problem (the plan reads the whole spec); silent where the model's shape is unknown here.
    ``resources.gpuMemory`` is read from the actor alone (every GPU of the job is judged by
    it): set on another role it is refused rather than ignored."""
    elsewhere = [
        Problem(
            f"{prefix}.roles.{name}.resources.gpuMemory",
            "the memory plan judges every GPU of the job by the actor's size; this one would be "
            "ignored",
            "set roles.actor.resources.gpuMemory instead and remove this one",
        )
        for name in ("critic", "rollout", "reward", "sandbox")
        if (role := getattr(half.roles, name, None)) is not None
        and getattr(getattr(role, "resources", None), "gpu_memory", None) is not None
    ]
    return elsewhere or plan_problems(half, prefix)
