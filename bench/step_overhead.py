"""Overhead of the Ray trainer over the same PPO step done in one process without Ray.

For the tiny config (``builtin:tiny-llama``, the example manifest) and one about ten times larger
(``builtin:small-llama``), times:

* the full Ray step (``PPOTrainer.step``: generate, reward, values through the object store,
  log-probs, GAE, critic and actor updates, weight sync), and
* the same step in one process without Ray (a child process of its own, so that the Ray
  driver's threads do not share it): a ``WorkerHost`` (the very class each Ray worker process
  runs, hosting the same roles: actor, colocated critic and rollout) built there, its step
  methods called in ``PPOTrainer.step``'s order (generate, compute_values, prepare,
  train_critic, train_actor, sync_colocated). The role code is therefore the workers' own, with
  the same mini- and micro-batch sizes, sample order, seeds and thread count; the only change is
  that ``ray.put``/``ray.get`` inside the role code hand the object over in memory (no
  serialisation, no object store, no other process).

What differs between the two is then only Ray's: the driver's remote calls and scheduling, the
object store (serialising the batches, values and returns) and the worker process. As a check
that both do the same work, each pair of steps (same step number, same seeds) must give the
same mean reward; the bench prints the largest difference. The two run in alternating blocks
(``--block`` steps each) so a neighbour's load hits both alike; figures are medians after
``--warmup`` steps. Needs a layout with one worker process (``actor.replicas: 1``, rollout and
critic colocated with the actor), as in the example.

    python bench/step_overhead.py [--steps 20] [--warmup 5] [--manifest examples/ppojob-tiny.yaml]
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def load_cfg(manifest: Path, model: str, cpus: float | None = None):
    from ppojob_trainer.manifest import config_from_doc as config_from_manifest

    doc = yaml.safe_load(manifest.read_text())
    doc["spec"]["model"]["path"] = model
    if cpus is not None:
        doc["spec"]["roles"]["actor"].setdefault("resources", {})["cpus"] = cpus
    doc["spec"]["algorithm"]["advantageEstimator"] = "gae"
    return config_from_manifest(doc)


class _Ref:
    """An in-memory stand-in for an ObjectRef (hashable, as the role code keys caches by ref)."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value


class _InProcessRay:
    """Replaces the ``ray`` module inside the role code for the one-process step."""

    ObjectRef = _Ref  # (the actor tells a nested ref from a list of refs by it)

    @staticmethod
    def put(value: object) -> _Ref:
        return _Ref(value)

    @staticmethod
    def get(ref: object, **_: object) -> object:
        if isinstance(ref, list):
            return [r.value if isinstance(r, _Ref) else r for r in ref]
        return ref.value if isinstance(ref, _Ref) else ref

    @staticmethod
    def get_gpu_ids() -> list[int]:
        return []


@contextmanager
def in_process() -> Iterator[None]:
    """``ray`` of the worker modules swapped for :class:`_InProcessRay` (the Ray workers run in
    other processes: they are not affected)."""
    from ppojob_trainer.workers import actor, handoff, host

    mods = (host, actor, handoff)
    saved = [m.ray for m in mods]
    for m in mods:
        m.ray = _InProcessRay
    try:
        yield
    finally:
        for m, r in zip(mods, saved, strict=True):
            m.ray = r


def local_steps(cfg, threads: int) -> Iterator[dict[str, float]]:
    """``PPOTrainer.step`` for one worker process hosting every role, with that process's
    ``WorkerHost`` built here and called directly; yields each step's phase times (s) and its
    mean reward. ``threads``: the Ray worker's torch thread count."""
    from ppojob_trainer.algorithms import AdaptiveKLController, FixedKLController, plan_step
    from ppojob_trainer.driver.groups import step_seed
    from ppojob_trainer.driver.topology import resolve_topology
    from ppojob_trainer.models import cache_root
    from ppojob_trainer.tasks import make_task
    from ppojob_trainer.workers.host import WorkerHost

    algo, roles, data = cfg.algorithm, cfg.roles, cfg.data
    critic = roles.effective_critic(algo.needs_critic)
    if roles.workers_of("actor") != 1 or not roles.rollout.colocate_with_actor:
        raise SystemExit("step_overhead: needs actor.replicas 1 with a colocated rollout")
    if critic is not None and not critic.colocate_with_actor:
        raise SystemExit("step_overhead: needs the critic colocated with the actor")
    hosted = {"actor": (0, 1), "rollout": (0, 1)}
    if critic is not None:
        hosted["critic"] = (0, 1)
    n, seed = data.samples_per_step, cfg.training.seed
    whole = [(0, n)]
    with in_process():
        host = WorkerHost(
            cfg.model_dump_json(by_alias=True),
            hosted,
            None,
            threads,
            "cpu",
            str(cache_root()),
        )
        error = host.ready().get("error") or host.start_rollout(None)
        if error:
            raise SystemExit(f"step_overhead: the in-process worker could not start: {error}")
    task = make_task(data.prompts, data.prompt_key, data.label_key, data.shuffle)
    data_rng = random.Random(seed)
    kl = algo.kl
    kl_ctl = (
        AdaptiveKLController(kl.coefficient, kl.target, kl.horizon)
        if kl.target is not None
        else FixedKLController(kl.coefficient)
    )
    offload = resolve_topology(cfg).offload  # (as the driver: the torch engine has none)
    syncs = 0
    for step in itertools.count():
        with in_process():
            t0 = time.perf_counter()
            examples = task.sample(data.rollout_batch_size, data_rng)
            gen = host.generate(examples, 0, step_seed(seed, step, 0))
            if offload:
                host.release_memory()
            values = [host.compute_values(whole, whole, gen)] if critic is not None else []
            prepared = host.prepare(
                whole, whole if critic is not None else None, kl_ctl.value, gen, *values
            )
            plan = plan_step(
                step,
                has_critic=critic is not None,
                critic_warmup_steps=algo.critic_warmup_steps,
                critic_updates_per_step=algo.critic_updates_per_step,
            )
            critic_m = (
                host.train_critic(step, whole, plan.critic_updates, prepared)
                if critic is not None and plan.critic_updates
                else {}
            )
            actor_m = host.train_actor(step) if plan.actor_trains else {}
            if offload:
                host.resume_memory()
            sync_s = 0.0
            if plan.actor_trains or offload:
                syncs += 1
                sync_s = host.sync_colocated(syncs, [])["seconds"]
            total = time.perf_counter() - t0
        if kl.coefficient > 0:
            kl_ctl.update(prepared[1].get("kl_sum", 0.0) / n, n)
        yield {
            "generate": gen["metrics"]["time/generate"],
            "values": critic_m.get("time/values", 0.0),
            "prepare": prepared[1]["time/prepare"],
            "train_critic": critic_m.get("time/train_critic", 0.0),
            "train_actor": actor_m.get("time/train_actor", 0.0),
            "weight_sync": sync_s,
            "step": total,
            "reward": gen["metrics"]["reward_sum"] / gen["metrics"]["n"],
        }


def _serve(conn, cfg, threads: int) -> None:  # type: ignore[no-untyped-def]
    """The one-process steps, in a process without Ray: one step per request on ``conn``."""
    steps = local_steps(cfg, threads)
    while conn.recv():
        conn.send(next(steps))


class LocalSteps:
    """:func:`local_steps` running in a child process (spawned: no Ray, no driver threads)."""

    def __init__(self, cfg, threads: int) -> None:  # type: ignore[no-untyped-def]
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, cfg, threads), daemon=True)
        self.proc.start()

    def __next__(self) -> dict[str, float]:
        self.conn.send(True)
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(False)
        self.proc.join(60)


PHASES = ("generate", "values", "prepare", "train_critic", "train_actor", "weight_sync")
BREAKDOWN = (
    ("before", "step start -> first call on the worker"),
    ("between", "the worker idle between the step's calls (round trips)"),
    ("arguments", "the calls' argument deserialisation"),
    ("outputs", "the calls' output storing"),
    ("after", "last call's end -> step end (reports, metrics)"),
    ("untimed", "inside the calls, outside the role timers"),
)


def ray_phases(row: dict[str, float]) -> dict[str, float]:
    """A Ray step's metrics as phase times (the leader's export counts as weight sync)."""
    out = {k: row.get(f"time/{k}", 0.0) for k in (*PHASES, "step")}
    out["weight_sync"] += row.get("time/export_weights", 0.0)
    out["reward"] = row["reward/mean"]
    return out


def ray_breakdown(
    events: list[dict], windows: list[tuple[float, float]], timed: list[float]
) -> dict[str, float]:
    """Where the Ray step's time goes besides the role code, from Ray's task timeline
    (``ray.timeline()``: each actor call's span on its worker, with its
    ``task:deserialize_arguments``, ``task:execute`` and ``task:store_outputs`` parts) over the
    driver's step ``windows`` (wall clock, s). Medians over steps, in seconds, of:
    ``before``, from the step's start to its first call on the worker (the driver launching the
    generation); ``between``, the worker idle between two of the step's calls (the driver's
    round trips: the commit waits for the generation before it sends the training calls; a call
    whose arguments are refs is sent once they are ready); ``arguments``, ``outputs``: the
    calls' argument deserialisation and output storing; ``after``, from the last call's end to
    the step's end (the driver fetching the reports, the metrics); ``untimed``, the calls'
    execution less ``timed`` (each step's phase times: the role code's own timers), what the
    worker does inside the calls around the timed role code (generation's work after its timer,
    the host's bookkeeping, puts outside the timers); ``calls``: the step's calls. The training
    phases' own timers hold the object store's gets and puts inside the role code (``ray.get``
    of the batches, ``ray.put`` of the values and prepared batches), which the one-process step
    hands over in memory: their difference from the one-process step's is that and the shared
    cores, not separated here. The layout has one worker process (every span is its).
    """
    spans = sorted(
        (e for e in events if e.get("ph") == "X" and str(e.get("tid", "")).startswith("worker")),
        key=lambda e: e["ts"],
    )
    out: dict[str, list[float]] = {
        k: [] for k in ("before", "between", "arguments", "outputs", "after", "untimed", "calls")
    }
    for (t0, t1), phases in zip(windows, timed, strict=True):
        mine = [e for e in spans if t0 * 1e6 <= e["ts"] <= t1 * 1e6]
        calls = [e for e in mine if not e["name"].startswith("task:")]
        if not calls:
            continue
        out["before"].append(calls[0]["ts"] / 1e6 - t0)
        out["after"].append(t1 - (calls[-1]["ts"] + calls[-1]["dur"]) / 1e6)
        out["between"].append(
            sum(max(0.0, b["ts"] - (a["ts"] + a["dur"])) for a, b in itertools.pairwise(calls))
            / 1e6
        )
        for key, name in (
            ("arguments", "task:deserialize_arguments"),
            ("outputs", "task:store_outputs"),
        ):
            out[key].append(sum(e["dur"] for e in mine if e["name"] == name) / 1e6)
        executed = sum(e["dur"] for e in mine if e["name"] == "task:execute") / 1e6
        out["untimed"].append(executed - phases)
        out["calls"].append(float(len(calls)))
    return {k: statistics.median(v) if v else float("nan") for k, v in out.items()}


def measure(cfg, steps: int, warmup: int, block: int) -> tuple[dict, dict, float, int, dict]:
    """Median phase times of the Ray step and of the one-process step, the largest
    difference of their mean rewards at equal steps and the worker's torch threads (the
    one-process step takes the Ray worker's). The two run in alternating blocks of
    ``block`` steps, so a neighbour's load hits both alike."""
    from ppojob_trainer.driver.trainer import PPOTrainer

    trainer = PPOTrainer(cfg)
    threads = int(trainer.groups.identities[0]["threads"])
    local = LocalSteps(cfg, threads)
    ray_rows: list[dict[str, float]] = []
    local_rows: list[dict[str, float]] = []
    windows: list[tuple[float, float]] = []
    try:
        reward_diff = 0.0
        for s in range(warmup):
            reward_diff = max(
                reward_diff, abs(trainer.step(s)["reward/mean"] - next(local)["reward"])
            )
        s = warmup
        while len(ray_rows) < steps:
            n = min(block, steps - len(ray_rows))
            for _ in range(n):
                t0 = time.time()
                ray_rows.append(ray_phases(trainer.step(s)))
                windows.append((t0, time.time()))
                s += 1
            local_rows += [next(local) for _ in range(n)]
        import ray

        timed = [sum(r[k] for k in PHASES) for r in ray_rows]
        breakdown = ray_breakdown(ray.timeline(), windows, timed)
    finally:
        trainer.shutdown()
        local.close()

    for a, b in zip(ray_rows, local_rows, strict=True):
        reward_diff = max(reward_diff, abs(a["reward"] - b["reward"]))

    def median(rows):
        return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in (*PHASES, "step")}

    return median(ray_rows), median(local_rows), reward_diff, threads, breakdown


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest", type=Path, default=ROOT / "examples" / "ppojob-tiny.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--models", default="builtin:tiny-llama,builtin:small-llama")
    ap.add_argument("--block", type=int, default=1, help="steps per alternating block")
    ap.add_argument("--cpus", type=float, help="override the actor's resources.cpus (threads)")
    from bench.records import Figure, add_record_arguments, write_record

    add_record_arguments(ap, "step_overhead")
    args = ap.parse_args()
    os.environ.setdefault("PPOJOB_CACHE_DIR", str(Path.home() / ".cache" / "ppojob"))
    # as PPOTrainer sets for its workers; here for the in-process one (read when torch loads)
    os.environ.setdefault("GOMP_SPINCOUNT", "20000")
    from ppojob_trainer.models import count_parameters, load_causal_lm, resolve_model_path
    from ppojob_trainer.runtime import shutdown_ray, start_local_ray

    print(
        f"cpus: {os.cpu_count()}, load average: {os.getloadavg()[0]:.2f}, "
        f"steps: {args.steps} (after {args.warmup} warm-up), medians in ms"
    )
    start_local_ray()
    worst = 0.0
    figures: dict[str, Figure] = {}
    models = args.models.split(",")
    try:
        for model in models:
            cfg = load_cfg(args.manifest, model, args.cpus)
            params = count_parameters(load_causal_lm(resolve_model_path(model, cfg.training.seed)))
            ray_t, local_t, reward_diff, threads, parts = measure(
                cfg, args.steps, args.warmup, args.block
            )
            ratio = ray_t["step"] / local_t["step"]
            worst = max(worst, ratio)
            print(
                f"\n{model} ({params:,} parameters, {cfg.data.samples_per_step} samples/step, "
                f"{threads} torch thread(s) in each)"
            )
            print(f"  {'phase':<14}{'ray':>10}{'one process':>14}")
            for key in PHASES:
                print(f"  {key:<14}{ray_t[key] * 1e3:>10.1f}{local_t[key] * 1e3:>14.1f}")
            phases = sum(ray_t[k] for k in PHASES)
            print(
                f"  {'(ray: driver, scheduling, object store)':<40}"
                f"{(ray_t['step'] - phases) * 1e3:>8.1f} ms"
            )
            print(
                f"  {'full step':<14}{ray_t['step'] * 1e3:>10.1f}{local_t['step'] * 1e3:>14.1f}"
                f"   ratio {ratio:.2f}"
            )
            print(
                f"  Ray's part from its task timeline ({parts['calls']:.0f} calls a step, "
                "medians in ms):"
            )
            for key, label in BREAKDOWN:
                print(f"    {label:<58}{parts[key] * 1e3:>8.1f}")
            contention = sum(ray_t[k] - local_t[k] for k in PHASES if k != "generate")
            print(f"    {'the training phases, Ray minus one process':<58}{contention * 1e3:>8.1f}")
            print(f"  same work: max |mean reward difference| at equal steps {reward_diff:.2e}")
            key = "" if len(models) == 1 else model.split(":")[-1] + "."
            figures[f"{key}full_step_median"] = Figure(
                ray_t["step"] * 1e3, "ms", 1, unit_shown=False
            )
            figures[f"{key}ray_part"] = Figure((ray_t["step"] - phases) * 1e3, "ms", 1)
            figures[f"{key}ray_over_one_process"] = Figure(ratio, "", 2)
            for part, _ in BREAKDOWN:
                figures[f"{key}ray_{part}"] = Figure(parts[part] * 1e3, "ms", 1)
    finally:
        shutdown_ray()
    print(f"\nworst ratio: {worst:.2f} (issue 43's goal: <= 1.2)")
    if args.record:
        write_record(args.record, figures, load=args.load)
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT / "api"), str(ROOT / "trainer"), str(ROOT)]
    raise SystemExit(main())
