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

Token order: the router sees a layer's hidden states ``[s, b, h]`` flattened to ``[s * b]``
(with sequence parallelism each tensor-parallel rank its ``s / tp`` slice).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class ReplayTopK:
    """One router's replay: :attr:`forced` ``[s * b, k]`` (or None: the router's own choice);
    with :attr:`recording`, :attr:`chosen` receives the router's own top-k and :attr:`used`
    the experts the layer used."""

    def __init__(self) -> None:
        self.forced: torch.Tensor | None = None
        self.recording = False
        self.chosen: torch.Tensor | None = None
        self.used: torch.Tensor | None = None

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
        if self.forced is None:
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
        return scores.gather(1, used), used


def install(model: Any, first_layer: int) -> dict[int, ReplayTopK]:
    """A :class:`ReplayTopK` on every ``TopKRouter`` of ``model`` (a pipeline stage whose first
    layer is decoder layer ``first_layer``), by decoder layer index."""
    from megatron.core.transformer.moe.router import TopKRouter

    out: dict[int, ReplayTopK] = {}
    for name, module in model.named_modules():
        if isinstance(module, TopKRouter):
            match = _LAYER.search(name)
            if match is None:
                raise ValueError(f"routing replay: router {name!r} is not inside a layer")
            module.router_replay = out[first_layer + int(match.group(1))] = ReplayTopK()
    if not out:
        raise ValueError("routing replay: the megatron model has no mixture-of-experts router")
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
