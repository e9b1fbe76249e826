"""Checks of batch sizes and learning rates: mini- and micro-batches that split a step's samples
over each trained role's data-parallel workers, group estimators' group size, the schedule."""

from __future__ import annotations

from ppojob_api.overrides import (
    apply_critic_overrides,
    check_critic_overrides,
    overridable_field,
)
from ppojob_api.problems import Problem
from ppojob_api.training import TrainingHalf, TrainingSettings
from ppojob_api.trainspec.constants import GROUP_ESTIMATORS


def batch_problems(
    settings: TrainingSettings, n: int, dp: int, path: str, role: str
) -> list[Problem]:
    """A role's mini-batch must divide the `n` samples of a step and split over its `dp`
    data-parallel workers; its micro-batch must divide a worker's share of a mini-batch."""
    mini = settings.mini_batch_size or n
    if n % mini:
        return [
            Problem(
                f"{path}.miniBatchSize",
                f"{mini} does not divide the {n} samples of a step (rolloutBatchSize x "
                f"samplesPerPrompt)",
                f"use a divisor of {n}",
            )
        ]
    if mini % dp:
        return [
            Problem(
                f"{path}.miniBatchSize",
                f"the {role}'s mini-batch of {mini} samples does not split over its {dp} "
                f"data-parallel workers",
                f"use a multiple of {dp}",
            )
        ]
    if settings.micro_batch_size and (mini // dp) % settings.micro_batch_size:
        return [
            Problem(
                f"{path}.microBatchSize",
                f"{settings.micro_batch_size} does not divide the {role} worker's share of a "
                f"mini-batch ({mini} / {dp} = {mini // dp})",
                f"use a divisor of {mini // dp}",
            )
        ]
    return []


def check_batches(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """The actor's batch sizes, then the critic's (its overrides on top of the actor's
    settings). A critic problem is blamed where its value was written: at the critic's override
    when it has one, else at spec.training (which the critic inherits), and reported once when
    the actor's problem already names that field."""
    roles, n = half.roles, half.data.samples_per_step
    actor = roles.actor
    dp_actor = max(roles.workers_of("actor") // actor.parallelism.model_parallel, 1)
    p = batch_problems(half.training, n, dp_actor, f"{prefix}.training", "actor")
    critic = roles.effective_critic(half.algorithm.needs_critic)
    if critic is None:
        return p
    opath = f"{prefix}.roles.critic.overrides"
    override_problems = check_critic_overrides(critic.overrides, opath)
    if override_problems:
        return p + override_problems
    dp_critic = max(roles.workers_of("critic") // critic.parallelism.model_parallel, 1)
    merged = apply_critic_overrides(half.training, critic.overrides)
    overridden = {overridable_field(str(k)): str(k) for k in critic.overrides}
    out = list(p)
    for q in batch_problems(merged, n, dp_critic, opath, "critic"):
        field = q.path.rsplit(".", 1)[1]  # miniBatchSize or microBatchSize
        name = "mini_batch_size" if field == "miniBatchSize" else "micro_batch_size"
        if name in overridden:
            q = Problem(f"{opath}.{overridden[name]}", q.message, q.fix)
        else:
            where = f"{prefix}.training.{field}"
            if any(r.path == where for r in out):
                continue  # the actor's problem names the same value
            q = Problem(
                where,
                q.message + " (the critic inherits spec.training's value)",
                q.fix + f", or give the critic its own in {opath}.{field}",
            )
        out.append(q)
    return out


def check_group_size(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """Group estimators compare samples of one prompt: they need two or more per prompt."""
    estimator = half.algorithm.advantage_estimator
    if estimator not in GROUP_ESTIMATORS or half.data.samples_per_prompt >= 2:
        return []
    return [
        Problem(
            f"{prefix}.data.samplesPerPrompt",
            f"{estimator} compares samples of the same prompt and needs at least 2",
            "set samplesPerPrompt >= 2",
        )
    ]


def role_training(half: TrainingHalf, role: str) -> TrainingSettings:
    """The training settings of ``role``: spec.training for the actor, with the critic's
    overrides on top for the critic."""
    critic = half.roles.effective_critic(half.algorithm.needs_critic)
    if role == "critic" and critic is not None:
        return apply_critic_overrides(half.training, critic.overrides)
    return half.training


def planned_updates(half: TrainingHalf, role: str) -> int:
    """Optimizer updates ``role`` ("actor" or "critic") makes over the whole run: the length of
    its learning-rate schedule (the trainer's and validate's one count).

    Actor: the steps it trains at (all but the critic warm-up ones when there is a critic)
    x ``ppoEpochs`` x mini-batches per step. Critic: steps x ``criticUpdatesPerStep`` x its own
    ``ppoEpochs`` x its own mini-batches per step (its settings with the critic overrides).
    """
    algo = half.algorithm
    has_critic = half.roles.effective_critic(algo.needs_critic) is not None
    n = half.data.samples_per_step
    settings = role_training(half, role)
    per_pass = settings.ppo_epochs * (n // (settings.mini_batch_size or n))
    steps = half.training.steps
    if role == "critic":
        return steps * algo.critic_updates_per_step * per_pass if has_critic else 0
    trained = max(steps - algo.critic_warmup_steps, 0) if has_critic else steps
    return trained * per_pass


def schedule_warnings(half: TrainingHalf, prefix: str = "spec") -> list[str]:
    """Learning-rate schedules that are legal but hardly meant, as warnings naming the field the
    user wrote (a critic override, else spec.training): a warm-up at least as long as the run's
    optimizer updates (the rate never reaches learningRate), and a warmup-stable-decay longer
    than the updates after the warm-up (the decay then spans all of them, as lrDecaySteps 0: a
    short run of a long job's manifest, `--steps 10`, is the usual case)."""
    critic = half.roles.effective_critic(half.algorithm.needs_critic)
    roles: dict[str, dict[str | None, str]] = {"actor": {}}
    if critic is not None and not check_critic_overrides(critic.overrides, "critic"):
        roles["critic"] = {overridable_field(str(k)): str(k) for k in critic.overrides}
    out: list[str] = []
    for role, written in roles.items():
        settings = role_training(half, role)
        total = planned_updates(half, role)

        def where(field: str, name: str, written: dict[str | None, str] = written) -> str:
            if name in written:
                return f"{prefix}.roles.critic.overrides.{written[name]}"
            return f"{prefix}.training.{field}"

        warm = settings.lr_warmup_steps
        if warm and warm >= total:
            out.append(
                f"{where('lrWarmupSteps', 'lr_warmup_steps')}: {warm} warm-up updates, but the "
                f"{role} makes only {total} optimizer updates in the whole run (steps x "
                "ppoEpochs x mini-batches per step): its learning rate never reaches "
                "learningRate; lower lrWarmupSteps"
            )
            continue
        decay = settings.lr_decay_steps
        if decay and settings.lr_scheduler != "constant" and decay > total - warm:
            out.append(
                f"{where('lrDecaySteps', 'lr_decay_steps')}: {decay} decay updates, but the "
                f"{role} makes only {total - warm} optimizer updates after its {warm} warm-up "
                f"updates: the decay spans those {total - warm} (as lrDecaySteps 0); set "
                f"lrDecaySteps <= {total - warm} for a stable phase before it"
            )
    return out


def check_learning_rate(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """The schedule decays from learningRate to minLearningRate, never up; a decay length needs
    a schedule that decays."""
    t = half.training
    out = []
    if t.min_learning_rate > t.learning_rate:
        out.append(
            Problem(
                f"{prefix}.training.minLearningRate",
                "exceeds learningRate",
                "set minLearningRate <= learningRate",
            )
        )
    if t.lr_decay_steps and t.lr_scheduler == "constant":
        out.append(
            Problem(
                f"{prefix}.training.lrDecaySteps",
                "has no effect: lrScheduler is constant (nothing decays)",
                "set lrScheduler: cosine or linear, or remove lrDecaySteps",
            )
        )
    return out
