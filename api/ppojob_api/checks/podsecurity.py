"""Pod Security Standards: the level (``restricted``, ``baseline``, ``privileged``) a namespace
must allow for a job's pods, feature by feature, as Kubernetes' PodSecurity admission judges
the pods KubeRay makes from the RayJob (https://kubernetes.io/docs/concepts/security/pod-security-standards/).

The trainer's pods meet ``restricted`` as built (non-root, no privilege escalation, every
capability dropped, RuntimeDefault seccomp; the K8sJobMode submitter pod likewise). What needs
more:

- ``submissionMode: SidecarMode`` needs ``baseline``: KubeRay (1.5, 1.6) adds its
  ``ray-job-submitter`` container to the head pod without a securityContext, so it has
  neither ``allowPrivilegeEscalation: false`` nor ``capabilities.drop: [ALL]``.
- ``roles.*.capabilities`` needs ``privileged``: ``IPC_LOCK``, ``SYS_RESOURCE`` and ``SYS_NICE``
  are outside ``baseline``'s list of capabilities that may be added (``restricted`` allows only
  ``NET_BIND_SERVICE``).
- ``podTemplate.volumes``: a ``hostPath`` volume needs ``privileged``; a volume type outside
  ``restricted``'s list (configMap, csi, downwardAPI, emptyDir, ephemeral, persistentVolumeClaim,
  projected, secret), such as ``nfs``, needs ``baseline``.
- ``checkpointVolume.nfs`` needs ``baseline`` (an ``nfs`` volume).
"""

from __future__ import annotations

from dataclasses import dataclass

from ppojob_api.problems import Problem
from ppojob_api.spec import PPOJobSpec

LEVELS = ("restricted", "baseline", "privileged")
"""Pod Security levels, strictest first."""
ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
"""The namespace label PodSecurity admission enforces (pods violating it are refused)."""

BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
"""Capabilities ``baseline`` lets a container add."""
RESTRICTED_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
"""Capabilities ``restricted`` lets a container add."""
RESTRICTED_VOLUMES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
"""Volume types ``restricted`` allows (``baseline`` refuses only ``hostPath``)."""

POD_ROLES = ("actor", "critic", "rollout", "reward", "sandbox")


@dataclass(frozen=True)
class Need:
    """A feature of the spec and the least strict level that admits its pods."""

    path: str
    level: str
    why: str


def needs(spec: PPOJobSpec, prefix: str = "spec") -> list[Need]:
    """Every feature of ``spec`` that ``restricted`` refuses, with the level it needs."""
    out: list[Need] = []
    if spec.submission_mode == "SidecarMode":
        out.append(
            Need(
                f"{prefix}.submissionMode",
                "baseline",
                "SidecarMode: KubeRay adds its ray-job-submitter container to the head pod "
                "without a securityContext (no allowPrivilegeEscalation: false, no "
                "capabilities.drop: [ALL]); K8sJobMode's submitter pod meets restricted",
            )
        )
    for name in POD_ROLES:
        role = getattr(spec.roles, name, None)
        if role is None or getattr(role, "colocate_with_actor", False):
            continue
        for cap in role.capabilities:
            if cap in RESTRICTED_CAPABILITIES:
                continue
            level = "baseline" if cap in BASELINE_CAPABILITIES else "privileged"
            why = f"adds capability {cap}"
            out.append(Need(f"{prefix}.roles.{name}.capabilities", level, why))
    for i, volume in enumerate(spec.pod_template.volumes):
        kinds = [k for k in volume if k != "name"]
        for kind in kinds:
            if kind == "hostPath":
                level = "privileged"
            elif kind not in RESTRICTED_VOLUMES:
                level = "baseline"
            else:
                continue
            why = f"a {kind} volume ({volume.get('name')})"
            out.append(Need(f"{prefix}.podTemplate.volumes[{i}]", level, why))
    if spec.checkpoint_volume is not None and spec.checkpoint_volume.nfs is not None:
        out.append(Need(f"{prefix}.checkpointVolume.nfs", "baseline", "an nfs volume"))
    return out


def required_level(spec: PPOJobSpec) -> str:
    """The strictest Pod Security level that admits every pod of the job."""
    levels = [n.level for n in needs(spec)]
    return max(levels, key=LEVELS.index) if levels else "restricted"


def check_pod_security(spec: PPOJobSpec, level: str, prefix: str = "spec") -> list[Problem]:
    """What a namespace enforcing Pod Security ``level`` would refuse of the job's pods (an
    unknown level is taken as ``restricted``, as PodSecurity admission itself does not: it
    refuses the label; the strictest reading never admits a job that would be refused)."""
    allowed = LEVELS.index(level) if level in LEVELS else 0
    return [
        Problem(
            n.path,
            f'{n.why}: the job\'s pods need Pod Security "{n.level}", and "{level}" refuses them',
            f'run the job in a namespace whose {ENFORCE_LABEL} is "{n.level}" (or less strict), '
            "or drop the feature",
        )
        for n in needs(spec, prefix)
        if LEVELS.index(n.level) > allowed
    ]
