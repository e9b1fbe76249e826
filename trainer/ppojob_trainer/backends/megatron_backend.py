"""Megatron-core training backend: tensor and pipeline parallel actor and critic.

This module holds the trainers (:class:`MegatronPolicyTrainer`, :class:`MegatronValueTrainer`);
:mod:`.megatron_inputs` the inputs, :mod:`.megatron_sharded` one role's sharded model, optimizer
and schedule, :mod:`.megatron_logprobs` the log-probs and entropy from vocabulary-parallel logits.

Imported only when ``spec.roles.actor.backend`` or ``spec.roles.critic.backend`` is
``megatron``; megatron-core itself is imported inside the functions that need it.

Each worker holds one tensor/pipeline-parallel shard of a megatron-core ``GPTModel`` converted from
the Hugging Face checkpoint (:mod:`.megatron_convert`), read from its safetensors files as the
slices that worker holds (``get_slice``; host memory per worker: about its shard, the reference
model's copy read the same way); exporting to Hugging Face names is the only gather. The actor's
model ends at its final hidden states (:func:`~.megatron_logprobs.emit_hidden_states`) and its
log-probs and entropy come from the vocabulary-parallel projection of the response positions,
``LOGITS_CHUNK_TOKENS`` at a time, each chunk recomputed in backward
(:func:`~.megatron_logprobs.chunked_vocab_stats`), never the micro-batch's whole [b, L, V/tp] logits
nor the gathered vocabulary; the critic is the same model with a value head instead of the output
layer. Forward and backward go through megatron-core's pipeline schedule
(``get_forward_backward_func``: no pipelining at pipeline 1, 1F1B above). The loss functions are the
shared ones (``ppojob_trainer.algorithms``), weighted per micro-batch exactly as the torch backend
weighs them, so both backends make the same update.

Two optimizer paths:

- CPU (verified by the tests): fp32 weights, ``torch.optim.AdamW`` over the local shard, the
  gradient average over the data-parallel group with one flat all-reduce, gradient clipping on
  the global norm (tensor-parallel shards counted once each, replicated weights once).
- GPU (not yet run on a GPU): megatron-core's ``DistributedDataParallel`` and distributed optimizer
  (bf16 weights with fp32 master weights and gradient reduction in fp32), Transformer Engine's layer
  spec with megatron-core's fusions on (:func:`~.megatron_parallel.kernel_choice`; Transformer
  Engine missing is an error naming the ``gpu`` extra, unless the role sets
  ``PPOJOB_MEGATRON_LOCAL_SPEC=1`` for the unfused local layers). On the CPU the tests drive
  megatron-core's own DDP (its gradient scale against one full-batch backward, over real gloo
  groups) and its own distributed optimizer under a device shim (save -> load -> step resumes
  bit-identically); megatron's pipeline schedules and Transformer Engine need CUDA and run only on a
  GPU.

Inputs: every row is shifted left so that its prompt starts at position 0 (right padding only),
which gives each token the position the Hugging Face model gives it under left padding and needs
only the causal mask. Each micro-batch is padded to its own longest prompt and response.

Packing (``training.packing``): a micro-batch's sequences concatenated into one row without padding
(:func:`~.torch_backend.packing.pack_rows`), positions restarting per sequence. Under Transformer
Engine's layer spec the row goes in as ``thd`` with ``PackedSeqParams``
(:func:`~.megatron_inputs.packed_seq_params`: ``cu_seqlens`` at the boundaries; its varlen
attention and RoPE restart per sequence); megatron-core's local attention takes no
``PackedSeqParams`` (``DotProductAttention`` asserts it is None), so there the row gets a
block-diagonal causal mask (:func:`~.megatron_inputs.block_causal_mask`) and rotary positions
restarting per sequence (:func:`~.megatron_inputs.rope_positions`: ``GPTModel`` asks its rotary
embedding for positions 0..N-1 whatever its ``position_ids``). Micro-batches by tokens
(``maxTokensPerMicroBatch``): the torch backend's planner
(:func:`~.torch_backend.packing.micro_batch_rows`), the loss weights unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..distributed import ShardIdentity
from .base import PolicyLossFn, PolicyTrainer, ValueLossFn, ValueTrainer
from .megatron_logprobs import (
    LOGITS_CHUNK_TOKENS,
    _at_index,
    chunked_vocab_stats,
    emit_hidden_states,
    output_weight,
)
from .megatron_sharded import _Sharded
from .weight_sync import WeightStream

log = logging.getLogger(__name__)


class MegatronPolicyTrainer(PolicyTrainer):
    """The actor on megatron-core (reference model: a frozen shard of the same layout)."""

    export_is_collective = True

    def __init__(
        self,
        cfg: Any,
        model_dir: Path,
        shard: ShardIdentity,
        *,
        need_reference: bool,
        total_updates: int = 1,
        device: str = "cpu",
        need_entropy: bool = True,
    ) -> None:
        self.temperature = float(cfg.data.temperature)
        self.need_entropy = need_entropy
        self.entropy_grad = cfg.algorithm.entropy_coefficient > 0
        self.m = _Sharded(
            Path(model_dir),
            cfg.model.dtype,
            shard,
            cfg.training,
            total_updates=total_updates,
            value=False,
            device=device,
            seed=cfg.training.seed,
            sequence_parallel=cfg.roles.actor.parallelism.sequence_parallel,
            frozen_copy=need_reference,
            routing_replay=cfg.algorithm.routing_replay == "rollout",
            router_aux_loss=cfg.algorithm.router_aux_loss_coefficient,
        )
        self.logits_chunk = LOGITS_CHUNK_TOKENS
        for model in (self.m.model, self.m.reference):
            if model is not None:
                emit_hidden_states(model)
        self.micro = cfg.training.micro_batch_size

    def _token_stats(
        self,
        model: Any,
        output: torch.Tensor,
        mb: Mapping[str, torch.Tensor],
        entropy: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of the response tokens (and their entropy) from ``model``'s final hidden
        states ``output`` [b, L, h] (:func:`emit_hidden_states`) at the response positions,
        projected onto this rank's vocabulary slice ``logits_chunk`` positions at a time."""
        hidden = _at_index(output, mb)
        tokens = mb["response_ids"].to(hidden.device)
        return chunked_vocab_stats(
            hidden,
            output_weight(model),
            tokens,
            self.temperature,
            entropy=entropy,
            chunk_tokens=self.logits_chunk,
        )

    @torch.no_grad()
    def logprobs(
        self, batch: Mapping[str, torch.Tensor], *, reference: bool = False
    ) -> torch.Tensor:
        if reference and self.m.reference is None:
            raise ValueError("logprobs(reference=True) needs a reference model (KL is off)")
        model = self.m.reference if reference else self.m.model
        n = batch["response_ids"].shape[0]

        def head(output: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
            logp, _ = self._token_stats(model, output, mb)
            return output.new_zeros(()), logp.cpu()

        plan = self.m.plan(batch, self.micro or n)
        if not reference:  # routingReplay: the agreement of this pass (old log-probs)
            self.m.routing_counts = [0.0, 0.0]
        self.m.measure_routing = not reference
        try:
            with _eval_mode(model):
                parts = self.m.run(batch, plan, head, forward_only=True, reference=reference)
        finally:
            self.m.measure_routing = False
        width = batch["response_ids"].shape[1]
        return self.m.from_last_stage(self.m.assemble(plan, parts, width))

    def routing_stats(self) -> dict[str, float]:
        """The last old log-probs' routing agreement with the engine's (sums: choices made
        alike, choices compared, every layer of the pipeline's stages); empty without routing
        replay. Every worker of the role calls it (a collective over the pipeline)."""
        if not self.m.routing_replay:
            return {}
        counts = torch.tensor(self.m.routing_counts, dtype=torch.float64)
        if self.m.shard.pp_size > 1:
            import torch.distributed as dist

            from ..algorithms import collectives

            group = self.m.ps.get_pipeline_model_parallel_group()
            counts = collectives.to_group(counts, group)
            dist.all_reduce(counts, group=group)
        same, total = counts.cpu().tolist()
        return {"router_agree_sum": same, "router_choices": total}

    def update(
        self,
        minibatch: Mapping[str, torch.Tensor],
        loss_fn: PolicyLossFn,
        micro_batch_size: int,
        agg: str = "token-mean",
    ) -> dict[str, float]:
        entropy = None
        if self.need_entropy:
            entropy = "grad" if self.entropy_grad else "nograd"

        def micro_loss(output: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[Any, Any]:
            logp, ent = self._token_stats(self.m.model, output, mb, entropy)
            return loss_fn(logp, ent, _loss_inputs(mb, logp.device))

        return self.m.update(minibatch, micro_batch_size, agg, micro_loss)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """HF-named weights, on the role's leader ({} on every other worker). A collective:
        every worker of the role calls it (``export_is_collective``)."""
        return self.m.gathered_weights()

    def export_weight_stream(self, max_bytes: int) -> WeightStream:
        """:meth:`export_weights` in buckets of at most ``max_bytes``, each assembled when asked
        for with tensor collectives on the weights' device (:meth:`_Sharded.weight_stream`).
        Every worker of the role gets every bucket; every worker must walk the stream (a
        collective within its data-parallel replica)."""
        return self.m.weight_stream(max_bytes)

    def save_checkpoint(self, directory: Path | str, shard: ShardIdentity) -> None:
        """This worker's shard, through megatron-core's ``dist_checkpointing``
        (:meth:`_Sharded.save_checkpoint`); every worker of the role calls it."""
        self.m.save_checkpoint(Path(directory))

    def load_checkpoint(self, directory: Path | str, shard: ShardIdentity) -> None:
        """Restore :meth:`save_checkpoint`'s shards (or a single-file checkpoint of before)."""
        _load_sharded(self, self.m, Path(directory))

    def state_dict(self) -> dict[str, object]:
        return self.m.state_dict()

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self.m.load_state_dict(state)


class MegatronValueTrainer(ValueTrainer):
    """The critic on megatron-core: the policy's architecture with a value head."""

    export_is_collective = True

    def __init__(
        self,
        cfg: Any,
        model_dir: Path,
        shard: ShardIdentity,
        *,
        total_updates: int = 1,
        device: str = "cpu",
    ) -> None:
        critic = cfg.roles.effective_critic(True)
        settings = cfg.critic_training()
        self.m = _Sharded(
            Path(model_dir),
            cfg.model.dtype,
            shard,
            settings,
            total_updates=total_updates,
            value=True,
            device=device,
            seed=cfg.training.seed,
            sequence_parallel=critic.parallelism.sequence_parallel,
        )
        self.micro = settings.micro_batch_size

    @staticmethod
    def _values(output: torch.Tensor, mb: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return _at_index(output.squeeze(-1), mb).float()

    @torch.no_grad()
    def values(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        n = batch["response_ids"].shape[0]

        def head(output: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
            return output.new_zeros(()), self._values(output, mb).cpu()

        plan = self.m.plan(batch, self.micro or n)
        with _eval_mode(self.m.model):
            parts = self.m.run(batch, plan, head, forward_only=True)
        width = batch["response_ids"].shape[1]
        return self.m.from_last_stage(self.m.assemble(plan, parts, width))

    def update(
        self,
        minibatch: Mapping[str, torch.Tensor],
        loss_fn: ValueLossFn,
        micro_batch_size: int,
        agg: str = "token-mean",
    ) -> dict[str, float]:
        def micro_loss(output: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[Any, Any]:
            values = self._values(output, mb)
            return loss_fn(values, _loss_inputs(mb, values.device))

        return self.m.update(minibatch, micro_batch_size, agg, micro_loss)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The critic's HF-named weights (backbone, ``value_head.*``) on its leader."""
        return self.m.gathered_weights()

    def export_weight_stream(self, max_bytes: int) -> WeightStream:
        """:meth:`export_weights` bucket by bucket, as the actor's
        (:meth:`MegatronPolicyTrainer.export_weight_stream`)."""
        return self.m.weight_stream(max_bytes)

    def save_checkpoint(self, directory: Path | str, shard: ShardIdentity) -> None:
        """This worker's shard, through megatron-core's ``dist_checkpointing``
        (:meth:`_Sharded.save_checkpoint`); every worker of the role calls it."""
        self.m.save_checkpoint(Path(directory))

    def load_checkpoint(self, directory: Path | str, shard: ShardIdentity) -> None:
        """Restore :meth:`save_checkpoint`'s shards (or a single-file checkpoint of before)."""
        _load_sharded(self, self.m, Path(directory))

    def state_dict(self) -> dict[str, object]:
        return self.m.state_dict()

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self.m.load_state_dict(state)


def _load_sharded(
    trainer: MegatronPolicyTrainer | MegatronValueTrainer, m: _Sharded, directory: Path
) -> None:
    """Load a role's checkpoint directory: ``dist_checkpointing`` shards (``metadata.json``),
    else a single ``state.pt`` written before sharded checkpoints (still loadable: every worker
    reads it whole, once, and cuts its shard; the next checkpoint is sharded)."""
    if (directory / "metadata.json").is_file():
        m.load_checkpoint(directory)
        return
    legacy = directory / _LEGACY_STATE
    if legacy.is_file():
        log.warning(
            "%s is a single-file megatron checkpoint of an earlier version: every worker loads "
            "it whole (host memory: the whole training state); checkpoints from now on are "
            "sharded",
            legacy,
        )
        trainer.load_state_dict(torch.load(legacy, map_location="cpu", weights_only=True))
        return
    raise FileNotFoundError(
        f"{directory} holds no megatron checkpoint (neither dist_checkpointing's metadata.json "
        f"nor a {_LEGACY_STATE})"
    )


_LEGACY_STATE = "state.pt"


def _loss_inputs(mb: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The micro-batch a loss function sees: its tensors on the device of the log-probs or
    values it is combined with (the batch crosses the seam on the CPU; the model's output is on
    the GPU), without the schedule's own ``_ids``/``_index``."""
    routes = ("routed_experts", "prompt_routed_experts")  # (routing replay: used already)
    return {k: v.to(device) for k, v in mb.items() if not k.startswith("_") and k not in routes}


@contextmanager
def _eval_mode(module: Any) -> Iterator[None]:
    was = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was)
