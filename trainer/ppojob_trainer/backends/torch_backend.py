"""The torch backend: Hugging Face ``transformers`` models on CPU or one GPU per worker.

Generation is a tight sampling loop over the whole batch with the model's KV cache
(``past_key_values``): one forward over the prompts, then one single-token forward per step until
every row has produced a stop token.

Training is data parallel over the role's ``torch.distributed`` group (gloo on CPU, nccl on GPU):
- device: tensors cross the backend seam on the CPU; :func:`to_device` is the one place a
  micro-batch moves to the worker's device (model inputs go through :func:`_device_inputs`);
- precision: float32 master weights and AdamW state; ``model.dtype`` bfloat16 computes under
  ``torch.autocast`` (float16 is rejected by validation: no loss scaling); the frozen reference
  and the generation engines hold their weights in ``model.dtype``;
- memory: forwards without gradient run ``forwardMicroBatchSize`` rows at a time; every
  (micro-)batch is padded to its own longest prompt and response (:func:`trim_padding`);
  log-probs and entropy come from the hidden states ``LOGITS_CHUNK_TOKENS`` positions at a time
  (:func:`chunked_logprobs`); ``gradientCheckpointing`` recomputes block activations;
- sharding: ``sharding: none`` keeps a replica per worker and averages gradients with one flat
  ``all_reduce``; ``sharding: fsdp`` shards parameters, gradients and optimizer state with
  FSDP2 (``fully_shard``, one unit per transformer block), the reference model too (optionally
  offloaded to CPU memory);
- checkpoints: every worker writes its own shard with ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ppojob_api.training import LoraSpec, TrainingSettings

from ..algorithms.sampling import sampling_logprobs
from ..distributed import ShardIdentity
from ..models import (
    VALUE_HEAD_FILE,
    load_causal_lm,
    load_tokenizer,
    load_value_model,
    save_pretrained_here,
    torch_dtype,
)
from .base import (
    Generation,
    GenerationEngine,
    PolicyLossFn,
    PolicyTrainer,
    ValueLossFn,
    ValueTrainer,
)
from .packed_attention import use_packed_attention
from .weight_sync import WeightStream, plan_buckets


# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------
def full_inputs(
    batch: Mapping[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
    """Prompt + response ids, attention mask (None without padding), position ids, prompt len."""
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
    ids = torch.cat([prompt_ids, batch["response_ids"]], dim=1)
    if bool(prompt_mask.all()):
        return ids, None, None, prompt_ids.shape[1]
    ones = torch.ones_like(batch["response_ids"], dtype=prompt_mask.dtype)
    attn = torch.cat([prompt_mask, ones], dim=1).long()
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    return ids, attn, pos, prompt_ids.shape[1]


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, top_p: float = 1.0
) -> torch.Tensor:
    """Log-probs of ``tokens`` under the sampling distribution: ``softmax(logits / temperature)``
    truncated to the ``top_p`` nucleus (:func:`~ppojob_trainer.algorithms.sampling_logprobs`),
    in float32."""
    return sampling_logprobs(logits, tokens, temperature, top_p)


def entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per position, float32."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail of each row beyond the smallest set with probability mass >= ``top_p``."""
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, idx, sorted_p)


def lr_factor(update: int, settings: TrainingSettings, total_updates: int) -> float:
    """Multiplier of the peak learning rate at optimizer update ``update`` (0-based): a linear
    warmup over ``lr_warmup_steps``, then the peak, then the decay to ``min_learning_rate``
    over the last ``lr_decay_steps`` updates (0: every update after the warmup)."""
    warm = settings.lr_warmup_steps
    if warm and update < warm:
        return (update + 1) / warm
    if settings.lr_scheduler == "constant" or total_updates <= warm:
        return 1.0
    span = total_updates - warm
    if settings.lr_decay_steps:
        span = min(span, settings.lr_decay_steps)
    start = total_updates - span  # the first update of the decay
    if update < start:
        return 1.0
    progress = min(1.0, (update - start) / max(1, span))
    floor = settings.min_learning_rate / settings.learning_rate
    if settings.lr_scheduler == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode (no dropout) inside the block, its previous mode after."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def _split(n: int, size: int) -> list[torch.Tensor]:
    return [torch.arange(i, min(i + size, n)) for i in range(0, n, size)]


# ---------------------------------------------------------------------------------------------
# Packing and token-budget micro-batches
# ---------------------------------------------------------------------------------------------
def sequence_lengths(batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Real (unpadded) prompt and response tokens of each row: ``prompt_mask`` and
    ``response_mask`` counted (a batch without ``response_mask``: every column)."""
    plen = batch["prompt_mask"].bool().sum(1)
    mask = batch.get("response_mask")
    if mask is None:
        rlen = torch.full_like(plen, batch["response_ids"].shape[1])
    else:
        rlen = mask.bool().sum(1)
    return plen, rlen


def micro_batch_rows(
    batch: Mapping[str, torch.Tensor],
    max_tokens: int | None,
    *,
    packing: bool,
    max_rows: int | None,
    field: str = "maxTokensPerMicroBatch",
) -> list[torch.Tensor]:
    """The rows of each micro-batch of ``batch`` (index tensors; every row exactly once).

    Without ``max_tokens``: consecutive runs of ``max_rows`` rows (today's micro-batches).
    With it: micro-batches whose tokens as the forward sees them fit ``max_tokens``: the sum
    of the rows' prompt + response tokens when packed, rows x the longest prompt + the longest
    response when padded. Rows are taken longest first (first-fit decreasing when packed, runs
    of similar lengths when padded), so few micro-batches run, and one long row never drags
    short ones to its width. A row longer than ``max_tokens`` raises ``ValueError`` naming
    ``field``."""
    n = batch["response_ids"].shape[0]
    if max_tokens is None:
        return _split(n, max(1, max_rows or n))
    plen, rlen = sequence_lengths(batch)
    cost = (plen + rlen).tolist()
    order = sorted(range(n), key=lambda i: (-cost[i], i))
    if order and cost[order[0]] > max_tokens:
        raise ValueError(
            f"{field}: a sequence of {cost[order[0]]} tokens (prompt + response) does not fit "
            f"the budget of {max_tokens} tokens; raise {field} to at least "
            "maxPromptLength + maxResponseLength"
        )
    bins: list[list[int]] = []
    if packing:  # first-fit decreasing by tokens
        room: list[int] = []
        for i in order:
            for b, free in enumerate(room):
                if cost[i] <= free and (max_rows is None or len(bins[b]) < max_rows):
                    bins[b].append(i)
                    room[b] -= cost[i]
                    break
            else:
                bins.append([i])
                room.append(max_tokens - cost[i])
    else:  # padded: each micro-batch costs rows x (longest prompt + longest response)
        pmax = rmax = 0
        for i in order:
            p, r = max(pmax, int(plen[i])), max(rmax, int(rlen[i]))
            full = max_rows is not None and bins and len(bins[-1]) >= max_rows
            if bins and not full and (len(bins[-1]) + 1) * (p + r) <= max_tokens:
                bins[-1].append(i)
                pmax, rmax = p, r
            else:
                bins.append([i])
                pmax, rmax = int(plen[i]), int(rlen[i])
    return [torch.tensor(sorted(b), dtype=torch.long) for b in bins]


def split_to_count(bins: Sequence[torch.Tensor], count: int) -> list[torch.Tensor]:
    """``bins`` split (the one with most rows in halves, repeatedly) until there are ``count``
    of them: FSDP's collectives need every worker of the group to run as many micro-batches.
    A half of a micro-batch within the token budget is within it too."""
    out = [b for b in bins]
    while len(out) < count:
        big = max(range(len(out)), key=lambda j: len(out[j]))
        if len(out[big]) < 2:
            raise ValueError(
                f"maxTokensPerMicroBatch: another data-parallel worker runs {count} "
                f"micro-batches but this one has only {sum(len(b) for b in bins)} samples"
            )
        rows = out.pop(big)
        out[big:big] = [rows[0::2], rows[1::2]]
    return out


def pack_rows(
    batch: Mapping[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``batch``'s sequences (each row's real prompt tokens, then its response tokens up to its
    length) concatenated into one row without padding.

    Returns ``input_ids`` [1, N] and ``position_ids`` [1, N] (restarting at 0 for every
    sequence: the Hugging Face attention takes that, with no attention mask, as packed
    sequences: a block-diagonal causal mask for eager/sdpa attention, varlen kernels for flash
    attention), then for each of the batch's response tokens, flattened: the packed position
    whose hidden state predicts it (``select``), and its row and column in ``[B, T]``."""
    prompt_ids, pmask = batch["prompt_ids"], batch["prompt_mask"].bool()
    resp = batch["response_ids"]
    _, rlen = sequence_lengths(batch)
    ids, pos, select, rows, cols = [], [], [], [], []
    offset = 0
    for i in range(resp.shape[0]):
        prompt = prompt_ids[i][pmask[i]]
        if prompt.numel() == 0:
            raise ValueError(f"packing: sample {i} has no prompt token")
        length = int(rlen[i])
        seq = torch.cat([prompt, resp[i, :length]])
        ids.append(seq)
        pos.append(torch.arange(seq.numel()))
        steps = torch.arange(length)
        select.append(offset + prompt.numel() - 1 + steps)
        rows.append(torch.full((length,), i, dtype=torch.long))
        cols.append(steps)
        offset += seq.numel()
    return (
        torch.cat(ids)[None],
        torch.cat(pos)[None],
        torch.cat(select),
        torch.cat(rows),
        torch.cat(cols),
    )


def unpack(flat: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, shape: Any) -> torch.Tensor:
    """Per-token values ``flat`` [n] put back at their ``(rows, cols)`` of a zero ``[B, T]``
    (differentiable)."""
    out = flat.new_zeros(tuple(shape))
    return out.index_put((rows, cols), flat)


def check_packing_support(model: nn.Module) -> None:
    """Packed sequences need a Hugging Face decoder whose attention mask comes from
    ``transformers.masking_utils`` (which reads restarting position ids as sequence
    boundaries); a model with its own mask code would attend across them."""
    import sys

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    module = sys.modules.get(type(decoder).__module__)
    if module is None or not hasattr(module, "create_causal_mask"):
        raise ValueError(
            f"packing: {type(decoder).__name__} builds its attention mask itself (not with "
            "transformers' create_causal_mask), so packed sequences would attend to each "
            "other; set packing: false for this model"
        )


# ---------------------------------------------------------------------------------------------
# Devices, precision and bounded memory
# ---------------------------------------------------------------------------------------------
LOGITS_CHUNK_TOKENS = 1024
"""Positions whose vocabulary logits exist at once in :func:`chunked_logprobs`."""


def to_device(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of ``batch`` on ``device``: the one place a micro-batch crosses from the CPU
    seam to the worker's device, so a loss never mixes devices."""
    nb = device.type == "cuda"
    return {k: v.to(device, non_blocking=nb) for k, v in batch.items()}


def trim_padding(batch: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """``batch`` padded to its own longest prompt and response, not the step's maximum.

    Drops the response columns after the last response token of any row (every ``[b, T]``
    tensor) and the prompt columns before the first prompt token of any row (prompts are
    left-padded). Returns the trimmed batch and the original response width ``T``.
    """
    width = batch["response_ids"].shape[1]
    keep = width
    mask = batch.get("response_mask")
    if mask is not None and width:
        used = mask.bool().any(0).nonzero()
        keep = int(used[-1]) + 1 if used.numel() else 1
    first = 0
    pmask = batch.get("prompt_mask")
    if pmask is not None and pmask.shape[1] > 1:
        used = pmask.bool().any(0).nonzero()
        first = min(int(used[0]) if used.numel() else 0, pmask.shape[1] - 1)
    out = {}
    for k, v in batch.items():
        if k in ("prompt_ids", "prompt_mask"):
            out[k] = v[:, first:]
        elif v.dim() >= 2 and v.shape[1] == width and keep < width:
            out[k] = v[:, :keep]
        else:
            out[k] = v
    return out, width


def _pad_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    if x.shape[1] >= width:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], width - x.shape[1], *x.shape[2:])], 1)


def scalar(x: Any) -> float:
    """A metric as a Python float (a sharded DTensor is gathered; a tensor on the ``meta``
    device, where only shapes exist, is NaN)."""
    if not isinstance(x, torch.Tensor):
        return float(x)
    if hasattr(x, "full_tensor"):
        x = x.full_tensor()
    if x.is_meta:
        return float("nan")
    return float(x.detach())


def _chunk_stats(
    head: nn.Module,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    want_entropy: bool,
    entropy_grad: bool,
    softcap: float | None,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if top_p < 1.0:  # the sampling distribution: the top-p nucleus, renormalised
        logp = sampling_logprobs(logits, tokens, temperature, top_p)
        logits = logits / temperature
        lse = torch.logsumexp(logits, dim=-1)
    else:
        logits = logits / temperature
        lse = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse
    if not want_entropy:
        return logp, logp.new_zeros(0)
    if entropy_grad:
        return logp, lse - (torch.softmax(logits, -1) * logits).sum(-1)
    with torch.no_grad():
        d = logits.detach()
        return logp, lse.detach() - (torch.softmax(d, -1) * d).sum(-1)


def chunked_logprobs(
    hidden: torch.Tensor,
    head: nn.Module,
    tokens: torch.Tensor,
    temperature: float,
    *,
    want_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_tokens: int = LOGITS_CHUNK_TOKENS,
    softcap: float | None = None,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``tokens`` [b, T] (and the entropy) from the last hidden states [b, T, H].

    The vocabulary projection ``head`` runs ``chunk_tokens`` positions at a time and each
    chunk's logits are reduced (float32 log-sum-exp, gather) before the next exists. With
    gradients and more than one chunk, each chunk is recomputed in backward
    (``torch.utils.checkpoint``) instead of keeping its logits: memory holds one chunk of
    ``[chunk_tokens, V]`` logits, never ``[b, T, V]``.
    """
    b, t, h = hidden.shape
    flat, toks = hidden.reshape(b * t, h), tokens.reshape(b * t)
    n = b * t
    recompute = torch.is_grad_enabled() and hidden.requires_grad and n > chunk_tokens
    lps, ents = [], []
    for s in range(0, max(n, 1), chunk_tokens):
        args = (
            head,
            flat[s : s + chunk_tokens],
            toks[s : s + chunk_tokens],
            temperature,
            want_entropy,
            entropy_grad,
            softcap,
            top_p,
        )
        if recompute:
            from torch.utils.checkpoint import checkpoint

            lp, ent = checkpoint(_chunk_stats, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(*args)
        lps.append(lp)
        ents.append(ent)
    # (fresh tensors, not views: an FSDP root's outputs carry its backward hooks)
    logp = torch.cat(lps).view(b, t).clone()
    return logp, (torch.cat(ents).view(b, t).clone() if want_entropy else None)


def shard_module(
    module: nn.Module,
    group: Any,
    device: torch.device,
    *,
    offload: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    """FSDP2 (``fully_shard``) over the data-parallel ``group``: each transformer block is one
    unit (gathered for its forward and backward, resharded after), the root holds the rest.
    Parameters, gradients and optimizer state then exist as 1/dp shards (``DTensor``).
    ``compute_dtype`` (other than the parameters'): units are gathered in it and gradients
    reduced in float32 (FSDP's mixed precision; no autocast, whose weight-cast cache would hold
    a whole unsharded copy). ``offload``: shards live in CPU memory, copied to the device per
    unit."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(group, device.type)
    kw: dict[str, Any] = {"mesh": mesh}
    if compute_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=compute_dtype, reduce_dtype=torch.float32
        )
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in transformer_blocks(module):
        fully_shard(block, **kw)
    fully_shard(module, **kw)
    return module


def activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward (non-reentrant checkpointing; the HF
    method's name in transformers >= 5, else its older one)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a HF model: the first ``ModuleList`` named ``layers``/``h``/
    ``blocks`` (Llama, Qwen, Mistral, GPT-2, ...), else none."""
    for name, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks"):
            return list(sub)
    return []


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` as whole CPU tensors (FSDP shards gathered: every worker of the
    group must call this, in the same order)."""
    out = {}
    for k, v in module.state_dict().items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        out[k] = v.detach().to("cpu")
    return out


def stream_state_dict(module: nn.Module, dtype: torch.dtype, max_bytes: int) -> WeightStream:
    """:func:`full_state_dict` cast to ``dtype`` (floating tensors), made one bucket of at
    most ``max_bytes`` at a time on the weights' own device: a shard is gathered
    (``full_tensor``) only when its bucket is asked for, and nothing is copied to the CPU.
    Every worker of an FSDP group must ask for every bucket, in order. The buckets are planned
    from the global shapes, so every worker plans the same ones."""
    state = module.state_dict()  # references to the parameters (or their shards): no copy

    def out_dtype(v: torch.Tensor) -> torch.dtype:
        return dtype if v.is_floating_point() else v.dtype

    plan = plan_buckets(
        ((k, v.numel() * out_dtype(v).itemsize) for k, v in state.items()), max_bytes
    )

    def produce(names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for k in names:
            v = state[k]
            if hasattr(v, "full_tensor"):
                v = v.full_tensor()
            out[k] = v.detach().to(dtype=out_dtype(v))
        return out

    return WeightStream(plan, produce)


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
    from ..algorithms import aggregation_count

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
            import torch.distributed as dist

            count = torch.tensor([len(rows)], dtype=torch.long)
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
            rows = split_to_count(rows, int(count))
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
        from ..algorithms.stats import all_reduce_sum

        return float(all_reduce_sum(torch.tensor([float(local)], dtype=torch.float64), self.group))

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

            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            flat /= self.dp_size
            offset = 0
            for p in self.params:
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
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


# ---------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------
class TorchGenerationEngine(GenerationEngine):
    """Batched sampling with the HF model's KV cache."""

    def __init__(
        self,
        model_dir: Path | str,
        dtype: str,
        stop_ids: Sequence[int],
        pad_id: int,
        device: str = "cpu",
        model: nn.Module | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.model = (model if model is not None else load_causal_lm(model_dir, dtype)).to(
            self.device
        )
        self.model.eval()
        self.model.requires_grad_(False)
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=self.device)
        self.pad_id = int(pad_id)
        # transformers renamed `past_key_values` to `cache`; use whichever this version takes.
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    @torch.no_grad()  # not inference_mode: the outputs feed autograd in the same process
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        version: int = 0,
        interrupt: Callable[[], tuple[int, Mapping[str, torch.Tensor]] | None] | None = None,
    ) -> Generation:
        """Sample (KV cache). Partial rollout: ``interrupt``, when given, is asked between two
        tokens for a weight update; one it returns, ``(new version, weights)``, is loaded at
        once and generation resumes with it: the prompts and the tokens so far are re-encoded
        with the new weights (a fresh KV cache), so every later token is sampled from the new
        policy, and ``versions`` records which version sampled which token."""
        from transformers import DynamicCache

        dev = self.device
        gen = torch.Generator(device=dev).manual_seed(int(seed))
        ids = prompt_ids.to(dev)
        bsz = ids.shape[0]
        padded = not bool(prompt_mask.all())
        attn = prompt_mask.to(dev).long() if padded else None
        pos = (attn.cumsum(-1) - 1).clamp_min(0) if padded else None
        next_pos = (
            pos[:, -1:] + 1
            if pos is not None
            else torch.full((bsz, 1), ids.shape[1], dtype=torch.long, device=dev)
        )
        cache = DynamicCache()
        out = self.model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kw: cache},
        )
        tokens = torch.full((bsz, max_new_tokens), self.pad_id, dtype=torch.long, device=dev)
        logps = torch.zeros(bsz, max_new_tokens, dtype=torch.float32, device=dev)
        mask = torch.zeros(bsz, max_new_tokens, dtype=torch.bool, device=dev)
        done = torch.zeros(bsz, dtype=torch.bool, device=dev)
        versions = torch.full((bsz, max_new_tokens), int(version), dtype=torch.int32)
        logits = out.logits[:, -1, :]
        greedy = temperature <= 0  # evaluation: the most likely token
        temperature = 1.0 if greedy else temperature
        for t in range(max_new_tokens):
            update = interrupt() if (interrupt is not None and t > 0) else None
            if update is not None:  # new weights mid-generation: re-encode, then go on
                version, weights = int(update[0]), update[1]
                self.update_weights(weights)
                cache = DynamicCache()
                full = torch.cat([ids, tokens[:, :t]], 1)
                full_attn = None if attn is None else attn  # already holds the t new columns
                full_pos = None if full_attn is None else (full_attn.cumsum(-1) - 1).clamp_min(0)
                out = self.model(
                    input_ids=full,
                    attention_mask=full_attn,
                    position_ids=full_pos,
                    use_cache=True,
                    logits_to_keep=1,
                    **{self.cache_kw: cache},
                )
                logits = out.logits[:, -1, :]
            versions[:, t] = int(version)
            if greedy:
                tok = logits.argmax(-1)
            else:
                probs = torch.softmax(logits.float() / temperature, dim=-1)
                if top_p < 1.0:
                    probs = top_p_filter(probs, top_p)
                tok = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            alive = ~done
            tok = torch.where(alive, tok, self.pad_id)
            tokens[:, t] = tok
            mask[:, t] = alive
            # the log-prob under the distribution sampled from (top-p truncated): pi_old's
            logp_tok = sampling_logprobs(logits, tok, temperature, top_p)
            logps[:, t] = torch.where(alive, logp_tok, 0.0)
            done = done | torch.isin(tok, self.stop_ids)
            if t == max_new_tokens - 1 or bool(done.all()):
                break
            if attn is not None:
                attn = torch.cat([attn, torch.ones(bsz, 1, dtype=attn.dtype, device=dev)], 1)
            out = self.model(
                input_ids=tok[:, None],
                attention_mask=attn,
                position_ids=next_pos,
                use_cache=True,
                **{self.cache_kw: cache},
            )
            next_pos = next_pos + 1
            logits = out.logits[:, -1, :]
        width = t + 1  # columns actually sampled: pad to the longest response, not the max
        return Generation(
            response_ids=tokens[:, :width].cpu(),
            response_mask=mask[:, :width].cpu(),
            logprobs=logps[:, :width].cpu(),
            lengths=mask.sum(1).cpu(),
            versions=versions[:, :width] if interrupt is not None else None,
        )

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Full weights (every name of the model's state dict), or LoRA adapters only
        (:data:`LORA_A` / :data:`LORA_B` pairs): then each adapted weight becomes its base value
        (kept from the first adapter update) plus ``B @ A``."""
        params = self.model.state_dict(keep_vars=True)
        if any(k.endswith((LORA_A, LORA_B)) for k in named_tensors):
            adapters = {k: v for k, v in named_tensors.items() if k.endswith((LORA_A, LORA_B))}
            self._apply_adapters(params, adapters)
            full = {k: v for k, v in named_tensors.items() if k not in adapters}
            unknown = sorted(set(full) - set(params))
            if unknown:  # (modulesToSave: whole weights next to the adapters)
                raise ValueError(f"update_weights: no weights {unknown[:5]}")
            with torch.no_grad():
                for name, value in full.items():
                    params[name].copy_(value)
            return
        missing = sorted(set(params) - set(named_tensors))
        if missing:
            raise ValueError(f"update_weights: weights missing for {missing[:5]}")
        with torch.no_grad():
            for name, dst in params.items():
                dst.copy_(named_tensors[name])

    def _apply_adapters(
        self, params: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor]
    ) -> None:
        base: dict[str, torch.Tensor] = self.__dict__.setdefault("_lora_base", {})
        modules = sorted({k.removesuffix(LORA_A).removesuffix(LORA_B) for k in adapters})
        with torch.no_grad():
            for module in modules:
                key = f"{module}.weight"
                a, b = adapters.get(module + LORA_A), adapters.get(module + LORA_B)
                if key not in params or a is None or b is None:
                    raise ValueError(f"update_weights: no weight {key!r} or half an adapter")
                dst = params[key]
                if key not in base:  # the base weight, before any adapter
                    base[key] = dst.detach().clone()
                delta = b.to(dst.device, torch.float32) @ a.to(dst.device, torch.float32)
                dst.copy_((base[key].float() + delta).to(dst.dtype))


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
class _OptimisedState:
    """Checkpoint state of a trainer is its model and optimizer (``self.opt``)."""

    opt: _Optimised

    def state_dict(self) -> dict[str, object]:
        return self.opt.state_dict()

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self.opt.load_state_dict(state)

    def save_checkpoint(self, directory: Path | str, shard: ShardIdentity) -> None:
        """Every worker of the role writes its own shard (torch.distributed.checkpoint)."""
        self.opt.save_checkpoint(directory)

    def load_checkpoint(self, directory: Path | str, shard: ShardIdentity) -> None:
        self.opt.load_checkpoint(directory)


class CausalLMLogprobs(nn.Module):
    """A causal LM that returns the log-probs (and entropy) of given response tokens.

    The decoder runs once; the vocabulary projection runs over :data:`LOGITS_CHUNK_TOKENS`
    positions at a time (:func:`chunked_logprobs`), so no [B, T, V] logits tensor exists.
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        self.softcap = getattr(lm.config, "final_logit_softcapping", None)

    def forward(
        self,
        inputs: Mapping[str, torch.Tensor | None],
        tokens: torch.Tensor,
        prompt_len: int,
        temperature: float,
        want_entropy: bool = False,
        entropy_grad: bool = False,
        chunk_tokens: int = 1024,
        top_p: float = 1.0,
        select: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``select`` (packed inputs, :func:`pack_rows`): the positions of the one packed row
        whose hidden states predict ``tokens`` [1, n]; else ``tokens`` [b, T] follow the
        ``prompt_len`` prompt columns."""
        hidden = self.lm.get_decoder()(**inputs, use_cache=False).last_hidden_state
        if select is not None:
            hidden = hidden[0, select][None]
        else:
            tlen = tokens.shape[1]
            hidden = hidden[:, prompt_len - 1 : prompt_len - 1 + tlen]
        return chunked_logprobs(
            hidden,
            self.lm.get_output_embeddings(),
            tokens,
            temperature,
            want_entropy=want_entropy,
            entropy_grad=entropy_grad,
            chunk_tokens=chunk_tokens,
            softcap=self.softcap,
            top_p=top_p,
        )


def _device_inputs(
    batch: Mapping[str, torch.Tensor], device: torch.device
) -> tuple[dict[str, torch.Tensor | None], int]:
    """Model inputs of a CPU batch (decided on the CPU: padding is data-dependent), moved."""
    ids, attn, pos, plen = full_inputs(batch)
    inputs = {"input_ids": ids, "attention_mask": attn, "position_ids": pos}
    nb = device.type == "cuda"
    return {
        k: None if v is None else v.to(device, non_blocking=nb) for k, v in inputs.items()
    }, plen


# ---------------------------------------------------------------------------------------------
# LoRA (PEFT)
# ---------------------------------------------------------------------------------------------
LORA_A, LORA_B = ".lora_A", ".lora_B"
"""Suffixes of the adapter tensors the weight sync sends: ``<module>.lora_A`` [r, in] and
``<module>.lora_B`` [out, r] already multiplied by alpha / r, so an engine adds ``B @ A`` to
``<module>.weight`` (HF names of the base model)."""


def apply_lora(lm: nn.Module, lora: LoraSpec) -> nn.Module:
    """``lm`` with PEFT LoRA adapters on ``lora.target_modules`` (every other weight frozen).
    A name that is no linear layer of ``lm`` raises one line naming the field."""
    from peft import LoraConfig, get_peft_model

    targets = list(lora.target_modules)
    linear = sorted(
        {n.rsplit(".", 1)[-1] for n, m in lm.named_modules() if isinstance(m, nn.Linear)}
        - {"lm_head"}
    )
    unknown = [t for t in targets if t != "all-linear" and t not in linear]
    if unknown:
        raise ValueError(
            f"spec.model.lora.targetModules: {unknown} are not linear layers of "
            f"{type(lm).__name__}; use some of {linear}, or all-linear"
        )
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        modules_to_save=list(lora.modules_to_save) or None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(lm, config)


def _saved_modules(peft_model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(HF name, trained copy) of each module trained in full (``modulesToSave``)."""
    for name, module in peft_model.named_modules():
        copies = getattr(module, "modules_to_save", None)
        if isinstance(copies, nn.ModuleDict) and "default" in copies:
            yield name.removeprefix("base_model.model."), copies["default"]


def _lora_layers(peft_model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(HF name of the base module, its LoRA layer) for each adapted layer."""
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            yield name.removeprefix("base_model.model."), module


def lora_adapter_tensors(peft_model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The adapters as the weight sync sends them (:data:`LORA_A`, :data:`LORA_B`), CPU
    tensors in ``dtype``."""
    out = {}
    for name, layer in _lora_layers(peft_model):
        a = layer.lora_A["default"].weight.detach()
        b = layer.lora_B["default"].weight.detach() * layer.scaling["default"]
        out[name + LORA_A] = a.to("cpu", dtype)
        out[name + LORA_B] = b.to("cpu", dtype)
    for name, module in _saved_modules(peft_model):  # modulesToSave: their full weights
        for key, value in module.state_dict().items():
            out[f"{name}.{key}"] = value.detach().to("cpu", dtype)
    return out


def merged_lora_weights(peft_model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The base model's HF state dict with every adapter merged in (``W + (alpha/r) B A``),
    CPU tensors in ``dtype`` (floating point ones): for engines that take full weights."""
    base = {}
    for k, v in peft_model.get_base_model().state_dict().items():
        if ".lora_" not in k and ".original_module." not in k:  # (modulesToSave: the copy)
            name = k.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
            base[name] = v.detach().to("cpu")
    for name, layer in _lora_layers(peft_model):
        a = layer.lora_A["default"].weight.detach().float().cpu()
        b = layer.lora_B["default"].weight.detach().float().cpu() * layer.scaling["default"]
        key = f"{name}.weight"
        base[key] = base[key].float() + b @ a
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in base.items()}


def _packed_device_inputs(
    batch: Mapping[str, torch.Tensor], device: torch.device
) -> tuple[dict[str, torch.Tensor | None], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed model inputs of a CPU batch (:func:`pack_rows`: no attention mask, position ids
    restarting per sequence) on ``device``; the selected positions there; rows and columns on
    the CPU."""
    ids, pos, select, rows, cols = pack_rows(batch)
    nb = device.type == "cuda"
    starts = torch.nonzero(pos[0] == 0).flatten()
    cu = torch.cat([starts, torch.tensor([pos.shape[1]])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    inputs: dict[str, Any] = {
        "input_ids": ids.to(device, non_blocking=nb),
        "attention_mask": None,
        "position_ids": pos.to(device, non_blocking=nb),
        # the sequences' boundaries, as flash-attention's varlen kernels and the CPU's
        # per-sequence attention (packed_attention) take them
        "cu_seq_lens_q": cu.to(device, non_blocking=nb),
        "cu_seq_lens_k": cu.to(device, non_blocking=nb),
        "max_length_q": longest,
        "max_length_k": longest,
    }
    return inputs, select.to(device, non_blocking=nb), rows, cols


class TorchPolicyTrainer(_OptimisedState, PolicyTrainer):
    """The actor: HF causal LM (float32 master weights, ``dtype`` compute), frozen reference
    copy in ``dtype`` when KL is on, AdamW; optionally FSDP2-sharded over the data-parallel
    group (``settings.sharding``)."""

    def __init__(
        self,
        model_dir: Path | str,
        dtype: str,
        settings: TrainingSettings,
        *,
        total_updates: int,
        temperature: float,
        top_p: float = 1.0,
        need_reference: bool,
        need_entropy: bool = True,
        entropy_grad: bool = False,
        group: Any | None = None,
        dp_size: int = 1,
        device: str = "cpu",
        offload_reference: bool = False,
        logits_chunk_tokens: int = LOGITS_CHUNK_TOKENS,
        lora: LoraSpec | None = None,
        sync_adapters: bool = True,
    ) -> None:
        """``need_entropy``: hand ``loss_fn`` the per-token entropy; ``entropy_grad``: with its
        graph (only when the loss uses it: an entropy coefficient > 0), else as a detached
        metric computed under ``no_grad`` (no [B, T, V] activations kept for backward).
        ``lora``: train adapters only (the reference is the base model with them disabled);
        ``sync_adapters``: :meth:`export_weights` gives only the adapters (engines that apply
        them), else the merged weights."""
        self.device = torch.device(device)
        self.model_dir = Path(model_dir)
        self.dtype = torch_dtype(dtype)
        self.settings = settings
        lm = load_causal_lm(model_dir, "float32")  # master weights in float32
        if settings.packing:
            check_packing_support(lm)
            use_packed_attention(lm)
        if settings.gradient_checkpointing:
            activation_checkpointing(lm)
        self.lora = lora
        self.sync_adapters = sync_adapters
        if lora is not None:
            lm = apply_lora(lm, lora)
        self.model = CausalLMLogprobs(lm)
        self.opt = _Optimised(
            self.model,
            settings,
            total_updates,
            group,
            dp_size,
            device=self.device,
            compute_dtype=self.dtype,
        )
        self.model.train()
        self.reference: nn.Module | None = None
        self.reference_device = self.device
        if need_reference and lora is None:  # with LoRA: the base model, adapters disabled
            ref_lm = load_causal_lm(model_dir, dtype)
            if settings.packing:
                use_packed_attention(ref_lm)
            ref = CausalLMLogprobs(ref_lm).eval()
            ref.requires_grad_(False)
            offload = offload_reference and self.device.type != "cpu"
            if self.opt.sharded:
                ref = shard_module(ref, group, self.device, offload=offload)
            elif offload:  # kept on the CPU, brought to the device for its forwards
                self.reference_device = torch.device("cpu")
            else:
                ref = ref.to(self.device)
            self.reference = ref
        self.temperature = temperature
        self.top_p = top_p  # pi_old and pi_theta are the top-p truncated sampling distribution
        self.need_entropy = need_entropy
        self.entropy_grad = entropy_grad
        self.chunk_tokens = int(logits_chunk_tokens)

    @property
    def lm(self) -> nn.Module:
        """The Hugging Face model being trained."""
        return self.model.lm

    @torch.no_grad()
    def logprobs(
        self, batch: Mapping[str, torch.Tensor], *, reference: bool = False
    ) -> torch.Tensor:
        base = reference and self.lora is not None
        model = self.model if base or not reference else self.reference
        if model is None:
            raise ValueError("logprobs(reference=True) needs a reference model (KL is off)")
        moved = reference and not base and self.reference_device != self.device
        if moved:
            model.to(self.device)
        adapters_off = self.lm.disable_adapter() if base else nullcontext()
        try:
            # old/ref log-probs without dropout; training: train mode
            with _eval_mode(model), adapters_off:
                return self.opt.forward_chunks(batch, lambda mb: self._logp(model, mb)[0])
        finally:
            if moved:
                model.to(self.reference_device)

    def _logp(
        self, model: nn.Module, micro: Mapping[str, torch.Tensor], *, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        kw = dict(
            want_entropy=entropy,
            entropy_grad=self.entropy_grad,
            chunk_tokens=self.chunk_tokens,
            top_p=self.top_p,
        )
        if self.settings.packing:
            inputs, select, rows, cols = _packed_device_inputs(micro, self.device)
            tokens = micro["response_ids"][rows, cols][None].to(self.device)
            with self.opt.autocast():
                logp, ent = model(inputs, tokens, 0, self.temperature, select=select, **kw)
            shape = micro["response_ids"].shape
            rows, cols = rows.to(self.device), cols.to(self.device)
            return unpack(logp[0], rows, cols, shape), (
                None if ent is None else unpack(ent[0], rows, cols, shape)
            )
        inputs, plen = _device_inputs(micro, self.device)
        tokens = micro["response_ids"].to(self.device)
        with self.opt.autocast():
            return model(inputs, tokens, plen, self.temperature, **kw)

    def update(
        self,
        minibatch: Mapping[str, torch.Tensor],
        loss_fn: PolicyLossFn,
        micro_batch_size: int,
        agg: str = "token-mean",
    ) -> dict[str, float]:
        def micro_loss(micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
            logp, ent = self._logp(self.model, micro, entropy=self.need_entropy)
            return loss_fn(logp, ent, to_device(micro, self.device))

        return self.opt.accumulate(minibatch, micro_batch_size, agg, micro_loss)

    export_is_collective = property(lambda self: self.opt.sharded)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """HF-named CPU tensors in the compute dtype (float32 masters cast once here). Under
        FSDP every worker of the group must call it (the shards are gathered). With LoRA: the
        adapters only (:func:`lora_adapter_tensors`), or the merged weights for engines that
        take full weights."""
        if self.lora is not None:
            if self.sync_adapters:
                return lora_adapter_tensors(self.lm, self.dtype)
            return merged_lora_weights(self.lm, self.dtype)
        return {
            k: v.to(dtype=self.dtype) if v.is_floating_point() else v
            for k, v in full_state_dict(self.lm).items()
        }

    def export_weight_stream(self, max_bytes: int) -> WeightStream:
        """:meth:`export_weights` in buckets of at most ``max_bytes``, each gathered when asked
        for, on the weights' device (:func:`stream_state_dict`); with LoRA, the same tensors
        as :meth:`export_weights` (adapters, or merged weights) planned into buckets."""
        if self.lora is not None:
            return WeightStream.of(self.export_weights(), max_bytes)
        return stream_state_dict(self.lm, self.dtype, max_bytes)

    def export_pretrained(self, directory: Path | str, shard: ShardIdentity) -> None:
        """``save_pretrained`` of the policy (in ``model.dtype``) and its tokenizer. With LoRA:
        the PEFT adapter (and, with ``exportMerged``, the merged model under ``merged/``)."""
        if self.lora is not None:
            if shard.is_dp_leader:
                self._export_lora(Path(directory))
            return
        weights = self.export_weights()  # collective under FSDP
        if shard.is_dp_leader:
            save_pretrained(self.lm, weights, directory, self.model_dir)

    def _export_lora(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.lm.save_pretrained(str(out))  # adapter_config.json + adapter_model.safetensors
        with suppress(OSError, ValueError):  # a model directory without a tokenizer
            load_tokenizer(self.model_dir).save_pretrained(str(out))
        if self.lora is not None and self.lora.export_merged:
            plain = load_causal_lm(self.model_dir, "float32")
            save_pretrained(
                plain, merged_lora_weights(self.lm, self.dtype), out / "merged", self.model_dir
            )


class TorchValueTrainer(_OptimisedState, ValueTrainer):
    """The critic: HF backbone with a scalar value head (float32 master weights, ``dtype``
    compute), AdamW; optionally FSDP2-sharded like the actor."""

    def __init__(
        self,
        model_dir: Path | str,
        dtype: str,
        settings: TrainingSettings,
        *,
        total_updates: int,
        seed: int,
        group: Any | None = None,
        dp_size: int = 1,
        device: str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.model_dir = Path(model_dir)
        self.dtype = torch_dtype(dtype)
        self.settings = settings
        self.model = load_value_model(model_dir, "float32", seed=seed)
        if settings.packing:
            check_packing_support(self.model.backbone)
            use_packed_attention(self.model.backbone)
        if settings.gradient_checkpointing:
            activation_checkpointing(self.model.backbone)
        self.opt = _Optimised(
            self.model,
            settings,
            total_updates,
            group,
            dp_size,
            device=self.device,
            compute_dtype=self.dtype,
        )
        self.model.train()

    def _forward(self, micro: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if self.settings.packing:
            inputs, select, rows, cols = _packed_device_inputs(micro, self.device)
            with self.opt.autocast():
                values = self.model(**inputs)
            return unpack(
                values[0, select].float(),
                rows.to(self.device),
                cols.to(self.device),
                micro["response_ids"].shape,
            )
        inputs, plen = _device_inputs(micro, self.device)
        tlen = micro["response_ids"].shape[1]
        with self.opt.autocast():
            values = self.model(**inputs)
        return values[:, plen - 1 : plen - 1 + tlen].float()

    @torch.no_grad()
    def values(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        with _eval_mode(self.model):  # values for the advantages without dropout
            return self.opt.forward_chunks(batch, self._forward)

    def update(
        self,
        minibatch: Mapping[str, torch.Tensor],
        loss_fn: ValueLossFn,
        micro_batch_size: int,
        agg: str = "token-mean",
    ) -> dict[str, float]:
        def micro_loss(micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
            return loss_fn(self._forward(micro), to_device(micro, self.device))

        return self.opt.accumulate(minibatch, micro_batch_size, agg, micro_loss)

    def export_pretrained(self, directory: Path | str, shard: ShardIdentity) -> None:
        """The backbone with ``save_pretrained`` plus ``value_head.safetensors`` (and the
        tokenizer); :func:`ppojob_trainer.models.load_value_model` loads both back."""
        full = full_state_dict(self.model)  # collective under FSDP
        if not shard.is_dp_leader:
            return
        backbone = {
            k.removeprefix("backbone."): v for k, v in full.items() if k.startswith("backbone.")
        }
        save_pretrained(self.model.backbone, backbone, directory, self.model_dir)
        from safetensors.torch import save_file

        head = {
            k.removeprefix("value_head."): v.contiguous()
            for k, v in full.items()
            if k.startswith("value_head.")
        }
        save_file(head, str(Path(directory) / VALUE_HEAD_FILE))


def save_pretrained(
    model: nn.Module,
    weights: Mapping[str, torch.Tensor],
    directory: Path | str,
    tokenizer_dir: Path | str | None,
) -> None:
    """``model.save_pretrained`` with the given (gathered) weights, and the tokenizer saved
    with ``tokenizer_dir``'s model if it has one."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    dtypes = {v.dtype for v in weights.values() if v.is_floating_point()}
    if len(dtypes) == 1:
        model.config.dtype = next(iter(dtypes))
    save_pretrained_here(model, out, state_dict=dict(weights))
    if tokenizer_dir is not None:
        try:
            tok = load_tokenizer(tokenizer_dir)
        except (OSError, ValueError):  # a model directory without a tokenizer
            return
        tok.save_pretrained(str(out))


__all__ = [
    "CausalLMLogprobs",
    "TorchGenerationEngine",
    "TorchPolicyTrainer",
    "TorchValueTrainer",
    "accumulation_weights",
    "chunked_logprobs",
    "entropy",
    "full_inputs",
    "lr_factor",
    "save_pretrained",
    "shard_module",
    "to_device",
    "token_logprobs",
    "top_p_filter",
    "trim_padding",
]


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
