"""Overhead of the Ray trainer over the same PPO step done in one process without Ray.

For the tiny config (``builtin:tiny-llama``, the example manifest) and one about ten times larger
(``builtin:small-llama``), times:

* the full Ray step (``PPOTrainer.step``: generate, reward, values through the object store,
  log-probs, GAE, critic and actor updates, weight sync), and
* the same work on the same batch shapes with the backends called directly in this process
  (no Ray, no object store, no processes),

and prints both, the ratio and where the time goes.

    python bench/step_overhead.py [--steps 20] [--warmup 5] [--manifest examples/ppojob-tiny.yaml]
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
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


def threads_of(cfg) -> int:
    return max(1, round(cfg.roles.actor.resources.cpus))


def local_steps(cfg) -> Iterator[dict[str, float]]:
    """The step's work with the backends called directly (one process, no Ray); yields each
    step's phase times in seconds."""
    from ppojob_trainer import algorithms as A
    from ppojob_trainer.backends.torch_backend import (
        TorchGenerationEngine,
        TorchPolicyTrainer,
        TorchValueTrainer,
    )
    from ppojob_trainer.models import load_tokenizer, resolve_model_path
    from ppojob_trainer.tasks import RewardScorer, make_task
    from ppojob_trainer.workers.rollout import stop_token_ids

    torch.set_num_threads(threads_of(cfg))
    seed, data, algo, tr = cfg.training.seed, cfg.data, cfg.algorithm, cfg.training
    kl_on = algo.kl.coefficient > 0
    kl_loss_on = kl_on and algo.kl.mode == "loss"
    path = resolve_model_path(cfg.model.path, seed)
    tok = load_tokenizer(path)
    engine = TorchGenerationEngine(path, "float32", stop_token_ids(tok), tok.pad_token_id)
    actor = TorchPolicyTrainer(
        path, "float32", tr, total_updates=10**6, temperature=data.temperature, need_reference=kl_on
    )
    critic = TorchValueTrainer(
        path, "float32", cfg.critic_training(), total_updates=10**6, seed=seed
    )
    task = make_task(data.prompts)
    scorer = RewardScorer(data.reward_function, data.prompts)
    special = set(stop_token_ids(tok))
    rng = random.Random(seed)
    k = data.samples_per_prompt
    n = data.samples_per_step
    mini = tr.mini_batch_size or n
    times: dict[str, list[float]] = {}
    clock = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        times.setdefault(name, []).append(now - clock[0])
        clock[0] = now

    def vloss(v, mb):
        loss, _ = A.value_loss(
            v,
            mb["old_values"],
            mb["returns"],
            mb["response_mask"],
            algo.value_clip,
            agg=algo.loss_aggregation,
        )
        return loss, {}

    def ploss(lp, ent, mb):
        loss, _ = A.policy_loss(
            lp,
            mb["old_logprobs"],
            mb["advantages"],
            mb["response_mask"],
            algo.clip_range_low,
            algo.clip_range_high,
            algo.dual_clip,
            agg=algo.loss_aggregation,
            entropy=ent,
            entropy_coef=algo.entropy_coefficient,
        )
        if kl_loss_on:
            loss = loss + algo.kl.coefficient * A.kl_loss(
                lp,
                mb["ref_logprobs"],
                mb["response_mask"],
                algo.kl.estimator,
                algo.loss_aggregation,
            )
        return loss, {}

    def minibatches(batch):
        order = torch.randperm(n)
        for s in range(0, n, mini):
            yield {key: val[order[s : s + mini]] for key, val in batch.items()}

    for step in itertools.count():
        times = {}
        t_step = clock[0] = time.perf_counter()
        ex = task.sample(data.rollout_batch_size, rng)
        prompts = [e.prompt for e in ex for _ in range(k)]
        labels = [e.label for e in ex for _ in range(k)]
        # generate + reward
        enc = tok(prompts, padding=True, return_tensors="pt")
        ids, pmask = enc["input_ids"], enc["attention_mask"].bool()
        g = engine.generate(
            ids,
            pmask,
            max_new_tokens=data.max_response_length,
            temperature=data.temperature,
            top_p=data.top_p,
            seed=step,
        )
        texts = []
        for row in g.response_ids.tolist():
            cut = next((i for i, t in enumerate(row) if t in special), len(row))
            texts.append(tok.decode(row[:cut]))
        scores = torch.tensor(scorer(prompts, texts, labels))
        batch = {
            "prompt_ids": ids,
            "prompt_mask": pmask,
            "response_ids": g.response_ids,
            "response_mask": g.response_mask,
            "scores": scores,
            "group_ids": torch.arange(n) // k,
        }
        lap("generate")
        # values, old log-probs, advantages
        batch["values"] = batch["old_values"] = critic.values(batch)
        lap("values")
        batch["old_logprobs"] = actor.logprobs(batch)
        kl = None
        if kl_on:
            batch["ref_logprobs"] = actor.logprobs(batch, reference=True)
            kl = A.kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], algo.kl.estimator)
            kl = torch.where(batch["response_mask"], kl, 0.0)
        rewards = A.shape_token_rewards(
            batch["scores"],
            batch["response_mask"],
            None if kl_loss_on else kl,
            0.0 if kl_loss_on or kl is None else algo.kl.coefficient,
        )
        batch["advantages"], batch["returns"] = A.compute_advantages(
            "gae",
            token_rewards=rewards,
            scores=batch["scores"],
            values=batch["values"],
            mask=batch["response_mask"],
            group_ids=batch["group_ids"],
            gamma=algo.gamma,
            lam=algo.lam,
            whiten=algo.whitens_advantages,
        )
        lap("prepare")
        for _ in range(algo.critic_updates_per_step * cfg.critic_training().ppo_epochs):
            for mb in minibatches(batch):
                critic.update(mb, vloss, mini)
        lap("train_critic")
        for _ in range(tr.ppo_epochs):
            for mb in minibatches(batch):
                actor.update(mb, ploss, mini)
        lap("train_actor")
        engine.update_weights(actor.export_weights())
        lap("weight_sync")
        times.setdefault("step", []).append(time.perf_counter() - t_step)
        yield {key: v[0] for key, v in times.items()}


PHASES = ("generate", "values", "prepare", "train_critic", "train_actor", "weight_sync")


def ray_phases(row: dict[str, float]) -> dict[str, float]:
    """A Ray step's metrics as phase times (the leader's export counts as weight sync)."""
    out = {k: row.get(f"time/{k}", 0.0) for k in (*PHASES, "step")}
    out["weight_sync"] += row.get("time/export_weights", 0.0)
    return out


def measure(cfg, steps: int, warmup: int, block: int) -> tuple[dict, dict]:
    """Median phase times of the Ray step and of the one-process step. The two run in
    alternating blocks of ``block`` steps, so a neighbour's load hits both alike."""
    from ppojob_trainer.loop import PPOTrainer

    trainer = PPOTrainer(cfg)
    local = local_steps(cfg)
    ray_rows: list[dict[str, float]] = []
    local_rows: list[dict[str, float]] = []
    try:
        for s in range(warmup):
            trainer.step(s)
            next(local)
        s = warmup
        while len(ray_rows) < steps:
            n = min(block, steps - len(ray_rows))
            for _ in range(n):
                ray_rows.append(ray_phases(trainer.step(s)))
                s += 1
            local_rows += [next(local) for _ in range(n)]
    finally:
        trainer.shutdown()

    def median(rows):
        return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in (*PHASES, "step")}

    return median(ray_rows), median(local_rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest", type=Path, default=ROOT / "examples" / "ppojob-tiny.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--models", default="builtin:tiny-llama,builtin:small-llama")
    ap.add_argument("--block", type=int, default=1, help="steps per alternating block")
    ap.add_argument("--cpus", type=float, help="override the actor's resources.cpus (threads)")
    args = ap.parse_args()
    os.environ.setdefault("PPOJOB_CACHE_DIR", str(Path.home() / ".cache" / "ppojob"))
    from ppojob_trainer.models import count_parameters, load_causal_lm, resolve_model_path
    from ppojob_trainer.runtime import shutdown_ray, start_local_ray

    print(
        f"cpus: {os.cpu_count()}, load average: {os.getloadavg()[0]:.2f}, "
        f"steps: {args.steps} (after {args.warmup} warm-up), medians in ms"
    )
    start_local_ray()
    worst = 0.0
    try:
        for model in args.models.split(","):
            cfg = load_cfg(args.manifest, model, args.cpus)
            params = count_parameters(load_causal_lm(resolve_model_path(model, cfg.training.seed)))
            ray_t, local_t = measure(cfg, args.steps, args.warmup, args.block)
            ratio = ray_t["step"] / local_t["step"]
            worst = max(worst, ratio)
            print(
                f"\n{model} ({params:,} parameters, {cfg.data.samples_per_step} samples/step, "
                f"{threads_of(cfg)} torch thread(s))"
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
    finally:
        shutdown_ray()
    print(f"\nworst ratio: {worst:.2f} (goal <= 1.25)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "trainer"))
    raise SystemExit(main())
