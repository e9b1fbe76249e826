"""Per-job Prometheus metrics from each PPOJob's status.progress: the exporter read from a status
object (the families scraped, parsed back with prometheus_client's own text parser), labelled by
``ppojob_namespace`` and ``ppojob`` (names no Prometheus target label takes, so jobs stay apart
however the operator is scraped), and gone when the job is deleted (driven through the handlers'
event function with the API calls replaced by recorders)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from ppojob_operator import k8s, metrics, watch
from ppojob_operator.state import OperatorConfig, State
from tests.helpers.manifests import base_manifest

STATUS: dict[str, Any] = {
    "phase": "Running",
    "restarts": 1,
    "disruptions": 2,
    "progress": {
        "step": 120,
        "totalSteps": 500,
        "rewardMean": 0.75,
        "evalRewardMean": 0.5,
        "kl": 0.125,
        "valueLoss": 0.25,
        "tokensPerSecond": 4096.0,
        "stepSeconds": 2.5,
        "phaseSeconds": {"generate": 1.25, "trainActor": 0.5, "weightSync": 0.0625},
        "logprobDiffMean": 0.001,
        "logprobDiffMax": 0.25,
        "entropy": 0.875,
        "weightVersion": 121,
        "rolloutVersion": 119,
        "stalenessMean": 1.5,
        "stalenessMax": 2.0,
        "updatedAt": "2026-01-02T03:04:05Z",
    },
}


class _Fixed(Collector):
    def __init__(self, jobs: dict[tuple[str, str], dict[str, Any]]) -> None:
        self.jobs = jobs

    def collect(self):
        yield from metrics.job_families(self.jobs)


def scrape(collector: Collector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of what Prometheus would scrape."""
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def job(ns: str = "team-a", name: str = "tiny", **extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"ppojob_namespace": ns, "ppojob": name, **extra}.items()))


def test_every_progress_value_is_a_sample_labelled_by_the_jobs_namespace_and_name() -> None:
    got = scrape(_Fixed({("team-a", "tiny"): STATUS}))
    j = job()
    assert got[("ppojob_job_step", j)] == 120
    assert got[("ppojob_job_total_steps", j)] == 500
    assert got[("ppojob_job_reward_mean", j)] == 0.75
    assert got[("ppojob_job_eval_reward_mean", j)] == 0.5
    assert got[("ppojob_job_kl", j)] == 0.125
    assert got[("ppojob_job_value_loss", j)] == 0.25
    assert got[("ppojob_job_tokens_per_second", j)] == 4096.0
    assert got[("ppojob_job_step_seconds", j)] == 2.5
    assert got[("ppojob_job_logprob_diff_mean", j)] == 0.001
    assert got[("ppojob_job_logprob_diff_max", j)] == 0.25
    assert got[("ppojob_job_entropy", j)] == 0.875
    assert got[("ppojob_job_weight_version", j)] == 121.0  # issue 40: the sync's version
    assert got[("ppojob_job_rollout_version", j)] == 119.0
    assert got[("ppojob_job_staleness_mean", j)] == 1.5
    assert got[("ppojob_job_staleness_max", j)] == 2.0
    assert got[("ppojob_job_phase_seconds", job(phase="generate"))] == 1.25
    assert got[("ppojob_job_phase_seconds", job(phase="trainActor"))] == 0.5
    assert got[("ppojob_job_phase_seconds", job(phase="weightSync"))] == 0.0625
    assert got[("ppojob_job_weight_sync_seconds", j)] == 0.0625
    assert got[("ppojob_job_restarts_total", job(failure_class="Application"))] == 1
    assert got[("ppojob_job_restarts_total", job(failure_class="Disruption"))] == 2
    assert got[("ppojob_job_status_phase", job(phase="Running"))] == 1
    assert got[("ppojob_job_progress_updated_timestamp_seconds", j)] == 1767323045.0


def test_a_value_the_status_lacks_is_no_sample_and_jobs_stay_apart() -> None:
    other = {"phase": "Pending", "progress": {"step": 3}}
    got = scrape(_Fixed({("team-a", "tiny"): STATUS, ("team-b", "tiny"): other}))
    b = job("team-b")
    assert got[("ppojob_job_step", b)] == 3 and got[("ppojob_job_step", job())] == 120
    assert ("ppojob_job_reward_mean", b) not in got  # never a made-up 0
    assert ("ppojob_job_phase_seconds", job("team-b", phase="generate")) not in got
    assert got[("ppojob_job_restarts_total", job("team-b", failure_class="Application"))] == 0


def _recorders(monkeypatch) -> None:
    async def apatch_job_status(namespace: str, name: str, patch: dict[str, Any]) -> Any:
        return {}

    async def gone(*_: Any, **__: Any) -> None:
        return None

    monkeypatch.setattr(k8s, "apatch_job_status", apatch_job_status)
    monkeypatch.setattr(k8s, "aget", gone)
    monkeypatch.setattr(k8s, "apost_event", gone)


def test_the_operator_exports_a_jobs_status_and_drops_it_when_the_job_is_deleted(
    monkeypatch,
) -> None:
    _recorders(monkeypatch)
    monkeypatch.setattr(metrics, "JOB_PROGRESS", metrics._JobProgressCollector())
    body = base_manifest()
    body["metadata"].update(namespace="ns1", name="demo", uid="u1")
    body["status"] = copy.deepcopy(STATUS)

    async def scenario() -> None:
        state = State(OperatorConfig())
        await watch.on_ppojob_event(state, "MODIFIED", body)
        got = scrape(metrics.JOB_PROGRESS)
        assert got[("ppojob_job_reward_mean", job("ns1", "demo"))] == 0.75
        await watch.on_ppojob_event(state, "DELETED", body)
        assert not any(labels for (_, labels) in scrape(metrics.JOB_PROGRESS))

    asyncio.run(scenario())


TARGET_LABELS = {
    "job": "ppojob-operator",
    "instance": "10.0.0.5:8080",
    "namespace": "ppojob-system",
    "service": "ppojob-operator",
    "pod": "ppojob-operator-7d9f-x2x4q",
    "container": "operator",
    "endpoint": "metrics",
}
"""The labels Prometheus attaches to every series of a target: its own (``job``, ``instance``)
and, scraping through a ServiceMonitor, the Prometheus operator's (``namespace``, ``service``,
``pod``, ``container``, ``endpoint``), all naming the operator's pod, never a PPOJob."""


def stored_by_prometheus(scraped: dict[str, str], honor_labels: bool) -> dict[str, str]:
    """A scraped series' labels as Prometheus stores them, by its documented ``honor_labels``
    rule: on a clash with a target label, the scraped label wins (true), or is renamed
    ``exported_<name>`` and the target label kept (false, the default)."""
    out = dict(TARGET_LABELS)
    for name, value in scraped.items():
        if name in TARGET_LABELS and not honor_labels:
            out[f"exported_{name}"] = value
        else:
            out[name] = value
    return out


def test_jobs_stay_apart_under_prometheus_target_labels_with_or_without_honor_labels() -> None:
    """The per-job labels are names no target label takes: queried by them (as the shipped
    dashboard does), three jobs (two with the same name) are three series whatever the scrape
    config's ``honor_labels``."""
    assert not set(metrics.JOB_LABELS) & TARGET_LABELS.keys()
    jobs = {("team-a", "tiny"): STATUS, ("team-b", "tiny"): STATUS, ("team-a", "big"): STATUS}
    got = scrape(_Fixed(jobs))
    ns_label, job_label = metrics.JOB_LABELS
    for honor in (False, True):
        stored = [
            stored_by_prometheus(dict(labels), honor)
            for name, labels in got
            if name == "ppojob_job_step"
        ]
        assert {(s[ns_label], s[job_label]) for s in stored} == set(jobs), honor
