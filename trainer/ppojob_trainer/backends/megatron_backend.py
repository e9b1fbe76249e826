"""Megatron-core training backend (GPU; tensor, pipeline and context parallel).

Imported only when ``spec.roles.actor.backend`` or ``spec.roles.critic.backend`` is
``megatron``. The role logic in ``workers/`` is shared with the torch backend; this module must
provide :class:`~.base.PolicyTrainer` and :class:`~.base.ValueTrainer` on megatron-core models
(HF checkpoint conversion, ``parallel_state`` initialisation from the worker's
:class:`~.base.ShardIdentity`, distributed optimizer). That work needs GPUs to develop and test;
until it lands, constructing either trainer fails with a clear error rather than half-working.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import missing_backend


def _import_megatron() -> Any:
    try:
        import megatron.core as mcore
    except ImportError:
        raise missing_backend("megatron", "megatron-core", "spec.roles.actor.backend") from None
    return mcore


def _not_ready(role: str) -> NotImplementedError:
    return NotImplementedError(
        f"the megatron {role} trainer is not implemented in this release; set "
        f"spec.roles.{role}.backend: torch (data parallel on GPUs) for now"
    )


class MegatronPolicyTrainer:
    """Placeholder seam for the megatron actor (see the module docstring)."""

    def __init__(self, cfg: Any, model_dir: Path, shard: Any, *, need_reference: bool) -> None:
        _import_megatron()
        raise _not_ready("actor")


class MegatronValueTrainer:
    """Placeholder seam for the megatron critic (see the module docstring)."""

    def __init__(self, cfg: Any, model_dir: Path, shard: Any) -> None:
        _import_megatron()
        raise _not_ready("critic")
