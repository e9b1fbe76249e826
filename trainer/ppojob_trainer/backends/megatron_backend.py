"""Megatron-core training backend: tensor and pipeline parallel actor and critic.

Imported only when ``spec.roles.actor.backend`` or ``spec.roles.critic.backend`` is
``megatron``; megatron-core itself is imported inside the functions that need it.

Each worker holds one tensor/pipeline-parallel shard of a megatron-core ``GPTModel`` converted
from the Hugging Face checkpoint (:mod:`.megatron_convert`); the actor's model ends at its final
hidden states (:func:`emit_hidden_states`) and its log-probs and entropy come from the
vocabulary-parallel projection of the response positions, ``LOGITS_CHUNK_TOKENS`` at a time, each
chunk recomputed in backward (:func:`chunked_vocab_stats`), never the micro-batch's whole
[b, L, V/tp] logits nor the gathered vocabulary; the critic is the same model with a
value head instead of the output layer. Forward and backward go through megatron-core's pipeline
schedule (``get_forward_backward_func``: no pipelining at pipeline 1, 1F1B above). The loss
functions are the shared ones (``ppojob_trainer.algorithms``), weighted per micro-batch exactly as
the torch backend weighs them, so both backends make the same update.

Two optimizer paths:

- CPU (verified by the tests): fp32 weights, ``torch.optim.AdamW`` over the local shard, the
  gradient average over the data-parallel group with one flat all-reduce, gradient clipping on
  the global norm (tensor-parallel shards counted once each, replicated weights once).
- GPU (not yet run on a GPU): megatron-core's ``DistributedDataParallel`` and distributed
  optimizer (bf16 weights with fp32 master weights and gradient reduction in fp32), Transformer
  Engine's layer spec when it is installed. On the CPU the tests drive megatron-core's own DDP
  (its gradient scale against one full-batch backward, over real gloo groups) and its own
  distributed optimizer under a device shim (save -> load -> step resumes bit-identically);
  megatron's pipeline schedules and Transformer Engine need CUDA and run only on a GPU.

Inputs: every row is shifted left so that its prompt starts at position 0 (right padding only),
which gives each token the position the Hugging Face model gives it under left padding and needs
only the causal mask. Each micro-batch is padded to its own longest prompt and response.

Packing (``training.packing``): a micro-batch's sequences concatenated into one row without
padding (:func:`~.torch_backend.packing.pack_rows`), positions restarting per sequence. Under
Transformer Engine's layer spec the row goes in as ``thd`` with ``PackedSeqParams``
(:func:`packed_seq_params`: ``cu_seqlens`` at the boundaries; its varlen attention and RoPE
restart per sequence); megatron-core's local attention takes no ``PackedSeqParams``
(``DotProductAttention`` asserts it is None), so there the row gets a block-diagonal causal mask
(:func:`block_causal_mask`) and rotary positions restarting per sequence
(:func:`rope_positions`: ``GPTModel`` asks its rotary embedding for positions 0..N-1 whatever
its ``position_ids``). Micro-batches by tokens (``maxTokensPerMicroBatch``): the torch
backend's planner (:func:`~.torch_backend.packing.micro_batch_rows`), the loss weights unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ppojob_api.training import TrainingSettings

from ..distributed import ShardIdentity
from .base import PolicyLossFn, PolicyTrainer, ValueLossFn, ValueTrainer
from .megatron_convert import (
    HfTensor,
    ModelShape,
    hf_from_pieces,
    hf_layout,
    hf_to_megatron,
    megatron_to_hf,
    parallel_problems,
)
from .weight_sync import WeightStream, plan_buckets

ADAM_KEYS = ("exp_avg", "exp_avg_sq")
# Transformer Engine's layer spec fuses the norms into the following linear layers.
TE_NORMS = [
    ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
]


def _rename(sd: Mapping[str, torch.Tensor], pairs: list[tuple[str, str]]) -> dict:
    """``sd`` with every key ending in a pair's first suffix ending in its second instead."""
    out = {}
    for k, v in sd.items():
        for old, new in pairs:
            if k.endswith(old):
                k = k[: -len(old)] + new
                break
        out[k] = v
    return out


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------
def left_aligned(
    batch: Mapping[str, torch.Tensor], pad_to: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, L], index [B, T]): each row's prompt + response moved to start at position 0,
    and the position of the logits (or value) that predicts response token t of row i.

    ``L`` is rounded up to a multiple of ``pad_to`` (sequence parallelism splits it)."""
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"].long()
    ids = torch.cat([prompt_ids, batch["response_ids"]], dim=1)
    b, p = prompt_ids.shape
    t = batch["response_ids"].shape[1]
    length = p + t
    shift = p - prompt_mask.sum(1)  # left padding of each row
    cols = torch.arange(length)[None, :] + shift[:, None]
    out = ids.gather(1, cols.clamp(max=length - 1))
    out = out.masked_fill(cols >= length, 0)
    total = -(-length // pad_to) * pad_to
    if total > length:
        out = torch.cat([out, out.new_zeros(b, total - length)], 1)
    index = (p - shift - 1)[:, None] + torch.arange(t)[None, :]
    return out, index


def _causal_mask(length: int, device: torch.device) -> torch.Tensor:
    return torch.ones(length, length, device=device).triu(1).bool()[None, None]


def packed_lengths(positions: torch.Tensor) -> list[int]:
    """The lengths of the sequences of one packed row, from its ``positions`` (restarting at 0
    for every sequence, :func:`~.torch_backend.packing.pack_rows`)."""
    pos = positions.reshape(-1)
    starts = (pos == 0).nonzero().flatten().tolist()
    return [b - a for a, b in zip(starts, [*starts[1:], pos.numel()], strict=True)]


def block_causal_mask(lengths: list[int], device: torch.device) -> torch.Tensor:
    """[1, 1, N, N] bool, megatron's convention (True: masked out): each of the packed
    sequences of ``lengths`` attends causally to itself and to no other."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    same = seg[:, None] == seg[None, :]
    causal = torch.ones(len(seg), len(seg), dtype=torch.bool).tril()
    return (~(same & causal)).to(device)[None, None]


def packed_seq_params(lengths: list[int], device: torch.device) -> Any:
    """megatron-core's ``PackedSeqParams`` of one packed row (``thd``: Transformer Engine's
    varlen attention, and RoPE restarted per sequence): the cumulative sequence boundaries
    ``cu_seqlens`` [0, l1, l1 + l2, ..., N] (int32) and the longest sequence, the same for
    queries and keys (self-attention; no context parallelism, so no per-sequence padding)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    cu = cu.to(device)
    longest = max(lengths)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


@contextmanager
def rope_positions(module: Any, positions: torch.Tensor) -> Iterator[None]:
    """Inside the block, the rotary embeddings of ``module`` (megatron-core's ``GPTModel``
    computes them for positions 0..N-1 of the row, whatever its ``position_ids``) rotate token
    k by ``positions[k]`` instead: the packed row's positions, restarting per sequence, as the
    Hugging Face model and the padded row give them (megatron's local attention takes no
    ``PackedSeqParams``)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    pos = positions.reshape(-1)
    ropes = [m for m in module.modules() if type(m) is RotaryEmbedding]

    def restarted(rope: Any) -> Callable[..., torch.Tensor]:
        def forward(max_seq_len: int, *args: Any, **kwargs: Any) -> torch.Tensor:
            emb = RotaryEmbedding.forward(rope, int(pos.max()) + 1, *args, **kwargs)
            return emb[pos.to(emb.device)]

        return forward

    for rope in ropes:
        rope.forward = restarted(rope)
    try:
        yield
    finally:
        for rope in ropes:
            del rope.forward


def _split(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


# ---------------------------------------------------------------------------------------------
# One role's sharded model, optimizer and schedule
# ---------------------------------------------------------------------------------------------
class _Sharded:
    """A megatron-core model shard (actor or critic), its optimizer and its checkpoint state."""

    def __init__(
        self,
        model_dir: Path,
        dtype_name: str,
        shard: ShardIdentity,
        settings: TrainingSettings,
        *,
        total_updates: int,
        value: bool,
        device: str,
        seed: int,
        sequence_parallel: bool = False,
        frozen_copy: bool = False,
    ) -> None:
        from transformers import AutoConfig

        from ..models import torch_dtype
        from .megatron_parallel import build_model, init_parallel, transformer_config

        self.shard = shard
        self.settings = settings
        self.total_updates = max(1, total_updates)
        self.value = value
        self.device = torch.device(device)
        self.gpu = self.device.type == "cuda"
        field = f"spec.roles.{shard.role}"
        self.shape = ModelShape.from_hf_config(
            AutoConfig.from_pretrained(str(model_dir)), field="spec.model.path"
        )
        problems = parallel_problems(self.shape, shard.tp_size, shard.pp_size)
        if problems:
            what, fix = problems[0]
            raise ValueError(f"{field}.parallelism: {what}; {fix}")
        if shard.cp_size > 1 and not self.gpu:
            raise ValueError(f"{field}.parallelism.context: context parallelism needs GPUs; set 1")
        dtype = torch_dtype(dtype_name)
        if not self.gpu and dtype != torch.float32:
            raise ValueError("spec.model.dtype: the megatron backend on CPU runs float32; set it")
        init_parallel(shard, device, seed)
        from megatron.core import parallel_state as ps

        self.ps = ps
        self.first = ps.is_pipeline_first_stage()
        self.last = ps.is_pipeline_last_stage()
        self.sequence_parallel = sequence_parallel and shard.tp_size > 1
        self.config = transformer_config(
            self.shape,
            dtype,
            device=device,
            tp=shard.tp_size,
            pp=shard.pp_size,
            cp=shard.cp_size,
            sequence_parallel=self.sequence_parallel,
        )
        self.config.calculate_per_token_loss = True  # the loss functions weigh micro-batches
        self.config.variable_seq_lengths = True  # micro-batches may differ in size

        hf = self._load_hf(model_dir, seed, dtype_name)
        self.model = self._new_model(build_model, hf)
        # Transformer Engine's layer spec (its varlen attention takes packed rows as ``thd``),
        # else megatron-core's local attention (packed rows: a block-diagonal mask)
        self.te = any(k.endswith(TE_NORMS[0][1]) for k in self.model.state_dict())
        self.reference = None
        if frozen_copy:
            self.reference = self._new_model(build_model, hf).eval()
            self.reference.requires_grad_(False)
        del hf
        self.updates = 0
        self.ddp = None
        if self.gpu:
            self._gpu_optimizer()
        else:
            self.params = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(
                self.params,
                lr=settings.learning_rate,
                betas=(settings.adam_beta1, settings.adam_beta2),
                eps=settings.adam_eps,
                weight_decay=settings.weight_decay,
            )

    # -- construction --------------------------------------------------------------------------
    def _load_hf(self, model_dir: Path, seed: int, dtype: str) -> dict[str, torch.Tensor]:
        """The HF state dict in the training dtype, on the CPU (critic: backbone + a value head
        initialised as the torch backend's, so both backends start from the same critic)."""
        from ..models import load_causal_lm, load_value_model

        if not self.value:
            return load_causal_lm(model_dir, dtype).state_dict()
        vm = load_value_model(model_dir, dtype, seed=seed)
        sd = {
            ("model." + k[len("backbone.") :]): v
            for k, v in vm.state_dict().items()
            if k.startswith("backbone.")
        }
        sd["value_head.weight"] = vm.value_head.weight.detach()
        sd["value_head.bias"] = vm.value_head.bias.detach()
        return sd

    def _new_model(self, build_model: Callable[..., Any], hf: Mapping[str, torch.Tensor]) -> Any:
        model = build_model(
            self.shape,
            self.config,
            pre_process=self.first,
            post_process=self.last,
            value=self.value,
            role=self.shard.role,
        )
        self._load_local(model, self._local_from_hf(hf))
        return model.to(self.device)

    def _local_from_hf(self, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        s = self.shard
        head = None
        if self.value:
            head = {"weight": hf["value_head.weight"], "bias": hf["value_head.bias"]}
        return hf_to_megatron(
            hf, self.shape, s.tp_rank, s.tp_size, s.pp_rank, s.pp_size, value_head=head
        )

    @staticmethod
    def _load_local(model: Any, local: Mapping[str, torch.Tensor]) -> None:
        params = {
            k: v
            for k, v in model.state_dict(keep_vars=True).items()
            if not k.endswith("_extra_state")
        }
        if any(k.endswith(TE_NORMS[0][1]) for k in params):  # Transformer Engine's layer spec
            local = _rename(local, TE_NORMS)
        if set(params) != set(local):
            raise RuntimeError(
                f"megatron conversion: model keys {sorted(set(params) ^ set(local))[:6]} do not "
                f"match the converted checkpoint"
            )
        with torch.no_grad():
            for k, p in params.items():
                if p.shape != local[k].shape:
                    raise RuntimeError(
                        f"megatron conversion: {k} {tuple(local[k].shape)} does "
                        f"not fit {tuple(p.shape)}"
                    )
                p.copy_(local[k])

    def _gpu_optimizer(self) -> None:  # pragma: no cover - needs CUDA
        """megatron-core DDP + distributed optimizer (bf16 weights, fp32 main weights)."""
        self._wrap_ddp()
        self.optimizer = self._megatron_optimizer()
        self.config.grad_scale_func = self.optimizer.scale_loss  # 1 in bf16; the scaler in fp16

    def _wrap_ddp(self) -> None:
        """megatron-core's ``DistributedDataParallel`` around the model (runs on a CPU too).

        ``calculate_per_token_loss`` makes DDP SUM the gradients over the data-parallel group
        (``gradient_scaling_factor = 1``) and makes the schedule hand ``finalize_model_grads``
        the token count; the loss functions already weigh each micro-batch by its share of the
        whole mini-batch's tokens (:meth:`_micro_weights`, no data-parallel factor), so the sum
        is the gradient of the global mean and megatron must not divide again."""
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
        )
        self.ddp = DistributedDataParallel(
            config=self.config, ddp_config=ddp_config, module=self.model
        )
        self.config.no_sync_func = self.ddp.no_sync
        self.config.finalize_model_grads_func = lambda models, _n=None, *a, **k: (
            finalize_model_grads(models, None, *a, **k)
        )

    def _megatron_optimizer(self) -> Any:
        """megatron-core's distributed optimizer over the DDP-wrapped model. Its process-group
        setup runs on a CPU; the optimizer itself allocates on CUDA (``optimizer.py``:
        ``torch.tensor(..., device='cuda')``) and takes only ``torch.cuda.*Tensor`` parameters
        (``distrib_optimizer.py``)."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from .megatron_parallel import GLOO_GROUPS

        s = self.settings
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=s.learning_rate,
            weight_decay=s.weight_decay,
            adam_beta1=s.adam_beta1,
            adam_beta2=s.adam_beta2,
            adam_eps=s.adam_eps,
            clip_grad=s.grad_clip or 0.0,
            bf16=self.config.bf16,
            fp16=self.config.fp16,
            params_dtype=self.config.params_dtype,
            use_distributed_optimizer=True,
        )
        return get_megatron_optimizer(opt_config, [self.ddp], use_gloo_process_groups=GLOO_GROUPS)

    def _micro_weights(self, counts: list[float], global_count: float) -> list[float]:
        """Each micro-batch loss's weight: its share of the mini-batch's units over every
        data-parallel worker; times the data-parallel size where the gradients are then
        AVERAGED (the CPU path's all-reduce), not where they are SUMMED (megatron's DDP under
        ``calculate_per_token_loss``)."""
        from .torch_backend.optimiser import accumulation_weights

        averaged = self.ddp is None
        return accumulation_weights(counts, global_count, self.shard.dp_size if averaged else 1)

    @property
    def _train_module(self) -> Any:
        return self.ddp if self.ddp is not None else self.model

    # -- forward and backward ------------------------------------------------------------------
    def plan(self, batch: Mapping[str, torch.Tensor], max_rows: int | None) -> list[torch.Tensor]:
        """Row indices of ``batch``'s micro-batches: ``max_rows`` rows at a time, or with
        ``maxTokensPerMicroBatch`` the torch backend's token-budget planner
        (:func:`~.torch_backend.packing.micro_batch_rows`: first-fit decreasing when packed); every
        rank of a model-parallel group plans the same batch alike."""
        from .torch_backend.packing import micro_batch_rows

        s = self.settings
        return micro_batch_rows(
            batch, s.max_tokens_per_micro_batch, packing=s.packing, max_rows=max_rows
        )

    def _inputs(self, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The micro-batch ``mb`` (padded to its own longest prompt and response) with the
        model's inputs: ``_ids`` [b, L] left-aligned rows, or with ``packing`` [1, N] one packed
        row (``_pos``: positions restarting per sequence, ``_lengths``: the sequences' lengths);
        ``_index`` [b, T]: the position of
        the output that predicts each response token (in the packed row: 0 for padding)."""
        from .torch_backend.memory import trim_padding
        from .torch_backend.packing import pack_rows

        mb, _ = trim_padding(mb)
        pad_to = self.shard.tp_size if self.sequence_parallel else 1
        if not self.settings.packing:
            ids, index = left_aligned(mb, pad_to)
            mb["_ids"], mb["_index"] = ids.to(self.device), index.to(self.device)
            return mb
        ids, pos, select, rows, cols = pack_rows(mb)
        tail = -ids.shape[1] % pad_to  # one more sequence of padding (sequence parallelism)
        if tail:
            ids = torch.cat([ids, ids.new_zeros(1, tail)], 1)
            pos = torch.cat([pos, torch.arange(tail)[None]], 1)
        index = torch.zeros(mb["response_ids"].shape, dtype=torch.long)
        index[rows, cols] = select
        mb["_ids"], mb["_pos"] = ids.to(self.device), pos.to(self.device)
        mb["_index"] = index.to(self.device)
        mb["_lengths"] = torch.tensor(packed_lengths(pos))  # on the CPU: no device sync
        return mb

    def run(
        self,
        batch: Mapping[str, torch.Tensor],
        plan: int | list[torch.Tensor],
        head: Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, Any]],
        *,
        forward_only: bool,
        reference: bool = False,
    ) -> list[Any]:
        """Run ``batch`` in micro-batches (the row indices of ``plan``, or runs of ``plan``
        rows) through megatron-core's schedule, each padded to its own longest sequence, or
        packed into one row with ``packing``.

        ``head(output, micro_batch)`` runs on the last stage and returns ``(loss, payload)``;
        the payloads of the micro-batches come back in ``plan``'s order (on the last stage; []
        elsewhere). ``output`` is [b, L, ...], or [1, N, ...] for a packed row: read it at
        ``micro_batch["_index"]`` with :func:`_at_index`."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        model = self.reference if reference else self._train_module
        n = batch["response_ids"].shape[0]
        if isinstance(plan, int):
            plan = [torch.arange(sl.start, sl.stop) for sl in _split(n, plan)]
        micros = [self._inputs({k: v[idx] for k, v in batch.items()}) for idx in plan]
        packed, te = self.settings.packing, self.te

        def step(data: Iterator[dict[str, torch.Tensor]], module: Any) -> tuple[Any, Any]:
            mb = next(data)
            length = mb["_ids"].shape[1]
            if not packed:
                mask = None if self.gpu else _causal_mask(length, self.device)
                out = module(input_ids=mb["_ids"], position_ids=None, attention_mask=mask)
            elif te:  # pragma: no cover - Transformer Engine needs CUDA
                params = packed_seq_params(mb["_lengths"].tolist(), self.device)
                out = module(
                    input_ids=mb["_ids"],
                    position_ids=mb["_pos"],
                    attention_mask=None,
                    packed_seq_params=params,
                )
            else:
                mask = block_causal_mask(mb["_lengths"].tolist(), self.device)
                with rope_positions(module, mb["_pos"]):
                    out = module(input_ids=mb["_ids"], position_ids=mb["_pos"], attention_mask=mask)

            def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
                loss, payload = head(output, mb)
                return loss, torch.tensor(1, dtype=torch.int), payload

            return out, loss_func

        if not self.gpu:
            return self._cpu_schedule(model, micros, step, forward_only=forward_only)
        return get_forward_backward_func()(  # pragma: no cover - needs CUDA
            forward_step_func=step,
            data_iterator=iter(micros),
            model=[model],
            num_microbatches=len(micros),
            seq_length=max(mb["_ids"].shape[1] for mb in micros),
            micro_batch_size=max(mb["_ids"].shape[0] for mb in micros),
            forward_only=forward_only,
        )

    @staticmethod
    def assemble(plan: list[torch.Tensor], parts: list[torch.Tensor], width: int) -> Any:
        """The [B, width] result of the micro-batches' [b, T'] ``parts`` (rows ``plan``), in
        the batch's row order; None where ``parts`` is empty (not the last stage)."""
        from .torch_backend.memory import _pad_columns

        if not parts:
            return None
        out = torch.zeros(sum(len(idx) for idx in plan), width, dtype=parts[0].dtype)
        for idx, part in zip(plan, parts, strict=True):
            out[idx] = _pad_columns(part, width)
        return out

    def _cpu_schedule(
        self,
        model: Any,
        micros: list[dict[str, torch.Tensor]],
        step: Callable[..., Any],
        *,
        forward_only: bool,
    ) -> list[Any]:
        """Forward (and backward) of each micro-batch through the pipeline stages in turn.

        megatron-core 0.16's schedules cannot run without CUDA: ``forward_backward_no_pipelining``
        and ``forward_backward_pipelining_without_interleaving`` allocate their token counter
        with ``torch.zeros([], dtype=torch.int, device="cuda")`` (schedules.py lines 596 and
        2138). On the CPU this schedule does what they do for one micro-batch at a time: the
        stage's input from the previous stage (``set_input_tensor``), forward, the loss on the
        last stage, and the gradients back through the stages (point-to-point over gloo)."""
        import torch.distributed as dist

        ps, pp = self.ps, self.shard.pp_size
        group = ps.get_pipeline_model_parallel_group() if pp > 1 else None
        prev_rank = ps.get_pipeline_model_parallel_prev_rank() if pp > 1 else None
        next_rank = ps.get_pipeline_model_parallel_next_rank() if pp > 1 else None
        results = []
        for mb in micros:
            b, length = mb["_ids"].shape
            inp = None
            if not self.first:
                inp = torch.empty(length, b, self.shape.hidden, dtype=self.config.params_dtype)
                dist.recv(inp, src=prev_rank, group=group)
                inp.requires_grad_(not forward_only)
                model.set_input_tensor(inp)
            out, loss_func = step(iter([mb]), model)
            if self.last:
                loss, _, payload = loss_func(out)
                results.append(payload)
                if not forward_only:
                    loss.backward()
            else:
                dist.send(out.detach().contiguous(), dst=next_rank, group=group)
                if not forward_only:
                    grad = torch.empty_like(out)
                    dist.recv(grad, src=next_rank, group=group)
                    torch.autograd.backward(out, grad)
            if inp is not None and not forward_only:
                dist.send(inp.grad.contiguous(), dst=prev_rank, group=group)
        return results

    def from_last_stage(self, obj: Any) -> Any:
        """``obj`` of the last pipeline stage, on every stage."""
        if self.shard.pp_size == 1:
            return obj
        import torch.distributed as dist

        group = self.ps.get_pipeline_model_parallel_group()
        src = dist.get_global_rank(group, self.shard.pp_size - 1)
        box = [obj if self.last else None]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    # -- one update ----------------------------------------------------------------------------
    def update(
        self,
        minibatch: Mapping[str, torch.Tensor],
        micro: int,
        agg: str,
        micro_loss: Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict]],
    ) -> dict[str, float]:
        """One optimizer update over ``minibatch`` (the weights of the micro-batches as in the
        torch backend: each micro-batch's loss times its share of the mini-batch's tokens)."""
        from ..algorithms import aggregation_count

        n = minibatch["response_ids"].shape[0]
        budget = self.settings.max_tokens_per_micro_batch
        plan = self.plan(minibatch, self.settings.micro_batch_size if budget is not None else micro)
        mask = minibatch.get("loss_mask", minibatch.get("response_mask"))
        counts = (
            [float(len(idx)) for idx in plan]
            if mask is None
            else [float(aggregation_count(mask[idx], agg)) for idx in plan]
        )
        total = self._dp_sum(sum(counts))
        if total == 0 and "loss_mask" in minibatch:  # every sample left out of the loss
            return {"skipped_updates": 1.0}
        weights = self._micro_weights(counts, total)
        state = {"i": 0}

        def head(output: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
            i = state["i"]
            state["i"] += 1
            loss, metrics = micro_loss(output, mb)
            return loss * weights[i], (len(plan[i]) / n, metrics)

        self.model.train()
        if self.ddp is not None:
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
        parts = self.run(minibatch, plan, head, forward_only=False)
        out: dict[str, float] = {}
        for rows, metrics in parts:
            for k, v in metrics.items():
                out[k] = out.get(k, 0.0) + rows * float(v)
        out = self.from_last_stage(out)
        out.update(self._step())
        return out

    def _dp_sum(self, local: float) -> float:
        if self.shard.dp_size == 1:
            return float(local)
        import torch.distributed as dist

        t = torch.tensor([float(local)], dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(t, group=self.ps.get_data_parallel_group())
        return float(t.item())

    @property
    def _comm_device(self) -> torch.device:
        return self.device

    def _lr(self) -> float:
        from .torch_backend.common import lr_factor

        return self.settings.learning_rate * lr_factor(
            self.updates, self.settings, self.total_updates
        )

    def _step(self) -> dict[str, float]:
        lr = self._lr()
        if self.ddp is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            ok, norm, _ = self.optimizer.step()
            self.updates += 1
            return {"grad_norm": float(norm or 0.0), "lr": lr, "skipped": float(not ok)}
        import torch.distributed as dist

        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.shard.dp_size > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in self.params])
            dist.all_reduce(flat, group=self.ps.get_data_parallel_group())
            flat /= self.shard.dp_size
            offset = 0
            for p in self.params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        norm = self._global_grad_norm()
        clip = self.settings.grad_clip
        if clip:
            coef = min(1.0, clip / (norm + 1e-6))
            if coef < 1.0:
                for p in self.params:
                    p.grad.mul_(coef)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        return {"grad_norm": norm, "lr": lr}

    def _global_grad_norm(self) -> float:
        """L2 norm of the whole model's gradient: tensor-parallel shards summed over the
        model-parallel group, weights replicated over tensor-parallel ranks counted once."""
        import torch.distributed as dist

        sq = torch.zeros(1, dtype=torch.float64)
        for p in self.params:
            if getattr(p, "tensor_model_parallel", False) or self.shard.tp_rank == 0:
                sq += p.grad.double().pow(2).sum()
        if self.shard.tp_size * self.shard.pp_size > 1:
            dist.all_reduce(sq, group=self.ps.get_model_parallel_group())
        return float(sq.sqrt())

    # -- gathering and checkpoints -------------------------------------------------------------
    def _gather(self, local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """HF-named full tensors from every model-parallel rank's ``local`` megatron-named
        tensors, on model-parallel rank 0 (None elsewhere). Collective over that group."""
        import torch.distributed as dist

        local = {k: v.detach().to("cpu") for k, v in local.items()}
        s = self.shard
        if s.tp_size * s.pp_size == 1:
            pieces = [local]
        else:
            group = self.ps.get_model_parallel_group()
            dst = dist.get_global_rank(group, 0)
            rank = dist.get_rank(group)
            pieces = [None] * dist.get_world_size(group) if rank == 0 else None
            dist.gather_object((s.pp_rank, s.tp_rank, local), pieces, dst=dst, group=group)
            if rank != 0:
                return None
            grid: list[list[Any]] = [[None] * s.tp_size for _ in range(s.pp_size)]
            for pp, tp, sd in pieces:
                grid[pp][tp] = sd
            return megatron_to_hf(grid, self.shape, value=self.value)
        return megatron_to_hf([pieces], self.shape, value=self.value)

    def _local_weights(self, model: Any) -> dict[str, torch.Tensor]:
        """The shard's weights under the local layer spec's names."""
        out = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        return _rename(out, [(b, a) for a, b in TE_NORMS])

    def gathered_weights(self) -> dict[str, torch.Tensor]:
        """HF-named weights on the role's leader ({} elsewhere). Every worker calls it."""
        if self.shard.dp_rank != 0 or self.shard.cp_rank != 0:
            return {}
        return self._gather(self._local_weights(self.model)) or {}

    def weight_stream(self, max_bytes: int) -> WeightStream:
        """The HF-named weights in buckets of at most ``max_bytes``, each assembled when asked
        for, on the weights' device, with tensor collectives (no pickled state dicts).

        The plan (:func:`~.megatron_convert.hf_layout`, bucketed by bytes) follows from the
        model's shape alone, so every rank computes the same one without communicating. Each
        tensor of a bucket is made by its pipeline stage: the tensor-parallel ranks there
        all-gather their pieces (a replicated tensor: tensor-parallel rank 0's copy, broadcast)
        and convert them (:func:`~.megatron_convert.hf_from_pieces`); the stage then
        broadcasts it over the pipeline group. Every worker of the role thus holds each bucket
        in turn (colocated engines stage it from their own GPU), and the collectives stay
        within one data-parallel (and context-parallel) replica's tensor and pipeline groups:
        replicas never wait on each other, and every worker of a replica walks the same
        buckets in the same order."""
        layout = hf_layout(self.shape, self.shard.pp_size, value=self.value)
        local = self._local_weights(self.model)
        mine = next(t for t in layout if t.stage == self.shard.pp_rank)
        dtype = local[mine.key].dtype  # every stage builds its weights in the config's dtype
        size = dtype.itemsize
        by_name = {t.name: t for t in layout}
        plan = plan_buckets(((t.name, size * math.prod(t.shape)) for t in layout), max_bytes)

        def produce(names: list[str]) -> dict[str, torch.Tensor]:
            return {n: self._hf_tensor(by_name[n], local, dtype) for n in names}

        return WeightStream(plan, produce)

    def _hf_tensor(
        self, t: HfTensor, local: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> torch.Tensor:
        """HF tensor ``t`` on this worker (collective over its stage's tensor-parallel group
        and its pipeline group)."""
        import torch.distributed as dist

        s = self.shard
        if t.stage == s.pp_rank:
            piece = local[t.key].detach()
            if s.tp_size == 1:
                pieces = [piece]
            elif t.split:
                pieces = [torch.empty_like(piece) for _ in range(s.tp_size)]
                dist.all_gather(
                    pieces, piece.contiguous(), group=self.ps.get_tensor_model_parallel_group()
                )
            else:
                pieces = [piece.clone()]
                group = self.ps.get_tensor_model_parallel_group()
                dist.broadcast(pieces[0], group=group, group_src=0)
            out = hf_from_pieces(self.shape, t, pieces)
            del pieces
        else:
            out = torch.empty(t.shape, dtype=dtype, device=self.device)
        if s.pp_size > 1:
            group = self.ps.get_pipeline_model_parallel_group()
            dist.broadcast(out, group=group, group_src=t.stage)
        return out

    def state_dict(self) -> dict[str, object]:
        """Gathered HF-named weights and Adam moments (resumable under any parallel layout);
        on the role's leader ({} elsewhere). Every worker calls it. Under megatron's
        distributed optimizer also its fp32 main weights (``master``): each data-parallel rank
        holds a slice of every one, assembled here, so a resume continues from them exactly."""
        names = {id(p): k for k, p in self.model.named_parameters()}
        master = None
        if self.ddp is not None:
            moments, step, master = self._distributed_adam_state(names)
        else:
            moments = {k: {} for k in ADAM_KEYS}
            steps = []
            for p in self.params:
                st = self.optimizer.state.get(p, {})
                for k in ADAM_KEYS:
                    moments[k][names[id(p)]] = st[k] if k in st else torch.zeros_like(p)
                steps.append(float(st["step"]) if "step" in st else 0.0)
            step = max(steps, default=0.0)
        if self.shard.dp_rank != 0 or self.shard.cp_rank != 0:
            return {}
        te = [(b, a) for a, b in TE_NORMS]
        model = self._gather(self._local_weights(self.model))
        adam = {k: self._gather(_rename(moments[k], te)) for k in ADAM_KEYS}
        main = self._gather(_rename(master, te)) if master is not None else None
        if model is None:
            return {}
        out = {"model": model, "adam": adam, "adam_step": step, "updates": self.updates}
        if main is not None:
            out["master"] = main
        return out

    def _distributed_adam_state(
        self, names: Mapping[int, str]
    ) -> tuple[dict[str, dict[str, torch.Tensor]], float, dict[str, torch.Tensor]]:
        """(Adam moments by local parameter name, step, fp32 main weights) of megatron's
        distributed optimizer, whole on every data-parallel rank (a collective over the
        data-parallel group: each rank fills the slice of each parameter it owns)."""
        import torch.distributed as dist

        keys = (*ADAM_KEYS, "param")
        full: dict[str, dict[str, torch.Tensor]] = {k: {} for k in keys}
        step = torch.zeros(1, dtype=torch.float64)
        owners = self._distributed_owners()
        for p in self.model.parameters():
            if not p.requires_grad:
                continue
            for k in keys:
                full[k][names[id(p)]] = torch.zeros(p.numel(), dtype=torch.float32)
            if p not in owners:
                continue
            opt, rng = owners[p]
            tensors = opt._get_main_param_and_optimizer_states(p)
            for k in keys:
                if k in tensors:
                    full[k][names[id(p)]][rng.start : rng.end] = tensors[k].detach().float().cpu()
            if "step" in tensors:
                step = torch.maximum(step, tensors["step"].detach().double().cpu().reshape(1))
        if self.shard.dp_size > 1:
            group = self.ps.get_data_parallel_group()
            flat = torch.cat([t for k in keys for t in full[k].values()]).to(self._comm_device)
            dist.all_reduce(flat, group=group)  # the slices are disjoint: a sum assembles them
            flat = flat.cpu()
            offset = 0
            for k in keys:
                for name, t in full[k].items():
                    full[k][name] = flat[offset : offset + t.numel()]
                    offset += t.numel()
            step = step.to(self._comm_device)
            dist.all_reduce(step, op=dist.ReduceOp.MAX, group=group)
        params = dict(self.model.named_parameters())
        shaped = {k: {n: t.view(params[n].shape) for n, t in full[k].items()} for k in keys}
        master = shaped.pop("param")
        return shaped, float(step.item()), master

    def _distributed_owners(self) -> dict[Any, tuple[Any, Any]]:
        """Model parameter -> (the distributed optimizer holding a slice of it on this rank, the
        slice's range in the flattened parameter)."""
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        owners = {}
        for opt in chained:
            for p in getattr(opt, "model_param_group_index_map", {}):
                owners[p] = (opt, opt._get_model_param_range_map(p)["param"])
        return owners

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict` (each worker cuts its own shard)."""
        self._load_local(self.model, self._local_from_hf(state["model"]))
        self.updates = int(state["updates"])
        if self.ddp is not None:
            self._load_distributed(state)
            return
        if "adam" not in state:
            return
        params = dict(self.model.named_parameters())
        local = {
            k: self._local_from_hf(_with_frozen(state["adam"][k], state["model"]))
            for k in ADAM_KEYS
        }
        step = torch.tensor(float(state["adam_step"]))
        self.optimizer.state.clear()
        for name, p in params.items():
            if p.requires_grad:
                self.optimizer.state[p] = {
                    "step": step.clone(),
                    **{k: local[k][name].clone().to(p.dtype) for k in ADAM_KEYS},
                }

    def _load_distributed(self, state: Mapping[str, Any]) -> None:
        """megatron's distributed optimizer after the model's weights were loaded: its fp32
        main weights follow them (``reload_model_params``; without it the next step writes the
        old main weights back: a resume would return to the initial weights), then each rank's
        slices of the saved main weights and Adam moments, and the step."""
        owners = self._distributed_owners()
        if "adam" in state:  # Adam's state must exist before it is overwritten
            for opt in {id(o): o for o, _ in owners.values()}.values():
                main = [p for g in opt.optimizer.param_groups for p in g["params"]]
                if any(not opt.optimizer.state.get(p) for p in main):
                    opt._init_optimizer_states_with_dummy_values()
        self.optimizer.reload_model_params()
        if "adam" not in state:
            return
        te = any(k.endswith(TE_NORMS[0][1]) for k in dict(self.model.named_parameters()))

        def local(hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            out = self._local_from_hf(_with_frozen(hf, state["model"]))
            return _rename(out, TE_NORMS) if te else out

        saved = {k: local(state["adam"][k]) for k in ADAM_KEYS}
        if "master" in state:
            saved["param"] = local(state["master"])
        names = {id(p): k for k, p in self.model.named_parameters()}
        step = float(state["adam_step"])
        for p, (opt, rng) in owners.items():
            name = names[id(p)]
            current = opt._get_main_param_and_optimizer_states(p)
            tensors = {
                k: saved[k][name].reshape(-1)[rng.start : rng.end].to(current[k])
                for k in saved
                if k in current
            }
            with torch.no_grad():
                opt._set_main_param_and_optimizer_states(p, {**current, **tensors})
                if "step" in current:
                    current["step"].fill_(step)


def _with_frozen(moments: Mapping[str, torch.Tensor], model: Mapping[str, torch.Tensor]) -> dict:
    """``moments`` completed with the model's entries it lacks (tied weights), for the
    conversion, which expects every HF name."""
    return {**{k: torch.zeros_like(v) for k, v in model.items()}, **moments}


# ---------------------------------------------------------------------------------------------
# Log-probs and entropy from vocabulary-parallel logits, a chunk of positions at a time
# ---------------------------------------------------------------------------------------------
LOGITS_CHUNK_TOKENS = 1024
"""Positions whose vocabulary-parallel logits exist at once (:func:`chunked_vocab_stats`): a
[1024, V/tp] float32 chunk, not the micro-batch's [b, L, V/tp] logits and their gradient (the
torch backend's chunk, and the one ``memory_plan`` counts for every backend)."""


def _select(output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of ``output`` [b, L, ...] at positions ``index`` [b, T]."""
    idx = index.view(*index.shape, *([1] * (output.dim() - 2))).expand(
        *index.shape, *output.shape[2:]
    )
    return output.gather(1, idx)


def _at_index(output: torch.Tensor, mb: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``output`` [b, L, ...] (or [1, N, ...] for a packed row) at the micro-batch's
    ``_index`` [b, T]: [b, T, ...]."""
    if "_pos" in mb:
        return output[0][mb["_index"]]
    return _select(output, mb["_index"])


def vocab_parallel_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] with ``logits`` split over the tensor-parallel vocabulary."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # megatron-core's cross entropy overwrites its input (max subtracted, exponentiated in
    # place): hand it a copy so the caller's logits (entropy) stay intact.
    x = logits.clone() if logits.dtype == torch.float32 else logits.float()
    return -vocab_parallel_cross_entropy(x, tokens)


def vocab_parallel_entropy(logits: torch.Tensor, *, grad: bool) -> torch.Tensor:
    """Entropy of softmax(logits) per position, ``logits`` split over the vocabulary.

    Over tensor-parallel ranks from three all-reduced per-position numbers (the max m, the
    sums z of exp(x - m) and s of exp(x - m) * (m - x); H = log z + s / z, a sum of two
    non-negative terms), never the gathered vocabulary. With ``grad`` the sums go through
    ``reduce_from_tensor_model_parallel_region`` (backward: the identity, each rank's gradient
    flowing to its own slice); the max is a constant shift (H does not depend on it), so it
    carries no gradient."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        logp = torch.log_softmax(logits.float(), -1)
        return -(logp.exp() * logp).sum(-1)
    import torch.distributed as dist

    group = ps.get_tensor_model_parallel_group()
    x = logits.float() if grad else logits.detach().float()
    m = x.detach().max(-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    d = m[..., None] - x  # >= 0 on every rank
    e = (-d).exp()
    z, sd = e.sum(-1), (e * d).sum(-1)
    if grad:
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

        z = reduce_from_tensor_model_parallel_region(z)
        sd = reduce_from_tensor_model_parallel_region(sd)
    else:
        dist.all_reduce(z, group=group)
        dist.all_reduce(sd, group=group)
    return z.log() + sd / z


def _vocab_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """[n, V/tp] float32 logits of hidden states [n, h] over this rank's vocabulary slice
    ``weight`` [V/tp, h], divided by the sampling temperature in float32 (in bf16 the quotient
    would lose all but 8 mantissa bits)."""
    return torch.nn.functional.linear(hidden, weight).float() / temperature


def _chunk_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    entropy: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = _vocab_logits(hidden, weight, temperature)
    logp = vocab_parallel_logprobs(logits, tokens)
    if entropy is None:
        return logp, logp.new_zeros(0)
    if entropy == "grad":
        return logp, vocab_parallel_entropy(logits, grad=True)
    with torch.no_grad():
        return logp, vocab_parallel_entropy(logits, grad=False)


def chunked_vocab_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    *,
    entropy: str | None = None,
    chunk_tokens: int = LOGITS_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``tokens`` [b, T] (and with ``entropy`` "grad" or "nograd" the entropy)
    from the final hidden states [b, T, h] and this rank's vocabulary slice ``weight``.

    The projection runs ``chunk_tokens`` positions at a time and each chunk's [chunk, V/tp]
    logits are reduced (megatron-core's vocabulary-parallel cross entropy, the entropy's sums)
    before the next chunk's exist. With gradients each chunk is recomputed in backward
    (``torch.utils.checkpoint``) instead of keeping its logits. Every tensor-parallel rank
    holds the same hidden states, so every rank runs the same chunks and the same collectives
    in the same order, forward and in the recomputation.
    """
    b, t, h = hidden.shape
    n = b * t
    flat, toks = hidden.reshape(n, h), tokens.reshape(n)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    recompute = grad and n > chunk_tokens  # one chunk: nothing to free between chunks
    lps, ents = [], []
    for s in range(0, max(n, 1), chunk_tokens):
        args = (flat[s : s + chunk_tokens], weight, toks[s : s + chunk_tokens], temperature)
        if recompute:
            from torch.utils.checkpoint import checkpoint

            lp, ent = checkpoint(_chunk_stats, *args, entropy, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(*args, entropy)
        lps.append(lp)
        ents.append(ent)
    logp = torch.cat(lps).view(b, t)
    return logp, (torch.cat(ents).view(b, t) if entropy is not None else None)


def emit_hidden_states(model: Any) -> None:
    """Make the last stage of the GPT model ``model`` return its final hidden states [b, L, h]
    instead of the vocabulary-parallel logits [b, L, V/tp] (:func:`chunked_vocab_stats` projects
    them a chunk at a time).

    ``GPTModel._postprocess`` calls ``output_layer(hidden [L, b, h], weight=<the embedding's
    weight when tied>)`` and returns its first output transposed to [b, L, ...]; the output
    layer (a ``ColumnParallelLinear``, its weight split over the vocabulary) is replaced by
    what it does to its input before the matmul: the all-gather over the sequence under
    sequence parallelism (backward: the reduce-scatter that sums the ranks' partial input
    gradients), else the identity whose backward all-reduces them over tensor-parallel ranks
    (:class:`_SumGradOverRanks`).
    Its weight stays where it is (``output_weight``), as do its state-dict keys."""
    if not getattr(model, "post_process", False):
        return
    layer = model.output_layer

    def forward(input_: torch.Tensor, weight: Any = None, **_: Any) -> tuple[torch.Tensor, None]:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        if layer.sequence_parallel:
            return gather_from_sequence_parallel_region(input_, group=layer.tp_group), None
        if layer.disable_grad_reduce or layer.tp_group.size() == 1:
            return input_, None
        return _SumGradOverRanks.apply(input_, layer.tp_group), None

    layer.forward = forward


class _SumGradOverRanks(torch.autograd.Function):
    """The identity; backward: the gradient all-reduced over ``group``. (megatron-core's
    ``copy_to_tensor_model_parallel_region`` all-reduces ``grad.contiguous()`` and returns the
    gradient it was given: a non-contiguous gradient, as the transpose after the output layer
    hands back, would come back unreduced.)"""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def output_weight(model: Any) -> torch.Tensor:
    """The vocabulary-parallel projection [V/tp, h] of a last stage: the output layer's weight,
    or the input embedding's where they are tied and this stage holds it (what ``GPTModel``
    passes its output layer)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


# ---------------------------------------------------------------------------------------------
# The trainers
# ---------------------------------------------------------------------------------------------
class MegatronPolicyTrainer(PolicyTrainer):
    """The actor on megatron-core (reference model: a frozen shard of the same layout)."""

    export_is_collective = True

    def __init__(
        self,
        cfg: Any,
        model_dir: Path,
        shard: ShardIdentity,
        *,
        need_reference: bool,
        total_updates: int = 1,
        device: str = "cpu",
        need_entropy: bool = True,
    ) -> None:
        self.temperature = float(cfg.data.temperature)
        self.need_entropy = need_entropy
        self.entropy_grad = cfg.algorithm.entropy_coefficient > 0
        self.m = _Sharded(
            Path(model_dir),
            cfg.model.dtype,
            shard,
            cfg.training,
            total_updates=total_updates,
            value=False,
            device=device,
            seed=cfg.training.seed,
            sequence_parallel=cfg.roles.actor.parallelism.sequence_parallel,
            frozen_copy=need_reference,
        )
        self.logits_chunk = LOGITS_CHUNK_TOKENS
        for model in (self.m.model, self.m.reference):
            if model is not None:
                emit_hidden_states(model)
        self.micro = cfg.training.micro_batch_size

    def _token_stats(
        self,
        model: Any,
        output: torch.Tensor,
        mb: Mapping[str, torch.Tensor],
        entropy: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of the response tokens (and their entropy) from ``model``'s final hidden
        states ``output`` [b, L, h] (:func:`emit_hidden_states`) at the response positions,
        projected onto this rank's vocabulary slice ``logits_chunk`` positions at a time."""
        hidden = _at_index(output, mb)
        tokens = mb["response_ids"].to(hidden.device)
        return chunked_vocab_stats(
            hidden,
            output_weight(model),
            tokens,
            self.temperature,
            entropy=entropy,
            chunk_tokens=self.logits_chunk,
        )

    @torch.no_grad()
    def logprobs(
        self, batch: Mapping[str, torch.Tensor], *, reference: bool = False
    ) -> torch.Tensor:
        if reference and self.m.reference is None:
            raise ValueError("logprobs(reference=True) needs a reference model (KL is off)")
        model = self.m.reference if reference else self.m.model
        n = batch["response_ids"].shape[0]

        def head(output: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
            logp, _ = self._token_stats(model, output, mb)
            return output.new_zeros(()), logp.cpu()

        plan = self.m.plan(batch, self.micro or n)
        with _eval_mode(model):
            parts = self.m.run(batch, plan, head, forward_only=True, reference=reference)
        width = batch["response_ids"].shape[1]
        return self.m.from_last_stage(self.m.assemble(plan, parts, width))

    def update(
        self,
        minibatch: Mapping[str, torch.Tensor],
        loss_fn: PolicyLossFn,
        micro_batch_size: int,
        agg: str = "token-mean",
    ) -> dict[str, float]:
        entropy = None
        if self.need_entropy:
            entropy = "grad" if self.entropy_grad else "nograd"

        def micro_loss(output: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[Any, Any]:
            logp, ent = self._token_stats(self.m.model, output, mb, entropy)
            return loss_fn(logp, ent, _loss_inputs(mb, logp.device))

        return self.m.update(minibatch, micro_batch_size, agg, micro_loss)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """HF-named weights, on the role's leader ({} on every other worker). A collective:
        every worker of the role calls it (``export_is_collective``)."""
        return self.m.gathered_weights()

    def export_weight_stream(self, max_bytes: int) -> WeightStream:
        """:meth:`export_weights` in buckets of at most ``max_bytes``, each assembled when asked
        for with tensor collectives on the weights' device (:meth:`_Sharded.weight_stream`).
        Every worker of the role gets every bucket; every worker must walk the stream (a
        collective within its data-parallel replica)."""
        return self.m.weight_stream(max_bytes)

    def state_dict(self) -> dict[str, object]:
        return self.m.state_dict()

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self.m.load_state_dict(state)


class MegatronValueTrainer(ValueTrainer):
    """The critic on megatron-core: the policy's architecture with a value head."""

    export_is_collective = True

    def __init__(
        self,
        cfg: Any,
        model_dir: Path,
        shard: ShardIdentity,
        *,
        total_updates: int = 1,
        device: str = "cpu",
    ) -> None:
        critic = cfg.roles.effective_critic(True)
        settings = cfg.critic_training()
        self.m = _Sharded(
            Path(model_dir),
            cfg.model.dtype,
            shard,
            settings,
            total_updates=total_updates,
            value=True,
            device=device,
            seed=cfg.training.seed,
            sequence_parallel=critic.parallelism.sequence_parallel,
        )
        self.micro = settings.micro_batch_size

    @staticmethod
    def _values(output: torch.Tensor, mb: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return _at_index(output.squeeze(-1), mb).float()

    @torch.no_grad()
    def values(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        n = batch["response_ids"].shape[0]

        def head(output: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
            return output.new_zeros(()), self._values(output, mb).cpu()

        plan = self.m.plan(batch, self.micro or n)
        with _eval_mode(self.m.model):
            parts = self.m.run(batch, plan, head, forward_only=True)
        width = batch["response_ids"].shape[1]
        return self.m.from_last_stage(self.m.assemble(plan, parts, width))

    def update(
        self,
        minibatch: Mapping[str, torch.Tensor],
        loss_fn: ValueLossFn,
        micro_batch_size: int,
        agg: str = "token-mean",
    ) -> dict[str, float]:
        def micro_loss(output: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[Any, Any]:
            values = self._values(output, mb)
            return loss_fn(values, _loss_inputs(mb, values.device))

        return self.m.update(minibatch, micro_batch_size, agg, micro_loss)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The critic's HF-named weights (backbone, ``value_head.*``) on its leader."""
        return self.m.gathered_weights()

    def export_weight_stream(self, max_bytes: int) -> WeightStream:
        """:meth:`export_weights` bucket by bucket, as the actor's
        (:meth:`MegatronPolicyTrainer.export_weight_stream`)."""
        return self.m.weight_stream(max_bytes)

    def state_dict(self) -> dict[str, object]:
        return self.m.state_dict()

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self.m.load_state_dict(state)


def _loss_inputs(mb: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The micro-batch a loss function sees: its tensors on the device of the log-probs or
    values it is combined with (the batch crosses the seam on the CPU; the model's output is on
    the GPU), without the schedule's own ``_ids``/``_index``."""
    return {k: v.to(device) for k, v in mb.items() if not k.startswith("_")}


@contextmanager
def _eval_mode(module: Any) -> Iterator[None]:
    was = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was)


__all__ = [
    "LOGITS_CHUNK_TOKENS",
    "MegatronPolicyTrainer",
    "MegatronValueTrainer",
    "chunked_vocab_stats",
    "emit_hidden_states",
    "left_aligned",
    "output_weight",
    "vocab_parallel_entropy",
    "vocab_parallel_logprobs",
]
