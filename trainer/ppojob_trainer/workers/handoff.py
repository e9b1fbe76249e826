"""How one role's tensors reach another role: the object store, or memory in a one-process run.

A role hands what another role reads (a rollout batch, the critic's values, the actor's returns)
over as a reference the driver passes on: normally a Ray ``ObjectRef`` (``ray.put``), read with
``ray.get`` in whatever process the reader lives. When the whole run is one worker process (the
actor with its colocated engine and critic, one of each: :attr:`Topology.one_process`), every
reader is in the process that wrote the object, and the object store only costs a serialisation
and a copy each way: the host then switches this module to :func:`in_memory`, where :func:`put`
keeps the object here and returns a :class:`LocalRef`, and :func:`get` hands the same object back
(measured in ``bench/step_overhead.py``). What is handed over this way is not written to after the
hand-over: the values and returns are fresh copies (``clone``), and a rollout batch is read-only
to its readers in either mode (colocated roles already share one fetched copy).

A local object is read once (:func:`get` removes it); what a step leaves unread (a dynamic
sampling round without a pick, a step stopped before its training) is dropped by
:func:`drop_older_than` when a later step reads its batches.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import ray

_IN_MEMORY = False
_LOCAL: dict[LocalRef, Any] = {}
_KEYS = itertools.count()


@dataclass(frozen=True, slots=True)
class LocalRef:
    """An object kept in this process's memory by :func:`put` (keys increase with each put)."""

    key: int


def in_memory(on: bool) -> None:
    """Hand objects over in this process's memory (``on``) or through the object store."""
    global _IN_MEMORY
    _IN_MEMORY = on
    _LOCAL.clear()


def put(value: Any) -> Any:
    """A reference to ``value`` for another role: a :class:`LocalRef` in memory, else a Ray
    ``ObjectRef``."""
    if not _IN_MEMORY:
        return ray.put(value)
    ref = LocalRef(next(_KEYS))
    _LOCAL[ref] = value
    return ref


def get(ref: Any) -> Any:
    """The object ``ref`` names (a local one is read once)."""
    if not isinstance(ref, LocalRef):
        return ray.get(ref)
    try:
        return _LOCAL.pop(ref)
    except KeyError:
        raise RuntimeError(
            f"object {ref.key} was handed over in memory but is gone (read twice, or read in "
            "another process than the one-process run that wrote it)"
        ) from None


def drop_older_than(refs: Any) -> None:
    """Drop the local objects put before the oldest of ``refs`` (a step's batches, read now)."""
    keys = [r.key for r in refs if isinstance(r, LocalRef)]
    if keys:
        oldest = min(keys)
        for ref in [r for r in _LOCAL if r.key < oldest]:
            del _LOCAL[ref]


def mode() -> str:
    """``memory`` or ``store``."""
    return "memory" if _IN_MEMORY else "store"


def held() -> int:
    """How many local objects are held (for tests)."""
    return len(_LOCAL)
