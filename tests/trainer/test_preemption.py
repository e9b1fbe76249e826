"""Preemption: a SIGTERM mid-training ends `ppojob run` after the step in flight with a checkpoint
of it and exit code 75; running the same command again resumes there with no completed step lost
and none run twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppojob_api.failures import PREEMPTED_EXIT_CODE, classify
from ppojob_trainer.checkpoint import latest_checkpoint, read_manifest
from ppojob_trainer.preemption import StopSignal, watch
from ppojob_trainer.progress import METRICS_FILE, read_metrics

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "ppojob-tiny.yaml"
STEPS = 6


def _command(out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ppojob_cli",
        "run",
        str(TINY),
        "--steps",
        str(STEPS),
        "--set",
        "data.rolloutBatchSize=4",
        "--set",
        "training.miniBatchSize=32",
        "--set",
        "training.checkpointInterval=0",  # only the end (and the preemption) checkpoints
        "--num-cpus",
        "2",
        "--no-progress",
        "--out",
        str(out),
    ]


def _wait_for(predicate, proc: subprocess.Popen, timeout: float) -> None:
    """Poll a file-backed condition; fail early if the process ended."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"ppojob run ended (rc {proc.returncode}) before the condition")
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for training progress")
        time.sleep(0.05)


def _ckpt_step(out: Path) -> int | None:
    path = latest_checkpoint(out / "checkpoints")
    return None if path is None else (read_manifest(path) or {}).get("step")


@pytest.mark.slow
def test_sigterm_checkpoints_the_last_completed_step_and_resume_loses_none(tmp_path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env["PPOJOB_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.Popen(_command(out), env=env, stderr=subprocess.PIPE, text=True)
    try:
        # one step reported: the next one is in flight
        _wait_for(lambda: len(read_metrics(out)) >= 1, proc, timeout=300)
        seen = len(read_metrics(out))
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == PREEMPTED_EXIT_CODE, err[-2000:]
    assert "Preempted: SIGTERM" in err
    before = read_metrics(out)
    done = len(before)
    assert seen <= done < STEPS  # stopped early, at a step boundary at or after the signal
    assert [r["step"] for r in before] == list(range(1, done + 1))
    assert _ckpt_step(out) == done  # the checkpoint holds the last completed step
    assert classify(err.strip().splitlines()[-1]) == "Disruption", err[-1500:]
    lines_before = (out / METRICS_FILE).read_text().splitlines()

    again = subprocess.run(_command(out), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    after = read_metrics(out)
    assert [r["step"] for r in after] == list(range(1, STEPS + 1))
    # the steps done before the preemption were not run again: their records are untouched
    assert (out / METRICS_FILE).read_text().splitlines()[:done] == lines_before
    assert _ckpt_step(out) == STEPS


def test_stop_signal_sets_on_sigterm_and_restores_the_handler() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with watch(grace_seconds=None) as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(5)
        assert stop.cause == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_stop_file_requests_a_stop_and_the_running_file_goes(tmp_path, monkeypatch) -> None:
    """The head's preStop hook touches the stop file and waits while the running file exists."""
    stop_file, running = tmp_path / "stop", tmp_path / "running"
    monkeypatch.setenv("PPOJOB_STOP_FILE", str(stop_file))
    monkeypatch.setenv("PPOJOB_RUNNING_FILE", str(running))
    with watch() as stop:
        assert running.exists()
        stop_file.touch()
        assert stop.wait(10)
        assert stop.cause == f"stop file {stop_file}"
    assert not running.exists()


def test_a_draining_ray_node_requests_a_stop_within_the_drains_deadline() -> None:
    """A worker pod's SIGTERM drains its Ray node until kubelet's SIGKILL (the operator sets
    RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S to the grace period): the stop names the node, and the
    abandon timer counts from the drain's deadline when that leaves less than the grace period.
    A GCS that does not answer once is asked again. (tests/trainer/test_worker_stop.py drives it
    with a real drain.)"""
    answers: list[object] = [RuntimeError("GCS unreachable"), []]
    deadline = time.time() + 10.0

    def draining() -> list[tuple[str, float | None]]:
        answer = answers.pop(0) if answers else [("tiny-x-worker-1", deadline)]
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[return-value]

    with watch(grace_seconds=30.0, draining=draining) as stop:
        assert stop.wait(10)
        assert stop.cause == "Ray node tiny-x-worker-1 is stopping (its pod got SIGTERM)"
        assert not answers
        assert stop._timer is not None
        assert 10.0 - 2 - 2.0 < stop._timer.interval <= 10.0 - 2.0  # deadline - margin


@pytest.fixture()
def default_sigint():
    """SIGINT handled as a trainer process handles it (Python's default: KeyboardInterrupt),
    whatever an earlier test of this pytest process left installed (``interrupt_main`` does
    nothing under SIG_DFL or SIG_IGN)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_the_abandon_works_where_sigint_was_ignored() -> None:
    """A trainer started in the background of a non-interactive shell starts with SIGINT
    ignored, where ``interrupt_main`` does nothing: ``watch`` installs Python's handler for its
    duration, and puts the ignored one back."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(KeyboardInterrupt), watch(grace_seconds=2.1) as stop:
            stop.in_step = True
            stop.request("SIGTERM")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # a step that does not end
                time.sleep(0.01)
        assert stop.abandoned
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("default_sigint")
def test_a_step_that_outlives_the_grace_period_is_abandoned() -> None:
    stop = StopSignal(grace_seconds=2.1)  # 0.1 s before the margin runs out
    stop.in_step = True
    stop.request("SIGTERM")
    with pytest.raises(KeyboardInterrupt):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # a step that does not end
            time.sleep(0.01)
    assert stop.abandoned


def test_a_step_that_ends_in_time_is_not_abandoned() -> None:
    stop = StopSignal(grace_seconds=2.1)
    stop.in_step = False  # the step finished before the deadline
    stop.request("SIGTERM")
    assert stop._timer is not None
    stop._timer.join(5)
    assert not stop.abandoned


class _ScriptedStop(StopSignal):
    """A stop whose ``requested`` answers from a script, read by read (then the last answer)."""

    def __init__(self, answers: list[bool]) -> None:
        super().__init__()
        self.answers = answers
        self.reads = 0

    @property
    def requested(self) -> bool:  # type: ignore[override]
        i, self.reads = self.reads, self.reads + 1
        return self.answers[min(i, len(self.answers) - 1)]


class _StubTrainer:
    """What the run loop asks of a trainer: a step, evaluation, checkpoint state."""

    committed = False
    completed = exposed_s = None

    def step(self, step: int) -> dict[str, float]:
        return {"reward/mean": 0.5, "time/step": 0.01}

    def checkpointable(self) -> bool:
        return True

    def eval_due(self, done: int, total: int) -> bool:
        return False

    def save_workers(self, directory: Path) -> None:
        (directory / "workers.txt").write_text("shards")

    def state(self, step: int) -> dict[str, object]:
        return {"step": step}


def _five_steps(tmp_path: Path, trainer: object, reporter: type, stop: StopSignal) -> object:
    """The run loop over ``trainer`` for 5 steps, no periodic checkpoint, under ``stop``."""
    from types import SimpleNamespace

    from ppojob_trainer.driver.run import TrainResult, _Run

    cfg = SimpleNamespace(
        training=SimpleNamespace(
            resume=False, checkpoint_interval=0, keep_checkpoints=2, export_hugging_face=False
        )
    )
    return _Run(
        trainer,  # type: ignore[arg-type]
        cfg,  # type: ignore[arg-type]
        tmp_path / "ckpt",
        reporter(tmp_path / "out", show_bar=False),
        TrainResult(steps=0),
        5,
        time.perf_counter(),
        stop,
    )


@pytest.mark.parametrize(
    ("answers", "stopped_at"),
    [
        # read 1 at the loop's top (step 0), read 2 at the step's own check: the stop is seen
        # there and step 1 is checkpointed with the step
        ([False, True], 1),
        # the stop lands after step 1's own check and before the loop's next look: the loop
        # ends with step 1 completed and not checkpointed by the step
        ([False, False, True], 1),
        # the same after step 2
        ([False, False, False, False, True], 2),
    ],
)
def test_a_stop_anywhere_between_steps_checkpoints_every_completed_step(
    tmp_path: Path, answers: list[bool], stopped_at: int
) -> None:

    from ppojob_trainer.preemption import Preempted
    from ppojob_trainer.progress import LocalProgressReporter

    stop = _ScriptedStop(answers)
    stop.cause = "SIGTERM"
    run = _five_steps(tmp_path, _StubTrainer(), LocalProgressReporter, stop)
    with pytest.raises(Preempted) as info:
        run.run()
    assert info.value.step == stopped_at and not info.value.abandoned
    newest = latest_checkpoint(tmp_path / "ckpt")
    assert newest is not None and newest.name == f"step-{stopped_at:06d}", newest
    assert info.value.checkpoint == str(newest)


@pytest.mark.parametrize("during_a_step", [True, False])
def test_the_account_says_whether_a_step_was_in_flight_at_the_stop(
    tmp_path: Path, during_a_step: bool
) -> None:
    """A stop asked for inside step 2 lets it finish: "finished the step in flight". One asked for
    after step 2's report (its checkpoint or the loop's next look, where a pod's SIGTERM lands
    as often as in a step) has no step to finish, and the account says so instead of claiming
    one: both checkpoint the 2 completed steps."""

    from ppojob_trainer.preemption import Preempted
    from ppojob_trainer.progress import LocalProgressReporter

    stop = StopSignal()

    class Trainer(_StubTrainer):
        def step(self, step: int) -> dict[str, float]:
            if during_a_step and step == 1:
                stop.request("SIGTERM")
            return super().step(step)

    class Reporter(LocalProgressReporter):
        def report(self, step: int, metrics: dict[str, float]) -> None:
            super().report(step, metrics)
            if not during_a_step and step == 2:
                stop.request("SIGTERM")

    run = _five_steps(tmp_path, Trainer(), Reporter, stop)
    with pytest.raises(Preempted) as info:
        run.run()
    assert info.value.step == 2 and info.value.in_flight is during_a_step
    said = "finished the step in flight" if during_a_step else "no step was in flight"
    assert str(info.value) == (
        f"SIGTERM: {said}; 2 completed steps are in checkpoint {info.value.checkpoint}; "
        "the next run resumes there"
    )
    newest = latest_checkpoint(tmp_path / "ckpt")
    assert newest is not None and str(newest) == info.value.checkpoint
    assert newest.name == "step-000002"


def test_a_training_run_watches_the_draining_ray_nodes(tmp_path, monkeypatch) -> None:
    """``train`` hands the GCS's draining nodes to ``watch``: without it a worker pod's SIGTERM
    reaches the driver only as an ActorDiedError when the grace period ends."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    from ppojob_trainer.driver import run

    seen: dict[str, object] = {}

    @contextmanager
    def recording_watch(grace_seconds=None, draining=None):
        seen["draining"] = draining
        raise RuntimeError("recorded")
        yield  # pragma: no cover

    class _NoTrainer:
        def __init__(self, cfg, threads=None) -> None:
            pass

        def expendable_actors(self) -> set[str]:
            return {"engine"}

        def shutdown(self, stopping: bool = False) -> None:
            seen["shutdown"] = True

    monkeypatch.setattr(run.runtime, "connect_ray", lambda: None)
    monkeypatch.setattr(run, "PPOTrainer", _NoTrainer)
    monkeypatch.setattr(run, "watch", recording_watch)
    cfg = SimpleNamespace(training=SimpleNamespace(steps=1, checkpoint_dir="ckpt"))
    with pytest.raises(RuntimeError, match="recorded"):
        run.train(cfg, tmp_path, reporter=None)  # type: ignore[arg-type]
    draining = seen.pop("draining")
    assert seen == {"shutdown": True}
    # the GCS's draining nodes, less those holding only actors the run can lose
    assert draining.func is run.draining_ray_nodes  # type: ignore[attr-defined]
    assert draining.args[0]() == {"engine"}  # type: ignore[attr-defined]


def test_only_a_draining_node_with_an_actor_of_the_job_is_a_stop() -> None:
    """The autoscaler drains idle nodes of an elastic rollout group (no actor left on them): no
    reason to stop the job. A node with one of the job's live actors is."""
    from ppojob_trainer.driver.run import stopping_nodes

    draining = {"idle": 0, "busy": 1_700_000_030_000}
    names = {"busy": "tiny-x-worker-1", "idle": "tiny-x-rollout-2"}
    assert stopping_nodes(draining, {"busy", "head"}, names) == [
        ("tiny-x-worker-1", 1_700_000_030.0)
    ]
    assert stopping_nodes(draining, {"head"}, names) == []
    assert stopping_nodes({"busy": 0}, {"busy"}, {}) == [("busy", None)]


def test_a_node_holding_only_actors_the_run_can_lose_is_no_stop() -> None:
    """Elastic engines and reward workers are dropped and replaced when lost: a draining node
    holding only those does not stop the job; one holding any other actor of the job does."""
    from ppojob_trainer.driver.run import actor_nodes

    actors = {
        "e1": {"Address": {"NodeID": "rollout-pod"}},
        "r1": {"Address": {"NodeID": "reward-pod"}},
        "a1": {"Address": {"NodeID": "actor-pod"}},
        "a2": {"Address": {"NodeID": "reward-pod"}},
    }
    assert actor_nodes(actors, {"e1", "r1"}) == {"actor-pod", "reward-pod"}
    assert actor_nodes(actors, {"e1", "r1", "a2"}) == {"actor-pod"}
    assert actor_nodes(actors, set()) == {"rollout-pod", "reward-pod", "actor-pod"}
