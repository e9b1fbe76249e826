"""A worker that hangs inside a real step, on a local Ray (issue 42, finding 4): the stall
watchdog ends the run with one line naming that role, rank and phase, and the operator's
failure policy acts on that line as ``spec.failurePolicy.onStall`` says. The hang is arranged,
not timed: ``PPOJOB_HANG_GATE`` makes rank 1 of the actor block for ever (on an event nobody
sets) when it starts writing its checkpoint shard after the first step, a wait the watchdog did
not cover before (the driver's ``ray.get`` waited for ever); the stall limit's floor is 20 s."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from ppojob_operator import restarts
from ppojob_trainer.driver.cluster import CLOSE_S, Cluster
from ppojob_trainer.driver.run import train
from ppojob_trainer.manifest import config_from_doc
from ppojob_trainer.watchdog import STEP_FACTOR, WATCHDOG, StallError
from ppojob_trainer.workers.host import HANG_GATE_ENV
from tests.operator.test_restart_policy import job, rayjob
from tests.trainer.test_loop import Recorder

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ppojob-tiny.yaml"
FLOOR_S = 20

pytestmark = pytest.mark.usefixtures("ray_session")  # conftest: loopback Ray + model cache


def _doc() -> dict[str, Any]:
    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = doc["spec"]
    spec["roles"]["actor"].update(replicas=2, resources={"cpus": 1, "memory": "2Gi"})
    spec["training"].update(checkpointInterval=1)
    spec["failurePolicy"] = {"stallTimeoutSeconds": FLOOR_S}
    return doc


def test_a_rank_hung_in_its_checkpoint_save_is_named_and_the_on_stall_action_follows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(HANG_GATE_ENV, "actor:1:save checkpoint")
    cfg = config_from_doc(_doc())
    assert cfg.stall_timeout_seconds == FLOOR_S
    shutdowns: list[float] = []
    real_shutdown = Cluster.shutdown

    def timed(self: Cluster, closing: list[Any], stopping: bool = False) -> None:
        t = time.monotonic()
        real_shutdown(self, closing, stopping)
        shutdowns.append(time.monotonic() - t)

    monkeypatch.setattr(Cluster, "shutdown", timed)
    with pytest.raises(StallError) as info:
        train(cfg, tmp_path, rec := Recorder(), max_steps=2)
    text = str(info.value)
    # the hung rank's host never answers its close: shutdown kills it after the short bound
    # instead of waiting out the usual one
    assert WATCHDOG.stalled == info.value.pending
    assert shutdowns and shutdowns[0] < CLOSE_S, shutdowns
    assert [step for step, _ in rec.reports] == [1]  # inside the first step's checkpoint
    assert ("actor", 1, "save checkpoint") in info.value.pending, text
    assert "actor rank 1 (save checkpoint)" in text
    assert {phase for *_, phase in info.value.pending} == {"save checkpoint"}, text
    # the limit: the floor, or 3 x the measured step when that is longer
    step_s = rec.reports[0][1]["time/step"]
    assert f"no step progress for {max(FLOOR_S, STEP_FACTOR * step_s):.0f}s" in text

    # the trainer's account (entrypoint: "<reason>: <message>", exit 2) -> the operator's policy
    account = f"{info.value.reason}: {text}"
    failed = {"reason": "AppFailed", "message": "Job entrypoint command failed with exit code 2"}
    for on_stall, action, klass in (
        ("Restart", "Restart", "Disruption"),
        ("Fail", "Fail", "Permanent"),
    ):
        j = job(backoffLimit=0, failurePolicy={"onStall": on_stall})
        d = restarts.decision(j, rayjob(j, **failed), {}, account)
        assert d is not None and (d.action, d.failure_class) == (action, klass), d
        assert "actor rank 1 (save checkpoint)" in d.message


def test_the_stall_limit_follows_the_slowest_step_above_its_floor() -> None:
    WATCHDOG.configure(30)
    assert WATCHDOG.limit == 30
    WATCHDOG.step_took(4.0)
    assert WATCHDOG.limit == 30  # 3 x 4 s is under the floor
    WATCHDOG.step_took(25.0)
    WATCHDOG.step_took(12.0)
    assert WATCHDOG.limit == STEP_FACTOR * 25.0  # the slowest step seen, not the last
    WATCHDOG.configure(None)
    WATCHDOG.step_took(100.0)
    assert WATCHDOG.limit is None  # off


def test_start_up_waits_have_no_limit_until_a_step_has_completed() -> None:
    """Starting workers (a model download), forming groups and loading a checkpoint take what
    the model's size says: no floor applies before the first step; a start-up later in the
    run (an elastic engine joining) has the run's limit, and a step's phases always do."""
    WATCHDOG.configure(30)
    for phases in (["start"], ["rendezvous"], ["resume"], ["start", "resume"]):
        assert WATCHDOG.limit_for(phases) is None, phases
    assert WATCHDOG.limit_for(["start", "generate"]) == 30
    assert WATCHDOG.limit_for(["save checkpoint"]) == 30
    WATCHDOG.step_took(2.0)
    assert WATCHDOG.limit_for(["start"]) == 30
    WATCHDOG.configure(None)


def test_the_gate_with_seconds_makes_a_slow_step_not_a_hung_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``role:rank:phase:seconds`` (the real-pod tests' long steps): the gate's rank sleeps that
    long on entering that phase, then goes on; another rank or phase does not wait."""
    from ppojob_trainer.workers.host import WorkerHost

    host = WorkerHost.__new__(WorkerHost)  # the gate reads only these two
    host.roles, host.events = {"actor": (0, 1)}, []
    monkeypatch.setenv(HANG_GATE_ENV, "actor:0:train:0.3")
    t = time.monotonic()
    host._hang_gate("actor", "train")
    assert time.monotonic() - t >= 0.3 and host.events == ["slow.actor.train"]
    t = time.monotonic()
    host._hang_gate("actor", "save checkpoint")
    host._hang_gate("critic", "train")
    monkeypatch.setenv(HANG_GATE_ENV, "actor:1:train:30")
    host._hang_gate("actor", "train")
    assert time.monotonic() - t < 0.3 and host.events == ["slow.actor.train"]
