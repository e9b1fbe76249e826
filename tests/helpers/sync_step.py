"""The synchronous PPO step as it stood before bounded staleness (issue 24), verbatim from
``ppojob_trainer/loop.py`` at commit 780cc59: the oracle that ``maxStaleness: 0`` must reproduce
bit for bit (tests/trainer/test_async_loop.py). Only the imports are made absolute, and the
trainer's state is read where the driver package (``ppojob_trainer.driver``) keeps it."""

from __future__ import annotations

import time

from ppojob_trainer.driver.groups import ranges as sample_ranges
from ppojob_trainer.driver.groups import step_seed
from ppojob_trainer.driver.metrics import step_metrics
from ppojob_trainer.driver.trainer import PPOTrainer
from ppojob_trainer.watchdog import wait_or_name


class SynchronousTrainer(PPOTrainer):
    def step(self, step: int) -> dict[str, float]:
        """The synchronous step as it stood before bounded staleness (commit 780cc59)."""
        import ray

        from ppojob_trainer.algorithms import plan_step

        cfg, algo = self.cfg, self.cfg.algorithm
        t0 = time.perf_counter()
        n_prompts = cfg.data.rollout_batch_size
        k = cfg.data.samples_per_prompt
        examples = self.rollouts.task.sample(n_prompts, self.rollouts.data_rng)

        # 1. generate + reward: each engine samples a contiguous range of prompts (an engine
        #    left without prompts sits this step out).
        parts, engines = [], []
        for e, (p_lo, p_hi) in enumerate(sample_ranges(n_prompts, len(self.hosts["rollout"]))):
            if p_lo == p_hi:
                continue
            ref = self.hosts["rollout"][e].generate.remote(
                examples[p_lo:p_hi], p_lo * k, step_seed(cfg.training.seed, step, e)
            )
            parts.append((p_lo * k, p_hi * k, ref))
            engines.append(e)

        ranges = [(lo, hi) for lo, hi, _ in parts]
        gens = [ref for _, _, ref in parts]
        # Engines sharing the actor's GPUs free their weights and KV cache for training.
        if self.topo.offload:
            ray.get([r.release_memory.remote() for r in self.hosts["rollout"]])

        # 2. values: each critic worker puts one object per actor worker; we keep only refs.
        value_lists = []
        if self.topo.has_critic:
            value_lists = [
                c.compute_values.remote(ranges, self.groups.actor.ranges, *gens)
                for c in self.hosts["critic"]
            ]

        # 3. old/ref log-probs, advantages and returns on the actor workers.
        all_values = value_lists
        value_lists = [value_lists[i] for i in self.groups.critic.leaders]
        prepared = [
            a.prepare.remote(
                ranges, self.groups.critic.ranges, self.kl_ctl.value, *gens, *value_lists
            )
            for a in self.hosts["actor"]
        ]
        prepared_leaders = [prepared[i] for i in self.groups.actor.leaders]

        # 4. critic updates, 5. actor update (after warm-up).
        plan = plan_step(
            step,
            has_critic=self.topo.has_critic,
            critic_warmup_steps=algo.critic_warmup_steps,
            critic_updates_per_step=algo.critic_updates_per_step,
        )
        critic_done = []
        if self.topo.has_critic and plan.critic_updates:
            critic_done = [
                c.train_critic.remote(
                    step, self.groups.actor.ranges, plan.critic_updates, *prepared_leaders
                )
                for c in self.hosts["critic"]
            ]
        actor_done = []
        if plan.actor_trains:
            actor_done = [a.train_actor.remote(step) for a in self.hosts["actor"]]

        # 6. colocated engines wake once training is done on all their GPUs; then every engine
        #    takes the new weights (in order, on the engine's process). A woken engine's weights
        #    were released, so it takes them even when the actor did not train.
        woken = []
        if self.topo.offload:
            after = [*prepared, *critic_done, *actor_done]
            woken = [r.resume_memory.remote(*after) for r in self.hosts["rollout"]]
        synced = self.weights.start() if plan.actor_trains or self.topo.offload else []

        # 7. metrics (floats only; the driver never fetches a tensor), once every worker has
        #    reported; one that has not within the stall timeout is named (watchdog.py).
        wait_or_name(
            [
                *(("rollout", e, "generate", r) for e, r in zip(engines, gens, strict=True)),
                *(("critic", i, "values", r) for i, r in enumerate(all_values)),
                *(("actor", i, "prepare", r) for i, r in enumerate(prepared)),
                *(("critic", i, "train", r) for i, r in enumerate(critic_done)),
                *(("actor", i, "train", r) for i, r in enumerate(actor_done)),
                *(("rollout", i, "wake", r) for i, r in enumerate(woken)),
                *(("rollout", i, "weight sync", r) for i, r in enumerate(synced)),
            ],
            cfg.stall_timeout_seconds,
        )
        groups = [gens, prepared, critic_done, actor_done, woken, synced]
        flat = ray.get([ref for group in groups for ref in group])  # one round trip
        out, pos = [], 0
        for group in groups:
            out.append(flat[pos : pos + len(group)])
            pos += len(group)
        gens, prep, critic_m, actor_m, _, sync_s = out
        prep = [prep[i] for i in self.groups.actor.leaders]
        metrics = step_metrics(gens, prep, critic_m, actor_m, sync_s)
        if algo.kl.coefficient > 0:
            self.kl_ctl.update(metrics.get("kl/mean", 0.0), cfg.data.samples_per_step)
            metrics["kl/coef"] = self.kl_ctl.value
        metrics["time/step"] = time.perf_counter() - t0
        tokens = metrics["response/length"] * cfg.data.samples_per_step
        metrics["time/tokens_per_second"] = tokens / metrics["time/step"]
        return metrics
