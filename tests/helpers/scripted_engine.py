"""A rollout engine stand-in for the agent tests: it answers each turn with fixed token ids."""

from __future__ import annotations

from typing import Any

import torch

from ppojob_trainer.backends.base import Generation


class ScriptedEngine:
    """Returns fixed turns (ids, and log-probs -1/scale, -2/scale, ... per turn), recording the
    prompts it was given."""

    def __init__(self, turns: list[list[int]], pad: int, logp_scale: float = 10.0) -> None:
        self.turns = turns
        self.pad = pad
        self.logp_scale = logp_scale
        self.prompts: list[list[int]] = []

    def generate(self, ids: torch.Tensor, mask: torch.Tensor, **kw: Any) -> Generation:
        self.prompts.append(ids[0][mask[0]].tolist())
        turn = self.turns[len(self.prompts) - 1]
        width = kw["max_new_tokens"]
        out = torch.full((1, width), self.pad, dtype=torch.long)
        out[0, : len(turn)] = torch.tensor(turn)
        logp = torch.zeros(1, width)
        steps = torch.arange(1, len(turn) + 1, dtype=torch.float32)
        logp[0, : len(turn)] = -steps / self.logp_scale
        resp = torch.zeros(1, width, dtype=torch.bool)
        resp[0, : len(turn)] = True
        return Generation(out, resp, logp, torch.tensor([len(turn)]))
