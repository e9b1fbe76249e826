"""Built-in models, tasks, agents and tools; the estimator families the checks and defaults use."""

from __future__ import annotations

BUILTIN_MODELS = ("tiny-llama", "tiny-qwen2", "small-llama", "tiny-qwen3-moe", "tiny-mixtral")
BUILTIN_MOE_MODELS = {"tiny-qwen3-moe": (8, 2), "tiny-mixtral": (8, 2)}
"""The built-in mixture-of-experts models: (experts per layer, experts per token)."""
BUILTIN_TEACHERS = ("count-up-teacher",)
"""Built-in teacher models (algorithm.distillation.teacher only), each shaped as tiny-llama."""
BUILTIN_CONTEXT = 2048
"""Longest sequence (prompt + response tokens) a built-in model takes (its position table)."""
BUILTIN_SHAPES = {
    "tiny-llama": (64, 256, 2),
    "tiny-qwen2": (64, 256, 2),
    "small-llama": (128, 512, 5),
    "tiny-qwen3-moe": (64, 64, 2),
    "tiny-mixtral": (64, 64, 2),
}
"""(hidden, intermediate, layers) of each built-in model (a MoE model's intermediate: one
expert's), for the size checks (`models.py` builds
them; a test keeps the two in step)."""

# What the megatron backend splits in the built-in models (models.BUILTIN_MODELS, which needs
# torch): family, hidden, intermediate (a MoE model's: each expert's), layers, heads, key/value
# heads, vocabulary. A trainer test checks they agree with the models.
BUILTIN_MEGATRON_SHAPES = {
    "tiny-llama": ("llama", 64, 256, 2, 4, 4, 14),
    "tiny-qwen2": ("qwen2", 64, 256, 2, 4, 4, 14),
    "small-llama": ("llama", 128, 512, 5, 4, 4, 14),
    "tiny-qwen3-moe": ("qwen3_moe", 64, 64, 2, 4, 4, 14),
    "tiny-mixtral": ("mixtral", 64, 64, 2, 4, 4, 14),
}
BUILTIN_TASKS = ("count-up", "reverse", "calculator")
BUILTIN_AGENTS = ("calculator",)
BUILTIN_TOOLS = ("calculate",)
TOOL_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$"
ESTIMATORS_WITHOUT_CRITIC = ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo")
GROUP_ESTIMATORS = ("grpo", "reinforce_plus_plus_baseline", "rloo")
# Estimators whose advantages are whitened over the step's tokens when normalizeAdvantages is unset
WHITENING_BY_DEFAULT = ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
