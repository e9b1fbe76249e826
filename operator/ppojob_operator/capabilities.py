"""Pure: what this cluster's KubeRay can run, and which jobs the operator must refuse for it.

Two facts about the KubeRay installation decide whether a valid PPOJob can run at all:

- **SidecarMode.** ``submissionMode: SidecarMode`` exists since KubeRay 1.5.0; a 1.3/1.4
  controller accepts the field (the CRD has no enum for it) and never submits, holding every
  pod. The operator reads the installed RayJob CRD at start-up: KubeRay 1.5.0 replaced
  ``spec.deletionPolicy`` with ``spec.deletionStrategy`` in the same release that added
  SidecarMode (``ray-operator/apis/ray/v1/rayjob_types.go`` at v1.4.2 and v1.5.0), so a CRD
  without ``spec.deletionStrategy`` is older than 1.5.0. (A CRD newer than its controller cannot
  be told apart; keep them from one release, as KubeRay's chart does.) Such a job is refused with
  reason ``KubeRayTooOld``; ``submissionMode: K8sJobMode`` works with any KubeRay.
- **batchScheduler.** One per KubeRay installation; see
  :func:`ppojob_operator.scheduling.kuberay_disagreement` (reason ``BatchSchedulerMismatch``).

A job whose gang scheduler is the operator's default (``gangScheduler`` unset) is also checked
against that default here (``kueue`` needs ``spec.scheduling.queue``, a LocalQueue name;
``none`` takes no queue):
``ppojob validate`` cannot know the default, so it judges only the spec.
"""

from __future__ import annotations

import re
from typing import Any

from ppojob_api.checks.podsecurity import ENFORCE_LABEL, check_pod_security, required_level
from ppojob_api.metadata import check_kueue_queue
from ppojob_api.spec import PPOJob
from ppojob_operator.scheduling import effective_scheduler, kuberay_disagreement

SCHEDULER_CRDS = {
    "kueue": "workloads.kueue.x-k8s.io",
    "scheduler-plugins": "podgroups.scheduling.x-k8s.io",
    "volcano": "podgroups.scheduling.volcano.sh",
    "kai": "queues.scheduling.run.ai",
}
"""The CRD each gang scheduler's objects need: Kueue's Workloads (Kueue makes one per RayJob and
admits it), scheduler-plugins' PodGroups (the operator makes them), Volcano's PodGroups (KubeRay
makes them), KAI's Queues (the job's pods name one). Without it nothing would ever admit or
place the job: it would wait forever.
YuniKorn has no CRD (its pods wait; ``spec.scheduling.queueTimeoutSeconds`` bounds that)."""

SIDECAR_MARKER = "deletionStrategy"
"""A ``RayJob.spec`` property present in KubeRay's CRD from 1.5.0 on (the SidecarMode release)."""


def _has_property(rayjob_crd: dict[str, Any] | None, *path: str) -> bool | None:
    """Whether the v1 schema of the RayJob CRD has the property at ``path`` (names of nested
    properties under ``spec``, the last one looked for); None: no CRD, or unreadable."""
    if not rayjob_crd:
        return None
    for version in (rayjob_crd.get("spec") or {}).get("versions") or []:
        if version.get("name") != "v1":
            continue
        try:
            props = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
            for name in path[:-1]:
                props = props[name]["properties"]
        except (KeyError, TypeError):
            return None
        return path[-1] in props
    return None


def sidecar_supported(rayjob_crd: dict[str, Any] | None) -> bool | None:
    """Whether the installed RayJob CRD is from KubeRay >= 1.5.0 (None: no CRD / unreadable)."""
    return _has_property(rayjob_crd, SIDECAR_MARKER)


AUTH_MARKER = "authOptions"
"""A ``RayJob.spec.rayClusterSpec`` property present in KubeRay's CRD from 1.6.0 on: token
authentication of the Ray dashboard (and Ray's own RPCs). With ``authOptions.mode: token``
KubeRay makes a Secret per RayCluster holding a random token, puts it (``RAY_AUTH_MODE``,
``RAY_AUTH_TOKEN``) into every Ray container, the submitter and the ``wait-gcs-ready`` init
container, and sends it on its own dashboard calls (``ray-operator/controllers/ray`` at v1.6.1:
``common/pod.go`` ``configureTokenAuth``, ``rayjob_controller.go``
``configureSubmitterContainer``, ``raycluster_controller.go`` ``reconcileAuthSecret``)."""

AUTH_MIN_RAY = (2, 52)
"""KubeRay refuses ``authOptions.mode: token`` for a ``rayVersion`` below 2.52.0
(``utils/validation.go`` at v1.6.1): Ray reads ``RAY_AUTH_MODE`` from that release on."""


def dashboard_auth_supported(rayjob_crd: dict[str, Any] | None) -> bool | None:
    """Whether the installed RayJob CRD has ``spec.rayClusterSpec.authOptions`` (KubeRay >=
    1.6.0; None: no CRD / unreadable)."""
    return _has_property(rayjob_crd, "rayClusterSpec", AUTH_MARKER)


def ray_supports_auth(ray_version: str) -> bool:
    """Whether a ``rayVersion`` (``2.60.0``) is one KubeRay enables token authentication for
    (:data:`AUTH_MIN_RAY`); an unparsable one is not."""
    parts = re.findall(r"\d+", ray_version or "")[:2]
    if len(parts) < 2:
        return False
    return (int(parts[0]), int(parts[1])) >= AUTH_MIN_RAY


KUBERAY_DEPLOYMENT = "kuberay-operator"
"""The name, and the ``app.kubernetes.io/name`` label, of KubeRay's operator Deployment (its
Helm chart's)."""
_TRUE = {"true", "1", "t", "T", "TRUE", "True"}


def _kuberay_flags(args: list[str]) -> tuple[str, str]:
    """(batch scheduler, config file) from KubeRay's command line, read the way its main.go
    (Go's flag package) reads them: ``--batch-scheduler[=]NAME``, ``--enable-batch-scheduler
    [=true]`` (volcano), ``--config[=]FILE``; one or two dashes."""
    name = config = ""
    it = iter(args)
    for arg in it:
        flag, eq, value = arg.lstrip("-").partition("=")
        if not arg.startswith("-"):
            continue
        if flag == "batch-scheduler":
            name = value if eq else next(it, "")
        elif flag == "config":
            config = value if eq else next(it, "")
        elif flag == "enable-batch-scheduler" and (not eq or value in _TRUE):
            name = "volcano"
    return name, config


def kuberay_batch_scheduler_of(
    deployments: list[dict[str, Any]], config_maps: dict[str, dict[str, Any]]
) -> str | None:
    """KubeRay's ``batchScheduler`` from its operator Deployments (those named or labelled
    ``app.kubernetes.io/name`` :data:`KUBERAY_DEPLOYMENT`) in KubeRay's namespace: "" (none),
    a scheduler's name, or None (unknown: no KubeRay Deployment, several that disagree, or a
    ``--config`` file not found in ``config_maps``, by ConfigMap name). With ``--config`` KubeRay
    ignores its other flags and reads ``batchScheduler`` / ``enableBatchScheduler`` from the
    file (KubeRay's chart mounts it from a ConfigMap)."""
    found: set[str | None] = set()
    for dep in deployments:
        meta = dep.get("metadata") or {}
        labels = meta.get("labels") or {}
        if KUBERAY_DEPLOYMENT not in (meta.get("name"), labels.get("app.kubernetes.io/name")):
            continue
        pod = ((dep.get("spec") or {}).get("template") or {}).get("spec") or {}
        containers = pod.get("containers") or [{}]
        named = [c for c in containers if c.get("name") == KUBERAY_DEPLOYMENT]
        c = (named or containers)[0]
        args = [str(a) for a in (c.get("command") or []) + (c.get("args") or [])]
        name: str | None
        name, config = _kuberay_flags(args)
        if config:
            name = _from_config_file(config, c, pod, config_maps)
        found.add(name)
    return found.pop() if len(found) == 1 else None


def _from_config_file(
    path: str, container: dict[str, Any], pod: dict[str, Any], maps: dict[str, dict[str, Any]]
) -> str | None:
    import posixpath

    import yaml

    directory, base = posixpath.split(path)
    for mount in container.get("volumeMounts") or []:
        if mount.get("mountPath", "").rstrip("/") != directory:
            continue
        for vol in pod.get("volumes") or []:
            cm = vol.get("configMap") or {}
            if vol.get("name") != mount.get("name") or not cm:
                continue
            text = ((maps.get(cm.get("name", "")) or {}).get("data") or {}).get(base)
            if not text:
                return None
            cfg = yaml.safe_load(text) or {}
            return "volcano" if cfg.get("enableBatchScheduler") else cfg.get("batchScheduler") or ""
    return None


CRD_FIX = "kubectl apply --server-side --force-conflicts -f crds/"


def crd_staleness(installed: dict[str, Any] | None, expected_hash: str) -> str | None:
    """Why the installed PPOJob CRD is not the one this operator was built with (its
    ``ppojob.io/schema-hash`` annotation differs, or it has none: older than the annotation);
    None when it is the same. Helm installs a chart's ``crds/`` once and never upgrades them,
    so after ``helm upgrade`` the API server may keep validating, defaulting and pruning with an
    old schema: new fields are silently dropped."""
    from ppojob_api.crd import SCHEMA_HASH_ANNOTATION

    if installed is None:
        return None  # kopf itself waits for the CRD
    annotations = (installed.get("metadata") or {}).get("annotations") or {}
    have = annotations.get(SCHEMA_HASH_ANNOTATION)
    if have == expected_hash:
        return None
    name = (installed.get("metadata") or {}).get("name", "ppojobs.ppojob.io")
    what = f"schema hash {have}" if have else f"no {SCHEMA_HASH_ANNOTATION} annotation"
    return (
        f"the installed CustomResourceDefinition {name} is stale ({what}; this operator's is "
        f"{expected_hash}): Helm never upgrades a chart's crds/, so the API server validates, "
        "defaults and prunes PPOJobs with an older schema and may drop fields this operator "
        f"reads. Update it from the chart of this release: {CRD_FIX} "
        "(charts/ppojob-operator/crds/)"
    )


def refusal(
    job: PPOJob,
    *,
    gang_default: str | None,
    kuberay_batch_scheduler: str | None,
    sidecar: bool | None,
    missing_crd: str | None = None,
    kuberay_1_6: bool | None = None,
) -> tuple[str, str] | None:
    """(reason, message) when this installation cannot run the job; None when it can.
    ``missing_crd``: the job's gang scheduler's CRD (:data:`SCHEDULER_CRDS`), found missing."""
    sched = job.spec.scheduling
    scheduler = effective_scheduler(job, gang_default)
    if missing_crd is not None:
        return (
            "SchedulerNotInstalled",
            f"the gang scheduler is {scheduler}, but this cluster has no CustomResourceDefinition "
            f"{missing_crd}: {scheduler} is not installed, and nothing would ever admit or place "
            "the job. Install it (see docs/gang-scheduling.md), or set "
            "spec.scheduling.gangScheduler to one that is",
        )
    if sched.gang_scheduler is None:
        if scheduler == "kueue" and not sched.queue:
            return (
                "QueueRequired",
                "the operator's default gang scheduler is kueue, which needs a LocalQueue: set "
                "spec.scheduling.queue (or spec.scheduling.gangScheduler)",
            )
        bad_queue = check_kueue_queue(sched.queue) if scheduler == "kueue" else []
        if bad_queue:
            return "InvalidQueue", f"the operator's default gang scheduler is kueue: {bad_queue[0]}"
        if scheduler != "kueue" and sched.topology is not None:
            return (
                "NotKueue",
                f"spec.scheduling.topology is Kueue's Topology-Aware Scheduling, but the "
                f"operator's default gang scheduler is {scheduler}: set "
                "spec.scheduling.gangScheduler: kueue, or remove spec.scheduling.topology",
            )
        if scheduler != "kueue" and sched.workload_priority_class:
            return (
                "NotKueue",
                f"spec.scheduling.workloadPriorityClass is Kueue's, but the operator's default "
                f"gang scheduler is {scheduler}: set spec.scheduling.gangScheduler: kueue, or use "
                "spec.scheduling.priorityClassName",
            )
        if scheduler == "none" and sched.queue:
            return (
                "NoGangScheduler",
                "spec.scheduling.queue is set but the operator has no default gang scheduler: "
                "set spec.scheduling.gangScheduler",
            )
    why = kuberay_disagreement(scheduler, kuberay_batch_scheduler)
    if why:
        return "BatchSchedulerMismatch", why
    if scheduler == "kai":
        # KubeRay requeues such a RayJob with its error, writing no status: refuse it here
        if kuberay_1_6 is False:
            return (
                "KubeRayTooOld",
                "the gang scheduler is kai, which needs KubeRay >= 1.6, but the installed "
                "RayJob CRD is older (no spec.rayClusterSpec.authOptions): KubeRay 1.5 answers "
                'every RayJob under kai-scheduler with "currently only RayCluster is supported". '
                "Upgrade KubeRay to 1.6 or newer, or choose another gang scheduler",
            )
        if job.spec.submission_mode == "K8sJobMode":
            return (
                "KaiNeedsSidecarMode",
                "the gang scheduler is kai, and KubeRay refuses submissionMode K8sJobMode under "
                "kai-scheduler (its submitter pod is made after the Ray cluster, outside the "
                "gang): set spec.submissionMode: SidecarMode",
            )
        if not sched.queue:
            return (
                "QueueRequired",
                "the gang scheduler is kai, which needs a KAI Queue: set spec.scheduling.queue",
            )
    if job.spec.submission_mode == "SidecarMode" and sidecar is False:
        return (
            "KubeRayTooOld",
            "submissionMode SidecarMode needs KubeRay >= 1.5.0, but the installed RayJob CRD is "
            "older (no spec.deletionStrategy): KubeRay would accept the RayJob and never submit "
            "the trainer. Upgrade KubeRay to 1.5.0 or newer, or set spec.submissionMode: "
            "K8sJobMode",
        )
    return None


MULTIKUEUE_CONTROLLER = "kueue.x-k8s.io/multikueue"
"""The ``controllerName`` of Kueue's MultiKueue AdmissionCheck (``apis/kueue/v1beta2/
multikueue_types.go``, ``MultiKueueControllerName``)."""


def cluster_queue_checks(cluster_queue: dict[str, Any]) -> list[str]:
    """The names of a ClusterQueue's AdmissionChecks (``kueue.x-k8s.io/v1beta2``:
    ``spec.admissionChecksStrategy.admissionChecks[].name``; v1beta1 also had
    ``spec.admissionChecks``, a list of names)."""
    spec = cluster_queue.get("spec") or {}
    rules = (spec.get("admissionChecksStrategy") or {}).get("admissionChecks") or []
    return [r["name"] for r in rules if r.get("name")] + list(spec.get("admissionChecks") or [])


def multikueue_refusal(
    queue: str, cluster_queue: str, checks: dict[str, dict[str, Any] | None]
) -> tuple[str, str] | None:
    """(reason, message) when the job's LocalQueue ``queue`` leads to ClusterQueue
    ``cluster_queue`` with a MultiKueue AdmissionCheck among ``checks`` (name -> the
    AdmissionCheck; None: not found). MultiKueue copies the admitted RayJob to a worker cluster
    and runs it there (Kueue >= 0.10 for RayJob), but the job's other children (the trainer's
    ConfigMap, ServiceAccount and Role, the PodDisruptionBudget, NetworkPolicy, PodGroup) and
    its checkpoint claim live in this cluster, and the trainer reports to this API server: the
    copy could not start, and would be half a job."""
    for name, check in checks.items():
        if ((check or {}).get("spec") or {}).get("controllerName") == MULTIKUEUE_CONTROLLER:
            return (
                "MultiKueueUnsupported",
                f"spec.scheduling.queue {queue} leads to ClusterQueue {cluster_queue}, whose "
                f"admission check {name} is MultiKueue: Kueue would run the RayJob on a worker "
                "cluster, without the job's ConfigMap, ServiceAccount, Role, checkpoint claim "
                "and other objects, which stay in this cluster. Use a LocalQueue whose "
                "ClusterQueue has no MultiKueue admission check (or install ppojob on the "
                "worker cluster and submit the PPOJob there)",
            )
    return None


def pod_security_refusal(job: PPOJob, namespace: str, level: str | None) -> tuple[str, str] | None:
    """(reason, message) when the namespace's enforced Pod Security ``level`` (its
    ``pod-security.kubernetes.io/enforce`` label; None: none) would refuse the job's pods:
    PodSecurity admission refuses a pod KubeRay creates, which the RayJob's status never
    says (the Ray cluster just never comes up). None when the level admits them."""
    if not level or level == "privileged":
        return None
    problems = check_pod_security(job.spec, level)
    if not problems:
        return None
    return (
        "PodSecurityViolation",
        f'namespace {namespace} enforces Pod Security "{level}" ({ENFORCE_LABEL}), which would '
        f'refuse the job\'s pods (the job needs "{required_level(job.spec)}"): '
        + "; ".join(str(p) for p in problems),
    )
