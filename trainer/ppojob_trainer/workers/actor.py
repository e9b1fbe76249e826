"""Actor role: old (and reference) log-probs of its shard, advantages, PPO updates.

The actor worker of data-parallel rank ``r`` owns the samples :func:`shard_range(N, dp, r)`. It
fetches only the rollout parts and the critic value objects that overlap its range (values come
as ObjectRefs the critic workers put; the driver only passes the refs and the ranges), computes
advantages and returns, and sends each critic worker the returns of the samples that critic owns,
again as ObjectRefs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import ray
import torch

from ppojob_api.checks.batches import planned_updates as api_planned_updates
from ppojob_api.training import Algorithm, TrainerConfig, TrainingSettings

from .. import algorithms as A
from ..agent import policy_mask
from ..backends.base import PolicyTrainer
from ..distributed import ShardIdentity
from ..teacher import make_teacher
from . import handoff
from .group import balanced_shares, overlap, shard_range
from .rollout import cat_batches, slice_batch

Part = tuple[int, int, Any]  # (start, end, ObjectRef of a rollout batch)


# Built-in estimators that whiten over the batch by definition, and their option switching it.
WHITENING_ESTIMATORS = {
    "gae": "whiten",
    "reinforce_plus_plus": "whiten",
    "reinforce_plus_plus_baseline": "whiten",
}

_FETCHED: dict[Any, dict[str, torch.Tensor]] = {}  # this step's rollout parts, per process


def fetch_range(parts: Sequence[Part], lo: int, hi: int) -> dict[str, torch.Tensor]:
    """The samples ``lo:hi`` of a step, fetching only the rollout parts that hold them.

    A part is fetched once per process and step (colocated roles share it); the cache holds only
    the parts of the latest step.
    """
    keys = [ref for _, _, ref in parts]
    for stale in [k for k in _FETCHED if k not in keys]:
        del _FETCHED[stale]
    handoff.drop_older_than(keys)
    pieces = []
    for start, end, ref in parts:
        ov = overlap((start, end), (lo, hi))
        if ov is None:
            continue
        if ref not in _FETCHED:
            _FETCHED[ref] = handoff.get(ref)
        pieces.append(slice_batch(_FETCHED[ref], ov[0] - start, ov[1] - start))
    return cat_batches(pieces)


def make_policy_trainer(
    cfg: TrainerConfig,
    model_dir: Path,
    group: Any,
    shard: ShardIdentity,
    device: str,
    total_updates: int,
) -> PolicyTrainer:
    """The policy trainer of ``spec.roles.actor.backend``."""
    need_ref = cfg.algorithm.kl.coefficient > 0
    if cfg.roles.actor.backend == "megatron":
        from ..backends.megatron_backend import MegatronPolicyTrainer

        return MegatronPolicyTrainer(
            cfg,
            model_dir,
            shard,
            need_reference=need_ref,
            total_updates=total_updates,
            device=device,
        )
    from ..backends.torch_backend.policy import TorchPolicyTrainer

    return TorchPolicyTrainer(
        model_dir,
        cfg.model.dtype,
        cfg.training,
        total_updates=total_updates,
        temperature=cfg.data.temperature,
        top_p=cfg.data.top_p,
        need_reference=need_ref,
        need_entropy=True,
        entropy_grad=cfg.algorithm.entropy_coefficient > 0,
        group=group,
        dp_size=shard.dp_size,
        device=device,
        offload_reference=cfg.training.offload_reference,
        lora=cfg.model.lora,
        # both engines take the adapters only (sglang: its LoRA adapter loading)
        sync_adapters=True,
        routing_replay=cfg.algorithm.routing_replay == "rollout",
        router_aux_loss=cfg.algorithm.router_aux_loss_coefficient,
    )


def balances_tokens(settings: TrainingSettings, shard: ShardIdentity, group: Any) -> bool:
    """Whether a role's workers take token-balanced shares of each mini-batch from the whole
    step (with ``maxTokensPerMicroBatch`` over several data-parallel workers) instead of
    their own contiguous range of samples."""
    return (
        settings.max_tokens_per_micro_batch is not None and shard.dp_size > 1 and group is not None
    )


def mini_batch_rows(
    batch: Mapping[str, torch.Tensor],
    mini: int,
    shard: ShardIdentity,
    gen: torch.Generator,
    balanced: bool,
) -> list[torch.Tensor]:
    """This worker's rows of ``batch`` for each mini-batch of one epoch (``mini`` samples per
    worker). Unbalanced: ``batch`` is this worker's range, shuffled and cut. Balanced:
    ``batch`` is the whole step, shuffled alike on every worker (same seed), each mini-batch
    dealt over the workers by tokens (:func:`~.group.balanced_shares`), so no worker waits
    on one holding the long samples."""
    n = batch["response_ids"].shape[0]
    if not balanced:
        order = torch.randperm(n, generator=gen) if n > mini else torch.arange(n)
        return [order[s : s + mini] for s in range(0, n, mini)]
    size = mini * shard.dp_size
    order = torch.randperm(n, generator=gen) if n > size else torch.arange(n)
    tokens = (batch["prompt_mask"].sum(1) + batch["response_mask"].sum(1)).tolist()
    shares = balanced_shares(tokens, order.tolist(), size, shard.dp_size, shard.dp_rank)
    return [torch.tensor(s, dtype=torch.long) for s in shares]


def role_metrics(metrics: Mapping[str, float], role: str) -> dict[str, float]:
    """``metrics`` with every key under ``role/``: backends report plain ``grad_norm`` and
    ``lr``, which the actor and the critic would otherwise overwrite in the step's metrics."""
    prefix = f"{role}/"
    return {(k if k.startswith(prefix) else prefix + k): v for k, v in metrics.items()}


def updates_per_step(n: int, mini_batch_size: int | None, epochs: int) -> int:
    """Optimizer updates of one training pass of a role over a step's ``n`` samples."""
    return epochs * (n // (mini_batch_size or n))


def planned_updates(cfg: TrainerConfig, role: str) -> int:
    """Optimizer updates ``role`` ("actor" or "critic") makes over the whole run: the length of
    its learning-rate schedule (ppojob_api.checks.batches.planned_updates, the count `ppojob
    validate` warns with)."""
    return api_planned_updates(cfg, role)


def step_advantages(
    algo: Algorithm,
    custom: Callable[..., Any] | None,
    *,
    token_rewards: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor,
    scores: torch.Tensor,
    group_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns of a whole step ([N, T] inputs, every sample of the step).

    The custom function (``customAdvantageFunction``) or the estimator sees every sample, so
    prompt groups are whole; whitening (``normalizeAdvantages``, resolved per estimator by
    :attr:`Algorithm.whitens_advantages`) is done once, over the step's response tokens.
    """
    common = dict(
        token_rewards=token_rewards,
        scores=scores,
        values=values,
        mask=mask,
        group_ids=group_ids,
        gamma=algo.gamma,
        lam=algo.lam,
    )
    whiten = algo.whitens_advantages
    if custom is not None:
        adv, ret = A.run_custom_advantage(custom, **common)
        return (A.masked_whiten(adv, mask.bool()) if whiten else adv), ret
    name = algo.advantage_estimator
    options: dict[str, Any] = {}
    if name == "grpo":
        options["norm_by_std"] = algo.grpo_norm_by_std
    # Estimators whose definition whitens take the switch; the others are whitened here.
    own_switch = WHITENING_ESTIMATORS.get(name)
    if own_switch is not None:
        options[own_switch] = whiten
    adv, ret = A.compute_advantages(name, **common, **options)
    if own_switch is None and whiten:
        adv = A.masked_whiten(adv, mask.bool())
    return adv, ret


def gather_rows(local: torch.Tensor, width: int, group: Any) -> torch.Tensor:
    """The rows of every data-parallel worker of ``group``, in rank order (rank r holds the
    samples ``shard_range(N, dp, r)``), each padded with zeros to ``width`` columns."""
    local = torch.nn.functional.pad(local.cpu(), (0, width - local.shape[1]))
    if group is None:
        return local
    import torch.distributed as dist

    pieces: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(pieces, local, group=group)
    return torch.cat(pieces, 0)


def logprob_mismatch(
    rollout_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """|engine sampling log-prob - actor recomputed log-prob| on the response tokens, as a sum
    and a max (the loop reports ``rollout/logprob_diff_mean`` and ``_max`` over the step)."""
    m = mask.bool()
    diff = torch.where(m, (rollout_logprobs.float() - old_logprobs.float()).abs(), 0.0)
    return {"logprob_diff_sum": float(diff.sum()), "logprob_diff_max": float(diff.max())}


def shard_advantages(
    algo: Algorithm,
    custom: Callable[..., Any] | None,
    full: Mapping[str, torch.Tensor],
    lo: int,
    hi: int,
    token_rewards: torch.Tensor,
    values: torch.Tensor | None,
    group: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This worker's rows ``lo:hi`` of the whole step's advantages and returns.

    ``full``: the step's ``response_mask``, ``scores`` and ``group_ids`` (all samples);
    ``token_rewards`` and ``values``: this worker's rows (its own KL term is in its token
    rewards). Every worker of ``group`` calls this in the same phase: the per-token inputs are
    gathered, each worker computes the whole step's advantages and keeps its rows, so the result
    does not depend on the data-parallel size.
    """
    mask = policy_mask(full)  # GAE skips the environment's tokens of a multi-turn response
    width = mask.shape[1]
    tr = gather_rows(token_rewards, width, group)
    vals = None if values is None else gather_rows(values, width, group)
    adv, ret = step_advantages(
        algo,
        custom,
        token_rewards=tr,
        values=vals,
        mask=mask,
        scores=full["scores"],
        group_ids=full["group_ids"],
    )
    local_width = token_rewards.shape[1]
    return adv[lo:hi, :local_width], ret[lo:hi, :local_width]


def loss_rows(batch: Mapping[str, torch.Tensor], algo: Algorithm) -> torch.Tensor | None:
    """[b] bool: the samples the policy loss takes, or None for all of them. Left out: samples
    cut at maxResponseLength (``maskTruncatedSamples``, DAPO's overlong filtering) and the
    fillers of a step that dynamic sampling could not fill (``in_loss`` false)."""
    keep = None
    if algo.mask_truncated_samples and "truncated" in batch:
        keep = ~batch["truncated"].bool()
    if "in_loss" in batch:
        in_loss = batch["in_loss"].bool()
        keep = in_loss if keep is None else keep & in_loss
    return keep


def policy_loss_mask(batch: Mapping[str, torch.Tensor], algo: Algorithm) -> torch.Tensor | None:
    """[b, T] bool: the tokens the policy loss takes, or None for every response token. Left
    out: the samples :func:`loss_rows` leaves out, and in a multi-turn batch the environment's
    tokens (``action_mask`` false: the model reads them, it did not sample them)."""
    keep = loss_rows(batch, algo)
    if keep is None and "action_mask" not in batch:
        return None
    owned = policy_mask(batch)
    return owned if keep is None else owned & keep.unsqueeze(1)


def merge_update_metrics(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The metrics of a step's updates: each key's mean over the updates that report it;
    ``*/skipped_updates`` (updates left out because no sample of their mini-batch was in the
    loss) summed."""
    keys = dict.fromkeys(k for p in parts for k in p)
    out = {}
    for k in keys:
        vals = [p[k] for p in parts if k in p]
        out[k] = sum(vals) if k.endswith("skipped_updates") else sum(vals) / len(vals)
    return out


class ActorWorker:
    """Role logic of one actor (policy) worker."""

    def __init__(
        self, cfg: TrainerConfig, shard: ShardIdentity, model_dir: Path, device: str, group: Any
    ) -> None:
        self.cfg = cfg
        self.shard = shard
        self.group = group
        n = cfg.data.samples_per_step
        total = planned_updates(cfg, "actor")
        self.trainer = make_policy_trainer(cfg, model_dir, group, shard, device, total)
        # algorithm.distillation: the frozen teacher, beside the policy
        self.teacher = make_teacher(cfg, model_dir, device)
        self.range = shard_range(n, shard.dp_size, shard.dp_rank)
        self.custom = (
            A.load_function(
                cfg.algorithm.custom_advantage_function, "spec.algorithm.customAdvantageFunction"
            )
            if cfg.algorithm.custom_advantage_function
            else None
        )
        self.batch: dict[str, torch.Tensor] | None = None
        self.whole: dict[str, torch.Tensor] | None = None
        self.received_values: torch.Tensor | None = None

    # -- step phase 1: log-probs and advantages ------------------------------------------------
    def prepare(
        self,
        parts: Sequence[Part],
        value_lists: Sequence[Any] | None,
        critic_ranges: Sequence[tuple[int, int]] | None,
        kl_coef: float,
        policy_version: int = 0,
    ) -> tuple[list[Any] | None, dict[str, float]]:
        """Compute old/ref log-probs, advantages and returns for this worker's samples.

        ``value_lists[i]`` is critic worker ``i``'s list of value refs (one per actor worker),
        or the ref of that list (fetched here, after the log-probs: a critic in another
        process computes the values meanwhile); only entry ``self.shard.dp_rank`` is fetched.
        Returns the refs of the returns for each critic worker (None without a critic) and
        metrics (sums).
        ``policy_version``: the actor's; a token generated more than ``maxStaleness`` versions
        before it is refused (:class:`~ppojob_trainer.algorithms.StalenessError`), never trained.
        The old log-probs are the proximal policy of the decoupled objective; with
        ``importanceSampling`` the weights pi_old / pi_behaviour are computed here, once a step.
        """
        algo = self.cfg.algorithm
        lo, hi = self.range
        batch = fetch_range(parts, lo, hi)
        mask = policy_mask(batch)  # multi-turn: the environment's tokens are not the policy's
        stale: dict[str, float] = {}
        if "versions" in batch:
            stale = A.staleness_stats(batch["versions"], mask, policy_version, algo.max_staleness)
        batch["old_logprobs"] = self.trainer.logprobs(batch)
        metrics = logprob_mismatch(batch["rollout_logprobs"], batch["old_logprobs"], mask)
        # routingReplay: how often the actor's routers chose the engine's experts themselves
        metrics.update(getattr(self.trainer, "routing_stats", dict)())
        metrics.update(stale)
        correction = algo.importance_sampling
        if correction is not None:
            batch["is_weights"], is_stats = A.importance_weights(
                batch["old_logprobs"],
                batch["rollout_logprobs"],
                mask,
                level=correction.level,
                mode=correction.mode,
                cap=correction.cap,
            )
            metrics.update(is_stats)
        kl = None
        if algo.kl.coefficient > 0:
            batch["ref_logprobs"] = self.trainer.logprobs(batch, reference=True)
            kl = A.kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], algo.kl.estimator)
            kl = torch.where(mask, kl, 0.0)
            metrics["kl_sum"] = float((kl.sum(1)).sum())
        values = None
        if value_lists is not None:
            values = self._fetch_values(value_lists, critic_ranges or [])
            batch["values"] = values
        reward_kl = kl if (kl is not None and algo.kl.mode == "reward") else None
        n = self.cfg.data.samples_per_step
        full = batch if (lo, hi) == (0, n) else dict(fetch_range(parts, 0, n))
        distill = algo.distillation
        if distill is not None and not distill.task_reward:  # the teacher alone
            batch["scores"] = torch.zeros_like(batch["scores"])
            full["scores"] = torch.zeros_like(full["scores"])
        token_rewards = A.shape_token_rewards(
            batch["scores"], mask, reward_kl, kl_coef if reward_kl is not None else 0.0
        )
        if self.teacher is not None:
            token_rewards = self._distill(batch, mask, token_rewards, metrics)
        # Advantages over the whole step: every worker sees whole prompt groups and the same
        # numbers, whatever the data-parallel size (shard_advantages gathers the token rewards).
        adv, ret = shard_advantages(
            algo, self.custom, full, lo, hi, token_rewards, values, self.group
        )
        batch["advantages"], batch["returns"] = adv, ret
        self.batch = batch
        self.whole = None
        if balances_tokens(self.cfg.training, self.shard, self.group):
            # every worker holds the whole step's training rows, to take a token-balanced share
            width = full["response_mask"].shape[1]
            whole = dict(full)
            for key in (
                "old_logprobs",
                "ref_logprobs",
                "teacher_logprobs",
                "advantages",
                "is_weights",
            ):
                if key in batch:
                    whole[key] = gather_rows(batch[key], width, self.group)
            self.whole = whole
        metrics["adv_abs_sum"] = float((adv.abs() * mask).sum())
        metrics["tokens"] = float(mask.sum())
        returns_refs = None
        if critic_ranges is not None:
            returns_refs = []
            for c_lo, c_hi in critic_ranges:
                ov = overlap((lo, hi), (c_lo, c_hi))
                returns_refs.append(
                    None if ov is None else handoff.put(ret[ov[0] - lo : ov[1] - lo].clone())
                )
        return returns_refs, metrics

    def _distill(
        self,
        batch: dict[str, torch.Tensor],
        mask: torch.Tensor,
        token_rewards: torch.Tensor,
        metrics: dict[str, float],
    ) -> torch.Tensor:
        """The teacher's log-probs of this worker's samples (kept in ``batch`` for a loss-mode
        update), the step's reverse KL summed into ``metrics``, and the token rewards with
        the reverse-KL reward added in mode ``reward``."""
        distill = self.cfg.algorithm.distillation
        assert distill is not None and self.teacher is not None
        batch["teacher_logprobs"] = self.teacher.logprobs(batch)
        rkl = A.reverse_kl(batch["old_logprobs"], batch["teacher_logprobs"], mask)
        metrics["distill_kl_sum"] = float(rkl.sum())
        if distill.mode == "reward" and distill.coefficient > 0:
            return A.distill_token_rewards(token_rewards, rkl, distill.coefficient)
        return token_rewards

    def _fetch_values(
        self, value_lists: Sequence[Any], critic_ranges: Sequence[tuple[int, int]]
    ) -> torch.Tensor:
        lo, hi = self.range
        pieces = []
        for outer, c_range in zip(value_lists, critic_ranges, strict=True):
            if overlap(c_range, (lo, hi)) is None:
                continue
            if isinstance(outer, ray.ObjectRef):  # the critic's compute_values, still a ref
                outer = ray.get(outer)
            pieces.append(handoff.get(outer[self.shard.dp_rank]))
        widths = {p.shape[1] for p in pieces}
        if len(widths) > 1:
            width = max(widths)
            pieces = [
                torch.cat([p, p.new_zeros(p.shape[0], width - p.shape[1])], 1) for p in pieces
            ]
        values = torch.cat(pieces, 0)
        self.received_values = values
        return values

    # -- step phase 2: PPO updates -------------------------------------------------------------
    def train(self, step: int) -> dict[str, float]:
        """PPO epochs over this worker's samples in mini-batches; returns averaged metrics."""
        if self.batch is None:
            raise RuntimeError("ActorWorker.train called before prepare")
        cfg, algo = self.cfg, self.cfg.algorithm
        tr = cfg.training
        source = self.whole if self.whole is not None else self.batch
        skip = ("values", "returns", "versions", "truncated", "in_loss", "action_mask")
        batch = {k: v for k, v in source.items() if k not in skip}
        batch["response_mask"] = batch["response_mask"].bool()
        loss_mask = policy_loss_mask(source, algo)
        if loss_mask is not None:  # tokens left out of the loss stay in the forward
            batch["loss_mask"] = loss_mask
        mini = (tr.mini_batch_size or cfg.data.samples_per_step) // self.shard.dp_size
        micro = tr.micro_batch_size or mini
        kl_loss_on = algo.kl.coefficient > 0 and algo.kl.mode == "loss"
        distill = algo.distillation
        distill_coef = (
            distill.coefficient if distill is not None and distill.mode == "loss" else 0.0
        )
        tis_cap = algo.tis_cap

        def loss_fn(
            logp: torch.Tensor, ent: torch.Tensor | None, mb: Mapping[str, torch.Tensor]
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            weights = mb.get("is_weights")  # importanceSampling: pi_old / pi_behaviour
            if weights is not None:
                weights = weights.to(logp.device)
            elif tis_cap is not None:  # truncated importance sampling: pi_old / pi_rollout
                weights = A.rollout_is_weights(
                    mb["old_logprobs"], mb["rollout_logprobs"], tis_cap
                ).to(logp.device)
            mask = mb.get("loss_mask")
            if mask is None or not bool(mask.any()):
                # (a micro-batch with no sample in the loss weighs 0: any finite loss will do)
                mask = mb["response_mask"]
            clip = (algo.clip_range_low, algo.clip_range_high)
            common = dict(
                agg=algo.loss_aggregation,
                entropy=ent,
                entropy_coef=algo.entropy_coefficient,
                weights=weights,
            )
            if algo.policy_loss == "gspo":
                loss, m = A.gspo_policy_loss(
                    logp, mb["old_logprobs"], mb["advantages"], mask, *clip, **common
                )
            else:
                loss, m = A.policy_loss(
                    logp,
                    mb["old_logprobs"],
                    mb["advantages"],
                    mask,
                    *clip,
                    algo.dual_clip,
                    **common,
                )
            # metrics stay tensors on the device: the backend reads them once per update
            metrics = {f"actor/{k}": v for k, v in m.items()}
            metrics["actor/pg_loss"] = loss.detach()
            if kl_loss_on:
                kll = A.kl_loss(
                    logp,
                    mb["ref_logprobs"],
                    mask,
                    algo.kl.estimator,
                    algo.loss_aggregation,
                )
                loss = loss + algo.kl.coefficient * kll
                metrics["actor/kl_loss"] = kll.detach()
            if distill_coef > 0:  # the reverse KL to the teacher, as a loss term
                dl = A.distill_loss(logp, mb["teacher_logprobs"], mask, algo.loss_aggregation)
                loss = loss + distill_coef * dl
                metrics["actor/distill_loss"] = dl.detach()
            return loss, metrics

        parts: list[dict[str, float]] = []
        gen = torch.Generator().manual_seed(cfg.training.seed * 1_000_003 + step)
        balanced = self.whole is not None
        for _ in range(tr.ppo_epochs):
            for idx in mini_batch_rows(batch, mini, self.shard, gen, balanced):
                mb = {k: v[idx] for k, v in batch.items()}
                out = self.trainer.update(mb, loss_fn, micro, agg=algo.loss_aggregation)
                parts.append(role_metrics(out, "actor"))
        return merge_update_metrics(parts)
