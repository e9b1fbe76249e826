"""Mixture-of-experts routing of Hugging Face models: record the experts each token was routed
to, and replay recorded routing in another forward pass (``algorithm.routingReplay: rollout``).

A routed-experts tensor is ``[..., layers, k]`` int16: for every token and decoder layer the
``k`` expert indices its router chose (the layout of SGLang's ``return_routed_experts``:
``[tokens, num_hidden_layers, top_k]``). ``-1`` marks "no record": a dense layer, a position the
engine never fed (the last sampled token) or padding; there the router chooses for itself.

Routers are found by class (:data:`ROUTER_CLASSES`: transformers' ``Qwen3MoeTopKRouter`` and
``MixtralTopKRouter``, which return ``(router_logits, top_k_weights, top_k_index)`` over the
block's flattened tokens). A forward hook reads the router's own choice and, when replaying,
returns the recorded indices with their weights recomputed from this forward's router logits
(softmax, the recorded experts' probabilities, renormalised as the router does), so the router
still receives gradients through the weights of the experts it is forced to use.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

ROUTER_CLASSES = (
    ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter"),
    ("transformers.models.mixtral.modeling_mixtral", "MixtralTopKRouter"),
)
"""The routers routing replay knows: their forward returns ``(router_logits, top_k_weights,
top_k_index)``; Qwen3-MoE renormalises the top-k weights when ``norm_topk_prob`` is set,
Mixtral always."""

NO_EXPERT = -1
EXPERT_DTYPE = torch.int16
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _router_types() -> tuple[type, ...]:
    import importlib

    found = []
    for module, name in ROUTER_CLASSES:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # an older transformers without it
            continue
    return tuple(found)


def moe_routers(model: nn.Module) -> dict[int, nn.Module]:
    """The routers of ``model`` by decoder layer index (from the module's name,
    ``...layers.<i>.mlp.gate``); empty for a dense model."""
    types = _router_types()
    out: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        if types and isinstance(module, types):
            match = _LAYER.search(name)
            if match is None:
                raise ValueError(f"routing: router {name!r} is not inside a numbered layer")
            out[int(match.group(1))] = module
    return out


def num_layers(model: nn.Module) -> int:
    """The decoder layers of ``model`` (the layer axis of a routed-experts tensor)."""
    config = getattr(model, "config", None)
    n = getattr(config, "num_hidden_layers", None)
    if n is None:
        routers = moe_routers(model)
        return max(routers) + 1 if routers else 0
    return int(n)


def top_k(model: nn.Module) -> int:
    """Experts per token of ``model``'s routers (0 for a dense model)."""
    routers = moe_routers(model)
    return int(next(iter(routers.values())).top_k) if routers else 0


class RouterTap:
    """Forward hooks on every router of a model: :attr:`forced` (a ``[N, layers, k]`` tensor
    in the decoder's flattened token order, or None) replaces the routers' choice where it
    holds no ``-1``; with :attr:`recording` on, :attr:`chosen` (the router's own choice) and
    :attr:`used` (the experts the forward used) receive each layer's ``[N, k]``.

    The hooks stay installed; :attr:`forced` stays set until replaced, so activation
    checkpointing's recomputation in the backward pass replays the same routing."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(
                f"routing: {type(model).__name__} has no mixture-of-experts router "
                f"routing replay knows ({', '.join(n for _, n in ROUTER_CLASSES)})"
            )
        self.layers = num_layers(model)
        self.k = top_k(model)
        self.forced: torch.Tensor | None = None
        self.recording = False
        self.chosen: dict[int, torch.Tensor] = {}
        self.used: dict[int, torch.Tensor] = {}
        self.handles = [
            router.register_forward_hook(self._hook(layer))
            for layer, router in self.routers.items()
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _hook(self, layer: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            logits, scores, index = output
            replaced = None
            if self.forced is not None:
                replaced = replay_choice(module, logits, scores, index, self.forced[:, layer])
            if self.recording:
                self.chosen[layer] = index.detach()
                self.used[layer] = (index if replaced is None else replaced[2]).detach()
            return replaced

        return hook

    @contextmanager
    def record(self) -> Iterator[None]:
        """Record :attr:`chosen` and :attr:`used` for the forwards inside the block."""
        self.chosen, self.used, self.recording = {}, {}, True
        try:
            yield
        finally:
            self.recording = False

    def stacked(self, which: dict[int, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """One recorded forward's ``which`` (:attr:`chosen` or :attr:`used`) as a
        ``[*shape, layers, k]`` int16 tensor on the CPU (``shape``: the tokens' batch shape,
        e.g. ``(B, S)``), ``-1`` on the layers without a router."""
        n = 1
        for s in shape:
            n *= s
        out = torch.full((n, self.layers, self.k), NO_EXPERT, dtype=EXPERT_DTYPE)
        for layer, index in which.items():
            out[:, layer] = index.reshape(n, self.k).to("cpu", EXPERT_DTYPE)
        return out.reshape(*shape, self.layers, self.k)


def replay_choice(
    router: nn.Module,
    logits: torch.Tensor,
    scores: torch.Tensor,
    index: torch.Tensor,
    forced: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's output with the experts of ``forced`` ``[N, k]`` (rows holding a ``-1``
    keep the router's own choice): each forced expert weighted by its probability under this
    forward's ``logits`` (differentiable), renormalised over the k as the router does."""
    if forced.shape != index.shape:
        raise ValueError(
            f"routing replay: the recorded routing has shape {tuple(forced.shape)}, the "
            f"router chose {tuple(index.shape)} (tokens x top-k): the rollout's tokens are "
            "not the ones this forward sees"
        )
    forced = forced.to(index.device, torch.long)
    probs = torch.softmax(logits.float(), dim=-1)
    weights = probs.gather(-1, forced.clamp_min(0))
    if getattr(router, "norm_topk_prob", True):  # Mixtral always renormalises
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights.to(scores.dtype)
    known = (forced >= 0).all(-1, keepdim=True)
    return (
        logits,
        torch.where(known, weights, scores),
        torch.where(known, forced, index.long()).to(index.dtype),
    )


def agreement(
    recorded: torch.Tensor, chosen: torch.Tensor, valid: torch.Tensor
) -> tuple[float, float]:
    """(token-layer choices whose expert sets are equal, choices compared) between ``recorded``
    and ``chosen`` (both ``[..., layers, k]``), over the positions ``valid`` (``[...]`` bool)
    and the layers both hold (no ``-1``)."""
    a = recorded.long().sort(-1).values
    b = chosen.long().sort(-1).values
    both = (a >= 0).all(-1) & (b >= 0).all(-1) & valid.unsqueeze(-1)
    same = (a == b).all(-1) & both
    return float(same.sum()), float(both.sum())


# -- the router load-balancing loss (algorithm.routerAuxLossCoefficient) -----------------------


def balance_terms(
    probs: torch.Tensor, chosen: torch.Tensor, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One router's load-balancing statistics over the tokens ``valid`` (``[N]`` bool, None:
    all): the choices each expert received (``chosen`` ``[N, k]``, the router's own top-k; no
    gradient), each expert's summed probability (``probs`` ``[N, E]``, float32, with its
    gradient) and the number of tokens, as float32 tensors ``[E]``, ``[E]``, ``[]`` on
    ``probs``' device (masked sums: no device sync)."""
    experts = probs.shape[-1]
    picks = torch.nn.functional.one_hot(chosen.long(), experts).sum(-2).float()  # [N, E]
    if valid is None:
        return picks.sum(0), probs.float().sum(0), probs.new_tensor(float(probs.shape[0]))
    mask = valid.reshape(-1, 1).to(probs.device, torch.float32)
    return (picks * mask).sum(0), (probs.float() * mask).sum(0), mask.sum()


def balance_loss(
    counts: torch.Tensor, prob_sums: torch.Tensor, tokens: torch.Tensor, k: int
) -> torch.Tensor:
    """The Switch Transformer load-balancing loss of one MoE layer (Fedus et al. 2021, eq. 4,
    for top-k routing): ``E * sum_e f_e * P_e``, with ``f_e`` the share of the tokens' ``k``
    choices that went to expert ``e`` and ``P_e`` its mean router probability (from
    :func:`balance_terms`). 1.0 when the routing is uniform, up to ``E / k`` when every token
    goes to the same experts; its gradient reaches the router through ``P`` only. No tokens:
    0."""
    n = tokens.clamp_min(1.0)
    return counts.shape[0] * ((counts / (n * k)) * (prob_sums / n)).sum()


class BalanceTap:
    """Forward hooks on every router of a HF model that, inside :meth:`collect`, keep each
    layer's router logits; :meth:`loss` is the mean over the layers of their
    :func:`balance_loss` (the router's own top-k, its softmax, the tokens marked valid). The
    hooks only keep a reference (no operation of theirs is recorded), so activation
    checkpointing's recomputation, which runs them again outside :meth:`collect`, saves what
    the first forward saved; the loss is computed after the forward, outside the checkpointed
    blocks, and its gradient reaches the routers through the kept logits."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(
                f"routerAuxLossCoefficient: {type(model).__name__} has no mixture-of-experts "
                f"router ({', '.join(n for _, n in ROUTER_CLASSES)})"
            )
        self.k = top_k(model)
        self.valid: torch.Tensor | None = None
        self.active = False
        self.logits: dict[int, torch.Tensor] = {}
        self.handles = [
            router.register_forward_hook(self._hook(layer))
            for layer, router in self.routers.items()
        ]

    def _hook(self, layer: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.active and torch.is_grad_enabled():
                self.logits[layer] = output[0]

        return hook

    @contextmanager
    def collect(self, valid: torch.Tensor | None) -> Iterator[None]:
        """Keep the routers' logits of the forwards inside the block, for a loss over the
        tokens ``valid`` (in the decoder's flattened order; None: all)."""
        self.logits, self.valid, self.active = {}, valid, True
        try:
            yield
        finally:
            self.active = False

    def loss(self) -> torch.Tensor:
        """The mean over the layers of the last collected forward's load-balancing losses
        (the kept logits are let go)."""
        if not self.logits:
            raise RuntimeError("routerAuxLossCoefficient: no router ran in the forward pass")
        losses = []
        for logits in self.logits.values():
            probs = torch.softmax(logits.float(), dim=-1)
            chosen = probs.detach().topk(self.k, dim=-1).indices
            losses.append(balance_loss(*balance_terms(probs, chosen, self.valid), self.k))
        self.logits = {}
        return torch.stack(losses).mean()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
