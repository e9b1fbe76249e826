"""Routing replay on the megatron backend (``algorithm.routingReplay: rollout``).

megatron-core 0.16.1's ``TopKRouter`` takes its top-k through ``self.router_replay`` when that
is set (``topk_routing_with_score_function(..., router_replay=...)`` calls its
``get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)``). Its own
``RouterReplay`` replays whole index tensors through a process-wide list of every router (a
colocated critic's and the reference model's included) and has no "no record" entries; here
:class:`ReplayTopK` is installed on each router of one model instead. It computes the router's
own choice, keeps it when recording (the agreement metric), and returns the recorded experts
where a token has them (``-1`` elsewhere: the router's own), with the router's scores of those
experts: megatron-core then takes their softmax (top-k renormalised) or, with
``moe_router_pre_softmax``, their probabilities, as the HF models' routers and the torch
backend's replay (:func:`~.torch_backend.moe.replay_choice`) do. Gradients reach the router
through those scores.

With ``algorithm.routerAuxLossCoefficient`` the same hook computes each router's load-balancing
loss (:func:`~.torch_backend.moe.balance_loss`, as the torch backend does) from its scores and
its own top-k, over the tokens :attr:`ReplayTopK.valid`; with sequence (or context) parallelism
the expert counts, probability sums and token counts are summed over the group that splits the
tokens first, so every rank's share adds up to the whole sequence's loss. The loss joins the
backward through :class:`_WithLoss` on the top-k scores, scaled by :attr:`ReplayTopK.scale`
(the coefficient times the micro-batch's loss weight over the layers, times the fp16 loss
scale where megatron-core's optimizer scales the loss): a pipeline stage's routers need no
loss from the last stage.

Token order: the router sees a layer's hidden states ``[s, b, h]`` flattened to ``[s * b]``
(with sequence parallelism each tensor-parallel rank its ``s / tp`` slice).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class _WithLoss(torch.autograd.Function):
    """``x`` unchanged; its backward also sends ``scale`` down ``loss``'s graph (as if
    ``scale * loss`` were added to the objective)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


class ReplayTopK:
    """One router's replay: :attr:`forced` ``[s * b, k]`` (or None: the router's own choice);
    with :attr:`recording`, :attr:`chosen` receives the router's own top-k and :attr:`used`
    the experts the layer used. With :attr:`scale` set (a training forward with a
    load-balancing loss) the router's loss over the tokens :attr:`valid` (``[s * b]``) joins
    the backward and :attr:`balance` receives its value (the whole sequence's)."""

    def __init__(self, group: Any = None, pre_softmax: bool = False) -> None:
        self.forced: torch.Tensor | None = None
        self.recording = False
        self.chosen: torch.Tensor | None = None
        self.used: torch.Tensor | None = None
        self.group = group  # the group splitting the tokens (None: this rank sees every token)
        self.pre_softmax = pre_softmax  # the scores are probabilities, not logits
        self.scale: float | None = None
        self.valid: torch.Tensor | None = None
        self.balance: torch.Tensor | None = None

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if default_compute_topk is None:
            raise RuntimeError("routing replay: megatron-core gave no top-k function")
        values, index = default_compute_topk(
            scores, topk, num_groups=num_groups, group_topk=group_topk
        )
        if self.recording:
            self.chosen = self.used = index.detach()
        balance = None
        if self.scale is not None and torch.is_grad_enabled():
            balance = self._balance_loss(scores, index)
        if self.forced is None:
            if balance is not None:
                values = _WithLoss.apply(values, balance, self.scale)
            return values, index
        forced = self.forced.to(index.device)
        if forced.shape != index.shape:
            raise ValueError(
                f"routing replay: the recorded routing has shape {tuple(forced.shape)}, the "
                f"router chose {tuple(index.shape)} (tokens x top-k): the rollout's tokens are "
                "not the ones this forward sees"
            )
        known = (forced >= 0).all(-1, keepdim=True)
        used = torch.where(known, forced.long(), index)
        if self.recording:
            self.used = used.detach()
        chosen = scores.gather(1, used)
        if balance is not None:
            chosen = _WithLoss.apply(chosen, balance, self.scale)
        return chosen, used

    def _balance_loss(self, scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """This rank's share of the router's load-balancing loss (its own choice ``index``;
        the gradient through this rank's probabilities); :attr:`balance`: the whole loss."""
        from .torch_backend.moe import balance_loss, balance_terms

        probs = scores.float() if self.pre_softmax else torch.softmax(scores.float(), dim=-1)
        counts, sums, tokens = balance_terms(probs, index, self.valid)
        k = index.shape[-1]
        if self.group is None:
            loss = balance_loss(counts, sums, tokens, k)
            self.balance = loss.detach()
            return loss
        from ..algorithms import collectives

        experts = counts.shape[0]
        whole = torch.cat([counts, sums.detach(), tokens[None]]).double()
        whole = collectives.all_reduce_sum(whole, self.group).to(sums.device, torch.float32)
        counts, tokens = whole[:experts], whole[-1]
        self.balance = balance_loss(counts, whole[experts:-1], tokens, k)
        return balance_loss(counts, sums, tokens, k)


def install(
    model: Any, first_layer: int, balance: tuple[Any, bool] | None = None
) -> dict[int, ReplayTopK]:
    """A :class:`ReplayTopK` on every ``TopKRouter`` of ``model`` (a pipeline stage whose first
    layer is decoder layer ``first_layer``), by decoder layer index; ``balance``: (the
    tensor-and-context group or None, whether the router's scores are probabilities) for a
    load-balancing loss."""
    from megatron.core.transformer.moe.router import TopKRouter

    out: dict[int, ReplayTopK] = {}
    for name, module in model.named_modules():
        if isinstance(module, TopKRouter):
            match = _LAYER.search(name)
            if match is None:
                raise ValueError(f"routing replay: router {name!r} is not inside a layer")
            hook = ReplayTopK() if balance is None else ReplayTopK(*balance)
            module.router_replay = out[first_layer + int(match.group(1))] = hook
    if not out:
        raise ValueError(
            "routing replay / routerAuxLossCoefficient: the megatron model has no "
            "mixture-of-experts router"
        )
    return out


def token_major(x: torch.Tensor, tp_rank: int = 0, tp_size: int = 1) -> torch.Tensor:
    """``x`` ``[b, L, ...]`` in the routers' token order ``[L * b, ...]`` (``tp_size`` > 1:
    sequence parallelism, rank ``tp_rank``'s slice of ``L``)."""
    x = x.transpose(0, 1)
    if tp_size > 1:
        x = x.chunk(tp_size, 0)[tp_rank]
    return x.reshape(-1, *x.shape[2:])


def set_forced(routers: dict[int, ReplayTopK], routes: torch.Tensor | None) -> None:
    """Each router's :attr:`ReplayTopK.forced` from ``routes`` ``[tokens, layers, k]`` (None:
    every router chooses for itself)."""
    for layer, router in routers.items():
        router.forced = None if routes is None else routes[:, layer]


def agreement(
    routers: dict[int, ReplayTopK],
    routes: torch.Tensor,
    valid: torch.Tensor,
    which: str = "chosen",
) -> tuple[float, float]:
    """(token-layer choices whose expert sets the routers chose (``which``: or used) as
    ``routes`` records them, choices compared) over the tokens ``valid`` and the records
    without ``-1``, from the routers' last recorded forward (tokens in the routers' order)."""
    same = total = 0.0
    for layer, router in routers.items():
        mine = getattr(router, which)
        if mine is None:
            continue
        a = routes[:, layer].long().sort(-1).values.to(mine.device)
        b = mine.long().sort(-1).values
        both = (a >= 0).all(-1) & valid.to(a.device)
        same += float(((a == b).all(-1) & both).sum())
        total += float(both.sum())
    return same, total
