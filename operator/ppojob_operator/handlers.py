"""kopf wiring only: each handler is a few lines that route an event to the reconcile modules.

- ``on.create`` / ``on.resume`` PPOJob -> ``reconcile.reconcile_children`` (admit, plan the
  attempt, build the children, ensure them, record: one status write).
- ``on.update`` of ``spec`` -> ``watch.apply_spec_change`` (suspend/resume, or refused).
- ``on.event`` PPOJob, RayJob, pods -> ``watch`` (level-triggered status sync: ``sync.py``).
- DELETE events of every child kind -> ``reconcile.heal`` (self-healing).

Where the rest lives: ``state.py`` (what is known of each job between events), ``sync.py``
(desired status -> write -> follow-ups), ``suspend.py`` (spec.suspend of a started job),
``timers.py`` (retry backoff, restart delay, queue timeout).

No deletion handler and no finalizer: children are garbage-collected through their controller
ownerReferences. kopf runs standalone (no peering: ``leader.py`` elects one operator on a Lease
instead); its own events are posted only for warnings.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from ppojob_api.spec import GROUP, PLURAL, VERSION
from ppojob_operator import capabilities, k8s, leader, metrics, pods, reconcile, watch
from ppojob_operator.builders import JOB_LABEL, MANAGED_BY
from ppojob_operator.state import OperatorConfig, State, plain

log = logging.getLogger(__name__)

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


def register(registry: kopf.OperatorRegistry, state: State) -> kopf.OperatorRegistry:
    """Register the handlers (bound to ``state``) in ``registry``. (kopf names a handler by its
    qualified name, kept in the PPOJob's progress annotations: they stay defined here.)"""

    @kopf.on.startup(registry=registry)
    def _configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings, state.config.max_workers)

    @kopf.on.startup(registry=registry)
    async def _detect_kuberay(**_: Any) -> None:
        await detect_kuberay(state)

    @kopf.on.startup(registry=registry)
    async def _check_crd(**_: Any) -> None:
        await check_crd()

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    @metrics.instrumented("ppojob_event")
    async def _ppojob_event(type: str | None, body: Any, **_: Any) -> None:
        await watch.on_ppojob_event(state, type, plain(body))

    @kopf.on.event("ray.io", "v1", "rayjobs", labels={JOB_LABEL: kopf.PRESENT}, registry=registry)
    @metrics.instrumented("rayjob_event")
    async def _rayjob_event(type: str | None, body: Any, **_: Any) -> None:
        await watch.on_rayjob_event(state, type, plain(body))

    def _waiting(body: Any, type: str | None = None, **_: Any) -> bool:
        return pod_waiting(state, body, type)

    # Only pods with a container waiting or not placed (filtered before kopf invokes and logs
    # the handler)
    @kopf.on.event("", "v1", "pods", labels=OURS, when=_waiting, registry=registry)
    @metrics.instrumented("pod_event")
    async def _pod_event(type: str | None, body: Any, **_: Any) -> None:
        await watch.on_pod_event(state, plain(body), type)

    for group, version, plural in CHILD_KINDS:
        # Only deletions matter; filtered before kopf invokes (and logs) the handler, since
        # every child's creation is an event here too (four per job).
        @kopf.on.event(group, version, plural, id=f"heal-{plural}", **_deletions(registry))
        async def _child_event(type: str | None, body: Any, **_: Any) -> None:
            await watch.on_child_event(state, type, plain(body))

    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    async def _resume(body: Any, **_: Any) -> None:
        await watch.on_resume(state, plain(body))

    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @metrics.instrumented("create")
    async def _create(body: Any, **_: Any) -> None:
        await reconcile.reconcile_children(state, plain(body))

    @kopf.on.update(GROUP, VERSION, PLURAL, field="spec", registry=registry)
    @metrics.instrumented("update")
    async def _update(body: Any, old: Any, new: Any, **_: Any) -> None:
        await watch.apply_spec_change(state, plain(body), dict(old or {}), dict(new or {}))

    return registry


OURS = {JOB_LABEL: kopf.PRESENT}
"""The label selector of every object of our jobs (children and KubeRay's pods)."""


def _deleted(type: str | None, **_: Any) -> bool:
    return type == "DELETED"


def _deletions(registry: kopf.OperatorRegistry) -> dict[str, Any]:
    """The keywords of a child kind's watch: our objects, deletions only."""
    return {"labels": OURS, "when": _deleted, "registry": registry}


def configure(settings: kopf.OperatorSettings, max_workers: int) -> None:
    """kopf's settings for this operator (at start-up)."""
    settings.posting.level = logging.WARNING  # kopf's own events: warnings only
    settings.execution.max_workers = max_workers
    settings.watching.connect_timeout = 60
    settings.watching.server_timeout = 600
    settings.networking.request_timeout = 60
    settings.batching.batch_window = 0.005  # default 0.1 s delays every job by 100 ms
    # Handler progress in annotations only: kopf's default also keeps it in status.kopf,
    # which our CRD does not declare, and deep-copies the body once more per event to do so.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage()
    # Children are watched server-side filtered: only the objects this operator made.
    for group, plural in CHILD_RESOURCES:
        selector = f"app.kubernetes.io/managed-by={MANAGED_BY}"
        settings.watching.label_selectors[group, plural] = selector
    # Pods (KubeRay's, of our jobs only): the key of the label, no value
    settings.watching.label_selectors["", "pods"] = JOB_LABEL


async def detect_batch_scheduler(state: State) -> None:
    """``--kuberay-batch-scheduler=auto``: KubeRay's batchScheduler from its Deployment in
    ``--kuberay-namespace`` (and the ConfigMap of its ``--config`` file), read with the chart's
    Role in that namespace only. Unknown (none found, several that disagree, unreadable): not
    checked, and said so."""
    cfg = state.config
    if not cfg.detect_batch_scheduler:
        return
    ns = cfg.kuberay_namespace
    try:
        deployments = await k8s.alist("apps/v1", "Deployment", ns) or []
        maps: dict[str, dict[str, Any]] = {}
        for dep in deployments:
            pod = dep.get("spec", {}).get("template", {}).get("spec", {})
            for vol in pod.get("volumes") or []:
                name = (vol.get("configMap") or {}).get("name")
                if name and name not in maps:
                    maps[name] = await k8s.aget("v1", "ConfigMap", ns, name) or {}
    except Exception as exc:  # RBAC or network: do not refuse jobs on a guess
        log.warning(
            "cannot read KubeRay's Deployment in namespace %s (%s); its batch scheduler is not "
            "checked",
            ns,
            exc,
        )
        return
    found = capabilities.kuberay_batch_scheduler_of(deployments, maps)
    cfg.kuberay_batch_scheduler = found
    if found is None:
        log.warning(
            "no single KubeRay operator Deployment found in namespace %s "
            "(--kuberay-namespace); its batch scheduler is not checked",
            ns,
        )
    else:
        log.info("KubeRay's batch scheduler (Deployment in %s): %s", ns, found or "none")


async def detect_kuberay(state: State) -> None:
    """Whether the installed KubeRay supports SidecarMode (unless the command line said), and
    its batch scheduler (``--kuberay-batch-scheduler=auto``)."""
    await detect_batch_scheduler(state)
    cfg = state.config
    try:
        crd = await k8s.aget(
            "apiextensions.k8s.io/v1", "CustomResourceDefinition", "", "rayjobs.ray.io"
        )
    except Exception as exc:  # RBAC or network: do not refuse jobs on a guess
        log.warning(
            "cannot read the RayJob CRD (%s); SidecarMode and token authentication support "
            "not checked (token authentication: %s)",
            exc,
            "on (--ray-auth=token)" if cfg.dashboard_auth else "off",
        )
        return
    cfg.kuberay_1_6 = capabilities.dashboard_auth_supported(crd)
    if cfg.dashboard_auth and cfg.kuberay_1_6 is False:
        log.warning(
            "--ray-auth=token, but the installed KubeRay predates 1.6 (no authOptions in the "
            "RayJob CRD): the API server drops authOptions and the jobs' Ray clusters run "
            "without token authentication"
        )
    if cfg.dashboard_auth is None:
        cfg.dashboard_auth = bool(cfg.kuberay_1_6)
        log.info(
            "Ray token authentication of each job's dashboard and RPCs: %s",
            "on (KubeRay authOptions)"
            if cfg.dashboard_auth
            else "off (the installed KubeRay predates 1.6: no authOptions in the RayJob CRD)",
        )
    if cfg.sidecar_supported is not None:
        return
    state.config.sidecar_supported = capabilities.sidecar_supported(crd)
    if state.config.sidecar_supported is False:
        log.warning(
            "the installed RayJob CRD predates KubeRay 1.5.0: jobs with submissionMode "
            "SidecarMode are refused (reason KubeRayTooOld)"
        )


async def check_crd() -> None:
    """Compare the installed PPOJob CRD's schema hash with this operator's: when stale, a
    warning in the log, a Warning event on the CRD and ``ppojob_crd_stale`` 1 (else 0)."""
    from ppojob_api.crd import build_crd, schema_hash

    expected = schema_hash(build_crd()["spec"])
    try:
        crd = await k8s.aget(
            "apiextensions.k8s.io/v1", "CustomResourceDefinition", "", f"{PLURAL}.{GROUP}"
        )
    except Exception as exc:  # RBAC or network: say so, do not guess
        log.warning("cannot read the PPOJob CRD (%s); its schema hash is not checked", exc)
        return
    why = capabilities.crd_staleness(crd, expected)
    metrics.CRD_STALE.set(1 if why else 0)
    if why is None or crd is None:
        return
    log.warning("%s", why)
    await k8s.apost_event(crd, "Warning", "StaleCRD", why)


def pod_waiting(state: State, body: Any, type: str | None = None) -> bool:
    """Whether a pod's event matters: deleted, a container waiting, a failed job submitter
    (``pods.failed_submitter``), not placed, or placed since the scheduler could not (filtered
    before kopf invokes and logs the handler)."""
    if type == "DELETED" or (body.get("metadata") or {}).get("deletionTimestamp"):
        return True
    status = body.get("status") or {}
    statuses = [
        *(status.get("containerStatuses") or []),
        *(status.get("initContainerStatuses") or []),
    ]
    if any("waiting" in (cs.get("state") or {}) for cs in statuses):
        return True
    if pods.failed_submitter(body) is not None:
        return True
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return True  # the scheduler cannot place it
    meta = body.get("metadata") or {}
    st = state.get((meta.get("namespace") or "", (meta.get("labels") or {}).get(JOB_LABEL)))
    return st is not None and meta.get("name") in st.unplaced  # placed since


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
    elector: leader.Elector | None = None,
) -> None:
    """Run the operator until ``stop_flag`` is set (blocking; owns its event loop). With
    ``elector``, only while it holds its Lease (``leader.py``): it waits first, serving
    ``/healthz``, and exits the process when the Lease is lost."""
    state = State(config or OperatorConfig())
    k8s.configure(host)
    registry = build_registry(state, host)
    settings = kopf.OperatorSettings()
    settings.posting.enabled = post_events
    liveness = f"http://{listen_address}:{health_port}/healthz" if health_port else None

    async def main() -> None:
        try:
            if elector is not None:
                await leader.standby(elector, listen_address, health_port)
            operate = kopf.operator(
                registry=registry,
                settings=settings,
                standalone=True,
                clusterwide=clusterwide,
                namespaces=namespaces or [],
                liveness_endpoint=liveness,
                stop_flag=stop_flag,
                ready_flag=ready_flag,
            )
            await (operate if elector is None else leader.lead(elector, operate))
        finally:
            await k8s.aclose()

    asyncio.run(main())
