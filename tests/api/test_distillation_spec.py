"""spec.algorithm.distillation (issue 44): typed and bounded, refused in one line naming the
field where it cannot work, a manifest and its stored form given the same verdict; the memory
plan and `ppojob render` count the teacher."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from ppojob_api import memory_plan as M
from ppojob_api.problems import SpecError
from ppojob_api.training import TrainerConfig
from ppojob_api.validation import validate_manifest
from tests.api.test_stored_defaults import apply_schema_defaults

ROOT = Path(__file__).parents[2]
DISTILL = yaml.safe_load((ROOT / "examples" / "ppojob-tiny-distill.yaml").read_text())


def _doc(distillation: dict[str, Any], algorithm: dict[str, Any] | None = None, **spec: Any):
    doc = copy.deepcopy(DISTILL)
    doc["spec"]["algorithm"]["distillation"].update(distillation)
    doc["spec"]["algorithm"].update(algorithm or {})
    for key, value in spec.items():
        doc["spec"].setdefault(key, {}).update(value)
    return doc


def _problems(doc: dict[str, Any]) -> list[str]:
    verdicts = []
    for form in (doc, apply_schema_defaults(doc)):
        try:
            validate_manifest(form)
            verdicts.append([])
        except SpecError as exc:
            verdicts.append([str(p) for p in exc.problems])
    assert verdicts[0] == verdicts[1], "the stored form got another verdict"
    return verdicts[0]


def test_the_example_is_valid_and_a_dataset_needs_no_reward_with_the_teacher_alone() -> None:
    assert _problems(_doc({})) == []
    assert _problems(_doc({}, data={"prompts": "/data/p.jsonl"})) == []
    with_reward = _problems(_doc({"taskReward": True}, data={"prompts": "/data/p.jsonl"}))
    assert any(
        "spec.data.rewardFunction: a dataset needs a reward function" in p for p in with_reward
    )


@pytest.mark.parametrize(
    ("distillation", "algorithm", "spec", "field", "why"),
    [
        ({}, {"advantageEstimator": "grpo"}, {}, "algorithm.distillation.mode",
         "grpo compares outcome rewards within a group"),
        ({"teacher": "builtin:nope"}, {}, {}, "algorithm.distillation.teacher",
         "unknown built-in model 'builtin:nope'"),
        ({"teacher": "s3://bucket/t"}, {}, {}, "algorithm.distillation.teacher",
         "URIs are not loaded"),
        ({}, {}, {"data": {"rewardFunction": "builtin:count-up"}},
         "algorithm.distillation.taskReward", "data.rewardFunction would do nothing"),
        ({}, {"overlongShaping": {"bufferLength": 2}}, {},
         "algorithm.distillation.taskReward", "algorithm.overlongShaping would do nothing"),
        ({}, {}, {"roles": {"actor": {"backend": "megatron"}}},
         "algorithm.distillation.teacher", "the megatron actor does not host one yet"),
    ],
)  # fmt: skip
def test_settings_that_cannot_work_are_refused_naming_the_field(
    distillation: dict, algorithm: dict, spec: dict, field: str, why: str
) -> None:
    problems = _problems(_doc(distillation, algorithm, **spec))
    assert any(p.startswith(f"spec.{field}: ") and why in p for p in problems), problems


def test_the_loss_mode_works_with_group_estimators_and_the_coefficient_is_bounded() -> None:
    assert _problems(_doc({"mode": "loss"}, {"advantageEstimator": "grpo"})) == []
    assert _problems(_doc({"coefficient": 0})) == []  # measured, not learned from
    with pytest.raises(SpecError, match=r"coefficient"):
        validate_manifest(_doc({"coefficient": -1}))
    with pytest.raises(SpecError, match=r"teacher"):
        validate_manifest(_doc({"teacher": ""}))


def _gpu_job(**distillation: Any) -> TrainerConfig:
    algo: dict[str, Any] = {"advantageEstimator": "grpo"}
    if distillation:
        algo["distillation"] = {"mode": "loss", **distillation}
    return TrainerConfig.model_validate(
        {
            "model": {"path": "Qwen/Qwen2.5-7B", "dtype": "bfloat16"},
            "roles": {
                "actor": {"replicas": 8, "resources": {"gpus": 1}},
                "rollout": {"replicas": 2, "resources": {"gpus": 1}},
            },
            "algorithm": algo,
            "data": {"maxPromptLength": 1024, "maxResponseLength": 1024},
            "training": {"microBatchSize": 2, "sharding": "fsdp"},
        }
    )


def test_the_memory_plan_counts_the_teacher_on_every_actor_gpu() -> None:
    """A 1.5B teacher of a 7B student: its weights in model.dtype (whole on each actor GPU,
    not sharded) and its scoring forward as a phase; an unknown teacher is a note."""
    small = M.KNOWN_SHAPES["Qwen/Qwen2.5-1.5B"]
    base = M.plan_job(_gpu_job())[0]
    actor = M.plan_job(_gpu_job(teacher="Qwen/Qwen2.5-1.5B"))[0]
    assert actor.persistent["teacher"] == 2 * small.params
    tokens = 2 * 2048
    scoring = actor.phases["teacher scoring"]
    assert scoring["teacher forward (one block)"] == tokens * 2 * (
        4 * small.hidden + 2 * small.kv_dim + 3 * small.intermediate
    )
    assert scoring["teacher logits"] == 1024 * small.vocab * 12
    assert actor.peak >= base.peak + 2 * small.params
    fp32 = M.plan_job(_gpu_job(teacher="Qwen/Qwen2.5-1.5B", dtype="float32"))[0]
    assert fp32.persistent["teacher"] == 4 * small.params
    unknown = M.plan_job(_gpu_job(teacher="someorg/unknown-model"))[0]
    assert "teacher" not in unknown.persistent
    assert "algorithm.distillation.teacher: shape unknown here" in unknown.notes
    assert "teacher" in M.WEIGHT_PARTS  # loaded before a colocated engine sizes its memory


def test_render_prints_the_teacher_in_the_plan(tmp_path: Path, capsys) -> None:
    from ppojob_cli.main import main

    doc = yaml.safe_load((ROOT / "examples" / "ppojob-grpo-kueue.yaml").read_text())
    doc["spec"]["algorithm"]["distillation"] = {
        "teacher": doc["spec"]["model"]["path"],
        "mode": "loss",
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["render", str(path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    plan = [line for line in out.splitlines() if line.startswith("#")]
    assert any(line.split()[1:3] == ["teacher", "2.875"] for line in plan), plan  # 1.5B, bf16
