"""Per-GPU memory plan of a PPOJob: what each worker process holds at its peak, by part.

Pure arithmetic in the API package: imports neither torch nor Ray, so ``ppojob validate``, the
operator (before any pod starts) and the trainer (at start) judge a job by the same plan. The plan
is arithmetic over the model's shape (from a local ``config.json``, a built-in, or
:data:`KNOWN_SHAPES`) and the spec:

``weights``      float32 master weights (torch backend), per worker: / dp under ``sharding: fsdp``
                 (with LoRA: the frozen base plus the adapters; grads and optimizer: adapters only)
``grads``        float32 gradients, sharded alike (under FSDP with several micro-batches per
                 update also the unsharded float32 gradients they accumulate into, per update)
``optimizer``    AdamW's two float32 moments, sharded alike
``compute``      working copies in the compute dtype: autocast's bf16 weight casts (a whole model,
                 replicated) or, under FSDP, the gathered root and two gathered blocks (prefetch)
``activations``  what backward keeps for one micro-batch of ``microBatchSize`` x (maxPromptLength
                 + maxResponseLength) tokens, or ``maxTokensPerMicroBatch`` when set (all
                 blocks, or under gradientCheckpointing one hidden state per block plus one
                 block's full set)
``logits``       one chunk of ``LOGITS_CHUNK_TOKENS`` vocabulary logits and their float32 copies
``reference``    the frozen reference in the compute dtype (0 when offloaded or with LoRA, whose
                 reference is the base model with the adapters off; / dp under FSDP)
``teacher``      ``algorithm.distillation``'s teacher on every actor worker: its weights in its
                 dtype (whole, never sharded; its shape from its config.json or a built-in, unknown
                 otherwise), and while it scores, one micro-batch's forward (one block's
                 intermediates, no graph kept) and one chunk of its vocabulary logits
``rollout``      a colocated engine: its weights and KV cache (torch), or its memory fraction
                 (sglang without offload; with LoRA a note gives its LoRA buffers' share of it;
                 with offload and LoRA its LoRA buffers stay while it is released, and a note
                 gives the host memory of its base weights' copy)
``reward model`` each ``data.rewards`` model source on the engine's GPU (``device: auto``), or on
                 each reward worker's GPU when ``roles.reward`` is set (a ``reward`` process): its
                 weights in its dtype (embedding, blocks and a one-output head; its shape read
                 from its config.json, unknown when that is not readable here) and, while it
                 scores, one batch's activations (batchSize x maxLength tokens, one block)
``judge``        each generative ``judge`` source of ``data.rewards``, on the rollout engine's GPU
                 (a judge runs on the engines, roles.reward or not): a judge model of its own
                 (not ``policy``) holds its weights in model.dtype (its shape from its
                 config.json or a built-in, unknown otherwise); while it judges, the torch
                 engine's KV cache and sampling logits for the engine's samples x (its
                 maxPromptLength + maxNewTokens) tokens, one phase per judge (``policy`` on
                 sglang: inside its memory fraction, nothing more)

A process's peak is its persistent parts plus its largest phase (actor update, critic update,
generation).

A colocated sglang engine with ``offload`` also has a **wake** (:func:`wake_steps`): per GPU,
what is reserved after each step of the host's order (``workers/host.py``: empty cache ->
resume weights -> weight sync -> empty cache -> resume KV cache and CUDA graphs). Training's
persistent parts stay; PyTorch's caching allocator keeps the update's freed blocks reserved
until ``empty_cache``, which returns only whole free segments (a segment with one live block
stays: :data:`ALLOCATOR_KEPT` of the update's transient bytes is assumed kept); the sync stages
one bucket (``weightSyncBucketMb``, or the largest tensor when larger) on the GPU; the engine's
weights are ``model.dtype`` / its tensor size; and its KV cache is what SGLang sized at start:
its static memory (weights + KV) is ``gpuMemoryFraction`` x the memory free when it started
(``kv_cache_configurator._profile_available_bytes``: free memory after loading the weights
minus ``pre_model_load_memory x (1 - mem_fraction_static)``), and the actor's weights (and
reference) were loaded before the engine started. Each process on a GPU (the worker, SGLang's
scheduler) holds a CUDA context (:data:`CUDA_CONTEXT_BYTES`). SGLang's activations and CUDA
graphs during generation come from outside its fraction and are not counted.

The engine's ``gpuMemoryFraction``, when unset, is the plan's (:func:`plan_job` sets
``engine_fraction`` with ``engine_fraction_source``): colocated with ``offload``, the largest
fraction whose wake after step 1 fits, less :data:`SGLANG_RUNTIME_BYTES` of headroom for what
SGLang takes outside its fraction, rounded down to a hundredth and at most
:data:`DEFAULT_ENGINE_FRACTION`; colocated without ``offload``, what the actor's peak leaves, less
the same headroom; on its own GPUs :data:`DEFAULT_ENGINE_FRACTION`. :func:`plan_problems` are the
plan's verdicts (``ppojob validate``, the operator and the trainer refuse a job with any): a
process over its GPU, a wake step over it, an engine whose static memory holds its weights but
not one sequence's KV cache.

The Megatron figures assume its usual layout (bf16 parameters, float32 gradients and a
distributed optimizer over the data-parallel group, activations split over tensor parallelism)
and are marked as such.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ppojob_api.problems import Problem
from ppojob_api.quantity import quantity_value

GiB = 1024**3
LOGITS_CHUNK_TOKENS = 1024  # as backends.torch_backend.memory.LOGITS_CHUNK_TOKENS
DEFAULT_GPU_GIB = 80.0
ALLOCATOR_KEPT = 0.10
"""Share of an update's freed (transient) bytes assumed still reserved after ``empty_cache``
(fragmentation: the caching allocator releases only segments with no live block)."""
CUDA_CONTEXT_BYTES = 0.5 * GiB
"""A CUDA context and its kernels, per process on a GPU (an assumption, typical of H100s)."""
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_ENGINE_FRACTION = 0.85
"""An sglang engine's ``gpuMemoryFraction`` when unset on its own GPUs, and the most an unset one
beside the actor is given."""
SGLANG_RUNTIME_BYTES = 2.0 * GiB
"""Headroom an unset colocated fraction leaves for what SGLang allocates outside it while it
generates (activations, CUDA graphs, sampling buffers): an assumption, not a measurement."""


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer (Llama/Qwen/Mistral family), dense or mixture-of-experts
    (Qwen3-MoE, Mixtral): ``moe_layers`` of its ``layers`` replace the dense MLP of
    ``intermediate`` with a router over ``experts`` experts (each a gated MLP of
    ``expert_intermediate``), ``experts_per_token`` of which each token runs through."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    head_dim: int = 0
    """Width of an attention head; 0: hidden / heads (Qwen3-MoE's may differ)."""
    experts: int = 0
    """Routed experts per MoE layer; 0: a dense model."""
    experts_per_token: int = 0
    expert_intermediate: int = 0
    moe_layers: int = 0
    """Blocks with experts; the other ``layers - moe_layers`` have a dense MLP of
    ``intermediate`` (Qwen3-MoE's ``mlp_only_layers`` and ``decoder_sparse_step``)."""
    qk_norm: bool = False
    """Qwen3's RMS norms of each head's queries and keys (``head_dim`` weights each)."""

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.head_dim or self.hidden // self.heads)

    @property
    def q_dim(self) -> int:
        return self.hidden if not self.head_dim else self.heads * self.head_dim

    @property
    def attention_params(self) -> int:
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        norms = 2 * (self.head_dim or self.hidden // self.heads) if self.qk_norm else 0
        return 2 * h * q + 2 * h * kv + ((q + 2 * kv) if self.qkv_bias else 0) + norms

    @property
    def dense_block_params(self) -> int:
        return self.attention_params + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def expert_block_params(self) -> int:
        """One expert's gate, up and down projections."""
        return 3 * self.hidden * self.expert_intermediate

    @property
    def moe_block_params(self) -> int:
        """A MoE block: attention, the router (experts x hidden), every expert, two norms."""
        h, e = self.hidden, self.experts
        return self.attention_params + e * h + e * self.expert_block_params + 2 * h

    @property
    def block_params(self) -> int:
        """The largest block (what FSDP gathers at once)."""
        if not self.moe_layers:
            return self.dense_block_params
        dense = self.dense_block_params if self.moe_layers < self.layers else 0
        return max(self.moe_block_params, dense)

    @property
    def expert_params(self) -> int:
        """The experts of every MoE block (what expert parallelism splits)."""
        return self.moe_layers * self.experts * self.expert_block_params

    @property
    def active_params(self) -> int:
        """The parameters a token runs through (top-k experts of each MoE block)."""
        return self.params - self.moe_layers * (
            (self.experts - self.experts_per_token) * self.expert_block_params
        )

    @property
    def root_params(self) -> int:
        """Embedding, final norm and (untied) LM head: what FSDP's root unit holds."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        dense = self.layers - self.moe_layers
        blocks = dense * self.dense_block_params + self.moe_layers * self.moe_block_params
        return blocks + self.root_params

    def forward_width(self, moe: bool) -> int:
        """Values a block's forward makes per token in the compute dtype: the two norm
        outputs, q/k/v, the attention output and the MLP's intermediates (a MoE block: its
        top-k experts' intermediates, the token's k dispatched copies and its router logits)."""
        h = self.hidden
        if moe:
            k = self.experts_per_token
            mlp = 3 * k * self.expert_intermediate + k * h + self.experts
        else:
            mlp = 3 * self.intermediate
        return 2 * h + 2 * self.q_dim + 2 * self.kv_dim + mlp

    @property
    def widest_forward(self) -> int:
        """:meth:`forward_width` of the widest block."""
        dense = self.forward_width(False) if self.moe_layers < self.layers else 0
        return max(self.forward_width(True) if self.moe_layers else 0, dense)

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """Parameters of LoRA adapters of ``rank`` on the named linear layers of every block
        (``rank x (in + out)`` each; ``all-linear``: all seven; a MoE block's experts are 3-D
        parameters, no linear layers: its MLP names have none)."""
        h, kv, i, q = self.hidden, self.kv_dim, self.intermediate, self.q_dim
        attention = {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
        }
        mlp = {
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        names = [*attention, *mlp] if "all-linear" in targets else targets
        dense = self.layers - self.moe_layers
        return sum(
            (self.layers if n in attention else dense) * rank * sum({**attention, **mlp}[n])
            for n in names
            if n in attention or n in mlp
        )

    def sglang_lora_pool(self, rank: int, targets: list[str], dtype_bytes: int, tp: int) -> int:
        """Bytes of SGLang's LoRA buffers on one of an engine's ``tp`` GPUs for one adapter slot
        (``max_loras_per_batch: 1``) of ``rank`` (``lora/mem_pool.py`` ``init_buffers``): per
        block and stacked module (q/k/v as ``qkv_proj``, gate/up as ``gate_up_proj``) A
        ``[c x rank, in]`` and B ``[out, rank]``, sharded like the base layer (the input of
        o/down, the output of qkv/gate_up); ``all-linear`` (SGLang's ``all``) also has the
        embedding's and the LM head's, ``rank x (vocab + hidden)`` each."""
        h, kv, i = self.hidden, self.kv_dim, self.intermediate
        # stacked module -> (HF names, c, in, out, row parallel)
        stacked = {
            "qkv_proj": (("q_proj", "k_proj", "v_proj"), 3, h, h + 2 * kv, False),
            "o_proj": (("o_proj",), 1, h, h, True),
            "gate_up_proj": (("gate_proj", "up_proj"), 2, h, 2 * i, False),
            "down_proj": (("down_proj",), 1, i, h, True),
        }
        every = "all-linear" in targets
        total = 0
        for names, c, d_in, d_out, row in stacked.values():
            if every or any(n in targets for n in names):
                d_in, d_out = (d_in // tp, d_out) if row else (d_in, d_out // tp)
                total += self.layers * rank * (c * d_in + d_out)
        if every:
            total += 2 * rank * (self.vocab + self.hidden)
        return total * dtype_bytes


def _qwen(h: int, n: int, heads: int, kv: int, i: int, v: int, tied: bool) -> Shape:
    return Shape(h, n, heads, kv, i, v, tied=tied, qkv_bias=True)


KNOWN_SHAPES: dict[str, Shape] = {
    "Qwen/Qwen2.5-0.5B": _qwen(896, 24, 14, 2, 4864, 151936, True),
    "Qwen/Qwen2.5-1.5B": _qwen(1536, 28, 12, 2, 8960, 151936, True),
    "Qwen/Qwen2.5-3B": _qwen(2048, 36, 16, 2, 11008, 151936, True),
    "Qwen/Qwen2.5-7B": _qwen(3584, 28, 28, 4, 18944, 152064, False),
    "meta-llama/Llama-3.2-1B": Shape(2048, 16, 32, 8, 8192, 128256, tied=True),
    "meta-llama/Llama-3.1-8B": Shape(4096, 32, 32, 8, 14336, 128256),
    # Qwen3-MoE: 128 experts of intermediate 768, top-8, in all 48 blocks (30.5B, 3.3B active)
    "Qwen/Qwen3-30B-A3B": Shape(
        2048,
        48,
        32,
        4,
        6144,
        151936,
        head_dim=128,
        experts=128,
        experts_per_token=8,
        expert_intermediate=768,
        moe_layers=48,
        qk_norm=True,
    ),
    "builtin:tiny-llama": Shape(64, 2, 4, 4, 256, 14),
    "builtin:tiny-qwen2": Shape(64, 2, 4, 4, 256, 14, qkv_bias=True),
    "builtin:small-llama": Shape(128, 5, 4, 4, 512, 14),
    "builtin:count-up-teacher": Shape(64, 2, 4, 4, 256, 14),
    # models.BUILTIN_MODELS' MoE ones: 8 experts of intermediate 64, top-2, in both blocks
    "builtin:tiny-qwen3-moe": Shape(
        64,
        2,
        4,
        4,
        64,
        14,
        head_dim=16,
        experts=8,
        experts_per_token=2,
        expert_intermediate=64,
        moe_layers=2,
        qk_norm=True,
    ),
    "builtin:tiny-mixtral": Shape(
        64, 2, 4, 4, 64, 14, experts=8, experts_per_token=2, expert_intermediate=64, moe_layers=2
    ),
}
"""Shapes of common models by hub id (``-Instruct`` variants share them)."""


def shape_from_config(cfg: dict[str, Any]) -> Shape:
    """The shape of a Hugging Face ``config.json`` (a MoE one: :data:`MOE_MODEL_TYPES` only,
    else ValueError)."""
    heads = int(cfg["num_attention_heads"])
    dense = Shape(
        hidden=int(cfg["hidden_size"]),
        layers=int(cfg["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        intermediate=int(cfg["intermediate_size"]),
        vocab=int(cfg["vocab_size"]),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
    )
    if not any(cfg.get(k) for k in MOE_KEYS):
        return dense
    return _moe_shape(cfg, dense)


MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""Config keys of a mixture-of-experts model."""
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
"""The MoE architectures :class:`Shape` counts; another MoE config has no plan here (its shared
experts or dense layers are not counted: no promise rather than a wrong one)."""


def _moe_shape(cfg: dict[str, Any], dense: Shape) -> Shape:
    """A Qwen3-MoE or Mixtral ``config.json``'s shape (transformers' ``Qwen3MoeDecoderLayer``:
    block i has experts unless i is in ``mlp_only_layers`` or (i + 1) is no multiple of
    ``decoder_sparse_step``; Mixtral: every block, experts of ``intermediate_size``)."""
    kind = cfg.get("model_type")
    if kind not in MOE_MODEL_TYPES:
        raise ValueError(f"a mixture-of-experts model of type {kind!r}")
    head_dim = int(cfg.get("head_dim") or 0)  # 0: hidden / heads
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts too
    experts = int(next(cfg[k] for k in MOE_KEYS if cfg.get(k)))
    if kind == "mixtral":
        inner, moe_layers = dense.intermediate, dense.layers
    else:
        inner = int(cfg["moe_intermediate_size"])
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense_only = {int(i) for i in cfg.get("mlp_only_layers") or []}
        moe_layers = sum(
            1 for i in range(dense.layers) if i not in dense_only and (i + 1) % step == 0
        )
    return replace(
        dense,
        head_dim=head_dim,
        experts=experts,
        experts_per_token=int(cfg["num_experts_per_tok"]),
        expert_intermediate=inner,
        moe_layers=moe_layers,
        qk_norm=kind == "qwen3_moe",
    )


def resolve_shape(path: str) -> Shape | None:
    """The shape of ``model.path``: a local directory's config.json, a built-in, a known hub id
    (an ``-Instruct`` suffix ignored); None when unknown."""
    local = Path(path) / "config.json"
    try:
        if local.is_file():
            return shape_from_config(json.loads(local.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # not a Hugging Face config (the model loader says why), or another MoE
    return KNOWN_SHAPES.get(path) or KNOWN_SHAPES.get(re.sub(r"-Instruct$", "", path))


@dataclass(frozen=True)
class TrainedModel:
    """One trained model (actor or critic) on one worker and how it is run."""

    shape: Shape
    dtype: str = "bfloat16"
    backend: str = "torch"
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallelism (megatron): each rank holds experts / ep of each MoE block
    sharding: str = "none"
    micro_batch: int = 1
    seq_len: int = 1024
    gradient_checkpointing: bool = False
    lm_head: bool = True  # the actor projects to the vocabulary; the critic has a value head
    accumulation: int = 1  # micro-batches per worker and optimizer update
    tokens_per_micro_batch: int | None = None  # maxTokensPerMicroBatch (else micro x seq)
    lora_params: int = 0  # trainable adapter parameters (LoRA); 0: full fine-tuning

    @property
    def compute_bytes(self) -> int:
        return _BYTES[self.dtype]

    @property
    def fsdp(self) -> bool:
        return self.backend == "torch" and self.sharding == "fsdp"  # one worker too

    @property
    def params(self) -> int:
        """The actor's parameters; the critic has a value head instead of the LM head."""
        sh = self.shape
        if self.lm_head or sh.tied:
            return sh.params if self.lm_head else sh.params + sh.hidden + 1
        return sh.params - sh.vocab * sh.hidden + sh.hidden + 1

    def held(self, params: int) -> float:
        """Of a model of ``params`` parameters (this shape's experts among them), those one
        megatron rank holds: its tensor and pipeline share, of the experts also its
        expert-parallel share (the experts keep the tensor parallelism)."""
        experts = self.shape.expert_params
        return ((params - experts) + experts / self.ep) / (self.tp * self.pp)

    def states(self) -> dict[str, float]:
        """Persistent bytes: weights, gradients, optimizer state."""
        p = self.params
        if self.backend == "megatron":  # bf16 params, fp32 grads, distributed fp32 optimizer
            mp = self.tp * self.pp
            # the distributed optimizer shards dense states over dp and the experts' over the
            # expert-data-parallel group (dp / ep ranks, each holding experts / ep): p / (mp x dp)
            return {
                "weights": 2 * self.held(p),
                "grads": 4 * self.held(p),
                "optimizer": 12 * p / (mp * self.dp),
            }
        s = self.dp if self.fsdp else 1
        if self.lora_params:  # a frozen float32 base; only the adapters have grads and moments
            a = self.lora_params
            return {"weights": 4 * (p + a), "grads": 4 * a, "optimizer": 8 * a}
        return {"weights": 4 * p / s, "grads": 4 * p / s, "optimizer": 8 * p / s}

    def update_transient(self) -> dict[str, float]:
        """Bytes that exist only during an update: working copies, activations, logits."""
        sh, c = self.shape, self.compute_bytes
        out: dict[str, float] = {}
        if self.backend == "torch":
            if self.fsdp and self.accumulation > 1:
                # FSDP2 with set_requires_gradient_sync(False) accumulates the micro-batches'
                # gradients UNSHARDED, float32 like the masters, until the last reduce-scatter
                out["unsharded grads (accumulation)"] = 4.0 * self.params
            if self.fsdp:
                out["compute"] = c * (sh.root_params + 2 * sh.block_params)
            elif c < 4:
                out["compute"] = c * self.params  # autocast's cached weight casts
            else:
                out["compute"] = 0.0
        # residual stream: float32 under autocast (fp32 masters), compute dtype under FSDP's policy
        stream = c if (self.fsdp or self.backend == "megatron") else 4
        tokens = self.tokens_per_micro_batch or self.micro_batch * self.seq_len
        # kept per token and block: the two residual inputs (stream dtype) and, in the compute
        # dtype, the norm outputs, q/k/v, the attention output and the MLP's intermediates (a
        # MoE block: its top-k experts'; Shape.forward_width)
        # (coefficients checked against measured peaks: bench/memory.py --measure)
        residual = stream * 2 * sh.hidden
        if self.gradient_checkpointing:
            acts = tokens * (sh.layers * stream * sh.hidden + residual + c * sh.widest_forward)
        else:
            dense, moe = sh.layers - sh.moe_layers, sh.moe_layers
            acts = tokens * (
                dense * (residual + c * sh.forward_width(False))
                + moe * (residual + c * sh.forward_width(True))
            )
        out["activations"] = acts / self.tp
        if self.lm_head:
            chunk = min(tokens, LOGITS_CHUNK_TOKENS)
            # float32 logits / temperature (kept for backward), the softmax of the entropy and
            # its product (or, in backward, the gradient), plus the compute-dtype logits
            out["logits"] = chunk * sh.vocab * (3 * 4 + (c if c < 4 else 0)) / self.tp
        return out


@dataclass
class ProcessPlan:
    """The peak of one worker process (one GPU) and its parts."""

    name: str
    persistent: dict[str, float] = field(default_factory=dict)
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    wake: dict[str, dict[str, float]] = field(default_factory=dict)
    """A colocated engine's wake, in order: step -> the parts reserved on the GPU after it."""
    wake_max_fraction: float | None = None
    """The largest gpuMemoryFraction whose wake fits the GPU (None: no wake modelled)."""
    engine_fraction: float | None = None
    """The gpuMemoryFraction of the sglang engine on this GPU (None: none here)."""
    engine_fraction_source: str | None = None
    """Where it comes from: ``spec`` (written), ``auto`` (sized by the plan) or ``default``."""
    engine_max_fraction: float | None = None
    """The largest fraction that fits beside the actor (colocated engines only)."""
    engine_kv: float | None = None
    """Bytes its static memory leaves for its KV cache after its weights and LoRA buffers."""
    engine_min_kv: float = 0.0
    """Bytes of one rollout sequence's KV cache: the least an engine can generate with."""

    def wake_over(self, gpu_bytes: float) -> tuple[str, float, float] | None:
        """The first wake step that does not fit ``gpu_bytes``: (step, its bytes, bytes over)."""
        for step, parts in self.wake.items():
            total = sum(parts.values())
            if total > gpu_bytes:
                return step, total, total - gpu_bytes
        return None

    @property
    def peak_phase(self) -> str | None:
        return max(self.phases, key=lambda k: sum(self.phases[k].values()), default=None)

    @property
    def peak(self) -> float:
        top = self.peak_phase
        return sum(self.persistent.values()) + (sum(self.phases[top].values()) if top else 0.0)

    def rows(self) -> list[tuple[str, float]]:
        """(part, bytes) at the peak, the persistent parts then the peak phase's."""
        out = [(k, v) for k, v in self.persistent.items()]
        top = self.peak_phase
        if top:
            out += [(f"{k} ({top})", v) for k, v in self.phases[top].items()]
        return out


def _model(half: Any, role: str, shape: Shape) -> TrainedModel:
    roles, data = half.roles, half.data
    spec = roles.actor if role == "actor" else roles.effective_critic(True)
    if role == "actor":
        settings = half.training
    else:
        from ppojob_api.overrides import apply_critic_overrides

        settings = apply_critic_overrides(half.training, spec.overrides)
    workers = roles.workers_of(role)
    mp = spec.parallelism.model_parallel
    dp = max(workers // mp, 1)
    per_worker = max((settings.mini_batch_size or data.samples_per_step) // dp, 1)
    micro = settings.micro_batch_size or per_worker
    lora = half.model.lora if role == "actor" and spec.backend == "torch" else None
    return TrainedModel(
        shape=shape,
        dtype=half.model.dtype,
        backend=spec.backend,
        dp=dp,
        tp=spec.parallelism.tensor,
        pp=spec.parallelism.pipeline,
        ep=spec.parallelism.expert if spec.backend == "megatron" else 1,
        sharding=settings.sharding,
        micro_batch=micro,
        seq_len=data.max_prompt_length + data.max_response_length,
        gradient_checkpointing=settings.gradient_checkpointing,
        lm_head=role == "actor",
        accumulation=-(-per_worker // micro),
        tokens_per_micro_batch=settings.max_tokens_per_micro_batch,
        lora_params=(
            shape.lora_params(lora.rank, lora.target_modules)
            + shape.vocab * shape.hidden * len(set(lora.modules_to_save))  # trained in full
            if lora
            else 0
        ),
    )


def _rollout_parts(
    half: Any, shape: Shape, gpu_bytes: float, fraction: float
) -> tuple[dict, dict, list[str]]:
    """(persistent, generation-phase) bytes of one rollout engine GPU (``fraction``: an sglang
    engine's gpuMemoryFraction)."""
    roles, data = half.roles, half.data
    ro = roles.rollout
    c = _BYTES[half.model.dtype]
    if ro.backend == "sglang":
        frac = fraction * gpu_bytes
        notes = []
        offload = ro.colocate_with_actor and ro.offload
        pool = _sglang_lora_pool(half, shape)
        if half.model.lora is not None:  # allocated before the KV cache is sized
            notes.append(
                f"the sglang engine's LoRA buffers take {pool / 2**20:.1f} MiB of its memory "
                "fraction (from its KV cache)"
                + ("; they stay on the GPU while it is released" if offload else "")
            )
        if offload:
            persistent = {SGLANG_LORA_KEPT: pool} if pool else {}
            if half.model.lora is not None:
                host = c * shape.params / ro.parallelism.tensor
                notes.append(
                    "the released sglang engine keeps a host copy of its base weights (an "
                    f"adapter sync sends none): {host / GiB:.1f} GiB of host memory per GPU"
                )
            return persistent, {"rollout (sglang, released while training)": frac - pool}, notes
        return {"rollout (sglang memory fraction)": frac}, {}, notes
    engines = roles.workers_of("rollout")
    rows = -(-data.rollout_batch_size // engines) * data.samples_per_prompt
    seq = data.max_prompt_length + data.max_response_length
    kv = rows * seq * shape.layers * 2 * shape.kv_dim * c
    logits = rows * shape.vocab * 4 * 3
    persistent = {"rollout weights": c * shape.params}
    generation = {"rollout KV cache": kv, "sampling": logits}
    return persistent, generation, []


SGLANG_LORA_KEPT = "sglang LoRA buffers (kept while released)"
"""A released colocated sglang engine's LoRA buffers: SGLang allocates its LoRA memory pool
outside its memory saver's regions (``model_runner.init_lora_manager``, after the weights are
loaded), so ``release_memory_occupation`` leaves it on the GPU through training."""


def _sglang_lora_pool(half: Any, shape: Shape) -> float:
    """Bytes of an sglang engine's LoRA buffers on one of its GPUs (0 without LoRA)."""
    lora, ro = half.model.lora, half.roles.rollout
    if lora is None or ro.backend != "sglang":
        return 0.0
    c = _BYTES[half.model.dtype]
    return float(shape.sglang_lora_pool(lora.rank, lora.target_modules, c, ro.parallelism.tensor))


def _reward_model_parts(half: Any) -> tuple[dict[str, float], dict[str, float], list[str]]:
    """(persistent, scoring-phase) bytes of the reward models an engine's GPU holds, and notes
    on those whose shape is unknown."""
    persistent: dict[str, float] = {}
    scoring: dict[str, float] = {}
    notes: list[str] = []
    for i, src in enumerate(half.data.rewards):
        rm = src.model
        if rm is None or rm.device == "cpu":
            continue
        label = f"reward model {src.default_name()}"
        rm_shape = resolve_shape(rm.path)
        if rm_shape is None:
            notes.append(f"data.rewards[{i}].model: shape unknown here (no readable config.json)")
            continue
        c = _BYTES[rm.dtype or half.model.dtype]
        # a one-output score head in place of the LM head
        params = rm_shape.params - (0 if rm_shape.tied else rm_shape.vocab * rm_shape.hidden)
        persistent[f"{label} weights"] = c * (params + rm_shape.hidden)
        tokens = rm.batch_size * rm.max_length
        scoring[f"{label} scoring"] = tokens * c * rm_shape.widest_forward
    return persistent, scoring, notes


def _add_teacher(half: Any, actor: TrainedModel, plan: ProcessPlan) -> None:
    """The distillation teacher on an actor worker's GPU: its weights (persistent) and its
    scoring forward (a phase), or a note when its shape is unknown here."""
    d = half.algorithm.distillation
    if d is None:
        return
    t_shape = resolve_shape(d.teacher)
    if t_shape is None:
        plan.notes.append("algorithm.distillation.teacher: shape unknown here")
        return
    c = _BYTES[d.dtype or half.model.dtype]
    plan.persistent["teacher"] = c * t_shape.params
    tokens = actor.tokens_per_micro_batch or actor.micro_batch * actor.seq_len
    block = tokens * c * t_shape.widest_forward
    logits = min(tokens, LOGITS_CHUNK_TOKENS) * t_shape.vocab * 3 * 4
    plan.phases["teacher scoring"] = {
        "teacher forward (one block)": block,
        "teacher logits": logits,
    }


def _judge_parts(
    half: Any, shape: Shape
) -> tuple[dict[str, float], dict[str, dict[str, float]], list[str]]:
    """(persistent bytes, one phase per judge, notes) of the generative judges an engine's GPU
    holds and runs (``shape``: the policy's, which a ``policy`` judge is)."""
    roles, data = half.roles, half.data
    c = _BYTES[half.model.dtype]
    rows = -(-data.rollout_batch_size // roles.workers_of("rollout")) * data.samples_per_prompt
    persistent: dict[str, float] = {}
    phases: dict[str, dict[str, float]] = {}
    notes: list[str] = []
    for i, src in enumerate(data.rewards):
        judge = src.judge
        if judge is None:
            continue
        label = f"judge {src.default_name()}"
        if judge.model == "policy":
            if roles.rollout.backend == "sglang":
                continue  # its verdicts use the engine's own KV pool (its memory fraction)
            j_shape = shape
        else:
            found = resolve_shape(judge.model)
            if found is None:
                notes.append(f"data.rewards[{i}].judge.model: shape unknown here")
                continue
            j_shape = found
            persistent[f"{label} weights"] = c * j_shape.params
        seq = judge.max_prompt_length + judge.max_new_tokens
        phases[f"{label} judging"] = {
            f"{label} KV cache": rows * seq * j_shape.layers * 2 * j_shape.kv_dim * c,
            f"{label} sampling": rows * j_shape.vocab * 4 * 3,
        }
    return persistent, phases, notes


def plan_job(
    half: Any, gpu_gib: float = DEFAULT_GPU_GIB, shape: Shape | None = None
) -> list[ProcessPlan]:
    """Per-process plans of a spec's training half (a ``TrainingHalf``); empty when the model's
    shape is unknown."""
    shape = shape or resolve_shape(half.model.path)
    if shape is None:
        return []
    roles, algo = half.roles, half.algorithm
    critic_spec = roles.effective_critic(algo.needs_critic)
    critic_shape = shape
    if half.model.critic_path:
        critic_shape = resolve_shape(half.model.critic_path) or shape
    gpu_bytes = gpu_gib * GiB
    plans: list[ProcessPlan] = []

    actor = _model(half, "actor", shape)
    p = ProcessPlan("actor")
    p.persistent.update({f"actor {k}": v for k, v in actor.states().items()})
    p.phases["actor update"] = {f"actor {k}": v for k, v in actor.update_transient().items()}
    # with LoRA the reference is the base model with the adapters off: no second copy
    if algo.kl.coefficient > 0 and not half.training.offload_reference and not actor.lora_params:
        p.persistent["reference"] = (
            actor.compute_bytes * actor.held(shape.params) / (actor.dp if actor.fsdp else 1)
        )
    if actor.backend == "megatron":
        p.notes.append("megatron: assumed bf16 params, fp32 grads, distributed optimizer")
    if shape.experts:
        p.notes.append(_experts_note(shape, actor))
    _add_teacher(half, actor, p)
    critic = None
    if critic_spec is not None:
        critic = _model(half, "critic", critic_shape)
        c_states = {f"critic {k}": v for k, v in critic.states().items()}
        c_phase = {f"critic {k}": v for k, v in critic.update_transient().items()}
        if critic_spec.colocate_with_actor:
            p.persistent.update(c_states)
            p.phases["critic update"] = c_phase
        else:
            cp = ProcessPlan("critic", persistent=c_states, phases={"critic update": c_phase})
            if critic.backend == "megatron":
                cp.notes.append("megatron: assumed bf16 params, fp32 grads, distributed optimizer")
            if critic_shape.experts:
                cp.notes.append(_experts_note(critic_shape, critic))
            plans.append(cp)
    ro = roles.rollout
    colocated_sglang = ro.colocate_with_actor and ro.backend == "sglang"
    fraction = ro.gpu_memory_fraction
    source = "spec" if fraction is not None else ("auto" if colocated_sglang else "default")
    if fraction is None:
        fraction = 0.0 if colocated_sglang else DEFAULT_ENGINE_FRACTION  # auto: sized below
    persistent, generation, notes = _rollout_parts(half, shape, gpu_bytes, fraction)
    rm_persistent, rm_scoring, rm_notes = _reward_model_parts(half)
    if roles.reward is not None:  # the reward workers hold them, not the engines
        if roles.reward.resources.gpus > 0 and (rm_persistent or rm_notes):
            phases = {"reward scoring": rm_scoring} if rm_scoring else {}
            plans.append(ProcessPlan("reward", dict(rm_persistent), phases, list(rm_notes)))
        rm_persistent, rm_scoring, rm_notes = {}, {}, []
    persistent.update(rm_persistent)
    notes += rm_notes
    judge_persistent, judging, judge_notes = _judge_parts(half, shape)
    persistent.update(judge_persistent)
    notes += judge_notes
    if roles.rollout.colocate_with_actor:
        p.persistent.update(persistent)
        if generation:
            p.phases["generation"] = generation
        if rm_scoring:
            p.phases["reward scoring"] = rm_scoring
        p.phases.update(judging)
        p.notes += notes
    else:
        phases = {"generation": generation} if generation else {}
        if rm_scoring:
            phases["reward scoring"] = rm_scoring
        phases.update(judging)
        plans.append(ProcessPlan("rollout", persistent=persistent, phases=phases, notes=notes))
    if ro.backend == "sglang":
        host = p if ro.colocate_with_actor else plans[-1]
        host.engine_fraction, host.engine_fraction_source = fraction, source
        _size_engine(half, shape, host, gpu_bytes)
    plans.insert(0, p)
    return plans


def _experts_note(shape: Shape, model: TrainedModel) -> str:
    """The plan's line on a MoE model: its experts, and those each rank holds."""
    total, active = shape.params / 1e9, shape.active_params / 1e9
    held = shape.experts // model.ep
    where = (
        f"expert parallel {model.ep}: each rank holds {held} of them per block"
        if model.ep > 1
        else "FSDP shards them with the other weights"
        if model.fsdp
        else "each rank holds all of them"
    )
    return (
        f"mixture of experts: {shape.experts} experts (top-{shape.experts_per_token}, "
        f"intermediate {shape.expert_intermediate}) in {shape.moe_layers} of {shape.layers} "
        f"blocks, {total:.2f}B parameters ({active:.2f}B active per token); {where}"
    )


def _down(fraction: float) -> float:
    """``fraction`` rounded down to a hundredth (a printed "at most" never exceeds it)."""
    return int(fraction * 100 + 1e-9) / 100


def _floor(fraction: float) -> float:
    """``fraction`` rounded down to a hundredth, within [0, DEFAULT_ENGINE_FRACTION]."""
    return min(max(_down(fraction), 0.0), DEFAULT_ENGINE_FRACTION)


def _size_engine(half: Any, shape: Shape, plan: ProcessPlan, gpu_bytes: float) -> None:
    """The sglang engine on ``plan``'s GPU: its fraction sized when unset (colocated), the most
    that fits, its wake (colocated with offload) and the KV cache its static memory leaves."""
    ro, data = half.roles.rollout, half.data
    c = _BYTES[half.model.dtype]
    tp = ro.parallelism.tensor
    weights = c * shape.params / tp
    pool = _sglang_lora_pool(half, shape)
    seq = data.max_prompt_length + data.max_response_length
    plan.engine_min_kv = seq * shape.layers * 2 * shape.kv_dim * c / tp
    if not ro.colocate_with_actor:
        plan.engine_kv = plan.engine_fraction * gpu_bytes - weights - pool
        return
    if ro.offload:
        room, free_at_start = _wake_room(half, plan, gpu_bytes)
        plan.engine_max_fraction = room / free_at_start
        if plan.engine_fraction_source == "auto":
            plan.engine_fraction = _floor((room - SGLANG_RUNTIME_BYTES) / free_at_start)
        plan.wake, plan.wake_max_fraction = wake_steps(half, shape, plan, gpu_bytes)
        # generating, the engine holds what it sized at start (its wake's last step)
        awake = plan.wake["resume KV cache"]
        released = "rollout (sglang, released while training)"
        plan.phases["generation"][released] = awake["sglang weights"] + awake["sglang KV cache"]
        plan.engine_kv = plan.engine_fraction * free_at_start - weights - pool
        return
    held = "rollout (sglang memory fraction)"
    plan.persistent.pop(held, None)
    plan.engine_max_fraction = (gpu_bytes - plan.peak) / gpu_bytes
    if plan.engine_fraction_source == "auto":
        plan.engine_fraction = _floor(plan.engine_max_fraction - SGLANG_RUNTIME_BYTES / gpu_bytes)
    plan.persistent[held] = plan.engine_fraction * gpu_bytes
    plan.engine_kv = plan.engine_fraction * gpu_bytes - weights - pool


def _wake_room(half: Any, plan: ProcessPlan, gpu_bytes: float) -> tuple[float, float]:
    """(bytes a woken colocated engine may take after step 1, bytes free when it started)."""
    training = {k: v for k, v in plan.persistent.items() if not k.startswith("rollout")}
    transient = max(
        (sum(plan.phases[k].values()) for k in UPDATE_PHASES if k in plan.phases), default=0.0
    )
    contexts = 2 * CUDA_CONTEXT_BYTES
    at_start = sum(training.get(k, 0.0) for k in WEIGHT_PARTS) + contexts
    room = gpu_bytes - sum(training.values()) - contexts - ALLOCATOR_KEPT * transient
    return room, gpu_bytes - at_start


UPDATE_PHASES = ("actor update", "critic update")
WEIGHT_PARTS = ("actor weights", "critic weights", "reference", "teacher")


def wake_steps(
    half: Any, shape: Shape, plan: ProcessPlan, gpu_bytes: float
) -> tuple[dict[str, dict[str, float]], float]:
    """The wake of a colocated sglang engine on one of the actor's GPUs, step by step in the
    host's order (each step: every part reserved after it), and the largest
    ``gpuMemoryFraction`` whose last step fits ``gpu_bytes`` (the engine's fraction:
    ``plan.engine_fraction``, else the spec's)."""
    ro = half.roles.rollout
    c = _BYTES[half.model.dtype]
    training = {k: v for k, v in plan.persistent.items() if not k.startswith("rollout")}
    transient = max(
        (sum(plan.phases[k].values()) for k in UPDATE_PHASES if k in plan.phases), default=0.0
    )
    contexts = {"cuda contexts (worker, sglang)": 2 * CUDA_CONTEXT_BYTES}
    base = {**training, **contexts}
    weights = c * shape.params / ro.parallelism.tensor
    bucket = max(ro.weight_sync_bucket_mb * 2**20, c * shape.vocab * shape.hidden)
    sync = {"weight sync bucket": bucket}
    actor = half.roles.actor
    if actor.backend == "megatron" and actor.parallelism.tensor > 1:
        # megatron joins a split tensor from its tensor-parallel pieces: while the largest one
        # (the embedding, or an untied head) is made, its pieces and the joined copy both exist
        sync["megatron: a tensor's pieces while it is joined"] = c * max(
            shape.vocab * shape.hidden, 2 * shape.intermediate * shape.hidden
        )
    # SGLang sized its static memory when it started: after the actor's weights were loaded
    at_start = sum(training.get(k, 0.0) for k in WEIGHT_PARTS) + sum(contexts.values())
    free_at_start = gpu_bytes - at_start
    # its LoRA buffers (kept while released: in ``training``) come before the KV cache is sized
    fraction = plan.engine_fraction
    if fraction is None:
        fraction = ro.gpu_memory_fraction or DEFAULT_ENGINE_FRACTION
    kv = max(fraction * free_at_start - weights - _sglang_lora_pool(half, shape), 0.0)
    kept = {"allocator: update blocks kept (fragmentation)": ALLOCATOR_KEPT * transient}
    engine = {"sglang weights": weights}
    steps = {
        "training done": {**base, "allocator: update blocks cached": transient},
        "empty cache": {**base, **kept},
        "resume weights": {**base, **kept, **engine},
        "weight sync": {**base, **kept, **engine, **sync},
        "empty cache after sync": {**base, **kept, **engine},
        "resume KV cache": {**base, **kept, **engine, "sglang KV cache": kv},
    }
    room = gpu_bytes - sum(base.values()) - sum(kept.values())
    return steps, room / free_at_start


def gpu_gib_of(node_selector: dict[str, str], declared: str | None = None) -> float:
    """GPU memory (GiB): ``declared`` (the role's ``resources.gpuMemory``, a quantity) when
    given, else the size a node selector's GPU product label names (``...-80GB-...``), else
    :data:`DEFAULT_GPU_GIB`."""
    if declared is not None:
        return quantity_value(declared) / GiB
    labelled = _labelled_gib(node_selector)
    return DEFAULT_GPU_GIB if labelled is None else labelled


def _labelled_gib(node_selector: dict[str, str]) -> float | None:
    for key, value in node_selector.items():
        if "gpu" in key.lower():
            m = re.search(r"(\d+)\s*GB", value, re.IGNORECASE)
            if m:
                return float(m.group(1)) * 1e9 / GiB
    return None


ASSUMED_GPU_FIX = (
    "; the plan assumed {gib:.0f} GiB GPUs (no roles.actor.resources.gpuMemory and no GPU "
    "product label in its nodeSelector): if yours have more, set roles.actor.resources.gpuMemory"
)


def gpu_plans(
    half: Any, gpu_gib: float | None = None, shape: Shape | None = None
) -> tuple[float, list[ProcessPlan]]:
    """(GPU GiB, the plans of the processes that run on GPUs); no plans when the model's shape
    is unknown here."""
    roles = half.roles
    actor = roles.actor
    gib = (
        gpu_gib
        if gpu_gib is not None
        else gpu_gib_of(actor.node_selector, actor.resources.gpu_memory)
    )
    out = []
    for plan in plan_job(half, gib, shape):
        spec = getattr(roles, plan.name) or roles.actor
        owner = roles.actor if getattr(spec, "colocate_with_actor", False) else spec
        if owner.resources.gpus > 0:
            out.append(plan)
    return gib, out


def plan_problems(
    half: Any, prefix: str = "spec", gpu_gib: float | None = None, shape: Shape | None = None
) -> list[Problem]:
    """The plan's verdicts, one line each naming the field to change, with the numbers: a GPU
    process over its GPU, a colocated engine's wake step over it, an engine whose static memory
    leaves no room for one sequence's KV cache (roles with GPUs only; none when the model's
    shape is unknown here)."""
    gib, plans = gpu_plans(half, gpu_gib, shape)
    out: list[Problem] = []
    for plan in plans:
        found: list[Problem] = []
        over = plan.wake_over(gib * GiB)
        wake = _wake_problem(plan, gib, prefix, *over) if over is not None else None
        if plan.peak > gib * GiB and not (wake and plan.peak_phase == "generation"):
            parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in plan.rows() if v)
            found.append(
                Problem(
                    f"{prefix}.roles.{plan.name}",
                    f"the memory plan needs {plan.peak / GiB:.1f} GiB per GPU, more than its "
                    f"{gib:.0f} GiB ({parts} GiB)",
                    "training.sharding: fsdp, gradientCheckpointing, a smaller microBatchSize "
                    "or offloadReference"
                    + (_EXPERT_FIX if _splits_experts(half, plan.name, shape) else "")
                    + "; `ppojob validate --plan` prints the plan",
                )
            )
        if wake is not None:
            found.append(wake)
        kv, least = plan.engine_kv, plan.engine_min_kv
        if not found and kv is not None and kv < least:
            found.append(_engine_problem(plan, gib, prefix))
        for problem in found:  # one line per field
            if problem.path not in {q.path for q in out}:
                out.append(problem)
    actor = half.roles.actor
    assumed = actor.resources.gpu_memory is None and _labelled_gib(actor.node_selector) is None
    if gpu_gib is None and assumed:
        hint = ASSUMED_GPU_FIX.format(gib=gib)
        out = [Problem(p.path, p.message, p.fix + hint) for p in out]
    return out


_EXPERT_FIX = ", or (megatron) a larger parallelism.expert to split the experts"


def _splits_experts(half: Any, name: str, shape: Shape | None) -> bool:
    """Whether a megatron role ``name`` of a MoE model could hold fewer experts per GPU."""
    spec = getattr(half.roles, name, None)
    if spec is None or getattr(spec, "backend", None) != "megatron":
        return False
    path = half.model.critic_path if name == "critic" and half.model.critic_path else None
    found = shape if shape is not None and path is None else resolve_shape(path or half.model.path)
    return bool(found is not None and found.experts)


def _engine_problem(plan: ProcessPlan, gib: float, prefix: str) -> Problem:
    """An engine whose static memory holds its weights but not one sequence's KV cache."""
    frac = plan.engine_fraction or 0.0
    kv = max(plan.engine_kv or 0.0, 0.0)
    source = _SOURCES[plan.engine_fraction_source]
    what = (
        f"the sglang engine's gpuMemoryFraction {frac:.2f} ({source})"
        f" leaves {kv / GiB:.2f} GiB for its KV cache per GPU after its weights, less than one "
        f"rollout sequence's {plan.engine_min_kv / GiB:.2f} GiB (of {gib:.0f} GiB GPUs)"
    )
    if plan.engine_fraction_source == "spec" and plan.engine_max_fraction is None:
        return Problem(
            f"{prefix}.roles.rollout.gpuMemoryFraction",
            what,
            "raise it, or raise roles.rollout.parallelism.tensor",
        )
    return Problem(
        f"{prefix}.roles.rollout",
        what,
        "leave the engine more room: training.sharding: fsdp, gradientCheckpointing, a smaller "
        "microBatchSize, roles.rollout.parallelism.tensor, or a rollout on its own GPUs "
        "(roles.rollout.colocateWithActor: false)",
    )


_SOURCES = {
    "spec": "as written",
    "auto": "sized by the plan",
    "default": "the default on its own GPUs",
    None: "-",
}


def _wake_problem(
    plan: ProcessPlan, gib: float, prefix: str, step: str, total: float, over: float
) -> Problem:
    """The wake step that does not fit, by how much, and the field to change."""
    what = (
        f"waking the colocated sglang engine after a training step needs {total / GiB:.1f} GiB "
        f"per GPU at '{step}', {over / GiB:.1f} GiB more than its {gib:.0f} GiB"
    )
    frac = plan.wake_max_fraction or 0.0
    engine_weights = plan.wake[step].get("sglang weights", 0.0)
    if step == "resume KV cache" and frac * (gib * GiB) > engine_weights:
        return Problem(
            f"{prefix}.roles.rollout.gpuMemoryFraction",
            what,
            f"set it to at most {_down(frac):.2f}, or leave it unset (the plan sizes it)",
        )
    if step == "weight sync":
        return Problem(
            f"{prefix}.roles.rollout.weightSyncBucketMb",
            what,
            "lower it, or leave the actor less resident (training.sharding: fsdp)",
        )
    return Problem(
        f"{prefix}.roles.actor",
        what + ": the actor's states leave the engine too little",
        "training.sharding: fsdp, a smaller microBatchSize (less kept in the allocator), or a "
        "rollout on its own GPUs (roles.rollout.colocateWithActor: false)",
    )


def memory_status(half: Any) -> dict[str, Any]:
    """``status.memoryPlan``: the per-GPU peak of each GPU process, the engine's fraction and
    where it comes from, and a one-line verdict; a message alone where the model's shape is
    unknown here (the trainer plans it at start) or no role has GPUs."""
    gib, plans = gpu_plans(half)
    out: dict[str, Any] = {"gpuGiB": round(gib, 2), "peakGiB": None}
    if not plans:
        if resolve_shape(half.model.path) is None:
            out["message"] = (
                f"model {half.model.path}: shape unknown to the operator; checked by the trainer "
                "at start (the same plan, from the model's config.json), before training"
            )
        else:
            out["message"] = "no role has GPUs: no plan"
        return out
    out["peakGiB"] = round(max(p.peak for p in plans) / GiB, 2)
    out["processes"] = [
        {"name": p.name, "peakGiB": round(p.peak / GiB, 2), "peakPhase": p.peak_phase}
        for p in plans
    ]
    engine = next((p for p in plans if p.engine_fraction is not None), None)
    words = [f"{p.name} {p.peak / GiB:.1f} GiB" for p in plans]
    if engine is not None:
        out["engineFraction"] = engine.engine_fraction
        out["engineFractionSource"] = engine.engine_fraction_source
        words.append(
            f"sglang gpuMemoryFraction {engine.engine_fraction:.2f} "
            f"({_SOURCES[engine.engine_fraction_source]})"
        )
    verdict = "fits" if not plan_problems(half, gpu_gib=gib) else "does not fit"
    out["message"] = f"{verdict} {gib:.0f} GiB GPUs: " + ", ".join(words)
    return out


def format_plan(plans: list[ProcessPlan], gpu_gib: float) -> str:
    """The plans as a table: one block per process, GiB per part, the peak and the verdict."""
    lines = []
    for plan in plans:
        lines.append(
            f"{plan.name}: peak {plan.peak / GiB:.2f} GiB of {gpu_gib:.0f} GiB "
            f"({'fits' if plan.peak <= gpu_gib * GiB else 'DOES NOT FIT'}; "
            f"peak phase: {plan.peak_phase or '-'})"
        )
        for name, value in plan.rows():
            lines.append(f"    {name:<52} {value / GiB:9.3f} GiB")
        lines += [f"    note: {n}" for n in plan.notes]
        if plan.engine_fraction is not None:
            most = plan.engine_max_fraction
            lines.append(
                f"  sglang engine: gpuMemoryFraction {plan.engine_fraction:.2f} "
                f"({_SOURCES[plan.engine_fraction_source]}"
                + (f"; at most {_down(most):.2f} fits beside the actor" if most is not None else "")
                + ")"
            )
        if plan.wake:
            over = plan.wake_over(gpu_gib * GiB)
            lines.append(
                "  wake of the colocated sglang engine: "
                + (f"DOES NOT FIT at '{over[0]}'" if over else "fits")
                + f" (gpuMemoryFraction at most {_down(plan.wake_max_fraction):.2f})"
            )
            for step, parts in plan.wake.items():
                lines.append(f"    {step:<52} {sum(parts.values()) / GiB:9.3f} GiB")
    return "\n".join(lines)


__all__ = [
    "DEFAULT_ENGINE_FRACTION",
    "KNOWN_SHAPES",
    "ProcessPlan",
    "Shape",
    "TrainedModel",
    "format_plan",
    "gpu_gib_of",
    "gpu_plans",
    "memory_status",
    "plan_job",
    "plan_problems",
    "resolve_shape",
    "shape_from_config",
    "wake_steps",
]
