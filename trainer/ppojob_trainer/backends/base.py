"""Backend interfaces: what the role logic in ``workers/`` asks of a training or generation stack.

Three seams, each implemented by the ``torch`` backend (Hugging Face models, CPU or GPU) and by
the GPU backends (``megatron`` for training, ``sglang`` for generation):

``GenerationEngine``  sample completions for a batch of prompts; take new weights
                      (``update_weights``) after every actor update.
``PolicyTrainer``     log-probs of responses under the policy (and under the frozen reference);
                      one optimizer update from a mini-batch and a loss function.
``ValueTrainer``      values of response positions; one optimizer update likewise.

Tensors cross these seams on the CPU, shaped ``[B, P]`` (prompts, left-padded) and ``[B, T]``
(responses, right-padded; ``response_mask`` is 1 on generated tokens up to and including the
first stop token). A backend moves what it needs to its device itself; the metrics a loss
function returns may be floats or scalar tensors (read once per update). The loss functions are
the backend-agnostic part: the role logic builds them
from ``ppojob_trainer.algorithms``; a backend only runs forward, backward, the gradient
all-reduce of its data-parallel group and the optimizer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..distributed import ShardIdentity
from .weight_sync import WeightStream

# (logprobs [b, T], entropy [b, T] or None, mini-batch) -> (loss, metrics)
PolicyLossFn = Callable[
    [torch.Tensor, torch.Tensor | None, Mapping[str, torch.Tensor]],
    tuple[torch.Tensor, dict[str, float]],
]
# (values [b, T], mini-batch) -> (loss, metrics)
ValueLossFn = Callable[
    [torch.Tensor, Mapping[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]
]


@dataclass
class Generation:
    """Completions of a batch of prompts."""

    response_ids: torch.Tensor  # [B, T] long, padded with the pad id after the stop token
    response_mask: torch.Tensor  # [B, T] bool
    logprobs: torch.Tensor  # [B, T] float32, log-probs of the sampled tokens (0 where masked)
    lengths: torch.Tensor  # [B] long, response tokens incl. the stop token
    versions: torch.Tensor | None = None
    """[B, T] int32: the policy version that sampled each token, when the engine's weights
    changed during the call (partial rollout); None: all of them the caller's version."""
    routed_experts: torch.Tensor | None = None
    """[B, T, layers, k] int16: the experts each response token was routed to when the engine
    fed it (``-1``: not fed, e.g. the last sampled token, or a dense layer); None unless
    asked for (``algorithm.routingReplay: rollout``)."""
    prompt_routed_experts: torch.Tensor | None = None
    """[B, P, layers, k] int16: the same for the (left-padded) prompt columns."""


MEMORY_WEIGHTS = "weights"
MEMORY_KV_CACHE = "kv_cache"
MEMORY_CUDA_GRAPH = "cuda_graph"
"""What a sleeping engine frees and takes back, by SGLang's tags (``sglang.srt.constants``:
``GPU_MEMORY_TYPE_*``; the contract tests check the values). A colocated engine wakes in two
halves, as verl's does: its weights first (then the sync), its KV cache and CUDA graphs after
the sync's buckets are freed."""
WAKE_FOR_SYNC = (MEMORY_WEIGHTS,)
WAKE_AFTER_SYNC = (MEMORY_KV_CACHE, MEMORY_CUDA_GRAPH)


class GenerationEngine(ABC):
    """Samples completions; holds its own copy of the policy weights."""

    @abstractmethod
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
    ) -> Generation:
        """Sample one completion per prompt row (repeat rows for several samples per prompt).
        ``temperature == 0`` asks for greedy decoding (the most likely token at every step)."""

    @abstractmethod
    def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace the engine's weights with the actor's, all at once (names as in the HF state
        dict). The sync methods below default to collecting buckets and calling this."""

    # ---- weight sync: SGLang's method names; the torch engine uses these defaults ----------
    def begin_weight_update(self) -> None:  # noqa: B027 - optional hook
        """Open a weight-update session: every ``update_weights_from_*`` call of one sync runs
        between this and :meth:`end_weight_update` (SGLang refuses them outside one)."""

    def end_weight_update(self) -> None:  # noqa: B027 - optional hook
        """Close the session :meth:`begin_weight_update` opened (SGLang finalizes the loaded
        weights here)."""

    def update_weights_from_tensor(self, payloads: Sequence[Any], *, flush_cache: bool) -> None:
        """Colocated sync: one bucket of the actor's weights, from the processes owning them on
        the engine's GPUs. ``payloads[i]`` is tensor-parallel rank ``i``'s bucket: here a
        :class:`~.weight_sync.FlatBucket` of this very process (the torch engine spans one
        worker); for sglang a serialized CUDA IPC handle. ``flush_cache`` marks the update's
        last bucket."""
        (bucket,) = payloads
        self._pending_weights().update(bucket.tensors())
        if flush_cache:
            self._apply_pending()

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
    ) -> None:
        """Disaggregated sync: join the weight-update group (rank 0 is the actor's leader)."""
        from .weight_sync import init_custom_group

        groups = self.__dict__.setdefault("_weight_groups", {})
        groups[group_name] = (
            init_custom_group(
                backend, master_address, master_port, world_size, rank_offset, group_name
            ),
            backend,
        )

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str,
        flush_cache: bool,
    ) -> None:
        """Disaggregated sync: receive one bucket broadcast by rank 0 as one packed byte
        tensor (:func:`~.weight_sync.pack`'s layout, SGLang's ``flattened_bucket``)."""
        import torch.distributed as dist

        from .weight_sync import unpack_empty

        group, backend = self.__dict__["_weight_groups"][group_name]
        device = "cuda" if backend == "nccl" else "cpu"
        bucket = unpack_empty(names, dtypes, shapes, device)
        dist.broadcast(bucket.flattened_tensor, src=0, group=group)
        self._pending_weights().update(bucket.tensors())
        if flush_cache:
            self._apply_pending()

    def _pending_weights(self) -> dict[str, torch.Tensor]:
        return self.__dict__.setdefault("_pending", {})

    def _apply_pending(self) -> None:
        pending, self.__dict__["_pending"] = self._pending_weights(), {}
        self.update_weights(pending)

    def release_memory(self) -> None:  # noqa: B027 - optional hook
        """Free weights, KV cache and CUDA graphs while the actor trains (colocated engines
        with offload)."""

    def resume_memory(self, tags: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """Take back the memory of ``tags`` (:data:`WAKE_FOR_SYNC` before the weight update,
        :data:`WAKE_AFTER_SYNC` after it)."""


class PolicyTrainer(ABC):
    """The actor's model, optional frozen reference model and optimizer."""

    @abstractmethod
    def logprobs(
        self, batch: Mapping[str, torch.Tensor], *, reference: bool = False
    ) -> torch.Tensor:
        """Log-probs [B, T] of ``batch['response_ids']`` under the policy (or the reference)."""

    @abstractmethod
    def update(
        self,
        minibatch: Mapping[str, torch.Tensor],
        loss_fn: PolicyLossFn,
        micro_batch_size: int,
        agg: str = "token-mean",
    ) -> dict[str, float]:
        """One optimizer update from this worker's share of a mini-batch (gradients averaged
        over the data-parallel group). Returns the loss metrics and ``grad_norm``, ``lr``.

        ``loss_fn`` gives each micro-batch's loss aggregated over that micro-batch with ``agg``
        (a mean); the backend weighs it by the micro-batch's share of the whole mini-batch's
        tokens (or sequences, for the ``seq-*`` modes) over every data-parallel worker, so the
        update is that of the loss of the whole mini-batch in one pass."""

    @abstractmethod
    def export_weights(self) -> dict[str, torch.Tensor]:
        """The policy's weights for the generation engines, HF names, CPU tensors."""

    export_is_collective: bool = False
    """True when :meth:`export_weights` (and :meth:`export_pretrained`) gather shards, so every
    worker of the role must call it; otherwise only the data-parallel leader does."""

    def export_weight_stream(self, max_bytes: int) -> WeightStream:
        """The weights of :meth:`export_weights` for a sync, bucket by bucket (buckets of at
        most ``max_bytes``). Default: exported whole, then cut into buckets; a backend that
        can gather one bucket at a time overrides it."""
        return WeightStream.of(self.export_weights(), max_bytes)

    def save_checkpoint(self, directory: Path | str, shard: ShardIdentity) -> None:
        """Write this worker's part of the training state under ``directory`` (every worker of
        the role calls it with the same shared directory). Default: the leader saves
        :meth:`state_dict`."""
        _save_leader_state(self, directory, shard)

    def load_checkpoint(self, directory: Path | str, shard: ShardIdentity) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""
        _load_leader_state(self, directory)

    def export_pretrained(self, directory: Path | str, shard: ShardIdentity) -> None:
        """Write the policy as a Hugging Face model directory (``save_pretrained`` + tokenizer)."""
        raise NotImplementedError(f"{type(self).__name__} has no Hugging Face export")

    @abstractmethod
    def state_dict(self) -> dict[str, object]:
        """Everything needed to resume: model, optimizer and schedule state."""

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore from :meth:`state_dict`."""


class ValueTrainer(ABC):
    """The critic's value model and optimizer."""

    @abstractmethod
    def values(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Values [B, T] (float32) of the states before each response token."""

    @abstractmethod
    def update(
        self,
        minibatch: Mapping[str, torch.Tensor],
        loss_fn: ValueLossFn,
        micro_batch_size: int,
        agg: str = "token-mean",
    ) -> dict[str, float]:
        """One optimizer update, as :meth:`PolicyTrainer.update`."""

    @abstractmethod
    def state_dict(self) -> dict[str, object]:
        """Everything needed to resume."""

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore from :meth:`state_dict`."""

    def save_checkpoint(self, directory: Path | str, shard: ShardIdentity) -> None:
        """As :meth:`PolicyTrainer.save_checkpoint`."""
        _save_leader_state(self, directory, shard)

    def load_checkpoint(self, directory: Path | str, shard: ShardIdentity) -> None:
        """As :meth:`PolicyTrainer.load_checkpoint`."""
        _load_leader_state(self, directory)

    def export_pretrained(self, directory: Path | str, shard: ShardIdentity) -> None:
        """Write the value model: backbone with ``save_pretrained`` plus its value head."""
        raise NotImplementedError(f"{type(self).__name__} has no Hugging Face export")


_STATE_FILE = "state.pt"


def _save_leader_state(
    trainer: PolicyTrainer | ValueTrainer, directory: Path | str, shard: ShardIdentity
) -> None:
    state = trainer.state_dict()  # on every worker: a sharded backend gathers here
    if shard.is_dp_leader:
        Path(directory).mkdir(parents=True, exist_ok=True)
        torch.save(state, Path(directory) / _STATE_FILE)


def _load_leader_state(trainer: PolicyTrainer | ValueTrainer, directory: Path | str) -> None:
    trainer.load_state_dict(torch.load(Path(directory) / _STATE_FILE, weights_only=True))
