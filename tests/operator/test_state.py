"""The handlers' memory: one JobState per PPOJob, created on first sight and forgotten with the
job, so an operator that has seen many jobs come and go holds nothing of them; a job re-created
under the same name (a new uid) starts from nothing.

Driven through the handlers' event functions with the API calls replaced by recorders (no
kopf, no server): what is asserted is the registry's content after each event."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from ppojob_api.validation import validate_manifest
from ppojob_operator import builders, k8s, reconcile, sync, watch
from ppojob_operator.state import OperatorConfig, State, owned_by
from tests.helpers.manifests import base_manifest

KEY = ("ns1", "demo")


def ppojob(uid: str = "u1", **spec: Any) -> dict[str, Any]:
    body = base_manifest(**spec)
    body["metadata"]["uid"] = uid
    body["status"] = {}
    return body


def rayjob(owner_uid: str = "u1", *, deleting: bool = False) -> dict[str, Any]:
    job = validate_manifest(base_manifest())
    rj = builders.build_children(job, namespace="ns1", uid=owner_uid)[-1]
    rj["status"] = {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}
    if deleting:
        rj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return rj


@pytest.fixture()
def patches(monkeypatch) -> list[dict[str, Any]]:
    """The status patches the handlers write; every other call answers "gone"."""
    written: list[dict[str, Any]] = []

    async def apatch_job_status(namespace: str, name: str, patch: dict[str, Any]) -> Any:
        written.append(copy.deepcopy(patch))
        return {}

    async def gone(*_: Any, **__: Any) -> None:
        return None

    monkeypatch.setattr(k8s, "apatch_job_status", apatch_job_status)
    monkeypatch.setattr(k8s, "aget", gone)  # the PPOJob read fresh by heal: deleted
    monkeypatch.setattr(k8s, "apost_event", gone)
    return written


def new_state() -> State:
    return State(OperatorConfig())


def test_a_deleted_jobs_state_is_forgotten(patches):
    async def scenario() -> None:
        state = new_state()
        await watch.on_ppojob_event(state, "ADDED", ppojob())
        await watch.on_rayjob_event(state, "MODIFIED", rayjob())
        st = state.get(KEY)
        assert st is not None and st.rayjob is not None and st.written is not None
        st.retry = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
        await watch.on_ppojob_event(state, "DELETED", ppojob())
        assert state.get(KEY) is None and len(state) == 0
        await asyncio.sleep(0)  # let the cancellation land
        assert st.retry.cancelled()
        # the garbage collector deletes the RayJob afterwards: its events bring nothing back
        await watch.on_rayjob_event(state, "MODIFIED", rayjob(deleting=True))
        await watch.on_rayjob_event(state, "DELETED", rayjob(deleting=True))
        assert len(state) == 0
        # a RayJob seen before its PPOJob, then deleted: forgotten too
        await watch.on_rayjob_event(state, "ADDED", rayjob())
        assert state.get(KEY) is not None and state.get(KEY).body is None
        await watch.on_rayjob_event(state, "DELETED", rayjob())
        assert len(state) == 0

    asyncio.run(scenario())


def test_a_job_recreated_under_the_same_name_starts_from_nothing(patches):
    async def scenario() -> None:
        state = new_state()
        await watch.on_ppojob_event(state, "ADDED", ppojob("u1"))
        await watch.on_rayjob_event(state, "MODIFIED", rayjob("u1"))
        old = state.get(KEY)
        assert old is not None and old.written is not None
        old.posted["ChildConflict"] = "taken"
        old.note = ("Pending", "ChildConflict", "taken")
        old.rayjob_deletions, old.backoff, old.attempts = 2, 5, 3
        old.retry = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
        # the old job's DELETED event was missed (a watch relist); the new job shows up
        await watch.on_ppojob_event(state, "ADDED", ppojob("u2"))
        new = state.get(KEY)
        assert new is not old and new.uid == "u2"
        assert (new.written, new.posted, new.note) == (None, {}, None)
        assert (new.rayjob_deletions, new.backoff, new.attempts, new.retry) == (0, 0, 0, None)
        await asyncio.sleep(0)
        assert old.retry.cancelled()
        # a pass still holding the old job's state (here with news of its RayJob) writes
        # nothing onto the new job
        old.rayjob = rayjob("u1")
        old.rayjob["status"] = {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}
        before = len(patches)
        assert await sync.sync_status(state, old) is False
        assert len(patches) == before
        # and the old job's late DELETED event leaves the new job's state alone
        await watch.on_ppojob_event(state, "DELETED", ppojob("u1"))
        assert state.get(KEY) is new
        await watch.on_ppojob_event(state, "DELETED", ppojob("u2"))
        assert len(state) == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("readable", [True, False])
def test_a_started_job_edited_into_an_invalid_spec(patches, readable):
    """The RayJob runs on, so the status follows it with SpecApplied False; when the RayJob's
    applied spec is unreadable, the job's status is that of an invalid spec."""

    async def scenario() -> dict[str, Any]:
        state = new_state()
        rj = rayjob()
        if not readable:
            rj["metadata"]["annotations"] = {}
        st = state.see(ppojob(roles={"actor": {"replicas": 0}}))
        st.rayjob = rj
        assert await sync.sync_status(state, st) is True
        return patches[-1]

    written = asyncio.run(scenario())
    conds = {c["type"]: c for c in written["conditions"]}
    if readable:
        assert written["phase"] == "Running"
        assert conds["SpecApplied"]["reason"] == "InvalidSpec"
    else:
        assert written["phase"] == "Invalid"
        assert conds["Valid"]["status"] == "False"


def test_a_deleted_jobs_late_events_leave_the_new_job_alone(patches, monkeypatch):
    """kopf handles each object (uid) in a worker of its own, so events of a deleted PPOJob
    queued before its deletion may be handled after the new PPOJob of the same name was seen.
    They must neither replace the new job's state (its retry, what it wrote) nor act for it."""
    created: list[dict[str, Any]] = []

    async def acreate_or_get(obj: dict[str, Any], **_: Any) -> tuple[dict[str, Any], bool]:
        created.append(obj)
        return obj, True

    monkeypatch.setattr(k8s, "acreate_or_get", acreate_or_get)

    async def scenario() -> None:
        state = new_state()
        await watch.on_ppojob_event(state, "ADDED", ppojob("u1"))
        # u1 deleted, u2 made under its name; u2's worker runs first
        await watch.on_ppojob_event(state, "ADDED", ppojob("u2"))
        new = state.get(KEY)
        assert new is not None and new.uid == "u2"
        new.retry = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
        written = len(patches)
        # u1's worker catches up: a status MODIFIED, its create handler, its DELETED
        await watch.on_ppojob_event(state, "MODIFIED", ppojob("u1"))
        assert await reconcile.reconcile_children(state, ppojob("u1")) == []
        await watch.on_ppojob_event(state, "DELETED", ppojob("u1"))
        assert state.get(KEY) is new
        assert not new.retry.done()
        assert len(patches) == written and created == []
        new.retry.cancel()

    asyncio.run(scenario())


def test_an_earlier_jobs_rayjob_never_stands_in_for_the_new_jobs(patches):
    """The RayJob of a deleted PPOJob (awaiting the garbage collector or KubeRay's finalizer)
    goes by the same name: its events must not replace the new job's RayJob in its state, nor
    count as a deletion of the new job's RayJob."""

    async def scenario() -> None:
        state = new_state()
        await watch.on_ppojob_event(state, "ADDED", ppojob("u2"))
        await watch.on_rayjob_event(state, "MODIFIED", rayjob("u2"))
        st = state.get(KEY)
        assert st is not None and owned_by(st.rayjob, "u2") is not None
        await watch.on_rayjob_event(state, "MODIFIED", rayjob("u1", deleting=True))
        assert owned_by(st.rayjob, "u2") is not None
        await watch.on_rayjob_event(state, "DELETED", rayjob("u1", deleting=True))
        assert owned_by(st.rayjob, "u2") is not None
        assert st.rayjob_deletions == 0
        # its own RayJob's deletion still counts
        await watch.on_rayjob_event(state, "DELETED", rayjob("u2"))
        assert st.rayjob is None and st.rayjob_deletions == 1

    asyncio.run(scenario())


def test_the_rayjob_is_posted_without_waiting_for_the_trainers_rbac(patches, monkeypatch):
    """The trainer's Role and RoleBinding (the API server's slow RBAC escalation checks) are off
    the critical path: the RayJob is posted while they are still in flight, after every child
    its pods need; the RoleBinding still only after its Role."""
    posted: list[str] = []
    rayjob_posted = asyncio.Event()

    async def acreate_or_get(obj: dict[str, Any], **_: Any) -> tuple[dict[str, Any], bool]:
        posted.append(obj["kind"])
        if obj["kind"] == "RayJob":
            rayjob_posted.set()
        if obj["kind"] == "Role":  # the RBAC check: done only once the RayJob went out
            await asyncio.wait_for(rayjob_posted.wait(), 5)
        return obj, True

    monkeypatch.setattr(k8s, "acreate_or_get", acreate_or_get)

    async def scenario() -> list[dict[str, Any]]:
        return await reconcile.reconcile_children(new_state(), ppojob())

    made = asyncio.run(scenario())
    assert [o["kind"] for o in made][-1] == "RayJob"
    assert posted.index("RoleBinding") > posted.index("Role")
    for kind in ("ConfigMap", "ServiceAccount", "PodDisruptionBudget", "NetworkPolicy"):
        assert posted.index(kind) < posted.index("RayJob"), posted


@pytest.mark.parametrize(
    ("phase", "kept"),
    [("Initializing", True), ("Running", True), ("Pending", True), ("Succeeded", False)],
)
def test_a_pod_force_deleted_before_the_job_reads_running_is_evidence(patches, phase, kept):
    """A worker force-deleted (grace 0: one DELETED event) while the job's status, which lags
    the trainer, still says Initializing is remembered for its attempt, so the restart names
    it (seen on real pods: the trainer was training, the phase not yet Running, and the
    restart's message named no pod); a finished job's pods (KubeRay's clean-up) are not."""
    from ppojob_operator.builders import JOB_LABEL

    async def scenario() -> Any:
        state = new_state()
        body = ppojob()
        body["status"] = {"phase": phase}
        await watch.on_ppojob_event(state, "ADDED", body)
        labels = {JOB_LABEL: "demo", "ray.io/cluster": "demo-c1", "ray.io/node-type": "worker"}
        meta = {
            "name": "demo-c1-actor-worker-x",
            "namespace": "ns1",
            "labels": labels,
            "deletionTimestamp": "2026-01-01T00:00:10Z",
            "deletionGracePeriodSeconds": 0,
        }
        await watch.on_pod_event(state, {"metadata": meta, "status": {}}, "DELETED")
        return state.get(KEY)

    st = asyncio.run(scenario())
    assert st is not None
    seen = st.lost_pods.get("demo-c1", {})
    if kept:
        assert seen["demo-c1-actor-worker-x"].line == "pod demo-c1-actor-worker-x was deleted"
    else:
        assert seen == {}
