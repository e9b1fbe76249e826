"""Pure builders: PPOJob -> the children the operator creates (plain dicts, no API calls).

Children, in creation order (the RayJob last, so everything its pods need exists first):

1. ConfigMap ``<job>-trainer``: ``trainer.yaml``, the trainer's config (the training half).
2. ServiceAccount ``<job>-trainer``: the identity of every trainer pod.
3. Role + RoleBinding ``<job>-trainer``: ``get`` and ``patch`` on ``ppojobs/status`` of this job
   only (``resourceNames``), so the trainer can report progress and nothing else.
4. PodGroup ``<job>`` (scheduler-plugins only; see ``scheduling``).
5. RayJob ``<job>``: a head group and one worker group per role with pods of its own.

Every child carries a controller ownerReference to its PPOJob (when the PPOJob's uid is known;
``ppojob render`` without a cluster leaves it out), so deleting the PPOJob garbage-collects them.

Ray custom resources: each worker pod advertises ``ppojob-<role>: <workers on this pod>`` (its
GPUs, or 1 on a CPU pod) in ``rayStartParams.resources``, so the trainer can pin each role's
workers to that role's pods (see :data:`ROLE_RESOURCE` and the trainer's
``placement.role_resource``). The head advertises none of them, only ``ppojob-head: 1``, and
``num-cpus: "0"``: it runs the PPO driver, which holds no resources, so no bundle or task of the
job can land there. Worker pods advertise the CPUs and GPUs KubeRay derives from their limits
(CPUs rounded up), never fewer than the trainer's bundles on the pod ask for.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from ppojob_api.base import dump
from ppojob_api.checks.sizes import quantity_bytes
from ppojob_api.problems import Problem
from ppojob_api.spec import API_VERSION, GROUP, KIND, PLURAL, PPOJob
from ppojob_api.validation import trainer_config_from_spec
from ppojob_operator import scheduling

MANAGED_BY = "ppojob-operator"
JOB_LABEL = "ppojob.io/job"
ROLE_LABEL = "ppojob.io/role"
APPLIED_SPEC_ANNOTATION = "ppojob.io/applied-spec"
ATTEMPT_ANNOTATION = "ppojob.io/attempt"  # restarts.ATTEMPT_ANNOTATION
ROLE_RESOURCE = "ppojob-{role}"
"""Name of the Ray custom resource marking a role's pods (``ppojob-actor``, ...)."""

CONFIG_DIR = "/etc/ppojob"
CONFIG_KEY = "trainer.yaml"
OUTPUT_DIR = "/tmp/ppojob-out"
RUN_AS_USER = 10001  # the `ppojob` user of images/trainer.Dockerfile (owns HOME and /workspace)
MAX_NAME_LENGTH = 47  # KubeRay: RayJob names <= 47 characters (it appends 6 for the cluster)
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

# libyaml's emitter when present (same output as yaml.safe_dump, several times faster)
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

ENV_JOB_NAME = "PPOJOB_NAME"
ENV_JOB_NAMESPACE = "PPOJOB_NAMESPACE"
ENV_ROLE = "PPOJOB_ROLE"
ENV_GRACE = "PPOJOB_GRACE_SECONDS"  # ppojob_trainer.preemption.GRACE_ENV
ENV_STOP_FILE = "PPOJOB_STOP_FILE"  # ppojob_trainer.preemption.STOP_FILE_ENV
ENV_RUNNING_FILE = "PPOJOB_RUNNING_FILE"  # ppojob_trainer.preemption.RUNNING_FILE_ENV
ENV_RAY_DRAIN = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
"""Ray's bound on the drain that ``ray start --block`` (a worker container's first process) runs
on SIGTERM before it kills the node's processes (Ray's default: 30 s). A worker pod gets the
grace period here, so its raylet and actors live until the driver, which hears of the drain from
the GCS at once, has finished or abandoned its step and written the checkpoint (and let its actors
go: a draining node with no leases left ends at once), or until kubelet's SIGKILL. A worker pod's
preStop hook (:data:`WORKER_PRESTOP_COMMAND`) holds the SIGTERM back for at most a second. See
docs/trainer-guide.md, "Preemption"."""
STOP_FILE = "/tmp/ppojob-stop"
RUNNING_FILE = "/tmp/ppojob-running"
PRESTOP_COMMAND = [
    "sh",
    "-c",
    f"touch {STOP_FILE}; while [ -e {RUNNING_FILE} ]; do sleep 1; done",
]
"""The head's preStop hook: ask the trainer (the Ray job's driver, which is not the container's
first process and never sees its SIGTERM) to stop, and wait while it finishes its step and writes
its checkpoint. kubelet runs it inside the pod's grace period, before the SIGTERM."""
WORKER_EXIT_WAIT_S = 5
WORKER_PRESTOP_PROGRAM = f"""import os, signal, time
address = os.environ.get("RAY_ADDRESS", "")
port = address.rpartition(":")[2]
def connections():
    # (state, remote port) of this pod's TCP connections, from its network namespace's tables
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            out.append((fields[3], int(fields[2].rpartition(":")[2], 16)))
    return out
seen = connections() if "://" not in address and port.isdigit() else []
# the tables are real (this node's raylet listens: state 0A) and no connection to the GCS port
# is established (state 01): the GCS closed them all, the head is gone
listening = any(state == "0A" for state, _ in seen)
if listening and not any(state == "01" and rport == int(port) for state, rport in seen):
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{{pid}}/cmdline", "rb") as f:
                if f.read().split(b"\\0")[0].endswith(b"/raylet"):
                    os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
    # `ray start --block` sees its raylet die within a second and ends the container (and this
    # hook with it); the SIGTERM that would start its drain must not come before that
    time.sleep({WORKER_EXIT_WAIT_S})
"""
WORKER_PRESTOP_COMMAND = [
    "sh",
    "-c",
    'python -c "$0" >/dev/null 2>&1; exit 0',
    WORKER_PRESTOP_PROGRAM,
]
"""A worker pod's preStop hook: when the pod holds no established connection to the GCS port
(``RAY_ADDRESS``'s, which KubeRay sets in a worker's container), the head's GCS has closed them
all: it is gone. Then kill the node's raylet and wait (at most :data:`WORKER_EXIT_WAIT_S`):
``ray start --block``, the container's first process, which checks its children every second,
ends the container, and the hook with it (kubelet records that as a ``FailedPreStopHook`` event
on the pod being torn down). Without it, a worker pod deleted after its head (a restart tears
the old cluster down) waits out its grace period: the SIGTERM handler's drain request to the
gone GCS is retried until ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S`` (:data:`ENV_RAY_DRAIN`, the
grace period), and the pod holds its CPUs and GPUs from the next attempt meanwhile (measured on
the real node: more than 97 s of 120). No new connection is tried, and the head's Service is not
looked up: a whole cluster's deletion (a suspend) removes the Service (a ClusterIP one's address
stops answering new connections) while the head still lives in its own preStop, writing the
checkpoint these workers take part in, and their established connections to it stand. With the
head up the hook returns at once and the drain goes on as before; tables it cannot read (no
listening socket in them) or an address with a scheme leave the node alone. It never fails (a
missing ``python`` included)."""
SUBMITTER_CONTAINER = "ray-job-submitter"
"""KubeRay's submitter container (``utils.SubmitterContainerName``): in SidecarMode the container
it adds to the head pod (it waits for the dashboard, runs ``ray job submit`` and follows the job),
in K8sJobMode the one of the submitter pod (:func:`submitter_template`)."""
AGENT_PORT = 52365
"""The Ray dashboard agent's HTTP port (KubeRay's ``DefaultDashboardAgentListenPort``; the job's
``rayStartParams`` leave it alone)."""
AGENT_WAIT_S = 180
AGENT_WAIT_PROGRAM = f"""import time, urllib.error, urllib.request
end = time.monotonic() + {AGENT_WAIT_S}
while time.monotonic() < end:
    try:
        urllib.request.urlopen("http://localhost:{AGENT_PORT}/api/healthz", timeout=2)
        break
    except urllib.error.HTTPError as e:
        if e.code != 503:
            break  # an agent without this check (Ray < 2.53) answers: it is up
    except Exception:
        pass
    time.sleep(1)
"""
POSTSTART_COMMAND = ["sh", "-c", 'python -c "$0" >/dev/null 2>&1; exit 0', AGENT_WAIT_PROGRAM]
"""The head's postStart hook (SidecarMode): wait (at most :data:`AGENT_WAIT_S` s by the clock, and
never fail: a failed hook kills the container) until the head's Ray dashboard agent answers its
health check (``localhost``: the agent binds ``::1`` where IPv6 is the loopback). kubelet
starts a pod's containers in order and a container's postStart hook holds back the next one, so
KubeRay's ``ray-job-submitter`` (appended after the Ray container in SidecarMode) starts only then.
Its own wait is for the dashboard's GCS health alone, and the dashboard's job API waits 10 s for
the head's agent (Ray's ``WAIT_AVAILABLE_AGENT_TIMEOUT``) before it answers ``500 No available
agent to submit job``: on a busy node the agent came later than that after a restart, and the
submitter exited 1 with nothing submitted (``pods.failed_submitter``)."""


# ---------------------------------------------------------------------------------------------
# Names, ownership, operator-level checks
# ---------------------------------------------------------------------------------------------
def trainer_name(job_name: str) -> str:
    """Name of the ConfigMap, ServiceAccount, Role and RoleBinding of a job."""
    return f"{job_name}-trainer"


def owner_reference(job_name: str, uid: str) -> dict[str, Any]:
    """A controller ownerReference to the PPOJob (deletion garbage-collects the child)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": job_name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def check_job(job: PPOJob) -> list[Problem]:
    """Problems only the operator sees (the child names KubeRay will accept)."""
    name = job.metadata.name or ""
    problems: list[Problem] = []
    if len(name) > MAX_NAME_LENGTH:
        problems.append(
            Problem(
                "metadata.name",
                f"is {len(name)} characters; KubeRay accepts "
                f"RayJob names of at most {MAX_NAME_LENGTH}",
                "use a shorter name",
            )
        )
    if name and not _DNS1035.fullmatch(name):
        problems.append(
            Problem(
                "metadata.name",
                f"{name!r} is not a DNS-1035 label (KubeRay "
                "needs one: lower case, digits and '-', starting with a letter)",
                "rename the job",
            )
        )
    return problems


def applied_spec(job: PPOJob) -> dict[str, Any]:
    """The part of the spec a started job cannot change (everything but ``suspend``)."""
    spec = dump(job.spec)
    spec.pop("suspend", None)
    return spec


def _meta(name: str, namespace: str, job_name: str, uid: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {"app.kubernetes.io/managed-by": MANAGED_BY, JOB_LABEL: job_name},
    }
    if uid:
        meta["ownerReferences"] = [owner_reference(job_name, uid)]
    return meta


# ---------------------------------------------------------------------------------------------
# ConfigMap, ServiceAccount, Role, RoleBinding
# ---------------------------------------------------------------------------------------------
def trainer_config_yaml(job: PPOJob) -> str:
    """The trainer's config file: the training half of the spec, every field written out.

    Nulls are kept: `valueClip: null` means "off", and dropping it would give the trainer the
    default (0.2). `ppojob run FILE` and `ppojob-train --config` of this file build the same
    config."""
    cfg = trainer_config_from_spec(job.spec, job.metadata.name)
    data = cfg.model_dump(by_alias=True, mode="json")
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)


def config_map(job: PPOJob, namespace: str, uid: str | None = None) -> dict[str, Any]:
    name = job.metadata.name or ""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(trainer_name(name), namespace, name, uid),
        "data": {CONFIG_KEY: trainer_config_yaml(job)},
    }


def service_account(job: PPOJob, namespace: str, uid: str | None = None) -> dict[str, Any]:
    name = job.metadata.name or ""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(trainer_name(name), namespace, name, uid),
    }


def role(job: PPOJob, namespace: str, uid: str | None = None) -> dict[str, Any]:
    name = job.metadata.name or ""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(trainer_name(name), namespace, name, uid),
        "rules": [
            {
                "apiGroups": [GROUP],
                "resources": [f"{PLURAL}/status"],
                "resourceNames": [name],
                "verbs": ["get", "patch"],
            }
        ],
    }


def role_binding(job: PPOJob, namespace: str, uid: str | None = None) -> dict[str, Any]:
    name = job.metadata.name or ""
    tname = trainer_name(name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(tname, namespace, name, uid),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": tname},
        "subjects": [{"kind": "ServiceAccount", "name": tname, "namespace": namespace}],
    }


# ---------------------------------------------------------------------------------------------
# RayJob
# ---------------------------------------------------------------------------------------------
def pod_disruption_budget(job: PPOJob, namespace: str, uid: str | None = None) -> dict[str, Any]:
    """No voluntary eviction of a Ready pod of the job: one lost pod ends the gang's attempt.
    A Running pod that is not Ready (crash-looping) may always be evicted
    (``unhealthyPodEvictionPolicy: AlwaysAllow``: a field since Kubernetes 1.26, on by default
    since 1.27): under the default, IfHealthyBudget, the eviction API refuses it while the job
    is short of healthy pods, so it would block the drain of its node. (Pending and terminated
    pods are evictable either way; Ready pods still block, by design.)

    The budget is ``minAvailable``: every pod the job can have (the head and each worker group
    at its largest), an integer. Kubernetes' disruption controller counts an integer
    ``minAvailable`` from the pods the selector matches, but works out ``maxUnavailable`` (and
    any percentage) from the scale of the pods' controller: a RayCluster has no scale
    subresource, so such a budget never syncs (event CalculateExpectedPodCountFailed, condition
    SyncFailed) and refuses every eviction for that reason instead of its own
    (pkg/controller/disruption, ``getExpectedPodCount``)."""
    name = job.metadata.name or ""
    pods = 1 + sum(scaling_bounds(role, spec)[1] for role, spec in pod_roles(job))
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(name, namespace, name, uid),
        "spec": {
            "minAvailable": pods,
            "selector": {"matchLabels": {JOB_LABEL: name}},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


DASHBOARD_PORT = 8265
"""The Ray dashboard's port (KubeRay's default ``dashboard`` port): its job API submits and
stops jobs, so only the job's own pods and the job submitters reach it."""

KUBERAY_NAMESPACE = "default"
"""Where KubeRay's operator runs unless told (``--kuberay-namespace``, the chart's
``kuberay.namespace``): the namespace KubeRay's documented ``helm install`` puts it in."""

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
"""The label the API server sets on every namespace to its name (Kubernetes >= 1.22); nobody can
give it another value, so a ``namespaceSelector`` on it names exactly one namespace."""


def kuberay_operator_peer(kuberay_namespace: str) -> dict[str, Any]:
    """KubeRay's operator pods (the labels of KubeRay's Helm chart) in KubeRay's namespace only:
    it polls the dashboard for the job's status and stops jobs through it. Scoped to that one
    namespace: any tenant can label a pod of their own ``app.kubernetes.io/name:
    kuberay-operator``, but not put it in KubeRay's namespace."""
    return {
        "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: kuberay_namespace}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}},
    }


@dataclass(frozen=True)
class NetworkPolicySettings:
    """What reaches a job's pods besides the job's own pods (operator-wide: the chart's
    ``kuberay.namespace`` and ``networkPolicy`` values, ``--kuberay-namespace`` and
    ``--network-policy``)."""

    kuberay_namespace: str = KUBERAY_NAMESPACE
    """KubeRay's namespace: its operator pods there reach the dashboard port."""
    dashboard_from: list[dict[str, Any]] = field(default_factory=list)
    """More NetworkPolicyPeers allowed to the dashboard port (e.g. the control plane's addresses
    when KubeRay uses its Kubernetes proxy)."""
    extra_ingress: list[dict[str, Any]] = field(default_factory=list)
    """More NetworkPolicyIngressRules, as written (e.g. a Prometheus scraping Ray's metrics)."""


def network_policy(
    job: PPOJob,
    namespace: str,
    uid: str | None = None,
    settings: NetworkPolicySettings | None = None,
) -> dict[str, Any]:
    """Ingress to the job's pods only from the job's own pods (Ray's GCS, object store, workers,
    NCCL), and to the dashboard's job API also from KubeRay's operator in KubeRay's namespace
    (:func:`kuberay_operator_peer`), from ``settings.dashboard_from``, and from the submitter
    Job KubeRay makes in K8sJobMode (its pods, in the job's namespace, carry the Job
    controller's ``batch.kubernetes.io/job-name``: the RayJob's name). The job's own pods and
    the submitter are selected in the job's namespace only (a ``podSelector`` without a
    ``namespaceSelector``). Enforced by CNIs that implement NetworkPolicy; kubelet probes and
    ``kubectl port-forward`` are not affected."""
    settings = settings or NetworkPolicySettings()
    name = job.metadata.name or ""
    own = {"matchLabels": {JOB_LABEL: name}}
    submitter = {"podSelector": {"matchLabels": {"batch.kubernetes.io/job-name": name}}}
    ingress: list[dict[str, Any]] = [
        {"from": [{"podSelector": own}]},
        {
            "from": [
                submitter,
                kuberay_operator_peer(settings.kuberay_namespace),
                *settings.dashboard_from,
            ],
            "ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}],
        },
        *settings.extra_ingress,
    ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(name, namespace, name, uid),
        "spec": {"podSelector": own, "policyTypes": ["Ingress"], "ingress": ingress},
    }


DNS_PEER: dict[str, Any] = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
}
"""The cluster's DNS pods (kube-dns or CoreDNS: both carry ``k8s-app: kube-dns``)."""
DNS_PORTS = [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]


def sandbox_network_policy(job: PPOJob, namespace: str, uid: str | None = None) -> dict[str, Any]:
    """``roles.sandbox``: egress of the sandbox pods (they run the agent's tool calls) only to
    the job's own pods (Ray's GCS on the head, the other raylets and object stores, the engines
    that call them) and to the cluster's DNS (UDP and TCP 53 of the kube-dns pods); nothing else,
    the internet, the API server and other namespaces included. Egress only: ingress stays as
    the job's NetworkPolicy says. Enforced only by CNIs that implement NetworkPolicy egress
    (Calico, Cilium, ...); elsewhere it is accepted and ignored."""
    name = job.metadata.name or ""
    meta = _meta(name, namespace, name, uid)
    meta["name"] = f"{name}-sandbox"
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {
            "podSelector": {"matchLabels": {JOB_LABEL: name, ROLE_LABEL: "sandbox"}},
            "policyTypes": ["Egress"],
            "egress": [
                {"to": [{"podSelector": {"matchLabels": {JOB_LABEL: name}}}]},
                {"to": [DNS_PEER], "ports": DNS_PORTS},
            ],
        },
    }


def pod_roles(job: PPOJob) -> list[tuple[str, Any]]:
    """(role, role spec) of every role that needs pods of its own, in group order."""
    spec = job.spec
    out: list[tuple[str, Any]] = [("actor", spec.roles.actor)]
    critic = spec.roles.effective_critic(spec.algorithm.needs_critic)
    if critic is not None and not critic.colocate_with_actor:
        out.append(("critic", critic))
    if not spec.roles.rollout.colocate_with_actor:
        out.append(("rollout", spec.roles.rollout))
    if spec.roles.reward is not None:  # reward-model workers: pods of their own, in the gang
        out.append(("reward", spec.roles.reward))
    if spec.roles.sandbox is not None:  # tool-call workers: pods of their own, in the gang
        out.append(("sandbox", spec.roles.sandbox))
    return out


def scaling_bounds(role: str, spec: Any) -> tuple[int, int]:
    """(minReplicas, maxReplicas) of a role's worker group: its replicas, or for elastic rollout
    engines (``roles.rollout.elastic``) their bounds; the gang counts the minimum only."""
    elastic = getattr(spec, "elastic", None) if role == "rollout" else None
    if elastic is None:
        return spec.replicas, spec.replicas
    return elastic.min_replicas, elastic.max_replicas


def _cpu(cpus: float) -> str:
    milli = round(cpus * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def _resources(
    cpus: float,
    memory: str,
    gpus: int,
    extra: dict[str, int] | None = None,
    hugepages: dict[str, str] | None = None,
) -> dict[str, dict[str, str]]:
    res = {"cpu": _cpu(cpus), "memory": memory}
    if gpus:
        res["nvidia.com/gpu"] = str(gpus)
    for name, qty in sorted((extra or {}).items()):
        res[name] = str(qty)
    for size, qty in sorted((hugepages or {}).items()):
        res[f"hugepages-{size}"] = qty
    return {"requests": dict(res), "limits": dict(res)}


def _hugepage_volumes(
    hugepages: dict[str, str],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The emptyDir volumes that hand a pod its huge pages: medium ``HugePages`` at
    /dev/hugepages for one page size, ``HugePages-<size>`` at /dev/hugepages-<size> each for
    several (the kubelet's rule: a ``HugePages`` medium is ambiguous with more than one size)."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    sizes = sorted(hugepages)
    for size in sizes:
        one = len(sizes) == 1
        name = "hugepages" if one else f"hugepages-{size.lower()}"
        medium = "HugePages" if one else f"HugePages-{size}"
        volumes.append({"name": name, "emptyDir": {"medium": medium}})
        mounts.append(
            {"name": name, "mountPath": "/dev/hugepages" if one else f"/dev/hugepages-{size}"}
        )
    return volumes, mounts


def _volumes(job: PPOJob) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    name = job.metadata.name or ""
    volumes: list[dict[str, Any]] = [
        {"name": "trainer-config", "configMap": {"name": trainer_name(name)}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "trainer-config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    vol = job.spec.checkpoint_volume
    if vol is not None:
        if vol.persistent_volume_claim is not None:
            src = {"persistentVolumeClaim": {"claimName": vol.persistent_volume_claim.claim_name}}
        elif vol.nfs is not None:
            src = {"nfs": {"server": vol.nfs.server, "path": vol.nfs.path}}
        else:  # check_spec rejects this; keep the builder total
            src = None
        if src is not None:
            volumes.append({"name": "checkpoints", **src})
            mounts.append({"name": "checkpoints", "mountPath": job.spec.training.checkpoint_dir})
    return volumes, mounts


def _env(job_role: str, extra: list[Any], grace: int) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {
            "name": ENV_JOB_NAME,
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{JOB_LABEL}']"}},
        },
        {"name": ENV_JOB_NAMESPACE, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": ENV_ROLE, "value": job_role},
        {"name": "RAY_USAGE_STATS_ENABLED", "value": "0"},
        {"name": ENV_GRACE, "value": str(grace)},
    ]
    if job_role == "head":  # where the driver runs
        env += [
            {"name": ENV_STOP_FILE, "value": STOP_FILE},
            {"name": ENV_RUNNING_FILE, "value": RUNNING_FILE},
        ]
    else:  # a worker's SIGTERM drains its Ray node for the whole grace period
        env.append({"name": ENV_RAY_DRAIN, "value": str(grace)})
    seen = {e["name"] for e in env}
    env += [{"name": e.name, "value": e.value} for e in extra if e.name not in seen]
    return env


def tracker_env_from(job: PPOJob) -> list[dict[str, Any]]:
    """The head container's ``envFrom`` of the trackers' Secrets (``spec.trackers[].secretRef``),
    each once: their keys (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN, ...) become variables of the
    trainer's driver only, never of the worker pods that run user code."""
    out: list[dict[str, Any]] = []
    for tracker in job.spec.trackers:
        ref = getattr(tracker, "secret_ref", None)
        entry = {"secretRef": {"name": ref.name}} if ref is not None else None
        if entry is not None and entry not in out:
            out.append(entry)
    return out


def _pod_template(
    job: PPOJob,
    *,
    group_role: str,
    container: str,
    resources: dict[str, Any],
    node_selector: dict[str, str],
    tolerations: list[Any],
    env: list[Any],
    gang: scheduling.GangPlan,
    capabilities: list[str] | None = None,
    affinity: dict[str, Any] | None = None,
    hugepages: dict[str, str] | None = None,
    runtime_class_name: str | None = None,
) -> dict[str, Any]:
    spec = job.spec
    name = job.metadata.name or ""
    volumes, mounts = _volumes(job)
    huge_volumes, huge_mounts = _hugepage_volumes(hugepages or {})
    volumes += huge_volumes
    mounts += huge_mounts
    pod: dict[str, Any] = {
        "serviceAccountName": trainer_name(name),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": container,
                "image": spec.image,
                "imagePullPolicy": spec.image_pull_policy,
                "resources": resources,
                "env": _env(group_role, env, spec.failure_policy.termination_grace_period_seconds),
                "volumeMounts": mounts,
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "runAsNonRoot": True,
                    "capabilities": {
                        "drop": ["ALL"],
                        **({"add": list(capabilities)} if capabilities else {}),
                    },
                },
            }
        ],
        "volumes": volumes,
        "terminationGracePeriodSeconds": spec.failure_policy.termination_grace_period_seconds,
    }
    extra = spec.pod_template
    container = pod["containers"][0]
    container["env"] += [
        dump(v) for v in extra.env if v.name not in {e["name"] for e in container["env"]}
    ]
    env_from = [dump(r) for r in extra.env_from]
    if group_role == "head":  # the trainer's driver, which alone talks to the trackers
        env_from += [r for r in tracker_env_from(job) if r not in env_from]
    if env_from:
        container["envFrom"] = env_from
    pod["volumes"] += [dict(v) for v in extra.volumes]
    container["volumeMounts"] += [dump(m) for m in extra.volume_mounts]
    if group_role == "head":
        lifecycle: dict[str, Any] = {"preStop": {"exec": {"command": PRESTOP_COMMAND}}}
        if spec.submission_mode == "SidecarMode":  # the submitter is the next container
            lifecycle["postStart"] = {"exec": {"command": POSTSTART_COMMAND}}
        pod["containers"][0]["lifecycle"] = lifecycle
    else:
        # The trainer's token (it may patch the PPOJob's status) only where the trainer's
        # driver runs: worker pods run user code (reward functions) and need no API access.
        pod["automountServiceAccountToken"] = False
        pod["containers"][0]["lifecycle"] = {
            "preStop": {"exec": {"command": WORKER_PRESTOP_COMMAND}}
        }
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s.name} for s in spec.image_pull_secrets]
    if node_selector:
        pod["nodeSelector"] = dict(node_selector)
    if tolerations:
        pod["tolerations"] = [dump(t) for t in tolerations]
    if affinity:
        pod["affinity"] = dict(affinity)
    if runtime_class_name:  # roles.sandbox: e.g. gvisor or kata
        pod["runtimeClassName"] = runtime_class_name
    if spec.scheduling.priority_class_name:
        pod["priorityClassName"] = spec.scheduling.priority_class_name
    if gang.scheduler_name:
        pod["schedulerName"] = gang.scheduler_name
    labels = {**extra.labels, JOB_LABEL: name, ROLE_LABEL: group_role, **gang.pod_labels}
    meta: dict[str, Any] = {"labels": labels}
    annotations = {**extra.annotations, **gang.pod_annotations}
    if group_role != "head":
        annotations.update(gang.worker_annotations)
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": pod}


def _ray_resources(values: dict[str, int]) -> str:
    """``rayStartParams.resources`` as KubeRay expects it: JSON in single quotes.

    KubeRay (v1.5 ``controllers/ray/common/pod.go``) puts every rayStartParams value verbatim
    into the shell command ``ray start ... --resources=<value>``, and reads this one itself
    (``getResourcesMap``: trims surrounding quotes, then ``json.Unmarshal`` into a map of
    floats) to merge accelerator resources; its own writes use ``'<json>'``. JSON with escaped
    quotes fails that unmarshal (KubeRay then skips adding ``num-gpus``)."""
    return "'" + json.dumps(values, separators=(",", ":")) + "'"


SIDECAR_SUBMITTER_REQUESTS = {"cpu": 0.5, "memory": 200 * 2**20}
"""Requests of the ``ray-job-submitter`` container KubeRay adds to the head pod in SidecarMode
(its ``GetDefaultSubmitterContainer``: 500m CPU, 200Mi memory)."""


SUBMITTER_RESOURCES = {
    "requests": {"cpu": "500m", "memory": "200Mi"},
    "limits": {"cpu": "1", "memory": "1Gi"},
}
"""Resources of the K8sJobMode submitter pod: KubeRay's own default submitter container's
(``GetDefaultSubmitterContainer``)."""

CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}
"""The securityContext of a container that needs nothing: the Pod Security ``restricted``
profile's container fields."""


def submitter_template(job: PPOJob) -> dict[str, Any]:
    """``submitterPodTemplate`` of a K8sJobMode RayJob: the submitter pod hardened to the Pod
    Security ``restricted`` profile (non-root, no privilege escalation, every capability
    dropped, RuntimeDefault seccomp) and without a service account token (``ray job submit``
    talks to the Ray dashboard, never to the Kubernetes API).

    KubeRay (v1.5, v1.6: ``GetSubmitterTemplate``) takes this template whole instead of its
    default one and only sets the first container's command, args (when it has no command)
    and two variables; Kueue (v0.17 to v0.19) reads the same template for the Workload's
    ``submitter`` podset. So everything KubeRay's default has is here: the head's image, its
    resources, and ``restartPolicy: Never`` (the Job's pods)."""
    spec = job.spec
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": SUBMITTER_CONTAINER,
                "image": spec.image,
                "imagePullPolicy": spec.image_pull_policy,
                "resources": {k: dict(v) for k, v in SUBMITTER_RESOURCES.items()},
                "securityContext": json.loads(json.dumps(CONTAINER_SECURITY)),
            }
        ],
    }
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s.name} for s in spec.image_pull_secrets]
    return {"spec": pod}


AUTOSCALER_RESOURCES = {
    "requests": {"cpu": "100m", "memory": "512Mi"},
    "limits": {"cpu": "500m", "memory": "512Mi"},
}
"""Resources of the ``autoscaler`` container KubeRay adds to the head pod with in-tree
autoscaling (``autoscalerOptions.resources``; KubeRay's own default is 500m / 512Mi requested,
more than an idle Ray autoscaler uses)."""

AUTOSCALER_IDLE_SECONDS = 60
"""``autoscalerOptions.idleTimeoutSeconds``: a rollout pod with no engine on it for this long
goes back (KubeRay's and Ray's default)."""


def autoscaled(job: PPOJob, scheduler_allows: bool) -> bool:
    """Whether KubeRay's in-tree autoscaler runs for the job: for elastic rollout engines in a
    group of their own, when the gang scheduler allows it (``scheduler_allows``: not Kueue)."""
    rollout = job.spec.roles.rollout
    return rollout.elastic is not None and not rollout.colocate_with_actor and scheduler_allows


def output_dir(job: PPOJob) -> str:
    """Where the trainer writes its log, metrics and summary: on the checkpoint volume when the
    job has one (so they outlive the pods, which are deleted ``ttlSecondsAfterFinished`` after
    the job ends), else in the head pod."""
    if job.spec.checkpoint_volume is not None:
        return job.spec.training.checkpoint_dir.rstrip("/") + "/output"
    return OUTPUT_DIR


def default_entrypoint(job: PPOJob) -> str:
    return f"ppojob-train --config {CONFIG_DIR}/{CONFIG_KEY} --out {output_dir(job)}"


def gang_members(job: PPOJob, *, autoscaler: bool = False) -> list[scheduling.GangMember]:
    """Head and worker groups as gang members (replicas and per-pod requests). In SidecarMode
    the head pod also holds KubeRay's submitter container, and with ``autoscaler`` KubeRay's
    autoscaler container (:data:`AUTOSCALER_RESOURCES`), so their requests count too."""
    head = job.spec.head
    head_requests = _resources(head.cpus, head.memory, 0)["requests"]
    cpu, mem = head.cpus, quantity_bytes(head.memory)
    if job.spec.submission_mode == "SidecarMode":
        cpu += SIDECAR_SUBMITTER_REQUESTS["cpu"]
        mem += SIDECAR_SUBMITTER_REQUESTS["memory"]
    if autoscaler:
        cpu += quantity_bytes(AUTOSCALER_RESOURCES["requests"]["cpu"])
        mem += quantity_bytes(AUTOSCALER_RESOURCES["requests"]["memory"])
    if (cpu, mem) != (head.cpus, quantity_bytes(head.memory)):
        head_requests = {"cpu": _cpu(cpu), "memory": str(round(mem))}
    members = [scheduling.GangMember(1, head_requests)]
    for role_name, r in pod_roles(job):
        res = r.resources
        members.append(
            scheduling.GangMember(
                scaling_bounds(role_name, r)[0],  # (elastic engines: only their minimum)
                _resources(res.cpus, res.memory, res.gpus, res.extra, res.hugepages)["requests"],
            )
        )
    return members


def dashboard_auth_of(job: PPOJob, supported: bool) -> bool:
    """Whether the job's Ray cluster gets token authentication: KubeRay supports it
    (``supported``: its CRD has ``authOptions``) and the job's ``rayVersion`` is one KubeRay
    enables it for (>= 2.52). With it, the dashboard's job API (port 8265, code execution in
    the head pod) and Ray's RPCs answer only requests carrying the cluster's token, which
    KubeRay keeps in a Secret of the job's namespace and gives to the job's own containers;
    the NetworkPolicy (:func:`network_policy`) is then a second line, not the only one."""
    from ppojob_operator.capabilities import ray_supports_auth

    return supported and ray_supports_auth(job.spec.ray_version)


def ray_job(
    job: PPOJob,
    namespace: str,
    uid: str | None = None,
    *,
    gang: scheduling.GangPlan,
    entrypoint: str | None = None,
    restart: int = 0,
    dashboard_auth: bool = False,
) -> dict[str, Any]:
    """The RayJob. ``dashboard_auth``: the installed KubeRay has ``authOptions`` (>= 1.6): the
    Ray cluster gets token authentication when the job's ``rayVersion`` supports it
    (:func:`dashboard_auth_of`)."""
    spec = job.spec
    name = job.metadata.name or ""
    head = spec.head
    head_group = {
        "rayStartParams": {
            "dashboard-host": "0.0.0.0",
            "num-cpus": "0",
            "resources": _ray_resources({ROLE_RESOURCE.format(role="head"): 1}),
        },
        "template": _pod_template(
            job,
            group_role="head",
            container="ray-head",
            resources=_resources(head.cpus, head.memory, 0),
            node_selector=head.node_selector,
            tolerations=head.tolerations,
            env=[],
            gang=gang,
            affinity=head.affinity,
        ),
    }
    workers = []
    for role_name, r in pod_roles(job):
        res = r.resources
        workers.append(
            {
                "groupName": role_name,
                "replicas": r.replicas,
                "minReplicas": scaling_bounds(role_name, r)[0],
                "maxReplicas": scaling_bounds(role_name, r)[1],
                "rayStartParams": {
                    "resources": _ray_resources(
                        {ROLE_RESOURCE.format(role=role_name): max(res.gpus, 1)}
                    )
                },
                "template": _pod_template(
                    job,
                    group_role=role_name,
                    container="ray-worker",
                    resources=_resources(res.cpus, res.memory, res.gpus, res.extra, res.hugepages),
                    node_selector=r.node_selector,
                    tolerations=r.tolerations,
                    env=r.env,
                    gang=gang,
                    capabilities=r.capabilities,
                    affinity=r.affinity,
                    hugepages=res.hugepages,
                    runtime_class_name=getattr(r, "runtime_class_name", None),
                ),
            }
        )
    meta = _meta(name, namespace, name, uid)
    meta["labels"].update(gang.rayjob_labels)
    meta["annotations"] = {APPLIED_SPEC_ANNOTATION: json.dumps(applied_spec(job), sort_keys=True)}
    if restart:
        meta["annotations"][ATTEMPT_ANNOTATION] = str(restart)
    body: dict[str, Any] = {
        "entrypoint": entrypoint or default_entrypoint(job),
        "submissionMode": spec.submission_mode,
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": spec.ttl_seconds_after_finished,
        # The operator retries (spec.failurePolicy: disruptions are not counted), never KubeRay.
        "backoffLimit": 0,
        "suspend": bool(spec.suspend or gang.create_suspended),
        "rayClusterSpec": {
            "rayVersion": spec.ray_version,
            "headGroupSpec": head_group,
            "workerGroupSpecs": workers,
        },
    }
    if dashboard_auth_of(job, dashboard_auth):
        body["rayClusterSpec"]["authOptions"] = {"mode": "token"}
    if autoscaled(job, gang.autoscaling):
        # KubeRay's in-tree autoscaler (a container in the head pod) grows the elastic rollout
        # group toward maxReplicas while the trainer's engines wait for room (Ray resource
        # demand), and lets idle pods go; every other group has minReplicas = maxReplicas.
        body["rayClusterSpec"]["enableInTreeAutoscaling"] = True
        body["rayClusterSpec"]["autoscalerOptions"] = {
            "upscalingMode": "Default",
            "idleTimeoutSeconds": AUTOSCALER_IDLE_SECONDS,
            "resources": {k: dict(v) for k, v in AUTOSCALER_RESOURCES.items()},
            "imagePullPolicy": spec.image_pull_policy,
            "securityContext": json.loads(json.dumps(CONTAINER_SECURITY)),
        }
    if spec.submission_mode == "K8sJobMode":
        body["submitterPodTemplate"] = submitter_template(job)
    if spec.active_deadline_seconds is not None:
        body["activeDeadlineSeconds"] = spec.active_deadline_seconds
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": meta, "spec": body}


# ---------------------------------------------------------------------------------------------
# All children
# ---------------------------------------------------------------------------------------------
def build_children(
    job: PPOJob,
    *,
    namespace: str,
    uid: str | None = None,
    gang_default: str | None = None,
    entrypoint: str | None = None,
    attempt: int = 0,
    restart: int = 0,
    network: NetworkPolicySettings | None = NetworkPolicySettings(),
    dashboard_auth: bool = False,
) -> list[dict[str, Any]]:
    """Every child of a valid PPOJob, in creation order (the RayJob last). ``attempt`` counts
    the RayJobs the operator has made for this PPOJob (a fresh YuniKorn application each);
    ``restart`` is the number of restarts made (the RayJob's ``ppojob.io/attempt``);
    ``network``: the NetworkPolicy's settings, None for none (``--network-policy=off``). The
    sandbox pods' egress policy (``roles.sandbox``) is the job's own: made whatever ``network``.
    ``dashboard_auth``: KubeRay supports token authentication (:func:`dashboard_auth_of`)."""
    name = job.metadata.name or ""
    scheduler = scheduling.effective_scheduler(job, gang_default)
    owner_refs = [owner_reference(name, uid)] if uid else None
    gang = scheduling.plan(
        job,
        name=name,
        namespace=namespace,
        scheduler=scheduler,
        members=gang_members(
            job, autoscaler=autoscaled(job, scheduling.strategy(scheduler).autoscaling)
        ),
        owner_refs=owner_refs,
        uid=uid,
        attempt=attempt,
    )
    return [
        config_map(job, namespace, uid),
        service_account(job, namespace, uid),
        role(job, namespace, uid),
        role_binding(job, namespace, uid),
        *(
            [pod_disruption_budget(job, namespace, uid)]
            if job.spec.failure_policy.pod_disruption_budget
            else []
        ),
        *([network_policy(job, namespace, uid, network)] if network is not None else []),
        *(
            [sandbox_network_policy(job, namespace, uid)]
            if job.spec.roles.sandbox is not None
            else []
        ),
        *gang.objects,
        ray_job(
            job,
            namespace,
            uid,
            gang=gang,
            entrypoint=entrypoint,
            restart=restart,
            dashboard_auth=dashboard_auth,
        ),
    ]


def render_children_yaml(
    job: PPOJob, namespace: str = "default", gang_default: str | None = None
) -> str:
    """The children as a YAML stream, exactly as the operator would create them (less the
    ownerReferences, which need the PPOJob's uid from the cluster)."""
    ns = job.metadata.namespace or namespace
    docs = build_children(job, namespace=ns, gang_default=gang_default)
    header = f"# children of PPOJob {ns}/{job.metadata.name} (ownerReferences added in-cluster)\n"
    return header + yaml.safe_dump_all(docs, sort_keys=False, explicit_start=True)
