"""Critic role: values of its shard (put in the object store, routed by sample to the actor
workers) and clipped value-loss updates on the returns the actor workers send back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ppojob_api.training import TrainerConfig

from .. import algorithms as A
from ..agent import policy_mask
from ..backends.base import ValueTrainer
from ..distributed import ShardIdentity
from . import handoff
from .actor import (
    Part,
    balances_tokens,
    fetch_range,
    gather_rows,
    mini_batch_rows,
    planned_updates,
    role_metrics,
)
from .group import overlap, shard_range


def make_value_trainer(
    cfg: TrainerConfig, model_dir: Path, group: Any, shard: ShardIdentity, device: str
) -> ValueTrainer:
    """The value trainer of ``spec.roles.critic.backend``."""
    critic = cfg.roles.effective_critic(cfg.algorithm.needs_critic)
    settings = cfg.critic_training()
    if critic is not None and critic.backend == "megatron":
        from ..backends.megatron_backend import MegatronValueTrainer

        return MegatronValueTrainer(
            cfg, model_dir, shard, device=device, total_updates=planned_updates(cfg, "critic")
        )
    from ..backends.torch_backend.value import TorchValueTrainer

    total = planned_updates(cfg, "critic")
    return TorchValueTrainer(
        model_dir,
        cfg.model.dtype,
        settings,
        total_updates=total,
        seed=cfg.training.seed,
        group=group,
        dp_size=shard.dp_size,
        device=device,
    )


class CriticWorker:
    """Role logic of one critic (value) worker."""

    def __init__(
        self, cfg: TrainerConfig, shard: ShardIdentity, model_dir: Path, device: str, group: Any
    ) -> None:
        self.cfg = cfg
        self.shard = shard
        self.settings = cfg.critic_training()
        self.group = group
        self.trainer = make_value_trainer(cfg, model_dir, group, shard, device)
        self.range = shard_range(cfg.data.samples_per_step, shard.dp_size, shard.dp_rank)
        self.batch: dict[str, torch.Tensor] | None = None
        self.whole: dict[str, torch.Tensor] | None = None

    def compute_values(
        self, parts: Sequence[Part], actor_ranges: Sequence[tuple[int, int]]
    ) -> list[Any]:
        """Values of this worker's samples, one ObjectRef per actor worker (None where the
        actor owns none of them). The tensors keep their dtype; nothing is converted."""
        lo, hi = self.range
        batch = fetch_range(parts, lo, hi)
        values = self.trainer.values(batch)
        batch["old_values"] = values
        self.batch = batch
        self.whole = None
        if balances_tokens(self.settings, self.shard, self.group):
            self.whole = fetch_range(parts, 0, self.cfg.data.samples_per_step)
        refs: list[Any] = []
        for a_range in actor_ranges:
            ov = overlap((lo, hi), a_range)
            refs.append(
                None if ov is None else handoff.put(values[ov[0] - lo : ov[1] - lo].clone())
            )
        return refs

    def train(
        self,
        step: int,
        returns_lists: Sequence[Any],
        actor_ranges: Sequence[tuple[int, int]],
        updates: int,
    ) -> dict[str, float]:
        """``updates`` passes of value-loss training on the returns from the actor workers.

        ``returns_lists[j]`` is actor worker ``j``'s prepare result ``(returns refs, metrics)``,
        one returns ref per critic worker; only entry ``self.shard.dp_rank`` is fetched.
        """
        if self.batch is None:
            raise RuntimeError("CriticWorker.train called before compute_values")
        lo, hi = self.range
        pieces = []
        for outer, a_range in zip(returns_lists, actor_ranges, strict=True):
            if overlap(a_range, (lo, hi)) is None:
                continue
            pieces.append(handoff.get(outer[0][self.shard.dp_rank]))
        width = self.batch["response_ids"].shape[1]
        pieces = [
            torch.cat([p, p.new_zeros(p.shape[0], width - p.shape[1])], 1)
            if p.shape[1] < width
            else p[:, :width]
            for p in pieces
        ]
        batch = {
            k: self.batch[k]
            for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "old_values")
        }
        batch["response_mask"] = batch["response_mask"].bool()
        batch["returns"] = torch.cat(pieces, 0)
        if "action_mask" in self.batch:  # multi-turn: no value loss on the environment's tokens
            batch["loss_mask"] = policy_mask(self.batch)
        if self.whole is not None:  # the whole step, for token-balanced shares
            w = self.whole["response_mask"].shape[1]
            per_token = {k: gather_rows(batch[k], w, self.group) for k in ("old_values", "returns")}
            batch = {k: self.whole[k] for k in ("prompt_ids", "prompt_mask", "response_ids")}
            batch["response_mask"] = self.whole["response_mask"].bool()
            if "action_mask" in self.whole:
                batch["loss_mask"] = policy_mask(self.whole)
            batch.update(per_token)
        s = self.settings
        mini = (s.mini_batch_size or self.cfg.data.samples_per_step) // self.shard.dp_size
        micro = s.micro_batch_size or mini
        clip = self.cfg.algorithm.value_clip
        agg = self.cfg.algorithm.loss_aggregation

        def loss_fn(
            values: torch.Tensor, mb: Mapping[str, torch.Tensor]
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss, m = A.value_loss(
                values,
                mb["old_values"],
                mb["returns"],
                mb.get("loss_mask", mb["response_mask"]),
                clip,
                agg=agg,
            )
            out = {f"critic/{k}": v for k, v in m.items()}  # read once per update
            out["critic/vf_loss"] = loss.detach()
            return loss, out

        gen = torch.Generator().manual_seed(self.cfg.training.seed * 1_000_033 + step)
        parts: list[dict[str, float]] = []
        for _ in range(updates):
            for _ in range(s.ppo_epochs):
                for idx in mini_batch_rows(batch, mini, self.shard, gen, self.whole is not None):
                    mb = {k: v[idx] for k, v in batch.items()}
                    out = self.trainer.update(mb, loss_fn, micro, agg=agg)
                    parts.append(role_metrics(out, "critic"))
        if not parts:
            return {}
        return {k: sum(p[k] for p in parts) / len(parts) for k in parts[0]}
