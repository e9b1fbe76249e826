"""megatron-core's parallel state from a worker's
:class:`~ppojob_trainer.distributed.ShardIdentity`, and the model.

Rank layout: megatron-core's default order ``tp-cp-ep-dp-pp`` over the world of the worker's role
set (the processes :func:`~ppojob_trainer.distributed.init_role_groups` joined): rank
``tp + T*(cp + C*(dp + D*pp))``. :func:`~ppojob_trainer.distributed.identity` computes the same
layout, so the shard identity a worker is given and megatron's groups agree (checked here).

megatron-core keeps its groups in module globals, one layout per process: a colocated actor and
critic on the megatron backend must share their parallelism (validation says so).

CPU: the process groups are gloo; two megatron-core pieces that assume CUDA are replaced by CPU
equivalents (the RNG-state tracker its tensor-parallel layers fork for dropout and
initialisation, and the global memory buffer). Context parallelism needs GPUs (its attention
kernels are Transformer Engine's) and is rejected before this module runs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..distributed import ShardIdentity
from .megatron_convert import ModelShape

GLOO_GROUPS = True
"""megatron-core's gloo process groups exist on every device (its default): its optimizer builder
asks for the gloo data-parallel groups unless told not to, and its distributed optimizer gathers
state over them. :func:`init_parallel` creates them and ``get_megatron_optimizer`` is told the
same (it used to be off on CUDA while the optimizer asked for them: an ``AssertionError``)."""


def _import(role: str) -> Any:
    try:
        from megatron.core import parallel_state
    except ImportError:
        raise ImportError(
            f"spec.roles.{role}.backend: backend 'megatron' needs the 'megatron-core' package, "
            f"which is not installed in this image; install it (pip install "
            f"'ppojob[megatron]', CPU or GPU; the trainer image built with the gpu extra has "
            f"it), or set the backend to torch"
        ) from None
    return parallel_state


class _CpuRngTracker:
    """megatron-core's ``CudaRNGStatesTracker`` on the CPU generator: named seeded states that
    ``fork()`` swaps in for the block and saves back after."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self.states_ = {}

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self.states_[name] = torch.Generator().manual_seed(int(seed)).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise RuntimeError(f"RNG state {name!r} was never added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def _cpu_device() -> torch.device:
    return torch.device("cpu")


class _CpuMemoryBuffer:
    """megatron-core's ``GlobalMemoryBuffer`` allocating on the CPU."""

    def __init__(self) -> None:
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(self, tensor_shape: Any, dtype: torch.dtype, name: str, **_: Any) -> Any:
        n = 1
        for s in tensor_shape:
            n *= int(s)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < n:
            buf = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype)
        return buf[:n].view(*tensor_shape)


def _install_cpu_shims(seed: int, tp_rank: int) -> None:
    from megatron.core import parallel_state

    if not torch.cuda.is_available():
        # megatron-core allocates buffers (RoPE frequencies, all-gather outputs, pipeline
        # messages) on ``torch.cuda.current_device()``; in a process without CUDA that device is
        # the CPU. Nothing else in such a process can ask CUDA for a device.
        torch.cuda.current_device = _cpu_device  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as mrandom

    tracker = _CpuRngTracker()
    # The seeds megatron-core's model_parallel_cuda_manual_seed uses, on the CPU generator.
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    parallel_state._GLOBAL_MEMORY_BUFFER = _CpuMemoryBuffer()


def parallel_kwargs(shard: ShardIdentity, device: str) -> dict[str, Any]:
    """megatron-core's ``initialize_model_parallel`` arguments for ``shard`` on ``device``."""
    return {
        "tensor_model_parallel_size": shard.tp_size,
        "pipeline_model_parallel_size": shard.pp_size,
        "context_parallel_size": shard.cp_size,
        "expert_model_parallel_size": shard.ep_size,
        "create_gloo_process_groups": GLOO_GROUPS,
    }


def init_parallel(shard: ShardIdentity, device: str, seed: int) -> None:
    """Initialise megatron-core's groups for ``shard``'s layout (once per process).

    The process's ``torch.distributed`` world is its role set's (one process: a one-rank gloo
    world is started here). A second call with the same layout (a colocated critic) is a no-op;
    another layout is an error.
    """
    import torch.distributed as dist

    ps = _import(shard.role)
    sizes = (shard.tp_size, shard.pp_size, shard.cp_size, shard.dp_size, shard.ep_size)
    world = shard.tp_size * shard.pp_size * shard.cp_size * shard.dp_size
    if not dist.is_initialized():
        if world != 1:
            raise RuntimeError(
                f"megatron backend: {world} workers expected in a process group, none was joined"
            )
        from ..distributed import loopback_gloo

        loopback_gloo()
        dist.init_process_group(  # one rank: an in-memory store, no listener
            "nccl" if device.startswith("cuda") else "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
        )
    if dist.get_world_size() != world:
        raise RuntimeError(
            f"megatron backend: the {shard.role} layout tensor x pipeline x context x data = "
            f"{' x '.join(map(str, sizes))} needs {world} workers in its process group, which "
            f"has {dist.get_world_size()}"
        )
    if ps.model_parallel_is_initialized():
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_context_parallel_world_size(),
            ps.get_data_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
        )
        if have != sizes:
            raise RuntimeError(
                f"spec.roles.{shard.role}.parallelism: megatron-core holds one layout per process "
                f"and this process already has tensor x pipeline x context x data x expert = "
                f"{have}; give a colocated actor and critic the same parallelism"
            )
        return
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.cuda.current_device())
    ps.initialize_model_parallel(**parallel_kwargs(shard, device))
    got = (
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_context_parallel_rank(),
        ps.get_data_parallel_rank(),
        ps.get_expert_model_parallel_rank(),
    )
    want = (shard.tp_rank, shard.pp_rank, shard.cp_rank, shard.dp_rank, shard.ep_rank)
    if got != want:
        raise RuntimeError(f"megatron backend: rank layout {got} differs from the worker's {want}")
    if device.startswith("cuda"):
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        _install_cpu_shims(seed, shard.tp_rank)


LOCAL_SPEC_ENV = "PPOJOB_MEGATRON_LOCAL_SPEC"
"""Set to 1 in a role's environment to run megatron-core's local (unfused, plain torch) layers on
a GPU without Transformer Engine: slower, and packed rows get a dense block-diagonal mask."""

FUSIONS = (
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "masked_softmax_fusion",
    "apply_rope_fusion",
    "gradient_accumulation_fusion",
)
"""The ``TransformerConfig`` fusion switches :func:`kernel_choice` sets (megatron-core 0.16.1)."""


def transformer_engine_available() -> bool:
    """Whether Transformer Engine's torch extension imports (a broken install raises its own
    error rather than reading as absent)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def wgrad_fusion_available() -> bool:
    """Whether the CUDA extension megatron-core's own ``ColumnParallelLinear`` (the output layer,
    under Transformer Engine's spec too) needs for ``gradient_accumulation_fusion``
    (``fused_weight_gradient_mlp_cuda``, APEX's) imports: without it megatron-core refuses the
    fusion when it builds the layer."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class KernelChoice:
    """Which layers and fused kernels a megatron model runs: Transformer Engine's layer spec or
    megatron-core's local one, and the ``TransformerConfig`` fusion switches (:data:`FUSIONS`)."""

    transformer_engine: bool
    fusions: dict[str, bool]


def kernel_choice(device: str, role: str = "actor") -> KernelChoice:
    """The kernels for ``device``. CPU: the local spec, every fusion off (they are CUDA
    kernels). CUDA: Transformer Engine's spec with the fusions on: SwiGLU (``bias_activation_
    fusion``: megatron-core's fused ``bias_swiglu``, no bias here), bias-dropout-add, masked
    softmax (read by the local attention only; Transformer Engine's attention is fused itself),
    RoPE (Transformer Engine's fused kernel, ``thd`` rows too), and gradient accumulation into
    the fp32 main gradients where megatron-core's output layer can do it too
    (:func:`wgrad_fusion_available`); the layer norms are RMSNorm, which
    ``persist_layer_norm`` does not cover. Transformer Engine missing on CUDA is an error naming
    the extra that installs it, unless the role opts into the local spec (:data:`LOCAL_SPEC_ENV`
    = 1), which runs unfused."""
    off = dict.fromkeys(FUSIONS, False)
    if not device.startswith("cuda"):
        return KernelChoice(False, off)
    if not transformer_engine_available():
        if os.environ.get(LOCAL_SPEC_ENV, "") == "1":
            return KernelChoice(False, off)
        raise ValueError(
            f"spec.roles.{role}.backend: megatron on a GPU needs Transformer Engine, which is not "
            f"installed in this image: use the trainer image built with the 'gpu' extra (pip "
            f"install 'ppojob[trainer,gpu]' and transformer-engine[pytorch,core_cu13] as "
            f"constraints-gpu.txt pins it; images/trainer.Dockerfile does both), or set "
            f"{LOCAL_SPEC_ENV}=1 in the role's env to run megatron-core's unfused local layers "
            f"(slower; packed rows get a dense attention mask)"
        )
    fusions = dict.fromkeys(FUSIONS, True)
    fusions["gradient_accumulation_fusion"] = wgrad_fusion_available()
    return KernelChoice(True, fusions)


def transformer_config(
    shape: ModelShape,
    dtype: torch.dtype,
    *,
    device: str,
    tp: int,
    pp: int,
    cp: int = 1,
    ep: int = 1,
    sequence_parallel: bool = False,
    role: str = "actor",
) -> Any:
    """megatron-core ``TransformerConfig`` of a Llama/Qwen2/Qwen3-MoE/Mixtral model (RMSNorm,
    SwiGLU, RoPE, GQA, no linear biases but Qwen2's q/k/v bias, Qwen3's q/k norms, no dropout:
    the HF models' own inference setup), with the fusions of :func:`kernel_choice` (which
    refuses a GPU without Transformer Engine unless the role opted into the local spec).

    A MoE model's layers route as the HF model does: softmax over the router's logits, the top
    ``experts_per_token``, renormalised (megatron's top-k of the logits, then their softmax) or
    not (``moe_router_pre_softmax``), the logits in the model's dtype; megatron-core's own
    load-balancing loss off (``algorithm.routerAuxLossCoefficient`` adds ours, the torch
    backend's definition, through the router's top-k hook: :mod:`.megatron_routing`); experts
    one MLP each (``SequentialMLP``:
    the same names under Transformer Engine's spec); tokens to the experts' ranks by
    all-to-all (on a CPU by all-gather). Routing replay: :mod:`.megatron_routing`."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    gpu = device.startswith("cuda")
    choice = kernel_choice(device, role)
    moe: dict[str, Any] = {}
    if shape.moe:
        moe = dict(
            num_moe_experts=shape.experts,
            moe_router_topk=shape.experts_per_token,
            moe_ffn_hidden_size=shape.intermediate,
            moe_router_pre_softmax=not shape.norm_topk,
            moe_router_score_function="softmax",
            # (no moe_router_dtype: the router's logits in the model's dtype, softmax in fp32,
            # as the HF models and SGLang's gate compute them)
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            # all-to-all on GPUs; on a CPU megatron-core's all-to-all dispatcher needs CUDA
            # streams, and its all-gather one (every expert rank sees every token) runs on gloo
            moe_token_dispatcher_type="alltoall" if gpu else "allgather",
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=tp,
        )
    return TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        ffn_hidden_size=shape.intermediate,
        num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        use_cpu_initialization=not gpu,
        perform_initialization=False,
        persist_layer_norm=False,
        deallocate_pipeline_outputs=False,
        qk_layernorm=shape.qk_norm,
        **choice.fusions,
        **moe,
    )


_TE_MOE_NAMES = (
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_unpermute",
    "te_general_gemm",
)
"""What megatron-core 0.16.1's ``moe_utils`` imports from Transformer Engine when it can."""


def _moe_without_transformer_engine() -> None:
    """megatron-core 0.16.1's MoE router without Transformer Engine: ``moe_utils`` leaves
    :data:`_TE_MOE_NAMES` undefined when the import fails, and the router's gating linear then
    tests ``te_general_gemm is not None`` (a ``NameError``). Defined as None, as the module
    means, megatron-core takes its torch path (``torch.mm``)."""
    from megatron.core.transformer.moe import moe_utils

    for name in _TE_MOE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def layer_spec(config: Any, role: str = "actor") -> Any:
    """Transformer Engine's layer spec where :func:`kernel_choice` picks it (a GPU), else
    megatron-core's local one (plain torch modules; what runs on the CPU, and on a GPU by the
    role's opt-in). Sequence parallelism needs Transformer Engine (the local spec's torch norms
    refuse it)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    device = "cpu" if config.use_cpu_initialization else "cuda"
    moe = dict(
        num_experts=config.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm
    )
    if kernel_choice(device, role).transformer_engine:
        return specs.get_gpt_layer_with_transformer_engine_spec(**moe)
    if config.sequence_parallel:
        raise ValueError(
            f"spec.roles.{role}.parallelism.sequenceParallel: needs Transformer Engine, which is "
            f"not installed in this image; remove it or use an image with transformer-engine"
        )
    if config.num_moe_experts:
        _moe_without_transformer_engine()
    return specs.get_gpt_layer_local_spec(normalization="RMSNorm", **moe)


class ValueHead(torch.nn.Module):
    """The critic's output layer: hidden [s, b, h] -> values [s, b, 1], replicated over
    tensor-parallel ranks (called like megatron's output layer: returns ``(values, None)``)."""

    def __init__(self, hidden: int, dtype: torch.dtype, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, weight: Any = None, **_: Any) -> tuple[Any, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


def build_model(
    shape: ModelShape,
    config: Any,
    *,
    pre_process: bool,
    post_process: bool,
    value: bool,
    role: str = "actor",
) -> Any:
    """A megatron-core ``GPTModel`` for one pipeline stage (a value head on the last stage of a
    critic), with uninitialised weights (the caller loads converted ones)."""
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, role),
        vocab_size=shape.vocab,
        max_sequence_length=shape.max_positions,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tied and not value,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
        rope_scaling=shape.rope_scaling_factor is not None,
        rope_scaling_factor=shape.rope_scaling_factor or 8.0,
    )
    if value and post_process:
        model.output_layer = ValueHead(shape.hidden, config.params_dtype, config.sequence_parallel)
    _mark_tensor_parallel(model)
    if pre_process and shape.pad_id is not None:
        _freeze_pad_row(model.embedding.word_embeddings, shape.pad_id)
    return model


def _mark_tensor_parallel(model: Any) -> None:
    """Tag the split weights as megatron-core's initialisers would (``tensor_model_parallel``,
    ``partition_dim``): with ``perform_initialization=False`` (the weights are loaded) its
    layers leave them untagged, and gradient-norm code would count them as replicated."""
    from megatron.core import tensor_parallel as tp

    dims = ((tp.ColumnParallelLinear, 0), (tp.RowParallelLinear, 1), (tp.VocabParallelEmbedding, 0))
    for module in model.modules():
        for cls, dim in dims:
            weight = getattr(module, "weight", None)
            tagged = getattr(weight, "tensor_model_parallel", False)
            if isinstance(module, cls) and weight is not None and not tagged:
                tp.set_tensor_model_parallel_attributes(weight, True, dim, 1)


def _freeze_pad_row(embedding: Any, pad_id: int) -> None:
    """The HF models' ``nn.Embedding(padding_idx=pad_id)``: the pad token's row gets no
    gradient from the lookup (megatron-core's embedding has no ``padding_idx``).

    Only the lookup's: where the output layer is this embedding (tied), its projection's
    gradient reaches the pad row as in the HF model (``padding_idx`` masks the embedding's own
    backward, not ``lm_head``'s). So the lookup runs on the weight through
    :class:`_NoRowGrad` instead of a hook on the weight, which would see the sum of both."""
    start, end = embedding.vocab_start_index, embedding.vocab_end_index
    if not start <= pad_id < end:
        return
    row = pad_id - start
    lookup = type(embedding).forward

    def forward(input_: torch.Tensor) -> torch.Tensor:
        weight = embedding._parameters["weight"]
        # megatron-core's forward reads ``self.weight``: this call's lookup reads the masked
        # view (a non-leaf tensor whose gradient goes on to the parameter), then it is restored
        embedding._parameters["weight"] = _NoRowGrad.apply(weight, row)
        try:
            return lookup(embedding, input_)
        finally:
            embedding._parameters["weight"] = weight

    embedding.forward = forward


class _NoRowGrad(torch.autograd.Function):
    """The identity; backward: the gradient with row ``row`` zeroed."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, row: int) -> torch.Tensor:
        ctx.row = row
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        grad[ctx.row] = 0
        return grad, None
