"""A local character-level tokenizer with a chat template that declares tools (no downloads),
and tools for the tests of data.agent.tools.

Every printable ASCII character and ``\\n`` is one token; ``<|im_start|>``, ``<|im_end|>``
(the EOS token) and ``<pad>`` are special tokens. The template is Hermes/ChatML-like: a system
message listing the tools as JSON and asking for ``<tool_call>{"name": ..., "arguments":
...}</tool_call>``, then ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`` per message; it only
appends, so it is prefix-stable. ``UNSTABLE_TEMPLATE`` counts the messages at the top, so each
new message changes the beginning.

``tool_calling_model`` writes a model directory for a real ``ppojob run`` of ``data.agent.tools``:
a tiny Llama and this tokenizer with ``COMPACT_TEMPLATE`` (each declared tool as one line
``name(arg, ...)``) and the call's fixed markup as whole tokens (``CALL_PIECES``, as a BPE
vocabulary merges frequent strings), trained for 50 steps of 8 conversations that call ``calc``
with random operands, so that it writes calls (with arguments of its own) from its first step.
"""

from __future__ import annotations

from typing import Any

# No newline follows a block tag (transformers renders with trim_blocks, which would eat it).
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    '{{ "\\n" }}Call one as <tool_call>{"name": NAME, "arguments": {...}}</tool_call>'
    "<|im_end|>{{ '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message.role + '\\n' + message.content }}<|im_end|>{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)

UNSTABLE_TEMPLATE = (
    "<|im_start|>system{{ '\\n' }}{{ messages | length }} messages<|im_end|>{{ '\\n' }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message.role + '\\n' + message.content }}<|im_end|>{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)

COMPACT_TEMPLATE = (
    "{% if tools %}<|im_start|>system{{ '\\n' }}{% for tool in tools %}"
    "{{ tool.function.name }}({{ tool.function.parameters.properties | list | join(', ') }})"
    "{{ '\\n' }}{% endfor %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message.role + '\\n' + message.content }}<|im_end|>{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)

SPECIALS = ("<pad>", "<|im_start|>", "<|im_end|>", "<unk>")
CALC_CALL = '{"name": "calc", "arguments": {"expression": "'
CALL_PIECES = ("<tool_call>", "</tool_call>", CALC_CALL, '"}}')
TOOL_LOG_ENV = "PPOJOB_TEST_TOOL_LOG"


def chat_tokenizer(template: str = CHAT_TEMPLATE, pieces: tuple[str, ...] = ()) -> Any:
    """The tokenizer, as a ``PreTrainedTokenizerFast`` with ``chat_template`` set; ``pieces``:
    strings that are one (ordinary, not special) token each."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\n", *(chr(c) for c in range(32, 127))]
    vocab = {t: i for i, t in enumerate([*SPECIALS, *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
    )
    out.chat_template = template
    if pieces:
        out.add_tokens(list(pieces))
    return out


CALC_TOOL = {
    "name": "calc",
    "description": "The value of an integer expression",
    "parameters": {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    },
}


def tool_calling_model(
    directory: Any, seed: int = 0, steps: int = 50, lr: float = 3e-3, batch: int = 8
) -> Any:
    """Write the tool-calling model (see the module's docstring) to ``directory``; return it.
    Each training conversation: a 4-digit user prompt, the call
    ``<tool_call>{"name": "calc", "arguments": {"expression": "A+B"}}</tool_call>`` with random
    A and B (0-99), the tool's value, the value's last digit as the answer; the loss is on the
    model's turns only."""
    import random
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = chat_tokenizer(COMPACT_TEMPLATE, CALL_PIECES)
    tools = [{"type": "function", "function": dict(CALC_TOOL)}]
    rng = random.Random(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
    )
    with torch.random.fork_rng():  # the caller's torch RNG stays as it was
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)

    def example() -> tuple[list[int], list[int]]:
        question = [{"role": "user", "content": f"{rng.randrange(10_000):04d}"}]
        a, b = rng.randrange(100), rng.randrange(100)
        call = f'<tool_call>{CALC_CALL}{a}+{b}"}}}}</tool_call>'
        answer = str((a + b) % 10)
        said = [*question, {"role": "assistant", "content": call}]
        answered = [*said, {"role": "tool", "name": "calc", "content": str(a + b)}]
        # what the trainer's conversation holds: the prompt, the model's call and its EOS, the
        # template's closing of that turn, the tool message and the next generation prompt
        # (the environment's), the model's answer and its EOS
        closed = tok.apply_chat_template(said, tools=tools, tokenize=False)
        opened = tok.apply_chat_template(answered, tools=tools, tokenize=False, **gen)
        env = closed[closed.rindex("<|im_end|>") + len("<|im_end|>") :] + opened[len(closed) :]
        parts = [
            (tok.apply_chat_template(question, tools=tools, tokenize=False, **gen), False),
            (call, True),
            (env, False),
            (answer, True),
        ]
        ids: list[int] = []
        labels: list[int] = []
        for text, model_wrote in parts:
            part = tok(text, add_special_tokens=False)["input_ids"]
            part += [tok.eos_token_id] if model_wrote else []
            ids += part
            labels += part if model_wrote else [-100] * len(part)
        return ids, labels

    gen = {"add_generation_prompt": True}
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        rows = [example() for _ in range(batch)]
        width = max(len(i) for i, _ in rows)
        ids = torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i, _ in rows])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = Path(directory)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


# Tools for the tests (data.agent.tools[].function: tests.helpers.chat_tools:add)
def add(a: int, b: int) -> int:
    """The sum of two integers."""
    return a + b


def divide(a: int, b: int) -> int:
    """Integer division (b = 0 raises ZeroDivisionError in the tool process)."""
    return a // b


def calculate_logged(expression: str) -> str:
    """Tool ``builtin:calculate`` (the same function), and one JSON line ``{"expression": ...,
    "result": ...}`` appended to the file named by ``$PPOJOB_TEST_TOOL_LOG`` (the test sets it
    before Ray starts, so the tool processes inherit it)."""
    import json
    import os

    from ppojob_trainer.agent import builtin_calculate

    def log(result: str) -> None:
        with open(os.environ[TOOL_LOG_ENV], "a") as f:
            f.write(json.dumps({"expression": expression, "result": result}) + "\n")

    try:
        result = builtin_calculate(expression)
    except ValueError as exc:
        log(f"ValueError: {exc}")
        raise
    log(result)
    return result


ADD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
