"""The PPO step, written out like a training script (see :meth:`PPOTrainer.step`).

    generate -> reward -> [colocated engines sleep] -> values (refs) -> old/ref log-probs
    -> advantages -> critic updates -> actor update (after warm-up) -> [engines wake]
    -> weight sync -> metrics

The driver holds no model and never pulls a tensor: it samples prompts, hands the workers
ObjectRefs and sample ranges, and reads back float metrics. Critic values travel from the
critic workers to the actor workers through the object store, routed by sample range, so actor
and critic may have different data-parallel sizes. Each mode is owned by the piece it concerns
(:mod:`.topology` resolves them): the weight sync by :mod:`.weights`, elastic engines and
reward workers by :mod:`.elastic`, the generation window by :mod:`.rollouts`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppojob_api.training import TrainerConfig

from ..algorithms import AdaptiveKLController, FixedKLController, plan_step
from ..checkpoint import config_fingerprint
from ..tasks import make_task
from ..watchdog import WATCHDOG
from .cluster import Cluster
from .elastic import ElasticEngines, RewardWorkers
from .groups import Groups
from .metrics import generation_metrics, overlap_seconds, step_metrics, train_span
from .rollouts import Rollout, Rollouts
from .topology import resolve_topology
from .weights import WeightSync, weight_sync

log = logging.getLogger(__name__)


@dataclass
class StepRefs:
    """Refs of a step's calls, by phase."""

    rollout: Rollout
    values: list[Any]
    prepared: list[Any]
    critic_done: list[Any]
    actor_done: list[Any]
    woken: list[Any]
    synced: list[Any]


@dataclass
class Reports:
    """What the step's calls returned (the driver's one round trip)."""

    gens: list[dict[str, Any]]
    prep: list[tuple[Any, dict[str, float]]]
    """The actor's data-parallel leaders'."""
    critic: list[dict[str, float]]
    actor: list[dict[str, float]]
    sync: list[float]


class PPOTrainer:
    """Ray worker processes of all roles in one placement group, and the step."""

    evaluating = False
    """An evaluation runs on the engines (or a stop cut it short)."""

    def __init__(self, cfg: TrainerConfig, threads: dict[str, int] | None = None) -> None:
        self.cfg = cfg
        self.topo = resolve_topology(cfg)
        self.total_steps: int | None = None
        """The run's step count (:func:`~.run.train` sets it): no generation is launched
        past it."""
        self.committed = False
        """The step in flight has sent work to the trained workers (from its commit, once its
        generation is done, until it ends): before that they hold the last completed step
        untouched (:meth:`checkpointable`)."""
        self.commit_s: float | None = None
        """Seconds from the last completed step's commit to its end: what a stop must leave
        for the step once it has committed."""
        self.completed: tuple[int, dict[str, float]] | None = None
        """The last step completed, with its metrics (the run reports it when a stop cut its
        evaluation short)."""
        self.exposed_s: float | None = None
        """Of the last completed step, the longest part a stop could not have cut short with a
        checkpoint of the completed steps: from its commit to its end; with colocated engines
        (whose generation holds a save back), its generation too when that was longer."""
        self.may_commit: Callable[[], bool] = lambda: True
        """Asked at each step's commit (:func:`~.run.train` sets it): False abandons the step
        there (:class:`StepAbandoned`), while a checkpoint of the completed steps can still be
        written."""
        WATCHDOG.configure(cfg.stall_timeout_seconds)  # every wait of the driver (watchdog.py)
        self.cluster = Cluster(cfg, self.topo, threads)
        try:
            self._start()
        except BaseException:
            # A worker that fails to start (bad model path, reward module...) must not leave the
            # placement group and the workers already started holding the cluster.
            self.shutdown()
            raise

    def _start(self) -> None:
        cfg, topo, cluster = self.cfg, self.topo, self.cluster
        hosts, role_hosts = cluster.start_hosts()
        rewards = RewardWorkers(cluster, cfg.stall_timeout_seconds)
        self.sandbox_hosts = cluster.start_sandbox()
        self.groups: Groups = cluster.groups(
            hosts, role_hosts, [*rewards.hosts, *self.sandbox_hosts]
        )
        cluster.start_rollout(self.groups, rewards.hosts, self.sandbox_hosts)
        self.engines: ElasticEngines | None = None
        self.weights: WeightSync
        if topo.elastic is not None:  # weights go through the object store (any engine count)
            helpers = (rewards, self.sandbox_hosts)
            k, stall = cfg.data.samples_per_prompt, cfg.stall_timeout_seconds
            self.engines = ElasticEngines(topo.elastic, cluster, self.groups, helpers, k, stall)
            self.weights = self.engines.sync
        else:
            self.weights = weight_sync(topo, self.groups)
        data = cfg.data
        task = make_task(data.prompts, data.prompt_key, data.label_key, data.shuffle)
        self.rollouts = Rollouts(cfg, self.groups, task, rewards, self.engines)
        self.eval_examples = (
            make_task(data.eval_prompts, data.prompt_key, data.label_key, shuffle=False).eval_set()
            if data.eval_prompts
            else []
        )
        kl = cfg.algorithm.kl
        self.kl_ctl = (
            AdaptiveKLController(kl.coefficient, kl.target, kl.horizon)
            if kl.target is not None
            else FixedKLController(kl.coefficient)
        )

    @property
    def hosts(self) -> dict[str, list[Any]]:
        """The processes of each role (``actor``, ``critic``, ``rollout``)."""
        return self.groups.by_role()

    # ------------------------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        """One PPO step; returns its metrics (floats only)."""
        algo, actor, critic = self.cfg.algorithm, self.groups.actor, self.groups.critic
        t0 = time.perf_counter()
        # 1. generate + reward: this step's generation (launched now or, maxStaleness > 0, at
        #    an earlier step's start) and that of the later steps the admission window takes.
        rollout = self.rollouts.take(step, self.total_steps)
        version = self.weights.version  # the actor's weights (and, at their sync, the engines')
        self.weights.release()  # (colocated engines free their memory for training)
        t_commit = self._commit(step, rollout)
        # 2. values: each critic worker puts one object per actor worker; we keep only refs.
        values = critic.call("compute_values", rollout.ranges, actor.ranges, *rollout.gens)
        # 3. old/ref log-probs, advantages and returns on the actor workers.
        prepared = self._prepare(rollout, values, version)
        # 4. critic updates, 5. actor update (after warm-up).
        plan = plan_step(
            step,
            has_critic=self.topo.has_critic,
            critic_warmup_steps=algo.critic_warmup_steps,
            critic_updates_per_step=algo.critic_updates_per_step,
        )
        critic_done = []
        if plan.critic_updates:
            trained_on = actor.of_leaders(prepared)
            critic_done = critic.call(
                "train_critic", step, actor.ranges, plan.critic_updates, *trained_on
            )
        actor_done = actor.call("train_actor", step) if plan.actor_trains else []
        # 6. colocated engines wake once training is done on all their GPUs; then every engine
        #    takes the new weights (in order, on the engine's process).
        woken = self.weights.wake([*prepared, *critic_done, *actor_done])
        synced = self.weights.step_sync(plan.actor_trains)
        # 7. metrics, once every worker has reported (one that has not is named).
        refs = StepRefs(rollout, values, prepared, critic_done, actor_done, woken, synced)
        metrics, overlap = self._metrics(rollout, self._collect(refs), version)
        return self._complete(step, metrics, overlap, t0, t_commit)

    def _commit(self, step: int, rollout: Rollout) -> float:
        """The step's commit (when it returns): nothing reaches the trained workers before the
        step's generation is done, so a stop until then can checkpoint the completed steps at
        once (run.py); :attr:`may_commit` may abandon the step here. Returns its time."""
        gens = zip(rollout.engines, rollout.gens, strict=True)
        WATCHDOG.wait([("rollout", e, "generate", g) for e, g in gens])
        if not self.may_commit():
            raise StepAbandoned(step)
        self.committed = True
        return time.perf_counter()

    def _complete(
        self, step: int, metrics: dict[str, float], overlap: float, t0: float, t_commit: float
    ) -> dict[str, float]:
        """The step's timings, then the step is complete, in this order (a stop's interrupt may
        land between any two): its record, its prompts trained on, the workers' state is the
        completed steps'."""
        self.commit_s = time.perf_counter() - t_commit
        generation_s = t_commit - t0
        colocated = self.topo.colocated
        self.exposed_s = max(self.commit_s, generation_s) if colocated else self.commit_s
        metrics = self._timed(metrics, overlap, t0)
        self.completed = (step, metrics)
        self.rollouts.step_done()
        self.committed = False
        return metrics

    def checkpointable(self) -> bool:
        """Whether a checkpoint of the completed steps can be written now, in the middle of a
        step: the step has not committed (its training calls are not sent) and no generation
        or evaluation runs in a trained worker's process (colocated engines) to hold the save
        back."""
        if self.committed:
            return False
        if self.topo.colocated:  # (the engines' calls would hold the save back)
            if self.evaluating:
                return False
            flight = self.rollouts.in_flight()
            return len(WATCHDOG.done(flight)) == len(flight)
        return True

    def _prepare(self, rollout: Rollout, values: list[Any], version: int) -> list[Any]:
        """Old/ref log-probs, advantages and returns on every actor worker. A critic in
        processes of its own: the value refs go nested in a list, which Ray does not resolve
        before the call, so an actor worker computes its log-probs while the critic computes
        the values, and waits for them only when the advantages need them (a colocated critic
        has computed them before, in the same process)."""
        value_lists = self.groups.critic.of_leaders(values)
        nested = value_lists if self.topo.critic_apart else None
        return self.groups.actor.call(
            "prepare",
            rollout.ranges,
            self.groups.critic.ranges,
            self.kl_ctl.value,
            *rollout.gens,
            *([] if nested is not None else value_lists),
            policy_version=version,
            value_refs=nested,
        )

    def _collect(self, refs: StepRefs) -> Reports:
        """Every call's report, once all have reported (one that has not within the stall
        timeout is named, watchdog.py), in one round trip."""
        r = refs
        WATCHDOG.wait(
            [
                *(
                    ("rollout", e, "generate", g)
                    for e, g in zip(r.rollout.engines, r.rollout.gens, strict=True)
                ),
                *(("critic", i, "values", x) for i, x in enumerate(r.values)),
                *(("actor", i, "prepare", x) for i, x in enumerate(r.prepared)),
                *(("critic", i, "train", x) for i, x in enumerate(r.critic_done)),
                *(("actor", i, "train", x) for i, x in enumerate(r.actor_done)),
                *(("rollout", i, "wake", x) for i, x in enumerate(r.woken)),
                *(("rollout", i, "weight sync", x) for i, x in enumerate(r.synced)),
            ]
        )
        fetched = r.synced if self.weights.fetched_with_step else []
        groups = [r.rollout.gens, r.prepared, r.critic_done, r.actor_done, r.woken, fetched]
        flat = WATCHDOG.get([ref for group in groups for ref in group], "step", "collect")
        out, pos = [], 0
        for group in groups:
            out.append(flat[pos : pos + len(group)])
            pos += len(group)
        gens, prep, critic_m, actor_m, _, sync_vals = out
        prep = self.groups.actor.of_leaders(prep)
        return Reports(gens, prep, critic_m, actor_m, self.weights.durations(r.synced, sync_vals))

    def _metrics(
        self, rollout: Rollout, reports: Reports, version: int
    ) -> tuple[dict[str, float], float]:
        """The step's metrics, and the seconds of its training during which an engine was
        generating (this step's samples or, launched ahead, later steps' finished by now)."""
        r = reports
        span = train_span(r.prep, r.critic, r.actor)
        metrics = step_metrics(r.gens, r.prep, r.critic, r.actor, r.sync)
        if rollout.generated is not None:  # the rewards and lengths of every sample generated
            metrics.update(generation_metrics(rollout.generated))
            metrics.update(rollout.metrics)
        metrics["policy/version"] = float(version)
        # the versions the engines reported: with their samples, and at the step's sync
        metrics["rollout/version"] = float(min(g["version"] for g in r.gens))
        metrics["weights/version"] = float(self.weights.reported)
        metrics.update(self.rollouts.pool_metrics())
        gens = [*(rollout.generated or r.gens), *self.rollouts.finished_ahead()]
        overlap = overlap_seconds(span, gens)
        if self.cfg.algorithm.kl.coefficient > 0:
            self.kl_ctl.update(metrics.get("kl/mean", 0.0), self.cfg.data.samples_per_step)
            metrics["kl/coef"] = self.kl_ctl.value
        return metrics, overlap

    def _timed(self, metrics: dict[str, float], overlap: float, t0: float) -> dict[str, float]:
        """The step's time, the share of it generation overlapped training, and tokens/s."""
        metrics["time/step"] = time.perf_counter() - t0
        WATCHDOG.step_took(metrics["time/step"])  # (the stall limit follows the slowest step)
        metrics["time/overlap_share"] = min(overlap / metrics["time/step"], 1.0)
        tokens = metrics["response/length"] * self.cfg.data.samples_per_step
        metrics["time/tokens_per_second"] = tokens / metrics["time/step"]
        return metrics

    # ------------------------------------------------------------------------------------------
    def eval_due(self, done: int, total: int) -> bool:
        """Whether to evaluate after ``done`` steps of ``total`` (evalInterval, and the end)."""
        every = self.cfg.training.eval_interval
        return bool(self.eval_examples) and (done % every == 0 or done == total)

    def evaluate(self) -> dict[str, float]:
        """Greedy completions of the held-out prompts, split over the engines, scored."""
        # (left set when a stop cuts the evaluation short: the engines' processes are busy)
        self.evaluating = True
        total = self.rollouts.evaluate(self.eval_examples)
        self.evaluating = False
        return {"eval/reward_mean": total / len(self.eval_examples)}

    def sandbox_calls(self) -> list[int]:
        """Tool calls each sandbox worker answered so far (``roles.sandbox``; empty when unset)."""
        return WATCHDOG.get([h.call_count.remote() for h in self.sandbox_hosts], "sandbox", "count")

    def reward_scored(self) -> list[int]:
        """Samples each reward worker scored so far (``roles.reward``; empty when unset)."""
        return self.rollouts.rewards.scored()

    def trained_roles(self) -> list[str]:
        return ["actor", "critic"] if self.topo.has_critic else ["actor"]

    def save_workers(self, directory: Path) -> None:
        """Every actor (and critic) worker writes its own shard into ``directory/<role>``; the
        driver passes the path and waits, no tensor comes through it."""
        WATCHDOG.get_labelled(
            [
                (role, rank, "save checkpoint", ref)
                for role in self.trained_roles()
                for rank, ref in enumerate(
                    self.groups.role(role).call("save_checkpoint", role, str(directory / role))
                )
            ]
        )

    def state(self, step: int) -> dict[str, Any]:
        """The driver's own (small) checkpoint state: step, data order, KL coefficient, task,
        and every worker process's generators. In the middle of a step (:meth:`checkpointable`),
        an engine's process that is generating is not asked (None: a resumed run gives it
        fresh generators; its sampling is seeded per call anyway)."""
        rng, task = self.rollouts.data_state()
        hosts = self.groups.all_hosts
        if self.rollouts.taken is not None or self.evaluating:  # the trained workers' only
            roles = self.trained_roles()
            trained = {h._actor_id.hex() for r in roles for h in self.groups.role(r).handles}
            hosts = [h if h._actor_id.hex() in trained else None for h in hosts]
        asked = [None if h is None else h.rng_state.remote() for h in hosts]
        got = iter(WATCHDOG.get([a for a in asked if a is not None], "worker", "checkpoint rng"))
        return {
            "step": step,
            "fingerprint": self.fingerprint(),
            "data_rng": rng,
            "kl_coef": self.kl_ctl.value,
            "task": task,
            # every worker process's generators (dropout, sampling helpers), in host order
            "rng": [None if a is None else next(got) for a in asked],
            "rng_layout": self.rng_layout(),
        }

    def rng_layout(self) -> list[list[str]]:
        """The roles and ranks each of ``all_hosts`` holds (``role:rank``), in host order: the
        processes a checkpoint's generator states belong to."""
        groups = self.groups
        if not groups.all_hosts:
            return []
        roles = [(r, groups.role(r).handles) for r in ("actor", "critic", "rollout")]
        return [
            sorted(f"{r}:{i}" for r, handles in roles for i, h in enumerate(handles) if h is host)
            for host in groups.all_hosts
        ]

    def fingerprint(self) -> dict[str, Any]:
        """The settings and the prompt data a checkpoint of this run depends on."""
        return config_fingerprint(self.cfg, self.rollouts.task.digest())

    def restore(self, state: dict[str, Any], path: Path | None = None) -> int:
        """Load a checkpoint into every worker (each reads its shard under ``path``); returns
        the number of steps already done."""
        waits, all_hosts = [], self.groups.all_hosts
        for role in self.trained_roles():
            group = self.groups.role(role)
            if path is not None and (path / role).is_dir():
                waits += group.call("load_checkpoint", role, str(path / role))
            elif role in state:  # a checkpoint written before per-worker shards
                waits += group.call("set_state", role, state[role])
        rng, layout, current = state.get("rng"), state.get("rng_layout"), self.rng_layout()
        # the generators go back only to processes holding the same roles and ranks (a resume
        # on other worker counts, which the fingerprint allows, starts them afresh); a
        # checkpoint written before layouts were recorded is matched by its length alone
        same = layout is None or layout == current
        if rng is not None and len(rng) == len(all_hosts) and same:
            pairs = zip(all_hosts, rng, strict=True)
            waits += [h.set_rng_state.remote(r) for h, r in pairs if r is not None]
        else:
            log.warning(
                "checkpoint holds the RNG states of %s worker processes laid out as %s, this "
                "run has %d laid out as %s: resuming with fresh generators",
                "no" if rng is None else len(rng),
                layout,
                len(all_hosts),
                current,
            )
        WATCHDOG.get(waits, "worker", "resume")
        WATCHDOG.get(self.weights.start(), "rollout", "weight sync")
        self.rollouts.data_rng.setstate(_as_rng_state(state["data_rng"]))
        self.kl_ctl.value = float(state["kl_coef"])
        self.rollouts.task.load_state(state.get("task", {}))
        return int(state["step"])

    def export_pretrained(self, directory: Path) -> Path:
        """Write the actor (``directory/actor``) and the critic (``directory/critic``, with its
        value head) as Hugging Face model directories with the tokenizer; on request at any
        time between steps, and at the end of :func:`~.run.train` (``exportHuggingFace``)."""
        roles = []
        for role in self.trained_roles():
            spec = (
                self.cfg.roles.actor if role == "actor" else self.cfg.roles.effective_critic(True)
            )
            if spec is not None and spec.backend != "torch":
                log.warning("no Hugging Face export of the %s: backend %s", role, spec.backend)
            else:
                roles.append(role)
        WATCHDOG.get_labelled(
            [
                (role, rank, "export", ref)
                for role in roles
                for rank, ref in enumerate(
                    self.groups.role(role).call("export_pretrained", role, str(directory / role))
                )
            ]
        )
        return directory

    def expendable_actors(self) -> set[str]:
        """Actor ids (hex) of the workers whose loss the run absorbs: elastic rollout engines
        (dropped, their prompts generated again, replaced) and reward workers (their part
        scored again by the others, replaced). A Ray node draining with only these on it is no
        reason to stop the job (``run.draining_ray_nodes``), nor is one holding those let go
        of (lost or failed to start: ``released``), which the GCS lists alive until their node
        is marked dead. Read from the stop watcher's thread: a snapshot of the lists, never
        changed here."""
        rewards = self.rollouts.rewards
        hosts = list(rewards.hosts)
        released = list(rewards.released)
        if self.engines is not None:
            hosts += [*self.groups.rollout.handles, *(s.host for s in self.engines.starting)]
            released += self.engines.released
        return {h._actor_id.hex() for h in hosts} | set(released)

    def shutdown(self, stopping: bool = False) -> None:
        """Kill every worker started and release the placement group (safe to call twice).
        ``stopping``: a stop (SIGTERM) ends the run, within a grace period: the engines, maybe
        still busy with work the stop abandoned, get the short bound to close."""
        groups = getattr(self, "groups", None)  # (None: the start failed before the groups)
        engines = groups.rollout.handles if groups is not None else self.cluster.hosts["rollout"]
        # engines own processes of their own (sglang), sandbox workers their tool pools: they
        # are stopped before their host is killed
        self.cluster.shutdown([*engines, *getattr(self, "sandbox_hosts", [])], stopping)


class StepAbandoned(Exception):
    """A stop asked for a step's end before its commit (:attr:`PPOTrainer.may_commit`): the
    trained workers still hold the completed steps."""

    def __init__(self, step: int) -> None:
        self.step = step
        super().__init__(f"step {step + 1} abandoned before its training")


def _as_rng_state(s: Any) -> tuple[Any, ...]:
    return (s[0], tuple(s[1]), s[2])
