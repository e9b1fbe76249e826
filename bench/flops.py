"""FLOPs a decoder-only transformer (Llama/Qwen family) executes, for the benches' MFU figures.

Counted (a multiply-add is 2 FLOPs):

* every linear layer of every block (q, k, v, o projections; gate, up, down of the MLP) on every
  position the model processes, padding included (a micro-batch is processed at its padded width);
* attention: ``Q K^T`` and ``softmax x V`` per query head, for the causal pairs only (position
  ``i`` with itself and every position before it: ``s (s + 1) / 2`` pairs per sequence of ``s``
  positions), the work a causal model needs; a kernel that computes the full square (a masked
  SDPA, eager attention) does more, which is not counted (``causal=False`` counts the square);
* the head only on the positions whose output is computed: the LM head on the response positions
  (the torch and megatron backends project only those), a value head (``hidden -> 1``) on every
  position.

Not counted: the embedding lookup (a gather, no FLOPs), norms, activations, softmax, rotary
embeddings, bias adds and the loss (elementwise, O(hidden) per position), and recomputation
(gradient checkpointing, the LM head chunks recomputed in backward): MFU counts the model's
FLOPs, not the hardware's. An update (forward + backward) is 3x the forward: the backward of a
matmul computes the input's gradient and the weight's, each as costly as the forward.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Micro:
    """One forward call's shape: ``rows`` sequences of ``seq`` positions (padded), of which
    ``head_positions`` per row go through the LM head."""

    rows: int
    seq: int
    head_positions: int


def forward_flops(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    micro: Micro,
    *,
    head: str = "lm",
    causal: bool = True,
) -> int:
    """FLOPs of one forward of ``micro`` (see the module docstring). ``head``: ``"lm"`` (the
    vocabulary projection on ``micro.head_positions`` per row), ``"value"`` (hidden -> 1 on every
    position) or ``"none"``."""
    if head not in ("lm", "value", "none"):
        raise ValueError(f"forward_flops: head must be 'lm', 'value' or 'none', got {head!r}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(
            f"forward_flops: hidden ({hidden}) must divide into heads ({heads}) and heads into "
            f"kv_heads ({kv_heads})"
        )
    kv = kv_heads * (hidden // heads)
    tokens = micro.rows * micro.seq
    per_token_linear = 2 * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * intermediate)
    pairs = micro.seq * (micro.seq + 1) // 2 if causal else micro.seq * micro.seq
    attention = 2 * 2 * hidden * pairs * micro.rows  # Q K^T and P V over all query heads
    flops = layers * (tokens * per_token_linear + attention)
    if head == "lm":
        flops += 2 * hidden * vocab * micro.rows * micro.head_positions
    elif head == "value":
        flops += 2 * hidden * tokens
    return flops


def total_flops(shape: dict[str, int], micros: Iterable[Micro], *, train: bool, **kw: str) -> int:
    """Sum of :func:`forward_flops` over ``micros`` (``shape``: the HF config names
    ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
    ``intermediate_size``, ``vocab_size``); x3 when ``train`` (forward + backward)."""
    args = (
        shape["hidden_size"],
        shape["num_hidden_layers"],
        shape["num_attention_heads"],
        shape.get("num_key_value_heads") or shape["num_attention_heads"],
        shape["intermediate_size"],
        shape["vocab_size"],
    )
    fwd = sum(forward_flops(*args, m, **kw) for m in micros)  # type: ignore[arg-type]
    return 3 * fwd if train else fwd


def micro_batches(prompt_mask, response_mask, size: int) -> list[Micro]:  # type: ignore[no-untyped-def]
    """The micro-batches the torch backend runs over a batch, ``size`` rows at a time: each is
    trimmed to its own longest prompt (left padding) and response (right padding), as
    ``torch_backend.memory.trim_padding`` does. ``prompt_mask``/``response_mask``: [B, P] / [B, T]
    boolean tensors."""
    out = []
    n = int(response_mask.shape[0])
    for lo in range(0, n, max(1, size)):
        pm, rm = prompt_mask[lo : lo + size].bool(), response_mask[lo : lo + size].bool()
        used_r = rm.any(0).nonzero()
        r_w = int(used_r[-1]) + 1 if used_r.numel() else 1
        used_p = pm.any(0).nonzero()
        first = min(int(used_p[0]) if used_p.numel() else 0, pm.shape[1] - 1)
        p_w = pm.shape[1] - first
        out.append(Micro(rows=int(rm.shape[0]), seq=p_w + r_w, head_positions=r_w))
    return out


def uniform(rows: int, prompt: int, response: int, size: int) -> Sequence[Micro]:
    """Micro-batches of ``size`` rows of a batch with no padding (every prompt ``prompt`` and
    every response ``response`` long)."""
    return [
        Micro(rows=min(size, rows - lo), seq=prompt + response, head_positions=response)
        for lo in range(0, rows, max(1, size))
    ]
