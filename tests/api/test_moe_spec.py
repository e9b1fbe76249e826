"""spec.algorithm.routingReplay and mixture-of-experts models (issue 44): typed, none by default,
and refused with the field and a fix where it cannot work; `ppojob validate` says so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from ppojob_api.checks.moe import check_routing_replay, moe_kind
from ppojob_api.training import Algorithm, TrainingHalf
from ppojob_api.yamlio import load_yaml
from ppojob_cli.main import main as ppojob

TINY = Path(__file__).parents[2] / "examples" / "ppojob-tiny.yaml"


def _half(**algorithm: Any) -> TrainingHalf:
    doc = yaml.safe_load(TINY.read_text())["spec"]
    doc["algorithm"].update(algorithm)
    training = {k: v for k, v in doc.items() if k in TrainingHalf.model_fields}
    return TrainingHalf.model_validate(training)


def test_replay_is_none_by_default_and_takes_none_or_rollout() -> None:
    assert Algorithm().routing_replay == "none"
    assert Algorithm.model_validate({"routingReplay": "rollout"}).routing_replay == "rollout"
    with pytest.raises(ValueError, match="routingReplay"):
        Algorithm.model_validate({"routingReplay": "training"})
    # `none`, not `off`: YAML 1.1 (kubectl's) reads a plain off as the boolean false
    assert load_yaml("routingReplay: none") == {"routingReplay": "none"}
    assert load_yaml("routingReplay: off") == {"routingReplay": False}


def _config(tmp_path: Path, name: str, **fields: Any) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(fields))
    return str(folder)


def test_a_model_directory_is_told_by_its_config(tmp_path: Path) -> None:
    assert moe_kind("builtin:tiny-mixtral") == "replayable"
    assert moe_kind("builtin:tiny-llama") == "dense"
    assert moe_kind(_config(tmp_path, "q", model_type="qwen3_moe", num_experts=128)) == (
        "replayable"
    )
    deepseek = _config(tmp_path, "d", model_type="deepseek_v3", n_routed_experts=256)
    assert moe_kind(deepseek) == "other-moe"
    assert moe_kind(_config(tmp_path, "l", model_type="llama")) == "dense"
    assert moe_kind("Qwen/Qwen3-30B-A3B") is None  # a hub id: the trainer tells at load

    half = _half(routingReplay="rollout")
    half.model.path = deepseek
    (problem,) = check_routing_replay(half, "spec")
    assert problem.path == "spec.algorithm.routingReplay"
    assert "cannot replay" in problem.message and "routingReplay: none" in problem.fix


def test_validate_refuses_replay_on_a_dense_model_and_accepts_it_on_a_moe_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = yaml.safe_load(TINY.read_text())
    doc["spec"]["algorithm"]["routingReplay"] = "rollout"
    dense = tmp_path / "dense.yaml"
    dense.write_text(yaml.safe_dump(doc))
    assert ppojob(["validate", str(dense)]) == 1
    err = capsys.readouterr().err
    assert "spec.algorithm.routingReplay" in err
    assert "builtin:tiny-llama is dense" in err and "builtin:tiny-qwen3-moe" in err

    doc["spec"]["model"]["path"] = "builtin:tiny-qwen3-moe"
    moe = tmp_path / "moe.yaml"
    moe.write_text(yaml.safe_dump(doc))
    assert ppojob(["validate", str(moe)]) == 0

    doc["spec"]["roles"]["actor"]["backend"] = "megatron"
    megatron = tmp_path / "megatron.yaml"
    megatron.write_text(yaml.safe_dump(doc))
    assert ppojob(["validate", str(megatron)]) == 1
    err = capsys.readouterr().err
    assert "spec.roles.actor.backend" in err and "mixture-of-experts" in err
    assert "the megatron backend does not replay routing" in err


def test_a_moe_config_gets_no_memory_plan_rather_than_a_dense_ones(tmp_path: Path) -> None:
    """The plan's Shape counts a dense MLP; a MoE model's experts would be left out."""
    from ppojob_api.memory_plan import resolve_shape

    dense = _config(
        tmp_path,
        "dense",
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        vocab_size=14,
    )
    assert resolve_shape(dense) is not None
    moe = _config(
        tmp_path,
        "moe",
        model_type="qwen3_moe",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_experts=8,
        vocab_size=14,
    )
    assert resolve_shape(moe) is None
