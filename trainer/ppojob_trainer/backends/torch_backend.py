"""The torch backend: Hugging Face ``transformers`` models on CPU or one GPU per worker.

Generation is a tight sampling loop over the whole batch with the model's KV cache
(``past_key_values``): one forward over the prompts, then one single-token forward per step until
every row has produced a stop token. Training is data parallel: each worker holds a full replica
and gradients are averaged with one flat ``all_reduce`` over the role's ``torch.distributed``
group (gloo on CPU, nccl on GPU).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..algorithms.sampling import sampling_logprobs
from ..config import TrainingSettings
from ..models import load_causal_lm, load_value_model
from .base import (
    Generation,
    GenerationEngine,
    PolicyLossFn,
    PolicyTrainer,
    ValueLossFn,
    ValueTrainer,
)


# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------
def full_inputs(
    batch: Mapping[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
    """Prompt + response ids, attention mask (None without padding), position ids, prompt len."""
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
    ids = torch.cat([prompt_ids, batch["response_ids"]], dim=1)
    if bool(prompt_mask.all()):
        return ids, None, None, prompt_ids.shape[1]
    ones = torch.ones_like(batch["response_ids"], dtype=prompt_mask.dtype)
    attn = torch.cat([prompt_mask, ones], dim=1).long()
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    return ids, attn, pos, prompt_ids.shape[1]


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, top_p: float = 1.0
) -> torch.Tensor:
    """Log-probs of ``tokens`` under the sampling distribution: ``softmax(logits / temperature)``
    truncated to the ``top_p`` nucleus (:func:`~ppojob_trainer.algorithms.sampling_logprobs`),
    in float32."""
    return sampling_logprobs(logits, tokens, temperature, top_p)


def entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per position, float32."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail of each row beyond the smallest set with probability mass >= ``top_p``."""
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, idx, sorted_p)


def lr_factor(update: int, settings: TrainingSettings, total_updates: int) -> float:
    """Multiplier of the peak learning rate at optimizer update ``update`` (0-based)."""
    warm = settings.lr_warmup_steps
    if warm and update < warm:
        return (update + 1) / warm
    if settings.lr_scheduler == "constant" or total_updates <= warm:
        return 1.0
    progress = min(1.0, (update - warm) / max(1, total_updates - warm))
    floor = settings.min_learning_rate / settings.learning_rate
    if settings.lr_scheduler == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode (no dropout) inside the block, its previous mode after."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def _split(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def accumulation_weights(counts: Sequence[float], global_count: float, dp_size: int) -> list[float]:
    """Weights of the micro-batch losses of one mini-batch under gradient accumulation.

    Each micro-batch's loss is a mean over its own ``counts[i]`` units (tokens or sequences);
    the mini-batch's loss is the mean over ``global_count`` units, every data-parallel worker's
    together. The weight ``counts[i] / global_count`` makes the summed gradients that of the
    global mean; times ``dp_size`` because the data-parallel all-reduce then averages them.
    """
    if global_count <= 0:
        raise ValueError(
            f"accumulation_weights: the mini-batch has no unit to average over "
            f"(global count {global_count})"
        )
    return [float(c) * dp_size / float(global_count) for c in counts]


def _micro_weights(
    minibatch: Mapping[str, torch.Tensor], slices: Sequence[slice], agg: str, opt: _Optimised
) -> list[float]:
    """:func:`accumulation_weights` of the micro-batches ``slices`` of ``minibatch``."""
    from ..algorithms import aggregation_count

    mask = minibatch.get("response_mask")
    if mask is None:  # a loss without a mask: each row counts once
        counts = [float(sl.stop - sl.start) for sl in slices]
    else:
        counts = [float(aggregation_count(mask[sl], agg)) for sl in slices]
    return accumulation_weights(counts, opt.global_count(sum(counts)), opt.dp_size)


class _Optimised:
    """A module, its AdamW optimizer, the LR schedule and the data-parallel gradient average."""

    def __init__(
        self,
        module: nn.Module,
        settings: TrainingSettings,
        total_updates: int,
        group: Any | None,
        dp_size: int,
    ) -> None:
        self.module = module
        self.settings = settings
        self.total_updates = max(1, total_updates)
        self.group = group
        self.dp_size = dp_size
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=settings.learning_rate,
            betas=(settings.adam_beta1, settings.adam_beta2),
            eps=settings.adam_eps,
            weight_decay=settings.weight_decay,
        )
        self.updates = 0

    def global_count(self, local: float) -> float:
        """Sum of ``local`` over the data-parallel group."""
        if self.dp_size <= 1:
            return float(local)
        from ..algorithms.stats import all_reduce_sum

        return float(all_reduce_sum(torch.tensor([float(local)], dtype=torch.float64), self.group))

    def accumulate(
        self,
        minibatch: Mapping[str, torch.Tensor],
        micro_batch_size: int,
        agg: str,
        micro_loss: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]],
    ) -> dict[str, float]:
        """One optimizer update over ``minibatch``: backward each micro-batch's loss with its
        :func:`accumulation_weights` weight, then step. Returns the row-weighted mean of the
        micro-batches' metrics plus the step's."""
        n = minibatch["response_ids"].shape[0]
        self.module.train()
        slices = _split(n, micro_batch_size)
        parts = []
        for sl, scale in zip(slices, _micro_weights(minibatch, slices, agg, self), strict=True):
            loss, metrics = micro_loss({k: v[sl] for k, v in minibatch.items()})
            (loss * scale).backward()
            parts.append(((sl.stop - sl.start) / n, metrics))
        out = _mean_metrics(parts)
        out.update(self.step())
        return out

    def step(self) -> dict[str, float]:
        if self.dp_size > 1:
            import torch.distributed as dist

            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            flat /= self.dp_size
            offset = 0
            for p in self.params:
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
                offset += n
        clip = self.settings.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.params, clip if clip else float("inf"))
        lr = self.settings.learning_rate * lr_factor(
            self.updates, self.settings, self.total_updates
        )
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        return {"grad_norm": float(norm), "lr": lr}

    def state_dict(self) -> dict[str, object]:
        return {
            "model": {k: v.detach().clone() for k, v in self.module.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "updates": self.updates,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = int(state["updates"])


def _mean_metrics(parts: Sequence[tuple[float, dict[str, float]]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for weight, metrics in parts:
        for k, v in metrics.items():
            out[k] = out.get(k, 0.0) + weight * float(v)
    return out


# ---------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------
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
    ) -> Generation:
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
        out = self.model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kw: cache},
        )
        tokens = torch.full((bsz, max_new_tokens), self.pad_id, dtype=torch.long, device=dev)
        logps = torch.zeros(bsz, max_new_tokens, dtype=torch.float32, device=dev)
        mask = torch.zeros(bsz, max_new_tokens, dtype=torch.bool, device=dev)
        done = torch.zeros(bsz, dtype=torch.bool, device=dev)
        logits = out.logits[:, -1, :]
        greedy = temperature <= 0  # evaluation: the most likely token
        temperature = 1.0 if greedy else temperature
        for t in range(max_new_tokens):
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
            out = self.model(
                input_ids=tok[:, None],
                attention_mask=attn,
                position_ids=next_pos,
                use_cache=True,
                **{self.cache_kw: cache},
            )
            next_pos = next_pos + 1
            logits = out.logits[:, -1, :]
        return Generation(
            response_ids=tokens.cpu(),
            response_mask=mask.cpu(),
            logprobs=logps.cpu(),
            lengths=mask.sum(1).cpu(),
        )

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        params = self.model.state_dict(keep_vars=True)
        missing = sorted(set(params) - set(named_tensors))
        if missing:
            raise ValueError(f"update_weights: weights missing for {missing[:5]}")
        with torch.no_grad():
            for name, dst in params.items():
                dst.copy_(named_tensors[name])


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
class _OptimisedState:
    """Checkpoint state of a trainer is its model and optimizer (``self.opt``)."""

    opt: _Optimised

    def state_dict(self) -> dict[str, object]:
        return self.opt.state_dict()

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self.opt.load_state_dict(state)


class TorchPolicyTrainer(_OptimisedState, PolicyTrainer):
    """The actor: HF causal LM, frozen reference copy when KL is on, AdamW."""

    def __init__(
        self,
        model_dir: Path | str,
        dtype: str,
        settings: TrainingSettings,
        *,
        total_updates: int,
        temperature: float,
        top_p: float = 1.0,
        need_reference: bool,
        need_entropy: bool = True,
        entropy_grad: bool = False,
        group: Any | None = None,
        dp_size: int = 1,
        device: str = "cpu",
    ) -> None:
        """``need_entropy``: hand ``loss_fn`` the per-token entropy; ``entropy_grad``: with its
        graph (only when the loss uses it: an entropy coefficient > 0), else as a detached
        metric computed under ``no_grad`` (no [B, T, V] activations kept for backward)."""
        self.device = torch.device(device)
        self.model = load_causal_lm(model_dir, dtype).to(self.device)
        self.model.train()
        self.reference = None
        if need_reference:
            self.reference = load_causal_lm(model_dir, dtype).to(self.device).eval()
            self.reference.requires_grad_(False)
        self.temperature = temperature
        self.top_p = top_p  # pi_old and pi_theta are the top-p truncated sampling distribution
        self.need_entropy = need_entropy
        self.entropy_grad = entropy_grad
        self.opt = _Optimised(self.model, settings, total_updates, group, dp_size)

    def _forward(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        ids, attn, pos, plen = full_inputs(batch)
        tlen = batch["response_ids"].shape[1]
        logits = model(
            input_ids=ids.to(self.device),
            attention_mask=None if attn is None else attn.to(self.device),
            position_ids=None if pos is None else pos.to(self.device),
            use_cache=False,
        ).logits
        return logits[:, plen - 1 : plen - 1 + tlen]

    @torch.no_grad()
    def logprobs(
        self, batch: Mapping[str, torch.Tensor], *, reference: bool = False
    ) -> torch.Tensor:
        model = self.reference if reference else self.model
        if model is None:
            raise ValueError("logprobs(reference=True) needs a reference model (KL is off)")
        with _eval_mode(model):  # old/ref log-probs without dropout; training uses train mode
            logits = self._forward(model, batch)
        tokens = batch["response_ids"].to(self.device)
        return token_logprobs(logits, tokens, self.temperature, self.top_p).cpu()

    def update(
        self,
        minibatch: Mapping[str, torch.Tensor],
        loss_fn: PolicyLossFn,
        micro_batch_size: int,
        agg: str = "token-mean",
    ) -> dict[str, float]:
        def micro_loss(micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
            logits = self._forward(self.model, micro)
            tokens = micro["response_ids"].to(self.device)
            logp = token_logprobs(logits, tokens, self.temperature, self.top_p)
            ent = None
            if self.need_entropy and self.entropy_grad:
                ent = entropy(logits, self.temperature)
            elif self.need_entropy:
                with torch.no_grad():
                    ent = entropy(logits.detach(), self.temperature)
            return loss_fn(logp, ent, micro)

        return self.opt.accumulate(minibatch, micro_batch_size, agg, micro_loss)

    def export_weights(self) -> dict[str, torch.Tensor]:
        # No copy on CPU: the caller serialises them (ray.put) before the next update.
        return {k: v.detach().to("cpu") for k, v in self.model.state_dict().items()}


class TorchValueTrainer(_OptimisedState, ValueTrainer):
    """The critic: HF backbone with a scalar value head, AdamW."""

    def __init__(
        self,
        model_dir: Path | str,
        dtype: str,
        settings: TrainingSettings,
        *,
        total_updates: int,
        seed: int,
        group: Any | None = None,
        dp_size: int = 1,
        device: str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.model = load_value_model(model_dir, dtype, seed=seed).to(self.device)
        self.model.train()
        self.opt = _Optimised(self.model, settings, total_updates, group, dp_size)

    def _forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        ids, attn, pos, plen = full_inputs(batch)
        tlen = batch["response_ids"].shape[1]
        values = self.model(
            ids.to(self.device),
            None if attn is None else attn.to(self.device),
            None if pos is None else pos.to(self.device),
        )
        return values[:, plen - 1 : plen - 1 + tlen]

    @torch.no_grad()
    def values(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        with _eval_mode(self.model):  # values for the advantages without dropout
            return self._forward(batch).cpu()

    def update(
        self,
        minibatch: Mapping[str, torch.Tensor],
        loss_fn: ValueLossFn,
        micro_batch_size: int,
        agg: str = "token-mean",
    ) -> dict[str, float]:
        return self.opt.accumulate(
            minibatch, micro_batch_size, agg, lambda micro: loss_fn(self._forward(micro), micro)
        )


__all__ = [
    "TorchGenerationEngine",
    "TorchPolicyTrainer",
    "TorchValueTrainer",
    "accumulation_weights",
    "entropy",
    "full_inputs",
    "lr_factor",
    "token_logprobs",
    "top_p_filter",
]
