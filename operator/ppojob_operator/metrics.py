"""Prometheus metrics of the operator (``prometheus_client``), served at ``/metrics``."""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
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
