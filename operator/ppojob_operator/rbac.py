"""The exact ClusterRole rules the operator needs; the Helm chart renders these.

Every verb here is used by the operator's code (`k8s.py`, called from `reconcile.py`, `sync.py`,
`suspend.py`, `timers.py`, `watch.py`) or by kopf itself:

- PPOJobs: kopf lists and watches them, patches them (finalizer-free; kopf's progress storage
  lives in annotations, hence ``patch`` on the object), and the operator writes ``status``.
- ``ppojobs/status`` get+patch: the operator writes status, and it must itself hold these
  verbs to create the per-job Role that grants them to the trainer (RBAC escalation rule).
- RayJobs: created, read, watched (status mirroring, self-healing), patched (suspend/resume,
  a fresh YuniKorn application id per attempt) and deleted (a restart by the failure policy
  replaces the failed attempt's RayJob).
- PodDisruptionBudgets and NetworkPolicies: created and read (create-or-get), listed and
  watched like the other children.
- ConfigMaps, ServiceAccounts, Roles, RoleBindings: created and read (create-or-get), listed and
  watched (only those labelled ``app.kubernetes.io/managed-by=ppojob-operator``, filtered
  server-side) so that one deleted by hand is recreated.
- PodGroups of scheduler-plugins: the same. Volcano's PodGroups are KubeRay's; the operator
  never reads them, so it gets no access to them.
- Kueue Workloads: read, listed and patched (``spec.active``: suspend and resume under Kueue).
  A job the operator fails (its image) under Kueue is stopped by deleting its RayJob, never by
  patching ``RayJob.spec.suspend`` (Kueue's field).
- Pods of its jobs: listed and watched (only those labelled ``ppojob.io/job``, filtered
  server-side), read-only: an image a pod cannot get fails its job at once (``pods.py``), and a
  job's own are listed when its queueing times out, for the scheduler's reason
  (``spec.scheduling.queueTimeoutSeconds``).
- Events (core/v1, the only API kopf and ``k8s.py`` post to): created.
- CRDs list/watch: kopf's resource scanning; get: the operator reads the RayJob CRD at start-up
  (SidecarMode support). Namespaces list/watch: cluster-wide mode; get: a new job's
  namespace's enforced Pod Security level (``pod-security.kubernetes.io/enforce``).
The operator runs kopf in standalone mode (no peering), so no KopfPeering rules; it elects a
leader on a Lease instead (:data:`LEADER_ELECTION_RULES`, a Role in its own namespace).
"""

from __future__ import annotations

OPERATOR_RULES: list[dict] = [
    {
        "apiGroups": ["ppojob.io"],
        "resources": ["ppojobs"],
        "verbs": ["get", "list", "watch", "patch"],
    },
    {
        "apiGroups": ["ppojob.io"],
        "resources": ["ppojobs/status"],
        "verbs": ["get", "patch"],
    },
    {
        # children carry blockOwnerDeletion: the OwnerReferencesPermissionEnforcement admission
        # plugin requires `update` on the owner's finalizers subresource
        "apiGroups": ["ppojob.io"],
        "resources": ["ppojobs/finalizers"],
        "verbs": ["update"],
    },
    {
        "apiGroups": ["ray.io"],
        "resources": ["rayjobs"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": [""],
        "resources": ["configmaps", "serviceaccounts"],
        "verbs": ["get", "list", "watch", "create"],
    },
    {
        "apiGroups": ["rbac.authorization.k8s.io"],
        "resources": ["roles", "rolebindings"],
        "verbs": ["get", "list", "watch", "create"],
    },
    {
        "apiGroups": ["scheduling.x-k8s.io"],
        "resources": ["podgroups"],
        "verbs": ["get", "list", "watch", "create"],
    },
    {
        "apiGroups": ["policy"],
        "resources": ["poddisruptionbudgets"],
        "verbs": ["get", "list", "watch", "create"],
    },
    {
        "apiGroups": ["networking.k8s.io"],
        "resources": ["networkpolicies"],
        "verbs": ["get", "list", "watch", "create"],
    },
    {
        "apiGroups": ["kueue.x-k8s.io"],
        "resources": ["workloads"],
        "verbs": ["get", "list", "patch"],
    },
    {
        # a kueue job's LocalQueue -> ClusterQueue -> AdmissionChecks: MultiKueue is refused
        "apiGroups": ["kueue.x-k8s.io"],
        "resources": ["localqueues"],
        "verbs": ["get"],
    },
    {
        "apiGroups": [""],
        "resources": ["pods"],
        "verbs": ["list", "watch"],
    },
    {
        "apiGroups": [""],
        "resources": ["events"],
        "verbs": ["create"],
    },
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["get", "list", "watch"],
    },
    {
        "apiGroups": [""],
        "resources": ["namespaces"],
        "verbs": ["get", "list", "watch"],
    },
    {
        "apiGroups": ["kueue.x-k8s.io"],
        "resources": ["clusterqueues", "admissionchecks"],
        "verbs": ["get"],
    },
]
"""ClusterRole rules of the operator's ServiceAccount (see the module docstring)."""


LEADER_ELECTION_RULES: list[dict] = [
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["get", "create", "update"],
    },
]
"""The leader Lease (``leader.py``), granted in the operator's own namespace only. (``create``
cannot be limited by ``resourceNames``.)"""


KUBERAY_READ_RULES: list[dict] = [
    {
        "apiGroups": ["apps"],
        "resources": ["deployments"],
        "verbs": ["list"],
    },
    {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "verbs": ["get"],
    },
]
"""``--kuberay-batch-scheduler=auto``: KubeRay's operator Deployment and the ConfigMap of its
``--config`` file, read at start-up, granted in KubeRay's namespace only (a Role there): never a
list of every Deployment in the cluster."""
