"""Rollout role: tokenize prompts, sample completions, score them.

A rollout batch is a dict of CPU tensors for a contiguous range of the step's samples:
``prompt_ids``/``prompt_mask`` [b, P] (left-padded), ``response_ids``/``response_mask`` [b, T],
``rollout_logprobs`` [b, T], ``lengths`` [b], ``scores`` [b] float32, ``group_ids`` [b] and
``sample_idx`` [b] (global sample numbers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..backends.base import GenerationEngine, ShardIdentity
from ..config import TrainerConfig
from ..models import load_tokenizer
from ..tasks import Example, RewardScorer


def make_engine(
    cfg: TrainerConfig, model_dir: Path, tokenizer: Any, device: str
) -> GenerationEngine:
    """The generation engine of ``spec.roles.rollout.backend``."""
    backend = cfg.roles.rollout.backend
    if backend == "sglang":
        from ..backends.sglang_backend import SGLangGenerationEngine

        return SGLangGenerationEngine(cfg, model_dir, tokenizer)
    from ..backends.torch_backend import TorchGenerationEngine

    return TorchGenerationEngine(
        model_dir,
        cfg.model.dtype,
        stop_ids=stop_token_ids(tokenizer),
        pad_id=tokenizer.pad_token_id,
        device=device,
    )


def stop_token_ids(tokenizer: Any) -> list[int]:
    """Generation stops at the first special token (EOS, padding, BOS...)."""
    ids = set(tokenizer.all_special_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def truncate_left(ids: list[int], max_len: int, bos_id: int | None) -> list[int]:
    """The last ``max_len`` tokens of ``ids``; a leading BOS token stays first (the model was
    trained with it there)."""
    if len(ids) <= max_len:
        return list(ids)
    if bos_id is not None and ids and ids[0] == bos_id and max_len > 1:
        return [ids[0], *ids[len(ids) - (max_len - 1) :]]
    return list(ids[len(ids) - max_len :])


class RolloutWorker:
    """Role logic of one generation engine."""

    def __init__(
        self, cfg: TrainerConfig, shard: ShardIdentity, model_dir: Path, device: str
    ) -> None:
        self.cfg = cfg
        self.shard = shard
        self.tokenizer = load_tokenizer(model_dir)
        self.special = set(stop_token_ids(self.tokenizer))
        self.engine = make_engine(cfg, model_dir, self.tokenizer, device)
        self.scorer = RewardScorer(cfg.data.reward_function, cfg.data.prompts)
        self.eval_scorer = (
            RewardScorer(cfg.data.reward_function, cfg.data.eval_prompts)
            if cfg.data.eval_prompts else self.scorer
        )  # fmt: skip

    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and mask, left-padded; a prompt longer than maxPromptLength keeps its end
        (and its BOS token, when the tokenizer adds one)."""
        tok = self.tokenizer
        rows = [
            truncate_left(ids, self.cfg.data.max_prompt_length, tok.bos_token_id)
            for ids in tok(prompts)["input_ids"]
        ]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, r in enumerate(rows):
            if r:
                ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
                mask[i, width - len(r) :] = True
        return ids, mask

    def completions(self, response_ids: torch.Tensor) -> list[str]:
        """Decoded responses, each cut at its first special token."""
        out = []
        for row in response_ids.tolist():
            cut = next((i for i, t in enumerate(row) if t in self.special), len(row))
            out.append(self.tokenizer.decode(row[:cut]))
        return out

    def generate(
        self, examples: list[Example], first_sample: int, seed: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Sample ``samplesPerPrompt`` completions of each example and score them.

        Samples are numbered from ``first_sample``; group ids are the global prompt numbers.
        """
        k = self.cfg.data.samples_per_prompt
        prompts = [e.prompt for e in examples for _ in range(k)]
        labels = [e.label for e in examples for _ in range(k)]
        ids, mask = self.encode(prompts)
        gen = self.engine.generate(
            ids,
            mask,
            max_new_tokens=self.cfg.data.max_response_length,
            temperature=self.cfg.data.temperature,
            top_p=self.cfg.data.top_p,
            seed=seed,
        )
        scores = torch.tensor(
            self.scorer(prompts, self.completions(gen.response_ids), labels), dtype=torch.float32
        )
        idx = torch.arange(first_sample, first_sample + len(prompts))
        batch = {
            "prompt_ids": ids,
            "prompt_mask": mask,
            "response_ids": gen.response_ids,
            "response_mask": gen.response_mask,
            "rollout_logprobs": gen.logprobs,
            "lengths": gen.lengths,
            "scores": scores,
            "group_ids": idx // k,
            "sample_idx": idx,
        }
        metrics = {
            "reward_sum": float(scores.sum()),
            "length_sum": float(gen.lengths.sum()),
            "n": float(len(prompts)),
        }
        return batch, metrics

    def evaluate(self, examples: list[Example]) -> dict[str, float]:
        """One greedy completion of each held-out example, scored; returns sums."""
        prompts = [e.prompt for e in examples]
        ids, mask = self.encode(prompts)
        gen = self.engine.generate(ids, mask, max_new_tokens=self.cfg.data.max_response_length,
                                   temperature=0.0, top_p=1.0, seed=0)  # fmt: skip
        scores = self.eval_scorer(prompts, self.completions(gen.response_ids),
                                  [e.label for e in examples])  # fmt: skip
        return {"reward_sum": float(sum(scores)), "n": float(len(prompts))}

    def update_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.engine.update_weights(weights)


# Weights cross the object store as NumPy arrays: Ray writes and reads those without a pickle
# copy (bfloat16, which NumPy lacks, travels as its int16 bit pattern).
def pack_weights(named: dict[str, torch.Tensor]) -> dict[str, tuple[str, Any]]:
    """CPU tensors -> {name: (dtype name, ndarray)} for ``ray.put``."""
    out = {}
    for name, t in named.items():
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            out[name] = ("bfloat16", t.view(torch.int16).numpy())
        else:
            out[name] = (str(t.dtype).removeprefix("torch."), t.numpy())
    return out


def unpack_weights(packed: dict[str, tuple[str, Any]]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`pack_weights` (tensors may share the object store's read-only memory;
    the engines copy them into their own parameters)."""
    import warnings

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only arrays from the object store
        for name, (dtype, arr) in packed.items():
            t = torch.from_numpy(arr)
            out[name] = t.view(torch.bfloat16) if dtype == "bfloat16" else t
    return out


def cat_batches(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate rollout batches (prompt and response widths are padded to the widest)."""
    if len(parts) == 1:
        return parts[0]
    out: dict[str, torch.Tensor] = {}
    pw = max(p["prompt_ids"].shape[1] for p in parts)
    rw = max(p["response_ids"].shape[1] for p in parts)
    pad = {"prompt_ids": 0, "prompt_mask": False}
    for key in parts[0]:
        tensors = []
        for p in parts:
            t = p[key]
            if key in ("prompt_ids", "prompt_mask") and t.shape[1] < pw:  # left pad
                fill = torch.full((t.shape[0], pw - t.shape[1]), pad[key], dtype=t.dtype)
                t = torch.cat([fill, t], 1)
            elif t.dim() == 2 and key not in ("prompt_ids", "prompt_mask") and t.shape[1] < rw:
                fill = torch.zeros((t.shape[0], rw - t.shape[1]), dtype=t.dtype)
                t = torch.cat([t, fill], 1)
            tensors.append(t)
        out[key] = torch.cat(tensors, 0)
    return out


def slice_batch(batch: dict[str, torch.Tensor], lo: int, hi: int) -> dict[str, torch.Tensor]:
    """Rows ``lo:hi`` of every tensor of a batch."""
    return {k: v[lo:hi] for k, v in batch.items()}
