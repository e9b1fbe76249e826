"""What the operator knows of its jobs between events: its settings, one :class:`JobState` per
PPOJob, and the small reads every reconcile step shares (the parsed spec, the owned RayJob).

No Kubernetes calls here but :func:`event_once`, which posts an event at most once per message.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from ppojob_api.failures import PodLoss
from ppojob_api.problems import Problem, SpecError
from ppojob_api.spec import PPOJob
from ppojob_api.validation import validate_manifest as _validate
from ppojob_operator import k8s, metrics
from ppojob_operator.builders import (
    JOB_LABEL,
    KUBERAY_NAMESPACE,
    NetworkPolicySettings,
    check_job,
)


@dataclass
class OperatorConfig:
    """Operator-wide settings (from the command line)."""

    gang_default: str | None = None
    entrypoint: str | None = None
    max_workers: int = 16
    kuberay_batch_scheduler: str | None = None
    """KubeRay's batchScheduler ("" none); None: not told, no agreement check."""
    detect_batch_scheduler: bool = False
    """Read KubeRay's batchScheduler from its Deployment in ``kuberay_namespace`` at start-up
    (``--kuberay-batch-scheduler=auto``)."""
    kuberay_namespace: str = KUBERAY_NAMESPACE
    """Where KubeRay's operator runs (``--kuberay-namespace``)."""
    sidecar_supported: bool | None = None
    """Whether KubeRay supports SidecarMode; None: read the RayJob CRD at start-up."""
    kuberay_1_6: bool | None = None
    """Whether the installed RayJob CRD is KubeRay >= 1.6's (it has ``authOptions``), read at
    start-up; None: not read. ``gangScheduler: kai`` needs it."""
    dashboard_auth: bool | None = None
    """Whether each job's Ray cluster gets token authentication (KubeRay's ``authOptions``,
    KubeRay >= 1.6; for a ``rayVersion`` >= 2.52); None: read the RayJob CRD at start-up."""
    retry_max_s: float = 60.0
    network_policy: NetworkPolicySettings | None = field(default_factory=NetworkPolicySettings)
    """Each job's NetworkPolicy (builders.network_policy); None: none (``--network-policy=off``)."""


Key = tuple[str, str]
Parsed = tuple[PPOJob | None, list[Problem]]


@dataclass(eq=False)
class JobState:
    """Everything the handlers know of one PPOJob between events. Created on first sight (of
    the PPOJob, or of its RayJob), dropped when the PPOJob is deleted (and when a PPOJob of
    the same name with another uid shows up: a new job starts from nothing)."""

    key: Key
    uid: str | None = None
    body: dict[str, Any] | None = None
    """The latest PPOJob seen (None while only its RayJob has been)."""
    rayjob: dict[str, Any] | None = None
    """The latest RayJob seen."""
    written: dict[str, Any] | None = None
    """The status keys last written (so a status write never repeats itself)."""
    workload: list[dict[str, Any]] | None = None
    """The conditions of the job's Kueue Workload, read while Kueue holds its RayJob."""
    stored: tuple[int, dict[str, Any]] | None = None
    """The resourceVersion and the operator's status keys as the API server returned them after
    the last write: a later PPOJob whose keys differ was edited from outside (repaired)."""
    posted: dict[str, str] = field(default_factory=dict)
    """Event reason -> the message last posted with it."""
    note: tuple[str, str, str] | None = None
    """Why a valid job has no RayJob to follow: (phase, reason, message)."""
    retry: asyncio.Task[None] | None = None
    restart: asyncio.Task[None] | None = None
    """Deletes a failed RayJob after the restart delay (``timers.schedule_restart``)."""
    restart_of: str | None = None
    """The uid of the RayJob (the failed attempt) that ``restart`` deletes."""
    queue_timer: asyncio.Task[None] | None = None
    """Wakes the job at its queueing deadline (``spec.scheduling.queueTimeoutSeconds``)."""
    backoff: int = 0
    """Retries in a row."""
    attempts: int = 0
    """YuniKorn applications made (resumes, retries)."""
    unplaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Pods the scheduler cannot place (PodScheduled False): name -> (Ray cluster, the
    scheduler's message)."""
    lost_pods: dict[str, dict[str, PodLoss]] = field(default_factory=dict)
    """Per Ray cluster: its pods that went away (deleted, disrupted) while it ran, by name, with
    what Kubernetes said of each (``pods.pod_loss``): evidence for the class of that attempt's
    failure (``restarts.decision``)."""
    failed_submitters: dict[str, str] = field(default_factory=dict)
    """Per Ray cluster: KubeRay's line for its head pod's submitter container that exited
    nonzero (``pods.failed_submitter``), which ends an attempt KubeRay keeps ``Initializing``
    (``restarts.submission_failed``)."""
    rayjob_deletions: int = 0
    """RayJob DELETED events seen: a pass that read the RayJob before one of them must not
    write a status from that copy."""
    parsed: tuple[str, Parsed] | None = None
    """The last spec parsed (as JSON) and its verdict: every event of a job re-reads it."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Orders the status writes of this job across awaits."""
    superseded: frozenset[str] = frozenset()
    """Uids of the earlier PPOJobs of this name this one replaced: all deleted (two objects
    never share a name), so their late events (kopf handles each uid in a worker of its own)
    are stale."""

    def parse(self, body: dict[str, Any]) -> Parsed:
        """:func:`parse`, remembering the last spec's verdict."""
        try:
            spec = json.dumps(body.get("spec"), sort_keys=True)
        except (TypeError, ValueError):
            return parse(body)
        if self.parsed is None or self.parsed[0] != spec:
            self.parsed = (spec, parse(body))
        return self.parsed[1]


def key_of(body: dict[str, Any]) -> Key:
    """A PPOJob's (namespace, name)."""
    meta = body.get("metadata") or {}
    return (meta.get("namespace") or "", meta.get("name") or "")


class State:
    """What the handlers know between events: one :class:`JobState` per PPOJob, by
    (namespace, name). The handlers are async and run in kopf's event loop (one thread): a
    plain dict suffices."""

    def __init__(self, config: OperatorConfig) -> None:
        self.config = config
        self._jobs: dict[Key, JobState] = {}
        self.crds_found: set[str] = set()
        """Gang schedulers' CRDs seen in the cluster (``reconcile.missing_scheduler_crd``)."""

    def __len__(self) -> int:
        return len(self._jobs)

    def get(self, key: Key) -> JobState | None:
        return self._jobs.get(key)

    def track(self, key: Key) -> JobState:
        """The state of a job, created if new (first seen through its RayJob)."""
        st = self._jobs.get(key)
        if st is None:
            st = self._jobs[key] = JobState(key)
        return st

    def see(self, body: dict[str, Any], *, keep: bool = False) -> JobState | None:
        """The state of the PPOJob ``body``, holding ``body`` (with ``keep``, only when it holds
        none yet). A PPOJob of a known name with another uid is a new job: the old state goes.
        None for a late event of a PPOJob a newer one of its name already replaced."""
        key = key_of(body)
        uid = (body.get("metadata") or {}).get("uid")
        st = self._jobs.get(key)
        superseded: frozenset[str] = frozenset()
        if st is not None and uid and uid in st.superseded:
            return None
        if st is not None and uid and st.uid and st.uid != uid:
            superseded = st.superseded | {st.uid}
            self.forget(key)
            st = None
        if st is None:
            st = self._jobs[key] = JobState(key, superseded=superseded)
        st.uid = uid or st.uid
        if st.body is None or not keep:
            st.body = body
        return st

    def forget(self, key: Key, uid: str | None = None) -> None:
        """Drop a job's state (with ``uid``: only if it is that job's), cancelling its retry."""
        st = self._jobs.get(key)
        if st is None or (uid and st.uid and st.uid != uid):
            return
        del self._jobs[key]
        for task in (st.retry, st.restart, st.queue_timer):
            if task is not None:
                task.cancel()
        metrics.JOBS.set(key, None)
        metrics.JOB_PROGRESS.set(key, None)

    def current(self, st: JobState) -> bool:
        """Whether ``st`` is still the state of its job (not forgotten or replaced since)."""
        return self._jobs.get(st.key) is st


async def event_once(st: JobState, body: dict[str, Any], type_: str, reason: str, msg: str) -> None:
    """Post an event unless the same one was just posted for this job (handlers may re-run)."""
    if st.posted.get(reason) == msg:
        return
    st.posted[reason] = msg
    await k8s.apost_event(body, type_, reason, msg)


def normalized(spec: dict[str, Any]) -> dict[str, Any]:
    """A spec with its defaults filled in (as stored), or as given if it does not validate."""
    from ppojob_api.base import dump
    from ppojob_api.spec import PPOJobSpec

    try:
        return dump(PPOJobSpec.model_validate(spec))
    except Exception:
        return spec


def now() -> str:
    """The time now, as the status's timestamps write it."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def plain(body: Any) -> dict[str, Any]:
    """A plain-dict snapshot of a kopf body (or a dict)."""
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": dict(body.get("metadata") or {}),
        "spec": dict(body.get("spec") or {}),
        "status": dict(body.get("status") or {}),
    }


def parse(body: dict[str, Any]) -> Parsed:
    """The validated job, or the problems of its spec (never raises on user input)."""
    doc = {k: v for k, v in body.items() if k != "status"}
    meta = doc.get("metadata") or {}
    doc["metadata"] = {"name": meta.get("name"), "namespace": meta.get("namespace")}
    try:
        job = _validate(doc)
    except SpecError as exc:
        return None, exc.problems
    problems = check_job(job)
    return (None, problems) if problems else (job, [])


def owned_by(rayjob: dict[str, Any] | None, uid: str | None) -> dict[str, Any] | None:
    """``rayjob`` if the PPOJob with ``uid`` controls it (or the PPOJob has no uid to compare:
    a local render), else None (unowned, or another PPOJob's)."""
    if rayjob is None or not uid:
        return rayjob
    owner = k8s.controller_ref(rayjob)
    return rayjob if owner is not None and owner.get("uid") == uid else None


def owner_key(child: dict[str, Any]) -> Key | None:
    """The (namespace, name) of the PPOJob a child belongs to (its controller, else its label)."""
    meta = child.get("metadata") or {}
    ref = k8s.controller_ref(child)
    if ref is not None and ref.get("kind") == "PPOJob":
        return (meta.get("namespace") or "", ref.get("name"))
    name = (meta.get("labels") or {}).get(JOB_LABEL)
    return (meta.get("namespace") or "", name) if name else None


def run_started(status: dict[str, Any]) -> bool:
    """Whether the trainer ran: the job was Running, or the trainer reported progress. (KubeRay's
    ``startTime`` is set when it begins creating the cluster, before anything ran.)"""
    return status.get("phase") == "Running" or bool(status.get("progress"))
