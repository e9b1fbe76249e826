"""Prometheus metrics of the operator (``prometheus_client``), served at ``/metrics``."""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector

from ppojob_api.spec import PHASES

RECONCILES = Counter("ppojob_reconciles_total", "Handler runs, by handler.", ["handler"])
ERRORS = Counter(
    "ppojob_reconcile_errors_total", "Handler runs that raised, by handler.", ["handler"]
)
RESTARTS = Counter(
    "ppojob_restarts_total",
    "Restarts the failure policy decided, by failure class (Disruption, Application).",
    ["failure_class"],
)
API_ERRORS = Counter(
    "ppojob_api_errors_total",
    "Kubernetes API requests of the operator that failed, by operation.",
    ["operation"],
)
ADMISSION_WAIT = Histogram(
    "ppojob_admission_wait_seconds",
    "Seconds from an attempt's RayJob creation until its trainer runs (queueing and admission, "
    "scheduling, image pulls, Ray start-up), by gang scheduler; one observation per attempt.",
    ["scheduler"],
    buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400),
)
CRD_STALE = Gauge(
    "ppojob_crd_stale",
    "1 when the installed PPOJob CRD's schema hash is not the one this operator was built with "
    "(Helm never upgrades crds/: kubectl apply -f crds/), 0 when it is; checked at start-up.",
)
LATENCY = Histogram(
    "ppojob_reconcile_duration_seconds",
    "Handler run time, by handler.",
    ["handler"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)


class _PhaseCollector(Collector):
    """``ppojob_jobs{phase=...}``: PPOJobs the operator sees, by phase (computed on scrape)."""

    def __init__(self) -> None:
        self._phases: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def set(self, key: tuple[str, str], phase: str | None) -> None:
        with self._lock:
            if phase is None:
                self._phases.pop(key, None)
            else:
                self._phases[key] = phase

    def counts(self) -> dict[str, int]:
        with self._lock:
            values = list(self._phases.values())
        return {p: values.count(p) for p in (*PHASES, "")}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "ppojob_jobs", "PPOJobs by phase ('' = not yet reconciled).", labels=["phase"]
        )
        for phase, n in self.counts().items():
            g.add_metric([phase], n)
        yield g


JOBS = _PhaseCollector()
REGISTRY.register(JOBS)

# Per-job gauges from each PPOJob's status.progress (written by the trainer): name, help, the
# progress key. Prometheus scrapes the operator; it never reaches into the job's pods.
JOB_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("ppojob_job_step", "Last completed training step.", "step"),
    ("ppojob_job_total_steps", "Steps the job will run.", "totalSteps"),
    ("ppojob_job_reward_mean", "Mean reward of the last step's samples.", "rewardMean"),
    ("ppojob_job_eval_reward_mean", "Mean reward of the last evaluation.", "evalRewardMean"),
    ("ppojob_job_kl", "Mean KL to the reference policy in the last step.", "kl"),
    ("ppojob_job_value_loss", "Critic loss of the last step.", "valueLoss"),
    (
        "ppojob_job_tokens_per_second",
        "Generated tokens per second in the last step.",
        "tokensPerSecond",
    ),
    ("ppojob_job_step_seconds", "Wall time of the last step.", "stepSeconds"),
    (
        "ppojob_job_logprob_diff_mean",
        "Mean |rollout - actor| log-prob difference of the last step's tokens.",
        "logprobDiffMean",
    ),
    (
        "ppojob_job_logprob_diff_max",
        "Largest |rollout - actor| log-prob difference in the last step.",
        "logprobDiffMax",
    ),
    ("ppojob_job_entropy", "Mean policy entropy over the last step's tokens.", "entropy"),
    (
        "ppojob_job_weight_version",
        "Policy version the generation engines reported holding after the last weight sync.",
        "weightVersion",
    ),
    (
        "ppojob_job_rollout_version",
        "Oldest policy version the last step's samples were generated with.",
        "rolloutVersion",
    ),
    (
        "ppojob_job_staleness_mean",
        "Mean age in policy versions of the last step's trained tokens.",
        "stalenessMean",
    ),
    ("ppojob_job_staleness_max", "Largest such age in the last step.", "stalenessMax"),
)
JOB_LABELS = ["ppojob_namespace", "ppojob"]
"""The per-job series' labels: the PPOJob's namespace and name. Never ``namespace`` or ``job``:
Prometheus attaches its own target labels (``job``, ``instance``; a ServiceMonitor adds
``namespace``, ``service``, ``pod``, ``container``, ``endpoint``: the operator's), and without
``honor_labels`` renames a scraped label of the same name to ``exported_<name>``, so dashboards
querying ``namespace``/``job`` would see only the operator's."""


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if value == value else None


def _timestamp(value: Any) -> float | None:
    """Seconds since the epoch of an RFC 3339 time (``2026-01-02T03:04:05Z``), else None."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def job_families(jobs: dict[tuple[str, str], dict[str, Any]]) -> list[Any]:
    """The per-job metric families of ``jobs`` ((namespace, name) -> the PPOJob's status):
    pure, so the exporter is tested from a status object. A value the status lacks is no
    sample (never a made-up 0)."""
    gauges = {name: GaugeMetricFamily(name, doc, labels=JOB_LABELS) for name, doc, _ in JOB_GAUGES}
    phases = GaugeMetricFamily(
        "ppojob_job_phase_seconds",
        "Wall time of the last step's phases (generate, prepare, values, trainCritic, "
        "trainActor, weightSync).",
        labels=[*JOB_LABELS, "phase"],
    )
    weight_sync = GaugeMetricFamily(
        "ppojob_job_weight_sync_seconds",
        "Weight sync (actor to rollout engine) time of the last step.",
        labels=JOB_LABELS,
    )
    restarts = CounterMetricFamily(
        "ppojob_job_restarts",
        "Restarts of the job by failure class (Application: counted against backoffLimit; "
        "Disruption: not counted).",
        labels=[*JOB_LABELS, "failure_class"],
    )
    state = GaugeMetricFamily(
        "ppojob_job_status_phase",
        "1 for the job's current phase.",
        labels=[*JOB_LABELS, "phase"],
    )
    updated = GaugeMetricFamily(
        "ppojob_job_progress_updated_timestamp_seconds",
        "When the trainer last wrote the job's progress (seconds since the epoch).",
        labels=JOB_LABELS,
    )
    for (namespace, job), status in sorted(jobs.items()):
        labels = [namespace, job]
        progress = status.get("progress") or {}
        for name, _, key in JOB_GAUGES:
            value = _number(progress.get(key))
            if value is not None:
                gauges[name].add_metric(labels, value)
        for phase, secs in sorted((progress.get("phaseSeconds") or {}).items()):
            value = _number(secs)
            if value is not None:
                phases.add_metric([*labels, phase], value)
                if phase == "weightSync":
                    weight_sync.add_metric(labels, value)
        for failure_class, key in (("Application", "restarts"), ("Disruption", "disruptions")):
            restarts.add_metric([*labels, failure_class], _number(status.get(key)) or 0.0)
        if status.get("phase"):
            state.add_metric([*labels, str(status["phase"])], 1.0)
        stamp = _timestamp(progress.get("updatedAt"))
        if stamp is not None:
            updated.add_metric(labels, stamp)
    return [*gauges.values(), phases, weight_sync, restarts, state, updated]


class _JobProgressCollector(Collector):
    """Per-job metrics from the status of each PPOJob the operator sees; a job's series go
    when the job is deleted (:meth:`set` with None)."""

    def __init__(self) -> None:
        self._status: dict[tuple[str, str], dict[str, Any]] = {}
        self._lock = threading.Lock()

    def set(self, key: tuple[str, str], status: dict[str, Any] | None) -> None:
        with self._lock:
            if status is None:
                self._status.pop(key, None)
            else:
                self._status[key] = dict(status)

    def collect(self) -> Iterator[Any]:
        with self._lock:
            jobs = dict(self._status)
        yield from job_families(jobs)


JOB_PROGRESS = _JobProgressCollector()
REGISTRY.register(JOB_PROGRESS)


@contextmanager
def observe(handler: str) -> Iterator[None]:
    """Count one run of a handler, its latency and whether it raised."""
    RECONCILES.labels(handler).inc()
    t0 = time.perf_counter()
    try:
        yield
    except Exception:
        ERRORS.labels(handler).inc()
        raise
    finally:
        LATENCY.labels(handler).observe(time.perf_counter() - t0)


def instrumented(handler: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator form of :func:`observe`."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):

            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                with observe(handler):
                    return await fn(*args, **kwargs)

            awrapper.__name__ = fn.__name__
            awrapper.__qualname__ = fn.__qualname__
            awrapper.__doc__ = fn.__doc__
            return awrapper

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with observe(handler):
                return fn(*args, **kwargs)

        wrapper.__name__ = fn.__name__
        wrapper.__doc__ = fn.__doc__
        return wrapper

    return deco


def serve(port: int, address: str = "0.0.0.0") -> None:
    """Serve /metrics on ``address:port`` (port 0: do nothing)."""
    if port:
        start_http_server(port, addr=address)
