"""One API rule: a manifest as written and the same manifest as the API server stores it (the CRD's
schema defaults filled in) get the same verdict from `ppojob validate` and from the operator; and
`ppojob run FILE` and the trainer started from the operator's rendered ConfigMap build the same
effective configuration, over every example and every valid manifest of the test suite.

`apply_schema_defaults` is written here, independently of the product, from the API server's rules
(k8s.io/apiextensions-apiserver, pkg/apiserver/schema/defaulting): first every null of a field that
is neither `nullable` nor defaulted is removed; then, walking down, each absent property with a
`default` gets a deep copy of it (a null of a non-nullable field counts as absent), and defaulting
recurses into every property present afterwards, into array items and into map values. A nullable
field's null is kept and never defaulted. It reads the committed CRD, the real artefact.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from ppojob_api.problems import SpecError
from ppojob_api.validation import load_trainer_config, validate_manifest
from ppojob_cli.main import main as ppojob
from ppojob_operator import builders, state
from ppojob_trainer.manifest import load_manifest
from tests.helpers.manifests import (
    GPU_JOB,
    GRPO_INVALID,
    INVALID,
    LAYOUTS,
    MEMORY_INVALID,
    SCHEDULING,
    base_manifest,
    grpo_base,
    memory_base,
    set_path,
)

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "ppojob.io_ppojobs.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


# ---------------------------------------------------------------------------------------------
# The API server's structural defaulting, written from its rules
# ---------------------------------------------------------------------------------------------
def _field_schema(schema: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
    if schema is None:
        return None
    if key in (schema.get("properties") or {}):
        return schema["properties"][key]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


def _prune_nulls(x: Any, schema: dict[str, Any] | None) -> None:
    if isinstance(x, dict):
        for key in list(x):
            sub = _field_schema(schema, key)
            if (
                x[key] is None
                and sub is not None
                and not sub.get("nullable")
                and "default" not in sub
            ):
                del x[key]
            else:
                _prune_nulls(x[key], sub)
    elif isinstance(x, list) and schema is not None:
        for item in x:
            _prune_nulls(item, schema.get("items"))


def _default(x: Any, schema: dict[str, Any] | None) -> None:
    if schema is None:
        return
    if isinstance(x, dict):
        for key, prop in (schema.get("properties") or {}).items():
            if "default" not in prop:
                continue
            if key not in x or (x[key] is None and not prop.get("nullable")):
                x[key] = copy.deepcopy(prop["default"])
        for key, value in x.items():
            _default(value, _field_schema(schema, key))
    elif isinstance(x, list):
        for item in x:
            _default(item, schema.get("items"))


def apply_schema_defaults(doc: dict[str, Any]) -> dict[str, Any]:
    """The object as the API server stores it."""
    out = copy.deepcopy(doc)
    _prune_nulls(out, SCHEMA)
    _default(out, SCHEMA)
    return out


def test_the_defaulter_follows_the_api_server_rules() -> None:
    doc = base_manifest(
        algorithm={"valueClip": None, "kl": {"coefficient": 0.1}, "gamma": None},
        roles={"rollout": {"colocateWithActor": True, "replicas": None}},
    )
    stored = apply_schema_defaults(doc)
    algo = stored["spec"]["algorithm"]
    assert algo["valueClip"] is None  # nullable: kept, not defaulted
    assert algo["gamma"] == 1.0  # non-nullable null with a default: defaulted
    assert algo["kl"] == {"coefficient": 0.1, "estimator": "k1", "mode": "reward", "horizon": 10000}
    assert algo["lambda"] == 0.95 and algo["criticWarmupSteps"] == 0
    assert stored["spec"]["roles"]["rollout"]["replicas"] == 1
    assert "actor" not in stored["spec"]["roles"]  # absent objects have no default
    assert "training" not in stored["spec"]
    assert (
        doc["spec"]["algorithm"]["valueClip"] is None and "lambda" not in doc["spec"]["algorithm"]
    )


# ---------------------------------------------------------------------------------------------
# Every valid manifest of the suite
# ---------------------------------------------------------------------------------------------
def _examples() -> dict[str, dict[str, Any]]:
    return {
        f"example:{p.name}": yaml.safe_load(p.read_text())
        for p in sorted((ROOT / "examples").glob("*.yaml"))
    }


def _layouts() -> dict[str, dict[str, Any]]:
    out = {}
    for layout, spec in LAYOUTS.items():
        for sched, scheduling in SCHEDULING.items():
            body = json.loads(json.dumps(spec))
            if scheduling:
                body["scheduling"] = scheduling
            out[f"builders:{layout}:{sched}"] = base_manifest(**body)
    return out


TINY = yaml.safe_load((ROOT / "examples" / "ppojob-tiny.yaml").read_text())
VALID: dict[str, dict[str, Any]] = {
    **_examples(),
    "validation:GPU_JOB": GPU_JOB,
    "validation:grpo": grpo_base(),
    **_layouts(),
    "builders:deadlines": base_manifest(
        activeDeadlineSeconds=3600, backoffLimit=2, ttlSecondsAfterFinished=60
    ),
    "builders:k8sjob-suspended": base_manifest(submissionMode="K8sJobMode", suspend=True),
    "builders:checkpoint-volume": base_manifest(
        checkpointVolume={"persistentVolumeClaim": {"claimName": "ckpt"}},
        training={"checkpointDir": "/checkpoints"},
    ),
    "status:steps-suspend": base_manifest(training={"steps": 5}, suspend=True),
    "run:tiny-grpo": set_path(TINY, "spec.algorithm.advantageEstimator", "grpo"),
    # nulls that mean "off" must survive storing and rendering
    "nulls:value-and-grad-clip-off": set_path(
        set_path(TINY, "spec.algorithm.valueClip", None), "spec.training.gradClip", None
    ),
    "grpo:colocated-rollout-2-actors": base_manifest(
        algorithm={"advantageEstimator": "grpo", "kl": {"coefficient": 0}},
        roles={"actor": {"replicas": 2}, "rollout": {"colocateWithActor": True}},
    ),
    "gae:colocated-critic-and-rollout-2-actors": base_manifest(
        roles={
            "actor": {"replicas": 2, "resources": {"gpus": 2}},
            "critic": {"colocateWithActor": True},
            "rollout": {"colocateWithActor": True},
        },
        training={"miniBatchSize": 32},
    ),
    # one member's default (logDir, dir, mode) must not be stored into the others
    "trackers:every-type": base_manifest(
        trackers=[
            {"type": "tensorboard"},
            {"type": "mlflow", "trackingUri": "http://mlflow:5000", "secretRef": {"name": "ml"}},
            {"type": "wandb", "project": "p", "mode": "offline"},
        ]
    ),
    "memory:colocated-engine-sized-by-the-plan": memory_base(),
    "grpo:kl-off-written-out": base_manifest(
        algorithm={"advantageEstimator": "grpo", "kl": {"coefficient": 0}, "dualClip": 3}
    ),
}


def _invalid() -> dict[str, dict[str, Any]]:
    out = {f"invalid:{why}": set_path(GPU_JOB, path, value) for why, path, value, _ in INVALID}
    out |= {
        f"invalid-grpo:{why}": set_path(grpo_base(), path, value)
        for why, path, value, _ in GRPO_INVALID
    }
    out |= {
        f"invalid-memory:{why}": set_path(memory_base(), path, value)
        for why, path, value, _ in MEMORY_INVALID
    }
    return out


def _operator_verdict(doc: dict[str, Any]) -> list[str]:
    """The operator's verdict on a stored object: the problems' paths ([] = valid)."""
    body = copy.deepcopy(doc)
    body.setdefault("metadata", {}).setdefault("namespace", "default")
    job, problems = state.parse(body)
    assert (job is None) == bool(problems)
    return sorted({p.path for p in problems})


def _cli_verdict(tmp_path: Path, doc: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> int:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    rc = ppojob(["validate", str(path)])
    capsys.readouterr()
    return rc


@pytest.mark.parametrize("name", list(VALID))
def test_valid_manifest_and_its_stored_form_are_valid_everywhere(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = VALID[name]
    stored = apply_schema_defaults(doc)
    for form in (doc, stored):
        assert _cli_verdict(tmp_path, form, capsys) == 0, validate_manifest(form)
        assert _operator_verdict(form) == []


@pytest.mark.parametrize("name", list(_invalid()))
def test_invalid_manifest_and_its_stored_form_get_the_same_verdict(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _invalid()[name]
    stored = apply_schema_defaults(doc)
    verdicts = {_operator_verdict(form).__repr__() for form in (doc, stored)}
    assert len(verdicts) == 1 and verdicts != {"[]"}, verdicts
    assert _cli_verdict(tmp_path, doc, capsys) == 1
    assert _cli_verdict(tmp_path, stored, capsys) == 1


# ---------------------------------------------------------------------------------------------
# The cluster runs what the laptop runs
# ---------------------------------------------------------------------------------------------
def _full_dump(cfg: Any) -> dict[str, Any]:
    return cfg.model_dump(by_alias=True, mode="json")


@pytest.mark.parametrize("name", list(VALID))
def test_ppojob_run_and_the_rendered_trainer_config_are_the_same(name: str, tmp_path: Path) -> None:
    doc = VALID[name]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    _, local = load_manifest(path)
    for form in (doc, apply_schema_defaults(doc)):
        job = validate_manifest(form)  # what the operator parses from the stored object
        cm = builders.config_map(job, namespace="default")
        rendered = tmp_path / "trainer.yaml"
        rendered.write_text(cm["data"][builders.CONFIG_KEY])
        cluster = load_trainer_config(rendered)  # what `ppojob-train --config` reads
        assert _full_dump(cluster) == _full_dump(local)
        assert cluster.critic_training() == local.critic_training()


def test_nulls_that_mean_off_reach_the_trainer(tmp_path: Path) -> None:
    doc = VALID["nulls:value-and-grad-clip-off"]
    job = validate_manifest(apply_schema_defaults(doc))
    rendered = tmp_path / "trainer.yaml"
    rendered.write_text(builders.trainer_config_yaml(job))
    cfg = load_trainer_config(rendered)
    assert cfg.algorithm.value_clip is None and cfg.training.grad_clip is None


def test_the_trainer_entrypoint_trains_every_rendered_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ppojob-train --config` on the config rendered from the stored object gets as far as
    calling `train()`, with the configuration `ppojob run` builds from the manifest as written.
    The fake `train` records its arguments and raises, so nothing trains."""
    from ppojob_trainer import entrypoint
    from ppojob_trainer.driver import run as driver_run

    class Stop(Exception):
        pass

    calls: list[tuple[Any, Path]] = []

    def fake_train(cfg: Any, out_dir: Path, reporter: Any) -> Any:
        calls.append((cfg, out_dir))
        raise Stop("the fake train() was reached")

    monkeypatch.setattr(driver_run, "train", fake_train)
    monkeypatch.setattr("ppojob_trainer.runtime.connect_ray", lambda: None)
    # the examples' datasets and reward modules live in their images: the pre-flight (tested on
    # its own in tests/trainer) would stop them here
    monkeypatch.setattr("ppojob_trainer.preflight.preflight", lambda cfg: [])
    for name, doc in VALID.items():
        written = tmp_path / "job.yaml"
        written.write_text(yaml.safe_dump(doc, sort_keys=False))
        _, local = load_manifest(written)
        job = validate_manifest(apply_schema_defaults(doc))
        rendered = tmp_path / f"{job.metadata.name}.yaml"
        rendered.write_text(builders.trainer_config_yaml(job))
        out = tmp_path / "o" / name.replace(":", "-")
        calls.clear()
        rc = entrypoint.main(["--config", str(rendered), "--out", str(out), "--no-progress"])
        err = capsys.readouterr().err
        assert rc == 2, (name, err)
        assert "training failed: " in err and "the fake train() was reached" in err, (name, err)
        assert len(calls) == 1, name
        cfg, out_dir = calls[0]
        assert out_dir == out
        assert _full_dump(cfg) == _full_dump(local), name


def test_validation_judges_values_not_presence() -> None:
    """Writing a default out by hand is the same as leaving it out."""
    grpo = base_manifest(
        algorithm={
            "advantageEstimator": "grpo",
            "lambda": 0.95,
            "valueClip": 0.2,
            "criticWarmupSteps": 0,
            "criticUpdatesPerStep": 1,
            "kl": {"coefficient": 0, "estimator": "k1", "mode": "reward"},
        },
        roles={"actor": {"replicas": 2}, "rollout": {"colocateWithActor": True, "replicas": 1}},
    )
    validate_manifest(grpo)
    # and a value that differs from the default is still refused, naming the field
    with pytest.raises(SpecError) as info:
        validate_manifest(set_path(grpo, "spec.algorithm.lambda", 0.9))
    assert [p.path for p in info.value.problems] == ["spec.algorithm.lambda"]
    with pytest.raises(SpecError) as info:
        validate_manifest(set_path(grpo, "spec.roles.rollout.replicas", 3))
    assert [p.path for p in info.value.problems] == ["spec.roles.rollout.replicas"]


@pytest.mark.parametrize("name", list(VALID))
def test_every_label_value_the_operator_writes_fits(name: str) -> None:
    """With the longest name and namespace validation allows, every label value of every child
    (all layouts and gang schedulers) is a valid Kubernetes label value."""
    value = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
    doc = copy.deepcopy(VALID[name])
    doc["metadata"]["name"] = "a" * 47
    job = validate_manifest(apply_schema_defaults(doc))
    seen = 0
    for child in builders.build_children(job, namespace="n" * 63):
        stack: list[Any] = [child]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                for key, sub in node.items():
                    if key == "labels" and isinstance(sub, dict):
                        for v in sub.values():
                            seen += 1
                            assert len(v) <= 63 and value.match(v), (child["kind"], key, v)
                    else:
                        stack.append(sub)
            elif isinstance(node, list):
                stack.extend(node)
    assert seen >= 5
