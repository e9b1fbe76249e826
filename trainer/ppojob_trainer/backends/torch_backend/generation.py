"""The torch backend's generation engine: a tight sampling loop over the whole batch with the
model's KV cache (``past_key_values``): one forward over the prompts, then one single-token
forward per step until every row has produced a stop token. With ``record_routing`` (a
mixture-of-experts model under ``algorithm.routingReplay: rollout``) it records the experts every
token it fed was routed to (:mod:`.moe`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...algorithms.sampling import sampling_logprobs
from ...models import load_causal_lm
from ..base import Generation, GenerationEngine
from .common import top_p_filter
from .lora import LORA_A, LORA_B
from .moe import EXPERT_DTYPE, NO_EXPERT, RouterTap


class TorchGenerationEngine(GenerationEngine):
    """Batched sampling with the HF model's KV cache."""

    def __init__(
        self,
        model_dir: Path | str,
        dtype: str,
        stop_ids: Sequence[int],
        pad_id: int,
        device: str = "cpu",
        model: nn.Module | None = None,
        record_routing: bool = False,
    ) -> None:
        self.device = torch.device(device)
        self.model = (model if model is not None else load_causal_lm(model_dir, dtype)).to(
            self.device
        )
        self.model.eval()
        self.model.requires_grad_(False)
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=self.device)
        self.pad_id = int(pad_id)
        # transformers renamed `past_key_values` to `cache`; use whichever this version takes.
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.tap = RouterTap(self.model) if record_routing else None

    @torch.no_grad()  # not inference_mode: the outputs feed autograd in the same process
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        version: int = 0,
        interrupt: Callable[[], tuple[int, Mapping[str, torch.Tensor]] | None] | None = None,
    ) -> Generation:
        """Sample (KV cache). Partial rollout: ``interrupt``, when given, is asked between two
        tokens for a weight update; one it returns, ``(new version, weights)``, is loaded at
        once and generation resumes with it: the prompts and the tokens so far are re-encoded
        with the new weights (a fresh KV cache), so every later token is sampled from the new
        policy, and ``versions`` records which version sampled which token."""
        from transformers import DynamicCache

        dev = self.device
        gen = torch.Generator(device=dev).manual_seed(int(seed))
        ids = prompt_ids.to(dev)
        bsz = ids.shape[0]
        padded = not bool(prompt_mask.all())
        attn = prompt_mask.to(dev).long() if padded else None
        pos = (attn.cumsum(-1) - 1).clamp_min(0) if padded else None
        next_pos = (
            pos[:, -1:] + 1
            if pos is not None
            else torch.full((bsz, 1), ids.shape[1], dtype=torch.long, device=dev)
        )
        cache = DynamicCache()
        tap = self.tap
        out = self._feed(ids, attn, pos, cache, logits_to_keep=1)
        plen = ids.shape[1]
        prompt_routes = routes = None
        if tap is not None:  # the experts of every fed token; the last sampled one stays -1
            prompt_routes = tap.stacked(tap.chosen, (bsz, plen))
            routes = torch.full(
                (bsz, max_new_tokens, tap.layers, tap.k), NO_EXPERT, dtype=EXPERT_DTYPE
            )
        tokens = torch.full((bsz, max_new_tokens), self.pad_id, dtype=torch.long, device=dev)
        logps = torch.zeros(bsz, max_new_tokens, dtype=torch.float32, device=dev)
        mask = torch.zeros(bsz, max_new_tokens, dtype=torch.bool, device=dev)
        done = torch.zeros(bsz, dtype=torch.bool, device=dev)
        versions = torch.full((bsz, max_new_tokens), int(version), dtype=torch.int32)
        logits = out.logits[:, -1, :]
        greedy = temperature <= 0  # evaluation: the most likely token
        temperature = 1.0 if greedy else temperature
        for t in range(max_new_tokens):
            update = interrupt() if (interrupt is not None and t > 0) else None
            if update is not None:  # new weights mid-generation: re-encode, then go on
                version, weights = int(update[0]), update[1]
                self.update_weights(weights)
                cache = DynamicCache()
                full = torch.cat([ids, tokens[:, :t]], 1)
                full_attn = None if attn is None else attn  # already holds the t new columns
                full_pos = None if full_attn is None else (full_attn.cumsum(-1) - 1).clamp_min(0)
                out = self._feed(full, full_attn, full_pos, cache, logits_to_keep=1)
                if tap is not None:  # the new weights' routing governs the tokens from here
                    both = tap.stacked(tap.chosen, (bsz, plen + t))
                    prompt_routes, routes[:, :t] = both[:, :plen], both[:, plen:]
                logits = out.logits[:, -1, :]
            versions[:, t] = int(version)
            if greedy:
                tok = logits.argmax(-1)
            else:
                probs = torch.softmax(logits.float() / temperature, dim=-1)
                if top_p < 1.0:
                    probs = top_p_filter(probs, top_p)
                tok = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            alive = ~done
            tok = torch.where(alive, tok, self.pad_id)
            tokens[:, t] = tok
            mask[:, t] = alive
            # the log-prob under the distribution sampled from (top-p truncated): pi_old's
            logp_tok = sampling_logprobs(logits, tok, temperature, top_p)
            logps[:, t] = torch.where(alive, logp_tok, 0.0)
            done = done | torch.isin(tok, self.stop_ids)
            if t == max_new_tokens - 1 or bool(done.all()):
                break
            if attn is not None:
                attn = torch.cat([attn, torch.ones(bsz, 1, dtype=attn.dtype, device=dev)], 1)
            out = self._feed(tok[:, None], attn, next_pos, cache)
            if tap is not None:
                routes[:, t] = tap.stacked(tap.chosen, (bsz, 1))[:, 0]
            next_pos = next_pos + 1
            logits = out.logits[:, -1, :]
        width = t + 1  # columns actually sampled: pad to the longest response, not the max
        return Generation(
            response_ids=tokens[:, :width].cpu(),
            response_mask=mask[:, :width].cpu(),
            logprobs=logps[:, :width].cpu(),
            lengths=mask.sum(1).cpu(),
            versions=versions[:, :width] if interrupt is not None else None,
            routed_experts=None if routes is None else routes[:, :width],
            prompt_routed_experts=prompt_routes,
        )

    def _feed(
        self,
        ids: torch.Tensor,
        attn: torch.Tensor | None,
        pos: torch.Tensor | None,
        cache: Any,
        **kw: Any,
    ) -> Any:
        """One forward of the model over ``ids`` with the KV ``cache`` (``kw``: e.g.
        ``logits_to_keep``), recording each fed token's experts when routing is recorded."""
        with self.tap.record() if self.tap is not None else nullcontext():
            return self.model(
                input_ids=ids,
                attention_mask=attn,
                position_ids=pos,
                use_cache=True,
                **{self.cache_kw: cache},
                **kw,
            )

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Full weights (every name of the model's state dict), or LoRA adapters only
        (:data:`LORA_A` / :data:`LORA_B` pairs): then each adapted weight becomes its base value
        (kept from the first adapter update) plus ``B @ A``."""
        params = self.model.state_dict(keep_vars=True)
        if any(k.endswith((LORA_A, LORA_B)) for k in named_tensors):
            adapters = {k: v for k, v in named_tensors.items() if k.endswith((LORA_A, LORA_B))}
            self._apply_adapters(params, adapters)
            full = {k: v for k, v in named_tensors.items() if k not in adapters}
            unknown = sorted(set(full) - set(params))
            if unknown:  # (modulesToSave: whole weights next to the adapters)
                raise ValueError(f"update_weights: no weights {unknown[:5]}")
            with torch.no_grad():
                for name, value in full.items():
                    params[name].copy_(value)
            return
        missing = sorted(set(params) - set(named_tensors))
        if missing:
            raise ValueError(f"update_weights: weights missing for {missing[:5]}")
        with torch.no_grad():
            for name, dst in params.items():
                dst.copy_(named_tensors[name])

    def _apply_adapters(
        self, params: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor]
    ) -> None:
        base: dict[str, torch.Tensor] = self.__dict__.setdefault("_lora_base", {})
        modules = sorted({k.removesuffix(LORA_A).removesuffix(LORA_B) for k in adapters})
        with torch.no_grad():
            for module in modules:
                key = f"{module}.weight"
                a, b = adapters.get(module + LORA_A), adapters.get(module + LORA_B)
                if key not in params or a is None or b is None:
                    raise ValueError(f"update_weights: no weight {key!r} or half an adapter")
                dst = params[key]
                if key not in base:  # the base weight, before any adapter
                    base[key] = dst.detach().clone()
                delta = b.to(dst.device, torch.float32) @ a.to(dst.device, torch.float32)
                dst.copy_((base[key].float() + delta).to(dst.dtype))
