"""Thin kopf handlers: read, call a pure function (builders, status), apply through ``k8s``.

- ``on.create`` PPOJob: validate; invalid -> Warning event + ``Invalid`` status, no children;
  refused by this installation (``capabilities.refusal``: KubeRay too old for SidecarMode, a
  gang scheduler KubeRay's batchScheduler defeats) -> ``Failed`` with that reason, no children;
  valid -> create-or-get every child (idempotent), then write the status once.
- A child's name still held by an object on its way out (being deleted, or owned by an earlier
  PPOJob of the same name) -> ``Pending``/``WaitingForOldChildren`` and a retry with backoff
  (1 s doubling to 60 s); an object we do not own -> ``Pending``/``ChildConflict`` with a Warning
  event, retried the same way, never adopted. Any other refusal of a child (a missing CRD, a
  ResourceQuota, an admission webhook) -> ``Pending``/``ChildCreateFailed`` with the API
  server's message, a Warning event, retried the same way.
- A failed attempt is classified and restarted or failed by ``spec.failurePolicy``
  (``restarts.py``): the failed RayJob is deleted after the policy's delay and its DELETED event
  creates the next attempt's.
- ``on.update`` of ``spec``: a job without a RayJob yet (invalid, refused, waiting, held) is
  reconciled like a new one; for a started job ``spec.suspend`` is applied (to the RayJob; under
  Kueue to its Workload's ``spec.active``, since Kueue owns ``RayJob.spec.suspend``) and any other
  change is refused (Warning event; ``SpecApplied`` stays False until the change is reverted).
  An edit that makes the spec invalid leaves the running status alone but for ``SpecApplied``.
- Self-healing: a child deleted by hand (DELETE watch events of every child kind, and a check at
  operator start) is recreated. A RayJob deleted after its run started is not re-run: the PPOJob
  turns ``Failed`` with reason ``RayJobDeleted`` (delete and recreate the PPOJob to run again).
- ``on.event`` PPOJob and RayJob: level-triggered status sync. The operator's status keys are
  recomputed from the PPOJob and its RayJob (``status.desired_status``) and patched only when they
  differ from what is stored (or what we last wrote), so a quiet job costs no writes.

No deletion handler and no finalizer: children are garbage-collected through their controller
ownerReferences. kopf runs standalone (no peering); its own events are posted only for warnings.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf

from ppojob_api.problems import Problem, SpecError
from ppojob_api.spec import GROUP, PLURAL, VERSION, PPOJob
from ppojob_api.validation import validate_manifest as _validate
from ppojob_operator import capabilities, k8s, metrics, pods, restarts
from ppojob_operator.builders import (
    JOB_LABEL,
    MANAGED_BY,
    NetworkPolicySettings,
    build_children,
    check_job,
)
from ppojob_operator.scheduling import (
    KUEUE_QUEUE_LABEL,
    YUNIKORN_APP_LABEL,
    effective_scheduler,
    strategy,
    yunikorn_app_id,
)
from ppojob_operator.status import (
    OPERATOR_KEYS,
    applied_job,
    changed_fields,
    desired_status,
    invalid_edit_status,
    invalid_status,
    note_status,
    status_patch,
)

log = logging.getLogger(__name__)


@dataclass
class OperatorConfig:
    """Operator-wide settings (from the command line)."""

    gang_default: str | None = None
    entrypoint: str | None = None
    max_workers: int = 16
    kuberay_batch_scheduler: str | None = None
    """KubeRay's batchScheduler ("" none); None: not told, no agreement check."""
    sidecar_supported: bool | None = None
    """Whether KubeRay supports SidecarMode; None: read the RayJob CRD at start-up."""
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
    """Deletes a failed RayJob after the restart delay (``_schedule_restart``)."""
    queue_timer: asyncio.Task[None] | None = None
    """Wakes the job at its queueing deadline (``spec.scheduling.queueTimeoutSeconds``)."""
    backoff: int = 0
    """Retries in a row."""
    attempts: int = 0
    """YuniKorn applications made (resumes, retries)."""
    unplaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Pods the scheduler cannot place (PodScheduled False): name -> (Ray cluster, the
    scheduler's message)."""
    lost_pods: dict[str, list[str]] = field(default_factory=dict)
    """Per Ray cluster: its pods deleted while it ran, one line each ("pod X was deleted"):
    the failure of that attempt is then a disruption (a lost pod), not the trainer's error."""
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


def _key_of(body: dict[str, Any]) -> Key:
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
        """Gang schedulers' CRDs seen in the cluster (``_missing_scheduler_crd``)."""

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
        key = _key_of(body)
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


async def _event_once(
    st: JobState, body: dict[str, Any], type_: str, reason: str, msg: str
) -> None:
    """Post an event unless the same one was just posted for this job (handlers may re-run)."""
    if st.posted.get(reason) == msg:
        return
    st.posted[reason] = msg
    await k8s.apost_event(body, type_, reason, msg)


def _normalized(spec: dict[str, Any]) -> dict[str, Any]:
    """A spec with its defaults filled in (as stored), or as given if it does not validate."""
    from ppojob_api.base import dump
    from ppojob_api.spec import PPOJobSpec

    try:
        return dump(PPOJobSpec.model_validate(spec))
    except Exception:
        return spec


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _plain(body: Any) -> dict[str, Any]:
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


CHILD_KINDS = (
    ("", "v1", "configmaps"),
    ("", "v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "v1", "roles"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    ("scheduling.x-k8s.io", "v1alpha1", "podgroups"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("networking.k8s.io", "v1", "networkpolicies"),
)
"""Children besides the RayJob, watched for deletion (self-healing)."""
CHILD_RESOURCES = [(g, p) for g, _, p in CHILD_KINDS] + [("ray.io", "rayjobs")]


async def heal(state: State, key: Key) -> None:
    """A child of a live PPOJob was deleted: reconcile the job (recreates it, or fails the job
    when its RayJob went after the run started). The PPOJob is read fresh: a child deleted by
    the garbage collector after its PPOJob went must not be recreated."""
    st = state.get(key)
    if st is None or st.body is None:
        return
    fresh = await k8s.aget(f"{GROUP}/{VERSION}", "PPOJob", key[0], key[1])
    if fresh is None or fresh.get("metadata", {}).get("deletionTimestamp"):
        return
    if not state.current(st) or st.uid not in (None, fresh["metadata"].get("uid")):
        return  # deleted meanwhile, or the PPOJob read is a newer one of the same name
    body = _plain(fresh)
    state.see(body)
    await reconcile_children(state, body)


async def refresh_yunikorn_app(job: JobState, rayjob: dict[str, Any]) -> None:
    """KubeRay retries a failed run with a new RayCluster that copies the RayJob's labels; give
    the retry a fresh YuniKorn application id while KubeRay tears the old cluster down (it stays
    in ``Retrying`` until every old pod is gone)."""
    status = rayjob.get("status") or {}
    labels = (rayjob.get("metadata") or {}).get("labels") or {}
    if status.get("jobDeploymentStatus") != "Retrying" or YUNIKORN_APP_LABEL not in labels:
        return
    ns, name = job.key
    want = yunikorn_app_id(ns, name, job.uid, f"retry-{status.get('failed') or 0}")
    if labels[YUNIKORN_APP_LABEL] == want:
        return
    patch = {"metadata": {"labels": {YUNIKORN_APP_LABEL: want}}}
    await k8s.apatch("ray.io/v1", "RayJob", ns, rayjob["metadata"]["name"], patch)


def _owner_key(rayjob: dict[str, Any]) -> Key | None:
    meta = rayjob.get("metadata") or {}
    ref = k8s.controller_ref(rayjob)
    if ref is not None and ref.get("kind") == "PPOJob":
        return (meta.get("namespace") or "", ref.get("name"))
    name = (meta.get("labels") or {}).get(JOB_LABEL)
    return (meta.get("namespace") or "", name) if name else None


# ---------------------------------------------------------------------------------------------
# The reconcile steps (plain functions; the kopf handlers below only route to them)
# ---------------------------------------------------------------------------------------------
async def sync_status(state: State, st: JobState, rayjob: dict[str, Any] | None = None) -> bool:
    """Write the operator's status keys of one job if they changed. Returns whether it wrote.
    A pass holding the state of a job since deleted (or replaced by a new one of the same name)
    writes nothing."""
    async with st.lock:
        body = st.body
        if body is None or not state.current(st):
            return False
        key = st.key
        meta = body["metadata"]
        generation = meta.get("generation")
        job, problems = st.parse(body)
        rj = rayjob if rayjob is not None else st.rayjob
        rj = owned_by(rj, meta.get("uid"))  # not an earlier PPOJob's of the same name
        base = st.written or body.get("status") or {}
        note = st.note
        decided = None
        trainer_error = None
        expired = False
        queued = ("", "")
        sched = "none"
        if problems:
            desired = None
            if rj is not None:  # a started job edited into an invalid spec
                raw_suspend = (body.get("spec") or {}).get("suspend")
                desired = invalid_edit_status(
                    rj,
                    problems,
                    name=meta.get("name"),
                    suspend=raw_suspend is True,
                    generation=generation,
                    previous=base,
                    now=_now(),
                    scheduler=_scheduler_of_rayjob(rj),
                )
            if desired is None:  # not started, or its RayJob's applied spec unreadable
                desired = invalid_status(problems, generation=generation, previous=base, now=_now())
        elif job is None:
            return False
        elif rj is None or (note is not None and note[0] == "Failed"):
            # a verdict of the operator's own (refused, RayJobDeleted, ImageUnavailable,
            # QueueTimeout) holds over whatever the RayJob says meanwhile, or as it goes
            if note is None:
                return False  # the create handler writes the first status
            desired = note_status(job, *note, generation=generation, previous=base, now=_now())
        else:
            sched = effective_scheduler(job, state.config.gang_default)
            progress = (body.get("status") or {}).get("progress") or {}
            trainer_error = progress.get("error")
            cluster = (rj.get("status") or {}).get("rayClusterName") or ""
            decided = restarts.decision(
                job, rj, base, trainer_error, lost_pods=st.lost_pods.get(cluster, [])
            )
            previous = base
            if decided is not None and decided.action == "Restart":
                previous = {**base, **restarts.restart_status(base, decided, rj, _now())}
            desired = desired_status(
                job,
                rj,
                generation=generation,
                previous=previous,
                now=_now(),
                scheduler=sched,
                trainer_error=None if previous is not base else trainer_error,
                workload=st.workload,
                unplaced=_unplaced(st, cluster),
            )
            started = _run_started({**base, "progress": progress})
            deadline = restarts.queue_deadline(job, rj, desired["phase"], started)
            if deadline is not None and time.time() >= deadline:
                queued = desired["reason"], _running_message(desired)
                expired = True
            elif deadline is not None:
                _wake_at(state, st, deadline)
        patch = status_patch(base, desired)
        edited = outside_edits(st.stored, body)
        for k in edited:
            patch[k] = desired.get(k)
        if decided is not None and decided.action == "Restart" and trainer_error:
            patch["progress"] = {"error": None}  # the failed attempt's: not the next one's
        metrics.JOBS.set(key, desired.get("phase"))
        wrote = False
        transition = None
        seen = {k: (body.get("status") or {}).get(k) for k in edited}
        if patch:
            before = newest_known(st.stored, body)
            got = await k8s.apatch_job_status(key[0], key[1], patch)
            if got is None:
                return False  # the PPOJob is gone
            # an outside write that landed between the read above and this patch, on a key the
            # patch left alone, is in the answer: put back in the same pass, or it would be taken
            # for the operator's own from now on
            slipped = edited_meanwhile(before, patch, got.get("status") or {}, desired)
            if slipped:
                seen.update({k: (got.get("status") or {}).get(k) for k in slipped})
                edited = [*edited, *slipped]
                again = await k8s.apatch_job_status(
                    key[0], key[1], {k: desired.get(k) for k in slipped}
                )
                if again is None:
                    return False
                got = again
            st.written = desired
            rv = _resource_version(got)
            if rv is not None:
                stored = got.get("status") or {}
                st.stored = rv, {k: stored.get(k) for k in OPERATOR_KEYS}
            wrote = True
            if "phase" in patch:
                transition = (base.get("phase"), desired)
                if desired.get("phase") == "Running" and rj is not None:
                    _observe_admission(rj, sched)
    if transition is not None:
        await _phase_event(st, body, *transition)
    if edited and wrote:
        shown = ", ".join(f"{k}={seen.get(k)!r}" for k in edited)
        msg = (
            f"status keys the operator owns were changed from outside ({shown}); restored. Only "
            "the operator writes these; the trainer reports in status.progress"
        )
        await k8s.apost_event(body, "Warning", "StatusEdited", msg)
    await _after_failure(state, st, body, decided)
    if expired:
        await _queue_timeout(state, st, body, *queued)
    return wrote


def _observe_admission(rayjob: dict[str, Any], scheduler: str) -> None:
    """The attempt's wait from its RayJob's creation to a running trainer (the metric)."""
    created = restarts.epoch((rayjob.get("metadata") or {}).get("creationTimestamp"))
    if created is not None:
        metrics.ADMISSION_WAIT.labels(scheduler).observe(max(0.0, time.time() - created))


def _unplaced(st: JobState, cluster: str) -> str | None:
    """The scheduler's message for the first (by name) pod of ``cluster`` it cannot place."""
    for name in sorted(st.unplaced):
        pod_cluster, message = st.unplaced[name]
        if pod_cluster == cluster:
            return message
    return None


def _resource_version(obj: dict[str, Any]) -> int | None:
    """An object's resourceVersion as a number (etcd's revision; None if it is not one)."""
    rv = (obj.get("metadata") or {}).get("resourceVersion")
    return int(rv) if isinstance(rv, str) and rv.isdigit() else None


def outside_edits(stored: tuple[int, dict[str, Any]] | None, body: dict[str, Any]) -> list[str]:
    """The operator's status keys that a write from outside changed: ``body`` is newer than the
    operator's last write (``stored``: its resourceVersion and keys as the API server returned
    them) and holds other values. An event from before that write (the watch lags behind)
    or the trainer's own writes (``status.progress``) are none."""
    rv = _resource_version(body)
    if stored is None or rv is None or rv <= stored[0]:
        return []
    status = body.get("status") or {}
    return [k for k in OPERATOR_KEYS if status.get(k) != stored[1].get(k)]


def newest_known(stored: tuple[int, dict[str, Any]] | None, body: dict[str, Any]) -> dict[str, Any]:
    """The operator's status keys as last known: from its own last write's answer, unless the
    watched ``body`` is newer."""
    rv = _resource_version(body)
    if stored is not None and (rv is None or rv <= stored[0]):
        return dict(stored[1])
    status = body.get("status") or {}
    return {k: status.get(k) for k in OPERATOR_KEYS}


def merge_patched(current: Any, patch: Any) -> Any:
    """``current`` after a JSON merge patch (RFC 7386): objects merge key by key, null deletes,
    anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    out = dict(current) if isinstance(current, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patched(out.get(k), v)
    return out


def edited_meanwhile(
    before: dict[str, Any], patch: dict[str, Any], after: dict[str, Any], desired: dict[str, Any]
) -> list[str]:
    """The operator's status keys that the API server's answer to ``patch`` holds with values
    neither ``before`` nor the patch gave them (written from outside in between), and that
    differ from what the operator wants (``desired``)."""
    out = []
    for k in OPERATOR_KEYS:
        want = merge_patched(before.get(k), patch[k]) if k in patch else before.get(k)
        if after.get(k) != want and after.get(k) != desired.get(k):
            out.append(k)
    return out


def _running_message(desired: dict[str, Any]) -> str:
    return next(
        (c.get("message", "") for c in desired.get("conditions") or [] if c["type"] == "Running"),
        "",
    )


def _wake_at(state: State, st: JobState, deadline: float) -> None:
    """Sync the job's status again at ``deadline`` (once per job at a time)."""
    if st.queue_timer is not None and not st.queue_timer.done():
        return

    async def _wake() -> None:
        await asyncio.sleep(max(0.0, deadline - time.time()) + 0.05)
        st.queue_timer = None
        if state.current(st):
            await sync_status(state, st)

    st.queue_timer = asyncio.get_running_loop().create_task(_wake())


async def _queue_timeout(
    state: State, st: JobState, body: dict[str, Any], reason: str, message: str
) -> None:
    """The attempt queued past spec.scheduling.queueTimeoutSeconds: fail the job, saying what
    it waited for and (from its pods) the scheduler's own reason, and delete its RayJob so that
    nothing it holds stays held."""
    job, _ = st.parse(body)
    if job is None or st.rayjob is None:
        return
    key = st.key
    pods = await k8s.alist("v1", "Pod", key[0], f"{JOB_LABEL}={key[1]}") or []
    msg = restarts.queue_timeout_message(job, reason, message, pods)
    st.note = ("Failed", "QueueTimeout", msg)
    await _event_once(st, body, "Warning", "QueueTimeout", msg)
    name = (st.rayjob.get("metadata") or {}).get("name")
    st.rayjob = None
    await sync_status(state, st)
    try:
        await k8s.adelete("ray.io/v1", "RayJob", key[0], name)
    except k8s.ApiError as exc:
        metrics.API_ERRORS.labels("delete").inc()
        log.warning("%s/%s: could not delete RayJob %s: %s", key[0], key[1], name, exc)


async def _phase_event(
    st: JobState, body: dict[str, Any], old: str | None, desired: dict[str, Any]
) -> None:
    """An event for every phase transition (Normal; Warning into Failed or Invalid), with the
    phase's reason and message, so `kubectl describe` and `kubectl get events` tell the story."""
    phase, why = desired.get("phase") or "", desired.get("reason") or "PhaseChanged"
    detail = next(
        (
            c.get("message")
            for c in desired.get("conditions") or []
            if c.get("reason") == why and c.get("message")
        ),
        "",
    )
    msg = f"{old or 'new'} -> {phase}" + (f": {detail}" if detail else "")
    kind = "Warning" if phase in ("Failed", "Invalid") else "Normal"
    await _event_once(st, body, kind, why, msg)


async def _after_failure(state: State, st: JobState, body: dict[str, Any], decided: Any) -> None:
    """The I/O of a restart decision: its event, the metric, and (after the policy's delay) the
    failed RayJob's deletion, whose DELETED event makes ``reconcile_children`` create the next
    attempt. A decision already written (a restarted operator) gets its deletion scheduled."""
    if decided is not None:
        normal = decided.action == "Restart" and decided.failure_class == "Disruption"
        why, msg = decided.reason, decided.message  # restarts.py: each reason documented
        await _event_once(st, body, "Normal" if normal else "Warning", why, msg)
        if decided.action == "Restart":
            metrics.RESTARTS.labels(decided.failure_class).inc()
    status = st.written or body.get("status") or {}
    if st.rayjob is not None and restarts.pending_restart(status, st.rayjob):
        job, _ = st.parse(body)
        delay = 0
        last = status.get("lastRestart") or {}
        if job is not None and last.get("failureClass") != "Disruption":
            delay = job.spec.failure_policy.retry_delay_seconds
        _schedule_restart(state, st, restarts.restart_delay(status, delay, time.time()))


def _schedule_restart(state: State, st: JobState, delay: float) -> None:
    """Delete the failed RayJob after ``delay`` seconds (once per job at a time)."""
    if st.restart is not None and not st.restart.done():
        return
    key = st.key

    async def _restart() -> None:
        await asyncio.sleep(delay)
        if not state.current(st) or st.rayjob is None:
            return
        name = (st.rayjob.get("metadata") or {}).get("name")
        log.info("%s/%s: restarting: deleting RayJob %s", key[0], key[1], name)
        try:
            await k8s.adelete("ray.io/v1", "RayJob", key[0], name)
        except k8s.ApiError as exc:
            log.warning("%s/%s: could not delete RayJob %s: %s", key[0], key[1], name, exc)
            metrics.API_ERRORS.labels("delete").inc()

    st.restart = asyncio.get_running_loop().create_task(_restart())


def _scheduler_of_rayjob(rayjob: dict[str, Any]) -> str:
    labels = (rayjob.get("metadata") or {}).get("labels") or {}
    return "kueue" if KUEUE_QUEUE_LABEL in labels else "none"


def _run_started(status: dict[str, Any]) -> bool:
    """Whether the trainer ran: the job was Running, or the trainer reported progress. (KubeRay's
    ``startTime`` is set when it begins creating the cluster, before anything ran.)"""
    return status.get("phase") == "Running" or bool(status.get("progress"))


def owned_by(rayjob: dict[str, Any] | None, uid: str | None) -> dict[str, Any] | None:
    """``rayjob`` if the PPOJob with ``uid`` controls it (or the PPOJob has no uid to compare:
    a local render), else None (unowned, or another PPOJob's)."""
    if rayjob is None or not uid:
        return rayjob
    owner = k8s.controller_ref(rayjob)
    return rayjob if owner is not None and owner.get("uid") == uid else None


def _retry_later(state: State, st: JobState, why: str, action: Any = None) -> None:
    """Run ``action(state, body)`` (default: reconcile the job) again after a backoff (1 s,
    doubling, at most ``retry_max_s``); nothing for a job forgotten meanwhile."""
    if not state.current(st) or (st.retry is not None and not st.retry.done()):
        return
    delay = min(2.0**st.backoff, state.config.retry_max_s)
    st.backoff += 1
    log.info("%s/%s: %s; retrying in %.0fs", st.key[0], st.key[1], why, delay)

    async def _again() -> None:
        await asyncio.sleep(delay)
        st.retry = None
        if state.current(st) and st.body is not None:
            await (action or reconcile_children)(state, st.body)

    st.retry = asyncio.get_running_loop().create_task(_again())


async def _missing_scheduler_crd(state: State, scheduler: str) -> str | None:
    """The gang scheduler's CRD when the cluster lacks it (capabilities.SCHEDULER_CRDS); read
    for each new job until found (then remembered: a scheduler installed after the operator
    started is seen). An unreadable CRD (RBAC, network) refuses nothing."""
    crd = capabilities.SCHEDULER_CRDS.get(scheduler)
    if crd is None or crd in state.crds_found:
        return None
    try:
        got = await k8s.aget("apiextensions.k8s.io/v1", "CustomResourceDefinition", "", crd)
    except Exception as exc:
        log.warning(
            "cannot read the CRD %s (%s); not checking that %s is installed", crd, exc, scheduler
        )
        return None
    if got is None:
        return crd
    state.crds_found.add(crd)
    return None


async def reconcile_children(state: State, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Create (or find) every child of a PPOJob, then write its status. Idempotent, and the one
    level-triggered path for new jobs, spec fixes, retries and self-healing.

    The children the RayJob's pods need are created concurrently, the RayJob after them."""
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    st = state.see(body, keep=True)
    if st is None:
        return []  # a late event of a PPOJob since replaced by a new one of its name
    job, problems = st.parse(body)
    if job is None:
        if (body.get("status") or {}).get("rayJobName") and st.rayjob is not None:
            await sync_status(state, st)  # a started job edited into an invalid spec
            return []
        msg = "; ".join(str(p) for p in problems)
        await _event_once(st, body, "Warning", "InvalidSpec", msg)
        await sync_status(state, st)
        return []
    cfg = state.config
    status = body.get("status") or {}
    missing = None
    if not status.get("rayJobName"):
        missing = await _missing_scheduler_crd(state, effective_scheduler(job, cfg.gang_default))
    refused = capabilities.refusal(
        job,
        gang_default=cfg.gang_default,
        kuberay_batch_scheduler=cfg.kuberay_batch_scheduler,
        sidecar=cfg.sidecar_supported,
        missing_crd=missing,
    )
    if refused is not None and not status.get("rayJobName"):
        st.note = ("Failed", *refused)
        await _event_once(st, body, "Warning", refused[0], refused[1])
        await sync_status(state, st)
        return []
    scheduler = effective_scheduler(job, cfg.gang_default)
    rayjob_name = meta["name"]
    uid = meta.get("uid")
    # Only a RayJob this PPOJob controls counts: one of an earlier PPOJob of the same name
    # (awaiting the garbage collector, or KubeRay's finalizer) goes through create-or-get,
    # which waits for it to go.
    existing_rj = owned_by(st.rayjob, uid)
    deletions = st.rayjob_deletions
    recreate = False
    if status.get("rayJobName"):
        # Read, not cached: a RayJob deleted while an earlier pass ran must be seen as gone.
        got = await k8s.aget("ray.io/v1", "RayJob", key[0], rayjob_name)
        existing_rj = owned_by(got, uid)
        if got is None:  # made before and deleted since: decide on a fresh status
            fresh = await k8s.aget(f"{GROUP}/{VERSION}", "PPOJob", key[0], key[1])
            if fresh is None or (fresh.get("metadata") or {}).get("uid") != meta.get("uid"):
                return []
            status = fresh.get("status") or {}
            if restarts.pending_restart(status, None):
                recreate = True  # a restart the failure policy decided (restarts.py)
            elif status.get("phase") in ("Succeeded", "Failed"):
                return []  # finished: nothing to heal
            elif _run_started(status):
                msg = (
                    f"RayJob {key[0]}/{rayjob_name} was deleted after the run started; the "
                    "operator does not re-run it. Delete and recreate the PPOJob to run again "
                    "(it resumes from the newest checkpoint on the checkpoint volume)"
                )
                st.note = ("Failed", "RayJobDeleted", msg)
                await _event_once(st, body, "Warning", "RayJobDeleted", msg)
                await sync_status(state, st)
                return []
            else:
                recreate = True
    # a recreated RayJob is a new attempt: a fresh YuniKorn application id (any unused token)
    attempt = int(time.time()) if recreate else 0
    # A started job's children are rebuilt from the spec its RayJob runs (a refused edit must
    # not reach a recreated ConfigMap), with the current suspend.
    build_job = job
    if existing_rj is not None:
        applied = applied_job(existing_rj, meta["name"])
        if applied is not None:
            applied.metadata = job.metadata
            applied.spec.suspend = job.spec.suspend
            build_job = applied
    children = build_children(
        build_job,
        namespace=key[0],
        uid=meta.get("uid"),
        gang_default=cfg.gang_default,
        entrypoint=cfg.entrypoint,
        network=cfg.network_policy,
        attempt=attempt,
        restart=restarts.next_attempt(status),
    )
    # Under Kueue, a job created (or still) suspended gets no RayJob until resumed: Kueue would
    # admit and unsuspend it (it owns RayJob.spec.suspend).
    hold = strategy(scheduler).owns_suspend and job.spec.suspend and existing_rj is None
    wanted = children[:-1] if hold else children
    # The trainer's Role and RoleBinding are off the critical path: the API server's RBAC
    # escalation check on each waits for its watch cache (~100 ms), and only the trainer's
    # progress reports need them (which wait out an early 403). They are granted while the
    # RayJob is posted, after everything its pods need (ConfigMap, ServiceAccount, the gang's
    # objects). A RoleBinding posted before its Role exists is refused with 404: Role first.
    rbac_kinds = ("Role", "RoleBinding")
    first = [c for c in wanted[:-1] if c["kind"] not in rbac_kinds]
    rbac = [c for c in wanted[:-1] if c["kind"] in rbac_kinds]

    async def grant() -> list[dict[str, Any]]:
        return [(await k8s.acreate_or_get(c))[0] for c in rbac]

    async def post_rayjob() -> list[dict[str, Any]]:
        if hold:
            return []
        if existing_rj is not None:
            return [existing_rj]  # a known RayJob is never posted again (a re-run if gone)
        return [(await k8s.acreate_or_get(wanted[-1], recreate_vanished=False))[0]]

    try:
        made = [o for o, _ in await asyncio.gather(*map(k8s.acreate_or_get, first))]
        granted, posted = await asyncio.gather(grant(), post_rayjob())
        made += granted + posted
    except k8s.ChildVanished as exc:
        # Deleted between our 409 and the read back: a pass on a fresh PPOJob decides whether
        # the job runs again or fails (its DELETED event's, and this retry in case the watch
        # never shows that event, e.g. across a relist).
        _retry_later(state, st, str(exc), action=lambda state, _body: heal(state, key))
        return []
    except k8s.ChildWaiting as exc:
        st.note = ("Pending", "WaitingForOldChildren", str(exc))
        await sync_status(state, st)
        _retry_later(state, st, str(exc))
        return []
    except k8s.ChildRefused as exc:
        # Whatever the API server said (a missing CRD, a quota, a webhook) reaches the status
        # and an event at once; the job is retried with backoff (the cause is usually fixed
        # outside the job: a CRD installed, a quota raised).
        metrics.API_ERRORS.labels("create").inc()
        st.note = ("Pending", "ChildCreateFailed", str(exc))
        await _event_once(st, body, "Warning", "ChildCreateFailed", str(exc))
        await sync_status(state, st)
        _retry_later(state, st, str(exc))
        return []
    except k8s.ChildConflict as exc:
        st.note = ("Pending", "ChildConflict", str(exc))
        await _event_once(st, body, "Warning", "ChildConflict", str(exc))
        await sync_status(state, st)
        _retry_later(state, st, str(exc))
        return []
    st.backoff = 0
    if hold:
        st.note = (
            "Suspended",
            "SuspendedBeforeAdmission",
            "the job is suspended (spec.suspend); its RayJob is created, and queued in Kueue, "
            "when spec.suspend is set to false",
        )
        await sync_status(state, st)
        return made
    if existing_rj is not None:
        # Not posted. The RayJob watch keeps the cache current (the copy read at the start of
        # this pass may be older than what it delivered since, so it only stands in for an
        # empty cache), and a verdict reached meanwhile (RayJobDeleted) stays.
        if st.rayjob_deletions != deletions:
            return made  # deleted since we read it: the deletion's pass writes the status
        if (st.note or ("",))[0] != "Failed":
            st.note = None
        await sync_status(state, st, rayjob=st.rayjob or existing_rj)
        return made
    st.note = None
    rayjob = made[-1]
    if not rayjob.get("metadata", {}).get("annotations"):
        rayjob = children[-1]  # an emulator/server that dropped fields: fall back to ours
    # The RayJob watch may have delivered a newer copy already (KubeRay moves a new RayJob to
    # Initializing within milliseconds): the answer to our POST must not replace it, or the
    # status would go back to RayJobCreated and stay there until the RayJob changes again.
    if not _newer_known(st.rayjob, rayjob):
        st.rayjob = rayjob
    await sync_status(state, st)
    return made


def _newer_known(known: dict[str, Any] | None, answer: dict[str, Any]) -> bool:
    """Whether ``known`` (the watch's copy) is a later version of the object ``answer`` is."""
    if known is None:
        return False
    uids = ((known.get("metadata") or {}).get("uid"), (answer.get("metadata") or {}).get("uid"))
    if None not in uids and uids[0] != uids[1]:
        return False  # another object of that name (an earlier attempt's)
    ours, theirs = _resource_version(answer), _resource_version(known)
    return ours is not None and theirs is not None and theirs > ours


# Newest first: Kueue serves v1beta2 from 0.15 and stores it from 0.16 (v1beta1 converted by its
# webhook, to be dropped), and a v1beta1 write to an admitted Workload fails there (Kueue v0.17:
# the v1beta1 schema's CEL rule on priorityClassSource, a field v1beta2 dropped, finds "no such
# key": HTTP 422). Kueue before 0.15 serves only v1beta1.
WORKLOAD_VERSIONS = ("kueue.x-k8s.io/v1beta2", "kueue.x-k8s.io/v1beta1")
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"


HELD = ("", "New", "Suspending", "Suspended")
"""RayJob deployment states in which Kueue may hold a job (not admitted, or evicted)."""


async def held_workload(rayjob: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The conditions of a Kueue-queued RayJob's Workload while the RayJob is held (so the
    status tells a preemption or Kueue's reason from plain waiting); None otherwise."""
    labels = (rayjob.get("metadata") or {}).get("labels") or {}
    dep = (rayjob.get("status") or {}).get("jobDeploymentStatus") or ""
    if KUEUE_QUEUE_LABEL not in labels or dep not in HELD:
        return None
    try:
        found = await find_workload(rayjob)
    except (k8s.ApiError, aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        # only an explanation: the status is synced without it (the next event tries again)
        log.warning(
            "cannot read the Kueue Workload of RayJob %s: %s", rayjob["metadata"]["name"], exc
        )
        return None
    return ((found[1].get("status") or {}).get("conditions") or None) if found else None


async def find_workload(rayjob: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The Kueue Workload of a RayJob: Kueue labels it ``kueue.x-k8s.io/job-uid: <RayJob uid>``
    and makes the RayJob its controller owner. Returns (apiVersion, workload)."""
    meta = rayjob.get("metadata") or {}
    uid, name, ns = meta.get("uid"), meta.get("name"), meta.get("namespace")
    for version in WORKLOAD_VERSIONS:
        selector = f"{KUEUE_JOB_UID_LABEL}={uid}" if uid else None
        items = await k8s.alist(version, "Workload", ns, selector)
        if items is None:
            continue
        for wl in items:
            for ref in (wl.get("metadata") or {}).get("ownerReferences") or []:
                same_uid = not uid or ref.get("uid") in (None, uid)
                if ref.get("kind") == "RayJob" and ref.get("name") == name and same_uid:
                    return version, wl
        return None
    return None


async def apply_suspend(
    state: State, st: JobState, body: dict[str, Any], job: PPOJob, rayjob_name: str
) -> None:
    """Make the RayJob's run follow ``spec.suspend``. Under Kueue through the Workload's
    ``spec.active`` (Kueue evicts and suspends the RayJob, and unsuspends it on readmission);
    otherwise through ``RayJob.spec.suspend``."""
    suspend = job.spec.suspend
    key = st.key
    rj = st.rayjob
    gang = strategy(effective_scheduler(job, state.config.gang_default))
    if gang.owns_suspend:
        if rj is None:
            rj = await k8s.aget("ray.io/v1", "RayJob", key[0], rayjob_name)
        if rj is None:
            return
        found = await find_workload(rj)
        if found is None:
            if suspend:  # Kueue has not made the Workload yet: try again shortly
                _retry_later(
                    state, st, "waiting for Kueue's Workload to suspend it", _suspend_again
                )
            return
        version, wl = found
        active = (wl.get("spec") or {}).get("active", True) is not False
        if active == (not suspend):
            return
        wl_meta = wl["metadata"]
        if (
            await k8s.apatch(
                version,
                "Workload",
                key[0],
                wl_meta["name"],
                {"spec": {"active": not suspend}},
            )
            is not None
        ):
            await _event_once(
                st,
                body,
                "Normal",
                "SuspendChanged",
                f"Kueue Workload {wl_meta['name']} "
                + ("deactivated (job suspended)" if suspend else "reactivated (job queued)"),
            )
        return
    differs = rj is None or bool((rj.get("spec") or {}).get("suspend")) != suspend
    if not differs:
        return
    patch: dict[str, Any] = {"spec": {"suspend": suspend}}
    if not suspend:
        # the new Ray cluster is a new attempt (YuniKorn: a fresh application)
        labels = gang.attempt_labels(key[0], key[1], body["metadata"].get("uid"), st.attempts + 1)
        if labels:
            st.attempts += 1
            patch["metadata"] = {"labels": labels}
    if await k8s.apatch("ray.io/v1", "RayJob", key[0], rayjob_name, patch) is not None:
        if rj is not None:
            rj.setdefault("spec", {})["suspend"] = suspend
        await _event_once(
            st,
            body,
            "Normal",
            "SuspendChanged",
            f"RayJob {rayjob_name} " + ("suspended" if suspend else "resumed"),
        )


async def _suspend_again(state: State, body: dict[str, Any]) -> None:
    st = state.get(_key_of(body))
    if st is None:
        return
    job, _ = st.parse(body)
    name = (body.get("status") or {}).get("rayJobName")
    if job is not None and name:
        await apply_suspend(state, st, body, job, name)
        await sync_status(state, st)


async def apply_spec_change(
    state: State, body: dict[str, Any], old: dict[str, Any] | None, new: dict[str, Any] | None
) -> None:
    """A spec change: suspend/resume; refuse (visibly) anything else. Never unsuspends a job
    Kueue holds: under Kueue only the Workload's ``spec.active`` is touched."""
    st = state.see(body)
    if st is None:
        return
    status = body.get("status") or {}
    if not status.get("rayJobName"):
        await reconcile_children(state, body)
        return
    job, problems = st.parse(body)
    if job is None:
        await _event_once(
            st,
            body,
            "Warning",
            "InvalidSpec",
            "the new spec is invalid; the running "
            "RayJob is unchanged: " + "; ".join(str(p) for p in problems),
        )
        await sync_status(state, st)
        return
    await apply_suspend(state, st, body, job, status["rayJobName"])
    refused = changed_fields(_normalized(old or {}), _normalized(new or {}))
    if refused:
        await _event_once(
            st,
            body,
            "Warning",
            "SpecChangeRefused",
            "a started job's spec can only change spec.suspend; refused: "
            + ", ".join(refused[:20]),
        )
    await sync_status(state, st)


async def on_ppojob_event(state: State, type: str | None, body: dict[str, Any]) -> None:
    """Any event of a PPOJob: remember it and sync its status; a deletion forgets the job."""
    if type == "DELETED":
        state.forget(_key_of(body), body["metadata"].get("uid"))
        return
    st = state.see(body)
    if st is not None:
        metrics.JOB_PROGRESS.set(st.key, body.get("status") or {})
        await sync_status(state, st)


async def on_rayjob_event(state: State, type: str | None, rayjob: dict[str, Any]) -> None:
    """Any event of one of our RayJobs: follow its status; a deletion heals (or fails) the job.
    A RayJob is remembered before its PPOJob is seen, but not once the PPOJob is gone."""
    key = _owner_key(rayjob)
    if key is None:
        return
    st = state.get(key)
    owner = (k8s.controller_ref(rayjob) or {}).get("uid")
    # the RayJob of an earlier PPOJob of this name (awaiting its garbage collection): not this
    # job's, though it has the name of this job's
    earlier = st is not None and st.uid is not None and owner is not None and owner != st.uid
    if type == "DELETED":
        if st is None:
            return
        if st.body is None:  # its PPOJob never seen (or gone): nothing else to keep
            state.forget(key)
            return
        if not earlier:
            st.rayjob = None
            st.rayjob_deletions += 1
        await heal(state, key)
        return
    if earlier:
        return
    if st is None:
        if rayjob["metadata"].get("deletionTimestamp"):
            return  # on its way out (its PPOJob's garbage): not worth remembering
        st = state.track(key)
    st.rayjob = rayjob
    await refresh_yunikorn_app(st, rayjob)
    st.workload = await held_workload(rayjob)
    await sync_status(state, st)


async def on_pod_event(state: State, pod: dict[str, Any], type: str | None = None) -> None:
    """A pod of one of our jobs changed: a deleted one is remembered for its attempt (its
    failure is then a disruption); an image it cannot get fails the job (the verdict is written
    first, then the RayJob is suspended so that KubeRay removes every pod of it)."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    name = labels.get(JOB_LABEL)
    if not name:
        return
    st = state.get((meta.get("namespace") or "", name))
    cluster = labels.get("ray.io/cluster") or ""
    if st is not None:  # the scheduler's word on the pod (None once placed, or gone)
        gone = type == "DELETED" or meta.get("deletionTimestamp")
        said = None if gone else restarts.unschedulable([pod])
        was = st.unplaced.get(meta.get("name") or "")
        if said is None:
            st.unplaced.pop(meta.get("name") or "", None)
        else:
            st.unplaced[meta.get("name") or ""] = (cluster, said)
        if (was[1] if was else None) != said:
            await sync_status(state, st)
    if type == "DELETED" or meta.get("deletionTimestamp"):
        phase = ((st.body or {}).get("status") or {}).get("phase") if st is not None else None
        line = f"pod {meta.get('name')} was deleted"
        if st is not None and phase == "Running" and line not in st.lost_pods.get(cluster, []):
            st.lost_pods.setdefault(cluster, []).append(line)
        return
    if st is None or st.body is None or (st.note or ("",))[0] == "Failed":
        return
    why = pods.unavailable_image(pod, dt.datetime.now(dt.timezone.utc))
    if why is None:
        return
    if (st.body.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return
    st.note = ("Failed", pods.REASON, why)
    await _event_once(st, st.body, "Warning", pods.REASON, why)
    await sync_status(state, st)
    rayjob = owned_by(st.rayjob, st.uid)
    if rayjob is not None:
        ns, rj_name = st.key[0], rayjob["metadata"]["name"]
        await k8s.apatch("ray.io/v1", "RayJob", ns, rj_name, {"spec": {"suspend": True}})


# ---------------------------------------------------------------------------------------------
# kopf wiring
# ---------------------------------------------------------------------------------------------
def register(registry: kopf.OperatorRegistry, state: State) -> kopf.OperatorRegistry:
    """Register the handlers (bound to ``state``) in ``registry``."""

    @kopf.on.startup(registry=registry)
    def _configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.WARNING  # kopf's own events: warnings only
        settings.execution.max_workers = state.config.max_workers
        settings.watching.connect_timeout = 60
        settings.watching.server_timeout = 600
        settings.networking.request_timeout = 60
        settings.batching.batch_window = 0.005  # default 0.1 s delays every job by 100 ms
        # Handler progress in annotations only: kopf's default also keeps it in status.kopf,
        # which our CRD does not declare, and deep-copies the body once more per event to do so.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage()
        # Children are watched server-side filtered: only the objects this operator made.
        for group, plural in CHILD_RESOURCES:
            settings.watching.label_selectors[group, plural] = (
                f"app.kubernetes.io/managed-by={MANAGED_BY}"
            )
        # Pods (KubeRay's, of our jobs only): the key of the label, no value
        settings.watching.label_selectors["", "pods"] = JOB_LABEL

    @kopf.on.startup(registry=registry)
    async def _detect_kuberay(**_: Any) -> None:
        if state.config.sidecar_supported is not None:
            return
        try:
            crd = await k8s.aget(
                "apiextensions.k8s.io/v1", "CustomResourceDefinition", "", "rayjobs.ray.io"
            )
        except Exception as exc:  # RBAC or network: do not refuse jobs on a guess
            log.warning("cannot read the RayJob CRD (%s); SidecarMode support not checked", exc)
            return
        state.config.sidecar_supported = capabilities.sidecar_supported(crd)
        if state.config.sidecar_supported is False:
            log.warning(
                "the installed RayJob CRD predates KubeRay 1.5.0: jobs with submissionMode "
                "SidecarMode are refused (reason KubeRayTooOld)"
            )

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    @metrics.instrumented("ppojob_event")
    async def _ppojob_event(type: str | None, body: Any, **_: Any) -> None:
        await on_ppojob_event(state, type, _plain(body))

    @kopf.on.event("ray.io", "v1", "rayjobs", labels={JOB_LABEL: kopf.PRESENT}, registry=registry)
    @metrics.instrumented("rayjob_event")
    async def _rayjob_event(type: str | None, body: Any, **_: Any) -> None:
        await on_rayjob_event(state, type, _plain(body))

    def _waiting(body: Any, type: str | None = None, **_: Any) -> bool:
        if type == "DELETED" or (body.get("metadata") or {}).get("deletionTimestamp"):
            return True
        status = body.get("status") or {}
        statuses = status.get("containerStatuses") or []
        statuses += status.get("initContainerStatuses") or []
        if any("waiting" in (cs.get("state") or {}) for cs in statuses):
            return True
        for c in status.get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False":
                return True  # the scheduler cannot place it
        meta = body.get("metadata") or {}
        st = state.get((meta.get("namespace") or "", (meta.get("labels") or {}).get(JOB_LABEL)))
        return st is not None and meta.get("name") in st.unplaced  # placed since

    # Only pods with a container waiting or not placed (filtered before kopf invokes and logs
    # the handler)
    @kopf.on.event(
        "", "v1", "pods", labels={JOB_LABEL: kopf.PRESENT}, when=_waiting, registry=registry
    )
    @metrics.instrumented("pod_event")
    async def _pod_event(type: str | None, body: Any, **_: Any) -> None:
        await on_pod_event(state, _plain(body), type)

    def _deleted(type: str | None, **_: Any) -> bool:
        return type == "DELETED"

    for group, version, plural in CHILD_KINDS:
        # Only deletions matter; filtered before kopf invokes (and logs) the handler, since
        # every child's creation is an event here too (four per job).
        @kopf.on.event(
            group,
            version,
            plural,
            id=f"heal-{plural}",
            labels={JOB_LABEL: kopf.PRESENT},
            when=_deleted,
            registry=registry,
        )
        async def _child_event(type: str | None, body: Any, **_: Any) -> None:
            if type != "DELETED":
                return
            key = _owner_key(_plain(body))
            if key is not None:
                await heal(state, key)

    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    async def _resume(body: Any, **_: Any) -> None:
        plain = _plain(body)
        st = plain["status"]
        if st.get("phase") in ("Succeeded", "Invalid") or (
            st.get("phase") == "Failed" and st.get("rayJobName")
        ):
            return
        state.see(plain, keep=True)
        await reconcile_children(state, plain)

    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @metrics.instrumented("create")
    async def _create(body: Any, **_: Any) -> None:
        await reconcile_children(state, _plain(body))

    @kopf.on.update(GROUP, VERSION, PLURAL, field="spec", registry=registry)
    @metrics.instrumented("update")
    async def _update(body: Any, old: Any, new: Any, **_: Any) -> None:
        await apply_spec_change(state, _plain(body), dict(old or {}), dict(new or {}))

    return registry


def build_registry(state: State, host: str | None = None) -> kopf.OperatorRegistry:
    """A registry with our handlers; with ``host``, kopf logs in to that URL (tests, bench)."""
    if host:
        registry = kopf.OperatorRegistry()

        @kopf.on.login(registry=registry)
        def _login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=host, insecure=True)
    else:
        # kopf does not export SmartOperatorRegistry (it crashed the operator at start-up):
        # log in as kopf's own fallbacks do, in-cluster first, then from the kubeconfig.
        registry = kopf.OperatorRegistry()

        @kopf.on.login(registry=registry)
        def _login(**kwargs: Any) -> kopf.ConnectionInfo | None:
            return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    return register(registry, state)


def run(
    *,
    namespaces: list[str] | None = None,
    clusterwide: bool = False,
    config: OperatorConfig | None = None,
    host: str | None = None,
    health_port: int = 0,
    listen_address: str = "0.0.0.0",
    stop_flag: Any = None,
    ready_flag: Any = None,
    post_events: bool = True,
) -> None:
    """Run the operator until ``stop_flag`` is set (blocking; owns its event loop)."""
    state = State(config or OperatorConfig())
    k8s.configure(host)
    registry = build_registry(state, host)
    settings = kopf.OperatorSettings()
    settings.posting.enabled = post_events
    liveness = f"http://{listen_address}:{health_port}/healthz" if health_port else None

    async def main() -> None:
        try:
            await kopf.operator(
                registry=registry,
                settings=settings,
                standalone=True,
                clusterwide=clusterwide,
                namespaces=namespaces or [],
                liveness_endpoint=liveness,
                stop_flag=stop_flag,
                ready_flag=ready_flag,
            )
        finally:
            await k8s.aclose()

    asyncio.run(main())
