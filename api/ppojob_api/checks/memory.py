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
    problem (the plan reads the whole spec); silent where the model's shape is unknown here."""
    return plan_problems(half, prefix)
