"""`data.rewards` in a manifest: a valid one passes, each bad field gets one line naming it and a
fix (the semantic rules themselves are rows of test_checks.py's table)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ppojob_api.problems import SpecError
from ppojob_api.training import DataSpec
from ppojob_api.validation import validate_manifest
from tests.helpers.manifests import set_path

TINY = yaml.safe_load((Path(__file__).parents[2] / "examples" / "ppojob-tiny.yaml").read_text())
SOURCES = [
    {"function": "builtin:count-up"},
    {"model": {"path": "/models/rm", "batchSize": 8}, "weight": 0.5},
    {
        "http": {"url": "https://rm.internal:8443/score", "timeoutSeconds": 5, "tokenEnv": "RM"},
        "weight": 1,
        "name": "judge",
    },
]


def _problems(doc: dict[str, Any]) -> list[str]:
    try:
        validate_manifest(doc)
    except SpecError as exc:
        return [str(p) for p in exc.problems]
    return []


def test_a_manifest_with_three_sources_is_valid_and_keeps_them() -> None:
    job = validate_manifest(set_path(TINY, "spec.data.rewards", SOURCES))
    rewards = job.spec.data.rewards
    assert [s.default_name() for s in rewards] == ["count-up", "model", "judge"]
    assert rewards[1].model is not None and rewards[1].model.batch_size == 8
    assert rewards[2].http is not None and rewards[2].http.token_env == "RM"
    assert rewards[2].http.retries == 2 and rewards[2].http.backoff_seconds == 1.0


def test_the_stored_form_gets_the_same_verdict() -> None:
    """The API server stores the defaults filled in; validating that form again passes."""
    job = validate_manifest(set_path(TINY, "spec.data.rewards", SOURCES))
    stored = job.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert validate_manifest(stored).spec.data.rewards == job.spec.data.rewards


@pytest.mark.parametrize(
    ("source", "path", "words"),
    [
        ({"http": {"url": "ftp://rm/score"}}, "spec.data.rewards[0].http.url", "write an http://"),
        ({"http": {"url": "http://rm", "retries": -1}}, "spec.data.rewards[0].http.retries", ">="),
        (
            {"http": {"url": "https://bob:hunter2@rm/score"}},
            "spec.data.rewards[0].http.url",
            "credentials never go in a PPOJob",
        ),
        ({"http": {"url": "https://bob@rm/score"}}, "spec.data.rewards[0].http.url", "tokenEnv"),
        ({"modle": {"path": "/rm"}}, "spec.data.rewards[0].modle", "unknown field"),
        ({"model": {"path": "/rm", "device": "gpu"}}, "spec.data.rewards[0].model.device", "auto"),
        ({"model": {}}, "spec.data.rewards[0].model.path", "required field is missing"),
        ({"function": "m:f", "name": "Bad Name"}, "spec.data.rewards[0].name", "lowercase letters"),
        ({"function": "m:f", "weight": "1"}, "spec.data.rewards[0].weight", "number"),
        (
            {"http": {"url": "http://rm", "tokenEnv": "A B"}},
            "spec.data.rewards[0].http.tokenEnv",
            "",
        ),
    ],
)
def test_a_bad_field_of_a_source_is_one_line_naming_it(source: Any, path: str, words: str) -> None:
    problems = _problems(set_path(TINY, "spec.data.rewards", [source]))
    assert len(problems) == 1 and problems[0].startswith(f"{path}: "), problems
    assert words in problems[0] and "\n" not in problems[0]
    assert "hunter2" not in problems[0]


def test_rewards_and_reward_function_together_are_refused_in_one_line() -> None:
    doc = set_path(TINY, "spec.data.rewards", [{"function": "m:g"}])
    doc = set_path(doc, "spec.data.rewardFunction", "m:f")
    assert _problems(doc) == [
        "spec.data.rewards: rewards and rewardFunction are both set (rewardFunction is the "
        "shorthand of one function source) (fix: move rewardFunction into rewards as "
        "{function: m:f}, or remove rewards)"
    ]


def test_a_dataset_with_reward_sources_needs_no_reward_function() -> None:
    doc = set_path(TINY, "spec.data.prompts", "/data/train.jsonl")
    assert _problems(doc) == [
        "spec.data.rewardFunction: a dataset needs a reward function "
        "(fix: set rewardFunction: package.module:function)"
    ]
    assert _problems(set_path(doc, "spec.data.rewards", [{"model": {"path": "/rm"}}])) == []


def test_default_names_follow_the_source() -> None:
    data = DataSpec.model_validate(
        {
            "rewards": [
                {"function": "pkg.mod:Scorer.score"},
                {"function": "builtin:reverse"},
                {"model": {"path": "/rm"}},
                {"http": {"url": "http://rm"}},
                {"http": {"url": "http://rm2"}, "name": "judge-2"},
            ]
        }
    )
    names = [s.default_name() for s in data.rewards]
    assert names == ["scorer.score", "reverse", "model", "http", "judge-2"]
