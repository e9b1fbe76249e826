"""Log-probs and entropy from vocabulary-parallel logits, ``LOGITS_CHUNK_TOKENS`` positions at a
time, each chunk recomputed in backward (:func:`chunked_vocab_stats`); the model ends at its final
hidden states (:func:`emit_hidden_states`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

LOGITS_CHUNK_TOKENS = 1024
"""Positions whose vocabulary-parallel logits exist at once (:func:`chunked_vocab_stats`): a
[1024, V/tp] float32 chunk, not the micro-batch's [b, L, V/tp] logits and their gradient (the
torch backend's chunk, and the one ``memory_plan`` counts for every backend)."""


def _select(output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of ``output`` [b, L, ...] at positions ``index`` [b, T]."""
    idx = index.view(*index.shape, *([1] * (output.dim() - 2))).expand(
        *index.shape, *output.shape[2:]
    )
    return output.gather(1, idx)


def _at_index(output: torch.Tensor, mb: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``output`` [b, L, ...] (or [1, N, ...] for a packed row) at the micro-batch's
    ``_index`` [b, T]: [b, T, ...]."""
    if "_pos" in mb:
        return output[0][mb["_index"]]
    return _select(output, mb["_index"])


def vocab_parallel_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] with ``logits`` split over the tensor-parallel vocabulary."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # megatron-core's cross entropy overwrites its input (max subtracted, exponentiated in
    # place): hand it a copy so the caller's logits (entropy) stay intact.
    x = logits.clone() if logits.dtype == torch.float32 else logits.float()
    return -vocab_parallel_cross_entropy(x, tokens)


def vocab_parallel_entropy(logits: torch.Tensor, *, grad: bool) -> torch.Tensor:
    """Entropy of softmax(logits) per position, ``logits`` split over the vocabulary.

    Over tensor-parallel ranks from three all-reduced per-position numbers (the max m, the
    sums z of exp(x - m) and s of exp(x - m) * (m - x); H = log z + s / z, a sum of two
    non-negative terms), never the gathered vocabulary. With ``grad`` the sums go through
    ``reduce_from_tensor_model_parallel_region`` (backward: the identity, each rank's gradient
    flowing to its own slice); the max is a constant shift (H does not depend on it), so it
    carries no gradient."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        logp = torch.log_softmax(logits.float(), -1)
        return -(logp.exp() * logp).sum(-1)
    import torch.distributed as dist

    from ..algorithms import collectives

    group = ps.get_tensor_model_parallel_group()
    x = logits.float() if grad else logits.detach().float()
    m = collectives.to_group(x.detach().max(-1).values, group)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    m = m.to(x.device)
    d = m[..., None] - x  # >= 0 on every rank
    e = (-d).exp()
    z, sd = e.sum(-1), (e * d).sum(-1)
    if grad:
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

        z = reduce_from_tensor_model_parallel_region(z)
        sd = reduce_from_tensor_model_parallel_region(sd)
    else:
        z, sd = collectives.to_group(z, group), collectives.to_group(sd, group)
        dist.all_reduce(z, group=group)
        dist.all_reduce(sd, group=group)
    return z.log() + sd / z


def _vocab_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """[n, V/tp] float32 logits of hidden states [n, h] over this rank's vocabulary slice
    ``weight`` [V/tp, h], divided by the sampling temperature in float32 (in bf16 the quotient
    would lose all but 8 mantissa bits)."""
    return torch.nn.functional.linear(hidden, weight).float() / temperature


def _chunk_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    entropy: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = _vocab_logits(hidden, weight, temperature)
    logp = vocab_parallel_logprobs(logits, tokens)
    if entropy is None:
        return logp, logp.new_zeros(0)
    if entropy == "grad":
        return logp, vocab_parallel_entropy(logits, grad=True)
    with torch.no_grad():
        return logp, vocab_parallel_entropy(logits, grad=False)


def chunked_vocab_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    *,
    entropy: str | None = None,
    chunk_tokens: int = LOGITS_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``tokens`` [b, T] (and with ``entropy`` "grad" or "nograd" the entropy)
    from the final hidden states [b, T, h] and this rank's vocabulary slice ``weight``.

    The projection runs ``chunk_tokens`` positions at a time and each chunk's [chunk, V/tp]
    logits are reduced (megatron-core's vocabulary-parallel cross entropy, the entropy's sums)
    before the next chunk's exist. With gradients each chunk is recomputed in backward
    (``torch.utils.checkpoint``) instead of keeping its logits. Every tensor-parallel rank
    holds the same hidden states, so every rank runs the same chunks and the same collectives
    in the same order, forward and in the recomputation.
    """
    b, t, h = hidden.shape
    n = b * t
    flat, toks = hidden.reshape(n, h), tokens.reshape(n)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    recompute = grad and n > chunk_tokens  # one chunk: nothing to free between chunks
    lps, ents = [], []
    for s in range(0, max(n, 1), chunk_tokens):
        args = (flat[s : s + chunk_tokens], weight, toks[s : s + chunk_tokens], temperature)
        if recompute:
            from torch.utils.checkpoint import checkpoint

            lp, ent = checkpoint(_chunk_stats, *args, entropy, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(*args, entropy)
        lps.append(lp)
        ents.append(ent)
    logp = torch.cat(lps).view(b, t)
    return logp, (torch.cat(ents).view(b, t) if entropy is not None else None)


def emit_hidden_states(model: Any) -> None:
    """Make the last stage of the GPT model ``model`` return its final hidden states [b, L, h]
    instead of the vocabulary-parallel logits [b, L, V/tp] (:func:`chunked_vocab_stats` projects
    them a chunk at a time).

    ``GPTModel._postprocess`` calls ``output_layer(hidden [L, b, h], weight=<the embedding's
    weight when tied>)`` and returns its first output transposed to [b, L, ...]; the output
    layer (a ``ColumnParallelLinear``, its weight split over the vocabulary) is replaced by
    what it does to its input before the matmul: the all-gather over the sequence under
    sequence parallelism (backward: the reduce-scatter that sums the ranks' partial input
    gradients), else the identity whose backward all-reduces them over tensor-parallel ranks
    (:class:`_SumGradOverRanks`).
    Its weight stays where it is (``output_weight``), as do its state-dict keys."""
    if not getattr(model, "post_process", False):
        return
    layer = model.output_layer

    def forward(input_: torch.Tensor, weight: Any = None, **_: Any) -> tuple[torch.Tensor, None]:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        if layer.sequence_parallel:
            return gather_from_sequence_parallel_region(input_, group=layer.tp_group), None
        if layer.disable_grad_reduce or layer.tp_group.size() == 1:
            return input_, None
        return _SumGradOverRanks.apply(input_, layer.tp_group), None

    layer.forward = forward


class _SumGradOverRanks(torch.autograd.Function):
    """The identity; backward: the gradient all-reduced over ``group``. (megatron-core's
    ``copy_to_tensor_model_parallel_region`` all-reduces ``grad.contiguous()`` and returns the
    gradient it was given: a non-contiguous gradient, as the transpose after the output layer
    hands back, would come back unreduced.)"""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        from ..algorithms import collectives

        out = collectives.to_group(grad.contiguous(), ctx.group)
        dist.all_reduce(out, group=ctx.group)
        return out.to(grad.device), None


def output_weight(model: Any) -> torch.Tensor:
    """The vocabulary-parallel projection [V/tp, h] of a last stage: the output layer's weight,
    or the input embedding's where they are tied and this stage holds it (what ``GPTModel``
    passes its output layer)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight
