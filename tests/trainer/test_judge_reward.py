"""The generative judge reward source (issue 25, ``data.rewards[].judge``): the judge prompt
holds the prompt and the response, the score is parsed with the configured pattern and clamped,
an unparseable verdict scores the default and is counted; driven with a stub engine whose
verdicts are fixed, and once with a real tiny engine (a built-in model, and the policy's own)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ppojob_api.training import DataSpec, JudgeRewardSource
from ppojob_trainer.backends.base import Generation
from ppojob_trainer.rewards import JudgeScorer, load_judge_engine, make_reward
from tests.helpers.chat_tools import chat_tokenizer


class StubJudge:
    """A generation engine answering fixed verdicts, in order; records what it was asked."""

    def __init__(self, tok: Any, verdicts: list[str]) -> None:
        self.tok, self.verdicts = tok, verdicts
        self.asked: list[str] = []
        self.kw: dict[str, Any] = {}

    def generate(self, ids: torch.Tensor, mask: torch.Tensor, **kw: Any) -> Generation:
        self.kw = kw
        self.asked = [self.tok.decode(r[m].tolist()) for r, m in zip(ids, mask, strict=True)]
        rows = [
            self.tok(v, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            for v in self.verdicts
        ]
        rows = [r[: kw["max_new_tokens"]] for r in rows]
        width = max(len(r) for r in rows)
        out = torch.full((len(rows), width), self.tok.pad_token_id, dtype=torch.long)
        resp = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.tensor(r)
            resp[i, : len(r)] = True
        lengths = torch.tensor([len(r) for r in rows])
        return Generation(out, resp, torch.zeros(out.shape), lengths)


def _spec(**kw: Any) -> JudgeRewardSource:
    return JudgeRewardSource.model_validate({"model": "policy", **kw})


def test_scores_are_parsed_clamped_and_unparsed_ones_default() -> None:
    tok = chat_tokenizer()
    verdicts = ["Score: 7", "score 12.5 of 10", "I think -3", "no idea", "Score: 4.5"]
    engine = StubJudge(tok, verdicts)
    spec = _spec(
        template="Q={prompt} A={response} L={label}",
        scorePattern=r"(-?\d+(?:\.\d+)?)",
        minScore=0,
        maxScore=10,
        defaultScore=1.5,
        maxNewTokens=20,
        applyChatTemplate=False,
    )
    judge = JudgeScorer(spec, "data.rewards[0].judge", engine, tok)
    prompts = ["p0", "p1", "p2", "p3", "p4"]
    responses = ["r0", "r1", "r2", "r3", "r4"]
    scores = judge(prompts, responses, [None, "x", None, None, None])
    assert scores == [7.0, 10.0, 0.0, 1.5, 4.5]
    assert judge.last_unparsed == 1
    # the judge saw each prompt and response through the template, greedily, with the budget
    assert engine.asked == [
        "Q=p0 A=r0 L=",
        "Q=p1 A=r1 L=x",
        *[f"Q=p{i} A=r{i} L=" for i in (2, 3, 4)],
    ]
    assert engine.kw["max_new_tokens"] == 20 and engine.kw["temperature"] == 0.0


def test_the_pattern_is_the_users() -> None:
    tok = chat_tokenizer()
    engine = StubJudge(tok, ["7 steps; verdict [[3]]", "verdict [[9]] after 2", "[[x]] 5"])
    spec = _spec(
        scorePattern=r"\[\[(\d+)\]\]", applyChatTemplate=False, defaultScore=0.5, maxNewTokens=64
    )
    judge = JudgeScorer(spec, "f", engine, tok)
    assert judge(["a", "b", "c"], ["x", "y", "z"], [None] * 3) == [3.0, 9.0, 0.5]
    assert judge.last_unparsed == 1


def test_the_judge_prompt_goes_through_the_chat_template() -> None:
    tok = chat_tokenizer()
    engine = StubJudge(tok, ["5"])
    judge = JudgeScorer(_spec(template="Rate {response} for {prompt}"), "f", engine, tok)
    assert judge(["2+3"], ["5"], [None]) == [5.0]
    assert engine.asked == ["<|im_start|>user\nRate 5 for 2+3<|im_end|>\n<|im_start|>assistant\n"]


def test_a_combined_reward_with_a_judge_counts_unparsed_verdicts() -> None:
    tok = chat_tokenizer()
    engine = StubJudge(tok, ["8", "none", "2"])
    data = DataSpec.model_validate(
        {
            "prompts": "builtin:count-up",
            "rewards": [
                {"function": "builtin:count-up"},
                {"judge": {"model": "policy", "maxScore": 10}, "weight": 0.1},
            ],
        }
    )
    reward = make_reward(data, "builtin:count-up", policy=(engine, tok))
    prompts = ["3", "3", "3"]
    total, parts = reward.score(prompts, ["4567", "4", "9"], [None] * 3)
    assert parts["judge"] == [8.0, 0.0, 2.0]
    expected = [c + 0.1 * j for c, j in zip(parts["count-up"], parts["judge"], strict=True)]
    assert total == pytest.approx(expected)
    assert reward.last_counts == {"judge_unparsed": 1}


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"scorePattern": "(\\d"}, "scorePattern: does not compile"),
        ({"scorePattern": "(\\d)(\\d)"}, "scorePattern: has 2 groups"),
    ],
)
def test_a_bad_pattern_is_one_line(kw: dict[str, Any], words: str) -> None:
    tok = chat_tokenizer()
    with pytest.raises(ValueError) as info:
        JudgeScorer(_spec(**kw), "data.rewards[1].judge", StubJudge(tok, []), tok)
    assert str(info.value).startswith("data.rewards[1].judge.") and words in str(info.value)


def test_a_real_tiny_judge_engine_runs(tmp_path: Any) -> None:
    """The wiring with the torch engine of a built-in model (digits only: the template and the
    pattern are digits); every verdict is a digit, a special token or nothing."""
    spec = _spec(
        model="builtin:tiny-llama",
        template="{prompt}{response}",
        scorePattern=r"(\d)",
        maxScore=9,
        defaultScore=0,
        maxNewTokens=3,
    )
    engine, tok = load_judge_engine(spec, "data.rewards[0].judge", "cpu", "float32")
    judge = JudgeScorer(spec, "data.rewards[0].judge", engine, tok)
    prompts, responses = ["12", "345", "6", "7890"], ["6", "78", "123", "4"]
    verdicts = judge.verdicts(prompts, responses, [None] * 4)
    assert len(verdicts) == 4 and all(set(v) <= set("0123456789") for v in verdicts)
    # the expected scores parsed here, not by the scorer: the first digit, else the default 0
    expected = [float(v[0]) if v else 0.0 for v in verdicts]
    # the seeded model writes digits other than the default: a scorer that parses nothing, or
    # ignores what it parsed, cannot give these scores
    assert any(e != 0.0 for e in expected), verdicts
    # greedy (temperature 0): scoring asks the same verdicts again, and scores what they say
    scores = judge(prompts, responses, [None] * 4)
    assert scores == expected, (verdicts, scores)
    assert judge.last_unparsed == sum(not v for v in verdicts)


def test_a_judge_model_that_is_no_directory_is_one_line(tmp_path: Any) -> None:
    spec = _spec(model=str(tmp_path / "nothing"))
    with pytest.raises(ValueError) as info:
        load_judge_engine(spec, "data.rewards[0].judge", "cpu", "float32")
    msg = str(info.value)
    assert msg.startswith("data.rewards[0].judge.model: ") and "\n" not in msg
