"""The steps' generation: launched ahead within the admission window (bounded staleness), taken
by its step, settled on elastic engines, refilled by dynamic sampling (DAPO); and evaluation.

Every token carries the policy version (weight sync) that generated it; with
``algorithm.maxStaleness`` k the generation of the next k steps is launched at a step's start
(:func:`~ppojob_trainer.algorithms.generation_window`), so the engines generate them while the
actor trains; k = 0 launches only the step's own: the synchronous loop.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import RayActorError

from ppojob_api.training import TrainerConfig

from ..algorithms import fill_step, generation_window
from ..tasks import Task
from ..watchdog import WATCHDOG
from .elastic import ElasticEngines, Part, RewardWorkers, surviving
from .groups import Groups, ranges, step_seed


@dataclass
class Generation:
    """One step's generation, launched (its refs in flight or done)."""

    step: int
    ranges: list[tuple[int, int]]
    """Sample ranges, one per engine that generates."""
    gens: list[Any]
    """Refs of the engines' results (``{"batch": ref, "metrics", "span", "version"}``)."""
    engines: list[int]
    """The engines, in the order of ``gens``."""
    data_state: tuple[Any, dict[str, Any]] | None = None
    """The data order before this step's prompts were drawn (a checkpoint taken while it is
    in flight, launched ahead or taken by a step that then stopped, rewinds to it, so a resumed
    run draws the same prompts)."""
    parts: list[Part] | None = None
    """Elastic engines: what each engine was given, to generate again elsewhere if it is lost
    (``gens`` are then the refs of the results without their batches)."""


@dataclass
class Rollout:
    """A step's generation as it is trained on."""

    ranges: list[tuple[int, int]]
    gens: list[Any]
    engines: list[int]
    generated: list[dict[str, Any]] | None = None
    """Dynamic sampling: every round's (small) results, of every sample generated."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Dynamic sampling's."""


class Rollouts:
    """The prompts (data order), the generation launched ahead of its step, and the engines'
    pools: reward workers and (``pool``) elastic engines."""

    def __init__(
        self,
        cfg: TrainerConfig,
        groups: Groups,
        task: Task,
        rewards: RewardWorkers,
        pool: ElasticEngines | None,
    ) -> None:
        self.cfg, self.groups, self.task = cfg, groups, task
        self.rewards, self.pool = rewards, pool
        self.data_rng = random.Random(cfg.training.seed)
        self.pending: dict[int, Generation] = {}
        """Generation launched ahead of its step (maxStaleness > 0), by step."""
        self.launched = 0
        """Every step before this one has had its generation launched."""
        self.taken: Generation | None = None
        """The generation of the step in flight (None between steps: :meth:`step_done`)."""
        self.step_refs: list[Any] = []
        """Every engine call of the step in flight: its generation, dynamic sampling's later
        rounds and the engines' assembly of the groups picked (:meth:`in_flight`)."""

    def take(self, step: int, total_steps: int | None) -> Rollout:
        """Step ``step``'s generation, launched now or (maxStaleness > 0) at an earlier step's
        start; with it, that of the later steps the admission window takes (their samples will
        be at most maxStaleness versions old when trained on). No generation is launched past
        ``total_steps``. Lost reward workers are started again first, and elastic engines
        started since join (with the current weights)."""
        algo = self.cfg.algorithm
        self.rewards.replace_lost(self.groups.engine_groups)
        if self.pool is not None:
            self.pool.begin_step()
        window = generation_window(step, self.launched, algo.max_staleness, total_steps)
        for j in window:
            self.pending[j] = self.launch(j)
        self.launched = max(self.launched, window.stop)
        current = self.taken = self.pending.pop(step)
        self.step_refs = list(current.gens)
        out = Rollout(current.ranges, current.gens, current.engines)
        if self.pool is not None:  # an engine lost now loses only its prompts (re-queued)
            out.ranges, out.gens, out.engines = self.pool.settle(current.parts or [])
        if algo.dynamic_sampling is not None:
            out = self.refill(step, current)
        known = set(self.step_refs)  # (the generation itself, unless settled or refilled)
        self.step_refs += [g for g in out.gens if g not in known]
        return out

    def launch(self, step: int, round_: int = 0) -> Generation:
        """Draw step ``step``'s prompts and launch their generation: each engine samples a
        contiguous range of prompts (an engine left without prompts sits the step out). An
        engine runs its calls in order, so it generates with the weights of the last sync
        launched before this call. ``round_``: dynamic sampling's extra rounds of a step draw
        fresh prompts, numbered after the earlier rounds' (group ids stay distinct)."""
        cfg = self.cfg
        n_prompts, k = cfg.data.rollout_batch_size, cfg.data.samples_per_prompt
        data_state = (self.data_rng.getstate(), self.task.state())
        examples = self.task.sample(n_prompts, self.data_rng)
        parts, engines = [], []
        offset = round_ * n_prompts
        elastic: list[Part] | None = [] if self.pool is not None else None
        hosts = self.groups.rollout.handles
        for e, (p_lo, p_hi) in enumerate(ranges(n_prompts, len(hosts))):
            if p_lo == p_hi:
                continue
            seed = step_seed(cfg.training.seed, step, e + 1_000 * round_)
            first, share = (offset + p_lo) * k, examples[p_lo:p_hi]
            if self.pool is not None and elastic is not None:
                elastic.append(self.pool.generate_on(hosts[e], p_lo * k, share, first, seed))
                ref = elastic[-1].info
            else:
                ref = hosts[e].generate.remote(share, first, seed)
            parts.append((p_lo * k, p_hi * k, ref))
            engines.append(e)
        spans = [(lo, hi) for lo, hi, _ in parts]
        return Generation(step, spans, [ref for _, _, ref in parts], engines, data_state, elastic)

    def refill(self, step: int, first: Generation) -> Rollout:
        """DAPO's dynamic sampling: generate rounds of fresh prompts until the step has
        ``rolloutBatchSize`` groups whose rewards differ (or ``maxRounds`` rounds), then have
        each engine assemble its picked groups into one rollout part."""
        cfg = self.cfg
        need = cfg.data.rollout_batch_size
        max_rounds = cfg.algorithm.dynamic_sampling.max_rounds  # type: ignore[union-attr]
        rounds: list[Generation] = []
        results: list[list[dict[str, Any]]] = []
        kept = 0
        while not rounds or (kept < need and len(rounds) < max_rounds):
            gen = first if not rounds else self.launch(step, len(rounds))
            if gen is not first:
                self.step_refs += gen.gens
            WATCHDOG.wait(
                [("rollout", e, "generate", r) for e, r in zip(gen.engines, gen.gens, strict=True)]
            )
            rounds.append(gen)
            results.append(WATCHDOG.get(gen.gens, "rollout", "generate", gen.engines))
            kept += sum(len(res["informative"]) for res in results[-1])
        fill = fill_step(
            [
                (
                    [g for res in round_ for g in res["groups"]],
                    [g for res in round_ for g in res["informative"]],
                )
                for round_ in results
            ],
            need,
        )
        out = self._assemble(rounds, results, fill.picked)
        out.generated = [res for round_ in results for res in round_]
        out.metrics = {
            "dynamic_sampling/generation_rounds": float(len(rounds)),
            "dynamic_sampling/filtered_groups": float(fill.filtered),
            "dynamic_sampling/kept_groups": float(need - fill.short),
            "dynamic_sampling/short_groups": float(fill.short),
            # rounds run one after another: generation time is their sum
            "time/generate": sum(
                max(res["metrics"]["time/generate"] for res in round_) for round_ in results
            ),
        }
        return out

    def _assemble(
        self,
        rounds: list[Generation],
        results: list[list[dict[str, Any]]],
        picked: list[tuple[int, int, bool]],
    ) -> Rollout:
        """The step's parts: each engine assembles the groups picked of those it generated."""
        k = self.cfg.data.samples_per_prompt
        # which engine generated each group of each round, and its result's place per engine
        owner: dict[tuple[int, int], tuple[int, int]] = {}
        per_engine: dict[int, list[Any]] = {}
        for r, (gen, round_) in enumerate(zip(rounds, results, strict=True)):
            for e, ref, res in zip(gen.engines, gen.gens, round_, strict=True):
                refs = per_engine.setdefault(e, [])
                for g in res["groups"]:
                    owner[(r, g)] = (e, len(refs))
                refs.append(ref)
        picks: dict[int, list[tuple[int, int, bool]]] = {}
        for r, g, in_loss in picked:
            e, pos = owner[(r, g)]
            picks.setdefault(e, []).append((pos, g, in_loss))
        out = Rollout([], [], [])
        lo = 0
        for e in sorted(picks):
            hi = lo + len(picks[e]) * k
            host = self.groups.rollout.handles[e]
            out.gens.append(host.select_groups.remote(lo, picks[e], *per_engine[e]))
            out.ranges.append((lo, hi))
            out.engines.append(e)
            lo = hi
        return out

    def pool_metrics(self) -> dict[str, float]:
        """Elastic engines: the step's engines, prompts re-queued and engines lost (else none)."""
        return self.pool.metrics() if self.pool is not None else {}

    def finished_ahead(self) -> list[dict[str, Any]]:
        """The results of the generation launched ahead that finished by now (elastic: less
        those of engines lost)."""
        ahead = [ref for g in self.pending.values() for ref in g.gens]
        done = WATCHDOG.done(ahead)
        return (
            WATCHDOG.get(done, "rollout", "generate ahead")
            if self.pool is None
            else surviving(done)
        )

    def step_done(self) -> None:
        """The step in flight completed: its prompts are trained on."""
        self.taken, self.step_refs = None, []

    def in_flight(self) -> list[Any]:
        """Refs of every generation in flight or done and not trained on yet: the step's own
        and those launched ahead."""
        return [g for gen in self.pending.values() for g in gen.gens] + self.step_refs

    def data_state(self) -> tuple[Any, dict[str, Any]]:
        """The data order and task state a checkpoint saves: generation launched ahead, or
        taken by a step that did not complete, is not saved, so a resumed run draws those
        steps' prompts again, from the data order before the earliest of them."""
        flight = [*self.pending.values(), *([self.taken] if self.taken is not None else [])]
        ahead = [g for g in flight if g.data_state is not None]
        if ahead:
            return min(ahead, key=lambda g: g.step).data_state  # type: ignore[return-value]
        return self.data_rng.getstate(), self.task.state()

    def evaluate(self, examples: list[Any]) -> float:
        """The summed reward of greedy completions of ``examples``, split over the engines.
        Elastic engines: the prompts of an engine lost meanwhile are evaluated again on the
        others (greedy decoding with the same weights gives the same completions)."""
        todo, total = [(0, len(examples))], 0.0
        while todo:
            if self.pool is not None:  # (at least minReplicas, or RolloutCapacityError)
                self.pool.ensure()
            engines = self.groups.rollout.handles
            calls = [
                (engines[e], lo + a, lo + b, engines[e].evaluate.remote(examples[lo + a : lo + b]))
                for lo, hi in todo
                for e, (a, b) in enumerate(ranges(hi - lo, len(engines)))
                if b > a
            ]
            todo, lost = [], []
            for host, lo, hi, ref in calls:
                try:
                    total += WATCHDOG.get(ref, "rollout", "evaluate")["reward_sum"]
                except RayActorError:
                    if self.pool is None:
                        raise
                    lost.append(host)
                    todo.append((lo, hi))
            if lost and self.pool is not None:
                self.pool.drop(lost)
        return total
