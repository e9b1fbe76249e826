"""The distillation teacher (``algorithm.distillation``): where it is held and what it computes.

The teacher is a frozen causal LM held by every actor worker, beside the policy (as the frozen
reference is), on the worker's device, in its dtype. In the actor's prepare phase it scores the
worker's own samples: the log-prob of each sampled response token under the teacher's own
distribution (temperature 1, no nucleus). The per-token reverse KL on the student's samples,
``log pi_student(y_t) - log pi_teacher(y_t)``, is then the signal
(:mod:`ppojob_trainer.algorithms.distill`). Nothing of the teacher leaves the worker: the
driver sees only the step's summed reverse KL.

The teacher must read the actor's token ids: a teacher with another tokenizer (vocabulary,
BOS/EOS/pad ids) or a smaller output vocabulary is refused at start, naming
``algorithm.distillation.teacher`` and the difference.

Built-in teachers, made here without a download (``builtin:count-up-teacher``): a
tiny-llama-shaped model whose next token depends on the current token only. Its blocks add
nothing to the residual stream (their output projections are zero), token ``i``'s embedding is
the unit vector ``e_i``, so the final RMSNorm gives ``sqrt(hidden) e_i`` and the output head's
column ``i`` holds the log-probs of the next token divided by ``sqrt(hidden)``: the model's
distribution is exactly the table :func:`count_up_teacher_table` (after digit ``d``: ``d+1`` with
0.7, ``d+2`` with 0.2, each other digit 0.012, each special token 0.001; after a special
token: the digits uniformly, special tokens 0.001).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ppojob_api.training import Distillation, TrainerConfig

from .backends.torch_backend.memory import _pad_columns, trim_padding
from .backends.torch_backend.trainer_common import CausalLMLogprobs, _device_inputs
from .models import (
    BUILTIN_PREFIX,
    DIGITS,
    SPECIAL_TOKENS,
    VOCAB,
    builtin_config,
    load_causal_lm,
    load_tokenizer,
    materialize_builtin,
    resolve_model_path,
    tokenizer_difference,
)

FIELD = "algorithm.distillation.teacher"
SPECIAL_PROB = 0.001
NEXT_PROB, SECOND_PROB = 0.7, 0.2


def count_up_teacher_table() -> torch.Tensor:
    """[V, V] float64: row ``i`` is the built-in count-up teacher's next-token distribution
    after token ``i`` (see the module docstring)."""
    v, first = len(VOCAB), len(SPECIAL_TOKENS)
    table = torch.full((v, v), SPECIAL_PROB, dtype=torch.float64)
    digits_left = 1.0 - first * SPECIAL_PROB
    for i in range(v):
        if i < first:  # after a special token: the digits uniformly
            table[i, first:] = digits_left / len(DIGITS)
            continue
        d = i - first
        rest = (digits_left - NEXT_PROB - SECOND_PROB) / (len(DIGITS) - 2)
        table[i, first:] = rest
        table[i, first + (d + 1) % 10] = NEXT_PROB
        table[i, first + (d + 2) % 10] = SECOND_PROB
    return table


def build_count_up_teacher(seed: int = 0) -> Any:
    """The built-in count-up teacher: tiny-llama's architecture computing the bigram table
    :func:`count_up_teacher_table` exactly (up to RMSNorm's epsilon)."""
    from transformers import AutoModelForCausalLM

    config = builtin_config("tiny-llama")
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.random.set_rng_state(state)
    hidden, v = config.hidden_size, config.vocab_size
    gain = 1.0 / math.sqrt(1.0 / hidden + config.rms_norm_eps)  # RMSNorm of a unit vector
    with torch.no_grad():
        for layer in model.model.layers:  # every block adds nothing to the residual stream
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = torch.zeros(v, hidden)
        embed[:, :v] = torch.eye(v)
        model.model.embed_tokens.weight.copy_(embed)
        model.model.norm.weight.fill_(1.0)
        head = torch.zeros(v, hidden)
        head[:, :v] = count_up_teacher_table().log().T.float() / gain
        model.lm_head.weight.copy_(head)
    return model


BUILTIN_TEACHERS = {"count-up-teacher": build_count_up_teacher}
"""Built-in teachers by name (``ppojob_api.trainspec.constants.BUILTIN_TEACHERS`` lists them)."""


def resolve_teacher_path(path: str, seed: int, root: Path | None = None) -> Path:
    """A loadable directory for the teacher: a built-in teacher is made (once, cached as the
    built-in models are), anything else resolves as ``model.path`` does."""
    name = path.removeprefix(BUILTIN_PREFIX)
    if path.startswith(BUILTIN_PREFIX) and name in BUILTIN_TEACHERS:
        return materialize_builtin(name, 0, root, build=BUILTIN_TEACHERS[name])
    try:
        return resolve_model_path(path, seed, root)
    except ValueError as exc:
        raise ValueError(str(exc).replace("model.path", FIELD, 1)) from None


def check_teacher_tokenizer(actor_dir: Path | str, teacher_dir: Path | str, lm: Any) -> None:
    """The teacher scores the actor's token ids: its tokenizer must be the actor's and its
    output vocabulary hold every id of it; ``ValueError`` naming the field otherwise."""
    actor_tok = load_tokenizer(actor_dir)
    problem = tokenizer_difference(actor_tok, load_tokenizer(teacher_dir))
    if problem is not None:
        problem = problem.replace("the critic", "the teacher").replace("critic's", "teacher's")
    width = int(lm.get_output_embeddings().weight.shape[0])
    if problem is None and width < len(actor_tok):
        problem = f"its output layer has {width} tokens, the actor's tokenizer {len(actor_tok)}"
    if problem is not None:
        raise ValueError(
            f"{FIELD}: {str(teacher_dir)!r} has a different tokenizer than model.path "
            f"{str(actor_dir)!r}: {problem}. The teacher scores the actor's token ids, so use a "
            "teacher trained with the actor's tokenizer"
        )


class Teacher:
    """The frozen teacher on one actor worker: :meth:`logprobs` of a batch's response tokens."""

    def __init__(
        self,
        spec: Distillation,
        model_dtype: str,
        actor_dir: Path | str,
        device: str,
        teacher_dir: Path | str,
        rows: int | None = None,
    ) -> None:
        lm = load_causal_lm(teacher_dir, spec.dtype or model_dtype)
        check_teacher_tokenizer(actor_dir, teacher_dir, lm)
        self.device = torch.device(device)
        self.model = CausalLMLogprobs(lm).to(self.device).eval()
        self.model.requires_grad_(False)
        self.rows = rows

    @torch.no_grad()
    def logprobs(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """[B, T] float32 on the CPU: each response token's log-prob under the teacher
        (temperature 1, no nucleus), ``rows`` samples at a time; 0 where ``response_mask`` is
        0."""
        n, width = batch["response_ids"].shape
        size = self.rows or n
        out = torch.zeros(n, width, dtype=torch.float32)
        keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
        for lo in range(0, n, size):
            micro, _ = trim_padding({k: batch[k][lo : lo + size] for k in keys})
            inputs, plen = _device_inputs(micro, self.device)
            tokens = micro["response_ids"].to(self.device)
            logp, _ = self.model(inputs, tokens, plen, 1.0)
            out[lo : lo + size] = _pad_columns(logp.float().cpu(), width)
        return torch.where(batch["response_mask"].bool(), out, 0.0)


def make_teacher(cfg: TrainerConfig, actor_dir: Path | str, device: str) -> Teacher | None:
    """The teacher of ``cfg`` on ``device`` (None without distillation); a failure to load
    it is one ``ValueError`` naming ``algorithm.distillation.teacher``."""
    spec = cfg.algorithm.distillation
    if spec is None:
        return None
    path = resolve_teacher_path(spec.teacher, cfg.training.seed)
    settings = cfg.training
    rows = settings.forward_micro_batch_size or settings.micro_batch_size
    try:
        return Teacher(spec, cfg.model.dtype, actor_dir, device, path, rows)
    except ValueError as exc:
        if str(exc).startswith(FIELD):
            raise
        raise ValueError(f"{FIELD}: {str(path)!r}: {exc}") from None
    except OSError as exc:
        raise ValueError(f"{FIELD}: {str(path)!r} cannot be loaded: {exc}") from None
