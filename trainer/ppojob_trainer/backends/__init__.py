"""Training and generation backends behind the interfaces of :mod:`.base`.

``torch`` (Hugging Face models, CPU or GPU) is always available; ``megatron`` and ``sglang`` import
their GPU packages lazily and raise a clear error when those are missing.
"""

from ..distributed import ShardIdentity
from .base import Generation, GenerationEngine, PolicyTrainer, ValueTrainer

__all__ = ["Generation", "GenerationEngine", "PolicyTrainer", "ShardIdentity", "ValueTrainer"]


def missing_backend(backend: str, package: str, field: str) -> ImportError:
    """The error raised when a GPU backend's package is not installed."""
    return ImportError(
        f"{field}: backend {backend!r} needs the {package!r} package, which is not installed in "
        f"this image; use the trainer image built with the `gpu` extra "
        f"(pip install 'ppojob[gpu]'), or set the backend to torch"
    )
