"""Checkpoints: atomic writes, newest-complete selection, keep-N pruning, RNG round trip."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from ppojob_trainer.checkpoint import (
    MANIFEST,
    CheckpointError,
    capture_rng_state,
    checkpoint_writer,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)


def state_at(step: int) -> dict:
    model = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(model.weight, float(step))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {
        "actor": model.state_dict(),
        "actor_optimizer": opt.state_dict(),
        "data": {"epoch": 1, "position": step * 4},
        "rng": capture_rng_state(),
    }


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    state = state_at(3)
    path = save_checkpoint(tmp_path, 3, state, keep=2)
    assert path == tmp_path / "step-000003"
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["complete"] is True and manifest["step"] == 3
    assert set(manifest["files"]) == {"actor.pt", "actor_optimizer.pt", "data.pt", "rng.pt"}
    loaded = load_checkpoint(path)
    assert loaded["step"] == 3
    assert loaded["data"] == {"epoch": 1, "position": 12}
    assert torch.equal(loaded["actor"]["weight"], state["actor"]["weight"])
    exp_avg = state["actor_optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(loaded["actor_optimizer"]["state"][0]["exp_avg"], exp_avg)
    assert latest_checkpoint(tmp_path) == path


def test_crash_mid_write_is_never_the_latest(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 10, state_at(10), keep=3)
    # A crash while writing step 20: the temp dir holds a partial file and no manifest.
    partial = tmp_path / ".tmp-step-000020-deadbeef"
    partial.mkdir()
    (partial / "actor.pt").write_bytes(b"\x80\x02partial")
    # A step dir without a manifest (e.g. copied by hand, half done) and one whose file was
    # truncated after the manifest was written: neither counts.
    (tmp_path / "step-000030").mkdir()
    (tmp_path / "step-000030" / "actor.pt").write_bytes(b"x")
    broken = save_checkpoint(tmp_path, 40, state_at(40), keep=3)
    (broken / "actor.pt").write_bytes(b"short")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000010"
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "step-000030")
    # The next save cleans the leftover temp dir and becomes the latest.
    path = save_checkpoint(tmp_path, 50, state_at(50), keep=3)
    assert not partial.exists()
    assert latest_checkpoint(tmp_path) == path


def test_exception_while_writing_leaves_nothing(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, state_at(1), keep=2)
    with pytest.raises(RuntimeError, match="boom"):
        with checkpoint_writer(tmp_path, 2, keep=2) as writer:
            writer.save("actor", {"w": torch.zeros(2)})
            raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]


def test_keep_n_prunes_oldest(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        save_checkpoint(tmp_path, step, {"x": torch.tensor([step])}, keep=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000006", "step-000008"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000006", "step-000008"]


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 5, {"x": torch.tensor([1])}, keep=2)
    save_checkpoint(tmp_path, 5, {"x": torch.tensor([2])}, keep=2)
    assert load_checkpoint(latest_checkpoint(tmp_path))["x"].item() == 2


def test_bad_input_is_rejected_before_writing(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"'data'\['when'\] is a builtins.object"):
        save_checkpoint(tmp_path, 1, {"data": {"when": object()}}, keep=1)
    with pytest.raises(ValueError, match="must match"):
        save_checkpoint(tmp_path, 1, {"../evil": 1}, keep=1)
    with pytest.raises(ValueError, match="keepCheckpoints"):
        save_checkpoint(tmp_path, 1, {"x": 1}, keep=0)
    assert latest_checkpoint(tmp_path) is None


def test_rng_state_round_trip_through_a_checkpoint(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    save_checkpoint(tmp_path, 1, {"rng": capture_rng_state()}, keep=1)
    expected = (random.random(), np.random.rand(), torch.rand(2))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    restore_rng_state(load_checkpoint(latest_checkpoint(tmp_path))["rng"])
    got = (random.random(), np.random.rand(), torch.rand(2))
    assert got[0] == expected[0] and got[1] == expected[1]
    assert torch.equal(got[2], expected[2])


def _cfg(**training):
    from ppojob_api.training import TrainerConfig

    return TrainerConfig.model_validate(
        {
            "roles": {"actor": {"replicas": 1}, "rollout": {"replicas": 1}},
            "algorithm": {"advantageEstimator": "grpo"},
            "data": {"rolloutBatchSize": 4, "samplesPerPrompt": 2},
            "training": {"steps": 2, **training},
        }
    )


def test_resume_with_a_changed_fingerprint_fails_naming_the_fields(tmp_path: Path) -> None:
    from ppojob_trainer.checkpoint import config_fingerprint
    from ppojob_trainer.driver.run import resume

    saved_cfg = _cfg(seed=1)
    save_checkpoint(tmp_path, 2, {"step": 2, "fingerprint": config_fingerprint(saved_cfg)}, 2)

    class FakeTrainer:
        def __init__(self, cfg):
            self.cfg, self.restored = cfg, None

        def fingerprint(self):
            return config_fingerprint(self.cfg)

        def restore(self, state, path=None):
            self.restored = state
            return int(state["step"])

    same = FakeTrainer(_cfg(seed=1, learningRate=3e-4))  # a setting free to change
    assert resume(same, tmp_path) == 2 and same.restored["step"] == 2

    changed = _cfg(seed=2)
    changed.data.rollout_batch_size = 8
    other = FakeTrainer(changed)
    with pytest.raises(CheckpointError) as err:
        resume(other, tmp_path)
    msg = str(err.value)
    assert "spec.training.seed: 1 in the checkpoint, 2 now" in msg
    assert "spec.data.rolloutBatchSize: 4 in the checkpoint, 8 now" in msg
    assert "spec.model.path" not in msg and "checkpointDir" in msg and "resume: false" in msg
    assert other.restored is None


def test_the_worker_counts_may_change_across_a_resume_but_not_the_states_layout() -> None:
    """Each worker saves its shard of one global state, read back resharded by another count
    (tests/trainer/test_resume.py resumes two FSDP workers' step on one): the worker counts are
    not in the fingerprint; the backend, the sharding, the model-parallel sizes and the LoRA
    adapters, which decide what was saved, are."""
    from ppojob_api.training import TrainerConfig
    from ppojob_trainer.checkpoint import config_fingerprint

    def fingerprint(
        actor: dict, critic: dict | None = None, sharding: str = "none", lora: dict | None = None
    ) -> dict:
        roles = {"actor": {"replicas": 1, **actor}, "rollout": {"replicas": 1}}
        if critic is not None:
            roles["critic"] = {"replicas": 1, **critic}
        algo = {"advantageEstimator": "gae" if critic is not None else "grpo"}
        return config_fingerprint(
            TrainerConfig.model_validate(
                {
                    "roles": roles,
                    "algorithm": algo,
                    "model": {"lora": lora},
                    "data": {"rolloutBatchSize": 4, "samplesPerPrompt": 2},
                    "training": {"steps": 2, "sharding": sharding},
                }
            )
        )

    assert fingerprint({}) == fingerprint({"replicas": 4})
    assert fingerprint({}, {}) == fingerprint({"replicas": 2}, {"replicas": 3})
    megatron = {"backend": "megatron", "replicas": 4}
    assert fingerprint(megatron) == fingerprint({**megatron, "replicas": 2})
    changed = [  # (the one key that differs, one fingerprint, another)
        ("spec.roles.actor.backend", fingerprint({}), fingerprint(megatron)),
        ("spec.roles.actor (sharding)", fingerprint({}), fingerprint({}, sharding="fsdp")),
        (
            "spec.roles.actor.parallelism.pipeline",
            fingerprint(megatron),
            fingerprint({**megatron, "parallelism": {"pipeline": 2}}),
        ),
        (
            "spec.roles.actor.parallelism.tensor",  # (the GPU optimizer's format: data only)
            fingerprint(megatron),
            fingerprint({**megatron, "parallelism": {"tensor": 2}}),
        ),
        (
            "spec.roles.critic.backend",
            fingerprint({}, {}),
            fingerprint({}, {"backend": "megatron"}),
        ),
        ("spec.model.lora", fingerprint({}), fingerprint({}, lora={"rank": 8})),
        ("spec.model.lora", fingerprint({}, lora={"rank": 8}), fingerprint({}, lora={"rank": 4})),
        (
            "spec.model.lora",
            fingerprint({}, lora={"rank": 8}),
            fingerprint({}, lora={"rank": 8, "alpha": 32}),
        ),
    ]
    for key, one, other in changed:
        assert [k for k in one if one[k] != other.get(k)] == [key], key


def test_a_changed_dataset_is_detected_onresume(tmp_path: Path) -> None:
    """Same settings, same file name, other prompts: the checkpoint's data order is meaningless
    for them, so resuming fails naming the prompt source."""
    from ppojob_trainer.checkpoint import config_fingerprint
    from ppojob_trainer.driver.run import resume
    from ppojob_trainer.tasks import make_task

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    cfg = _cfg()
    cfg.data.prompts, cfg.data.reward_function = str(data), "m:f"

    class Trainer:
        def __init__(self, cfg):
            self.cfg, self.task = cfg, make_task(cfg.data.prompts)

        def fingerprint(self):
            return config_fingerprint(self.cfg, self.task.digest())

        def restore(self, state, path=None):
            return int(state["step"])

    ckpts = tmp_path / "ckpt"
    save_checkpoint(ckpts, 2, {"step": 2, "fingerprint": Trainer(cfg).fingerprint()}, 2)
    assert resume(Trainer(cfg), ckpts) == 2  # unchanged data resumes

    data.write_text('{"prompt": "a"}\n{"prompt": "c"}\n')
    with pytest.raises(CheckpointError, match=r"spec\.data\.prompts \(content sha256\)"):
        resume(Trainer(cfg), ckpts)

    other = tmp_path / "other.jsonl"
    other.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    moved = _cfg()
    moved.data.prompts, moved.data.reward_function = str(other), "m:f"
    with pytest.raises(CheckpointError, match=r"spec\.data\.prompts: '"):
        resume(Trainer(moved), ckpts)
