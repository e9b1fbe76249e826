"""Atomic checkpoints: a half-written checkpoint is never taken as the latest.

Layout of `ckpt_dir`:
```
step-000010/            a complete checkpoint (renamed into place only once fully written)
  actor.pt ...          one torch.save file per top-level key of the state
  MANIFEST.json         written last: step, files and their sizes, "complete": true
.tmp-step-000020-<id>/  being written (or left behind by a crash); never read, cleaned later
```
Writing: files go into a hidden temp dir, each is fsynced, `MANIFEST.json` is written and
fsynced last, the temp dir is renamed to `step-NNNNNN` (atomic on POSIX) and the parent fsynced.
`latest_checkpoint` only considers `step-*` dirs whose manifest parses, says complete, names the
same step and whose files exist with the recorded sizes. Pruning renames a checkpoint to a hidden
name before deleting it, so a half-deleted one is never seen either.

State values must be tensors, numbers, strings, bools, None and lists/tuples/dicts of them
(model and optimizer state dicts qualify): loading uses `torch.load(weights_only=True)`, and saving
rejects anything else up front, so a checkpoint that saves always loads.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

MANIFEST = "MANIFEST.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_PRIMITIVES = (str, int, float, bool, type(None), torch.Tensor, torch.dtype, torch.Size)

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_loadable(value: Any, where: str) -> None:
    if isinstance(value, _PRIMITIVES):
        return
    if isinstance(value, dict | OrderedDict):
        for k, v in value.items():
            if not isinstance(k, str | int | float | bool | type(None)):
                raise TypeError(f"checkpoint state {where}: key {k!r} is a {type(k).__name__}")
            _check_loadable(v, f"{where}[{k!r}]")
        return
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_loadable(v, f"{where}[{i}]")
        return
    raise TypeError(
        f"checkpoint state {where} is a {type(value).__module__}.{type(value).__name__}; store "
        "tensors, numbers, strings, bools, None, lists, tuples and dicts only (convert it, e.g. "
        "with .tolist() or a dict)"
    )


class CheckpointWriter:
    """A checkpoint being written: put files into `.path`; `commit()` makes it complete."""

    def __init__(self, ckpt_dir: Path, step: int) -> None:
        self.ckpt_dir = Path(ckpt_dir)
        self.step = step
        self.path = self.ckpt_dir / f".tmp-{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
        self.path.mkdir(parents=True)
        self.meta: dict[str, Any] = {}

    def save(self, key: str, value: Any) -> Path:
        """torch.save one entry of the state as `<key>.pt`."""
        if not _KEY.match(key):
            raise ValueError(f"checkpoint key {key!r} must match {_KEY.pattern} (it is a filename)")
        _check_loadable(value, repr(key))
        target = self.path / f"{key}.pt"
        torch.save(value, target)
        return target

    def commit(self) -> Path:
        """Fsync every file, write the manifest last, rename into place; returns the final dir."""
        files = {}
        for f in sorted(self.path.rglob("*")):
            if f.is_file() and f.name != MANIFEST:
                _fsync_file(f)
                files[str(f.relative_to(self.path))] = f.stat().st_size
        for d in sorted({f.parent for f in self.path.rglob("*")} | {self.path}, reverse=True):
            _fsync_dir(d)
        manifest = {
            "format": FORMAT_VERSION,
            "step": self.step,
            "complete": True,
            "created": time.time(),
            "files": files,
            "meta": self.meta,
        }
        tmp_manifest = self.path / MANIFEST
        tmp_manifest.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        _fsync_file(tmp_manifest)
        _fsync_dir(self.path)
        final = self.ckpt_dir / step_dir_name(self.step)
        if final.exists():  # the same step saved again (e.g. after a resume): replace it
            _discard(final)
        os.rename(self.path, final)
        _fsync_dir(self.ckpt_dir)
        return final

    def abort(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


@contextmanager
def checkpoint_writer(
    ckpt_dir: Path, step: int, keep: int | None = None
) -> Iterator[CheckpointWriter]:
    """Write a checkpoint's files yourself (e.g. one shard per worker into `writer.path`);
    committed and pruned on normal exit, discarded on an exception."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    if keep is not None and keep < 1:
        raise ValueError(f"keep (spec.training.keepCheckpoints) must be >= 1, got {keep}")
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(ckpt_dir)
    writer = CheckpointWriter(ckpt_dir, step)
    try:
        yield writer
    except BaseException:
        writer.abort()
        raise
    writer.commit()
    if keep is not None:
        prune_checkpoints(ckpt_dir, keep)


def save_checkpoint(ckpt_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write `state` as the complete checkpoint of `step` (atomically) and keep the newest `keep`.

    Each top-level key becomes its own file (`actor.pt`, `optimizer.pt`, ...). Returns the
    checkpoint's directory, `ckpt_dir/step-NNNNNN`.
    """
    if not isinstance(state, dict) or not state:
        raise ValueError("checkpoint state must be a non-empty dict of named entries")
    for key, value in state.items():
        if not isinstance(key, str) or not _KEY.match(key):
            raise ValueError(f"checkpoint key {key!r} must match {_KEY.pattern} (it is a filename)")
        _check_loadable(value, repr(key))
    with checkpoint_writer(ckpt_dir, step, keep) as writer:
        for key, value in state.items():
            writer.save(key, value)
    final = Path(ckpt_dir) / step_dir_name(step)
    log.info("saved checkpoint %s", final)
    return final


# ---------------------------------------------------------------------------------------------
# What must not change across a resume
# ---------------------------------------------------------------------------------------------
def config_fingerprint(cfg: Any, prompts_digest: str | None = None) -> dict[str, Any]:
    """The settings a checkpoint is only valid under (a ``TrainerConfig``), by spec path: the
    model, the prompt source (and ``prompts_digest``, a digest of the prompts it holds:
    :meth:`Task.digest`), the data batch sizes, the seed, the estimator, and what decides the
    layout of the trained roles' saved state: each one's backend, its sharding, its model
    parallel sizes and the LoRA adapters. Stored in each checkpoint as ``fingerprint`` and
    compared on resume (:func:`check_fingerprint`).

    The worker counts are not in it: each worker writes its shard of one global state
    (torch.distributed.checkpoint on the torch backend, replicated or FSDP;
    ``dist_checkpointing`` on megatron, its distributed optimizer in the ``dp_reshardable``
    format), which a run with another data-parallel size reads back resharded; the engines hold
    no trained state. A resume on fewer or more workers (a job restarted where fewer GPUs are
    free) continues the run; the tensor, pipeline, context and expert sizes must stay."""
    roles, data, algo = cfg.roles, cfg.data, cfg.algorithm
    critic = roles.effective_critic(algo.needs_critic)
    out: dict[str, Any] = {
        "spec.data.prompts": data.prompts,
        "spec.data.prompts (content sha256)": prompts_digest,
        "spec.model.path": cfg.model.path,
        "spec.model.criticPath": cfg.model.critic_path,
        "spec.data.rolloutBatchSize": data.rollout_batch_size,
        "spec.data.samplesPerPrompt": data.samples_per_prompt,
        "spec.training.miniBatchSize": cfg.training.mini_batch_size,
        "spec.training.seed": cfg.training.seed,
        "spec.algorithm.advantageEstimator": algo.advantage_estimator,
    }
    trained = [("actor", roles.actor, cfg.training)]
    if critic is not None:
        trained.append(("critic", critic, cfg.critic_training()))
    for name, role, training in trained:
        out[f"spec.roles.{name}.backend"] = role.backend
        out[f"spec.roles.{name} (sharding)"] = training.sharding
        par = role.parallelism
        for axis in ("tensor", "pipeline", "context", "expert"):
            out[f"spec.roles.{name}.parallelism.{axis}"] = getattr(par, axis)
    lora = cfg.model.lora  # the adapters alone are saved: their shapes, and alpha's scale
    out["spec.model.lora"] = (
        None
        if lora is None
        else {
            "rank": lora.rank,
            "alpha": lora.alpha,
            "targetModules": list(lora.target_modules),
            "modulesToSave": list(lora.modules_to_save),
        }
    )
    return out


def check_fingerprint(saved: dict[str, Any] | None, current: dict[str, Any], path: Path) -> None:
    """Raise :class:`CheckpointError` naming every setting that differs between the checkpoint
    at ``path`` (``saved``; None for a checkpoint written before fingerprints) and this run."""
    if saved is None:
        log.warning("checkpoint %s has no config fingerprint; resuming without the check", path)
        return
    diffs = [
        f"{key}: {saved.get(key, '(not recorded)')!r} in the checkpoint, {value!r} now"
        for key, value in current.items()
        if saved.get(key, value) != value
    ]
    if diffs:
        raise CheckpointError(
            f"cannot resume from {path}: settings that a checkpoint depends on changed: "
            + "; ".join(diffs)
            + ". Restore them, or start afresh with a new spec.training.checkpointDir or "
            "spec.training.resume: false."
        )


# ---------------------------------------------------------------------------------------------
# Finding, reading, pruning
# ---------------------------------------------------------------------------------------------
def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a complete checkpoint directory, or None if it is not complete."""
    path = Path(path)
    m = _STEP_DIR.match(path.name)
    if not m or not path.is_dir():
        return None
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("complete") is not True:
        return None
    if manifest.get("step") != int(m.group(1)) or not isinstance(manifest.get("files"), dict):
        return None
    for name, size in manifest["files"].items():
        f = path / name
        try:
            if f.stat().st_size != size:
                return None
        except OSError:
            return None
    return manifest


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for entry in ckpt_dir.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and read_manifest(entry) is not None:
            found.append((int(m.group(1)), entry))
    return [p for _, p in sorted(found)]


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint in `ckpt_dir`, or None."""
    done = complete_checkpoints(ckpt_dir)
    return done[-1] if done else None


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a complete checkpoint: `{key: value}` for every `<key>.pt`, plus `step`."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest is None:
        raise CheckpointError(f"{path} is not a complete checkpoint (no valid {MANIFEST})")
    state: dict[str, Any] = {}
    for name in manifest["files"]:
        if name.endswith(".pt") and "/" not in name:
            state[name[:-3]] = torch.load(path / name, map_location="cpu", weights_only=True)
    state.setdefault("step", manifest["step"])
    return state


def prune_checkpoints(ckpt_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints; returns what was removed."""
    if keep < 1:
        raise ValueError(f"keep (spec.training.keepCheckpoints) must be >= 1, got {keep}")
    done = complete_checkpoints(ckpt_dir)
    old = done[:-keep]
    for path in old:
        _discard(path)
    return old


def _discard(path: Path) -> None:
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _clean_leftovers(ckpt_dir: Path) -> None:
    """Remove temp and trash dirs left by a crash (one trainer writes a checkpoint dir)."""
    for entry in ckpt_dir.iterdir():
        if entry.name.startswith((".tmp-step-", ".trash-step-")) and entry.is_dir():
            log.info("removing leftover %s", entry)
            shutil.rmtree(entry, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# RNG state
# ---------------------------------------------------------------------------------------------
def capture_rng_state() -> dict[str, Any]:
    """Python, numpy (if installed) and torch (CPU and every CUDA device) generator states, as
    checkpoint-safe values."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "torch": torch.get_rng_state(),
    }
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with the trainer's dependencies
        pass
    else:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [
            str(name),
            torch.from_numpy(keys.astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ]
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what `capture_rng_state` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
