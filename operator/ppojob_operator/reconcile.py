"""Reconcile one PPOJob's children, in KubeRay's shape: admit the job -> plan the attempt ->
build the desired objects (pure, ``builders``) -> ensure the children exist -> record the
outcome (the job's note, an event, one status sync, a retry). Idempotent, and the one
level-triggered path for new jobs, spec fixes, retries and self-healing.

- Invalid -> Warning event + ``Invalid`` status, no children; refused by this installation
  (``capabilities.refusal``: KubeRay too old for SidecarMode, a gang scheduler KubeRay's
  batchScheduler defeats, a scheduler whose CRD is missing) or by its namespace's enforced Pod
  Security level (``capabilities.pod_security_refusal``: PodSecurity admission would refuse
  the pods KubeRay makes) -> ``Failed`` with that reason.
- A child's name still held by an object on its way out -> ``Pending``/``WaitingForOldChildren``
  and a retry with backoff (1 s doubling to 60 s); an object we do not own ->
  ``Pending``/``ChildConflict`` with a Warning event, retried the same way, never adopted. Any
  other refusal of a child (a missing CRD, a ResourceQuota, an admission webhook) ->
  ``Pending``/``ChildCreateFailed`` with the API server's message, a Warning event, retried the
  same way (:data:`CHILD_ERRORS`).
- A child deleted by hand is recreated (:func:`heal`). A RayJob deleted after its run started
  is not re-run: the PPOJob turns ``Failed`` with reason ``RayJobDeleted``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ppojob_api.checks.podsecurity import ENFORCE_LABEL
from ppojob_api.spec import GROUP, VERSION, PPOJob
from ppojob_operator import capabilities, k8s, metrics, restarts, sync, timers
from ppojob_operator.builders import build_children
from ppojob_operator.scheduling import effective_scheduler, strategy
from ppojob_operator.state import (
    JobState,
    Key,
    OperatorConfig,
    State,
    event_once,
    owned_by,
    plain,
    run_started,
)
from ppojob_operator.status import applied_job

log = logging.getLogger(__name__)


class _Keep:
    """The job's note stays as it is."""


KEEP = _Keep()


@dataclass
class Outcome:
    """How a reconcile pass ends, applied by :func:`record` in this order: the metric, the job's
    note, a Warning event, one status sync, a retry with backoff."""

    made: list[dict[str, Any]] = field(default_factory=list)
    note: tuple[str, str, str] | _Keep | None = KEEP
    event: tuple[str, str, str] | None = None
    """(type, reason, message), posted once per message."""
    sync: bool = True
    rayjob: dict[str, Any] | None = None
    """The RayJob the status sync follows (None: the one the watch delivered)."""
    retry: str | None = None
    """Why the pass is retried with backoff (None: no retry)."""
    action: timers.Action | None = None
    """What the retry runs (None: this reconcile)."""
    metric: str | None = None
    """An API error counted under this label."""


@dataclass
class Attempt:
    """The plan of one pass: which spec the children are built from, and how the RayJob is
    treated (kept, posted, recreated as a new attempt, held back)."""

    job: PPOJob
    build_job: PPOJob
    """The spec the children are built from: a started job's RayJob's own (a refused edit must
    not reach a recreated ConfigMap), with the current suspend."""
    status: dict[str, Any]
    existing: dict[str, Any] | None
    """The RayJob this PPOJob controls, if known; never posted again."""
    deletions: int
    """RayJob deletions seen when the pass began."""
    token: int = 0
    """A recreated RayJob is a new attempt: a fresh YuniKorn application id (any unused one)."""
    hold: bool = False
    """Under Kueue, a job created (or still) suspended gets no RayJob until resumed: Kueue would
    admit and unsuspend it (it owns RayJob.spec.suspend)."""


@dataclass(frozen=True)
class ChildError:
    """How a refused child is reported: the ``Pending`` note's reason (None: no note, no
    status sync, and the retry re-reads the PPOJob (:func:`heal`) instead of reconciling the
    copy at hand), whether a Warning event says so, and the API-error metric's label."""

    reason: str | None
    event: bool = False
    metric: str | None = None


CHILD_ERRORS: dict[type[Exception], ChildError] = {
    # Deleted between our 409 and the read back: a pass on a fresh PPOJob decides whether the
    # job runs again or fails (its DELETED event's, and this retry in case the watch never
    # shows that event, e.g. across a relist).
    k8s.ChildVanished: ChildError(None),
    k8s.ChildWaiting: ChildError("WaitingForOldChildren"),
    # Whatever the API server said (a missing CRD, a quota, a webhook) reaches the status and
    # an event at once; the job is retried with backoff (the cause is usually fixed outside
    # the job: a CRD installed, a quota raised).
    k8s.ChildRefused: ChildError("ChildCreateFailed", event=True, metric="create"),
    k8s.ChildConflict: ChildError("ChildConflict", event=True),
}
"""The error table of :func:`ensure_children`: exception type -> how it is reported."""


async def reconcile_children(state: State, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Create (or find) every child of a PPOJob, then write its status. Returns the children.

    The children the RayJob's pods need are created concurrently, the RayJob after them."""
    st = state.see(body, keep=True)
    if st is None:
        return []  # a late event of a PPOJob since replaced by a new one of its name
    job = await admit(state, st, body)
    if isinstance(job, Outcome):
        return await record(state, st, body, job)
    attempt = await plan_attempt(state, st, body, job)
    if isinstance(attempt, Outcome):
        return await record(state, st, body, attempt)
    children = desired_children(state.config, body, attempt)
    try:
        made = await ensure_children(attempt, children)
    except tuple(CHILD_ERRORS) as exc:
        return await record(state, st, body, child_error(st.key, exc))
    st.backoff = 0
    return await record(state, st, body, settle(st, attempt, made, children))


async def record(state: State, st: JobState, body: dict[str, Any], out: Outcome) -> list[Any]:
    """Apply a pass's :class:`Outcome`: the one status write of the pass, and its retry."""
    if out.metric is not None:
        metrics.API_ERRORS.labels(out.metric).inc()
    if not isinstance(out.note, _Keep):
        st.note = out.note
    if out.event is not None:
        await event_once(st, body, *out.event)
    if out.sync:
        await sync.sync_status(state, st, rayjob=out.rayjob)
    if out.retry is not None:
        timers.retry_later(state, st, out.retry, out.action or reconcile_children)
    return out.made


# ---------------------------------------------------------------------------------------------
# admit -> plan the attempt
# ---------------------------------------------------------------------------------------------
async def admit(state: State, st: JobState, body: dict[str, Any]) -> PPOJob | Outcome:
    """The valid job this installation can run, or how the pass ends without children."""
    job, problems = st.parse(body)
    status = body.get("status") or {}
    if job is None:
        if status.get("rayJobName") and st.rayjob is not None:
            return Outcome()  # a started job edited into an invalid spec: its status only
        msg = "; ".join(str(p) for p in problems)
        return Outcome(event=("Warning", "InvalidSpec", msg))
    cfg = state.config
    missing = None
    if not status.get("rayJobName"):
        missing = await missing_scheduler_crd(state, effective_scheduler(job, cfg.gang_default))
    refused = capabilities.refusal(
        job,
        gang_default=cfg.gang_default,
        kuberay_batch_scheduler=cfg.kuberay_batch_scheduler,
        sidecar=cfg.sidecar_supported,
        missing_crd=missing,
        kuberay_1_6=cfg.kuberay_1_6,
    )
    if refused is None and not status.get("rayJobName"):
        ns = body["metadata"].get("namespace") or ""
        refused = capabilities.pod_security_refusal(job, ns, await enforced_pod_security(ns))
        queue = job.spec.scheduling.queue
        if refused is None and queue and effective_scheduler(job, cfg.gang_default) == "kueue":
            refused = await multikueue_refusal(ns, queue)
    if refused is not None and not status.get("rayJobName"):
        return Outcome(note=("Failed", *refused), event=("Warning", refused[0], refused[1]))
    return job


async def enforced_pod_security(namespace: str) -> str | None:
    """The Pod Security level the namespace enforces (its ``pod-security.kubernetes.io/enforce``
    label), read for each job not yet started; None for none. An unreadable namespace (RBAC,
    network) refuses nothing: PodSecurity admission still judges the pods."""
    try:
        ns = await k8s.aget("v1", "Namespace", "", namespace)
    except Exception as exc:
        log.warning(
            "cannot read namespace %s (%s); its Pod Security level not checked", namespace, exc
        )
        return None
    labels = ((ns or {}).get("metadata") or {}).get("labels") or {}
    return labels.get(ENFORCE_LABEL)


KUEUE = "kueue.x-k8s.io/v1beta2"


async def multikueue_refusal(namespace: str, queue: str) -> tuple[str, str] | None:
    """Why a kueue job cannot run here when its LocalQueue's ClusterQueue has a MultiKueue
    admission check (:func:`capabilities.multikueue_refusal`), read for each job not yet
    started. Anything unreadable (no such LocalQueue yet, RBAC, network) refuses nothing:
    Kueue itself holds a job whose queue is missing, and spec.scheduling.queueTimeoutSeconds
    bounds that."""
    try:
        lq = await k8s.aget(KUEUE, "LocalQueue", namespace, queue)
        cq_name = ((lq or {}).get("spec") or {}).get("clusterQueue")
        cq = await k8s.aget(KUEUE, "ClusterQueue", "", cq_name) if cq_name else None
        if cq is None:
            return None
        checks = {
            name: await k8s.aget(KUEUE, "AdmissionCheck", "", name)
            for name in capabilities.cluster_queue_checks(cq)
        }
    except Exception as exc:
        log.warning(
            "cannot read LocalQueue %s/%s and its ClusterQueue (%s); MultiKueue not checked",
            namespace,
            queue,
            exc,
        )
        return None
    return capabilities.multikueue_refusal(queue, cq_name, checks)


async def missing_scheduler_crd(state: State, scheduler: str) -> str | None:
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


async def plan_attempt(
    state: State, st: JobState, body: dict[str, Any], job: PPOJob
) -> Attempt | Outcome:
    """What this pass makes: the children of the spec the job runs, its RayJob kept, posted,
    recreated (a new attempt) or held back; or how the pass ends (a RayJob deleted after the
    run started, a finished job)."""
    meta = body["metadata"]
    # Only a RayJob this PPOJob controls counts: one of an earlier PPOJob of the same name
    # (awaiting the garbage collector, or KubeRay's finalizer) goes through create-or-get,
    # which waits for it to go.
    attempt = Attempt(job, job, body.get("status") or {}, owned_by(st.rayjob, meta.get("uid")), 0)
    attempt.deletions = st.rayjob_deletions
    recreate = False
    if attempt.status.get("rayJobName"):
        read = await _read_rayjob(st, body, attempt)
        if isinstance(read, Outcome):
            return read
        recreate = read
    attempt.token = int(time.time()) if recreate else 0
    if attempt.existing is not None:
        applied = applied_job(attempt.existing, meta["name"])
        if applied is not None:
            applied.metadata = job.metadata
            applied.spec.suspend = job.spec.suspend
            attempt.build_job = applied
    scheduler = effective_scheduler(job, state.config.gang_default)
    owns_suspend = strategy(scheduler).owns_suspend
    attempt.hold = owns_suspend and job.spec.suspend and attempt.existing is None
    return attempt


async def _read_rayjob(st: JobState, body: dict[str, Any], attempt: Attempt) -> bool | Outcome:
    """A job whose RayJob was made: its RayJob read (not cached: one deleted while an earlier
    pass ran must be seen as gone). Returns whether a vanished RayJob is recreated, or how the
    pass ends."""
    key, meta = st.key, body["metadata"]
    got = await k8s.aget("ray.io/v1", "RayJob", key[0], meta["name"])
    attempt.existing = owned_by(got, meta.get("uid"))
    if got is not None:
        return False
    # made before and deleted since: decide on a fresh status
    fresh = await k8s.aget(f"{GROUP}/{VERSION}", "PPOJob", key[0], key[1])
    if fresh is None or (fresh.get("metadata") or {}).get("uid") != meta.get("uid"):
        return Outcome(sync=False)
    status = attempt.status = fresh.get("status") or {}
    if restarts.pending_restart(status, None):
        return True  # a restart the failure policy decided (restarts.py)
    if status.get("phase") in ("Succeeded", "Failed"):
        return Outcome(sync=False)  # finished: nothing to heal
    if run_started(status):
        msg = (
            f"RayJob {key[0]}/{meta['name']} was deleted after the run started; the "
            "operator does not re-run it. Delete and recreate the PPOJob to run again "
            "(it resumes from the newest checkpoint on the checkpoint volume)"
        )
        return Outcome(
            note=("Failed", "RayJobDeleted", msg), event=("Warning", "RayJobDeleted", msg)
        )
    return True


# ---------------------------------------------------------------------------------------------
# build (pure) -> ensure
# ---------------------------------------------------------------------------------------------
def desired_children(
    config: OperatorConfig, body: dict[str, Any], attempt: Attempt
) -> list[dict[str, Any]]:
    """Every child of the attempt, the RayJob last (``builders.build_children``)."""
    meta = body["metadata"]
    return build_children(
        attempt.build_job,
        namespace=meta["namespace"],
        uid=meta.get("uid"),
        gang_default=config.gang_default,
        entrypoint=config.entrypoint,
        network=config.network_policy,
        dashboard_auth=bool(config.dashboard_auth),
        attempt=attempt.token,
        restart=restarts.next_attempt(attempt.status),
    )


RBAC_KINDS = ("Role", "RoleBinding")


async def ensure_children(attempt: Attempt, children: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Create (or get) the children; raises one of :data:`CHILD_ERRORS` when one is refused.

    The trainer's Role and RoleBinding are off the critical path: the API server's RBAC
    escalation check on each waits for its watch cache (~100 ms), and only the trainer's
    progress reports need them (which wait out an early 403). They are granted while the
    RayJob is posted, after everything its pods need (ConfigMap, ServiceAccount, the gang's
    objects). A RoleBinding posted before its Role exists is refused with 404: Role first."""
    wanted = children[:-1] if attempt.hold else children
    first = [c for c in wanted[:-1] if c["kind"] not in RBAC_KINDS]
    rbac = [c for c in wanted[:-1] if c["kind"] in RBAC_KINDS]

    async def grant() -> list[dict[str, Any]]:
        return [(await k8s.acreate_or_get(c))[0] for c in rbac]

    async def post_rayjob() -> list[dict[str, Any]]:
        if attempt.hold:
            return []
        if attempt.existing is not None:
            return [attempt.existing]  # a known RayJob is never posted again (a re-run if gone)
        return [(await k8s.acreate_or_get(wanted[-1], recreate_vanished=False))[0]]

    made = [o for o, _ in await asyncio.gather(*map(k8s.acreate_or_get, first))]
    granted, posted = await asyncio.gather(grant(), post_rayjob())
    return made + granted + posted


# ---------------------------------------------------------------------------------------------
# the outcomes
# ---------------------------------------------------------------------------------------------
def child_error(key: Key, exc: Exception) -> Outcome:
    """The outcome of a refused child, by :data:`CHILD_ERRORS`."""
    rule = next(CHILD_ERRORS[t] for t in type(exc).__mro__ if t in CHILD_ERRORS)
    msg = str(exc)
    if rule.reason is None:

        async def _heal(state: State, _body: dict[str, Any]) -> None:
            await heal(state, key)

        return Outcome(sync=False, retry=msg, action=_heal, metric=rule.metric)
    event = ("Warning", rule.reason, msg) if rule.event else None
    return Outcome(note=("Pending", rule.reason, msg), event=event, retry=msg, metric=rule.metric)


def settle(
    st: JobState, attempt: Attempt, made: list[dict[str, Any]], children: list[dict[str, Any]]
) -> Outcome:
    """The outcome of a pass whose children all exist (the cached RayJob updated)."""
    if attempt.hold:
        msg = (
            "the job is suspended (spec.suspend); its RayJob is created, and queued in Kueue, "
            "when spec.suspend is set to false"
        )
        return Outcome(made, note=("Suspended", "SuspendedBeforeAdmission", msg))
    if attempt.existing is not None:
        # Not posted. The RayJob watch keeps the cache current (the copy read at the start of
        # this pass may be older than what it delivered since, so it only stands in for an
        # empty cache), and a verdict reached meanwhile (RayJobDeleted) stays.
        if st.rayjob_deletions != attempt.deletions:
            return Outcome(made, sync=False)  # deleted since: the deletion's pass writes status
        note = st.note if (st.note or ("",))[0] == "Failed" else None
        return Outcome(made, note=note, rayjob=st.rayjob or attempt.existing)
    rayjob = made[-1]
    if not rayjob.get("metadata", {}).get("annotations"):
        rayjob = children[-1]  # an emulator/server that dropped fields: fall back to ours
    # The RayJob watch may have delivered a newer copy already (KubeRay moves a new RayJob to
    # Initializing within milliseconds): the answer to our POST must not replace it, or the
    # status would go back to RayJobCreated and stay there until the RayJob changes again.
    if not newer_known(st.rayjob, rayjob):
        st.rayjob = rayjob
    return Outcome(made, note=None)


def newer_known(known: dict[str, Any] | None, answer: dict[str, Any]) -> bool:
    """Whether ``known`` (the watch's copy) is a later version of the object ``answer`` is."""
    if known is None:
        return False
    uids = ((known.get("metadata") or {}).get("uid"), (answer.get("metadata") or {}).get("uid"))
    if None not in uids and uids[0] != uids[1]:
        return False  # another object of that name (an earlier attempt's)
    ours, theirs = sync.resource_version(answer), sync.resource_version(known)
    return ours is not None and theirs is not None and theirs > ours


# ---------------------------------------------------------------------------------------------
# self-healing
# ---------------------------------------------------------------------------------------------
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
    body = plain(fresh)
    state.see(body)
    await reconcile_children(state, body)
