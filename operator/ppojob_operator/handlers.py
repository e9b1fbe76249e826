"""Thin kopf handlers: read, call a pure function (builders, status), apply through ``k8s``.

- ``on.create`` PPOJob: validate; invalid -> Warning event + ``Invalid`` status, no children;
  refused by this installation (``capabilities.refusal``: KubeRay too old for SidecarMode, a
  gang scheduler KubeRay's batchScheduler defeats) -> ``Failed`` with that reason, no children;
  valid -> create-or-get every child (idempotent), then write the status once.
- A child's name still held by an object on its way out (being deleted, or owned by an earlier
  PPOJob of the same name) -> ``Pending``/``WaitingForOldChildren`` and a retry with backoff
  (1 s doubling to 60 s); an object we do not own -> ``Pending``/``ChildConflict`` with a Warning
  event, retried the same way, never adopted.
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
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import kopf

from ppojob_api.problems import Problem, SpecError
from ppojob_api.spec import GROUP, PLURAL, VERSION, PPOJob
from ppojob_api.validation import validate_manifest as _validate
from ppojob_operator import capabilities, k8s, metrics
from ppojob_operator.builders import JOB_LABEL, MANAGED_BY, build_children, check_job
from ppojob_operator.scheduling import YUNIKORN_APP_LABEL, effective_scheduler, yunikorn_app_id
from ppojob_operator.status import (
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


Key = tuple[str, str]


class State:
    """What the handlers know between events: the latest PPOJobs and RayJobs seen, and the
    status keys last written per job (so a status write never repeats itself)."""

    def __init__(self, config: OperatorConfig) -> None:
        self.config = config
        self.jobs: dict[Key, dict[str, Any]] = {}
        self.rayjobs: dict[Key, dict[str, Any]] = {}
        self.written: dict[Key, dict[str, Any]] = {}
        self.posted: dict[tuple[Key, str], str] = {}  # (job, reason) -> last message posted
        # why a valid job has no RayJob to follow: (phase, reason, message)
        self.notes: dict[Key, tuple[str, str, str]] = {}
        self.retries: dict[Key, asyncio.Task] = {}
        self.backoff: dict[Key, int] = {}  # retries in a row
        self.attempts: dict[Key, int] = {}  # YuniKorn applications made (resumes, retries)
        # RayJob DELETED events seen per job: a pass that read the RayJob before one of them
        # must not write a status from that copy
        self.rayjob_deletions: dict[Key, int] = {}
        # The handlers are async and run in kopf's event loop (one thread): plain dicts suffice;
        # the per-job lock only orders the status writes of one job across awaits.
        self._locks: dict[Key, asyncio.Lock] = {}

    def lock(self, key: Key) -> asyncio.Lock:
        lk = self._locks.get(key)
        if lk is None:
            lk = self._locks[key] = asyncio.Lock()
        return lk

    def forget(self, key: Key) -> None:
        self.jobs.pop(key, None)
        self.written.pop(key, None)
        self._locks.pop(key, None)
        self.notes.pop(key, None)
        self.attempts.pop(key, None)
        self.backoff.pop(key, None)
        self.rayjobs.pop(key, None)  # a new PPOJob of the same name must not take it over
        task = self.retries.pop(key, None)
        if task is not None:
            task.cancel()
        for k in [k for k in self.posted if k[0] == key]:
            self.posted.pop(k, None)
        metrics.JOBS.set(key, None)


async def _event_once(
    state: State, body: dict[str, Any], type_: str, reason: str, msg: str
) -> None:
    """Post an event unless the same one was just posted for this job (handlers may re-run)."""
    meta = body["metadata"]
    key = ((meta.get("namespace") or "", meta.get("name") or ""), reason)
    if state.posted.get(key) == msg:
        return
    state.posted[key] = msg
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


_PARSED: dict[str, tuple[PPOJob | None, list[Problem]]] = {}


def parse(body: dict[str, Any]) -> tuple[PPOJob | None, list[Problem]]:
    """The validated job, or the problems of its spec (never raises on user input).

    Results are cached by (name, namespace, spec): every event of a job re-reads it."""
    meta = body.get("metadata") or {}
    try:
        ck = json.dumps([meta.get("namespace"), meta.get("name"), body.get("spec")], sort_keys=True)
    except (TypeError, ValueError):
        return _parse(body)
    hit = _PARSED.get(ck)
    if hit is None:
        if len(_PARSED) > 4096:
            _PARSED.clear()
        hit = _PARSED[ck] = _parse(body)
    return hit


def _parse(body: dict[str, Any]) -> tuple[PPOJob | None, list[Problem]]:
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
)
"""Children besides the RayJob, watched for deletion (self-healing)."""
CHILD_RESOURCES = [(g, p) for g, _, p in CHILD_KINDS] + [("ray.io", "rayjobs")]


async def heal(state: State, key: Key) -> None:
    """A child of a live PPOJob was deleted: reconcile the job (recreates it, or fails the job
    when its RayJob went after the run started). The PPOJob is read fresh: a child deleted by
    the garbage collector after its PPOJob went must not be recreated."""
    if key not in state.jobs:
        return
    fresh = await k8s.aget(f"{GROUP}/{VERSION}", "PPOJob", key[0], key[1])
    if fresh is None or fresh.get("metadata", {}).get("deletionTimestamp"):
        return
    known = state.jobs.get(key) or {}
    if known.get("metadata", {}).get("uid") not in (None, fresh["metadata"].get("uid")):
        return
    body = _plain(fresh)
    state.jobs[key] = body
    await reconcile_children(state, body)


async def refresh_yunikorn_app(state: State, key: Key, rayjob: dict[str, Any]) -> None:
    """KubeRay retries a failed run with a new RayCluster that copies the RayJob's labels; give
    the retry a fresh YuniKorn application id while KubeRay tears the old cluster down (it stays
    in ``Retrying`` until every old pod is gone)."""
    st = rayjob.get("status") or {}
    labels = (rayjob.get("metadata") or {}).get("labels") or {}
    if st.get("jobDeploymentStatus") != "Retrying" or YUNIKORN_APP_LABEL not in labels:
        return
    body = state.jobs.get(key) or {}
    uid = (body.get("metadata") or {}).get("uid")
    want = yunikorn_app_id(key[0], key[1], uid, f"retry-{st.get('failed') or 0}")
    if labels[YUNIKORN_APP_LABEL] == want:
        return
    patch = {"metadata": {"labels": {YUNIKORN_APP_LABEL: want}}}
    await k8s.apatch("ray.io/v1", "RayJob", key[0], rayjob["metadata"]["name"], patch)


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
async def sync_status(state: State, key: Key, rayjob: dict[str, Any] | None = None) -> bool:
    """Write the operator's status keys of one job if they changed. Returns whether it wrote."""
    async with state.lock(key):
        body = state.jobs.get(key)
        if body is None:
            return False
        meta = body["metadata"]
        generation = meta.get("generation")
        job, problems = parse(body)
        rj = rayjob if rayjob is not None else state.rayjobs.get(key)
        rj = owned_by(rj, meta.get("uid"))  # not an earlier PPOJob's of the same name
        base = state.written.get(key) or body.get("status") or {}
        note = state.notes.get(key)
        desired = None
        if problems and rj is not None:  # a started job edited into an invalid spec
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
        if desired is not None:
            pass
        elif problems:
            desired = invalid_status(problems, generation=generation, previous=base, now=_now())
        elif job is None:
            return False
        elif rj is None:
            if note is None:
                return False  # the create handler writes the first status
            desired = note_status(job, *note, generation=generation, previous=base, now=_now())
        else:
            sched = effective_scheduler(job, state.config.gang_default)
            progress = (body.get("status") or {}).get("progress") or {}
            desired = desired_status(
                job,
                rj,
                generation=generation,
                previous=base,
                now=_now(),
                scheduler=sched,
                trainer_error=progress.get("error"),
            )
        patch = status_patch(base, desired)
        metrics.JOBS.set(key, desired.get("phase"))
        if not patch:
            return False
        if await k8s.apatch_job_status(key[0], key[1], patch) is None:
            return False  # the PPOJob is gone
        state.written[key] = desired
        return True


def _scheduler_of_rayjob(rayjob: dict[str, Any]) -> str:
    labels = (rayjob.get("metadata") or {}).get("labels") or {}
    return "kueue" if "kueue.x-k8s.io/queue-name" in labels else "none"


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


def _retry_later(state: State, key: Key, why: str, action: Any = None) -> None:
    """Run ``action(state, body)`` (default: reconcile the job) again after a backoff (1 s,
    doubling, at most ``retry_max_s``)."""
    if key in state.retries and not state.retries[key].done():
        return
    n = state.backoff.get(key, 0)
    delay = min(2.0**n, state.config.retry_max_s)
    state.backoff[key] = n + 1
    log.info("%s/%s: %s; retrying in %.0fs", key[0], key[1], why, delay)

    async def _again() -> None:
        await asyncio.sleep(delay)
        state.retries.pop(key, None)
        body = state.jobs.get(key)
        if body is not None:
            await (action or reconcile_children)(state, body)

    state.retries[key] = asyncio.get_running_loop().create_task(_again())


async def reconcile_children(state: State, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Create (or find) every child of a PPOJob, then write its status. Idempotent, and the one
    level-triggered path for new jobs, spec fixes, retries and self-healing.

    The children the RayJob's pods need are created concurrently, the RayJob after them."""
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    state.jobs.setdefault(key, body)
    job, problems = parse(body)
    if job is None:
        if (body.get("status") or {}).get("rayJobName") and key in state.rayjobs:
            await sync_status(state, key)  # a started job edited into an invalid spec
            return []
        msg = "; ".join(str(p) for p in problems)
        await _event_once(state, body, "Warning", "InvalidSpec", msg)
        await sync_status(state, key)
        return []
    cfg = state.config
    refused = capabilities.refusal(
        job,
        gang_default=cfg.gang_default,
        kuberay_batch_scheduler=cfg.kuberay_batch_scheduler,
        sidecar=cfg.sidecar_supported,
    )
    status = body.get("status") or {}
    if refused is not None and not status.get("rayJobName"):
        state.notes[key] = ("Failed", *refused)
        await _event_once(state, body, "Warning", refused[0], refused[1])
        await sync_status(state, key)
        return []
    scheduler = effective_scheduler(job, cfg.gang_default)
    rayjob_name = meta["name"]
    uid = meta.get("uid")
    # Only a RayJob this PPOJob controls counts: one of an earlier PPOJob of the same name
    # (awaiting the garbage collector, or KubeRay's finalizer) goes through create-or-get,
    # which waits for it to go.
    existing_rj = owned_by(state.rayjobs.get(key), uid)
    deletions = state.rayjob_deletions.get(key, 0)
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
            if status.get("phase") in ("Succeeded", "Failed"):
                return []  # finished: nothing to heal
            if _run_started(status):
                msg = (
                    f"RayJob {key[0]}/{rayjob_name} was deleted after the run started; the "
                    "operator does not re-run it. Delete and recreate the PPOJob to run again "
                    "(it resumes from the newest checkpoint on the checkpoint volume)"
                )
                state.notes[key] = ("Failed", "RayJobDeleted", msg)
                await _event_once(state, body, "Warning", "RayJobDeleted", msg)
                await sync_status(state, key)
                return []
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
        attempt=attempt,
    )
    # Under Kueue, a job created (or still) suspended gets no RayJob until resumed: Kueue would
    # admit and unsuspend it (it owns RayJob.spec.suspend).
    hold = scheduler == "kueue" and job.spec.suspend and existing_rj is None
    wanted = children[:-1] if hold else children
    # The API server checks a RoleBinding against its Role (the RBAC escalation check): a
    # RoleBinding posted before its Role exists is refused with 404. Bindings go second.
    first = [c for c in wanted[:-1] if c["kind"] != "RoleBinding"]
    bindings = [c for c in wanted[:-1] if c["kind"] == "RoleBinding"]
    try:
        made = [o for o, _ in await asyncio.gather(*map(k8s.acreate_or_get, first))]
        made += [o for o, _ in await asyncio.gather(*map(k8s.acreate_or_get, bindings))]
        if not hold and existing_rj is not None:
            made.append(existing_rj)  # a known RayJob is never posted again (a re-run if gone)
        elif not hold:
            made.append((await k8s.acreate_or_get(wanted[-1], recreate_vanished=False))[0])
    except k8s.ChildVanished as exc:
        # Deleted between our 409 and the read back: a pass on a fresh PPOJob decides whether
        # the job runs again or fails (its DELETED event's, and this retry in case the watch
        # never shows that event, e.g. across a relist).
        _retry_later(state, key, str(exc), action=lambda st, _body: heal(st, key))
        return []
    except k8s.ChildWaiting as exc:
        state.notes[key] = ("Pending", "WaitingForOldChildren", str(exc))
        await sync_status(state, key)
        _retry_later(state, key, str(exc))
        return []
    except k8s.ChildConflict as exc:
        state.notes[key] = ("Pending", "ChildConflict", str(exc))
        await _event_once(state, body, "Warning", "ChildConflict", str(exc))
        await sync_status(state, key)
        _retry_later(state, key, str(exc))
        return []
    state.backoff.pop(key, None)
    if hold:
        state.notes[key] = (
            "Suspended",
            "SuspendedBeforeAdmission",
            "the job is suspended (spec.suspend); its RayJob is created, and queued in Kueue, "
            "when spec.suspend is set to false",
        )
        await sync_status(state, key)
        return made
    if existing_rj is not None:
        # Not posted. The RayJob watch keeps the cache current (the copy read at the start of
        # this pass may be older than what it delivered since, so it only stands in for an
        # empty cache), and a verdict reached meanwhile (RayJobDeleted) stays.
        if state.rayjob_deletions.get(key, 0) != deletions:
            return made  # deleted since we read it: the deletion's pass writes the status
        if (state.notes.get(key) or ("",))[0] != "Failed":
            state.notes.pop(key, None)
        await sync_status(state, key, rayjob=state.rayjobs.get(key) or existing_rj)
        return made
    state.notes.pop(key, None)
    rayjob = made[-1]
    if not rayjob.get("metadata", {}).get("annotations"):
        rayjob = children[-1]  # an emulator/server that dropped fields: fall back to ours
    state.rayjobs[key] = rayjob
    await sync_status(state, key, rayjob=rayjob)
    return made


# Newest first: Kueue serves v1beta2 from 0.15 and stores it from 0.16 (v1beta1 converted by its
# webhook, to be dropped), and a v1beta1 write to an admitted Workload fails there (Kueue v0.17:
# the v1beta1 schema's CEL rule on priorityClassSource, a field v1beta2 dropped, finds "no such
# key": HTTP 422). Kueue before 0.15 serves only v1beta1.
WORKLOAD_VERSIONS = ("kueue.x-k8s.io/v1beta2", "kueue.x-k8s.io/v1beta1")
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"


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
    state: State, body: dict[str, Any], job: PPOJob, key: Key, rayjob_name: str
) -> None:
    """Make the RayJob's run follow ``spec.suspend``. Under Kueue through the Workload's
    ``spec.active`` (Kueue evicts and suspends the RayJob, and unsuspends it on readmission);
    otherwise through ``RayJob.spec.suspend``."""
    suspend = job.spec.suspend
    rj = state.rayjobs.get(key)
    scheduler = effective_scheduler(job, state.config.gang_default)
    if scheduler == "kueue":
        if rj is None:
            rj = await k8s.aget("ray.io/v1", "RayJob", key[0], rayjob_name)
        if rj is None:
            return
        found = await find_workload(rj)
        if found is None:
            if suspend:  # Kueue has not made the Workload yet: try again shortly
                _retry_later(
                    state, key, "waiting for Kueue's Workload to suspend it", _suspend_again
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
                state,
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
    if not suspend and scheduler == "yunikorn":
        # a fresh YuniKorn application for the new Ray cluster
        n = state.attempts[key] = state.attempts.get(key, 0) + 1
        app = yunikorn_app_id(key[0], key[1], body["metadata"].get("uid"), n)
        patch["metadata"] = {"labels": {YUNIKORN_APP_LABEL: app}}
    if await k8s.apatch("ray.io/v1", "RayJob", key[0], rayjob_name, patch) is not None:
        if rj is not None:
            rj.setdefault("spec", {})["suspend"] = suspend
        await _event_once(
            state,
            body,
            "Normal",
            "SuspendChanged",
            f"RayJob {rayjob_name} " + ("suspended" if suspend else "resumed"),
        )


async def _suspend_again(state: State, body: dict[str, Any]) -> None:
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    job, _ = parse(body)
    name = (body.get("status") or {}).get("rayJobName")
    if job is not None and name:
        await apply_suspend(state, body, job, key, name)
        await sync_status(state, key)


async def apply_spec_change(
    state: State, body: dict[str, Any], old: dict[str, Any] | None, new: dict[str, Any] | None
) -> None:
    """A spec change: suspend/resume; refuse (visibly) anything else. Never unsuspends a job
    Kueue holds: under Kueue only the Workload's ``spec.active`` is touched."""
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    state.jobs[key] = body
    status = body.get("status") or {}
    if not status.get("rayJobName"):
        await reconcile_children(state, body)
        return
    job, problems = parse(body)
    if job is None:
        await _event_once(
            state,
            body,
            "Warning",
            "InvalidSpec",
            "the new spec is invalid; the running "
            "RayJob is unchanged: " + "; ".join(str(p) for p in problems),
        )
        await sync_status(state, key)
        return
    await apply_suspend(state, body, job, key, status["rayJobName"])
    refused = changed_fields(_normalized(old or {}), _normalized(new or {}))
    if refused:
        await _event_once(
            state,
            body,
            "Warning",
            "SpecChangeRefused",
            "a started job's spec can only change spec.suspend; refused: "
            + ", ".join(refused[:20]),
        )
    await sync_status(state, key)


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
        plain = _plain(body)
        key = (plain["metadata"].get("namespace") or "", plain["metadata"].get("name"))
        if type == "DELETED":
            state.forget(key)
            return
        state.jobs[key] = plain
        await sync_status(state, key)

    @kopf.on.event("ray.io", "v1", "rayjobs", labels={JOB_LABEL: kopf.PRESENT}, registry=registry)
    @metrics.instrumented("rayjob_event")
    async def _rayjob_event(type: str | None, body: Any, **_: Any) -> None:
        plain = _plain(body)
        key = _owner_key(plain)
        if key is None:
            return
        if type == "DELETED":
            state.rayjobs.pop(key, None)
            state.rayjob_deletions[key] = state.rayjob_deletions.get(key, 0) + 1
            await heal(state, key)
            return
        state.rayjobs[key] = plain
        await refresh_yunikorn_app(state, key, plain)
        await sync_status(state, key)

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
        key = (plain["metadata"].get("namespace") or "", plain["metadata"].get("name"))
        state.jobs.setdefault(key, plain)
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
