"""Reward workers (``roles.reward``) lost mid-step, on a local Ray: the engines send a lost
worker's part again to the workers left, so the step's scores are those of an undisturbed step;
only when none is left does the step fail, with one line naming roles.reward and the counts.

The kill is arranged, not timed: each reward worker asks a gate (a Ray actor of this module,
named in ``PPOJOB_REWARD_FAULT_GATE``) before it scores; the gate kills the worker whose
arrival it was told to (``ray.kill``) while that worker waits for its answer, inside its share
of the step. Every arrival is logged with the worker's prompts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml

from ppojob_trainer.driver.trainer import PPOTrainer
from ppojob_trainer.manifest import config_from_doc
from ppojob_trainer.rewards import RemoteRewardModelScorer
from ppojob_trainer.workers.reward import REWARD_FAULT_GATE_ENV, RemoteRewardHost
from tests.trainer.test_rewards import build_reward_model

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ppojob-tiny.yaml"
FIELD = "data.rewards[0].model"
BATCH = 3
"""The model source's batchSize."""

pytestmark = pytest.mark.usefixtures("ray_session")  # conftest: loopback Ray + model cache


@ray.remote(num_cpus=0)
class Gate:
    """Logs every arrival; kills the caller at an arrival numbered in ``arrivals`` (counted
    over all workers, from 1), at one whose prompts are in ``prompts`` (once each), or at every
    arrival (``every``). :meth:`arm` sets these."""

    def __init__(self) -> None:
        self.arrivals_: set[int] = set()
        self.prompts: list[list[str]] = []
        self.every = False
        self.count = 0
        self.log: list[dict[str, Any]] = []

    async def arm(
        self,
        arrivals: tuple[int, ...] = (),
        prompts: tuple[list[str], ...] = (),
        every: bool = False,
    ) -> None:
        self.arrivals_ = set(arrivals)
        self.prompts = list(prompts)
        self.every = every

    async def arrive(self, event: str, caller: Any, info: dict[str, Any]) -> None:
        self.count += 1
        killed = self.every or self.count in self.arrivals_ or info["prompts"] in self.prompts
        if info["prompts"] in self.prompts:
            self.prompts.remove(info["prompts"])
        self.log.append(
            {"event": event, "worker": caller._actor_id.hex(), "killed": killed, **info}
        )
        if killed:  # (and never answered: the kill lands before the caller could go on)
            ray.kill(caller, no_restart=True)
            await asyncio.Event().wait()

    async def arrivals(self) -> list[dict[str, Any]]:
        return self.log


def _doc(rm: Path, replicas: int) -> dict[str, Any]:
    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = doc["spec"]
    spec["roles"]["actor"]["resources"]["cpus"] = 1
    spec["roles"]["reward"] = {"replicas": replicas, "resources": {"cpus": 0.5, "memory": "1Gi"}}
    spec["data"].update(rolloutBatchSize=4, rewards=[{"model": {"path": str(rm), "batchSize": 5}}])
    spec["training"].update(miniBatchSize=32, checkpointInterval=0)
    return doc


@pytest.fixture(scope="module")
def rm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_reward_model(tmp_path_factory.mktemp("rm"))


def _workers(rm: Path, n: int, gate: str) -> list[Any]:
    """``n`` reward workers holding the model source (batchSize :data:`BATCH`), gated."""
    doc = _doc(rm, n)
    doc["spec"]["data"]["rewards"][0]["model"]["batchSize"] = BATCH
    cfg_json = config_from_doc(doc).model_dump_json(by_alias=True)
    env = {"runtime_env": {"env_vars": {REWARD_FAULT_GATE_ENV: gate}}}
    hosts = [
        RemoteRewardHost.options(num_cpus=0.5, **env).remote(cfg_json, r, n, 1) for r in range(n)
    ]
    idents = ray.get([h.ready.remote() for h in hosts])
    assert all("error" not in i for i in idents), idents
    return hosts


PROMPTS = [f"{i % 7}{i % 3}" for i in range(20)]
COMPLETIONS = [" " + "0123456789"[i % 10 :] for i in range(20)]


def test_a_worker_killed_inside_its_share_is_replaced_by_the_others_same_scores(
    rm: Path,
) -> None:
    """Three workers, 20 samples in parts of 7, 7 and 6: the gate kills the worker of samples
    7:14 while it scores them; that part goes again to the two left, cut at its batches of 3
    (7:13 and 13:14), and the call's scores equal an undisturbed call's exactly. The dead
    worker is sent nothing after."""
    gate = Gate.options(name="reward-gate-one").remote()
    hosts = _workers(rm, 3, "reward-gate-one")
    try:
        scorer = RemoteRewardModelScorer(hosts, 0, FIELD, first=0, batch_size=BATCH)
        undisturbed = scorer(PROMPTS, COMPLETIONS, [None] * 20)
        assert scorer.last_resent == 0 and len(scorer.workers) == 3
        before = len(ray.get(gate.arrivals.remote()))
        assert before == 3
        ray.get(gate.arm.remote(prompts=(PROMPTS[7:14],)))
        disturbed = scorer(PROMPTS, COMPLETIONS, [None] * 20)
        assert disturbed == undisturbed  # exactly: the same batches, scored elsewhere
        assert scorer.last_resent == 7 and scorer.lost == 1 and len(scorer.workers) == 2
        log = ray.get(gate.arrivals.remote())[before:]
        (killed,) = [a for a in log if a["killed"]]
        assert killed["prompts"] == PROMPTS[7:14]
        victim = killed["worker"]
        assert hosts[1]._actor_id.hex() == victim  # (part 1 of an engine of rank 0)
        sent = sorted(
            (a["prompts"] for a in log if not a["killed"]), key=lambda p: PROMPTS.index(p[0])
        )
        assert sent == [PROMPTS[0:7], PROMPTS[7:13], PROMPTS[13:14], PROMPTS[14:20]]
        resent = [a for a in log if a["prompts"] in (PROMPTS[7:13], PROMPTS[13:14])]
        assert victim not in {a["worker"] for a in resent}
        assert len({a["worker"] for a in resent}) == 2  # split over both workers left
        # a later call goes to the two left only
        before += len(log)
        later = scorer(PROMPTS, COMPLETIONS, [None] * 20)
        log = ray.get(gate.arrivals.remote())[before:]
        assert len(log) == 2 and victim not in {a["worker"] for a in log}
        assert later == pytest.approx(undisturbed, rel=1e-5) and scorer.last_resent == 0
    finally:
        for h in hosts:
            ray.kill(h)
        ray.kill(gate)


def test_all_workers_lost_fail_the_call_naming_roles_reward_and_the_counts(rm: Path) -> None:
    """Two workers, each killed inside its share: no worker is left to send the parts to, and
    the call fails with one line."""
    gate = Gate.options(name="reward-gate-all").remote()
    hosts = _workers(rm, 2, "reward-gate-all")
    try:
        ray.get(gate.arm.remote(every=True))
        scorer = RemoteRewardModelScorer(hosts, 0, FIELD, first=0, batch_size=BATCH)
        with pytest.raises(ValueError) as info:
            scorer(PROMPTS, COMPLETIONS, [None] * 20)
        msg = str(info.value)
        assert "\n" not in msg
        assert msg.startswith(f"{FIELD}: roles.reward: all 2 reward worker(s) were lost")
        assert "(2 lost, 0 left)" in msg
        assert scorer.workers == []
    finally:
        for h in hosts:
            ray.kill(h)
        ray.kill(gate)


REPLACED: list[int] = []
"""Reward workers each :func:`_steps` run started again in a lost one's place."""

SPARE: list[set[str]] = []
"""Each :func:`_steps` run's expendable actors at its end (``PPOTrainer.expendable_actors``)."""


def _steps(rm: Path, monkeypatch: pytest.MonkeyPatch, gate: str, steps: int) -> list[dict]:
    """The metrics of ``steps`` training steps with two reward workers, gated by ``gate``."""
    monkeypatch.setenv(REWARD_FAULT_GATE_ENV, gate)
    trainer = PPOTrainer(config_from_doc(_doc(rm, 2)))
    trainer.total_steps = steps
    try:
        return [trainer.step(step) for step in range(steps)]
    finally:
        REPLACED.append(trainer.rollouts.rewards.replaced)
        SPARE.append(trainer.expendable_actors())
        trainer.shutdown()


def test_a_step_with_a_reward_worker_killed_scores_as_an_undisturbed_step(
    rm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training run (one engine, two reward workers, 4 x 8 samples a step in parts of 16,
    batchSize 5): the gate kills the worker of the second part of step 0 inside its share. The
    step completes, its part scored again by the worker left, and every reward metric of the
    step is the undisturbed run's, exactly. Before step 1 the trainer starts a worker in the
    lost one's place, so step 1 too is split as undisturbed and scores the same."""
    REPLACED.clear()
    SPARE.clear()
    gate = Gate.options(name="reward-gate-run").remote()
    undisturbed = _steps(rm, monkeypatch, "reward-gate-run", 2)
    ray.kill(gate)
    gate = Gate.options(name="reward-gate-run").remote()
    ray.get(gate.arm.remote(arrivals=(2,)))
    disturbed = _steps(rm, monkeypatch, "reward-gate-run", 2)
    log = ray.get(gate.arrivals.remote())
    ray.kill(gate)

    (killed,) = [a for a in log if a["killed"]]
    assert killed == log[1] and len(killed["prompts"]) == 16
    # its part again, whole (one worker left), then step 1's two parts of 16: on the survivor
    # and on the worker the trainer started in the lost one's place
    assert [a["prompts"] for a in log[2:3]] == [killed["prompts"]]
    assert [len(a["prompts"]) for a in log[2:]] == [16, 16, 16]
    (survivor,) = {a["worker"] for a in log[:2]} - {killed["worker"]}
    assert log[2]["worker"] == survivor
    assert {a["worker"] for a in log[3:]} - {survivor} - {killed["worker"]}  # a new worker
    assert killed["worker"] not in {a["worker"] for a in log[2:]}
    assert sorted(a["rank"] for a in log[3:]) == [0, 1]  # (it took the lost one's rank)
    assert [m["reward/model_resent"] for m in disturbed] == [16.0, 0.0]
    assert [m["reward/model_resent"] for m in undisturbed] == [0.0, 0.0]
    assert [m["reward/model_remote"] for m in disturbed] == [32.0, 32.0]
    assert REPLACED == [0, 1]  # (undisturbed, disturbed)
    # a draining node holding the lost worker stops nothing (the GCS lists it alive until its
    # node is marked dead): the two live workers and the lost one
    assert [len(s) for s in SPARE] == [2, 3]
    assert killed["worker"] in SPARE[1]
    for a, b in zip(undisturbed, disturbed, strict=True):  # both steps score as undisturbed
        keys = [k for k in a if k.startswith(("reward", "advantages")) and "resent" not in k]
        assert "reward/model_mean" in keys and a["reward/model_mean"] != 0.0
        assert {k: b[k] for k in keys} == {k: a[k] for k in keys}
