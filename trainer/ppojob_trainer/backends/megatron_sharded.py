"""One role's sharded megatron-core model, optimizer and schedule (:class:`_Sharded`): the model
converted from the Hugging Face checkpoint, the CPU (``torch.optim.AdamW``) or GPU (megatron-core's
DDP and distributed optimizer) optimizer path, forward and backward through megatron-core's
pipeline schedule, checkpoints and the weight stream in the Hugging Face layout."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ppojob_api.training import TrainingSettings

from ..distributed import ShardIdentity
from .megatron_convert import (
    STACKED_FC1,
    STACKED_FC2,
    HfTensor,
    ModelShape,
    checkpoint_names,
    hf_from_pieces,
    hf_layout,
    hf_to_megatron,
    local_from_slices,
    megatron_to_hf,
    parallel_problems,
    stack_experts,
    stage_pieces,
    unstack_experts,
)
from .megatron_inputs import (
    _causal_mask,
    _split,
    block_causal_mask,
    left_aligned,
    packed_lengths,
    packed_seq_params,
    rope_positions,
)
from .weight_sync import WeightStream, plan_buckets

log = logging.getLogger(__name__)

ADAM_KEYS = ("exp_avg", "exp_avg_sq")
# Transformer Engine's layer spec fuses the norms into the following linear layers.
TE_NORMS = [
    ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
]


DISTRIB_OPTIM_SHARDING = "dp_reshardable"
"""The format of the distributed optimizer's (GPU) sharded state: megatron-core 0.16.1 refuses
its deprecated default, ``fully_sharded_model_space`` (a ShardedTensor with ``flattened_range``,
which dist_checkpointing's mapping rejects); ``dp_reshardable``, Megatron-LM's default, saves
each rank's buffers in parallel and reshards across data-parallel sizes only (the fingerprint
keeps the other sizes: ``checkpoint.config_fingerprint``)."""


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


FUSED_KINDS = ("q", "k", "v", "gate", "up")
"""HF tensors cut from one fused megatron tensor (:class:`~.megatron_convert.HfTensor`)."""


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
        routing_replay: bool = False,
        router_aux_loss: float = 0.0,
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
        problems = parallel_problems(self.shape, shard.tp_size, shard.pp_size, shard.ep_size)
        if problems:
            what, fix = problems[0]
            raise ValueError(f"{field}.parallelism: {what}; {fix}")
        if shard.cp_size > 1 and not self.gpu:
            raise ValueError(f"{field}.parallelism.context: context parallelism needs GPUs; set 1")
        if self.shape.moe and shard.tp_size > 1 and not sequence_parallel:
            raise ValueError(
                f"{field}.parallelism.sequenceParallel: megatron-core trains a mixture-of-experts "
                f"model with tensor parallelism ({shard.tp_size}) only under sequence "
                f"parallelism; set sequenceParallel: true (GPUs with Transformer Engine) or "
                f"tensor: 1"
            )
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
            ep=shard.ep_size,
            sequence_parallel=self.sequence_parallel,
            role=shard.role,
        )
        self.config.calculate_per_token_loss = True  # the loss functions weigh micro-batches
        self.config.variable_seq_lengths = True  # micro-batches may differ in size

        local = self._local_source(model_dir, seed, dtype_name)
        self.model = self._new_model(build_model, local)
        # Transformer Engine's layer spec (its varlen attention takes packed rows as ``thd``),
        # else megatron-core's local attention (packed rows: a block-diagonal mask)
        self.te = any(k.endswith(TE_NORMS[0][1]) for k in self.model.state_dict())
        self.reference = None
        if frozen_copy:
            self.reference = self._new_model(build_model, local).eval()
            self.reference.requires_grad_(False)
        del local
        # routingReplay: the routers of each model by decoder layer (megatron_routing)
        self.routers: dict[str, dict[int, Any]] = {}
        self.routing_counts = [0.0, 0.0]  # (choices made as the engine's, choices compared)
        self.measure_routing = False
        self.fillers = 0  # micro-batches run only to match the expert-parallel ranks'
        # the routers' load-balancing losses of an update, row-weighted (a float or a tensor)
        self.balance_sum: Any = 0.0
        # routerAuxLossCoefficient: the load-balancing loss, through the same router hooks
        self.router_aux_loss = float(router_aux_loss)
        self.routing_replay = routing_replay
        if routing_replay or self.router_aux_loss > 0:
            from .megatron_convert import stage_layers
            from .megatron_routing import install

            first = stage_layers(self.shape, shard.pp_rank, shard.pp_size).start
            balance = None
            if self.router_aux_loss > 0:
                # the ranks that split a sequence's tokens: sequence parallelism's tensor ranks
                # (without it each tensor rank sees every token), the context ranks
                split_tp = self.sequence_parallel and shard.tp_size > 1
                if split_tp:
                    group = self.ps.get_tensor_and_context_parallel_group()
                elif shard.cp_size > 1:
                    group = self.ps.get_context_parallel_group()
                else:
                    group = None
                balance = (group, not self.shape.norm_topk)  # pre-softmax: scores are probs
            self.routers["model"] = install(self.model, first, balance)
            if self.reference is not None and routing_replay:
                self.routers["reference"] = install(self.reference, first)
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
    def _local_source(self, model_dir: Path, seed: int, dtype: str) -> Mapping[str, torch.Tensor]:
        """This rank's megatron tensors of the HF checkpoint in ``model_dir``, in the training
        dtype on the CPU: read slice by slice from its safetensors files when they hold every
        tensor the stage needs (:class:`_SliceShard`: the rank's host memory is about its shard),
        else (``.bin`` weights, other names) converted from the whole model loaded by
        ``transformers``."""
        from ..models import CheckpointSlices, torch_dtype, value_head_state

        slices = CheckpointSlices.open(model_dir)
        head = None
        if self.value:
            head = value_head_state(model_dir, self.shape.hidden, dtype, seed)
        if slices is not None:
            shard = _SliceShard(slices, self.shape, self.shard, torch_dtype(dtype), value_head=head)
            if not shard.missing:
                return shard
            log.warning(
                "megatron: %s lacks %s in its safetensors files; loading the whole model with "
                "transformers on every rank instead of each rank's slices",
                model_dir,
                shard.missing[:3],
            )
        return self._local_from_hf(self._load_hf(model_dir, seed, dtype))

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

    def _new_model(self, build_model: Callable[..., Any], local: Mapping[str, torch.Tensor]) -> Any:
        """A model of this rank's layout holding ``local`` (its megatron-named tensors)."""
        model = build_model(
            self.shape,
            self.config,
            pre_process=self.first,
            post_process=self.last,
            value=self.value,
            role=self.shard.role,
        )
        self._load_local(model, local)
        return model.to(self.device)

    def _local_from_hf(self, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        s = self.shard
        head = None
        if self.value:
            head = {"weight": hf["value_head.weight"], "bias": hf["value_head.bias"]}
        local = hf_to_megatron(
            hf,
            self.shape,
            s.tp_rank,
            s.tp_size,
            s.pp_rank,
            s.pp_size,
            value_head=head,
            ep_rank=s.ep_rank,
            ep_size=s.ep_size,
        )
        return unstack_experts(local)

    @staticmethod
    def _load_local(model: Any, local: Mapping[str, torch.Tensor]) -> None:
        params = {
            k: v
            for k, v in model.state_dict(keep_vars=True).items()
            if not k.endswith("_extra_state")
        }
        te = any(k.endswith(TE_NORMS[0][1]) for k in params)  # Transformer Engine's layer spec
        # keys only here: a _SliceShard reads a tensor when it is asked for, and each is copied
        # into the model before the next is read (a MoE layer's stacked experts one stack at once)
        names = {k: k for k in local}
        if te:
            names = {k: v for k, v in zip(local, _te_names(names, params), strict=True)}
        stacked = {k for k in local if k.endswith((STACKED_FC1, STACKED_FC2))}
        wanted = {names[k] for k in local if k not in stacked}
        for k in stacked:
            wanted |= set(unstack_experts({k: torch.empty(_stack_len(k, params))}))
        if set(params) != wanted:
            raise RuntimeError(
                f"megatron conversion: model keys {sorted(set(params) ^ wanted)[:6]} do not "
                f"match the converted checkpoint"
            )
        with torch.no_grad():
            for k in local:
                pieces = unstack_experts({k: local[k]}) if k in stacked else {names[k]: local[k]}
                for name, value in pieces.items():
                    p = params[name]
                    if p.shape != value.shape:
                        raise RuntimeError(
                            f"megatron conversion: {name} {tuple(value.shape)} does "
                            f"not fit {tuple(p.shape)}"
                        )
                    p.copy_(value)

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
        routes = None
        if self.routers and "routed_experts" in mb:
            from .torch_backend.policy import replay_layout

            routes = replay_layout(mb, self.settings.packing)
        if not self.settings.packing:
            ids, index = left_aligned(mb, pad_to)
            mb["_ids"], mb["_index"] = ids.to(self.device), index.to(self.device)
            if self.router_aux_loss > 0:
                mb["_tokens"] = left_aligned_tokens(mb, ids.shape[1])
            if routes is not None:
                mb["_routes"], mb["_valid"] = left_aligned_routes(mb, *routes, ids.shape[1])
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
        if self.router_aux_loss > 0:
            mb["_tokens"] = torch.arange(ids.shape[1])[None] < ids.shape[1] - tail
        if routes is not None:  # (replay_layout's packed order is pack_rows')
            mb["_routes"], mb["_valid"] = (
                _pad_columns(r, ids.shape[1], fill)
                for r, fill in zip(routes, (-1, False), strict=True)
            )
        return mb

    def run(
        self,
        batch: Mapping[str, torch.Tensor],
        plan: int | list[torch.Tensor],
        head: Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, Any]],
        *,
        forward_only: bool,
        reference: bool = False,
        aux_weights: list[float] | None = None,
    ) -> list[Any]:
        """Run ``batch`` in micro-batches (the row indices of ``plan``, or runs of ``plan``
        rows) through megatron-core's schedule, each padded to its own longest sequence, or
        packed into one row with ``packing``.

        ``head(output, micro_batch)`` runs on the last stage and returns ``(loss, payload)``;
        the payloads of the micro-batches come back in ``plan``'s order (on the last stage; []
        elsewhere). ``output`` is [b, L, ...], or [1, N, ...] for a packed row: read it at
        ``micro_batch["_index"]`` with :func:`_at_index`. ``aux_weights``: each micro-batch's
        loss weight, for the routers' load-balancing loss (:meth:`_balance`)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        model = self.reference if reference else self._train_module
        n = batch["response_ids"].shape[0]
        if isinstance(plan, int):
            plan = [torch.arange(sl.start, sl.stop) for sl in _split(n, plan)]
        micros = [self._inputs({k: v[idx] for k, v in batch.items()}) for idx in plan]
        if self.shard.ep_size > 1:
            micros = self._align_for_experts(micros)
        if aux_weights is not None and self.router_aux_loss > 0:
            for i, idx in enumerate(plan):  # (fillers, appended after these, have none)
                micros[i] = {**micros[i], "_aux": (aux_weights[i], len(idx) / n)}
        packed, te = self.settings.packing, self.te

        routers = self.routers.get("reference" if reference else "model", {})
        measure = self.measure_routing and not reference

        def step(data: Iterator[dict[str, torch.Tensor]], module: Any) -> tuple[Any, Any]:
            mb = next(data)
            length = mb["_ids"].shape[1]
            routes = self._routes(routers, mb, measure)
            balancing = self._balance(routers, mb)
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

            if balancing:  # (a tensor: no device sync per layer)
                share = mb["_aux"][1]
                self.balance_sum = self.balance_sum + share * sum(
                    r.balance for r in routers.values()
                )
            if routes is not None and measure and "_filler" not in mb:
                from .megatron_routing import agreement

                same, total = agreement(routers, *routes)
                self.routing_counts[0] += same
                self.routing_counts[1] += total

            def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
                if "_filler" in mb:  # (its backward still runs the experts' collectives)
                    return output.sum() * 0.0, torch.tensor(1, dtype=torch.int), _FILLER
                rows = mb.get("_rows")
                loss, payload = head(output if rows is None else output[:rows], mb)
                return loss, torch.tensor(1, dtype=torch.int), payload

            return out, loss_func

        if not self.gpu:
            done = self._cpu_schedule(model, micros, step, forward_only=forward_only)
            return [p for p in done if p is not _FILLER]
        done = get_forward_backward_func()(  # pragma: no cover - needs CUDA
            forward_step_func=step,
            data_iterator=iter(micros),
            model=[model],
            num_microbatches=len(micros),
            seq_length=max(mb["_ids"].shape[1] for mb in micros),
            micro_batch_size=max(mb["_ids"].shape[0] for mb in micros),
            forward_only=forward_only,
        )
        return [p for p in done if p is not _FILLER]  # pragma: no cover - needs CUDA

    def _routes(
        self, routers: Mapping[int, Any], mb: Mapping[str, Any], measure: bool
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Set ``routers`` to replay ``mb``'s recorded routing (none recorded: their own) and
        to record their own choice when ``measure``; the routing and its valid tokens in the
        routers' order, or None."""
        if not routers:
            return None
        from .megatron_routing import set_forced, token_major

        routes = None
        if "_routes" in mb:
            tp = self.shard.tp_size if self.sequence_parallel else 1
            routes = tuple(
                token_major(mb[k], self.shard.tp_rank, tp) for k in ("_routes", "_valid")
            )
        set_forced(routers, None if routes is None else routes[0])
        for router in routers.values():
            router.recording, router.chosen = measure, None
        return routes

    def _balance(self, routers: Mapping[int, Any], mb: Mapping[str, Any]) -> bool:
        """Set ``routers``' load-balancing loss for ``mb``: on (the coefficient times the
        micro-batch's loss weight, shared by the model's layers; the real tokens in the routers'
        order) for a trained micro-batch that is not a filler, else off; whether it is on."""
        on = "_aux" in mb and "_filler" not in mb
        scale = valid = None
        if on:
            from .megatron_routing import token_major

            scale = self.router_aux_loss * mb["_aux"][0] / self.shape.layers
            if self.config.grad_scale_func is not None:  # fp16: the loss scale, as the loss's
                one = torch.ones((), device=self.device)
                scale *= float(self.config.grad_scale_func(one))
            tp = self.shard.tp_size if self.sequence_parallel else 1
            valid = token_major(mb["_tokens"], self.shard.tp_rank, tp)
        for router in routers.values():
            router.scale, router.valid = scale, valid
        return on

    def _align_for_experts(self, micros: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``micros`` made to match those of every expert-parallel rank: each forward of a MoE
        layer is a collective over them (the tokens go to their experts' ranks), so every rank
        runs as many micro-batches (a rank with fewer adds fillers: its first micro-batch again,
        whose loss is 0 and whose result is dropped), and, under megatron-core's all-gather
        dispatcher (the one that runs on a CPU, which gathers equal pieces), the i-th
        micro-batches of all ranks have one shape: the rows and columns each lacks are padding,
        which the causal mask keeps from the real tokens (a packed row: one more padding
        sequence), and the loss reads the real rows only (``_rows``)."""
        import torch.distributed as dist

        from ..algorithms import collectives as C

        group = self.ps.get_expert_model_parallel_group()
        count = C.to_group(torch.tensor([len(micros)], dtype=torch.long), group)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        n = int(count.item())
        if not micros and n:
            raise RuntimeError(
                "megatron expert parallelism: this rank has no rows in a batch its expert-"
                "parallel ranks run (each data-parallel rank must get at least one sample)"
            )
        out = list(micros) + [{**micros[0], "_filler": True} for _ in range(n - len(micros))]
        self.fillers += n - len(micros)
        if self.config.moe_token_dispatcher_type != "allgather":
            return out  # (all-to-all exchanges the token counts: shapes may differ)
        sizes = torch.zeros(n, 2, dtype=torch.long)
        for i, mb in enumerate(out):
            sizes[i] = torch.tensor(mb["_ids"].shape)
        sizes = C.to_group(sizes, group)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
        for i, (rows, cols) in enumerate(sizes.cpu().tolist()):
            mb = out[i] = dict(out[i])
            b, length = mb["_ids"].shape
            if (b, length) == (rows, cols):
                continue
            ids = mb["_ids"].new_zeros(rows, cols)
            ids[:b, :length] = mb["_ids"]
            mb["_ids"], mb["_rows"] = ids, b
            for key, fill in (("_routes", -1), ("_valid", False), ("_tokens", False)):
                if key in mb:
                    pad = mb[key].new_full((rows, cols, *mb[key].shape[2:]), fill)
                    pad[:b, :length] = mb[key]
                    mb[key] = pad
            if "_pos" in mb:  # a packed row (one row on every rank): a padding sequence
                tail = cols - length
                pos = torch.arange(tail, device=mb["_pos"].device)[None]
                mb["_pos"] = torch.cat([mb["_pos"], pos], 1)
                mb["_lengths"] = torch.cat([mb["_lengths"], torch.tensor([tail])])
        return out

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

        from ..algorithms import collectives as C

        ps, pp = self.ps, self.shard.pp_size
        group = ps.get_pipeline_model_parallel_group() if pp > 1 else None
        prev_rank = ps.get_pipeline_model_parallel_prev_rank() if pp > 1 else None
        next_rank = ps.get_pipeline_model_parallel_next_rank() if pp > 1 else None
        results = []
        for mb in micros:
            b, length = mb["_ids"].shape
            inp = None
            if not self.first:
                shape = (length, b, self.shape.hidden)
                inp = C.group_empty(group, shape, self.config.params_dtype)
                dist.recv(inp, src=prev_rank, group=group)
                inp = inp.to(self.device).requires_grad_(not forward_only)
                model.set_input_tensor(inp)
            out, loss_func = step(iter([mb]), model)
            if self.last:
                loss, _, payload = loss_func(out)
                results.append(payload)
                if not forward_only:
                    loss.backward()
            else:
                dist.send(C.to_group(out.detach().contiguous(), group), dst=next_rank, group=group)
                if not forward_only:
                    grad = C.group_empty(group, out.shape, out.dtype)
                    dist.recv(grad, src=next_rank, group=group)
                    torch.autograd.backward(out, grad.to(out.device))
            if inp is not None and not forward_only:
                dist.send(C.to_group(inp.grad.contiguous(), group), dst=prev_rank, group=group)
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
        self.balance_sum = 0.0
        parts = self.run(minibatch, plan, head, forward_only=False, aux_weights=weights)
        out: dict[str, float] = {}
        for rows, metrics in parts:
            for k, v in metrics.items():
                out[k] = out.get(k, 0.0) + rows * float(v)
        out = self.from_last_stage(out)
        if self.router_aux_loss > 0:  # every stage's layers
            local = float(self.balance_sum)
            out["router_balance"] = self._pipeline_sum(local) / self.shape.layers
        out.update(self._step())
        return out

    def _pipeline_sum(self, local: float) -> float:
        """``local`` summed over the pipeline stages."""
        if self.shard.pp_size == 1:
            return float(local)
        from ..algorithms import collectives

        t = torch.tensor([float(local)], dtype=torch.float64)
        group = self.ps.get_pipeline_model_parallel_group()
        return float(collectives.all_reduce_sum(t, group).item())

    def _dp_sum(self, local: float) -> float:
        if self.shard.dp_size == 1:
            return float(local)
        from ..algorithms import collectives

        t = torch.tensor([float(local)], dtype=torch.float64)
        return float(collectives.all_reduce_sum(t, self.ps.get_data_parallel_group()).item())

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
            from ..algorithms import collectives

            # an expert's gradient already sums the tokens every expert-parallel rank sent it:
            # the rest comes from its replicas (megatron's expert data-parallel group)
            expert_dp = self.ps.get_expert_data_parallel_group() if self.shard.ep_size > 1 else None
            for params, group in (
                ([p for p in self.params if not _is_expert(p)], self.ps.get_data_parallel_group()),
                ([p for p in self.params if _is_expert(p)], expert_dp),
            ):
                if not params:
                    continue
                flat = collectives.to_group(torch.cat([p.grad.reshape(-1) for p in params]), group)
                if group is not None and dist.get_world_size(group) > 1:
                    dist.all_reduce(flat, group=group)
                flat /= self.shard.dp_size  # (every loss was weighted for an average)
                offset = 0
                for p in params:
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

        from ..algorithms import collectives

        s = self.shard
        total = 0.0
        for expert in (False, True):
            sq = torch.zeros(1, dtype=torch.float64, device=self.device)  # the gradients' device
            for p in self.params:
                if _is_expert(p) != expert:
                    continue
                if getattr(p, "tensor_model_parallel", False) or s.tp_rank == 0:
                    sq += p.grad.double().pow(2).sum()
            if expert and s.tp_size * s.pp_size * s.ep_size > 1:
                # each expert once: over tensor, expert and pipeline ranks
                group = self.ps.get_expert_tensor_model_pipeline_parallel_group()
            elif not expert and s.tp_size * s.pp_size > 1:
                group = self.ps.get_model_parallel_group()
            else:
                group = None
            if group is not None:
                sq = collectives.to_group(sq, group)  # NCCL: never the CPU
                dist.all_reduce(sq, group=group)
            total += float(sq.item())
        return math.sqrt(total)

    # -- gathering and checkpoints -------------------------------------------------------------
    def _gather(self, local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """HF-named full tensors from every model-parallel rank's ``local`` megatron-named
        tensors, on model-parallel rank 0 (None elsewhere). Collective over that group."""
        import torch.distributed as dist

        local = {k: v.detach().to("cpu") for k, v in stack_experts(local).items()}
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
        """The shard's weights under the local layer spec's names, a MoE layer's experts stacked
        (:func:`~.megatron_convert.stack_experts`)."""
        out = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        return stack_experts(_rename(out, [(b, a) for a, b in TE_NORMS]))

    def _every_expert(self, local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``local`` (stacked) with each MoE layer's experts of every expert-parallel rank, in
        expert order (a collective over the expert-parallel group; unchanged without it)."""
        if self.shard.ep_size == 1:
            return dict(local)
        import torch.distributed as dist

        from ..algorithms import collectives as C

        group = self.ps.get_expert_model_parallel_group()
        out = dict(local)
        for k in sorted(local):
            if not k.endswith((STACKED_FC1, STACKED_FC2)):
                continue
            piece = C.to_group(local[k].detach().contiguous(), group)
            pieces = [
                C.group_empty(group, piece.shape, piece.dtype) for _ in range(self.shard.ep_size)
            ]
            dist.all_gather(pieces, piece, group=group)
            out[k] = torch.cat(pieces, 0).to(local[k].device)
        return out

    def gathered_weights(self) -> dict[str, torch.Tensor]:
        """HF-named weights on the role's leader ({} elsewhere). Every worker calls it."""
        local = self._every_expert(self._local_weights(self.model))
        if self.shard.dp_rank != 0 or self.shard.cp_rank != 0:
            return {}
        return self._gather(local) or {}

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
        buckets in the same order. (A MoE model's experts under expert parallelism are the
        exception: their tensors are gathered over the expert-parallel ranks, which are
        data-parallel replicas of the dense weights; every worker walks every bucket, so they
        meet.)"""
        layout = hf_layout(self.shape, self.shard.pp_size, value=self.value)
        local = self._local_weights(self.model)
        mine = next(t for t in layout if t.stage == self.shard.pp_rank)
        dtype = local[mine.key].dtype  # every stage builds its weights in the config's dtype
        size = dtype.itemsize
        by_name = {t.name: t for t in layout}
        plan = plan_buckets(((t.name, size * math.prod(t.shape)) for t in layout), max_bytes)

        fused: dict[str, list[torch.Tensor]] = {}  # one fused tensor's gathered pieces

        def produce(names: list[str]) -> dict[str, torch.Tensor]:
            return {n: self._hf_tensor(by_name[n], local, dtype, fused) for n in names}

        return WeightStream(plan, produce)

    def _hf_tensor(
        self,
        t: HfTensor,
        local: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        fused: dict[str, list[torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """HF tensor ``t`` on this worker (collective over its stage's tensor-parallel group
        and its pipeline group). ``fused``: the gathered pieces of the last fused megatron
        tensor (``linear_qkv``: q, k, v; ``linear_fc1``: gate, up), kept while the HF tensors
        made of it follow one another in the layout, so each is all-gathered once, not once per
        HF tensor (the stream holds one fused tensor's pieces beside its bucket)."""
        import torch.distributed as dist

        from ..algorithms import collectives as C

        s = self.shard
        tp_group = self.ps.get_tensor_model_parallel_group() if s.tp_size > 1 else None
        pp_group = self.ps.get_pipeline_model_parallel_group() if s.pp_size > 1 else None
        if fused is not None and t.key not in fused:
            fused.clear()  # the layout has moved past the last fused tensor
        if t.stage == s.pp_rank:
            piece = local[t.key].detach()
            if t.kind.startswith("experts") and s.ep_size > 1:
                piece = self._every_expert({t.key: piece})[t.key]
            if s.tp_size == 1:
                pieces = [piece]
            elif fused is not None and t.key in fused:
                pieces = fused[t.key]
            elif t.split:
                pieces = [
                    C.group_empty(tp_group, piece.shape, piece.dtype) for _ in range(s.tp_size)
                ]
                dist.all_gather(pieces, C.to_group(piece.contiguous(), tp_group), group=tp_group)
                if fused is not None and t.kind in FUSED_KINDS:
                    fused[t.key] = pieces
            else:
                pieces = [C.to_group(piece.clone(), tp_group)]
                dist.broadcast(pieces[0], group=tp_group, group_src=0)
            out = hf_from_pieces(self.shape, t, pieces)
            del pieces
            if pp_group is not None:
                out = C.to_group(out.contiguous(), pp_group)
        else:
            out = C.group_empty(pp_group, t.shape, dtype)
        if pp_group is not None:
            dist.broadcast(out, group=pp_group, group_src=t.stage)
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
        te = [(b, a) for a, b in TE_NORMS]
        weights = self._every_expert(self._local_weights(self.model))
        moments = {k: self._every_expert(stack_experts(_rename(moments[k], te))) for k in ADAM_KEYS}
        if master is not None:
            master = self._every_expert(stack_experts(_rename(master, te)))
        if self.shard.dp_rank != 0 or self.shard.cp_rank != 0:
            return {}
        model = self._gather(weights)
        adam = {k: self._gather(moments[k]) for k in ADAM_KEYS}
        main = self._gather(master) if master is not None else None
        if model is None:
            return {}
        out = {"model": model, "adam": adam, "adam_step": step, "updates": self.updates}
        if main is not None:
            out["master"] = main
        return out

    # -- sharded checkpoints (megatron-core dist_checkpointing) ----------------------------------
    def save_checkpoint(self, directory: Path) -> None:
        """This rank's shard of the weights and the optimizer state into ``directory``, through
        megatron-core's ``dist_checkpointing`` (``torch_dist``: every rank writes its own file,
        a tensor replicated over data-parallel ranks is written once, its writes spread over
        them; no rank gathers another's state). Resumable under another data-parallel size (and
        another tensor or pipeline split: the tensors are stored in the model's global shapes).
        Every worker of the role calls it with the same directory (a collective)."""
        from megatron.core import dist_checkpointing

        directory.mkdir(parents=True, exist_ok=True)
        with _cpu_without_cuda_sync(not torch.cuda.is_available()):
            dist_checkpointing.save(
                self._sharded_state(loading=False), str(directory), self._save_strategy()
            )

    def load_checkpoint(self, directory: Path) -> None:
        """Restore what :meth:`save_checkpoint` wrote; each rank reads the parts of the stored
        tensors its shard covers (a collective over the role's workers)."""
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load(self._sharded_state(loading=True), str(directory))
        self.model.load_state_dict(loaded["model"], strict=True)
        self.updates = int(loaded["updates"])
        if self.ddp is not None:
            self.optimizer.load_state_dict(loaded["optimizer"])
            self.optimizer.reload_model_params()  # (no-op when the main weights were loaded)
            return
        names = {id(p): k for k, p in self.model.named_parameters()}
        step = torch.tensor(float(loaded["adam_step"]))
        self.optimizer.state.clear()
        for p in self.params:
            name = names[id(p)]
            self.optimizer.state[p] = {
                "step": step.clone(),
                **{k: loaded["optimizer"][k][name].to(p.dtype) for k in ADAM_KEYS},
            }

    def _sharded_state(self, *, loading: bool) -> dict[str, Any]:
        """The sharded state dict of this rank: the model's (``GPTModel.sharded_state_dict``),
        the optimizer's (megatron's distributed optimizer: its own, in the model's space; the
        CPU path's ``AdamW``: its moments as tensors of the parameters' sharding), the counters."""
        model = self.model.sharded_state_dict()
        state: dict[str, Any] = {"model": model, "updates": self.updates}
        if self.ddp is not None:
            if loading:
                self._init_distributed_state()
            state["optimizer"] = self.optimizer.sharded_state_dict(
                model,
                is_loading=loading,
                metadata={"distrib_optim_sharding_type": DISTRIB_OPTIM_SHARDING},
            )
            return state
        from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

        names = {id(p): k for k, p in self.model.named_parameters()}
        moments: dict[str, dict[str, Any]] = {k: {} for k in ADAM_KEYS}
        steps = []
        for p in self.params:
            name, st = names[id(p)], self.optimizer.state.get(p, {})
            for k in ADAM_KEYS:
                t = st[k] if k in st else torch.zeros_like(p)
                moments[k][name] = make_sharded_optimizer_tensor(model[name], t, f"optimizer.{k}")
            steps.append(float(st["step"]) if "step" in st else 0.0)
        state["optimizer"] = moments
        state["adam_step"] = max(steps, default=0.0)
        return state

    def _init_distributed_state(self) -> None:
        """Adam's state of megatron's distributed optimizer must exist before it is loaded."""
        owners = self._distributed_owners()
        for opt in {id(o): o for o, _ in owners.values()}.values():
            main = [p for g in opt.optimizer.param_groups for p in g["params"]]
            if any(not opt.optimizer.state.get(p) for p in main):
                opt._init_optimizer_states_with_dummy_values()

    def _save_strategy(self) -> Any:
        """``torch_dist`` with the writes of data-parallel replicas spread over them
        (megatron-core's fully parallel wrapper): no rank writes more than its share."""
        from megatron.core.dist_checkpointing.serialization import (
            get_default_save_sharded_strategy,
        )
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper,
        )

        base = get_default_save_sharded_strategy()
        if self.shard.dp_size * self.shard.cp_size == 1:
            return base
        group = self.ps.get_data_parallel_group(with_context_parallel=True)
        return FullyParallelSaveStrategyWrapper(base, group)

    def _distributed_adam_state(
        self, names: Mapping[int, str]
    ) -> tuple[dict[str, dict[str, torch.Tensor]], float, dict[str, torch.Tensor]]:
        """(Adam moments by local parameter name, step, fp32 main weights) of megatron's
        distributed optimizer, whole on every data-parallel rank (a collective over the
        data-parallel group: each rank fills the slice of each parameter it owns)."""
        import torch.distributed as dist

        from ..algorithms import collectives as C

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
        if self.shard.dp_size * self.shard.cp_size > 1:
            # megatron shards the dense parameters' state over the data x context ranks, an
            # expert's over its expert data-parallel ranks
            group = self.ps.get_data_parallel_group(with_context_parallel=True)
            params = dict(self.model.named_parameters())
            expert_dp = self.ps.get_expert_data_parallel_group()
            # the slices are disjoint: a sum assembles them
            for expert, g in ((False, group), (True, expert_dp)):
                names_here = [n for n in full[keys[0]] if _is_expert(params[n]) == expert]
                if not names_here:
                    continue
                flat = C.to_group(torch.cat([full[k][n] for k in keys for n in names_here]), g)
                dist.all_reduce(flat, group=g)
                flat = flat.cpu()
                offset = 0
                for k in keys:
                    for name in names_here:
                        n = full[k][name].numel()
                        full[k][name] = flat[offset : offset + n]
                        offset += n
            step = C.to_group(step, group)
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

        params = dict(self.model.named_parameters())

        def local(hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            out = self._local_from_hf(_with_frozen(hf, state["model"]))
            return _te_names(out, params) if te else out

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


@contextmanager
def _cpu_without_cuda_sync(cpu: bool) -> Iterator[None]:
    """megatron-core's ``torch_dist`` writer copies each tensor to the CPU ``non_blocking`` and
    then calls ``torch.cuda.synchronize()`` unconditionally (``preload_tensors``), which raises
    on a machine without CUDA. There the copies are synchronous CPU copies and the call has
    nothing to wait for: it is a no-op for the save's duration."""
    if not cpu:
        yield
        return
    real = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.synchronize = real  # type: ignore[assignment]


class _SliceShard(Mapping[str, torch.Tensor]):
    """One rank's megatron tensors read from a HF checkpoint's safetensors files when asked for,
    one at a time (:func:`~.megatron_convert.local_from_slices`): each read takes only the
    rank's slice of each HF tensor and nothing is kept, so loading a model from it holds one
    tensor beyond the model's own shard. ``missing``: the HF tensors the stage needs that the
    files lack (the critic's value head comes from ``value_head``)."""

    def __init__(
        self,
        slices: Any,
        shape: ModelShape,
        shard: ShardIdentity,
        dtype: torch.dtype,
        *,
        value_head: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.slices, self.shape, self.shard, self.dtype = slices, shape, shard, dtype
        value = value_head is not None
        self.pieces = stage_pieces(shape, shard.pp_rank, shard.pp_size, value=value)
        self.extra = {f"value_head.{k}": v for k, v in (value_head or {}).items()}
        self.names: dict[str, str] = {}  # HF (or per-expert file) name -> its name in the files
        self.missing: list[str] = []
        local = shape.experts // shard.ep_size
        self.experts = range(shard.ep_rank * local, (shard.ep_rank + 1) * local)
        for parts in self.pieces.values():
            for t in parts:
                if t.name in self.extra:
                    continue
                for name in self._file_names(t):
                    # a backbone saved alone (an exported critic's) has no "model." prefix
                    found = next(
                        (n for n in (name, name.removeprefix("model.")) if n in slices), None
                    )
                    if found is None:
                        self.missing.append(name)
                    else:
                        self.names[name] = found

    def _file_names(self, t: HfTensor) -> list[str]:
        """The names under which the files hold ``t``: its own, or a MoE layer's router and
        this rank's experts under the checkpoint's per-expert names (transformers writes its
        fused experts so)."""
        if not self.shape.moe or not (
            t.kind.startswith("experts") or t.name.endswith(".mlp.gate.weight")
        ):
            return [t.name]
        if not t.kind.startswith("experts"):
            return [checkpoint_names(self.shape.family, t, 0)]
        return [
            n for e in self.experts for n in checkpoint_names(self.shape.family, t, e).split("|")
        ]

    def _read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        if name in self.extra:
            return self.extra[name].narrow(dim, start, stop - start).clone()
        return self.slices.read(self.names[name], dim, start, stop, self.dtype)

    def __getitem__(self, key: str) -> torch.Tensor:
        s = self.shard
        parts = self.pieces[key]
        first = parts[0]
        if first.kind.startswith("experts"):  # this rank's experts, stacked, its tensor share
            n = self.shape.intermediate // s.tp_size
            rows = (s.tp_rank * n, (s.tp_rank + 1) * n)
            if first.kind == "experts_down":
                return torch.stack([self._read(name, 1, *rows) for name in self._file_names(first)])
            names = self._file_names(first)  # gate, up of each expert in turn
            return torch.stack(
                [
                    torch.cat([self._read(g, 0, *rows), self._read(u, 0, *rows)])
                    for g, u in zip(names[::2], names[1::2], strict=True)
                ]
            )
        if self.shape.moe and first.name.endswith(".mlp.gate.weight"):  # a router
            name = self._file_names(first)[0]
            return self._read(name, 0, 0, first.shape[0])
        return local_from_slices(self.shape, parts, self._read, s.tp_rank, s.tp_size)

    def __iter__(self) -> Iterator[str]:
        return iter(self.pieces)

    def __len__(self) -> int:
        return len(self.pieces)


_FILLER = object()
"""The result of a filler micro-batch (:meth:`_Sharded._align_for_experts`), dropped."""


def _pad_columns(x: torch.Tensor, width: int, fill: Any) -> torch.Tensor:
    """``x`` [b, n, ...] with columns of ``fill`` up to ``width``."""
    if x.shape[1] >= width:
        return x
    pad = x.new_full((x.shape[0], width - x.shape[1], *x.shape[2:]), fill)
    return torch.cat([x, pad], 1)


def _shift_left(x: torch.Tensor, prompt_mask: torch.Tensor, fill: Any) -> torch.Tensor:
    """``x`` ``[b, P + T, ...]`` (prompt then response columns) with each row moved left by its
    prompt's padding, as :func:`~.megatron_inputs.left_aligned` moves the tokens; ``fill``
    where no token is."""
    b, total = x.shape[:2]
    shift = prompt_mask.shape[1] - prompt_mask.long().sum(1)
    cols = torch.arange(total)[None, :] + shift[:, None]
    tail = (1,) * (x.dim() - 2)
    idx = cols.clamp(max=total - 1).view(b, total, *tail).expand_as(x)
    return x.gather(1, idx).masked_fill(~(cols < total).view(b, total, *tail), fill)


def left_aligned_tokens(mb: Mapping[str, torch.Tensor], width: int) -> torch.Tensor:
    """The real tokens (prompt and response, not padding) of :func:`~.megatron_inputs.
    left_aligned`'s rows: ``[b, width]`` bool."""
    response = mb.get("response_mask")
    if response is None:
        response = torch.ones_like(mb["response_ids"], dtype=torch.bool)
    real = torch.cat([mb["prompt_mask"].bool(), response.bool()], 1)
    return _pad_columns(_shift_left(real, mb["prompt_mask"], False), width, False)


def left_aligned_routes(
    mb: Mapping[str, torch.Tensor], recorded: torch.Tensor, valid: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recorded routing ``[b, P + T, layers, k]`` and its valid tokens ``[b, P + T]``
    (prompt then response columns, :func:`~.torch_backend.policy.replay_layout`) moved as
    :func:`~.megatron_inputs.left_aligned` moves the tokens, ``width`` columns (``-1`` and
    False where no token is)."""
    routes = _shift_left(recorded, mb["prompt_mask"], -1)
    ok = _shift_left(valid, mb["prompt_mask"], False)
    return _pad_columns(routes, width, -1), _pad_columns(ok, width, False)


def _stack_len(key: str, params: Mapping[str, Any]) -> int:
    """How many local experts the model holds under stacked key ``key``'s layer."""
    head = key.rsplit(".mlp.experts.", 1)[0] + ".mlp.experts.local_experts."
    return len({k[len(head) :].split(".")[0] for k in params if k.startswith(head)})


def _is_expert(p: torch.Tensor) -> bool:
    """Whether ``p`` is an expert's weight split over expert-parallel ranks (megatron-core marks
    them ``allreduce = False``: not all-reduced over the whole data-parallel group)."""
    return not getattr(p, "allreduce", True)


def _te_names(local: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict:
    """``local`` under Transformer Engine's layer spec's names (:data:`TE_NORMS`), for the layers
    whose norm that spec fuses (a MoE layer keeps its ``pre_mlp_layernorm``)."""
    out = {}
    for k, v in local.items():
        for old, new in TE_NORMS:
            if k.endswith(old) and k[: -len(old)] + new in params:
                k = k[: -len(old)] + new
                break
        out[k] = v
    return out


def _with_frozen(moments: Mapping[str, torch.Tensor], model: Mapping[str, torch.Tensor]) -> dict:
    """``moments`` completed with the model's entries it lacks (tied weights), for the
    conversion, which expects every HF name."""
    return {**{k: torch.zeros_like(v) for k, v in model.items()}, **moments}
