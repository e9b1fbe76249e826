"""Each job's NetworkPolicy on the real API server: which pods its peers select.

The test control plane has no CNI, so nothing enforces NetworkPolicy here; what is checked is
the policy the API server stores, evaluated (NetworkPolicy's peer semantics, Kubernetes' label
selectors) against the real namespace and pod objects read back from the same API server: the
namespace labels the API server sets itself included. A tenant's pod labelled like KubeRay's
operator, in a namespace of the tenant's, must not reach the job's dashboard port (Ray's job
API: code execution in the head pod); KubeRay's operator pod in KubeRay's namespace and the
job's own pods must. Those that reach it still need the Ray cluster's token (KubeRay >= 1.6:
``authOptions``; tests/realnode checks a real request without it is refused).
"""

from __future__ import annotations

import uuid
from typing import Any

from ppojob_operator.builders import DASHBOARD_PORT, KUBERAY_NAMESPACE
from tests.helpers.cluster_jobs import gpu_job, pods, wait_children
from tests.helpers.controlplane import wait_until

KUBERAY_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes' LabelSelector semantics (matchLabels and matchExpressions; {} selects all)."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def peer_selects(
    peer: dict[str, Any], policy_ns: str, pod: dict[str, Any], ns_labels: dict[str, str]
) -> bool:
    """Whether a NetworkPolicyPeer admits traffic from ``pod`` (``ns_labels``: its namespace's
    labels as stored). A podSelector alone means the policy's namespace; an ipBlock selects no
    pod by identity (it is judged here as selecting none)."""
    meta = pod["metadata"]
    labels = meta.get("labels") or {}
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], ns_labels):
            return False
    elif meta["namespace"] != policy_ns:
        return False
    return selects(peer.get("podSelector") or {}, labels)


def reaches_dashboard(
    policy: dict[str, Any], pod: dict[str, Any], ns_labels: dict[str, str]
) -> bool:
    """Whether the policy admits ``pod`` to the dashboard port of the pods it covers."""
    policy_ns = policy["metadata"]["namespace"]
    for rule in policy["spec"]["ingress"]:
        ports = rule.get("ports")
        if ports and not any(p.get("port") == DASHBOARD_PORT for p in ports):
            continue
        peers = rule.get("from")
        assert peers, f"a rule admitting every source: {rule}"
        if any(peer_selects(p, policy_ns, pod, ns_labels) for p in peers):
            return True
    return False


def bare_pod(name: str, ns: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "automountServiceAccountToken": False,
            "nodeSelector": {"ppojob.test/nowhere": "true"},  # never runs anywhere
            "containers": [{"name": "c", "image": "registry.invalid/none:1"}],
        },
    }


def test_a_pod_labelled_like_kuberay_in_a_tenants_namespace_does_not_reach_the_dashboard(
    cp, operator, ns
):
    """The stored policy, against the real pods and namespaces: KubeRay's operator pod in
    KubeRay's namespace and the job's own pods reach the dashboard port; a pod labelled
    exactly like KubeRay's operator in another namespace does not, nor does one in a namespace
    whose owner tried to relabel it as KubeRay's (the API server keeps
    ``kubernetes.io/metadata.name`` equal to the name), nor an unrelated pod of the job's
    namespace."""
    tenant = f"tenant-{uuid.uuid4().hex[:6]}"
    cp.kubectl("create", "namespace", tenant)
    kuberay_pod = f"kuberay-operator-{uuid.uuid4().hex[:6]}"
    try:
        wait_until(lambda: cp.get("serviceaccount", "default", tenant), 30, "tenant's SA")
        # the tenant tries to pass their namespace off as KubeRay's
        cp.kubectl(
            "label",
            "namespace",
            tenant,
            f"kubernetes.io/metadata.name={KUBERAY_NAMESPACE}",
            "--overwrite",
            check=False,
        )
        stored = cp.get("namespace", tenant)["metadata"]["labels"]
        assert stored["kubernetes.io/metadata.name"] == tenant
        cp.apply(
            [
                bare_pod("forged-kuberay", tenant, dict(KUBERAY_LABELS)),
                bare_pod(kuberay_pod, KUBERAY_NAMESPACE, dict(KUBERAY_LABELS)),
                bare_pod("bystander", ns, {"app": "other"}),
            ]
        )
        cp.apply(gpu_job("np", ns))
        policy = wait_children(cp, "np", ns)["networkpolicy.networking.k8s.io"]

        # every pod of the job (head, 2 actor, critic, rollout): KubeRay makes them one by one,
        # and one made after the look below would be an "extra" pod the policy admits
        def all_five() -> list[dict[str, Any]] | None:
            made = pods(cp, "np", ns)
            return made if len(made) == 5 else None

        job_pods = wait_until(all_five, 60, "the job's 5 pods")

        namespaces = {
            n["metadata"]["name"]: n["metadata"].get("labels") or {}
            for n in cp.get("namespace")["items"]
        }
        everyone = cp.get("pod")["items"]  # every pod of the cluster, as stored
        admitted = {
            (p["metadata"]["namespace"], p["metadata"]["name"])
            for p in everyone
            if reaches_dashboard(policy, p, namespaces[p["metadata"]["namespace"]])
        }
        assert (tenant, "forged-kuberay") not in admitted
        assert (ns, "bystander") not in admitted
        assert (KUBERAY_NAMESPACE, kuberay_pod) in admitted
        for p in job_pods:
            assert (ns, p["metadata"]["name"]) in admitted
        # nothing else anywhere: only the job's pods and KubeRay's operator
        want = {(ns, p["metadata"]["name"]) for p in job_pods} | {(KUBERAY_NAMESPACE, kuberay_pod)}
        assert admitted == want
        # and those that reach it still need the token (KubeRay >= 1.6, authOptions): every
        # Ray container of the job reads it from the Secret KubeRay made in the job's namespace
        rayjob = cp.get("rayjob.ray.io", "np", ns)
        assert rayjob["spec"]["rayClusterSpec"]["authOptions"] == {"mode": "token"}
        secrets = set()
        for p in job_pods:
            ray = p["spec"]["containers"][0]
            env = {e["name"]: e for e in ray.get("env") or []}
            assert env["RAY_AUTH_MODE"]["value"] == "token", (p["metadata"]["name"], env)
            ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
            secrets.add((ref["name"], ref["key"]))
        ((secret, key),) = secrets
        token = cp.get("secret", secret, ns)["data"][key]
        assert len(token) >= 32, "an empty or short token"
    finally:
        cp.kubectl(
            "delete", "pod", kuberay_pod, "-n", KUBERAY_NAMESPACE, "--wait=false", check=False
        )
        cp.kubectl("delete", "ppojob", "--all", "-n", ns, "--wait=false", check=False)
        cp.kubectl("delete", "namespace", tenant, "--wait=false", check=False)
