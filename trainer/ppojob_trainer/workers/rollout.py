"""Rollout role: tokenize prompts, sample completions, score them.

A rollout batch is a dict of CPU tensors for a contiguous range of the step's samples:
``prompt_ids``/``prompt_mask`` [b, P] (left-padded), ``response_ids``/``response_mask`` [b, T],
``rollout_logprobs`` [b, T], ``versions`` [b, T] (the policy version of each token),
``lengths`` [b], ``scores`` [b] float32 (the reward, plus DAPO's overlong penalty when
``algorithm.overlongShaping`` is set), ``truncated`` [b] bool (cut at maxResponseLength without a
stop token), ``group_ids`` [b] and ``sample_idx`` [b] (global sample numbers). A step assembled by
dynamic sampling (:func:`select_groups`) also has ``in_loss`` [b] bool. A multi-turn batch
(``data.agent``) also has ``action_mask`` [b, T] bool: True on the tokens the engine sampled,
False on the environment's (see :mod:`ppojob_trainer.agent`). Under ``algorithm.routingReplay:
rollout`` it also has ``routed_experts`` [b, T, layers, k] and ``prompt_routed_experts``
[b, P, layers, k] (int16, ``-1`` where nothing was recorded): the experts the engine routed each
token to (:mod:`ppojob_trainer.backends.torch_backend.moe`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ppojob_api.checks.distill import teacher_alone
from ppojob_api.training import TrainerConfig

from ..agent import (
    ChatTools,
    RemoteToolPool,
    ToolPool,
    conversation_tensors,
    load_agent,
    run_conversations,
)
from ..algorithms.dapo import overlong_penalty, truncated_rows
from ..backends.base import Generation, GenerationEngine
from ..distributed import ShardIdentity
from ..models import load_tokenizer
from ..rewards import make_reward
from ..tasks import Example, Prompt


def make_engine(
    cfg: TrainerConfig,
    model_dir: Path,
    tokenizer: Any,
    device: str,
    visible_devices: list[str] | None = None,
) -> GenerationEngine:
    """The generation engine of ``spec.roles.rollout.backend``. ``visible_devices``: the GPUs a
    colocated sglang engine spans (its bundle's), this process's own first."""
    backend = cfg.roles.rollout.backend
    if backend == "sglang":
        from ..backends.sglang_backend import SGLangGenerationEngine

        return SGLangGenerationEngine(
            cfg, model_dir, tokenizer, stop_token_ids(tokenizer), visible_devices
        )
    from ..backends.torch_backend.generation import TorchGenerationEngine

    return TorchGenerationEngine(
        model_dir,
        cfg.model.dtype,
        stop_ids=stop_token_ids(tokenizer),
        pad_id=tokenizer.pad_token_id,
        device=device,
        record_routing=cfg.algorithm.routing_replay == "rollout",
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


def uses_chat_template(tokenizer: Any, setting: bool | None) -> bool:
    """``data.applyChatTemplate``: on when set, off when false, and by default on exactly when
    the tokenizer has a chat template."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if setting is None:
        return has
    if setting and not has:
        raise ValueError(
            "data.applyChatTemplate is true but the model's tokenizer has no chat template; "
            "set applyChatTemplate: false or use a model whose tokenizer_config.json has one"
        )
    return setting


def render_prompt(
    tokenizer: Any, prompt: Prompt, chat: bool, tools: list[dict[str, Any]] | None = None
) -> str:
    """The text a prompt is tokenized from: a plain string as it is, or rendered with the
    tokenizer's chat template (a string becomes one user message; the template adds the
    assistant turn's header). Chat messages need the template."""
    if not chat:
        if not isinstance(prompt, str):
            raise ValueError(
                "data.prompts: a prompt given as chat messages needs the tokenizer's chat "
                "template, but data.applyChatTemplate is off (or the tokenizer has none)"
            )
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    extra = {"tools": tools} if tools else {}  # data.agent.tools, declared by the template
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **extra
    )


class RolloutWorker:
    """Role logic of one generation engine."""

    # data.agent's environment (multi-turn): its hook in tool processes, or its declared tools
    agent: ToolPool | RemoteToolPool | ChatTools | None = None

    def __init__(
        self,
        cfg: TrainerConfig,
        shard: ShardIdentity,
        model_dir: Path,
        device: str,
        visible_devices: list[str] | None = None,
        reward_workers: list[Any] | None = None,
        sandbox_workers: list[Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.shard = shard
        self.tokenizer = load_tokenizer(model_dir)
        self.chat = uses_chat_template(self.tokenizer, cfg.data.apply_chat_template)
        self.special = set(stop_token_ids(self.tokenizer))
        self.engine = make_engine(cfg, model_dir, self.tokenizer, device, visible_devices)
        # the reward sources live here, beside the engine (a reward model on its device), or,
        # with roles.reward, the model sources on the reward workers (``reward_workers``)
        self.scorer = make_reward(
            cfg.data,
            cfg.data.prompts,
            device,
            cfg.model.dtype,
            (self.engine, self.tokenizer),
            reward_workers,
            shard.dp_rank,
            needed=not teacher_alone(cfg),
        )
        self.eval_scorer = (
            make_reward(cfg.data, cfg.data.eval_prompts, device, cfg.model.dtype)
            if cfg.data.eval_prompts and not cfg.data.rewards  # sources do not depend on it
            else self.scorer
        )
        agent = cfg.data.agent
        # the environment's calls run here in tool processes of this engine, or, with
        # roles.sandbox, on the sandbox workers (``sandbox_workers``)
        remote = RemoteToolPool(sandbox_workers, shard.dp_rank) if sandbox_workers else None
        if agent is not None and agent.tools:
            self.chat = True
            self.agent = ChatTools(
                self.tokenizer,
                agent.tools,
                agent.tool_timeout_seconds,
                agent.max_tool_response_tokens,
                pool=remote,
            )
        elif agent is not None and agent.function is not None:
            self.agent = remote or ToolPool(load_agent(agent.function), agent.tool_timeout_seconds)

    def encode(self, prompts: list[Prompt]) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        """(prompt texts, ids, mask): each prompt rendered (chat template when on; a rendered
        template already holds its special tokens), tokenized and left-padded; a prompt longer
        than maxPromptLength keeps its end (and its BOS token, when there is one)."""
        tok = self.tokenizer
        tools = self.agent.declared if isinstance(self.agent, ChatTools) else None
        texts = [render_prompt(tok, p, self.chat, tools) for p in prompts]
        rows = [
            truncate_left(ids, self.cfg.data.max_prompt_length, tok.bos_token_id)
            for ids in tok(texts, add_special_tokens=not self.chat)["input_ids"]
        ]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, r in enumerate(rows):
            if r:
                ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
                mask[i, width - len(r) :] = True
        return texts, ids, mask

    def completions(self, response_ids: torch.Tensor) -> list[str]:
        """Decoded responses, each cut at its first special token."""
        out = []
        for row in response_ids.tolist():
            cut = next((i for i, t in enumerate(row) if t in self.special), len(row))
            out.append(self.tokenizer.decode(row[:cut]))
        return out

    def converse(
        self,
        prompts: list[str],
        ids: torch.Tensor,
        mask: torch.Tensor,
        labels: list[Any],
        temperature: float,
        top_p: float,
        seed: int,
        given: list[Prompt] | None = None,
    ) -> tuple[Generation, torch.Tensor, list[str], dict[str, float]]:
        """Multi-turn rollouts (``data.agent``): (the generation, its ``action_mask``, the model's
        last turn of each sample, tool-call metrics as sums). ``given``: the prompts as given
        (declared tools continue their chat messages)."""
        agent = self.cfg.data.agent
        assert agent is not None and self.agent is not None
        chat = self.agent if isinstance(self.agent, ChatTools) else None
        rows = [r[m].tolist() for r, m in zip(ids, mask, strict=True)]
        pool = self.agent.pool if isinstance(self.agent, ChatTools) else self.agent
        remote_before = pool.remote_calls if isinstance(pool, RemoteToolPool) else None
        convs = run_conversations(
            self.engine,
            self.tokenizer,
            rows,
            given if chat is not None and given is not None else prompts,
            labels,
            None if chat is not None else self.agent,
            max_turns=agent.max_turns,
            max_response_length=self.cfg.data.max_response_length,
            max_tool_response_tokens=agent.max_tool_response_tokens,
            tool_timeout=agent.tool_timeout_seconds,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            special=self.special,
            chat=chat,
        )
        t = conversation_tensors(convs, self.tokenizer.pad_token_id)
        gen = Generation(t["response_ids"], t["response_mask"], t["rollout_logprobs"], t["lengths"])
        metrics = {
            "agent/turns_sum": float(sum(len(c.turns) for c in convs)),
            "agent/env_calls_sum": float(sum(c.env_calls for c in convs)),
            "agent/tool_errors_sum": float(sum(c.tool_errors for c in convs)),
        }
        for name in sorted({k for c in convs for k in c.env_metrics}):  # the replies' metrics
            metrics[f"agent/env/{name}_sum"] = sum(c.env_metrics.get(name, 0.0) for c in convs)
        if remote_before is not None:  # roles.sandbox: calls the sandbox workers answered
            assert isinstance(pool, RemoteToolPool)
            metrics["agent/sandbox_calls_sum"] = float(pool.remote_calls - remote_before)
        return gen, t["action_mask"], [c.turns[-1] for c in convs], metrics

    def generate(
        self,
        examples: list[Example],
        first_sample: int,
        seed: int,
        version: int = 0,
        interrupt: Callable[[], tuple[int, Mapping[str, torch.Tensor]] | None] | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Sample ``samplesPerPrompt`` completions of each example and score them.

        Samples are numbered from ``first_sample``; group ids are the global prompt numbers.
        ``versions`` [b, T] (int32): the policy version (weight sync) that generated each token,
        ``version`` (the engine's weights at the start of this call). ``interrupt``: partial
        rollout (torch engine): asked between tokens for a weight update, ``(version, weights)``,
        that generation resumes with.
        """
        k = self.cfg.data.samples_per_prompt
        labels = [e.label for e in examples for _ in range(k)]
        given = [e.prompt for e in examples for _ in range(k)]
        prompts, ids, mask = self.encode(given)
        action_mask, agent_metrics = None, {}
        if self.agent is not None:
            gen, action_mask, completions, agent_metrics = self.converse(
                prompts,
                ids,
                mask,
                labels,
                self.cfg.data.temperature,
                self.cfg.data.top_p,
                seed,
                given,
            )
        else:
            gen = self.engine.generate(
                ids,
                mask,
                max_new_tokens=self.cfg.data.max_response_length,
                temperature=self.cfg.data.temperature,
                top_p=self.cfg.data.top_p,
                seed=seed,
                **({"version": version, "interrupt": interrupt} if interrupt is not None else {}),
            )
            completions = self.completions(gen.response_ids)
        total, parts = self.scorer.score(prompts, completions, labels)
        scores = torch.tensor(total, dtype=torch.float32)
        max_len = self.cfg.data.max_response_length
        truncated = truncated_rows(gen.response_ids, gen.lengths, max_len, sorted(self.special))
        reward = scores
        shaping = self.cfg.algorithm.overlong_shaping
        penalty = torch.zeros_like(scores)
        if shaping is not None:  # DAPO's soft overlong punishment, added before advantages
            penalty = overlong_penalty(
                gen.lengths, max_len, shaping.buffer_length, shaping.penalty_factor
            )
            scores = scores + penalty
        idx = torch.arange(first_sample, first_sample + len(prompts))
        batch = {
            "prompt_ids": ids,
            "prompt_mask": mask,
            "response_ids": gen.response_ids,
            "response_mask": gen.response_mask,
            "rollout_logprobs": gen.logprobs,
            "versions": (
                gen.versions
                if gen.versions is not None
                else torch.full(gen.response_ids.shape, int(version), dtype=torch.int32)
            ),
            "lengths": gen.lengths,
            "scores": scores,
            "truncated": truncated,
            "group_ids": idx // k,
            "sample_idx": idx,
        }
        if action_mask is not None:
            batch["action_mask"] = action_mask
        if gen.routed_experts is not None and gen.prompt_routed_experts is not None:
            batch["routed_experts"] = gen.routed_experts
            batch["prompt_routed_experts"] = gen.prompt_routed_experts
        elif self.cfg.algorithm.routing_replay == "rollout":
            raise RuntimeError(
                "algorithm.routingReplay: rollout, but the engine returned no routed experts"
            )
        metrics = {
            **agent_metrics,
            "reward_sum": float(reward.sum()),
            "overlong_penalty_sum": float(penalty.sum()),
            "truncated_sum": float(truncated.sum()),
            "length_sum": float(gen.lengths.sum()),
            "n": float(len(prompts)),
        }
        if self.scorer.report_sources:  # each source's unweighted sum: reward/<name>_mean
            metrics.update({f"reward_sum/{name}": float(sum(v)) for name, v in parts.items()})
            # judges' unparsed verdicts: reward/<name>_unparsed, a count over the step
            metrics.update(
                {f"reward_count/{k}": float(v) for k, v in self.scorer.last_counts.items()}
            )
        return batch, metrics

    def evaluate(self, examples: list[Example]) -> dict[str, float]:
        """One greedy completion of each held-out example, scored; returns sums."""
        prompts, ids, mask = self.encode([e.prompt for e in examples])
        labels = [e.label for e in examples]
        if self.agent is not None:
            given = [e.prompt for e in examples]
            _, _, completions, _ = self.converse(prompts, ids, mask, labels, 0.0, 1.0, 0, given)
        else:
            gen = self.engine.generate(
                ids,
                mask,
                max_new_tokens=self.cfg.data.max_response_length,
                temperature=0.0,
                top_p=1.0,
                seed=0,
            )
            completions = self.completions(gen.response_ids)
        scores = self.eval_scorer(prompts, completions, labels)
        return {"reward_sum": float(sum(scores)), "n": float(len(prompts))}


def cat_batches(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate rollout batches (prompt and response widths are padded to the widest)."""
    if len(parts) == 1:
        return parts[0]
    out: dict[str, torch.Tensor] = {}
    pw = max(p["prompt_ids"].shape[1] for p in parts)
    rw = max(p["response_ids"].shape[1] for p in parts)
    pad = {"prompt_ids": 0, "prompt_mask": False, "prompt_routed_experts": -1}
    for key in parts[0]:
        tensors = []
        for p in parts:
            t = p[key]
            if key in pad and t.shape[1] < pw:  # left pad
                fill = torch.full((t.shape[0], pw - t.shape[1], *t.shape[2:]), pad[key])
                t = torch.cat([fill.to(t.dtype), t], 1)
            elif key == "routed_experts" and t.shape[1] < rw:  # -1: nothing recorded
                fill = torch.full((t.shape[0], rw - t.shape[1], *t.shape[2:]), -1, dtype=t.dtype)
                t = torch.cat([t, fill], 1)
            elif t.dim() == 2 and key not in pad and t.shape[1] < rw:
                fill = torch.zeros((t.shape[0], rw - t.shape[1]), dtype=t.dtype)
                t = torch.cat([t, fill], 1)
            tensors.append(t)
        out[key] = torch.cat(tensors, 0)
    return out


def slice_batch(batch: dict[str, torch.Tensor], lo: int, hi: int) -> dict[str, torch.Tensor]:
    """Rows ``lo:hi`` of every tensor of a batch."""
    return {k: v[lo:hi] for k, v in batch.items()}


def select_groups(
    batches: list[dict[str, torch.Tensor]],
    picks: list[tuple[int, int, bool]],
    first_sample: int,
    group_size: int,
) -> dict[str, torch.Tensor]:
    """Dynamic sampling: the rows of the picked groups, ``(batch index, group id, in the loss)``
    each, in the order picked, renumbered as samples ``first_sample...`` (groups
    ``first_sample // group_size...``), with ``in_loss`` [b] bool per row."""
    parts = []
    for b, gid, in_loss in picks:
        batch = batches[b]
        rows = (batch["group_ids"] == gid).nonzero().squeeze(1)
        if len(rows) != group_size:
            raise ValueError(f"select_groups: group {gid} has {len(rows)} rows, not {group_size}")
        part = {key: v[rows] for key, v in batch.items()}
        part["in_loss"] = torch.full((len(rows),), bool(in_loss), dtype=torch.bool)
        parts.append(part)
    out = cat_batches(parts)
    idx = torch.arange(first_sample, first_sample + out["response_ids"].shape[0])
    out["sample_idx"] = idx
    out["group_ids"] = idx // group_size
    return out
