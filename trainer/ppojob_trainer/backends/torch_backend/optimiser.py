"""The optimizer side of a torch trainer: gradient accumulation weights, AdamW with the
learning-rate schedule, the data-parallel gradient all-reduce (``sharding: none``) or FSDP2, and
the sharded checkpoints (``torch.distributed.checkpoint``, every worker its own shard)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ppojob_api.training import TrainingSettings

from .common import lr_factor
from .memory import _pad_columns, scalar, trim_padding
from .packing import micro_batch_rows, split_to_count
from .sharding import shard_module


def accumulation_weights(counts: Sequence[float], global_count: float, dp_size: int) -> list[float]:
    """Weights of the micro-batch losses of one mini-batch under gradient accumulation.

    Each micro-batch's loss is a mean over its own ``counts[i]`` units (tokens or sequences);
    the mini-batch's loss is the mean over ``global_count`` units, every data-parallel worker's
    together. The weight ``counts[i] / global_count`` makes the summed gradients that of the
    global mean; times ``dp_size`` because the data-parallel all-reduce then averages them.
    """
    if global_count <= 0:
        raise ValueError(
            f"accumulation_weights: the mini-batch has no unit to average over "
            f"(global count {global_count})"
        )
    return [float(c) * dp_size / float(global_count) for c in counts]


def _micro_weights(
    minibatch: Mapping[str, torch.Tensor], slices: Sequence[torch.Tensor], agg: str, opt: _Optimised
) -> list[float] | None:
    """:func:`accumulation_weights` of the micro-batches (row indices ``slices``) of
    ``minibatch``, counted over its ``loss_mask`` when it has one (samples left out of the
    loss); None when no worker's mini-batch has anything in the loss."""
    from ...algorithms import aggregation_count

    mask = minibatch.get("loss_mask", minibatch.get("response_mask"))
    if mask is None:  # a loss without a mask: each row counts once
        counts = [float(len(sl)) for sl in slices]
    else:
        counts = [float(aggregation_count(mask[sl], agg)) for sl in slices]
    total = opt.global_count(sum(counts))
    if total == 0 and "loss_mask" in minibatch:
        return None
    return accumulation_weights(counts, total, opt.dp_size)


class _Optimised:
    """A module on its device, float32 master weights, its AdamW optimizer, the LR schedule, the
    data-parallel gradient average (one flat all-reduce, or FSDP2's reduce-scatter when
    ``settings.sharding`` is ``fsdp``) and the compute dtype (autocast)."""

    def __init__(
        self,
        module: nn.Module,
        settings: TrainingSettings,
        total_updates: int,
        group: Any | None,
        dp_size: int,
        *,
        device: torch.device | str = "cpu",
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        # FSDP2 whenever asked for and a group is given, one worker too (a world of one: the
        # same wrapping, mixed precision and sharded checkpoints; bench/gpu_check.py runs it)
        self.sharded = settings.sharding == "fsdp" and group is not None
        module.to(dtype=torch.float32)
        if self.sharded:  # fully_shard moves each unit to the device as it shards it
            mixed = compute_dtype if compute_dtype != torch.float32 else None
            shard_module(module, group, self.device, compute_dtype=mixed)
        else:
            module.to(device=self.device)
        self.module = module
        self.settings = settings
        self.total_updates = max(1, total_updates)
        self.group = group
        self.dp_size = dp_size
        self.params = [p for p in module.parameters() if p.requires_grad]
        # frozen weights (a LoRA base model) are neither trained nor checkpointed
        self.frozen = any(not p.requires_grad for p in module.parameters())
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=settings.learning_rate,
            betas=(settings.adam_beta1, settings.adam_beta2),
            eps=settings.adam_eps,
            weight_decay=settings.weight_decay,
        )
        self.updates = 0

    def autocast(self) -> AbstractContextManager[Any]:
        """Compute in ``compute_dtype`` (bfloat16 matmuls over the float32 master weights);
        sharded modules cast in FSDP's mixed-precision policy instead."""
        if (
            self.compute_dtype == torch.float32
            or self.sharded
            or self.device.type not in ("cpu", "cuda")
        ):
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def micro_batches(
        self, batch: Mapping[str, torch.Tensor], max_rows: int | None
    ) -> list[torch.Tensor]:
        """Row indices of ``batch``'s micro-batches (:func:`micro_batch_rows` with this role's
        ``maxTokensPerMicroBatch`` and ``packing``); under FSDP with a token budget every
        worker of the group runs as many (the most any of them needs)."""
        budget = self.settings.max_tokens_per_micro_batch
        rows = micro_batch_rows(batch, budget, packing=self.settings.packing, max_rows=max_rows)
        if budget is not None and self.sharded:
            from ...algorithms import collectives

            # on the device the group's backend needs (NCCL: CUDA), not where torch.tensor makes it
            rows = split_to_count(rows, collectives.all_reduce_max(len(rows), self.group))
        return rows

    def forward_chunks(
        self, batch: Mapping[str, torch.Tensor], forward: Callable[[dict], torch.Tensor]
    ) -> torch.Tensor:
        """A no-grad forward over ``batch`` in ``forwardMicroBatchSize`` rows (or
        ``maxTokensPerMicroBatch`` tokens) at a time, each padded to its own longest sequence
        or packed; the [B, T] result on the CPU, rows in ``batch``'s order."""
        n, width = batch["response_ids"].shape
        size = self.settings.forward_micro_batch_size or self.settings.micro_batch_size
        if self.settings.max_tokens_per_micro_batch is None:
            size = size or n
        out = torch.zeros(n, width, dtype=torch.float32)
        for idx in self.micro_batches(batch, size):
            micro, _ = trim_padding({k: v[idx] for k, v in batch.items()})
            out[idx] = _pad_columns(forward(micro).float().cpu(), width)
        return out

    def global_count(self, local: float) -> float:
        """Sum of ``local`` over the data-parallel group."""
        if self.dp_size <= 1:
            return float(local)
        from ...algorithms import collectives

        total = collectives.all_reduce_sum(
            torch.tensor([float(local)], dtype=torch.float64), self.group
        )
        return float(total)

    def accumulate(
        self,
        minibatch: Mapping[str, torch.Tensor],
        micro_batch_size: int,
        agg: str,
        micro_loss: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, Any]]],
    ) -> dict[str, float]:
        """One optimizer update over ``minibatch``: backward each micro-batch's loss with its
        :func:`accumulation_weights` weight, then step. Each micro-batch is padded to its own
        longest sequence (``micro_loss`` gets it on the CPU; the trainers move it to the device
        with :func:`to_device`). Returns the row-weighted mean of the micro-batches' metrics
        (floats or tensors; one device sync at the end) plus the step's."""
        n = minibatch["response_ids"].shape[0]
        self.module.train()
        budget = self.settings.max_tokens_per_micro_batch
        slices = self.micro_batches(
            minibatch, self.settings.micro_batch_size if budget is not None else micro_batch_size
        )
        parts = []
        weights = _micro_weights(minibatch, slices, agg, self)
        if weights is None:  # every sample of the mini-batch is left out of the loss
            return {"skipped_updates": 1.0}
        for i, (sl, scale) in enumerate(zip(slices, weights, strict=True)):
            if self.sharded:  # reduce-scatter the gradients once, after the last micro-batch
                self.module.set_requires_gradient_sync(i == len(slices) - 1)
            micro, _ = trim_padding({k: v[sl] for k, v in minibatch.items()})
            loss, metrics = micro_loss(micro)
            (loss * scale).backward()
            parts.append((len(sl) / n, metrics))
        out = _mean_metrics(parts)
        out.update(self.step())
        return out

    def step(self) -> dict[str, float]:
        if self.dp_size > 1 and not self.sharded:
            import torch.distributed as dist

            from ...algorithms import collectives

            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            flat = collectives.to_group(torch.cat([g.reshape(-1) for g in grads]), self.group)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            flat /= self.dp_size
            offset = 0
            for p in self.params:
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p).to(device=p.device, dtype=p.dtype)
                offset += n
        clip = self.settings.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.params, clip if clip else float("inf"))
        lr = self.settings.learning_rate * lr_factor(
            self.updates, self.settings, self.total_updates
        )
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        return {"grad_norm": scalar(norm), "lr": lr}

    def state_dict(self) -> dict[str, object]:
        """Whole model and optimizer state (in memory; gathered under FSDP)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(
            full_state_dict=self.sharded, cpu_offload=self.sharded, ignore_frozen_params=self.frozen
        )
        model, optim = get_state_dict(self.module, self.optimizer, options=opts)
        self._forget_unstepped_state()
        return {"model": model, "optimizer": optim, "updates": self.updates}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        opts = StateDictOptions(
            full_state_dict=self.sharded, broadcast_from_rank0=False, strict=not self.frozen
        )
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=opts,
        )
        self.updates = int(state["updates"])

    def save_checkpoint(self, directory: Path | str) -> None:
        """This worker's shard of the model and optimizer state into ``directory``
        (``torch.distributed.checkpoint``: one file per worker plus ``.metadata``; a replica
        that is the same on every worker is written once)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        Path(directory).mkdir(parents=True, exist_ok=True)
        opts = StateDictOptions(ignore_frozen_params=self.frozen)
        model, optim = get_state_dict(self.module, self.optimizer, options=opts)
        state = {"model": model, "optimizer": optim, "updates": torch.tensor(self.updates)}
        with _single_process_dcp(self.group is None):
            dcp.save(
                state,
                checkpoint_id=str(directory),
                process_group=self.group,
                no_dist=self.group is None,
            )
        self._forget_unstepped_state()

    def load_checkpoint(self, directory: Path | str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (each worker reads its own shard)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
            set_state_dict,
        )

        opts = StateDictOptions(ignore_frozen_params=self.frozen, strict=not self.frozen)
        model, optim = get_state_dict(self.module, self.optimizer, options=opts)
        state = {"model": model, "optimizer": optim, "updates": torch.tensor(0)}
        with _single_process_dcp(self.group is None):
            dcp.load(
                state,
                checkpoint_id=str(directory),
                process_group=self.group,
                no_dist=self.group is None,
            )
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=opts,
        )
        self.updates = int(state["updates"])
        self._forget_unstepped_state()

    def _forget_unstepped_state(self) -> None:
        """``get_state_dict`` fills an optimizer that never stepped with zero state (step 1);
        drop it, so saving or resuming before the first update changes nothing."""
        if self.updates == 0:
            self.optimizer.state.clear()


def _mean_metrics(parts: Sequence[tuple[float, Mapping[str, Any]]]) -> dict[str, float]:
    out: dict[str, Any] = {}
    for weight, metrics in parts:
        for k, v in metrics.items():
            v = v.detach() if isinstance(v, torch.Tensor) else float(v)
            out[k] = out.get(k, 0.0) + weight * v
    return {k: scalar(v) for k, v in out.items()}


@contextmanager
def _single_process_dcp(single: bool) -> Iterator[None]:
    """``torch.distributed.checkpoint`` with ``no_dist=True`` warns that it assumes one process;
    a worker without a group is one process on purpose, so that warning is noise in its log."""
    with warnings.catch_warnings():
        if single:
            warnings.filterwarnings(
                "ignore", message="torch.distributed is disabled", category=UserWarning
            )
        yield
