"""Thin kopf handlers: read, call a pure function (builders, status), apply through ``k8s``.

- ``on.create`` PPOJob: validate; invalid -> Warning event + ``Invalid`` status, no children;
  valid -> create-or-get every child (idempotent), then write the status once.
- ``on.update`` of ``spec``: a job without children yet (it was invalid) is reconciled like a new
  one; for a started job ``spec.suspend`` is applied to the RayJob and any other change is
  refused (Warning event; the ``SpecApplied`` condition stays False until the change is reverted).
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

from ppojob_operator import k8s, metrics
from ppojob_operator.api import GROUP, PLURAL, VERSION, PPOJob, Problem, SpecError
from ppojob_operator.api import validate_manifest as _validate
from ppojob_operator.builders import JOB_LABEL, build_children, check_job
from ppojob_operator.scheduling import effective_scheduler
from ppojob_operator.status import changed_fields, desired_status, invalid_status, status_patch

log = logging.getLogger(__name__)


@dataclass
class OperatorConfig:
    """Operator-wide settings (from the command line)."""

    gang_default: str | None = None
    entrypoint: str | None = None
    max_workers: int = 16


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
    from ppojob_operator.api import PPOJobSpec, dump

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


def _owner_key(rayjob: dict[str, Any]) -> Key | None:
    meta = rayjob.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == "PPOJob":
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
        base = state.written.get(key) or body.get("status") or {}
        if problems:
            desired = invalid_status(problems, generation=generation, previous=base, now=_now())
        elif rj is None or job is None:
            return False  # the create handler writes the first status
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


async def reconcile_children(state: State, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Create (or find) every child of a PPOJob, then write its status. Idempotent.

    The children the RayJob's pods need are created concurrently, the RayJob after them."""
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    state.jobs.setdefault(key, body)
    job, problems = parse(body)
    if job is None:
        msg = "; ".join(str(p) for p in problems)
        await _event_once(state, body, "Warning", "InvalidSpec", msg)
        await sync_status(state, key)
        return []
    children = build_children(
        job,
        namespace=key[0],
        uid=meta.get("uid"),
        gang_default=state.config.gang_default,
        entrypoint=state.config.entrypoint,
    )
    try:
        made = [o for o, _ in await asyncio.gather(*map(k8s.acreate_or_get, children[:-1]))]
        made.append((await k8s.acreate_or_get(children[-1]))[0])
    except k8s.ChildConflict as exc:
        await k8s.apost_event(body, "Warning", "ChildConflict", str(exc))
        raise kopf.PermanentError(str(exc)) from None
    rayjob = made[-1]
    if not rayjob.get("metadata", {}).get("annotations"):
        rayjob = children[-1]  # an emulator/server that dropped fields: fall back to ours
    await sync_status(state, key, rayjob=rayjob)
    return made


async def apply_spec_change(
    state: State, body: dict[str, Any], old: dict[str, Any] | None, new: dict[str, Any] | None
) -> None:
    """A spec change: suspend/resume the RayJob; refuse (visibly) anything else."""
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
    suspend = job.spec.suspend
    rj = state.rayjobs.get(key)
    differs = rj is None or bool((rj.get("spec") or {}).get("suspend")) != suspend
    if (
        differs
        and await k8s.apatch(
            "ray.io/v1", "RayJob", key[0], status["rayJobName"], {"spec": {"suspend": suspend}}
        )
        is not None
    ):
        if rj is not None:
            rj.setdefault("spec", {})["suspend"] = suspend
        await _event_once(
            state,
            body,
            "Normal",
            "SuspendChanged",
            f"RayJob {status['rayJobName']} " + ("suspended" if suspend else "resumed"),
        )
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
            return
        state.rayjobs[key] = plain
        await sync_status(state, key)

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
        registry = kopf.SmartOperatorRegistry()
    return register(registry, state)


def run(
    *,
    namespaces: list[str] | None = None,
    clusterwide: bool = False,
    config: OperatorConfig | None = None,
    host: str | None = None,
    health_port: int = 0,
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
    liveness = f"http://0.0.0.0:{health_port}/healthz" if health_port else None

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
