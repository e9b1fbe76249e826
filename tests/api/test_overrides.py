"""Critic overrides: the override file format and applying overrides onto the actor's settings."""

from __future__ import annotations

import pytest

from ppojob_api.overrides import apply_critic_overrides, parse_critic_override_file
from ppojob_api.problems import SpecError
from ppojob_api.training import TrainerConfig, Training


def test_override_file_round_trip() -> None:
    text = (
        "critic:\n  - name: default\n    overrides:\n"
        "      learning_rate: 1.0e-5\n      ppoEpochs: 2\n"
    )
    assert parse_critic_override_file(text) == {"learning_rate": 1e-5, "ppoEpochs": 2}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("critic: []\n", "exactly one entry, got 0"),
        ("critic:\n- {name: a}\n- {name: b}\n", "exactly one entry, got 2"),
        ("actor: []\n", "expected one top-level key `critic`"),
        ("critic: {name: default}\n", "exactly one entry, got dict"),
        ("critic:\n- overrides: {lr: 1}\n", "needs a string `name`"),
        (
            "critic:\n- {name: d, overrides: {num_gpus_per_node: 4}}\n",
            "critic[0].overrides.num_gpus_per_node: critic overrides may not change GPU allocation",
        ),
        ("critic:\n- {name: d, overrides: {gradClip: -1}}\n", "critic[0].overrides.gradClip"),
        ("critic:\n- {name: d, extra: 1}\n", "critic[0].extra: unknown key"),
        ("critic: [unclosed\n", "not valid YAML"),
    ],
)
def test_override_file_errors(text: str, expected: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_critic_override_file(text)
    assert expected in str(info.value)


def test_overrides_inherit_unspecified_keys() -> None:
    base = Training(learning_rate=1e-6, weight_decay=0.1, ppo_epochs=2, mini_batch_size=8)
    merged = apply_critic_overrides(base, {"learningRate": 5e-6, "mini_batch_size": 4})
    assert merged.learning_rate == 5e-6
    assert merged.mini_batch_size == 4
    assert merged.weight_decay == 0.1 and merged.ppo_epochs == 2
    assert base.learning_rate == 1e-6  # the actor's settings are untouched


def test_forbidden_override_is_named() -> None:
    with pytest.raises(SpecError) as info:
        apply_critic_overrides(Training(), {"replicas": 2})
    assert "spec.roles.critic.overrides.replicas" in str(info.value)


def test_trainer_config_critic_training() -> None:
    cfg = TrainerConfig.model_validate(
        {"roles": {"critic": {"overrides": {"lr": 3e-5}}}, "training": {"learningRate": 1e-5}}
    )
    assert cfg.critic_training().learning_rate == 3e-5
    grpo = TrainerConfig.model_validate({"algorithm": {"advantageEstimator": "grpo"}})
    assert grpo.critic_training().learning_rate == grpo.training.learning_rate
