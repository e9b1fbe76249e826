"""Bounded staleness (issue 24) on a local Ray (one session for the module).

End to end with the tiny example: maxStaleness 0 reproduces the synchronous loop bit for bit,
and with 1 the engines generate the next step while the actor trains, every token tagged with
the version that generated it. (The actor's own share: tests/trainer/test_offpolicy_actor.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ppojob_trainer.driver import run as driver_run
from ppojob_trainer.driver import weights
from ppojob_trainer.driver.run import train
from ppojob_trainer.manifest import config_from_doc
from ppojob_trainer.watchdog import WATCHDOG
from tests.helpers.sync_step import SynchronousTrainer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ppojob-tiny.yaml"
STEPS = 3

pytestmark = pytest.mark.usefixtures("ray_session")  # conftest: loopback Ray + model cache


class _Quiet:
    def start(self, total: int, start_step: int = 0) -> None:
        pass

    def report(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def finish(self, summary: dict[str, Any]) -> None:
        pass


def _cfg(staleness: int | None, own_engine: bool) -> Any:
    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = doc["spec"]
    spec["training"].update(steps=STEPS, checkpointInterval=0)
    if own_engine:  # actor and engine on one core each
        spec["roles"]["actor"]["resources"]["cpus"] = 1
        spec["roles"]["rollout"] = {"resources": {"cpus": 1}}
    if staleness is not None:
        spec["algorithm"]["maxStaleness"] = staleness
    return config_from_doc(doc)


def test_staleness_zero_reproduces_the_synchronous_loop_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example as `ppojob run` runs it (staleness 0, its default) against the step as it
    was before staleness existed (tests/helpers/sync_step.py), same seed: every loss, reward
    and statistic is the same float."""
    cfg = _cfg(0, own_engine=False)
    new = train(cfg, tmp_path / "new", _Quiet())
    monkeypatch.setattr(driver_run, "PPOTrainer", SynchronousTrainer)
    old = train(cfg, tmp_path / "old", _Quiet())
    assert len(new.history) == len(old.history) == STEPS
    keys = [
        "reward/mean",
        "response/length",
        "advantage/abs_mean",
        "rollout/logprob_diff_mean",
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/grad_norm",
        "actor/entropy",
        "critic/vf_loss",
    ]
    for key in keys:
        assert [m[key] for m in new.history] == [m[key] for m in old.history], key
    assert [m["staleness/max"] for m in new.history] == [0.0] * STEPS


def test_staleness_one_overlaps_generation_with_training_within_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # what each step waits for, and the engines' weight loads each step's sync queues
    waited: list[set[Any]] = []
    loads: list[list[Any]] = []
    wait = WATCHDOG.wait
    push = weights.push_weights

    def record_wait(calls: list[tuple[str, int, str, Any]]) -> None:
        if any(c[2] == "prepare" for c in calls):  # the step's own wait (driver _collect)
            waited.append({c[3] for c in calls if c[2] == "weight sync"})
        wait(calls)

    def record_push(
        actor: Any, version: int, engines: list[Any], **kw: Any
    ) -> tuple[list[Any], list[Any]]:
        sends, joined = push(actor, version, engines, **kw)
        loads.append(sends)
        return sends, joined

    monkeypatch.setattr(WATCHDOG, "wait", record_wait)
    monkeypatch.setattr(weights, "push_weights", record_push)
    result = train(_cfg(1, own_engine=True), tmp_path / "async", _Quiet())
    h = result.history
    # the sync goes through the object store, one load per engine per step, and no step waits
    # for its own sync's loads (queued on the engine ahead of its next generation): the next
    # step does
    assert len(waited) == len(loads) == STEPS and all(len(x) == 1 for x in loads)
    for k in range(STEPS):
        assert not waited[k] & set(loads[k]), k
    for k in range(STEPS - 1):
        assert set(loads[k]) <= waited[k + 1], k
    assert [m["policy/version"] for m in h] == [0.0, 1.0, 2.0]
    # step 0's samples come from the initial weights, every later step's from one version
    # before the actor's (generated while the actor trained the step before)
    assert [m["staleness/max"] for m in h] == [0.0, 1.0, 1.0]
    assert [m["staleness/mean"] for m in h] == [0.0, 1.0, 1.0]
    assert [m["staleness/share_1"] for m in h] == [0.0, 1.0, 1.0]
    # the engine generated step k+1 during step k's training (not after it)
    assert max(m["time/overlap_share"] for m in h[:-1]) > 0
