"""spec.algorithm's algorithm pack (issue 25): policyLoss (GSPO), dynamicSampling,
overlongShaping and maskTruncatedSamples are typed, bounded, refused in one line naming the
field when they cannot work, and a manifest and its stored form get the same verdict."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from ppojob_api.problems import SpecError
from ppojob_api.training import Algorithm
from ppojob_api.validation import validate_manifest
from tests.api.test_stored_defaults import apply_schema_defaults

TINY = yaml.safe_load((Path(__file__).parents[2] / "examples" / "ppojob-tiny.yaml").read_text())
GRPO = {"advantageEstimator": "grpo"}


def _doc(algorithm: dict[str, Any], data: dict[str, Any] | None = None, **roles: Any) -> dict:
    doc = copy.deepcopy(TINY)
    doc["spec"]["algorithm"].update(algorithm)
    doc["spec"]["data"].update(data or {})
    doc["spec"]["roles"].update(roles)
    return doc


def _problems(doc: dict[str, Any]) -> list[str]:
    """The verdict on the manifest as written, checked to equal that on its stored form."""
    verdicts = []
    for form in (doc, apply_schema_defaults(doc)):
        try:
            validate_manifest(form)
            verdicts.append([])
        except SpecError as exc:
            verdicts.append([str(p) for p in exc.problems])
    assert verdicts[0] == verdicts[1], "the stored form got another verdict"
    for problem in verdicts[0]:
        assert "\n" not in problem
    return verdicts[0]


def test_every_setting_is_off_by_default() -> None:
    algo = Algorithm()
    assert algo.policy_loss == "ppo"
    assert algo.dynamic_sampling is None and algo.overlong_shaping is None
    assert algo.mask_truncated_samples is False


def test_the_whole_pack_with_gspos_small_clip_ranges_validates() -> None:
    setting = {
        **GRPO,
        "policyLoss": "gspo",
        "clipRangeLow": 3e-4,
        "clipRangeHigh": 4e-4,
        "lossAggregation": "seq-mean-token-mean",
        "dynamicSampling": {"maxRounds": 3},
        "overlongShaping": {"bufferLength": 4, "penaltyFactor": 0.5},
        "maskTruncatedSamples": True,
    }
    assert _problems(_doc(setting)) == []
    assert _problems(_doc({**GRPO, "dynamicSampling": {}})) == []  # {}: the defaults


@pytest.mark.parametrize(
    ("algorithm", "field", "says"),
    [
        ({"policyLoss": "grpo"}, "policyLoss", "'ppo' or 'gspo'"),
        ({**GRPO, "dynamicSampling": {"maxRounds": 0}}, "dynamicSampling.maxRounds", ">= 1"),
        ({**GRPO, "dynamicSampling": {"rounds": 2}}, "dynamicSampling.rounds", "unknown field"),
        ({"overlongShaping": {}}, "overlongShaping.bufferLength", "required"),
        ({"overlongShaping": {"bufferLength": 0}}, "overlongShaping.bufferLength", ">= 1"),
        ({"maskTruncatedSamples": "yes"}, "maskTruncatedSamples", "valid boolean"),
    ],
)
def test_bad_values_are_one_line_naming_the_field(
    algorithm: dict[str, Any], field: str, says: str
) -> None:
    (problem,) = _problems(_doc(algorithm))
    assert problem.startswith(f"spec.algorithm.{field}: ")
    assert says in problem.replace("greater than or equal to", ">=")


def test_dynamic_sampling_needs_a_group_estimator() -> None:
    (problem,) = _problems(_doc({"dynamicSampling": {}}))  # the tiny example's gae
    assert problem.startswith("spec.algorithm.dynamicSampling: ")
    assert "not gae" in problem and "grpo" in problem


def test_dynamic_sampling_needs_groups_of_two() -> None:
    problems = _problems(_doc({**GRPO, "dynamicSampling": {}}, {"samplesPerPrompt": 1}))
    assert any(
        p.startswith("spec.algorithm.dynamicSampling: ") and "samplesPerPrompt is 1" in p
        for p in problems
    )


def test_dynamic_sampling_is_refused_with_bounded_staleness() -> None:
    doc = _doc({**GRPO, "dynamicSampling": {}, "maxStaleness": 1}, rollout={})
    (problem,) = _problems(doc)  # engines of their own: only the combination is wrong
    assert problem.startswith("spec.algorithm.dynamicSampling: ")
    assert "maxStaleness 1" in problem and "maxStaleness: 0" in problem


@pytest.mark.parametrize("buffer", [8, 9])
def test_overlong_buffer_must_lie_below_max_response_length(buffer: int) -> None:
    (problem,) = _problems(_doc({"overlongShaping": {"bufferLength": buffer}}))  # max 8
    assert problem.startswith("spec.algorithm.overlongShaping.bufferLength: ")
    assert "maxResponseLength 8" in problem
    assert _problems(_doc({"overlongShaping": {"bufferLength": 7}})) == []


def test_gspo_refuses_the_token_level_dual_clip() -> None:
    (problem,) = _problems(_doc({**GRPO, "policyLoss": "gspo", "dualClip": 3}))
    assert problem.startswith("spec.algorithm.dualClip: ")
    assert "gspo" in problem
    assert _problems(_doc({**GRPO, "policyLoss": "ppo", "dualClip": 3})) == []
