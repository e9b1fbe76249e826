"""What each watch event of a job does: a PPOJob's event syncs its status (its deletion forgets
the job), a spec change suspends, resumes or is refused, a RayJob's event is followed (its
deletion heals or fails the job), a pod's event records a lost or unplaceable pod and fails a
job whose image cannot be pulled.

- ``on.update`` of ``spec``: a job without a RayJob yet (invalid, refused, waiting, held) is
  reconciled like a new one; for a started job ``spec.suspend`` is applied (``suspend.py``).
  The API server refuses any other change of a started job's spec (the CRD's transition rules,
  ``ppojob_api.cel.started_rules``); one that still arrives (made between the RayJob's creation
  and the status write that freezes the spec, or under an older CRD) is refused here (Warning
  event; ``SpecApplied`` stays False until the change is reverted). An edit that makes the spec
  invalid leaves the running status alone but for ``SpecApplied``.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from ppojob_operator import k8s, metrics, pods, reconcile, restarts
from ppojob_operator.builders import JOB_LABEL
from ppojob_operator.scheduling import YUNIKORN_APP_LABEL, yunikorn_app_id
from ppojob_operator.state import (
    JobState,
    State,
    event_once,
    key_of,
    normalized,
    owned_by,
    owner_key,
)
from ppojob_operator.status import changed_fields
from ppojob_operator.suspend import apply_suspend, held_workload
from ppojob_operator.sync import sync_status
from ppojob_operator.timers import stop_failed


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
        await reconcile.reconcile_children(state, body)
        return
    job, problems = st.parse(body)
    if job is None:
        await event_once(
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
    refused = changed_fields(normalized(old or {}), normalized(new or {}))
    if refused:
        await event_once(
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
        state.forget(key_of(body), body["metadata"].get("uid"))
        return
    st = state.see(body)
    if st is not None:
        metrics.JOB_PROGRESS.set(st.key, body.get("status") or {})
        await sync_status(state, st)


async def on_rayjob_event(state: State, type: str | None, rayjob: dict[str, Any]) -> None:
    """Any event of one of our RayJobs: follow its status; a deletion heals (or fails) the job.
    A RayJob is remembered before its PPOJob is seen, but not once the PPOJob is gone."""
    key = owner_key(rayjob)
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
        await reconcile.heal(state, key)
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
    """A pod of one of our jobs changed: a deleted or disrupted one is remembered for its
    attempt (evidence for its failure's class, ``pods.pod_loss``), so is a head pod's failed
    submitter (``pods.failed_submitter``: the attempt's end); an image it cannot get fails
    the job (the verdict is written first, then the run is stopped so that no pod of it holds
    anything: ``timers.stop_failed``, which under Kueue deletes the RayJob rather than write
    ``spec.suspend``, Kueue's field)."""
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
    gone = type == "DELETED" or bool(meta.get("deletionTimestamp"))
    phase = ((st.body or {}).get("status") or {}).get("phase") if st is not None else None
    loss = pods.pod_loss(pod, deleted=gone)
    # evidence for the attempt's end (restarts.py), in any phase but a final one: the phase read
    # here lags the trainer (it becomes Running once KubeRay reports the Ray job RUNNING and
    # that status comes back), and a worker force-deleted in that gap is seen once or twice
    if st is not None and loss is not None and phase not in ("Succeeded", "Failed"):
        seen = st.lost_pods.setdefault(cluster, {})
        seen[loss.pod] = pods.merged(seen.get(loss.pod), loss)
    failed = pods.failed_submitter(pod) if labels.get("ray.io/node-type") == "head" else None
    if st is not None and failed is not None and st.failed_submitters.get(cluster) != failed:
        st.failed_submitters[cluster] = failed  # ends an Initializing attempt (restarts.py)
        await sync_status(state, st)
    if gone:
        return
    if st is None or st.body is None or (st.note or ("",))[0] == "Failed":
        return
    why = pods.unavailable_image(pod, dt.datetime.now(dt.timezone.utc))
    if why is None:
        return
    if (st.body.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return
    st.note = ("Failed", pods.REASON, why)
    await event_once(st, st.body, "Warning", pods.REASON, why)
    await sync_status(state, st)
    rayjob = owned_by(st.rayjob, st.uid)
    if rayjob is not None:
        await stop_failed(st, rayjob)


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


async def on_child_event(state: State, type: str | None, child: dict[str, Any]) -> None:
    """A child besides the RayJob changed: a deleted one is recreated (:func:`reconcile.heal`)."""
    if type != "DELETED":
        return
    key = owner_key(child)
    if key is not None:
        await reconcile.heal(state, key)


async def on_resume(state: State, body: dict[str, Any]) -> None:
    """The operator (re)started: reconcile every job not finished (a Failed job without a
    RayJob may be one a fix lets start)."""
    st = body["status"]
    if st.get("phase") in ("Succeeded", "Invalid") or (
        st.get("phase") == "Failed" and st.get("rayJobName")
    ):
        return
    state.see(body, keep=True)
    await reconcile.reconcile_children(state, body)
