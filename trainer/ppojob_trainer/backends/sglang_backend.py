"""SGLang generation engine (GPU). Imported only when ``spec.roles.rollout.backend: sglang``.

Generation goes through SGLang's offline ``Engine.generate`` with ``input_ids`` and
``return_logprob``; weight sync maps :meth:`update_weights` onto the engine's
``update_weights_from_tensor`` (same node, tensors handed over by CUDA IPC). Multi-node layouts
would instead set up ``init_weights_update_group`` once and call
``update_weights_from_distributed`` per update. Not testable on CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from . import missing_backend
from .base import Generation, GenerationEngine


def _import_sglang() -> Any:
    try:
        import sglang
    except ImportError:
        raise missing_backend("sglang", "sglang", "spec.roles.rollout.backend") from None
    return sglang


class SGLangGenerationEngine(GenerationEngine):
    """One SGLang engine per rollout worker (tensor parallel inside it)."""

    def __init__(self, cfg: Any, model_dir: Path, tokenizer: Any) -> None:
        sglang = _import_sglang()
        rollout = cfg.roles.rollout
        self.engine = sglang.Engine(
            model_path=str(model_dir),
            dtype=cfg.model.dtype,
            tp_size=rollout.parallelism.tensor,
            mem_fraction_static=rollout.gpu_memory_fraction,
            random_seed=cfg.training.seed,
            enable_memory_saver=rollout.colocate_with_actor and rollout.offload,
        )
        self.pad_id = int(tokenizer.pad_token_id)
        self.stop_ids = sorted(set(tokenizer.all_special_ids))
        self.offload = rollout.colocate_with_actor and rollout.offload

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
        temperature: float, top_p: float, seed: int,
    ) -> Generation:  # fmt: skip
        prompts = [row[m].tolist() for row, m in zip(prompt_ids, prompt_mask.bool(), strict=True)]
        params = {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "stop_token_ids": self.stop_ids,
            "sampling_seed": seed,
        }
        outs = self.engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        bsz = len(prompts)
        ids = torch.full((bsz, max_new_tokens), self.pad_id, dtype=torch.long)
        logps = torch.zeros(bsz, max_new_tokens)
        for i, out in enumerate(outs):
            # output_token_logprobs: [(logprob, token_id, text), ...]
            toks = out["meta_info"]["output_token_logprobs"][:max_new_tokens]
            for t, (lp, tok, _text) in enumerate(toks):
                ids[i, t] = int(tok)
                logps[i, t] = float(lp)
        lengths = torch.tensor([min(len(o["meta_info"]["output_token_logprobs"]), max_new_tokens)
                                for o in outs])  # fmt: skip
        mask = torch.arange(max_new_tokens)[None, :] < lengths[:, None]
        return Generation(ids, mask, logps, lengths)

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        self.engine.update_weights_from_tensor(named_tensors=list(named_tensors.items()))

    def release_memory(self) -> None:
        if self.offload:
            self.engine.release_memory_occupation()

    def resume_memory(self) -> None:
        if self.offload:
            self.engine.resume_memory_occupation()
