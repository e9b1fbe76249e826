"""A local character-level tokenizer with a chat template that declares tools (no downloads),
and tools for the tests of data.agent.tools.

Every printable ASCII character and ``\\n`` is one token; ``<|im_start|>``, ``<|im_end|>``
(the EOS token) and ``<pad>`` are special tokens. The template is Hermes/ChatML-like: a system
message listing the tools as JSON and asking for ``<tool_call>{"name": ..., "arguments":
...}</tool_call>``, then ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`` per message; it only
appends, so it is prefix-stable. ``UNSTABLE_TEMPLATE`` counts the messages at the top, so each
new message changes the beginning.
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

SPECIALS = ("<pad>", "<|im_start|>", "<|im_end|>", "<unk>")


def chat_tokenizer(template: str = CHAT_TEMPLATE) -> Any:
    """The tokenizer, as a ``PreTrainedTokenizerFast`` with ``chat_template`` set."""
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
    return out


# Tools for the tests (data.agent.tools[].function: tests.helpers.chat_tools:add)
def add(a: int, b: int) -> int:
    """The sum of two integers."""
    return a + b


def divide(a: int, b: int) -> int:
    """Integer division (b = 0 raises ZeroDivisionError in the tool process)."""
    return a // b


ADD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
