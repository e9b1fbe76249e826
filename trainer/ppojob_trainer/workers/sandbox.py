"""Sandbox role (``roles.sandbox``): a Ray actor process running ``data.agent``'s environment
(its hook, or its declared tools) for every rollout engine.

Each sandbox worker (one per replica) keeps a :class:`~ppojob_trainer.agent.ToolPool` of forked
tool processes, each call with ``toolTimeoutSeconds``, a CPU-time limit and an address-space
limit, exactly as an engine does without the role. The engines call :meth:`SandboxHost.call`
directly with the arguments of their part of a round's calls
(:class:`~ppojob_trainer.agent.RemoteToolPool`): the prompt and the model's turns as strings
(and the label), or a declared tool's name and arguments; replies come back in order. Nothing
goes through the driver. A worker runs one call at a time, its part spread over its tool
processes. On a cluster its pods run under ``roles.sandbox.runtimeClassName`` and a
NetworkPolicy that lets them reach only the job's own pods and DNS.
"""

from __future__ import annotations

import os
from typing import Any

import ray

from ppojob_api.training import TrainerConfig


class SandboxHost:
    """One sandbox worker: rank ``rank`` of ``world``."""

    def __init__(self, cfg_json: str, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.calls = 0
        """Tool calls answered so far."""
        self.tools: Any = None
        self._start_error: str | None = None
        try:
            from ..agent import SandboxTools

            cfg = TrainerConfig.model_validate_json(cfg_json)
            if cfg.data.agent is None:
                raise ValueError("roles.sandbox: data.agent is unset, so there is nothing to run")
            self.tools = SandboxTools(cfg.data.agent)
        except Exception as exc:  # reported by ready() as one line naming the field
            from ..errors import one_line

            self._start_error = one_line(exc)

    def ready(self) -> dict[str, Any]:
        """The pid; or ``{"error": one line, "roles": ["sandbox"]}``."""
        if self._start_error is not None:
            return {"error": self._start_error, "roles": ["sandbox"]}
        return {"pid": os.getpid(), "sandbox": {"rank": self.rank, "world": self.world}}

    def call(self, calls: list[list[Any]]) -> tuple[int, list[tuple[str | None, bool, bool]]]:
        """(this process's pid, the replies to ``calls`` in order: observation, done, error)."""
        replies = self.tools.call(calls)
        self.calls += len(replies)
        return os.getpid(), replies

    def call_count(self) -> int:
        """Tool calls this worker answered so far."""
        return self.calls

    def close(self) -> None:
        """End the tool processes."""
        if self.tools is not None:
            self.tools.close()


RemoteSandboxHost = ray.remote(SandboxHost)
"""The Ray actor class of a sandbox worker."""
