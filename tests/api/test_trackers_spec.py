"""spec.trackers: a discriminated union by `type` (tensorboard, mlflow, wandb). Its problems name
the field as written (no union tag in the path), a credential key points at secretRef, and the
CRD holds every member's fields in one structural object without one member's defaults."""

from __future__ import annotations

from typing import Any

import pytest

from ppojob_api.crd import build_crd
from ppojob_api.problems import SpecError
from ppojob_api.training import MlflowTracker, TensorBoardTracker, WandbTracker
from ppojob_api.validation import validate_manifest
from tests.helpers.manifests import base_manifest

MLFLOW = {"type": "mlflow", "trackingUri": "http://mlflow:5000"}
WANDB = {"type": "wandb", "project": "ppo"}


def _problems(*trackers: Any) -> list[str]:
    with pytest.raises(SpecError) as info:
        validate_manifest(base_manifest(trackers=list(trackers)))
    return [str(p) for p in info.value.problems]


def test_each_type_is_its_own_model() -> None:
    spec = validate_manifest(
        base_manifest(trackers=[{"type": "tensorboard"}, MLFLOW, {**WANDB, "mode": "offline"}])
    ).spec
    tb, ml, wb = spec.trackers
    assert isinstance(tb, TensorBoardTracker) and tb.log_dir == "tensorboard"
    assert isinstance(ml, MlflowTracker) and ml.tracking_uri == "http://mlflow:5000"
    assert isinstance(wb, WandbTracker) and (wb.mode, wb.dir) == ("offline", "wandb")


@pytest.mark.parametrize("key", ["apiKey", "token", "password", "api_key", "WANDB_API_KEY"])
def test_a_credential_in_the_job_points_at_secret_ref(key: str) -> None:
    (problem,) = _problems({**WANDB, key: "s3cr3t"})
    assert problem.startswith(f"spec.trackers[0].{key}: credentials never go in a PPOJob")
    assert "name the Secret in secretRef" in problem
    assert "s3cr3t" not in problem


def test_the_path_has_no_union_tag_and_fixes_name_the_members_fields() -> None:
    assert _problems({"type": "mlflow"}) == [
        "spec.trackers[0].trackingUri: required field is missing (fix: add it)"
    ]
    (typo,) = _problems({**WANDB, "prject": "x"})
    assert typo.startswith("spec.trackers[0].prject: unknown field")
    assert "did you mean `project`?" in typo
    (spelling,) = _problems({"type": "tensorboard", "logdir": "x"})
    assert "write it as `logDir`" in spelling


def test_an_unknown_or_missing_type_names_the_types() -> None:
    assert _problems({"type": "comet"}) == [
        "spec.trackers[0].type: unknown type 'comet' "
        "(fix: use one of 'tensorboard', 'mlflow', 'wandb')"
    ]
    assert _problems({"logDir": "x"}) == [
        "spec.trackers[0].type: required field is missing "
        "(fix: add it: one of tensorboard, mlflow, wandb)"
    ]


def test_the_crd_holds_every_members_fields_and_no_member_default() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    items = schema["properties"]["spec"]["properties"]["trackers"]["items"]
    assert items["type"] == "object" and items["required"] == ["type"]
    props = items["properties"]
    assert props["type"]["enum"] == ["tensorboard", "mlflow", "wandb"]
    assert {"logDir", "trackingUri", "project", "mode", "dir", "secretRef"} <= set(props)
    assert not [name for name, prop in props.items() if "default" in prop]
    assert props["trackingUri"]["description"].startswith("MLflow: ")
    assert "token" not in props and "apiKey" not in props
