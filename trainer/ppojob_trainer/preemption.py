"""Preemption: a SIGTERM (pod deletion, eviction, suspend) ends the run at a step boundary with a
checkpoint, and the process exits ``Preempted`` (code 75, ``ppojob_api.failures``).

Kubernetes sends SIGTERM to a pod's containers and SIGKILL ``terminationGracePeriodSeconds``
later. The driver of a Ray job is not the head container's first process, so the operator also
gives the head container a ``preStop`` hook that touches :data:`STOP_FILE_ENV`'s file (kubelet
runs it before the SIGTERM, inside the same grace period) and waits for the trainer's
:data:`RUNNING_FILE_ENV` file to go. A worker pod's SIGTERM reaches ``ray start --block`` (its
container's first process), whose handler marks the Ray node as draining in the GCS and keeps the
node's processes alive while its actors hold their leases (the operator sets the drain's bound,
``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S``, to the grace period); :func:`watch` polls the GCS for
draining nodes that hold the job's actors (``draining``) and sets the same :class:`StopSignal`,
so the driver hears of it within a second rather than as an ``ActorDiedError`` when the grace
period ends (the reasons, with references to Ray's and KubeRay's source: docs/trainer-guide.md,
"Preemption"). Either way, :class:`StopSignal` is set, and the training loop:

- lets the step in flight finish (the workers cannot be checkpointed mid-step), writes a
  checkpoint of it, and raises :class:`Preempted`;
- when the grace period left cannot cover the rest of the step plus a checkpoint (it measures
  both), abandons the step: at the step's commit (before it sends any work to the trained
  workers) when the training its last steps took no longer fits, else when the main thread is
  interrupted at ``grace - checkpoint cost - margin``. Until the commit, the trained workers hold
  the last completed step untouched, so the run writes a checkpoint of it at once
  (``driver/run.py``); after it, the run ends with the newest checkpoint already written
  (completed steps since it are lost; ``failures.grace_problem`` warns of this beforehand).

No torch, no Ray: the loop and the command lines share it.
"""

from __future__ import annotations

import _thread
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from ppojob_api.failures import PREEMPTED_EXIT_CODE

log = logging.getLogger(__name__)

STOP_FILE_ENV = "PPOJOB_STOP_FILE"
"""A file whose appearance asks the trainer to stop as on SIGTERM (the head's preStop hook)."""
RUNNING_FILE_ENV = "PPOJOB_RUNNING_FILE"
"""A file that exists while the training loop runs (the preStop hook waits while it does)."""
GRACE_ENV = "PPOJOB_GRACE_SECONDS"
"""The pods' grace period in seconds (the operator sets it from the spec)."""
MARGIN_S = 2.0
"""Kept free at the end of the grace period (process exit, Ray shutdown)."""
POLL_S = 0.5
"""How often the stop file and the draining Ray nodes are looked at."""

Draining = Callable[[], list[tuple[str, float | None]]]
"""Ray nodes being drained: (name, the drain's deadline in epoch seconds or None) for each."""

__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "StopSignal", "watch"]


class Preempted(Exception):
    """The run stopped on request; ``step`` completed steps are in ``checkpoint``."""

    reason = "Preempted"

    def __init__(
        self,
        step: int,
        checkpoint: str | None,
        cause: str,
        abandoned: bool,
        in_flight: bool = True,
    ) -> None:
        self.step, self.checkpoint, self.cause, self.abandoned = step, checkpoint, cause, abandoned
        self.in_flight = in_flight or abandoned
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint yet"
        if abandoned:
            what = "abandoned the step in flight"
        elif in_flight:
            what = "finished the step in flight"
        else:  # the stop came between two steps (a checkpoint, the report): none to finish
            what = "no step was in flight"
        super().__init__(
            f"{cause}: {what}; {step} completed steps are in {where}; the next run resumes there"
        )


class StopSignal:
    """Set once a stop was asked for (SIGTERM or the stop file); knows the grace period left."""

    def __init__(self, grace_seconds: float | None = None, stop_file: Path | None = None) -> None:
        self.grace_seconds = grace_seconds
        self.stop_file = stop_file
        self.cause: str | None = None
        self.at: float | None = None
        self.checkpoint_seconds = 0.0
        """Measured cost of the last checkpoint (the loop updates it)."""
        self.in_step = False
        self.abandoned = False
        self.deadline: float | None = None
        """When the grace period ends (``time.monotonic()``; None without one)."""
        self._event = threading.Event()
        self._timer: threading.Timer | None = None
        self._lock = threading.RLock()  # (re-entrant: a SIGTERM handler may run inside request)

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def request(self, cause: str, grace_left: float | None = None) -> None:
        """Ask for a stop (idempotent); arms the abandon timer when a grace period is known.
        ``grace_left``: what is left of it where the stop was asked before it reached here (a
        draining Ray node's deadline), when that is shorter."""
        with self._lock:
            if self.cause is not None:
                return
            self.cause, self.at = cause, time.monotonic()
            grace = self.grace_seconds
            if grace_left is not None:
                grace = grace_left if grace is None else min(grace, grace_left)
            if grace is not None:
                self.deadline = self.at + grace
                budget = grace - self.checkpoint_seconds - MARGIN_S
                self._timer = threading.Timer(max(budget, 0.0), self._abandon)
                self._timer.daemon = True
                self._timer.start()
            # set last: whoever wakes on the event (another thread) finds the timer armed
            self._event.set()
        log.warning("%s: stopping after the step in flight, with a checkpoint", cause)

    def time_left(self) -> float | None:
        """Seconds left of the grace period once a stop was asked for (None: no stop or no
        grace period known)."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def _abandon(self) -> None:
        if self.in_step:
            self.abandoned = True
            log.warning("grace period nearly over: abandoning the step in flight")
            _thread.interrupt_main()  # KeyboardInterrupt in the loop's ray.get

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _poll_stop_file(self, done: threading.Event) -> None:
        assert self.stop_file is not None
        while not done.wait(POLL_S):
            if self.stop_file.exists():
                self.request(f"stop file {self.stop_file}")
                return

    def _poll_draining(self, draining: Draining, done: threading.Event) -> None:
        """Sets the signal when a Ray node of the job is being drained: a worker pod's
        ``ray start --block`` got its SIGTERM (or the autoscaler or ``ray drain-node`` asked)."""
        failed = False
        while not done.wait(POLL_S):
            try:
                nodes = draining()
            except Exception as exc:  # the GCS briefly unreachable: look again
                if not failed:
                    log.warning("could not list the draining Ray nodes: %s", exc)
                failed = True
                continue
            if nodes:
                name, deadline = nodes[0]
                left = None if deadline is None else max(deadline - time.time(), 0.0)
                self.request(f"Ray node {name} is stopping (its pod got SIGTERM)", left)
                return


def _env_float(name: str) -> float | None:
    raw = os.environ.get(name)
    try:
        return float(raw) if raw else None
    except ValueError:
        log.warning("%s=%r is not a number; ignored", name, raw)
        return None


@contextmanager
def watch(
    grace_seconds: float | None = None, draining: Draining | None = None
) -> Iterator[StopSignal]:
    """A :class:`StopSignal` set by SIGTERM (main thread only), by the stop file named in
    ``$PPOJOB_STOP_FILE`` or by a Ray node that ``draining`` lists; the previous SIGTERM handler
    is restored on exit. The file ``$PPOJOB_RUNNING_FILE`` exists meanwhile."""
    if grace_seconds is None:
        grace_seconds = _env_float(GRACE_ENV)
    raw_stop = os.environ.get(STOP_FILE_ENV)
    stop = StopSignal(grace_seconds, Path(raw_stop) if raw_stop else None)
    previous = None
    main = threading.current_thread() is threading.main_thread()
    if main:

        def _on_sigterm(signum: int, frame: FrameType | None) -> None:
            stop.request("SIGTERM")

        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        # The abandon timer interrupts the step through SIGINT's Python handler
        # (``_thread.interrupt_main``), which does nothing while SIGINT is ignored: as it is in
        # a process started in the background of a non-interactive shell.
        previous_int = signal.getsignal(signal.SIGINT)
        if not callable(previous_int):
            signal.signal(signal.SIGINT, signal.default_int_handler)
    running = os.environ.get(RUNNING_FILE_ENV)
    if running:
        try:
            Path(running).write_text(f"{os.getpid()}\n")
        except OSError:
            log.warning("could not write %s", running)
            running = None
    done = threading.Event()
    if stop.stop_file is not None:
        threading.Thread(target=stop._poll_stop_file, args=(done,), daemon=True).start()
    if draining is not None:
        threading.Thread(target=stop._poll_draining, args=(draining, done), daemon=True).start()
    try:
        yield stop
    finally:
        done.set()
        stop.cancel()
        if main:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
            signal.signal(signal.SIGINT, previous_int)
        if running:
            Path(running).unlink(missing_ok=True)
