"""Report training progress into the PPOJob's ``status.progress`` (in-cluster).

The trainer's pods run as the job's own ServiceAccount, whose Role allows only ``get`` and
``patch`` on ``ppojobs/status`` of this one job. The job is found through the downward-API
environment the operator sets: ``PPOJOB_NAME`` and ``PPOJOB_NAMESPACE``.

Patches are throttled (at most one per ``min_interval`` seconds; the first report, the start and
the finish are always written) and never raise: an API error is logged and training goes on.
Only the ``kubernetes`` client is used, imported lazily.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ppojob_trainer.progress import ProgressReporter, canonical_metrics

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "ppojob.io", "v1alpha1", "ppojobs"
_METRIC_KEYS = {
    "reward_mean": "rewardMean",
    "kl": "kl",
    "value_loss": "valueLoss",
    "tokens_per_second": "tokensPerSecond",
    "eval/reward_mean": "evalRewardMean",
    "time/step": "stepSeconds",
    "rollout/logprob_diff_mean": "logprobDiffMean",
    "rollout/logprob_diff_max": "logprobDiffMax",
    "actor/entropy": "entropy",
    "staleness/mean": "stalenessMean",
    "staleness/max": "stalenessMax",
}
# Policy versions (whole numbers in the status)
_VERSION_KEYS = {"weights/version": "weightVersion", "rollout/version": "rolloutVersion"}
# The step's phases (the loop's `time/<phase>`) in status.progress.phaseSeconds
_PHASES = {
    "time/generate": "generate",
    "time/prepare": "prepare",
    "time/values": "values",
    "time/train_critic": "trainCritic",
    "time/train_actor": "trainActor",
    "time/weight_sync": "weightSync",
}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _number(value: Any) -> float | None:
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if f == f and f not in (float("inf"), float("-inf")) else None


class KubernetesProgressReporter(ProgressReporter):
    """Patches ``status.progress`` of its PPOJob through the status subresource."""

    def __init__(
        self,
        name: str | None = None,
        namespace: str | None = None,
        *,
        api: Any = None,
        min_interval: float = 5.0,
        clock: Any = time.monotonic,
    ) -> None:
        self.name = name or os.environ.get("PPOJOB_NAME", "")
        self.namespace = namespace or os.environ.get("PPOJOB_NAMESPACE", "")
        self._api = api
        self.min_interval = min_interval
        self._reported = False
        self._clock = clock
        self._last_write: float | None = None
        self._total: int | None = None
        self.failures = 0

    @classmethod
    def from_env(cls) -> KubernetesProgressReporter | None:
        """A reporter for the job named by the downward-API env, or None outside a cluster."""
        if not (os.environ.get("PPOJOB_NAME") and os.environ.get("PPOJOB_NAMESPACE")):
            return None
        return cls()

    def _client(self) -> Any:
        if self._api is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api = client.CustomObjectsApi()
        return self._api

    def _patch(self, progress: dict[str, Any]) -> bool:
        if not (self.name and self.namespace):
            return False
        body = {"status": {"progress": {**progress, "updatedAt": _now()}}}
        try:
            self._client().patch_namespaced_custom_object_status(
                GROUP, VERSION, self.namespace, PLURAL, self.name, body
            )
        except Exception as exc:  # never crash training on a status write
            self.failures += 1
            log.warning(
                "could not write progress of PPOJob %s/%s: %s", self.namespace, self.name, exc
            )
            return False
        self._last_write = self._clock()
        return True

    def start(self, total_steps: int, start_step: int = 0) -> None:
        self._total = total_steps
        # (a null clears the error and warning an earlier attempt of the job may have left)
        self._patch({"step": start_step, "totalSteps": total_steps, "error": None, "warning": None})

    def report(self, step: int, metrics: dict[str, float]) -> None:
        now = self._clock()
        evaluated = _number(metrics.get("eval/reward_mean")) is not None  # rare: always written
        recent = self._last_write is not None and now - self._last_write < self.min_interval
        if recent and not evaluated and self._reported:
            return
        self._reported = True  # the first report is always written, even right after start
        progress: dict[str, Any] = {"step": int(step)}
        if self._total is not None:
            progress["totalSteps"] = self._total
        plain = canonical_metrics(metrics)  # the loop sends `reward/mean`, ...
        for key, out in _METRIC_KEYS.items():
            value = _number(plain.get(key))
            if value is not None:
                progress[out] = value
        for key, out in _VERSION_KEYS.items():
            value = _number(plain.get(key))
            if value is not None:
                progress[out] = int(value)
        phases = {out: _number(plain.get(key)) for key, out in _PHASES.items()}
        if any(v is not None for v in phases.values()):
            # a merge patch: a phase this step did not run is cleared, not left from an earlier one
            progress["phaseSeconds"] = phases
        self._patch(progress)

    def checkpointed(self, checkpoints: list[tuple[int, str]]) -> None:
        """The kept checkpoints into ``status.progress.checkpoints`` (always written: rare)."""
        self._patch({"checkpoints": [{"step": s, "path": p} for s, p in checkpoints]})

    def finish(self, summary: dict[str, Any]) -> None:
        progress: dict[str, Any] = {}
        step = summary.get("step", summary.get("steps"))
        if isinstance(step, int):
            progress["step"] = step
        if self._total is not None:
            progress["totalSteps"] = self._total
        plain = canonical_metrics(summary)
        if plain.get("reward_mean") is None:
            plain["reward_mean"] = summary.get("final_reward")
        for key, out in _METRIC_KEYS.items():
            value = _number(plain.get(key))
            if value is not None:
                progress[out] = value
        self._patch(progress)

    def fail(self, message: str) -> None:
        """Write why the run failed into ``status.progress.error``; the operator puts it into the
        PPOJob's Failed condition."""
        self._patch({"error": message})

    def warn(self, message: str) -> None:
        """Write a problem that does not stop the run into ``status.progress.warning``; the
        operator posts it as a Warning event (its reason, the part before ``: ``)."""
        self._patch({"warning": message})
