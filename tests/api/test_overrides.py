"""Critic overrides: the override file format and applying overrides onto the actor's settings."""

from __future__ import annotations

import pytest

from ppojob_api.overrides import (
    apply_critic_overrides,
    check_critic_overrides,
    parse_critic_override_file,
)
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


# --- what a user sees for a bad override file: where, what, and a fix that works
FORMAT = "critic: [{name: default, overrides: {learningRate: 1e-5}}]"


@pytest.mark.parametrize(
    ("text", "path", "message"),
    [
        ("actor: []\n", "critic config", "expected one top-level key `critic`, got ['actor']"),
        ("- critic\n", "critic config", "expected one top-level key `critic`, got list"),
        ("critic: []\n", "critic", "must be a list of exactly one entry, got 0"),
        ("critic: {name: d}\n", "critic", "must be a list of exactly one entry, got dict"),
        ("critic:\n- overrides: {lr: 1}\n", "critic[0]", "needs a string `name`"),
    ],
)
def test_override_file_format_problems_show_a_working_example(
    text: str, path: str, message: str
) -> None:
    with pytest.raises(SpecError) as info:
        parse_critic_override_file(text)
    [problem] = info.value.problems
    assert (problem.path, info.value.source) == (path, "critic config")
    assert problem.message.startswith(message), problem
    assert str(info.value).startswith("critic config: 1 problem(s):")
    # the fix is an example file, and that example is accepted as it stands
    assert problem.fix == f"write {FORMAT}"
    assert parse_critic_override_file(problem.fix.removeprefix("write ")) == {"learningRate": 1e-5}


def test_override_file_names_its_source() -> None:
    with pytest.raises(SpecError) as info:
        parse_critic_override_file("critic:\n- {name: d, extra: 1}\n", "/etc/critic.yaml")
    assert info.value.source == "/etc/critic.yaml"
    assert str(info.value).startswith("/etc/critic.yaml: 1 problem(s):")
    [problem] = info.value.problems
    assert (problem.path, problem.message) == ("critic[0].extra", "unknown key")
    assert problem.fix == "use only name and overrides"
    with pytest.raises(SpecError) as info:
        parse_critic_override_file("critic: [unclosed\n", "/etc/critic.yaml")
    assert "/etc/critic.yaml" in str(info.value)


def test_override_file_without_overrides_means_none() -> None:
    assert parse_critic_override_file("critic:\n- {name: default}\n") == {}
    assert parse_critic_override_file("critic:\n- {name: default, overrides: null}\n") == {}


def test_overrides_that_are_not_a_mapping() -> None:
    with pytest.raises(SpecError) as info:
        parse_critic_override_file("critic:\n- {name: d, overrides: 5}\n")
    [problem] = info.value.problems
    assert problem.path == "critic[0].overrides"
    assert problem.message == "must be a mapping, got int"
    assert problem.fix == "write `overrides: {learningRate: 1e-5}`"


def test_unknown_override_lists_the_settings_a_user_may_write() -> None:
    with pytest.raises(SpecError) as info:
        parse_critic_override_file("critic:\n- {name: d, overrides: {learningRte: 1}}\n")
    [problem] = info.value.problems
    assert (problem.path, problem.message) == (
        "critic[0].overrides.learningRte",
        "not a training setting",
    )
    allowed = problem.fix.removeprefix("use one of: ").split(", ")
    # the camelCase spellings of the spec, every one of them accepted as an override key
    assert "learningRate" in allowed and "microBatchSize" in allowed
    assert not [a for a in allowed if "_" in a]
    for key in allowed:
        found = check_critic_overrides({key: None}, "o")
        assert all(p.message != "not a training setting" for p in found), (key, found)


def test_ill_typed_override_keeps_the_users_spelling_and_pydantics_reason() -> None:
    with pytest.raises(SpecError) as info:
        parse_critic_override_file("critic:\n- {name: d, overrides: {grad_clip: -1}}\n")
    [problem] = info.value.problems
    assert problem.path == "critic[0].overrides.grad_clip"
    assert "greater than 0" in problem.message and "got -1" in problem.message
    assert problem.fix
