"""A training run: connect to Ray, start the trainer, resume, the steps with their evaluation
and checkpoint cadence, a stop request's checkpoint, the final export and summary."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from ppojob_api.failures import grace_problem
from ppojob_api.training import TrainerConfig

from .. import runtime
from ..checkpoint import (
    check_fingerprint,
    checkpoint_writer,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    step_dir_name,
)
from ..preemption import MARGIN_S, Preempted, StopSignal, watch
from .trainer import PPOTrainer, StepAbandoned

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a training run did."""

    steps: int
    """Steps run (including resumed ones)."""
    history: list[dict[str, float]] = field(default_factory=list)
    """Metrics of every step run in this process."""
    wall_s: float = 0.0
    """Wall time of the whole run, Ray start and worker start-up included."""
    setup_s: float = 0.0
    """Of which before the first step (Ray, placement, worker and model start-up)."""
    final_reward: float = float("nan")
    """Mean reward of the last step."""
    checkpoint: str | None = None
    """The last checkpoint written."""
    eval_reward: float | None = None
    """Mean reward of the last evaluation on data.evalPrompts (None without one)."""
    export: str | None = None
    """Where the Hugging Face export of the final models was written."""

    def time_to_reward(self, threshold: float) -> float | None:
        """Wall seconds from the run's start until a step's mean reward first reached
        ``threshold``, or None."""
        for m in self.history:
            if m["reward/mean"] >= threshold:
                return m["time/elapsed"]
        return None


def train(
    cfg: TrainerConfig,
    out_dir: Path,
    reporter: Any,
    max_steps: int | None = None,
    threads: dict[str, int] | None = None,
    grace_seconds: float | None = None,
) -> TrainResult:
    """Run the PPO loop for ``cfg.training.steps`` steps (or ``max_steps``) and report progress.

    Starts a loopback-only local Ray unless one is running or ``RAY_ADDRESS`` names a cluster.
    Checkpoints go to ``training.checkpointDir`` (relative to ``out_dir``) every
    ``checkpointInterval`` steps and at the end; with ``resume`` the newest one is loaded first.
    A SIGTERM (or the preStop hook's stop file) ends the run after the step in flight with a
    checkpoint and raises :class:`~ppojob_trainer.preemption.Preempted` (``grace_seconds``, else
    ``$PPOJOB_GRACE_SECONDS``: the grace period it must fit in).
    """
    t_start = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PPOJOB_CACHE_DIR", str(_default_cache(out_dir)))
    runtime.connect_ray()
    tr = cfg.training
    total = tr.steps if max_steps is None else min(tr.steps, max_steps)
    ckpt_dir = Path(tr.checkpoint_dir)
    if not ckpt_dir.is_absolute():
        ckpt_dir = out_dir / ckpt_dir
    trainer = PPOTrainer(cfg, threads=threads)
    trainer.total_steps = total
    result = TrainResult(steps=0)
    stopping = False
    try:
        draining = partial(draining_ray_nodes, trainer.expendable_actors)
        with watch(grace_seconds, draining=draining) as stop:
            try:
                _Run(trainer, cfg, ckpt_dir, reporter, result, total, t_start, stop).run()
            finally:
                stopping = stop.requested
    finally:
        trainer.shutdown(stopping)
    return result


def draining_ray_nodes(
    expendable: Callable[[], set[str]] = set,
) -> list[tuple[str, float | None]]:
    """The Ray nodes being drained that hold a live actor of this job, by host name (a pod's name
    under KubeRay), with the drain's deadline in epoch seconds (None without one). A worker pod's
    ``ray start --block`` asks the GCS for this drain when its SIGTERM comes
    (``ray._private.node.Node``'s SIGTERM handler); the autoscaler drains only idle nodes (an
    elastic rollout group's), which hold no actor and are no reason to stop. Actors whose loss
    the run absorbs (``expendable()``: actor ids of elastic engines and reward workers, which
    are replaced) do not count: a node holding only those is no reason to stop either."""
    import ray
    from ray._private.state import state

    draining = state.get_draining_nodes()
    if not draining:
        return []
    job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    actors = state.actor_table(None, job_id=job, actor_state_name="ALIVE")
    hosts = actor_nodes(actors, expendable())
    names = {n["NodeID"]: n.get("NodeManagerHostname") or n["NodeID"] for n in ray.nodes()}
    return stopping_nodes(draining, hosts, names)


def actor_nodes(actors: dict[str, dict[str, Any]], expendable: set[str]) -> set[str]:
    """The node ids of the job's live actors (the GCS actor table, keyed by hex actor id), less
    the actors whose loss the run absorbs."""
    return {a["Address"]["NodeID"] for aid, a in actors.items() if aid not in expendable}


def stopping_nodes(
    draining: dict[str, int], hosts: set[str], names: dict[str, str]
) -> list[tuple[str, float | None]]:
    """Of the draining nodes (node id -> deadline in epoch ms, 0 for none), those in ``hosts``
    (the nodes of the job's live actors), as (name, deadline in epoch seconds or None)."""
    return [
        (names.get(node, node), ms / 1000 if ms else None)
        for node, ms in sorted(draining.items())
        if node in hosts
    ]


@dataclass
class _Run:
    """The steps of :func:`train`; a stop request ends them at a step boundary with a checkpoint
    (:class:`~ppojob_trainer.preemption.Preempted`)."""

    trainer: PPOTrainer
    cfg: TrainerConfig
    ckpt_dir: Path
    reporter: Any
    result: TrainResult
    total: int
    t_start: float
    stop: StopSignal
    first: int = 0
    last_ckpt_step: int = 0
    timed: bool = False
    """A checkpoint was written (and timed) by this process."""
    warned: bool = False
    """The grace period was found too short for a step and a checkpoint (warned once)."""
    stopped_in_step: bool = False
    """The stop (once asked for) came while the last step ran: it was finished, not skipped."""

    def run(self) -> None:
        tr, result, stop = self.cfg.training, self.result, self.stop
        self.trainer.may_commit = self._may_commit
        if tr.resume:
            self.first = resume(self.trainer, self.ckpt_dir)
            result.checkpoint = _newest(self.ckpt_dir)
        result.setup_s = time.perf_counter() - self.t_start
        self.reporter.start(self.total, self.first)
        self.last_ckpt_step = result.steps = self.first
        try:
            for step in range(self.first, self.total):
                if stop.requested:
                    break
                self._step(step)
        except (KeyboardInterrupt, StepAbandoned) as exc:
            if isinstance(exc, KeyboardInterrupt) and not stop.abandoned:
                raise
            # the step in flight is abandoned (at its commit, or the grace period ran out). Until
            # its commit the trained workers hold the completed steps: they are checkpointed
            # now; after it, what the newest complete checkpoint holds survives
            done = self.trainer.completed
            if not self.trainer.committed and done is not None and done[0] + 1 > result.steps:
                self._report(*done)  # the step completed; its evaluation was cut short
            if result.steps != self.last_ckpt_step and self.trainer.checkpointable():
                self._checkpoint(result.steps, None)
            newest = _newest(self.ckpt_dir)
            raise Preempted(self.last_ckpt_step, newest, stop.cause or "stop", True) from None
        if stop.requested:
            if result.steps != self.last_ckpt_step:
                # the stop came after the last step's own check (between it and the loop's):
                # no step is in flight, so the completed ones are saved here
                self._checkpoint(result.steps, None)
            cause = stop.cause or "stop"
            raise Preempted(result.steps, result.checkpoint, cause, False, self.stopped_in_step)
        self._finish()

    def _step(self, step: int) -> None:
        """One step, its evaluation when due, its report and its checkpoint when due."""
        trainer, result, stop, tr = self.trainer, self.result, self.stop, self.cfg.training
        stop.in_step = True
        try:
            metrics = trainer.step(step)
            if trainer.eval_due(step + 1, self.total):
                metrics.update(trainer.evaluate())
                result.eval_reward = metrics["eval/reward_mean"]
        finally:
            # a stop asked for by now came in this step (or just before it, past the loop's
            # look): the step ran after it, and the account says it finished the step in flight
            self.stopped_in_step = stop.cause is not None
            stop.in_step = False
        self._report(step, metrics)
        due = tr.checkpoint_interval and (step + 1) % tr.checkpoint_interval == 0
        # with a grace period (in a pod), the first step of a process is checkpointed whatever
        # the interval: a stop needs the checkpoint's cost, and the grace period is checked
        # against it now, before any stop
        probe = stop.grace_seconds is not None and not self.timed
        if due or stop.requested or probe:
            self._checkpoint(step + 1, self.trainer.exposed_s)

    def _report(self, step: int, metrics: dict[str, float]) -> None:
        """A completed step's record and report."""
        metrics["time/elapsed"] = time.perf_counter() - self.t_start
        self.result.history.append(metrics)
        self.result.steps = step + 1
        self.reporter.report(step + 1, metrics)

    def _may_commit(self) -> bool:
        """At a step's commit: False (abandon the step, checkpoint the completed ones) when a
        stop was asked for and what is left of the grace period no longer holds the training
        the last step took after its commit, plus a checkpoint."""
        left, stop = self.stop.time_left(), self.stop
        if left is None or self.trainer.commit_s is None:
            return True
        return left >= self.trainer.commit_s + stop.checkpoint_seconds + MARGIN_S

    def _checkpoint(self, steps: int, exposed_seconds: float | None) -> None:
        """A checkpoint of ``steps`` completed steps; the first one that knows what a stop must
        let a step finish (``exposed_seconds``, :attr:`PPOTrainer.exposed_s`) says once when
        the grace period cannot hold that and a checkpoint."""
        tr, stop = self.cfg.training, self.stop
        t_ckpt = time.perf_counter()
        self.result.checkpoint = save(
            self.trainer, self.ckpt_dir, steps, tr.keep_checkpoints, self.reporter
        )
        stop.checkpoint_seconds = time.perf_counter() - t_ckpt
        self.last_ckpt_step, self.timed = steps, True
        if exposed_seconds is not None and not self.warned and stop.grace_seconds is not None:
            grace = int(stop.grace_seconds)
            problem = grace_problem(grace, exposed_seconds, stop.checkpoint_seconds)
            if problem:
                log.warning("%s", problem)
                warn = getattr(self.reporter, "warn", None)  # (reporters of tests may lack it)
                if warn is not None:
                    warn(f"GracePeriodTooShort: {problem}")
                self.warned = True

    def _finish(self) -> None:
        """The final checkpoint and export, and the run's summary."""
        tr, result = self.cfg.training, self.result
        if result.steps and result.steps != self.last_ckpt_step:
            result.checkpoint = save(
                self.trainer, self.ckpt_dir, result.steps, tr.keep_checkpoints, self.reporter
            )
        if tr.export_hugging_face and result.steps > self.first:
            result.export = str(export(self.trainer, self.ckpt_dir, result.steps))
        result.steps = max(result.steps, self.first)
        if result.history:
            result.final_reward = result.history[-1]["reward/mean"]
        result.wall_s = time.perf_counter() - self.t_start
        evaluated = {} if result.eval_reward is None else {"eval/reward_mean": result.eval_reward}
        self.reporter.finish(
            {
                "steps": result.steps,
                "final_reward": result.final_reward,
                "wall_s": result.wall_s,
                "time_to_0.9_s": result.time_to_reward(0.9),
                **evaluated,
            }
        )


def _newest(ckpt_dir: Path) -> str | None:
    path = latest_checkpoint(ckpt_dir)
    return str(path) if path is not None else None


def _default_cache(out_dir: Path) -> Path:
    return Path.home() / ".cache" / "ppojob" if os.access(Path.home(), os.W_OK) else out_dir


def save(
    trainer: PPOTrainer,
    ckpt_dir: Path,
    step: int,
    keep: int,
    reporter: Any = None,
) -> str | None:
    """A checkpoint: the workers write their shards, then the driver its small state; the
    directory becomes complete (atomically) only after both. The reporter then hears which
    complete checkpoints are kept (`kubectl ppojob checkpoints` reads them from the status)."""
    with checkpoint_writer(ckpt_dir, step, keep) as writer:
        trainer.save_workers(writer.path)
        for key, value in trainer.state(step).items():
            writer.save(key, value)
    hook = getattr(reporter, "checkpointed", None)  # (reporters of tests may lack it)
    if hook is not None:
        hook([(int(p.name.split("-")[-1]), str(p)) for p in complete_checkpoints(ckpt_dir)])
    return str(ckpt_dir / step_dir_name(step))


def export(trainer: PPOTrainer, ckpt_dir: Path, step: int) -> Path:
    """Hugging Face export of the actor (and critic) under ``<checkpointDir>/hf/step-N/``."""
    return trainer.export_pretrained(ckpt_dir / "hf" / step_dir_name(step))


def resume(trainer: PPOTrainer, ckpt_dir: Path) -> int:
    """Load the newest checkpoint under ``ckpt_dir`` (its fingerprint checked); the steps done
    (0 without one)."""
    path = latest_checkpoint(ckpt_dir)
    if path is None:
        return 0
    log.info("resuming from %s", path)
    state = load_checkpoint(path)
    check_fingerprint(state.get("fingerprint"), trainer.fingerprint(), path)
    return trainer.restore(state, path)


__all__ = ["TrainResult", "export", "resume", "save", "train"]
