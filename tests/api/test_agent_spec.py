"""`data.agent` in a manifest (issue 25, multi-turn rollouts): the example is valid, each bad
field gets one line naming it and a fix, and a rollout backend that drives no agent turns is
refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ppojob_api.problems import SpecError
from ppojob_api.validation import validate_manifest
from tests.helpers.manifests import set_path

EXAMPLE = yaml.safe_load(
    (Path(__file__).parents[2] / "examples" / "ppojob-tiny-calculator.yaml").read_text()
)


def _problems(doc: dict[str, Any]) -> list[str]:
    try:
        validate_manifest(doc)
    except SpecError as exc:
        return [str(p) for p in exc.problems]
    return []


def test_the_calculator_example_is_valid_and_keeps_its_agent() -> None:
    agent = validate_manifest(EXAMPLE).spec.data.agent
    assert agent is not None and agent.function == "builtin:calculator"
    assert (agent.max_turns, agent.max_tool_response_tokens) == (2, 3)  # a sum: <= 3 digits
    assert agent.tool_timeout_seconds == 5


def test_the_stored_form_gets_the_same_verdict() -> None:
    job = validate_manifest(EXAMPLE)
    stored = job.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert validate_manifest(stored).spec.data.agent == job.spec.data.agent


@pytest.mark.parametrize(
    ("field", "value", "path", "words"),
    [
        ("function", "builtin:chess", "spec.data.agent.function", "unknown built-in agent"),
        ("function", "not a hook", "spec.data.agent.function", "is not `module:function`"),
        ("maxTurns", 0, "spec.data.agent.maxTurns", ">= 1"),
        ("toolTimeoutSeconds", 0, "spec.data.agent.toolTimeoutSeconds", "> 0"),
        ("maxToolResponseTokens", "x", "spec.data.agent.maxToolResponseTokens", "integer"),
        ("maxTurn", 3, "spec.data.agent.maxTurn", "unknown field"),
    ],
)
def test_a_bad_agent_field_is_one_line_naming_it(
    field: str, value: Any, path: str, words: str
) -> None:
    problems = _problems(set_path(EXAMPLE, f"spec.data.agent.{field}", value))
    assert len(problems) == 1 and problems[0].startswith(f"{path}: "), problems
    assert words in problems[0] and "\n" not in problems[0]


def test_a_missing_function_is_named() -> None:
    doc = set_path(EXAMPLE, "spec.data.agent", {"maxTurns": 2})
    problems = _problems(doc)
    assert len(problems) == 1 and problems[0].startswith("spec.data.agent.function: "), problems


def test_the_builtin_agent_needs_its_own_task() -> None:
    problems = _problems(set_path(EXAMPLE, "spec.data.prompts", "builtin:count-up"))
    assert problems == [
        "spec.data.agent.function: the built-in agent 'builtin:calculator' answers only its own "
        "task's prompts (fix: set data.prompts: builtin:calculator, or write your own agent hook)"
    ]


def test_a_user_hook_is_accepted() -> None:
    doc = set_path(EXAMPLE, "spec.data.agent.function", "my_env.tools:step")
    doc = set_path(doc, "spec.data.prompts", "/data/tasks.jsonl")
    doc = set_path(doc, "spec.data.rewardFunction", "my_env.reward:score")
    assert _problems(doc) == []


def test_a_rollout_backend_that_drives_no_agent_turns_is_refused() -> None:
    doc = set_path(EXAMPLE, "spec.roles.rollout.backend", "sglang")
    problems = [p for p in _problems(doc) if "data.agent" in p]
    assert len(problems) == 1 and problems[0].startswith("spec.roles.rollout.backend: "), problems
    assert "\n" not in problems[0]


def test_megatron_actor_and_critic_take_an_agent() -> None:
    """The workers hand megatron the environment-token loss mask as they do the torch backend
    (tests/trainer/backends/test_megatron.py trains the example on both)."""
    doc = set_path(EXAMPLE, "spec.roles.actor.backend", "megatron")
    doc = set_path(doc, "spec.algorithm.advantageEstimator", "gae")
    doc = set_path(doc, "spec.roles.critic", {"backend": "megatron", "colocateWithActor": True})
    assert [p for p in _problems(doc) if "data.agent" in p or "backend" in p] == []
