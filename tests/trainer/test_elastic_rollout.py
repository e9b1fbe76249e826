"""Elastic rollout engines (issue 24, roles.rollout.elastic) on a local Ray: an engine killed
while it generates does not fail the step.

The kill is arranged, not timed: the engines' processes ask a gate (a Ray actor of this module,
named in ``PPOJOB_ROLLOUT_FAULT_GATE``) before each elastic generation and before they start;
the gate kills the process whose arrival it was told to (``ray.kill``) while that process waits
for its answer, inside its generate call. Every arrival is logged with the engine's prompts,
first sample number, policy version and a checksum of its weights."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml

from ppojob_trainer.driver.elastic import RolloutCapacityError
from ppojob_trainer.driver.trainer import PPOTrainer
from ppojob_trainer.manifest import config_from_doc
from ppojob_trainer.workers.host import FAULT_GATE_ENV

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ppojob-tiny.yaml"
STEPS = 3
KILLED_AT = 3
"""The gate kills the engine of the third elastic generation: the first of step 1 (each of the
two engines generates once a step, and a step's generation starts after the last one's end)."""

pytestmark = pytest.mark.usefixtures("ray_session")  # conftest: loopback Ray + model cache


@ray.remote(num_cpus=0)
class Gate:
    """Logs every arrival; kills the caller at the ``kill_generate``-th generation, the
    ``kill_start``-th start and the ``kill_evaluate``-th evaluation, and never answers the
    ``hold_start``-th start (counted over all engines)."""

    def __init__(
        self,
        kill_generate: int | None,
        kill_start: int | None,
        hold_start: int | None = None,
        kill_evaluate: int | None = None,
    ) -> None:
        self.kill = {"generate": kill_generate, "start": kill_start, "evaluate": kill_evaluate}
        self.hold = hold_start
        self.count = {"generate": 0, "start": 0, "evaluate": 0}
        self.log: list[dict[str, Any]] = []

    async def arrive(self, event: str, caller: Any, info: dict[str, Any]) -> None:
        self.count[event] += 1
        killed = self.count[event] == self.kill[event]
        self.log.append(
            {"event": event, "engine": caller._actor_id.hex(), "killed": killed, **info}
        )
        if killed:  # (and never answered: the kill lands before the caller could go on)
            ray.kill(caller, no_restart=True)
            await asyncio.Event().wait()
        if event == "start" and self.count[event] == self.hold:
            await asyncio.Event().wait()  # an engine that never finishes starting

    async def arrivals(self) -> list[dict[str, Any]]:
        return self.log


def _cfg(elastic: dict[str, int], critic_warmup: int = 0) -> Any:
    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = doc["spec"]
    spec["training"].update(steps=STEPS, checkpointInterval=0)
    spec["algorithm"]["criticWarmupSteps"] = critic_warmup
    spec["roles"]["actor"]["resources"]["cpus"] = 1
    spec["roles"]["rollout"] = {"replicas": 2, "resources": {"cpus": 1}, "elastic": elastic}
    return config_from_doc(doc)


STILL_STARTING: list[int] = []
"""How many engines were still starting when the last :func:`_run` ended."""


EXPENDABLE: list[Any] = []
"""When the last :func:`_run` ended: how many actors a draining node may hold without stopping
the job (the engines, live, starting and let go of; no reward workers here), whether an actor
worker was among them, and their actor ids."""


def _run(
    cfg: Any, gate: Any, monkeypatch: pytest.MonkeyPatch, name: str
) -> tuple[list[dict[str, float]], list[tuple[list[int], list[int]]]]:
    """The steps of ``cfg`` with the gate named in the engines' environment: every step's
    metrics and (sample numbers, group ids) the actor trained on."""
    monkeypatch.setenv(FAULT_GATE_ENV, name)
    trainer = PPOTrainer(cfg)
    trainer.total_steps = STEPS
    history, trained = [], []
    try:
        for step in range(STEPS):
            history.append(trainer.step(step))
            trained.append(ray.get(trainer.hosts["actor"][0].trained_ids.remote()))
        STILL_STARTING[:] = [len(trainer.engines.starting)]
    finally:  # (also when a step failed)
        spare = trainer.expendable_actors()
        actors = {h._actor_id.hex() for h in trainer.hosts["actor"]}
        EXPENDABLE[:] = [len(spare), bool(spare & actors), spare]
        trainer.shutdown()
    return history, trained


def test_an_engine_killed_mid_step_loses_only_its_prompts_and_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """min = max = 2: the killed engine's prompts are generated again (same prompts, same
    sample numbers) on the survivor and a replacement; the replacement holds the weights the
    survivor generates with (the actor's after step 0), not the initial ones, before it
    generates; every sample of every step is trained on exactly once."""
    cfg = _cfg({"minReplicas": 2, "maxReplicas": 2, "startTimeoutSeconds": 300})
    gate = Gate.options(name="gate-replaced").remote(KILLED_AT, None)
    history, trained = _run(cfg, gate, monkeypatch, "gate-replaced")
    log = ray.get(gate.arrivals.remote())
    ray.kill(gate)

    n, k = cfg.data.samples_per_step, cfg.data.samples_per_prompt
    assert len(history) == STEPS
    for ids, groups in trained:  # every sample of each step once, in its own prompt group
        assert sorted(ids) == list(range(n))
        assert groups == [i // k for i in ids]
    assert [m["rollout/engines"] for m in history] == [2.0, 2.0, 2.0]
    assert [m["rollout/lost"] for m in history] == [0.0, 1.0, 0.0]
    gens = [a for a in log if a["event"] == "generate"]
    (killed,) = [a for a in gens if a["killed"]]
    assert killed == gens[KILLED_AT - 1]
    # the killed engine's prompts, and only they, were generated again, under their numbers
    step1 = gens[KILLED_AT:-2]  # (step 2's two generations last)
    survivor = next(a for a in step1 if a["engine"] != killed["engine"] and a["version"] == 1)
    again = sorted(
        (a for a in step1 if a is not survivor and a["engine"] != killed["engine"]),
        key=lambda a: a["first_sample"],
    )
    assert [p for a in again for p in a["prompts"]] == killed["prompts"]
    assert again[0]["first_sample"] == killed["first_sample"]
    for a, b in itertools.pairwise(again):
        assert b["first_sample"] == a["first_sample"] + len(a["prompts"]) * k
    assert history[1]["rollout/requeued"] == len(killed["prompts"])
    assert [m["rollout/requeued"] for m in (history[0], history[2])] == [0.0, 0.0]
    # the replacement: a new engine, holding the current policy before its first generation
    starts = [a for a in log if a["event"] == "start"]
    assert len(starts) == 3
    new = starts[2]["engine"]
    (first,) = [a for a in again if a["engine"] == new][:1]
    initial = gens[0]["checksum"]
    assert first["version"] == survivor["version"] == 1
    assert first["checksum"] == survivor["checksum"] != initial
    # a draining node holding the lost engine stops nothing (Ray lists it alive until its node
    # is marked dead, after the driver dropped it): the live two and the lost one
    assert EXPENDABLE[:2] == [3, False]
    assert killed["engine"] in EXPENDABLE[2]


def test_too_few_engines_left_fail_the_step_naming_the_role_and_the_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """min = max = 2, the engine killed in step 1 and its replacement killed while starting:
    one engine is left, fewer than minReplicas, and none can start."""
    cfg = _cfg({"minReplicas": 2, "maxReplicas": 2, "startTimeoutSeconds": 300})
    gate = Gate.options(name="gate-too-few").remote(KILLED_AT, 3)
    with pytest.raises(RolloutCapacityError) as err:
        _run(cfg, gate, monkeypatch, "gate-too-few")
    log = ray.get(gate.arrivals.remote())
    ray.kill(gate)
    # both engines let go of (the lost one and the replacement that failed to start) stay
    # expendable beside the one left: a drain of their nodes stops nothing
    gone = {a["engine"] for a in log if a["killed"]}
    assert len(gone) == 2
    assert EXPENDABLE[:2] == [3, False] and gone <= EXPENDABLE[2]
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("roles.rollout: 1 rollout engine(s) left, fewer than ")
    assert "elastic.minReplicas 2" in message
    assert "(1 lost, 1 failed to start, 0 still starting)" in message


@pytest.mark.timeout(180, method="thread")  # (a safety net: waiting would take an hour)
def test_the_trainer_never_waits_for_engines_beyond_the_minimum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """replicas 2, minReplicas 1: the engine beyond the minimum starts outside the gang and never
    finishes starting (the gate holds it); the run trains every step on the one engine it has,
    without waiting for the other (startTimeoutSeconds is an hour). (With a critic warm-up step:
    a step without a weight sync.)"""
    cfg = _cfg({"minReplicas": 1, "maxReplicas": 2, "startTimeoutSeconds": 3600}, 1)
    gate = Gate.options(name="gate-held").remote(None, None, 2)
    history, trained = _run(cfg, gate, monkeypatch, "gate-held")
    log = ray.get(gate.arrivals.remote())
    ray.kill(gate)
    n = cfg.data.samples_per_step
    assert [sorted(ids) for ids, _ in trained] == [list(range(n))] * STEPS
    assert [m["rollout/engines"] for m in history] == [1.0] * STEPS
    assert "time/weight_sync" not in history[0] and "time/weight_sync" in history[1]
    assert STILL_STARTING == [1]  # the engine beyond the minimum, started but never joined
    # a draining node holding only engines (the live one or the one starting) stops nothing;
    # one holding the actor worker does
    assert EXPENDABLE[:2] == [2, False]
    first_start = next(a["engine"] for a in log if a["event"] == "start")
    assert {a["engine"] for a in log if a["event"] == "generate"} == {first_start}


def test_an_engine_killed_while_it_evaluates_costs_the_evaluation_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """min = max = 2: an engine killed inside its share of an evaluation; its prompts are
    evaluated again on the engines left (a replacement joins first, minReplicas being 2), and
    the figure equals that of an evaluation nobody disturbed (greedy, same weights)."""
    cfg = _cfg({"minReplicas": 2, "maxReplicas": 2, "startTimeoutSeconds": 300})
    cfg.data.eval_prompts = cfg.data.prompts
    monkeypatch.setenv(FAULT_GATE_ENV, "gate-eval")
    gate = Gate.options(name="gate-eval").remote(None, None, None, 1)
    trainer = PPOTrainer(cfg)
    trainer.total_steps = STEPS
    try:
        trainer.step(0)
        disturbed = trainer.evaluate()
        engines = len(trainer.hosts["rollout"])
        undisturbed = trainer.evaluate()
    finally:
        trainer.shutdown()
    log = ray.get(gate.arrivals.remote())
    ray.kill(gate)
    evals = [a for a in log if a["event"] == "evaluate"]
    (killed,) = [a for a in evals if a["killed"]]
    assert killed["prompts"], "the killed engine had no prompts to evaluate"
    assert trainer.engines.lost == 1 and engines == 2
    # the lost share ran again elsewhere: every prompt evaluated in the first evaluation
    first = evals[: len(evals) - 2]  # (the second evaluation's two shares last)
    again = [p for a in first if not a["killed"] for p in a["prompts"]]
    assert sorted(again) == sorted(e.prompt for e in trainer.eval_examples)
    assert disturbed == undisturbed
