"""The Ray actor process that hosts one worker of one or more roles.

Colocated roles (the actor with a colocated critic and/or rollout) share one process, so on a
small machine the whole job can be a single worker process; roles with their own bundles get
their own processes. The host builds each role's logic, joins the role groups and exposes the
step phases as Ray methods. Tensors leave a host only through ``ray.put`` (the object store);
what the methods return to the driver is refs and float metrics.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import ray
import torch

from ..config import TrainerConfig
from ..models import resolve_model_path
from .group import (
    data_parallel_group,
    identity,
    init_role_groups,
    model_parallel_identity,
)
from .rollout import unpack_weights


class WorkerHost:
    """One worker process; ``roles`` maps each hosted role to its (rank, world size)."""

    def __init__(
        self,
        cfg_json: str,
        roles: dict[str, tuple[int, int]],
        rendezvous: tuple[str, int] | None,
        threads: int,
        device: str = "cpu",
        cache_dir: str | None = None,
    ) -> None:
        # A failure to start is not raised here (Ray would print the actor's traceback and the
        # driver get an ActorDiedError): ready() reports it as one line naming the field.
        self._start_error: str | None = None
        self.roles = dict(roles)
        try:
            self._init(cfg_json, roles, rendezvous, threads, device, cache_dir)
        except Exception as exc:
            from ..errors import one_line

            self._start_error = one_line(exc)

    def _init(
        self,
        cfg_json: str,
        roles: dict[str, tuple[int, int]],
        rendezvous: tuple[str, int] | None,
        threads: int,
        device: str,
        cache_dir: str | None,
    ) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        _undo_worker_niceness()
        if cache_dir:  # where built-in models are materialised, as the driver sees it
            os.environ["PPOJOB_CACHE_DIR"] = cache_dir
        torch.set_num_threads(max(1, threads))
        cfg = TrainerConfig.model_validate_json(cfg_json)
        self.cfg = cfg
        seed = cfg.training.seed
        torch.manual_seed(seed)
        self.roles = dict(roles)
        trained = [r for r in roles if r in ("actor", "critic")]
        groups: dict[str, Any] = {}
        if trained:
            rank, world = roles[trained[0]]
            addr, port = rendezvous if rendezvous else ("127.0.0.1", 0)
            backend = "nccl" if device.startswith("cuda") else "gloo"
            groups = init_role_groups(trained, rank, world, addr, port, backend)
        self.rollout = self.actor = self.critic = None
        if "rollout" in roles:
            from .rollout import RolloutWorker

            path = resolve_model_path(cfg.model.path, seed)
            self.rollout = RolloutWorker(cfg, identity("rollout", *roles["rollout"]), path, device)
        if "actor" in roles:
            from .actor import ActorWorker

            path = resolve_model_path(cfg.model.path, seed)
            shard = model_parallel_identity(cfg, "actor", *roles["actor"])
            group = data_parallel_group(groups.get("actor"), shard)
            self.actor = ActorWorker(cfg, shard, path, device, group)
        if "critic" in roles:
            from .critic import CriticWorker

            path = resolve_model_path(cfg.model.critic_path or cfg.model.path, seed)
            if cfg.model.critic_path is not None:
                from ..models import check_critic_tokenizer

                check_critic_tokenizer(resolve_model_path(cfg.model.path, seed), path)
            shard = model_parallel_identity(cfg, "critic", *roles["critic"])
            group = data_parallel_group(groups.get("critic"), shard)
            self.critic = CriticWorker(cfg, shard, path, device, group)

    def ready(self) -> dict[str, Any]:
        """Shard identities of the hosted roles (as plain dicts) and the pid; or, when the worker
        could not start, ``{"error": one line naming the field and the cause, "roles": [...]}``."""
        if self._start_error is not None:
            return {"error": self._start_error, "roles": sorted(self.roles)}
        out: dict[str, Any] = {"pid": os.getpid(), "threads": torch.get_num_threads()}
        for name in ("rollout", "actor", "critic"):
            role = getattr(self, name)
            if role is not None:
                out[name] = role.shard.__dict__
        return out

    # ---- step phases -------------------------------------------------------------------------
    def generate(self, examples: list[Any], first_sample: int, seed: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        batch, metrics = self.rollout.generate(examples, first_sample, seed)
        metrics["time/generate"] = time.perf_counter() - t0
        return {"batch": ray.put(batch), "metrics": metrics}

    def evaluate(self, examples: list[Any]) -> dict[str, float]:
        return self.rollout.evaluate(examples)

    # Results of earlier phases arrive as top-level arguments, which Ray resolves before the call
    # (the driver inlines these small dicts of refs); only the tensors they name are fetched here.
    def compute_values(
        self, ranges: list[tuple[int, int]], actor_ranges: list[tuple[int, int]], *gens: Any
    ) -> list[Any]:
        t0 = time.perf_counter()
        refs = self.critic.compute_values(_parts(ranges, gens), actor_ranges)
        self.values_s = time.perf_counter() - t0
        return refs

    def prepare(
        self, ranges: list[tuple[int, int]], critic_ranges: list[tuple[int, int]] | None,
        kl_coef: float, *gens_then_values: Any,
    ) -> tuple[list[Any] | None, dict[str, float]]:  # fmt: skip
        """``gens_then_values``: the rollout results (one per range), then each critic
        worker's list of value refs (none without a critic)."""
        t0 = time.perf_counter()
        gens, values = gens_then_values[: len(ranges)], gens_then_values[len(ranges) :]
        refs, metrics = self.actor.prepare(
            _parts(ranges, gens), list(values) if critic_ranges else None, critic_ranges, kl_coef
        )
        metrics["time/prepare"] = time.perf_counter() - t0
        return refs, metrics

    def train_critic(
        self, step: int, actor_ranges: list[tuple[int, int]], updates: int, *prepared: Any
    ) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = self.critic.train(step, list(prepared), actor_ranges, updates)
        metrics["time/train_critic"] = time.perf_counter() - t0
        metrics["time/values"] = getattr(self, "values_s", 0.0)
        return metrics

    def train_actor(self, step: int) -> tuple[dict[str, float], list[Any] | None]:
        """PPO updates; the data-parallel leader then puts the new weights in the object store
        once and returns ``(metrics, [weights ref])`` (``(metrics, None)`` elsewhere)."""
        t0 = time.perf_counter()
        metrics = self.actor.train(step)
        metrics["time/train_actor"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        weights = self.export_weights()
        metrics["time/export_weights"] = time.perf_counter() - t1
        return metrics, weights

    def export_weights(self) -> list[Any] | None:
        """[ref of the policy weights] from the actor's data-parallel leader, else None."""
        ref = self.actor.export_weights()
        return None if ref is None else [ref]

    def update_weights(self, exported: tuple[Any, list[Any] | None] | list[Any]) -> float:
        """Load the weights the actor leader put: ``exported`` is its :meth:`train_actor` result
        or :meth:`export_weights` result (Ray resolves the outer ref; the inner one is fetched
        here, one copy per engine)."""
        t0 = time.perf_counter()
        refs = exported[1] if isinstance(exported, tuple) else exported
        self.rollout.update_weights(unpack_weights(ray.get(refs[0])))
        return time.perf_counter() - t0

    # ---- checkpoints and inspection ----------------------------------------------------------
    def get_state(self, role: str) -> dict[str, Any]:
        return getattr(self, role).trainer.state_dict()

    def set_state(self, role: str, state: dict[str, Any]) -> None:
        getattr(self, role).trainer.load_state_dict(state)

    def rng_state(self) -> dict[str, Any]:
        """This process's Python, numpy and torch (CPU and CUDA) generator states."""
        from ..checkpoint import capture_rng_state

        return capture_rng_state()

    def set_rng_state(self, state: dict[str, Any]) -> None:
        from ..checkpoint import restore_rng_state

        restore_rng_state(state)

    def save_checkpoint(self, role: str, directory: str) -> None:
        """Write this worker's shard of ``role``'s training state into ``directory`` (shared by
        the role's workers; the driver only passes the path)."""
        worker = getattr(self, role)
        worker.trainer.save_checkpoint(Path(directory), worker.shard)

    def load_checkpoint(self, role: str, directory: str) -> None:
        worker = getattr(self, role)
        worker.trainer.load_checkpoint(Path(directory), worker.shard)

    def export_pretrained(self, role: str, directory: str) -> None:
        """Hugging Face export of ``role``'s model (the leader writes; every worker of a sharded
        role takes part in the gather)."""
        worker = getattr(self, role)
        worker.trainer.export_pretrained(Path(directory), worker.shard)

    def received_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sample indices, values) the actor received at the last step (tests only)."""
        return self.actor.batch["sample_idx"], self.actor.received_values

    def computed_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sample indices, values) the critic computed at the last step (tests only)."""
        return self.critic.batch["sample_idx"], self.critic.batch["old_values"]


def _undo_worker_niceness() -> None:
    """Ray starts workers with a raised niceness so its own daemons stay responsive; the workers
    are this job's compute, so they run at the driver's priority when the OS allows it."""
    try:
        current = os.getpriority(os.PRIO_PROCESS, 0)
        target = os.getpriority(os.PRIO_PROCESS, os.getppid())
        if current > target:
            os.setpriority(os.PRIO_PROCESS, 0, target)
    except (OSError, AttributeError):  # not permitted (unprivileged container) or not POSIX
        pass


def _parts(ranges: list[tuple[int, int]], gens: Any) -> list[tuple[int, int, Any]]:
    return [(int(a), int(b), g["batch"]) for (a, b), g in zip(ranges, gens, strict=True)]


RemoteWorkerHost = ray.remote(WorkerHost)
