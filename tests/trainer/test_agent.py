"""Multi-turn agentic rollouts (issue 25, ``data.agent``): the environment-token mask in the
losses, token alignment of a 2-turn conversation, tool crashes and timeouts as observations,
bad hooks, and a 2-step ``ppojob run`` of the built-in calculator task."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ppojob_api.training import Algorithm
from ppojob_trainer import algorithms as A
from ppojob_trainer.agent import (
    ADDRESS_SPACE_HEADROOM,
    ToolPool,
    calculator_agent,
    call_tools,
    conversation_tensors,
    load_agent,
    parse_reply,
    policy_mask,
    run_conversations,
)
from ppojob_trainer.models import build_char_tokenizer
from ppojob_trainer.tasks import calculator_reward, make_task
from ppojob_trainer.workers.actor import policy_loss_mask
from tests.helpers.scripted_engine import ScriptedEngine

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ppojob-tiny-calculator.yaml"


# --- the mask in the losses -------------------------------------------------------------------
def test_environment_tokens_get_no_policy_gradient() -> None:
    """A 2-turn response [model, model, env, env, model, pad]: the actor's loss mask leaves the
    env tokens out, so the policy loss has zero gradient on their log-probs and a nonzero one on
    every model token."""
    batch = {
        "response_mask": torch.tensor([[True, True, True, True, True, False]]),
        "action_mask": torch.tensor([[True, True, False, False, True, False]]),
    }
    mask = policy_loss_mask(batch, Algorithm())
    assert mask is not None
    assert mask.tolist() == [[True, True, False, False, True, False]]
    logp = torch.tensor([[-1.0, -0.5, -2.0, -3.0, -0.7, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -0.4, -1.0, -1.0, -0.75, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 5.0, 5.0, 1.0, 0.0]])
    loss, _ = A.policy_loss(logp, old, adv, mask, 0.2, 0.2, None, agg="token-mean")
    loss.backward()
    grad = logp.grad[0]
    assert grad[2] == 0 and grad[3] == 0 and grad[5] == 0
    assert bool((grad[[0, 1, 4]] != 0).all())
    # single-turn batches keep the old behaviour: no loss mask, every response token
    assert policy_loss_mask({"response_mask": batch["response_mask"]}, Algorithm()) is None


def test_gae_skips_environment_tokens() -> None:
    """GAE over the policy mask links the model token before an observation to the first model
    token after it: the env tokens' values do not enter the advantages."""
    mask = policy_mask(
        {
            "response_mask": torch.ones(1, 5, dtype=torch.bool),
            "action_mask": torch.tensor([[True, True, False, False, True]]),
        }
    )
    rewards = A.shape_token_rewards(torch.tensor([1.0]), mask)
    assert rewards.tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0]]
    values = torch.tensor([[0.1, 0.2, 9.0, -9.0, 0.3]])
    adv, _ = A.compute_gae(rewards, values, mask, 1.0, 1.0)
    # gamma = lam = 1: reward-to-go minus value, on the model's tokens only
    assert torch.allclose(adv, torch.tensor([[0.9, 0.8, 0.0, 0.0, 0.7]]))


# --- token alignment --------------------------------------------------------------------------


def test_a_two_turn_conversation_keeps_the_sampled_tokens_exactly() -> None:
    tok = build_char_tokenizer()
    eos = tok.eos_token_id
    digit = {str(d): tok.convert_tokens_to_ids(str(d)) for d in range(10)}
    turn1 = [digit[d] for d in "3748"] + [eos]  # a call of 37 + 48
    turn2 = [digit["5"], eos]
    engine = ScriptedEngine([turn1, turn2], tok.pad_token_id)
    prompt = tok("3748")["input_ids"]
    (conv,) = run_conversations(
        engine,
        tok,
        [prompt],
        ["3748"],
        [None],
        calculator_agent,
        max_turns=2,
        max_response_length=12,
        max_tool_response_tokens=3,
        tool_timeout=10,
        temperature=1.0,
        top_p=1.0,
        seed=0,
        special=set(tok.all_special_ids),
    )
    observation = [digit["8"], digit["5"]]  # the call's value, 85
    assert conv.ids == turn1 + observation + turn2
    assert conv.action == [True] * 5 + [False, False] + [True, True]
    # the model's tokens in the response are exactly what the engine sampled, in order
    assert [t for t, a in zip(conv.ids, conv.action, strict=True) if a] == turn1 + turn2
    sampled = [-0.1, -0.2, -0.3, -0.4, -0.5]
    assert conv.logprobs == pytest.approx([*sampled, 0, 0, -0.1, -0.2])
    # the second turn was sampled after the prompt, the first turn and the observation
    assert engine.prompts == [prompt, prompt + turn1 + observation]
    assert conv.turns == ["3748", "5"]
    assert conv.env_metrics == {"calls": 1.0, "exact_calls": 1.0, "digit_calls": 1.0}
    t = conversation_tensors([conv], tok.pad_token_id)
    assert t["action_mask"][0].tolist() == conv.action
    assert t["response_ids"][0].tolist() == conv.ids
    assert calculator_reward(["3748"] * 3, [conv.turns[-1], "55", "4"], [None] * 3) == [1, 0, 0]


# --- tools in child processes -----------------------------------------------------------------
def _sleeps(prompt: str, label: Any, turns: list[str]) -> dict[str, Any]:
    time.sleep(60)
    return {"observation": "late", "done": False}


def _raises(prompt: str, label: Any, turns: list[str]) -> dict[str, Any]:
    raise RuntimeError("the tool broke")


def _dies(prompt: str, label: Any, turns: list[str]) -> dict[str, Any]:
    os._exit(3)


def _malformed(prompt: str, label: Any, turns: list[str]) -> Any:
    return ["not", "a", "dict"]


def _spins(prompt: str, label: Any, turns: list[str]) -> dict[str, Any]:
    while True:
        pass


def test_a_tool_that_hangs_is_killed_and_its_timeout_is_the_observation() -> None:
    t0 = time.monotonic()
    (reply,) = call_tools(_sleeps, [("p", None, ["x"])], timeout=0.5)
    assert time.monotonic() - t0 < 30
    assert reply.error and not reply.done
    assert reply.observation == "tool error: timed out after 0.5 s"


@pytest.mark.parametrize(
    ("fn", "words"),
    [
        (_raises, "tool error: RuntimeError: the tool broke"),
        (_dies, "tool error: the tool process died (exit code 3)"),
        (_malformed, "tool error: the agent returned list, not a dict"),
    ],
)
def test_a_crash_or_a_malformed_reply_is_the_observation(fn: Any, words: str) -> None:
    (reply,) = call_tools(fn, [("p", None, ["x"])], timeout=10)
    assert reply.error and not reply.done and reply.observation == words


def test_a_tool_spinning_on_the_cpu_is_stopped() -> None:
    (reply,) = call_tools(_spins, [("p", None, ["x"])], timeout=1.0)
    assert reply.error and reply.observation is not None
    assert reply.observation.startswith("tool error: ")


def _limits(prompt: str, label: Any, turns: list[str]) -> dict[str, Any]:
    import resource

    used = resource.getrusage(resource.RUSAGE_SELF)
    left = resource.getrlimit(resource.RLIMIT_CPU)[0] - (used.ru_utime + used.ru_stime)
    space = resource.getrlimit(resource.RLIMIT_AS)[0]
    return {"observation": f"{left} {space} {os.getpid()}", "done": False}


def test_the_tool_process_runs_under_cpu_and_address_space_limits() -> None:
    """A call may spend the timeout (to the next whole second) in CPU seconds (RLIMIT_CPU); the
    tool process's RLIMIT_AS is finite (the trainer's size plus 1 GiB); the parent's limits are
    untouched."""
    import resource

    before = resource.getrlimit(resource.RLIMIT_AS)
    (reply,) = call_tools(_limits, [("p", None, ["x"])], timeout=2.5)
    assert reply.observation is not None and not reply.error
    left, space, _ = reply.observation.split()
    assert 2.5 <= float(left) <= 3.5
    space = int(space)
    assert space != resource.RLIM_INFINITY and space > ADDRESS_SPACE_HEADROOM
    assert resource.getrlimit(resource.RLIMIT_AS) == before


def test_the_pool_reuses_its_processes_and_replaces_one_that_timed_out() -> None:
    pool = ToolPool(_limits, timeout=1.0, size=1)
    try:
        first = pool.map([("p", None, ["x"]), ("p", None, ["y"])])
        pids = {r.observation.split()[2] for r in first if r.observation}
        assert len(pids) == 1  # one process served both calls
        pool.fn = _sleeps  # (the fn of the next fork; the running process keeps _limits)
        assert pool.map([("p", None, ["x"])])[0].observation.split()[2] in pids
    finally:
        pool.close()
    pool = ToolPool(_sleeps, timeout=0.3, size=1)
    try:
        assert pool.map([("p", None, ["x"])])[0].observation == "tool error: timed out after 0.3 s"
        pool.fn = _limits  # the replacement process is a fresh fork
        (after,) = pool.map([("p", None, ["y"])])
        assert not after.error and after.observation is not None
    finally:
        pool.close()


def test_good_replies_come_back_in_order() -> None:
    replies = call_tools(calculator_agent, [("3748", None, ["1111"]), ("0703", None, ["1"])], 10)
    assert [(r.observation, r.done, r.error) for r in replies] == [
        ("22", False, False),
        (None, True, False),
    ]
    assert replies[0].metrics == {"calls": 1.0, "exact_calls": 0.0, "digit_calls": 0.0}


@pytest.mark.parametrize(
    "metrics", [[1], {"calls": "1"}, {"calls": True}, {"calls": float("nan")}, {"a/b": 1}]
)
def test_malformed_metrics_are_a_tool_error(metrics: Any) -> None:
    reply = parse_reply({"observation": "x", "done": False, "metrics": metrics})
    assert reply.error and reply.observation.startswith("tool error: metrics is not")
    assert parse_reply({"observation": "x", "metrics": {"n": 2}}).metrics == {"n": 2.0}


def _calc(prompt: str, *turns: str) -> tuple[str | None, bool, dict[str, float]]:
    r = calculator_agent(prompt, None, list(turns))
    return r["observation"], r["done"], r["metrics"]


def test_the_calculator_evaluates_the_call_the_model_wrote() -> None:
    """The value comes from the model's arguments, never from the prompt: a wrong call gets a
    wrong result, and a turn that is not a call is the answer (nothing is answered)."""
    right = {"calls": 1.0, "exact_calls": 1.0, "digit_calls": 1.0}
    assert _calc("3748", "3748") == ("85", False, right)
    assert _calc("3748", "4837") == ("85", False, right)  # same sum, other arguments
    # the right last digits of the operands: the right answer digit, not the right sum
    assert _calc("3748", "0708") == ("15", False, {**right, "exact_calls": 0.0})
    wrong = {"calls": 1.0, "exact_calls": 0.0, "digit_calls": 0.0}
    assert _calc("3748", "1111") == ("22", False, wrong)
    assert _calc("3748", "0000") == ("0", False, wrong)
    none = {"calls": 0.0, "exact_calls": 0.0, "digit_calls": 0.0}
    for turn in ("", "5", "77", "374", "37485", "37a8"):  # not a call: the final answer
        assert _calc("3748", turn) == (None, True, none), turn
    # a later turn may call again; the last turn decides
    assert _calc("3748", "1111", "3748") == ("85", False, right)
    assert _calc("3748", "3748", "5")[:2] == (None, True)


def test_the_calculator_understands_a_text_call_and_reports_a_bad_one() -> None:
    assert _calc("3748", "<calc>37+48</calc>") == (
        "<result>85</result>",
        False,
        {"calls": 1.0, "exact_calls": 1.0, "digit_calls": 1.0},
    )
    assert _calc("3748", "so <calc>3*4</calc>")[0] == "<result>12</result>"
    bad, done, metrics = _calc("0000", "<calc>__import__('os')</calc>")
    assert bad is not None and bad.startswith("<result>error: not an integer expression")
    assert not done and metrics == {"calls": 1.0, "exact_calls": 0.0, "digit_calls": 0.0}


def test_the_calculator_task_asks_for_the_last_digit_of_a_sum() -> None:
    import random

    for e in make_task("builtin:calculator").sample(20, random.Random(0)):
        a, b = int(e.prompt[:2]), int(e.prompt[2:])
        assert len(e.prompt) == 4 and e.label == f"{(a + b) % 10}"


# --- bad hooks --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("builtin:chess", "data.agent.function: unknown built-in agent 'builtin:chess'"),
        ("no_such_module_x:fn", "data.agent.function"),
        ("json:no_such_function", "data.agent.function"),
    ],
)
def test_a_bad_agent_hook_is_one_line_naming_the_field(spec: str, words: str) -> None:
    with pytest.raises(ValueError) as info:
        load_agent(spec)
    msg = str(info.value)
    assert msg.startswith("data.agent.function") and words in msg and "\n" not in msg


# --- end to end -------------------------------------------------------------------------------
@pytest.mark.usefixtures("ray_session")
def test_two_steps_of_the_calculator_example_run(tmp_path: Path, capsys: Any) -> None:
    from ppojob_cli.main import main as ppojob
    from ppojob_trainer.progress import read_metrics

    out = tmp_path / "run"
    args = ["run", str(EXAMPLE), "--steps", "2", "--out", str(out), "--no-progress"]
    args += ["--set", "data.rolloutBatchSize=4", "--set", "training.miniBatchSize=16"]
    rc = ppojob(args)
    assert rc == 0, capsys.readouterr().err
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 1.0 <= r["agent/turns_mean"] <= 2.0
        assert r["agent/tool_errors_mean"] == 0.0
        assert 0.0 <= r["reward_mean"] <= 1.0
        # the calculator's own metrics: calls per sample, and those of them with the right sum
        assert 0.0 <= r["agent/env/exact_calls_mean"] <= r["agent/env/calls_mean"] <= 1.0


@pytest.mark.usefixtures("ray_session")
def test_a_user_agent_hook_runs_end_to_end(tmp_path: Path, capsys: Any) -> None:
    """``ppojob run`` with a ``module:function`` hook of the tests' own (tests/helpers/agent_hooks):
    the hook answers each sample's first turn with ``999``. Every call it logged saw one model
    turn of a dataset prompt; the step's tool calls are exactly the calls it logged; its tokens
    are the environment's: the engine's and the actor's log-probs agree on the trained tokens
    (the observation's rollout log-probs are 0, so counting them as trained would not)."""
    import json

    from ppojob_cli.main import main as ppojob
    from ppojob_trainer.progress import read_metrics

    log = tmp_path / "hook.jsonl"
    data = tmp_path / "prompts.jsonl"
    prompts = ["1234", "5678", "1357", "2468"]
    data.write_text("".join(json.dumps({"prompt": p, "label": str(log)}) + "\n" for p in prompts))
    out = tmp_path / "run"
    sets = {
        "data.prompts": str(data),
        "data.agent.function": "tests.helpers.agent_hooks:nines",
        "data.rewardFunction": "tests.helpers.agent_hooks:last_turn_nines",
        "data.agent.maxToolResponseTokens": "3",
        "data.maxResponseLength": "12",
        "data.rolloutBatchSize": "4",
        "data.samplesPerPrompt": "4",
        "training.miniBatchSize": "16",
    }
    args = ["run", str(EXAMPLE), "--steps", "2", "--out", str(out), "--no-progress"]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    rc = ppojob(args)
    assert rc == 0, capsys.readouterr().err
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls and all(c["prompt"] in prompts and len(c["turns"]) == 1 for c in calls)
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    assert sum(r["agent/env_calls_mean"] * 16 for r in records) == pytest.approx(len(calls))
    for r in records:
        assert r["agent/tool_errors_mean"] == 0.0
        assert r["rollout/logprob_diff_mean"] < 1e-4
