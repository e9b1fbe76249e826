"""spec.algorithm.routingReplay and mixture-of-experts models (issue 44): typed, none by default,
and refused with the field and a fix where it cannot work; `ppojob validate` says so. Expert
parallelism (`parallelism.expert`, megatron roles) and the memory plan of a MoE model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from ppojob_api import memory_plan as M
from ppojob_api.checks.moe import check_routing_replay, experts_of, moe_kind
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
    assert moe_kind("org/some-moe") is None  # a hub id: the trainer tells at load
    # ... unless the memory plan knows its shape
    assert moe_kind("Qwen/Qwen3-30B-A3B") == "replayable"
    assert moe_kind("Qwen/Qwen2.5-7B-Instruct") == "dense"

    half = _half(routingReplay="rollout")
    half.model.path = deepseek
    (problem,) = check_routing_replay(half, "spec")
    assert problem.path == "spec.algorithm.routingReplay"
    assert "does not drive" in problem.message and "routingReplay: none" in problem.fix


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

    # megatron actors replay too (megatron-core's RouterReplay)
    doc["spec"]["roles"]["actor"]["backend"] = "megatron"
    doc["spec"]["model"]["dtype"] = "float32"  # megatron on CPU
    megatron = tmp_path / "megatron.yaml"
    megatron.write_text(yaml.safe_dump(doc))
    assert ppojob(["validate", str(megatron)]) == 0, capsys.readouterr().err

    # another MoE architecture: neither replayed nor converted by the megatron backend
    doc["spec"]["model"]["path"] = _config(
        tmp_path, "deepseek", model_type="deepseek_v3", n_routed_experts=8
    )
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(doc))
    assert ppojob(["validate", str(other)]) == 1
    err = capsys.readouterr().err
    assert "spec.roles.actor.backend" in err and "does not convert" in err
    assert "spec.algorithm.routingReplay" in err and "does not drive" in err


def test_the_number_of_experts_is_read_from_each_config_key(tmp_path: Path) -> None:
    assert experts_of("builtin:tiny-mixtral") == 8
    assert experts_of("builtin:tiny-llama") is None
    assert experts_of("Qwen/Qwen3-30B-A3B") == 128
    assert experts_of("Qwen/Qwen2.5-7B") is None and experts_of("org/m") is None
    for i, key in enumerate(("num_experts", "num_local_experts", "n_routed_experts")):
        assert experts_of(_config(tmp_path, f"m{i}", **{key: 6})) == 6
    assert experts_of(_config(tmp_path, "dense", model_type="llama")) is None


def test_validate_takes_expert_parallelism_on_megatron_and_refuses_it_elsewhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = yaml.safe_load(TINY.read_text())
    spec = doc["spec"]
    spec["model"] = {"path": "builtin:tiny-mixtral", "dtype": "float32"}
    spec["roles"]["actor"].update(replicas=2, backend="megatron", parallelism={"expert": 2})
    job = tmp_path / "ep.yaml"
    job.write_text(yaml.safe_dump(doc))
    assert ppojob(["validate", str(job)]) == 0, capsys.readouterr().err

    spec["roles"]["actor"]["backend"] = "torch"
    job.write_text(yaml.safe_dump(doc))
    assert ppojob(["validate", str(job)]) == 1
    err = capsys.readouterr().err
    assert "spec.roles.actor.parallelism.expert: the torch backend has no expert parallelism" in err

    spec["roles"]["actor"].update(backend="megatron", parallelism={"expert": 4})  # 2 ranks
    job.write_text(yaml.safe_dump(doc))
    assert ppojob(["validate", str(job)]) == 1
    assert "expert 4 does not divide the data-parallel size 2" in capsys.readouterr().err


def _qwen3_moe(tmp_path: Path, name: str, **fields: Any) -> str:
    """A tiny Qwen3-MoE config.json (hidden 64, 2 blocks, 4 heads of 16, 8 experts of 32, top 2,
    a dense MLP of 256 where a block has no experts, vocabulary 14), ``fields`` written over."""
    return _config(
        tmp_path,
        name,
        **{
            "model_type": "qwen3_moe",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 16,
            "intermediate_size": 256,
            "moe_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "vocab_size": 14,
            **fields,
        },
    )


def test_a_moe_config_is_counted_by_hand(tmp_path: Path) -> None:
    """Per block: attention 4 x 64 x 64 = 16384, q/k norms 2 x 16, router 8 x 64 = 512, experts
    8 x 3 x 64 x 32 = 49152, two norms 128: 66208; two blocks 132416; embedding and head
    2 x 14 x 64 + the final norm 64 = 1856. (transformers 5.25 builds the same model with
    132416 + 1856 = 134272 parameters.)"""
    shape = M.resolve_shape(_qwen3_moe(tmp_path, "q"))
    assert shape is not None
    assert (shape.experts, shape.experts_per_token, shape.expert_intermediate) == (8, 2, 32)
    assert shape.moe_layers == 2
    assert shape.params == 2 * (16384 + 32 + 512 + 49152 + 128) + 1856 == 134272
    assert shape.expert_params == 2 * 49152
    # a token runs through 2 of the 8 experts
    assert shape.active_params == 134272 - 2 * 6 * 3 * 64 * 32

    # block 0 dense (mlp_only_layers): attention 16416, MLP 3 x 64 x 256 = 49152, norms 128
    mixed = M.resolve_shape(_qwen3_moe(tmp_path, "m", mlp_only_layers=[0]))
    assert mixed is not None and mixed.moe_layers == 1
    assert mixed.params == (16416 + 49152 + 128) + (16416 + 512 + 49152 + 128) + 1856
    # decoder_sparse_step 2: only block 1 (every second) has experts
    sparse = M.resolve_shape(_qwen3_moe(tmp_path, "s", decoder_sparse_step=2))
    assert sparse is not None and sparse.moe_layers == 1 and sparse.params == mixed.params

    # Mixtral: experts of intermediate_size, no q/k norms, head width hidden / heads
    mixtral = M.resolve_shape(
        _config(
            tmp_path,
            "x",
            model_type="mixtral",
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            vocab_size=14,
        )
    )
    assert mixtral is not None and mixtral.params == 2 * (16384 + 512 + 49152 + 128) + 1856

    # the built-ins, as models.BUILTIN_MODELS builds them (transformers counts 232576, 232512)
    assert M.resolve_shape("builtin:tiny-qwen3-moe").params == 232576
    assert M.resolve_shape("builtin:tiny-mixtral").params == 232512

    # another MoE architecture (shared experts, dense layers of its own): no promise
    assert M.resolve_shape(_qwen3_moe(tmp_path, "d", model_type="deepseek_v3")) is None
    # a dense config is counted as before
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
    assert M.resolve_shape(dense) == M.Shape(64, 2, 4, 4, 256, 14)


QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}


def test_a_qwen3_30b_a3b_shaped_config_has_30_5_billion_parameters(tmp_path: Path) -> None:
    shape = M.resolve_shape(_config(tmp_path, "q", **QWEN3_30B_A3B))
    assert shape is not None and shape == M.KNOWN_SHAPES["Qwen/Qwen3-30B-A3B"]
    # attention 2 x 2048 x 4096 + 2 x 2048 x 512 = 18874368 (+ q/k norms 256), router 262144,
    # experts 128 x 3 x 2048 x 768 = 603979776, norms 4096: x 48 blocks; + 2 x 151936 x 2048 + 2048
    by_hand = 48 * (18874368 + 256 + 262144 + 603979776 + 4096) + 2 * 151936 * 2048 + 2048
    assert shape.params == by_hand == 30_532_122_624
    assert abs(shape.params - 30.5e9) / 30.5e9 < 0.02
    assert abs(shape.active_params - 3.3e9) / 3.3e9 < 0.02  # the "A3B": 3.35e9


def test_expert_parallelism_halves_the_expert_bytes_per_rank() -> None:
    shape = M.KNOWN_SHAPES["Qwen/Qwen3-30B-A3B"]
    experts, dense = shape.expert_params, shape.params - shape.expert_params
    one, two = (
        M.TrainedModel(shape, backend="megatron", dp=8, tp=2, ep=ep).states() for ep in (1, 2)
    )
    assert one["weights"] == 2 * (dense + experts) / 2
    assert two["weights"] == 2 * (dense + experts / 2) / 2  # the experts' bytes halved
    assert one["weights"] - two["weights"] == 2 * experts / 2 / 2
    assert one["grads"] - two["grads"] == 4 * experts / 2 / 2
    # the distributed optimizer: dense states over dp, the experts' over dp / ep ranks that each
    # hold experts / ep: per rank the same
    assert one["optimizer"] == two["optimizer"] == 12 * shape.params / (2 * 8)
    # torch (FSDP or not) holds every expert: parallelism.expert is megatron's
    torch = M.TrainedModel(shape, backend="torch", dp=8, ep=1, sharding="fsdp").states()
    assert torch["weights"] == 4 * shape.params / 8


def _ep_job(expert: int) -> TrainingHalf:
    doc = yaml.safe_load(TINY.read_text())["spec"]
    doc["model"] = {"path": "Qwen/Qwen3-30B-A3B", "dtype": "bfloat16"}
    doc["roles"] = {
        "actor": {
            "replicas": 2,
            "backend": "megatron",
            "resources": {"gpus": 8},
            "parallelism": {"tensor": 2, "expert": expert},
        },
        "rollout": {"backend": "sglang", "resources": {"gpus": 8}, "parallelism": {"tensor": 4}},
    }
    doc["algorithm"] = {"advantageEstimator": "grpo", "kl": {"coefficient": 0.001}}
    doc["data"].update(maxPromptLength=512, maxResponseLength=512)
    doc["training"] = {"miniBatchSize": 64, "microBatchSize": 1}
    training = {k: v for k, v in doc.items() if k in TrainingHalf.model_fields}
    return TrainingHalf.model_validate(training)


def test_the_plan_of_a_job_splits_the_experts_over_expert_parallel_ranks() -> None:
    """Through the spec: parallelism.expert reaches the actor's weights, grads and reference."""
    shape = M.KNOWN_SHAPES["Qwen/Qwen3-30B-A3B"]
    (one, _), (eight, _) = (M.plan_job(_ep_job(ep), 80.0) for ep in (1, 8))
    saved = shape.expert_params * (1 - 1 / 8) / 2  # tensor 2
    for part, size in (("actor weights", 2), ("actor grads", 4), ("reference", 2)):
        assert one.persistent[part] - eight.persistent[part] == pytest.approx(size * saved)
    assert one.persistent["actor optimizer"] == eight.persistent["actor optimizer"]
    assert any("128 experts (top-8" in n and "holds 16 of them" in n for n in eight.notes)
    assert any("each rank holds all of them" in n for n in one.notes)
    # activations count the top-8 experts' intermediates, not a dense MLP of 6144
    dense_mlp = M.Shape(2048, 48, 32, 4, 6144, 151936, head_dim=128)
    assert shape.forward_width(True) != dense_mlp.forward_width(False)
    assert shape.widest_forward == (2 * 2048 + 2 * 4096 + 2 * 512 + 3 * 8 * 768 + 8 * 2048 + 128)


def test_render_and_validate_plan_show_the_experts(capsys: pytest.CaptureFixture[str]) -> None:
    example = Path(__file__).parents[2] / "examples" / "ppojob-qwen3-moe-megatron-ep.yaml"
    for command in (["render", str(example)], ["validate", "--plan", str(example)]):
        assert ppojob(command) == 0
        out = capsys.readouterr().out
        assert "mixture of experts: 128 experts (top-8, intermediate 768) in 48 of 48 blocks" in out
        assert "30.53B parameters (3.35B active per token)" in out
        assert "expert parallel 8: each rank holds 16 of them per block" in out
