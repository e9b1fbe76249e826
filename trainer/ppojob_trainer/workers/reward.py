"""Reward role (``roles.reward``): a Ray actor process holding the reward models of
``data.rewards`` and scoring text for every rollout engine.

Each reward worker (one per GPU, or one per replica on CPU) loads every ``model`` source of
``data.rewards`` (:class:`~ppojob_trainer.rewards.RewardModelScorer`) on its device. The engines
call :meth:`RewardHost.score` directly with the prompt and completion strings of their part of
a step's samples (:class:`~ppojob_trainer.rewards.RemoteRewardModelScorer`); what crosses the
process boundary is strings in and floats out, never tensors and never through the driver. A
worker scores one call at a time, each in batches of the source's ``batchSize``.
"""

from __future__ import annotations

import os
from typing import Any

import ray
import torch

from ppojob_api.training import TrainerConfig


class RewardHost:
    """One reward worker: rank ``rank`` of ``world``."""

    def __init__(
        self,
        cfg_json: str,
        rank: int,
        world: int,
        threads: int,
        device: str = "cpu",
    ) -> None:
        self.rank, self.world = rank, world
        self.models: dict[int, Any] = {}
        self.scored = 0
        """Samples scored so far (all sources)."""
        self._start_error: str | None = None
        try:
            self._init(cfg_json, threads, device)
        except Exception as exc:  # reported by ready() as one line naming the field
            from ..errors import one_line

            self._start_error = one_line(exc)

    def _init(self, cfg_json: str, threads: int, device: str) -> None:
        from ..models import set_trust_remote_code
        from ..rewards import RewardModelScorer

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        torch.set_num_threads(max(1, threads))
        cfg = TrainerConfig.model_validate_json(cfg_json)
        set_trust_remote_code(cfg.model.trust_remote_code)
        for i, src in enumerate(cfg.data.rewards):
            if src.model is not None:
                field = f"data.rewards[{i}].model"
                self.models[i] = RewardModelScorer(src.model, field, device, cfg.model.dtype)

    def ready(self) -> dict[str, Any]:
        """The pid and the sources held; or ``{"error": one line, "roles": ["reward"]}``."""
        if self._start_error is not None:
            return {"error": self._start_error, "roles": ["reward"]}
        return {
            "pid": os.getpid(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
            "reward": {"rank": self.rank, "world": self.world, "sources": sorted(self.models)},
        }

    def score(self, source: int, prompts: list[str], completions: list[str]) -> list[float]:
        """The rewards of ``data.rewards[source]`` (a model source) for ``prompt + completion``
        of each sample, in order."""
        _fault_gate(source, prompts, self.rank)
        scorer = self.models.get(source)
        if scorer is None:
            raise ValueError(f"data.rewards[{source}]: not a model source held by this worker")
        out = scorer(prompts, completions, [None] * len(prompts))
        self.scored += len(out)
        return out

    def scored_count(self) -> int:
        """Samples this worker scored so far (tests check that the engines use it)."""
        return self.scored


REWARD_FAULT_GATE_ENV = "PPOJOB_REWARD_FAULT_GATE"
"""Fault injection for tests: the name of a Ray actor that a reward worker asks before each
:meth:`RewardHost.score` (``gate.arrive("score", this actor, info)``) and waits for; the tests'
gate may kill the worker right there, inside its share of a step. Unset (always, outside
tests): nothing."""


def _fault_gate(source: int, prompts: list[str], rank: int) -> None:
    name = os.environ.get(REWARD_FAULT_GATE_ENV)
    if not name:
        return
    gate = ray.get_actor(name)
    info = {"source": source, "prompts": list(prompts), "rank": rank}
    ray.get(gate.arrive.remote("score", ray.get_runtime_context().current_actor, info))


RemoteRewardHost = ray.remote(RewardHost)
"""The Ray actor class of a reward worker."""
