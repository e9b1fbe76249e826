"""PPOJob manifests and polling helpers of the cluster tests."""

from __future__ import annotations

from typing import Any

from tests.helpers.controlplane import RESOURCES, ControlPlane, wait_until

RESOURCES.setdefault("poddisruptionbudget.policy", ("apis/policy/v1", "poddisruptionbudgets", True))
RESOURCES.setdefault(
    "networkpolicy.networking.k8s.io", ("apis/networking.k8s.io/v1", "networkpolicies", True)
)

PPOJOB = "ppojobs.ppojob.io"
JOB_LABEL = "ppojob.io/job"
# (resource, name suffix) of every child the operator makes for a job (besides a PodGroup)
CHILDREN = [
    ("configmap", "-trainer"),
    ("serviceaccount", "-trainer"),
    ("role.rbac.authorization.k8s.io", "-trainer"),
    ("rolebinding.rbac.authorization.k8s.io", "-trainer"),
    ("poddisruptionbudget.policy", ""),
    ("networkpolicy.networking.k8s.io", ""),
    ("rayjob.ray.io", ""),
]


def gpu_job(
    name: str,
    namespace: str,
    *,
    scheduler: str = "none",
    actor: int = 2,
    critic: int = 1,
    rollout: int = 1,
    gpus: int = 1,
    pool: str | None = None,
    steps: int = 10,
    queue: str | None = None,
    suspend: bool = False,
) -> dict[str, Any]:
    """A PPO job with one worker group per role (actor, critic, rollout), ``gpus`` per pod."""
    selector = {"pool": pool} if pool else {}

    def role(replicas: int) -> dict[str, Any]:
        r: dict[str, Any] = {
            "replicas": replicas,
            "resources": {"gpus": gpus, "cpus": 2, "memory": "8Gi"},
        }
        if selector:
            r["nodeSelector"] = selector
        return r

    spec: dict[str, Any] = {
        "image": "ghcr.io/ppojob/trainer:0.1.0",
        "head": {"cpus": 1, "memory": "2Gi", **({"nodeSelector": selector} if selector else {})},
        "model": {"path": "builtin:tiny-llama"},
        "roles": {"actor": role(actor), "critic": role(critic), "rollout": role(rollout)},
        "algorithm": {"advantageEstimator": "gae"},
        "data": {
            "prompts": "builtin:count-up",
            "rolloutBatchSize": 16,
            "samplesPerPrompt": 2,
            "maxPromptLength": 4,
            "maxResponseLength": 8,
        },
        "training": {"steps": steps, "miniBatchSize": 16},
        "scheduling": {"gangScheduler": scheduler, "timeoutSeconds": 600},
    }
    if queue:
        spec["scheduling"]["queue"] = queue
    if suspend:
        spec["suspend"] = True
    return {
        "apiVersion": "ppojob.io/v1alpha1",
        "kind": "PPOJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def pool_nodes(
    cp: ControlPlane,
    pool: str,
    names_gpus: dict[str, int],
    labels: dict[str, dict[str, str]] | None = None,
) -> None:
    """KWOK GPU nodes of ``pool`` (label ``pool``, which only its tests' jobs select): name ->
    GPUs, each with its ``labels`` (e.g. a topology block) besides; returns once all are
    Ready."""
    docs = []
    for name, gpus in names_gpus.items():
        cap = {"cpu": "96", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": str(gpus)}
        extra = (labels or {}).get(name, {})
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {"kwok.x-k8s.io/node": "fake"},
                    "labels": {"type": "kwok", "pool": pool, **extra},
                },
                "status": {"capacity": cap, "allocatable": cap},
            }
        )
    cp.apply(docs)

    def ready() -> bool:
        for name in names_gpus:
            node = cp.get("node", name) or {}
            conds = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
            if conds.get("Ready") != "True":
                return False
        return True

    wait_until(ready, 60, f"pool {pool} nodes Ready")


def job(cp: ControlPlane, name: str, ns: str) -> dict[str, Any] | None:
    return cp.get(PPOJOB, name, ns)


def status(cp: ControlPlane, name: str, ns: str) -> dict[str, Any]:
    return (job(cp, name, ns) or {}).get("status") or {}


def wait_children(cp: ControlPlane, name: str, ns: str, timeout: float = 60) -> dict[str, Any]:
    """Wait until every child exists and is controlled by the current PPOJob; returns them."""
    found: dict[str, Any] = {}

    def ready() -> bool:
        owner = job(cp, name, ns)
        if owner is None:
            return False
        uid = owner["metadata"]["uid"]
        for resource, suffix in CHILDREN:
            obj = cp.get(resource, name + suffix, ns)
            if obj is None or controller_uid(obj) != uid:
                return False
            found[resource] = obj
        return True

    wait_until(ready, timeout, f"children of {ns}/{name}")
    return found


def controller_uid(obj: dict[str, Any]) -> str | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


def pods(cp: ControlPlane, name: str, ns: str) -> list[dict[str, Any]]:
    """The pods KubeRay made for the job's RayCluster (labelled with the RayJob's cluster)."""
    rj = cp.get("rayjob.ray.io", name, ns)
    cluster = ((rj or {}).get("status") or {}).get("rayClusterName")
    if not cluster:
        return []
    return cp.get("pods", namespace=ns, selector=f"ray.io/cluster={cluster}")["items"]


def bound(pod: dict[str, Any]) -> bool:
    return bool(pod["spec"].get("nodeName"))


def unschedulable(pod: dict[str, Any]) -> bool:
    """The scheduler looked at the pod and refused it (PodScheduled False, Unschedulable)."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c["type"] == "PodScheduled" and c["status"] == "False":
            return c.get("reason") == "Unschedulable"
    return False


def running(pod: dict[str, Any]) -> bool:
    st = pod.get("status") or {}
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or [])
    return st.get("phase") == "Running" and ready


def condition(st: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in st.get("conditions") or [] if c["type"] == type_), {})


def table(text: str) -> list[dict[str, str]]:
    """Rows of kubectl's table output, cut at the header's column starts (empty cells stay
    empty: kubectl prints nothing for a printer column whose path is absent)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    header = lines[0]
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    names = header.split()
    rows = []
    for ln in lines[1:]:
        cells = [ln[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
        rows.append(dict(zip(names, cells, strict=True)))
    return rows
