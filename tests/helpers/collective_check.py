"""A collective-device check that runs on CPU: every group is named "nccl" and every tensor the
trainer's own code hands to a ``torch.distributed`` collective must have been placed for it.

On a GPU job NCCL communicates CUDA tensors only; a CPU tensor handed to an NCCL group raises
there and nowhere in a CPU test run. Under :func:`nccl_check`:

- ``ppojob_trainer.algorithms.collectives.group_backend`` answers "nccl" for every group, and
  ``collective_device`` maps "nccl" to the CPU (where this gloo group can still communicate);
- ``to_group`` and ``group_empty`` (the only functions that place a tensor for a collective)
  register the storage of every tensor they return;
- the tensor collectives and point-to-point calls of ``torch.distributed`` are wrapped: a call
  made from a module of ``ppojob_trainer`` is recorded with its site (the first frame outside
  ``collectives.py``), and every tensor it was handed (inputs, outputs, lists of them) whose
  storage was not registered is a violation: on a GPU it would be a CPU tensor on NCCL, since
  nothing moved it to the device the backend needs. The call then runs on gloo as usual, so every
  rank goes on (no rank raises alone and leaves the others waiting).

Calls from torch's or megatron-core's own code are not judged (their placement is theirs).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)
"""The ``torch.distributed`` calls that take tensors (object collectives pickle onto the
device torch picks itself and are not judged)."""

HELPERS = "ppojob_trainer.algorithms.collectives"


@dataclass
class CollectiveLog:
    """What :func:`nccl_check` saw: every judged call's site, and the violations."""

    calls: list[dict[str, Any]] = field(default_factory=list)
    violations: list[dict[str, Any]] = field(default_factory=list)
    _placed: dict[int, torch.Tensor] = field(default_factory=dict)

    def place(self, t: torch.Tensor) -> torch.Tensor:
        # held until the check ends, so a freed storage's address is never reused by a tensor
        # that nothing placed
        self._placed[t.untyped_storage().data_ptr()] = t
        return t

    def placed(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda" or t.untyped_storage().data_ptr() in self._placed

    def sites(self) -> set[str]:
        return {c["site"] for c in self.calls}


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)
    elif hasattr(value, "tensor") and isinstance(value.tensor, torch.Tensor):  # a P2POp
        yield value.tensor


def _site(frame: Any) -> str | None:
    """``module:qualname`` of the first frame outside the helpers; None when the call does
    not come from the trainer."""
    name = frame.f_globals.get("__name__", "")
    if not name.startswith("ppojob_trainer"):
        return None
    while frame is not None and frame.f_globals.get("__name__") == HELPERS:
        frame = frame.f_back
    if frame is None:
        return f"{HELPERS}:?"
    return f"{frame.f_globals.get('__name__')}:{frame.f_code.co_qualname}"


def _judge(log: CollectiveLog, name: str, real: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1)
        site = _site(caller)
        if site is not None:
            log.calls.append({"call": name, "site": site})
            for t in _tensors([*args, *kwargs.values()]):
                if not log.placed(t):
                    log.violations.append(
                        {
                            "call": name,
                            "site": site,
                            "line": f"{caller.f_code.co_filename}:{caller.f_lineno}",
                            "device": str(t.device),
                            "shape": list(t.shape),
                            "dtype": str(t.dtype),
                        }
                    )
        return real(*args, **kwargs)

    return wrapped


@contextmanager
def nccl_check() -> Iterator[CollectiveLog]:
    """Judge the collectives the trainer issues inside the block (see the module's doc)."""
    import torch.distributed as dist

    from ppojob_trainer.algorithms import collectives as C

    log = CollectiveLog()
    saved: dict[tuple[Any, str], Any] = {}

    def patch(owner: Any, attr: str, value: Any) -> None:
        saved[(owner, attr)] = getattr(owner, attr)
        setattr(owner, attr, value)

    real_device = C.collective_device
    real_to_group, real_empty = C.to_group, C.group_empty

    def device(backend: str, cuda_index: int | None = None) -> torch.device:
        if str(backend).lower() == "nccl":
            return torch.device("cpu")  # the gloo group below still communicates it
        return real_device(backend, cuda_index)

    try:
        patch(C, "group_backend", lambda group=None: "nccl")
        patch(C, "collective_device", device)
        patch(C, "to_group", lambda t, group=None: log.place(real_to_group(t, group)))
        patch(C, "group_empty", lambda *a, **k: log.place(real_empty(*a, **k)))
        for name in COLLECTIVES:
            patch(dist, name, _judge(log, name, getattr(dist, name)))
        yield log
    finally:
        for (owner, attr), value in saved.items():
            setattr(owner, attr, value)


def collective_sites(path: Path, module: str) -> set[str]:
    """``module:qualname`` (as :func:`nccl_check` records sites) of every function of the module
    at ``path`` that calls a tensor collective of ``torch.distributed`` (``dist.<name>``) or a
    collective of ``collectives.py``."""
    from ppojob_trainer.algorithms import collectives as C

    helpers = {n for n in C.__all__ if n.startswith("all_")}
    sites: set[str] = set()

    def called(node: ast.Call) -> str | None:
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            if f.value.id == "dist" and f.attr in COLLECTIVES:
                return f.attr
            return f.attr if f.attr in helpers else None
        return f.id if isinstance(f, ast.Name) and f.id in helpers else None

    def walk(node: ast.AST, qual: str, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                sep = ".<locals>." if in_function else "."
                name = f"{qual}{sep}{child.name}" if qual else child.name
                walk(child, name, True)
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{qual}.{child.name}" if qual else child.name, in_function)
            else:
                if isinstance(child, ast.Call) and called(child) and qual:
                    sites.add(f"{module}:{qual}")
                walk(child, qual, in_function)

    walk(ast.parse(path.read_text()), "", False)
    return sites
