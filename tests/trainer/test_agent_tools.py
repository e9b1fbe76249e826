"""Tools through the tokenizer's own chat template (issue 25, ``data.agent.tools``): the prompt
declares the tools (``apply_chat_template(tools=...)``), tool results go back as ``role: tool``
messages rendered by the template, token-exactly (the trained tokens are the sampled ones; the
environment's tokens are the template's rendering between two model turns), malformed calls
are the model's observation, and a template that is not prefix-stable is a clear error.

The tokenizer is local (tests/helpers/chat_tools.py): characters, ChatML-like template."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ppojob_trainer.agent import (
    ChatTools,
    TemplateError,
    ToolCall,
    conversation_tensors,
    parse_tool_calls,
    run_conversations,
)
from ppojob_trainer.workers.rollout import render_prompt
from tests.helpers.chat_tools import ADD_SCHEMA, UNSTABLE_TEMPLATE, chat_tokenizer
from tests.helpers.scripted_engine import ScriptedEngine

TOOLS = [
    SimpleNamespace(
        name="add",
        description="The sum of two integers",
        parameters=ADD_SCHEMA,
        function="tests.helpers.chat_tools:add",
    ),
    SimpleNamespace(
        name="divide",
        description="a // b",
        parameters=ADD_SCHEMA,
        function="tests.helpers.chat_tools:divide",
    ),
    SimpleNamespace(
        name="calc",
        description="An integer expression",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
        function="builtin:calculate",
    ),
]


def _converse(tok: Any, texts: list[str], question: str = "2+3?") -> tuple[Any, Any, Any, list]:
    """One conversation of scripted model turns (each text + the EOS token)."""
    chat = ChatTools(tok, TOOLS, timeout=10, max_tool_response_tokens=200)
    messages = [{"role": "user", "content": question}]
    prompt = tok(render_prompt(tok, question, True, chat.declared), add_special_tokens=False)
    prompt_ids = prompt["input_ids"]
    turns = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    engine = ScriptedEngine(turns, tok.pad_token_id, logp_scale=100)
    try:
        (conv,) = run_conversations(
            engine,
            tok,
            [prompt_ids],
            [question],
            [None],
            None,
            max_turns=len(texts),
            max_response_length=400,
            max_tool_response_tokens=32,
            tool_timeout=10,
            temperature=1.0,
            top_p=1.0,
            seed=0,
            special=set(tok.all_special_ids),
            chat=chat,
        )
    finally:
        chat.close()
    return conv, engine, prompt_ids, [*turns, messages]


def test_a_tool_call_is_answered_through_the_template_token_exactly() -> None:
    tok = chat_tokenizer()
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    conv, engine, prompt, (turn1, turn2, _) = _converse(tok, [call, "5"])
    # the prompt declares the tools through the template
    prompt_text = tok.decode(prompt)
    assert '"name": "add"' in prompt_text and '"name": "calc"' in prompt_text
    # the trained tokens are exactly the sampled ones, with their log-probs
    env = conv.ids[len(turn1) : len(conv.ids) - len(turn2)]
    assert conv.ids == turn1 + env + turn2
    assert conv.action == [True] * len(turn1) + [False] * len(env) + [True] * len(turn2)
    assert [t for t, a in zip(conv.ids, conv.action, strict=True) if a] == turn1 + turn2
    sampled_logp = [-(k + 1) / 100 for k in range(len(turn1))]
    assert conv.logprobs[: len(turn1)] == pytest.approx(sampled_logp)
    assert conv.logprobs[len(turn1) : len(turn1) + len(env)] == [0.0] * len(env)
    # the environment's tokens: the rest of the template's closing of the model's turn (the
    # model sampled <|im_end|>), the tool message, the next turn's generation prompt
    assert tok.decode(env) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    # the second turn was sampled after exactly those tokens
    assert engine.prompts == [prompt, prompt + turn1 + env]
    # the whole sequence is the template's rendering of the conversation (it closes the last
    # turn with a newline the model did not sample)
    messages = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": call},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]
    full = tok.apply_chat_template(
        messages, tools=ChatTools(tok, TOOLS, 1, 8).declared, tokenize=False
    )
    assert full == tok.decode(prompt + conv.ids) + "\n"
    assert conv.turns == [call, "5"] and conv.env_calls == 1 and conv.tool_errors == 0
    t = conversation_tensors([conv], tok.pad_token_id)
    assert t["action_mask"][0].tolist() == conv.action


def test_the_builtin_calculate_tool_and_a_bare_json_call() -> None:
    tok = chat_tokenizer()
    call = '{"name": "calc", "arguments": {"expression": "37+48"}}'
    conv, *_ = _converse(tok, [call, "85"])
    text = tok.decode(conv.ids)
    assert "<|im_start|>tool\n85<|im_end|>" in text and conv.tool_errors == 0


@pytest.mark.parametrize(
    ("call", "words"),
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 2, </tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "mul", "arguments": {"a": 2}}</tool_call>', "unknown tool 'mul'"),
        ('<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>', "missing required"),
        ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": "x"}}</tool_call>', "not integer"),
        (
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}</tool_call>',
            "unknown argument",
        ),
        ('<tool_call>["add", 1, 2]</tool_call>', '{"name": ..., "arguments": {...}}'),
        ('<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}', "ZeroDivisionError"),
    ],
)
def test_a_bad_call_is_the_models_observation(call: str, words: str) -> None:
    tok = chat_tokenizer()
    conv, *_ = _converse(tok, [call, "?"])
    env = tok.decode([t for t, a in zip(conv.ids, conv.action, strict=True) if not a])
    assert env.startswith("\n<|im_start|>tool\n") and words in env, env
    assert env.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert conv.tool_errors == 1 and len(conv.turns) == 2


def test_a_turn_without_a_call_ends_the_conversation() -> None:
    tok = chat_tokenizer()
    conv, engine, *_ = _converse(tok, ["The answer is 5", "never sampled"])
    assert len(engine.prompts) == 1 and conv.env_calls == 0 and all(conv.action)


def test_calls_are_parsed_in_order_with_string_arguments() -> None:
    schemas = {"add": ADD_SCHEMA}
    text = (
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call> and '
        '<tool_call>{"name": "add", "parameters": {"a": 3, "b": 4}}</tool_call>'
    )
    assert parse_tool_calls(text, schemas) == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("add", {"a": 3, "b": 4}),
    ]
    assert parse_tool_calls("5", schemas) == []
    assert parse_tool_calls('{"name": "add", "arguments": {"a": true, "b": 1}}', schemas) == [
        "error: add: argument 'a' is bool, not integer"
    ]


def test_a_template_that_is_not_prefix_stable_is_a_clear_error_at_the_start() -> None:
    tok = chat_tokenizer(UNSTABLE_TEMPLATE)
    with pytest.raises(TemplateError) as info:
        ChatTools(tok, TOOLS, 1, 8)  # before any conversation
    msg = str(info.value)
    assert msg.startswith("data.agent.tools: ") and "prefix-stable" in msg and "\n" not in msg


def test_tools_need_a_chat_template() -> None:
    tok = chat_tokenizer()
    tok.chat_template = None
    with pytest.raises(TemplateError) as info:
        ChatTools(tok, TOOLS, 1, 8)
    assert str(info.value).startswith("data.agent.tools: ") and "chat template" in str(info.value)


def test_the_rollout_worker_renders_prompts_with_the_declared_tools() -> None:
    from ppojob_trainer.workers.rollout import RolloutWorker

    tok = chat_tokenizer()
    worker = object.__new__(RolloutWorker)
    worker.tokenizer, worker.chat = tok, True
    worker.cfg = SimpleNamespace(data=SimpleNamespace(max_prompt_length=4096))
    worker.agent = ChatTools(tok, TOOLS, 1, 8)
    try:
        texts, ids, mask = worker.encode(["2+3?"])
    finally:
        worker.agent.close()
    assert '"name": "divide"' in texts[0] and texts[0].endswith("<|im_start|>assistant\n")
    assert tok.decode(ids[0][mask[0]].tolist()) == texts[0]
