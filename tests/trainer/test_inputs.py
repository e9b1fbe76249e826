"""Inputs as users have them: dependency floor, prompt truncation, critic tokenizer, dataset
formats."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tomllib

from ppojob_api.checks import check_training_half
from ppojob_api.training import TrainerConfig
from ppojob_trainer import models
from ppojob_trainer.distributed import ShardIdentity
from ppojob_trainer.tasks import Example, make_task
from ppojob_trainer.workers.rollout import RolloutWorker, truncate_left

ROOT = Path(__file__).resolve().parents[2]


def test_transformers_floor_has_the_dtype_keyword():
    """The code loads models with ``dtype=``; releases before 4.56 ignore it (bf16 loads as
    fp32), so the trainer extra must not allow them."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in extra["optional-dependencies"]["trainer"]]
    (tf,) = [r for r in reqs if r.name == "transformers"]
    floors = [Version(s.version) for s in tf.specifier if s.operator == ">="]
    assert floors and min(floors) >= Version("4.56")
    assert not tf.specifier.contains("4.55.4")


def test_truncate_left_keeps_bos():
    assert truncate_left([1, 5, 6, 7, 8], 3, bos_id=1) == [1, 7, 8]
    assert truncate_left([5, 6, 7, 8], 3, bos_id=1) == [6, 7, 8]
    assert truncate_left([1, 5, 6], 3, bos_id=1) == [1, 5, 6]
    assert truncate_left([1, 5, 6, 7], 2, bos_id=None) == [6, 7]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return models.materialize_builtin("tiny-llama", 5, tmp_path_factory.mktemp("cache"))


def test_long_prompts_keep_their_bos_token(model_dir):
    cfg = TrainerConfig.model_validate({"data": {"maxPromptLength": 4}})
    worker = RolloutWorker(cfg, ShardIdentity("rollout"), model_dir, "cpu")
    tok = worker.tokenizer
    _, ids, mask = worker.encode(["1234567890", "12"])
    full = tok("1234567890")["input_ids"]
    assert full[0] == tok.bos_token_id and len(full) > 4
    kept = ids[0][mask[0]].tolist()
    assert kept == [tok.bos_token_id, *full[-3:]]
    assert ids[1][mask[1]].tolist() == tok("12")["input_ids"]  # short prompts untouched
    assert ids[1][~mask[1]].tolist() == [tok.pad_token_id]  # left padding


def test_a_critic_with_another_tokenizer_is_rejected(model_dir, tmp_path):
    same = tmp_path / "same"
    shutil.copytree(model_dir, same)
    models.check_critic_tokenizer(model_dir, same)  # same tokenizer: fine

    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    tok = models.load_tokenizer(other)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    with pytest.raises(ValueError, match=r"model\.criticPath.*<extra>"):
        models.check_critic_tokenizer(model_dir, other)


@pytest.mark.slow
def test_the_trainer_refuses_to_start_a_critic_with_another_tokenizer(
    model_dir, tmp_path, local_ray, monkeypatch
):
    from ppojob_trainer.driver.trainer import PPOTrainer

    monkeypatch.setenv("PPOJOB_CACHE_DIR", str(tmp_path / "cache"))
    other = tmp_path / "critic"
    shutil.copytree(model_dir, other)
    tok = models.load_tokenizer(other)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    cfg = TrainerConfig.model_validate(
        {
            "model": {"path": str(model_dir), "criticPath": str(other)},
            "algorithm": {"advantageEstimator": "gae"},
            "data": {"rolloutBatchSize": 2, "samplesPerPrompt": 2},
            "training": {"steps": 1},
        }
    )
    with pytest.raises(Exception, match=r"model\.criticPath"):
        PPOTrainer(cfg)


RECORDS = [{"prompt": "12", "label": "21"}, {"prompt": "345", "label": None}, {"prompt": "6"}]


def _write_all(tmp_path: Path) -> dict[str, Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = {}
    out["jsonl"] = tmp_path / "p.jsonl"
    out["jsonl"].write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    out["json"] = tmp_path / "p.json"
    out["json"].write_text(json.dumps(RECORDS))
    table = pa.Table.from_pylist(
        [{"prompt": r["prompt"], "label": r.get("label")} for r in RECORDS]
    )
    out["parquet"] = tmp_path / "p.parquet"
    pq.write_table(table, out["parquet"])
    ds = datasets.Dataset.from_list(
        [{"prompt": r["prompt"], "label": r.get("label")} for r in RECORDS]
    )
    out["saved"] = tmp_path / "saved"
    ds.save_to_disk(str(out["saved"]))
    out["saved_dict"] = tmp_path / "saved_dict"
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(out["saved_dict"]))
    return out


def test_every_documented_prompt_format_loads_the_same_examples(tmp_path):
    expected = [Example(r["prompt"], r.get("label")) for r in RECORDS]
    for kind, path in _write_all(tmp_path).items():
        task = make_task(str(path), shuffle=False)
        assert task.examples == expected, kind
        cfg = TrainerConfig.model_validate(
            {"data": {"prompts": str(path), "rewardFunction": "m:f"}}
        )
        assert check_training_half(cfg) == [], kind


def test_unsupported_prompt_sources_are_rejected_clearly(tmp_path):
    cfg = TrainerConfig.model_validate({"data": {"prompts": "data.csv", "rewardFunction": "m:f"}})
    (problem,) = check_training_half(cfg)
    assert problem.path == "spec.data.prompts" and "save_to_disk" in problem.message
    plain = tmp_path / "not-a-dataset"
    plain.mkdir()
    (plain / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match="save_to_disk"):
        make_task(str(plain))
    import datasets

    ds = datasets.Dataset.from_list(RECORDS[:1])
    datasets.DatasetDict({"validation": ds}).save_to_disk(str(tmp_path / "nosplit"))
    with pytest.raises(ValueError, match="no 'train' split"):
        make_task(str(tmp_path / "nosplit"))
