"""Admission-time validation (issue 41, item 5): the CRD's CEL rules and bounds give each manifest
the verdict `ppojob validate` gives it, naming the same field, on the real API server; and a
started job's spec is immutable but for spec.suspend, as the operator applies it.

Each row of `ADMISSION` is sent through both the Python validation and a dry-run create; the two
verdicts must be equal and equal to the row's, and a refusal must name the row's field in both.
Each row of `EDITS` is a merge patch to a started job: the API server refuses it exactly when the
operator's own comparison (`status.changed_fields`, what it reports as SpecChangeRefused) finds a
changed field."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from ppojob_api.cel import ADMISSION_RULES, LIST_MAX, STRING_MAX
from ppojob_api.metadata import MAX_NAME_LENGTH
from ppojob_operator.state import normalized
from ppojob_operator.status import changed_fields
from tests.api.test_bad_input import TINY
from tests.cluster.conftest import OperatorProcess
from tests.cluster.test_api_agreement import server_refusal, validate_refusal
from tests.helpers.cluster_jobs import PPOJOB
from tests.helpers.controlplane import ControlPlane
from tests.helpers.manifests import DELETE, set_path

PVC = {"persistentVolumeClaim": {"claimName": "ckpt"}}
NFS = {"server": "nfs.example.com", "path": "/exports/ckpt"}


@dataclass(frozen=True)
class Case:
    name: str
    doc: dict[str, Any]
    refused: bool
    field: str = ""
    """The field both refusals name."""
    server_field: str = ""
    """Where the API server names another field than the Python check (generateName)."""


def edit(*pairs: tuple[str, Any], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    doc = copy.deepcopy(TINY)
    for path, value in pairs:
        doc = set_path(doc, path, value)
    if meta is not None:
        doc["metadata"] = meta
    return doc


ABSOLUTE = ("spec.training.checkpointDir", "/checkpoints")
ADMISSION: list[Case] = [
    Case("the tiny example", edit(), False),
    Case(
        f"a name of {MAX_NAME_LENGTH} characters",
        edit(meta={"name": "a" * MAX_NAME_LENGTH}),
        False,
    ),
    Case(
        f"a name of {MAX_NAME_LENGTH + 1} characters",
        edit(meta={"name": "a" * (MAX_NAME_LENGTH + 1)}),
        True,
        "metadata.name",
    ),
    Case(
        "a generateName the 5 generated characters make too long",
        edit(meta={"generateName": "a" * (MAX_NAME_LENGTH - 4)}),
        True,
        "metadata.generateName",
        "metadata.name",
    ),
    Case("a name with a dot", edit(meta={"name": "my.job"}), True, "metadata.name"),
    Case("a name starting with a digit", edit(meta={"name": "1job"}), True, "metadata.name"),
    Case(
        "a checkpoint volume with two sources",
        edit(ABSOLUTE, ("spec.checkpointVolume", {**PVC, "nfs": NFS})),
        True,
        "spec.checkpointVolume",
    ),
    Case(
        "a checkpoint volume without a source",
        edit(ABSOLUTE, ("spec.checkpointVolume", {})),
        True,
        "spec.checkpointVolume",
    ),
    Case(
        "a checkpoint volume with one source and a null",
        edit(ABSOLUTE, ("spec.checkpointVolume", {**PVC, "nfs": None})),
        False,
    ),
    Case(
        "a checkpoint volume at the default (relative) checkpointDir",
        edit(("spec.checkpointVolume", PVC)),
        True,
        "spec.training.checkpointDir",
    ),
    Case(
        "kueue without a queue",
        edit(("spec.scheduling", {"gangScheduler": "kueue"})),
        True,
        "spec.scheduling.queue",
    ),
    Case(
        "kueue with a null queue",
        edit(("spec.scheduling", {"gangScheduler": "kueue", "queue": None})),
        True,
        "spec.scheduling.queue",
    ),
    Case(
        "kueue with a queue",
        edit(("spec.scheduling", {"gangScheduler": "kueue", "queue": "team-a"})),
        False,
    ),
    Case(
        "kueue with a queue that is no LocalQueue name",
        edit(("spec.scheduling", {"gangScheduler": "kueue", "queue": "Team_A"})),
        True,
        "spec.scheduling.queue",
    ),
    Case(
        "a queue without a gang scheduler",
        edit(("spec.scheduling", {"gangScheduler": "none", "queue": "q"})),
        True,
        "spec.scheduling.queue",
    ),
    Case(
        "a volcano queue that is no label value",
        edit(("spec.scheduling", {"gangScheduler": "volcano", "queue": "a b"})),
        True,
        "spec.scheduling.queue",
    ),
    Case(
        "a priority class name of 64 characters",
        edit(("spec.scheduling.priorityClassName", "p" * 64)),
        True,
        "spec.scheduling.priorityClassName",
    ),
    Case(
        "staleness with a colocated rollout",
        edit(("spec.algorithm.maxStaleness", 1)),
        True,
        "spec.algorithm.maxStaleness",
    ),
    Case(
        "staleness with engines of their own",
        edit(
            ("spec.algorithm.maxStaleness", 1),
            ("spec.roles.rollout", {"resources": {"cpus": 1, "memory": "2Gi"}}),
        ),
        False,
    ),
    Case(
        "partial rollout without staleness",
        edit(
            ("spec.algorithm.partialRollout", True),
            ("spec.roles.rollout", {"resources": {"cpus": 1, "memory": "2Gi"}}),
        ),
        True,
        "spec.algorithm.partialRollout",
    ),
    Case(
        "partial rollout with sglang engines",
        edit(
            ("spec.algorithm.partialRollout", True),
            ("spec.algorithm.maxStaleness", 1),
            ("spec.roles.rollout", {"backend": "sglang", "resources": {"gpus": 1}}),
        ),
        True,
        "spec.algorithm.partialRollout",
    ),
    Case(
        "importanceSampling and tisCap",
        edit(
            ("spec.algorithm.tisCap", 2.0),
            ("spec.algorithm.importanceSampling", {"level": "token", "mode": "truncate"}),
        ),
        True,
        "spec.algorithm.importanceSampling",
    ),
    Case(
        "a colocated critic with capabilities",
        edit(("spec.roles.critic", {"colocateWithActor": True, "capabilities": ["IPC_LOCK"]})),
        True,
        "spec.roles.critic.capabilities",
    ),
    Case(
        "a colocated rollout with capabilities",
        edit(("spec.roles.rollout", {"colocateWithActor": True, "capabilities": ["IPC_LOCK"]})),
        True,
        "spec.roles.rollout.capabilities",
    ),
    Case(
        "a variable from a Secret and a ConfigMap",
        edit(
            (
                "spec.podTemplate.env",
                [
                    {
                        "name": "TOKEN",
                        "valueFrom": {
                            "secretKeyRef": {"name": "s", "key": "k"},
                            "configMapKeyRef": {"name": "c", "key": "k"},
                        },
                    }
                ],
            )
        ),
        True,
        "spec.podTemplate.env[0].valueFrom",
    ),
    Case(
        "an envFrom with a Secret and a ConfigMap",
        edit(
            (
                "spec.podTemplate.envFrom",
                [{"secretRef": {"name": "s"}, "configMapRef": {"name": "c"}}],
            )
        ),
        True,
        "spec.podTemplate.envFrom[0]",
    ),
    Case(
        "a relative mount path",
        edit(
            ("spec.podTemplate.volumes", [{"name": "data", "emptyDir": {}}]),
            ("spec.podTemplate.volumeMounts", [{"name": "data", "mountPath": "data"}]),
        ),
        True,
        "spec.podTemplate.volumeMounts[0].mountPath",
    ),
    Case("no model", edit(("spec.model", DELETE)), True, "spec.model.path", "spec.model"),
    Case(
        "a model without a path",
        edit(("spec.model", {"dtype": "float32"})),
        True,
        "spec.model.path",
    ),
    Case(
        f"an image of {STRING_MAX + 1} characters",
        edit(("spec.image", "r/" + "i" * (STRING_MAX - 1))),
        True,
        "spec.image",
    ),
    Case(
        f"an annotation value of {STRING_MAX} two-byte characters (counted as characters)",
        edit(("spec.podTemplate.annotations", {"example.com/note": "\u00e9" * STRING_MAX})),
        False,
    ),
    Case(
        f"an annotation value of {STRING_MAX + 1} characters",
        edit(("spec.podTemplate.annotations", {"example.com/note": "\u00e9" * (STRING_MAX + 1)})),
        True,
        "spec.podTemplate.annotations.example.com/note",
    ),
    Case(
        f"{LIST_MAX + 1} image pull secrets",
        edit(("spec.imagePullSecrets", [{"name": f"s{i}"} for i in range(LIST_MAX + 1)])),
        True,
        "spec.imagePullSecrets",
    ),
    Case(
        f"{LIST_MAX} image pull secrets",
        edit(("spec.imagePullSecrets", [{"name": f"s{i}"} for i in range(LIST_MAX)])),
        False,
    ),
]


def _server(cp: ControlPlane, ns: str, doc: dict[str, Any]) -> str | None:
    """The API server's whole answer to a dry-run create of `doc` (None: it would store it)."""
    return server_refusal(cp, ns, doc, limit=None)


def test_admission_rules_and_ppojob_validate_agree(cp: ControlPlane, ns: str) -> None:
    """One table, two judges: every row gets its verdict from both, naming its field."""
    wrong = []
    for case in ADMISSION:
        ours, theirs = validate_refusal(case.doc), _server(cp, ns, case.doc)
        verdicts = (ours is not None, theirs is not None)
        if verdicts != (case.refused, case.refused):
            wrong.append(f"{case.name}: validate {ours!r}; the API server {theirs!r}")
            continue
        if case.refused:
            assert ours is not None and theirs is not None
            if case.field not in ours:
                wrong.append(f"{case.name}: validate does not name {case.field}: {ours}")
            if (case.server_field or case.field) not in theirs:
                wrong.append(f"{case.name}: the API server does not name the field: {theirs}")
    assert not wrong, "\n".join(wrong)


def test_every_admission_rule_refuses_a_row_with_its_fix(cp: ControlPlane, ns: str) -> None:
    """Each CEL rule is what refuses some row of the table (its message, fix included, is in
    the API server's answer): no rule goes untested."""
    answers = [_server(cp, ns, c.doc) or "" for c in ADMISSION if c.refused]
    untested = [r.message for r in ADMISSION_RULES if not any(r.message in a for a in answers)]
    assert not untested, untested
    assert all("fix:" in r.message for r in ADMISSION_RULES)


# ---------------------------------------------------------------------------------------------
# a started job's spec
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Edit:
    name: str
    patch: dict[str, Any]
    extra: list[str] = field(default_factory=list)


EDITS: list[Edit] = [
    Edit("suspend", {"suspend": True}),
    Edit("the image", {"image": "ghcr.io/ppojob/trainer:0.2.0"}),
    Edit("the same image again", {"image": TINY["spec"]["image"]}),
    Edit("the steps", {"training": {"steps": 7}}),
    Edit("the model", {"model": {"path": "builtin:tiny-qwen2"}}),
    Edit("a deadline added", {"activeDeadlineSeconds": 3600}),
    Edit("the failure policy", {"failurePolicy": {"onStall": "Fail"}}),
    Edit("the actor's affinity (free-form)", {"roles": {"actor": {"affinity": {"x": {"y": 1}}}}}),
    Edit(
        "a pod template volume (free-form)",
        {"podTemplate": {"volumes": [{"name": "v", "emptyDir": {}}]}},
    ),
    Edit("a tracker added", {"trackers": [{"type": "tensorboard"}]}),
    Edit("the TTL", {"ttlSecondsAfterFinished": 600}),
    Edit("suspend and the image", {"suspend": True, "image": "x:1"}),
]


def _patch(cp: ControlPlane, ns: str, name: str, spec_patch: dict[str, Any]) -> str | None:
    """A dry-run merge patch of the spec; None when the API server would apply it."""
    proc = cp.kubectl(
        "patch", PPOJOB, name, "-n", ns, "--type=merge", "--dry-run=server",
        "-p", json.dumps({"spec": spec_patch}), check=False,
    )  # fmt: skip
    return None if proc.returncode == 0 else proc.stderr


def _merged(spec: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(spec)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def _stored(cp: ControlPlane, ns: str, name: str) -> dict[str, Any]:
    obj = cp.get(PPOJOB, name, ns)
    assert obj is not None
    return obj


@pytest.fixture()
def no_operator(operator: OperatorProcess) -> Iterator[None]:
    """The session's operator (watching every namespace) stopped for the test: the job is
    started, or not, only by what the test writes in its status; started again afterwards."""
    operator.stop()
    try:
        yield
    finally:
        operator.start()


@pytest.mark.usefixtures("no_operator")
def test_a_started_jobs_spec_is_immutable_but_for_suspend(cp: ControlPlane, ns: str) -> None:
    """Before the operator made the RayJob every edit is taken (the operator reconciles the job
    as a new one); after, the API server refuses exactly the edits the operator would refuse,
    naming the field; status updates go on."""
    doc = copy.deepcopy(TINY)
    doc["metadata"] = {"name": "frozen", "namespace": ns}
    cp.apply(doc)
    refused_before = {e.name: _patch(cp, ns, "frozen", e.patch) for e in EDITS}
    assert not any(refused_before.values()), refused_before
    cp.kubectl(
        "patch", PPOJOB, "frozen", "-n", ns, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"rayJobName": "frozen", "phase": "Running"}}),
    )  # fmt: skip
    stored = _stored(cp, ns, "frozen")["spec"]
    wrong = []
    for e in EDITS:
        operator_refuses = changed_fields(normalized(stored), normalized(_merged(stored, e.patch)))
        theirs = _patch(cp, ns, "frozen", e.patch)
        if bool(operator_refuses) != (theirs is not None):
            wrong.append(f"{e.name}: the operator refuses {operator_refuses}; server: {theirs}")
        elif theirs is not None:
            top = {".".join(p.split(".")[:2]) for p in operator_refuses}
            missing = [
                t for t in top if f"{t} cannot change once the job has started" not in theirs
            ]
            if missing or "fix:" not in theirs:
                wrong.append(f"{e.name}: the refusal does not name {missing}: {theirs}")
    assert not wrong, "\n".join(wrong)
    # the operator's status writes are not spec edits
    cp.kubectl(
        "patch", PPOJOB, "frozen", "-n", ns, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"phase": "Succeeded"}}),
    )  # fmt: skip
    assert _stored(cp, ns, "frozen")["status"]["phase"] == "Succeeded"


@pytest.mark.usefixtures("no_operator")
@pytest.mark.parametrize("status", [{}, {"phase": "Invalid", "reason": "InvalidSpec"}])
def test_a_job_without_a_rayjob_takes_any_edit(cp: ControlPlane, ns: str, status: dict) -> None:
    """A job the operator has not started (invalid, held, waiting) is edited freely: the
    operator reconciles it like a new one."""
    doc = copy.deepcopy(TINY)
    doc["metadata"] = {"name": "free", "namespace": ns}
    cp.apply(doc)
    if status:
        cp.kubectl(
            "patch", PPOJOB, "free", "-n", ns, "--subresource=status", "--type=merge",
            "-p", json.dumps({"status": status}),
        )  # fmt: skip
    assert _patch(cp, ns, "free", {"image": "x:2", "training": {"steps": 3}}) is None
