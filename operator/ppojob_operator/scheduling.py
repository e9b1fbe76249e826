"""Gang scheduling: one small pure strategy per scheduler (``spec.scheduling.gangScheduler``).

Each scheduler is one :class:`GangScheduler` in :data:`STRATEGIES` (name -> strategy), which
says what KubeRay's installation-wide ``batchScheduler`` must be for it and turns a job into a
:class:`GangPlan`: labels for the RayJob (KubeRay copies them to the RayCluster it creates),
labels, annotations and a scheduler name for every pod template, whether the RayJob must be
created suspended, and any object we must create ourselves. Every pod of the job (the head and
every worker, all with replicas = minReplicas = maxReplicas, except an elastic rollout group,
whose minReplicas pods only count) is in the one gang;
with ``submissionMode: SidecarMode`` the submitter is a container of the head pod, so no pod
lives outside it.

What each scheduler needs in the cluster (the KubeRay operator's settings and the scheduler):

``volcano``
    KubeRay operator started with ``batchScheduler.name=volcano`` (Helm value; the flag is
    ``--batch-scheduler=volcano``, or ``--enable-batch-scheduler=true`` before KubeRay 1.2).
    We set ``ray.io/gang-scheduling-enabled: "true"``, ``volcano.sh/queue-name`` (when
    ``spec.scheduling.queue`` is set; Volcano's ``default`` queue otherwise) and
    ``ray.io/priority-class-name``; KubeRay then creates one Volcano PodGroup (minMember = head
    + all workers, minResources = their sum) and sets ``schedulerName: volcano`` on the pods.
    Volcano must be installed, with the queue existing and open.
``yunikorn``
    KubeRay operator started with ``batchScheduler.name=yunikorn`` (``--batch-scheduler=yunikorn``,
    KubeRay >= 1.2). We set ``yunikorn.apache.org/app-id`` (``ppojob-<name>-<hash>``: at most 63
    characters, the hash covering namespace, name, uid and attempt, so two jobs never share one
    however long their names, and every attempt gets a fresh application),
    ``yunikorn.apache.org/queue`` (when set) and ``ray.io/gang-scheduling-enabled: "true"``;
    KubeRay writes the task groups (gang members) into the pod annotations and sets
    ``schedulerName: yunikorn``. Every pod template also carries
    ``yunikorn.apache.org/schedulingPolicyParameters: "placeholderTimeoutInSeconds=<timeout>
    gangSchedulingStyle=Hard"``: when the placeholders cannot all be placed within
    ``spec.scheduling.timeoutSeconds`` the application fails instead of YuniKorn's default
    ``Soft`` style silently scheduling the pods one by one. YuniKorn must be installed with the
    queue in its queue configuration.
``kueue``
    No KubeRay setting. Kueue must be installed with the RayJob integration enabled
    (``integrations.frameworks`` includes ``ray.io/rayjob`` in Kueue's configuration) and a
    LocalQueue named by ``spec.scheduling.queue`` in the job's namespace. We set
    ``kueue.x-k8s.io/queue-name`` and create the RayJob suspended; Kueue admits the whole job
    (head and all workers as one workload) by unsuspending it when quota allows. While queued the
    PPOJob is ``Pending`` with reason ``WaitingForAdmission``.
``scheduler-plugins``
    KubeRay's scheduler-plugins integration covers RayCluster only, so leave KubeRay's
    ``batchScheduler.name`` unset (if it is set to ``scheduler-plugins`` KubeRay would also create
    a PodGroup of its own per RayCluster). The scheduler-plugins second scheduler must be
    installed (scheduler name ``scheduler-plugins-scheduler``, the chart's default) with the
    Coscheduling plugin enabled. We create a ``scheduling.x-k8s.io/v1alpha1`` PodGroup named after
    the job (minMember = head + all workers, minResources = their sum, scheduleTimeoutSeconds =
    ``spec.scheduling.permitTimeoutSeconds``: how long placed pods wait at Permit for the
    rest) and put ``scheduling.x-k8s.io/pod-group`` and
    ``schedulerName`` in every pod template.
``none``
    Nothing is needed; pods are scheduled one by one by the default scheduler (no all-or-nothing
    guarantee; the trainer's placement group still waits for the whole job).

The operator's ``--gang-scheduler`` flag is a cluster default used only for jobs whose spec does
not name a gang scheduler (the CRD has no default for the field, so "unset" survives storage); an
explicit ``none`` stays ``none``.

KubeRay's ``batchScheduler`` is one setting per KubeRay installation, applied to every RayJob it
reconciles (KubeRay v1.5 ``batchscheduler/schedulermanager.go``: one scheduler for the operator;
``volcano`` makes a PodGroup for every RayJob and sets ``schedulerName: volcano`` on every pod;
``scheduler-plugins`` answers every RayJob with "currently only RayCluster is supported", so no
RayJob ever starts; ``kai-scheduler`` did the same up to v1.5 and from v1.6 sets
``schedulerName: kai-scheduler`` and the RayJob's ``kai.scheduler/queue`` label on every pod,
refusing K8sJobMode, whose submitter pod comes after the cluster and so outside the gang).
The operator is told that setting (``--kuberay-batch-scheduler``, chart value
``kuberay.batchScheduler``) and :func:`kuberay_disagreement` refuses a job whose gang scheduler
cannot work with it:

====================  ==========================================================
KubeRay batchScheduler  jobs that work (gangScheduler)
====================  ==========================================================
unset                 kueue, scheduler-plugins, none
volcano               volcano
yunikorn              yunikorn
scheduler-plugins     none (KubeRay fails every RayJob)
kai-scheduler         kai (KubeRay >= 1.6, SidecarMode; 1.5 fails every RayJob)
====================  ==========================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ppojob_api.checks.sizes import quantity_bytes
from ppojob_api.spec import PPOJob

KUBERAY_BATCH_SCHEDULERS = ("", "volcano", "yunikorn", "scheduler-plugins", "kai-scheduler")
"""Values of KubeRay's ``batchScheduler.name`` ("" = unset) the operator can be told."""
KUBERAY_RAYCLUSTER_ONLY = ("scheduler-plugins",)
"""KubeRay batchSchedulers that answer every RayJob with "currently only RayCluster is
supported" (KubeRay v1.5 and v1.6 ``batchscheduler``): no RayJob can start under them.
(``kai-scheduler`` did too up to v1.5.)"""

GANG_LABEL = "ray.io/gang-scheduling-enabled"
VOLCANO_QUEUE_LABEL = "volcano.sh/queue-name"
KAI_QUEUE_LABEL = "kai.scheduler/queue"
"""The KAI Queue of a RayJob; KubeRay (v1.6 ``batchscheduler/kai-scheduler``) copies it onto
every pod, and leaves a pod without it pending."""
PRIORITY_LABEL = "ray.io/priority-class-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
"""Kueue's WorkloadPriorityClass label on a job (``pkg/controller/constants``,
``WorkloadPriorityClassLabel``): Kueue copies it to the Workload's ``priorityClassRef``."""
YUNIKORN_APP_LABEL = "yunikorn.apache.org/app-id"
YUNIKORN_QUEUE_LABEL = "yunikorn.apache.org/queue"
YUNIKORN_POLICY_ANNOTATION = "yunikorn.apache.org/schedulingPolicyParameters"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_TOPOLOGY_ANNOTATIONS = {
    "required": "kueue.x-k8s.io/podset-required-topology",
    "preferred": "kueue.x-k8s.io/podset-preferred-topology",
}
"""Kueue's Topology-Aware Scheduling annotations on a pod set's template (v0.19
``apis/kueue/v1beta2/topology_types.go``: ``PodSetRequiredTopologyAnnotation``,
``PodSetPreferredTopologyAnnotation``), by ``scheduling.topology.mode``: the node label of the
domain the pod set must (or should) fit in."""
SP_POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
SP_SCHEDULER_NAME = "scheduler-plugins-scheduler"


@dataclass
class GangMember:
    """One group of identical pods of the gang (the head, or one worker group)."""

    replicas: int
    requests: dict[str, str]


@dataclass
class GangPlan:
    """What one scheduler strategy adds to the children."""

    rayjob_labels: dict[str, str] = field(default_factory=dict)
    pod_labels: dict[str, str] = field(default_factory=dict)
    pod_annotations: dict[str, str] = field(default_factory=dict)
    worker_annotations: dict[str, str] = field(default_factory=dict)
    """Annotations of the worker groups' pod templates only (not the head's)."""
    scheduler_name: str | None = None
    create_suspended: bool = False
    objects: list[dict[str, Any]] = field(default_factory=list)
    autoscaling: bool = True
    """Whether KubeRay's in-tree autoscaler may run for an elastic rollout group
    (:attr:`GangScheduler.autoscaling`)."""


@dataclass(frozen=True)
class GangJob:
    """What a strategy knows of one job: its identity, its gang and its scheduling spec."""

    job: PPOJob
    name: str
    namespace: str
    members: list[GangMember]
    owner_refs: list[dict[str, Any]] | None = None
    uid: str | None = None
    attempt: int = 0


class GangScheduler:
    """One gang scheduler (the interface; one subclass per value of ``gangScheduler``).

    ``kuberay_batch_scheduler`` is what KubeRay's installation-wide ``batchScheduler.name`` must
    be for this scheduler's jobs to work ("" = unset): KubeRay makes the gang itself for
    ``volcano`` and ``yunikorn``, and must stay out of the way for the others.

    ``owns_suspend``: the scheduler owns ``RayJob.spec.suspend`` (Kueue admits a job by
    unsuspending its RayJob): the operator suspends and resumes through the scheduler's own
    object, and makes no RayJob for a job created suspended (it would be admitted)."""

    name: str = ""
    kuberay_batch_scheduler: str = ""
    owns_suspend: bool = False
    autoscaling: bool = True
    """Whether the scheduler lets KubeRay's in-tree autoscaler grow and shrink a worker group
    (``enableInTreeAutoscaling``), as an elastic rollout group needs."""

    def plan(self, gang: GangJob) -> GangPlan:
        """The labels, annotations, scheduler name and extra objects of one job's children."""
        return GangPlan(autoscaling=self.autoscaling)

    def attempt_labels(
        self, namespace: str, name: str, uid: str | None, attempt: int | str
    ) -> dict[str, str]:
        """Labels a RayJob needs when it starts a new Ray cluster (a resume, KubeRay's retry)."""
        return {}


class Volcano(GangScheduler):
    """KubeRay makes the Volcano PodGroup and sets ``schedulerName: volcano`` on the pods."""

    name = "volcano"
    kuberay_batch_scheduler = "volcano"

    def plan(self, gang: GangJob) -> GangPlan:
        sched = gang.job.spec.scheduling
        out = super().plan(gang)
        out.rayjob_labels[GANG_LABEL] = "true"
        if sched.queue:
            out.rayjob_labels[VOLCANO_QUEUE_LABEL] = sched.queue
        if sched.priority_class_name:
            out.rayjob_labels[PRIORITY_LABEL] = sched.priority_class_name
        return out


class YuniKorn(GangScheduler):
    """KubeRay writes the task groups; we name the application (fresh per attempt) and ask for
    a hard gang with the job's timeout."""

    name = "yunikorn"
    kuberay_batch_scheduler = "yunikorn"

    def plan(self, gang: GangJob) -> GangPlan:
        sched = gang.job.spec.scheduling
        out = super().plan(gang)
        out.rayjob_labels[GANG_LABEL] = "true"
        out.rayjob_labels.update(
            self.attempt_labels(gang.namespace, gang.name, gang.uid, gang.attempt)
        )
        if sched.queue:
            out.rayjob_labels[YUNIKORN_QUEUE_LABEL] = sched.queue
        out.pod_annotations[YUNIKORN_POLICY_ANNOTATION] = (
            f"placeholderTimeoutInSeconds={sched.timeout_seconds} gangSchedulingStyle=Hard"
        )
        return out

    def attempt_labels(
        self, namespace: str, name: str, uid: str | None, attempt: int | str
    ) -> dict[str, str]:
        return {YUNIKORN_APP_LABEL: yunikorn_app_id(namespace, name, uid, attempt)}


class Kueue(GangScheduler):
    """The RayJob is created suspended in the job's LocalQueue; Kueue admits it whole (with
    ``scheduling.topology``, each worker group within one domain of the topology level)."""

    name = "kueue"
    owns_suspend = True
    # Kueue's RayJob webhook (0.17 to 0.19) refuses enableInTreeAutoscaling unless its
    # ElasticJobsViaWorkloadSlices gate is on and the job opts in (raycluster/common.go): an
    # elastic rollout group under Kueue keeps the replicas it started with (and with workload
    # slices Kueue would refuse scheduling.topology's annotations on an elastic group).
    autoscaling = False

    def plan(self, gang: GangJob) -> GangPlan:
        sched = gang.job.spec.scheduling
        out = super().plan(gang)
        if sched.queue:
            out.rayjob_labels[KUEUE_QUEUE_LABEL] = sched.queue
        if sched.workload_priority_class:
            out.rayjob_labels[KUEUE_PRIORITY_LABEL] = sched.workload_priority_class
        if sched.topology is not None:
            # each worker group in one domain, chosen group by group; not the head, one pod,
            # which fits one domain wherever it fits, and which the annotation would confine
            # to the ClusterQueue's topology flavors (a head on a CPU pool outside them would
            # never be admitted)
            key = KUEUE_TOPOLOGY_ANNOTATIONS[sched.topology.mode]
            out.worker_annotations[key] = sched.topology.level
        out.create_suspended = True
        return out


class SchedulerPlugins(GangScheduler):
    """We create the Coscheduling PodGroup ourselves and send every pod to its scheduler."""

    name = "scheduler-plugins"

    def plan(self, gang: GangJob) -> GangPlan:
        out = super().plan(gang)
        out.pod_labels[SP_POD_GROUP_LABEL] = gang.name
        out.scheduler_name = SP_SCHEDULER_NAME
        out.objects.append(
            scheduler_plugins_podgroup(
                name=gang.name,
                namespace=gang.namespace,
                members=gang.members,
                timeout_seconds=min(
                    gang.job.spec.scheduling.permit_timeout_seconds,
                    gang.job.spec.scheduling.timeout_seconds,
                ),
                owner_refs=gang.owner_refs,
            )
        )
        return out


class Kai(GangScheduler):
    """KubeRay (>= 1.6, ``--batch-scheduler=kai-scheduler``) sends every pod to KAI with the
    RayJob's queue label; KAI's pod grouper makes one PodGroup from the pods' common owner, so
    the head and every worker group are admitted together (SidecarMode: the submitter is a
    container of the head pod, inside the gang)."""

    name = "kai"
    kuberay_batch_scheduler = "kai-scheduler"

    def plan(self, gang: GangJob) -> GangPlan:
        out = super().plan(gang)
        if gang.job.spec.scheduling.queue:
            out.rayjob_labels[KAI_QUEUE_LABEL] = gang.job.spec.scheduling.queue
        return out


class NoGang(GangScheduler):
    """The default scheduler, pod by pod: nothing to add."""

    name = "none"


STRATEGIES: dict[str, GangScheduler] = {
    s.name: s for s in (Volcano(), YuniKorn(), Kueue(), SchedulerPlugins(), Kai(), NoGang())
}
"""Every gang scheduler by its ``gangScheduler`` value."""
GANG_SCHEDULERS = tuple(STRATEGIES)


def strategy(scheduler: str) -> GangScheduler:
    """The strategy of a ``gangScheduler`` value."""
    try:
        return STRATEGIES[scheduler]
    except KeyError:
        raise ValueError(
            f"unknown gang scheduler {scheduler!r}; one of {GANG_SCHEDULERS}"
        ) from None


def effective_scheduler(job: PPOJob, default: str | None) -> str:
    """The job's gang scheduler: the spec's, else the operator default, else ``none``. Judged on
    the value (unset is ``None``), so a manifest and its stored form give the same answer."""
    named = job.spec.scheduling.gang_scheduler
    if named is not None:
        return named
    if default:
        return strategy(default).name
    return "none"


def kuberay_disagreement(scheduler: str, kuberay_batch_scheduler: str | None) -> str | None:
    """Why a job with gang scheduler ``scheduler`` cannot run under KubeRay's installation-wide
    ``batchScheduler`` (None when it can, or when the operator was not told KubeRay's setting)."""
    if kuberay_batch_scheduler is None:
        return None
    b = kuberay_batch_scheduler
    if b in KUBERAY_RAYCLUSTER_ONLY:
        return (
            f"KubeRay runs with batchScheduler {b}, which supports RayCluster only: KubeRay "
            'fails every RayJob ("currently only RayCluster is supported"), so no PPOJob can '
            "start. Unset KubeRay's batchScheduler (ppojob creates scheduler-plugins PodGroups "
            "itself) and set the ppojob operator's kuberay.batchScheduler to match"
        )
    needed = strategy(scheduler).kuberay_batch_scheduler
    if b == needed:
        return None
    if b:
        return (
            f"spec.scheduling.gangScheduler is {scheduler}, but KubeRay runs with batchScheduler "
            f"{b}, which it applies to every RayJob (the pods would go to {b}, not {scheduler}). "
            f"Set spec.scheduling.gangScheduler: {b}, or run a KubeRay without a batchScheduler"
        )
    return (
        f"spec.scheduling.gangScheduler is {scheduler}, but KubeRay runs without a "
        f"batchScheduler, so nothing would create the {scheduler} gang. Start KubeRay with "
        f"batchScheduler.name={scheduler} (and tell the ppojob operator: "
        f"kuberay.batchScheduler={scheduler}), or choose kueue, scheduler-plugins or none"
    )


def yunikorn_app_id(namespace: str, name: str, uid: str | None, attempt: int | str = 0) -> str:
    """A YuniKorn application id unique per job object and attempt, at most 63 characters (a
    label value). The readable prefix may be cut; the hash is of the whole identity."""
    import hashlib

    ident = f"{namespace}/{name}/{uid or ''}/{attempt}"
    digest = hashlib.sha256(ident.encode()).hexdigest()[:10]
    head = f"ppojob-{name}"[: 63 - 1 - len(digest)].rstrip("-.")
    return f"{head}-{digest}"


def _format_quantity(name: str, total: float) -> str:
    """CPU in whole cores or millicores; everything else (bytes, devices) as a whole number."""
    if name == "cpu":
        milli = round(total * 1000)
        return f"{milli // 1000}" if milli % 1000 == 0 else f"{milli}m"
    return f"{round(total)}"


def gang_totals(members: list[GangMember]) -> tuple[int, dict[str, str]]:
    """minMember and minResources of the whole gang."""
    count = sum(m.replicas for m in members)
    sums: dict[str, float] = {}
    for m in members:
        for name, qty in m.requests.items():
            sums[name] = sums.get(name, 0.0) + m.replicas * quantity_bytes(qty)
    return count, {k: _format_quantity(k, v) for k, v in sorted(sums.items()) if v > 0}


def plan(
    job: PPOJob,
    *,
    name: str,
    namespace: str,
    scheduler: str,
    members: list[GangMember],
    owner_refs: list[dict[str, Any]] | None = None,
    uid: str | None = None,
    attempt: int = 0,
) -> GangPlan:
    """The gang plan of one job for one scheduler (``attempt``: see :func:`yunikorn_app_id`)."""
    gang = GangJob(job, name, namespace, members, owner_refs, uid, attempt)
    return strategy(scheduler).plan(gang)


def scheduler_plugins_podgroup(
    *,
    name: str,
    namespace: str,
    members: list[GangMember],
    timeout_seconds: int,
    owner_refs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The ``scheduling.x-k8s.io/v1alpha1`` PodGroup holding head and all workers."""
    count, resources = gang_totals(members)
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {"app.kubernetes.io/managed-by": "ppojob-operator", "ppojob.io/job": name},
    }
    if owner_refs:
        meta["ownerReferences"] = owner_refs
    return {
        "apiVersion": "scheduling.x-k8s.io/v1alpha1",
        "kind": "PodGroup",
        "metadata": meta,
        "spec": {
            "minMember": count,
            "minResources": resources,
            "scheduleTimeoutSeconds": timeout_seconds,
        },
    }
