"""Issue 42: a step longer than what is left of the grace period is abandoned, and the completed
steps are still checkpointed, with no periodic checkpoint.

Real local runs of the tiny example, steps made long by the tests' hang gate (a sleep in one
phase, every step). The test process is the driver: a SIGTERM sent to it as the third step
begins is the stop a pod's preStop hook gives it. Until a step's commit (its generation done,
nothing sent to the actor or critic) the trained workers hold the completed steps, so:

- a stop in a generation that outlasts the grace period: the abandon timer interrupts the
  driver's wait and the run checkpoints the two completed steps at once;
- a stop whose grace period cannot hold the training the last steps took after their commit:
  the step is abandoned at its commit, before any training, with the same checkpoint.

Each then resumes with no completed step redone; the first, whose prompts of the abandoned step
had been drawn, matches an uninterrupted run step for step (the data order is rewound).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from ppojob_trainer.checkpoint import complete_checkpoints, latest_checkpoint, read_manifest
from ppojob_trainer.manifest import load_manifest
from ppojob_trainer.preemption import Preempted
from ppojob_trainer.progress import LocalProgressReporter, read_metrics
from ppojob_trainer.workers.host import HANG_GATE_ENV

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "ppojob-tiny.yaml"
COMPARED = ("reward_mean", "kl", "value_loss", "actor/pg_loss", "response/length")
STOP_BEFORE = 2  # the SIGTERM comes as step index 2 (the third step) begins
SLOW_S = 4.0  # the gated phase's length, every step

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]


def _cfg(colocated: bool = False, *extra: tuple[str, object]):
    sets = [
        ("training.steps", 4),
        ("training.seed", 11),
        ("training.checkpointInterval", 0),  # no periodic checkpoint
        ("data.rolloutBatchSize", 4),
        ("training.miniBatchSize", 32),
        # engines in processes of their own: a colocated engine's generation runs in the
        # actor's process and holds a save back (the stop then keeps the newest checkpoint)
        ("roles.rollout.colocateWithActor", colocated),
        ("roles.actor.resources.cpus", 1),
    ]
    if not colocated:
        sets.append(("roles.rollout.resources.cpus", 1))
    return load_manifest(TINY, [*sets, *extra])[1]


def _train(cfg, out: Path, grace: float | None = None):
    from ppojob_trainer.driver.run import train

    reporter = LocalProgressReporter(out, show_bar=False)
    return train(cfg, out, reporter, grace_seconds=grace)


def _sigterm_as_step_begins(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM to this (the driver's) process when step ``STOP_BEFORE`` begins: past the
    loop's own look at the stop, so the step is in flight when it is asked for."""
    from ppojob_trainer.driver.trainer import PPOTrainer

    step = PPOTrainer.step

    def stepping(self, i: int):
        if i == STOP_BEFORE:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(self, i)

    monkeypatch.setattr(PPOTrainer, "step", stepping)


def _stopped(cfg, out: Path, grace: float, monkeypatch: pytest.MonkeyPatch) -> Preempted:
    with monkeypatch.context() as m:
        _sigterm_as_step_begins(m)
        with pytest.raises(Preempted) as info:
            _train(cfg, out, grace)
    return info.value


def _ckpt_steps(out: Path) -> list[int]:
    return [(read_manifest(p) or {})["step"] for p in complete_checkpoints(out / "checkpoints")]


def test_a_generation_longer_than_the_grace_period_is_abandoned_with_the_completed_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(HANG_GATE_ENV, f"rollout:0:generate:{SLOW_S}")
    cfg = _cfg()
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    _train(cfg, whole)

    # grace 3 s: the timer interrupts the driver's wait about 1 s into the 4 s generation
    stopped = _stopped(cfg, parts, 3.0, monkeypatch)
    assert stopped.abandoned and stopped.step == STOP_BEFORE, stopped
    assert "abandoned the step in flight" in str(stopped)
    newest = latest_checkpoint(parts / "checkpoints")
    assert newest is not None and stopped.checkpoint == str(newest)
    # step 1's is the probe that timed a checkpoint (a grace period is set), step 2's the stop's
    assert _ckpt_steps(parts) == [1, STOP_BEFORE]
    assert [r["step"] for r in read_metrics(parts)] == [1, 2]

    _train(cfg, parts)  # resumes at step 2: redoes none, runs 3 and 4
    a, b = read_metrics(whole), read_metrics(parts)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b, strict=True):  # the abandoned step's prompts were drawn again
        for key in COMPARED:
            if ra.get(key) is not None:
                assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), (ra["step"], key)


@pytest.mark.parametrize("colocated", [False, True], ids=["engines apart", "colocated"])
def test_a_step_whose_training_no_longer_fits_is_abandoned_at_its_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, colocated: bool
) -> None:
    """Colocated, the engine generates in the actor's process (1 s here, within the grace
    period): the save waits for that generation, and comes at the commit."""
    gates = f"actor:0:train:{SLOW_S}" + (",rollout:0:generate:1" if colocated else "")
    monkeypatch.setenv(HANG_GATE_ENV, gates)
    cfg = _cfg(colocated)
    out = tmp_path / "out"
    # grace 5 s: the abandon timer (5 s less the checkpoint and the margin) would interrupt the
    # 4 s training once it started, past the commit; the commit sees it cannot fit and stops
    stopped = _stopped(cfg, out, 5.0, monkeypatch)
    assert stopped.abandoned and stopped.step == STOP_BEFORE, stopped
    assert _ckpt_steps(out) == [1, STOP_BEFORE]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    _train(cfg, out)
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]


def test_a_stop_during_an_evaluation_checkpoints_the_step_it_follows_within_the_grace_period(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engines evaluate after every step (20 s here, the gate); a stop as step 2 begins:
    step 2 completes, its evaluation outlasts the grace period (3 s), the timer cuts it short,
    and step 2 is reported and checkpointed at once, not after the evaluation (the engines'
    processes, busy evaluating, are not asked for their generators)."""
    monkeypatch.setenv(HANG_GATE_ENV, "rollout:0:evaluate:20")
    cfg = _cfg(False, ("data.evalPrompts", "builtin:count-up"), ("training.evalInterval", 1))
    out = tmp_path / "out"
    from ppojob_trainer.driver.trainer import PPOTrainer

    step, asked = PPOTrainer.step, {}

    def stepping(self, i: int):
        if i == 1:
            asked["at"] = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)
        return step(self, i)

    monkeypatch.setattr(PPOTrainer, "step", stepping)
    with pytest.raises(Preempted) as info:
        _train(cfg, out, 3.0)
    took = time.monotonic() - asked["at"]
    assert info.value.abandoned and info.value.step == 2, info.value
    assert _ckpt_steps(out) == [1, 2]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert took < 12, took  # within the grace period (3 s) and step 2 (about 1 s), not 20 s
