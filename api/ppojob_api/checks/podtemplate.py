"""Checks of spec.podTemplate: labels and annotations that are valid and leave the operator's and
the gang scheduler's own alone; one source per variable; extra volumes with unique names that do
not shadow the trainer's own, mounted where the trainer's own are not."""

from __future__ import annotations

import re

from ppojob_api.checks.pods import volume_problems
from ppojob_api.metadata import check_label_value
from ppojob_api.problems import Problem
from ppojob_api.spec import PPOJobSpec

RESERVED_PREFIXES = (
    "ppojob.io/",
    "ray.io/",
    "app.kubernetes.io/managed-by",
    "scheduling.x-k8s.io/",
    "volcano.sh/",
    "yunikorn.apache.org/",
    "kueue.x-k8s.io/",
)
"""Keys the operator, KubeRay or a gang scheduler sets on the pods."""
OWN_VOLUMES = ("trainer-config", "dshm", "checkpoints")
OWN_PATHS = ("/etc/ppojob", "/dev/shm")
RESERVED_ENV = re.compile(r"^(PPOJOB_|RAY_)")
_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_VOLUME_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def _keys(values: dict[str, str], path: str, what: str) -> list[Problem]:
    p: list[Problem] = []
    for key in values:
        field = f"{path}.{key}"
        if not _KEY.fullmatch(key) or len(key.rpartition("/")[0]) > 253:
            p.append(Problem(field, f"is not a valid {what} key", "use [prefix/]name, e.g. team/x"))
        elif key.startswith(RESERVED_PREFIXES):
            p.append(
                Problem(
                    field,
                    f"the operator, KubeRay or the gang scheduler sets {what}s under this prefix",
                    "use a key of your own",
                )
            )
    return p


def check_pod_template(spec: PPOJobSpec, prefix: str = "spec") -> list[Problem]:
    """Every problem of spec.podTemplate."""
    t = spec.pod_template
    path = f"{prefix}.podTemplate"
    p = _keys(t.labels, f"{path}.labels", "label")
    p += _keys(t.annotations, f"{path}.annotations", "annotation")
    for key, value in t.labels.items():
        p += check_label_value(value, f"{path}.labels.{key}")
    for i, var in enumerate(t.env):
        field = f"{path}.env[{i}]"
        if RESERVED_ENV.match(var.name):
            p.append(
                Problem(
                    f"{field}.name",
                    f"{var.name}: PPOJOB_ and RAY_ variables are the operator's",
                    "use another name",
                )
            )
        src = var.value_from
        if (src.secret_key_ref is None) == (src.config_map_key_ref is None):
            p.append(
                Problem(
                    f"{field}.valueFrom",
                    "needs exactly one of secretKeyRef and configMapKeyRef",
                    "set one",
                )
            )
    for i, ref in enumerate(t.env_from):
        if (ref.secret_ref is None) == (ref.config_map_ref is None):
            p.append(
                Problem(
                    f"{path}.envFrom[{i}]",
                    "needs exactly one of secretRef and configMapRef",
                    "set one",
                )
            )
    names: list[str] = []
    for i, vol in enumerate(t.volumes):
        field = f"{path}.volumes[{i}]"
        name = vol.get("name")
        if not isinstance(name, str) or not _VOLUME_NAME.fullmatch(name):
            p.append(Problem(f"{field}.name", "needs a name (a DNS-1123 label)", "set name"))
            continue
        if name in OWN_VOLUMES or name in names:
            p.append(
                Problem(
                    f"{field}.name",
                    f"{name!r} is taken (by the trainer's own volumes or an earlier one)",
                    "rename it",
                )
            )
        if len(vol) < 2:
            p.append(Problem(field, "has no source", "add one, e.g. secret: {secretName: x}"))
        p += volume_problems(vol, field)
        names.append(name)
    own = (*OWN_PATHS, spec.training.checkpoint_dir)
    for i, m in enumerate(t.volume_mounts):
        field = f"{path}.volumeMounts[{i}]"
        if m.name not in names:
            p.append(
                Problem(
                    f"{field}.name",
                    f"no volume {m.name!r} in {path}.volumes",
                    f"add it there or mount one of {names or 'none'}",
                )
            )
        if not m.mount_path.startswith("/"):
            p.append(Problem(f"{field}.mountPath", "must be absolute", "start it with /"))
        elif any(m.mount_path.rstrip("/") == o.rstrip("/") for o in own):
            p.append(
                Problem(
                    f"{field}.mountPath",
                    f"{m.mount_path} is where the trainer's own config, shared memory or "
                    "checkpoints are mounted",
                    "mount it elsewhere",
                )
            )
    return p
