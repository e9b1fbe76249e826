"""Run by tests/trainer/backends/test_sglang_lora.py in a subprocess whose path holds the pinned
SGLang package (``make install``: ``<virtualenv>/test-cache/sglang-runtime``): a LoRA actor's
adapter sync into SGLang's OWN LoRA code, on the CPU. Prints one JSON object on its last line.

What runs is SGLang's: ``LoadLoRAAdapterFromTensorsReqInput`` / ``UnloadLoRAAdapterReqInput`` and
their ``to_ref``, the tensor-parallel worker's ``load_lora_adapter_from_tensors`` (deserializing
its rank's flattened-bucket payload with ``MultiprocessingSerializer`` and
``FlattenedTensorBucket``), ``LoRAManager``'s load, validation and unload
(``LoRAConfig.from_dict``, ``LoRAAdapter`` parsing our PEFT names and stacking q/k/v and gate/up),
``init_lora_shapes`` over our ``lora_target_modules``, the real ``LoRAMemoryPool`` its buffers
and ``fetch_new_loras`` filling them, ``LoRARegistry`` resolving the adapter name a request
carries, ``GenerateReqInput``'s normalization of our ``lora_path``, and the torch-native LoRA
kernels (``sgemm_lora_a_fwd`` / ``sgemm_lora_b_fwd``) run on the pool's buffers.

Stand-ins, and why: the ``Engine`` -> tokenizer manager -> scheduler hop (ZMQ, a CUDA build):
:class:`InProcessEngine` builds the request struct ``Engine`` builds and takes the tokenizer
manager's steps (registry register/unregister, ``LoRARef``); ``LoRAManager.__init__`` (it builds
the model's LoRA layers, which need SGLang's CUDA model): the manager is made with ``__new__`` and
given the fields ``__init__`` sets; the wrapped layers: :class:`Layer`, whose weight slicing is
the identity, as SGLang's is at one tensor-parallel rank.
"""

from __future__ import annotations

import asyncio
import json
import sys
import types
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from sglang_runtime_driver import cpu_tensors_through_torch, install_stand_ins

RANK, ALPHA = 4, 16.0
HIDDEN, HEADS, KV_HEADS, INTER, LAYERS, VOCAB = 16, 4, 2, 32, 2, 50
HEAD_DIM = HIDDEN // HEADS


def parallel_one_rank() -> None:
    from sglang.srt.runtime_context import get_parallel

    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    group = types.SimpleNamespace(cpu_group=torch.distributed.group.WORLD)
    get_parallel().override_permanently(
        tp_rank=0,
        tp_size=1,
        tp_group=group,
        attn_tp_size=1,
        attn_tp_rank=0,
        attn_cp_size=1,
        attn_dp_enabled=False,
    )


def hf_config() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        vocab_size=VOCAB,
    )


def actor(targets: list[str]) -> Any:
    """A tiny Qwen2 with our PEFT adapters (``apply_lora``), B randomised (PEFT starts it at 0)."""
    from transformers import Qwen2ForCausalLM

    from ppojob_api.training import LoraSpec
    from ppojob_trainer.backends.torch_backend.lora import apply_lora

    torch.manual_seed(0)
    lora = LoraSpec(rank=RANK, alpha=ALPHA, target_modules=targets)
    model = apply_lora(Qwen2ForCausalLM(hf_config()), lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p))
    return model, lora


class Layer:
    """A wrapped layer as the pool sees it: weight slicing is the identity at one TP rank."""

    def slice_lora_a_weights(self, a: torch.Tensor, *_: Any) -> torch.Tensor:
        return a

    def slice_lora_b_weights(self, b: torch.Tensor, *_: Any) -> torch.Tensor:
        return b


def lora_manager(server_args: dict[str, Any]) -> Any:
    """SGLang's ``LoRAManager`` on CPU with the fields its ``__init__`` sets from these
    ``ServerArgs`` fields, its own ``init_lora_shapes`` and ``init_memory_pool``."""
    from sglang.srt.lora.backend.torch_backend import TorchNativeLoRABackend
    from sglang.srt.lora.lora_manager import LoRAManager

    cfg = hf_config()
    base = torch.nn.Linear(1, 1)  # (the pool takes its device from a parameter)
    base.config = cfg
    m = LoRAManager.__new__(LoRAManager)
    m.base_model, m.base_hf_config = base, cfg
    m.max_loras_per_batch = server_args["max_loras_per_batch"]
    m.load_config, m.dtype, m.device = None, torch.float32, torch.device("cpu")
    m.attn_tp_size, m.lora_added_tokens_size = 1, None
    m.enable_lora_overlap_loading, m.attn_dp_enabled = False, False
    m.pending_lora_load_events, m.eviction_policy = {}, "lru"
    m.lora_strict_loading, m.speculative_algorithm = False, None
    m.lora_backend = TorchNativeLoRABackend(max_loras_per_batch=1, device=m.device)
    m.experts_shared_outer_loras = False
    m.embed_tokens_module = m.lm_head_module = None
    m.init_lora_adapters(None)
    # check_lora_server_args makes lora_target_modules a set before the manager sees it
    m.init_lora_shapes(
        server_args.get("max_lora_rank"), set(server_args.get("lora_target_modules", ()))
    )
    names = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp"}
    names["down_proj"] = "mlp"
    m.lora_modules = [
        {f"model.layers.{i}.{names[t]}.{t}": Layer() for t in sorted(m.target_modules)}
        for i in range(LAYERS)
    ]
    m.init_memory_pool()
    return m


class InProcessEngine:
    """``sglang.Engine``'s LoRA methods: the request struct Engine builds, the tokenizer
    manager's registry steps, the TP worker's load, SGLang's ``LoRAManager``."""

    def __init__(self, manager: Any) -> None:
        from sglang.srt.lora.lora_registry import LoRARegistry

        self.manager = manager
        self.registry = LoRARegistry()
        self.calls: list[str] = []

    def load_lora_adapter_from_tensors(
        self, lora_name: str, tensors: Any, config_dict: dict, load_format: str | None = None
    ) -> Any:
        from sglang.srt.lora.lora_registry import LoRARef
        from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput
        from sglang.srt.managers.tp_worker import TpModelWorker
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads

        self.calls.append(f"load({lora_name})")
        if load_format == "flattened_bucket":  # Engine._serialize_tensors_per_rank
            payloads = normalize_serialized_named_tensor_payloads(list(tensors))
        else:
            payloads = [MultiprocessingSerializer.serialize(tensors)]
        req = LoadLoRAAdapterFromTensorsReqInput(
            lora_name=lora_name,
            config_dict=config_dict,
            serialized_named_tensors=payloads,
            load_format=load_format,
        )
        ref = LoRARef(lora_name=lora_name, lora_path="__tensor__")  # the tokenizer manager's
        req.lora_id = ref.lora_id
        worker = types.SimpleNamespace(
            deserialize_own_rank=lambda p: MultiprocessingSerializer.deserialize(p[0]),
            model_runner=self.manager,  # ModelRunner forwards to its lora_manager
        )
        result = TpModelWorker.load_lora_adapter_from_tensors(worker, req)
        if result.success:
            asyncio.run(self.registry.register(ref))
        return result

    def begin_weight_update(self) -> tuple[bool, str]:  # Engine has them; an adapter needs none
        self.calls.append("begin_weight_update")
        return True, ""

    def end_weight_update(self) -> tuple[bool, str]:
        self.calls.append("end_weight_update")
        return True, ""

    def unload_lora_adapter(self, lora_name: str) -> Any:
        from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

        self.calls.append(f"unload({lora_name})")
        req = UnloadLoRAAdapterReqInput(lora_name=lora_name)
        req.lora_id = asyncio.run(self.registry.unregister(lora_name))
        return self.manager.unload_lora_adapter(req.to_ref())

    def generate(self, **kwargs: Any) -> list[Any]:
        from sglang.srt.managers.io_struct import GenerateReqInput

        self.calls.append("generate")
        req = GenerateReqInput(
            input_ids=kwargs["input_ids"],
            sampling_params=kwargs["sampling_params"],
            return_logprob=kwargs["return_logprob"],
            lora_path=kwargs["lora_path"],
        )
        req.normalize_batch_and_arguments()
        self.last_lora_paths = req.lora_path
        return [{"meta_info": {"output_token_logprobs": [(-0.5, 1, None)]}} for _ in req.input_ids]


def sglang_delta(manager: Any, lora_id: str, layer: int, module: str) -> torch.Tensor:
    """``scaling * B A`` as SGLang's torch-native kernels apply it from the pool's buffers of
    ``module`` (one stacked slice per projection), for the identity input: [out, in]."""
    from sglang.srt.lora.torch_ops.lora_ops import sgemm_lora_a_fwd, sgemm_lora_b_fwd
    from sglang.srt.lora.utils import get_stacked_multiply

    pool = manager.memory_pool
    slot = pool.uid_to_buffer_id[lora_id]
    a = pool.A_buffer[module][layer]
    b = pool.B_buffer[module][layer]
    adapter = manager.loras[lora_id]
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    outs = {"qkv_proj": [q, kv, kv], "gate_up_proj": [INTER, INTER]}
    outs.update(o_proj=[HIDDEN], down_proj=[HIDDEN])
    offsets = torch.tensor([0, *torch.tensor(outs[module]).cumsum(0).tolist()])
    x = torch.eye(a.shape[-1])
    idx = torch.tensor([slot])
    seg = torch.tensor([x.shape[0]])
    ranks = torch.tensor([adapter.config.r])
    scalings = torch.tensor([adapter.scaling])
    mid = sgemm_lora_a_fwd(x, a, idx, seg, ranks, scalings, get_stacked_multiply(module))
    return sgemm_lora_b_fwd(mid, b, idx, seg, ranks, offsets).T


HF_OF = {
    "qkv_proj": ("self_attn", ["q_proj", "k_proj", "v_proj"]),
    "o_proj": ("self_attn", ["o_proj"]),
    "gate_up_proj": ("mlp", ["gate_proj", "up_proj"]),
    "down_proj": ("mlp", ["down_proj"]),
}


def sync(targets: list[str], versions: int = 2, store: bool = False) -> dict[str, Any]:
    """A LoRA actor's syncs through the real host and adapter into SGLang's LoRA code (a
    colocated engine's, or with ``store`` a disaggregated one's through the object store:
    ``publish_weights`` then ``load_weights``); what SGLang then computes against our merged
    weights."""
    from ppojob_trainer.backends import sglang_backend as sb
    from ppojob_trainer.backends.torch_backend.lora import lora_adapter_tensors, merged_lora_weights

    model, lora = actor(targets)
    args = sb.lora_server_args(lora)
    manager = lora_manager(args)
    engine = InProcessEngine(manager)
    adapter = sb.SGLangGenerationEngine.__new__(sb.SGLangGenerationEngine)
    adapter.engine, adapter.offload, adapter.lora = engine, False, lora
    adapter.adapter_loaded, adapter.pad_id, adapter.stop_ids = False, 0, [2]
    host = host_for(adapter, lambda: lora_adapter_tensors(model, torch.float32))
    out: dict[str, Any] = {
        "server_args": {k: sorted(v) if k == "lora_target_modules" else v for k, v in args.items()}
    }
    gen = adapter.generate(
        torch.tensor([[5, 6], [7, 8]]),
        torch.ones(2, 2),
        max_new_tokens=1,
        temperature=1.0,
        top_p=1.0,
        seed=0,
    )
    out["lora_paths_before"] = engine.last_lora_paths
    out["generated"] = int(gen.response_ids[0, 0])
    errors = []
    for v in range(1, versions + 1):
        with torch.no_grad():  # a training update moves the adapters
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.add_(0.1 * v)
        try:
            if store:
                host.load_weights(v, host.publish_weights(v))
            else:
                host.sync_colocated(v, [])
        except Exception as exc:  # SGLang's refusal (RuntimeError from the adapter) or a crash
            errors.append(f"{type(exc).__name__}: {exc}")
            break
    out["errors"] = errors
    out["engine_calls"] = list(engine.calls)
    out["host_events"] = [e for e in host.events if e.startswith("engine.")]
    adapter.generate(
        torch.tensor([[5, 6], [7, 8]]),
        torch.ones(2, 2),
        max_new_tokens=1,
        temperature=1.0,
        top_p=1.0,
        seed=0,
    )
    out["lora_paths_after"] = engine.last_lora_paths
    if errors:
        return out
    lora_id = asyncio.run(engine.registry.acquire(sb.LORA_ADAPTER_NAME))
    out["loaded_ids"] = len(manager.loras)
    out["names_sglang_parsed"] = sorted(next(iter(manager.loras.values())).layers[0].weights)
    out["registry_resolves_newest"] = lora_id == next(iter(manager.loras))
    manager.fetch_new_loras({lora_id})  # a batch naming the adapter: its weights enter the pool
    merged = merged_lora_weights(model, torch.float32)
    base = {k: v for k, v in model.get_base_model().state_dict().items()}
    errs, moved = {}, {}
    for layer in range(LAYERS):
        for module in sorted(manager.target_modules):
            block, hf_names = HF_OF[module]
            delta = sglang_delta(manager, lora_id, layer, module)
            start = 0
            for hf in hf_names:
                key = f"model.layers.{layer}.{block}.{hf}.weight"
                w = base.get(f"model.layers.{layer}.{block}.{hf}.base_layer.weight")
                w = base[key] if w is None else w  # (a layer without an adapter)
                part = delta[start : start + w.shape[0]]
                start += w.shape[0]
                errs[key] = float((w + part - merged[key]).abs().max())
                if hf in targets:
                    moved[key] = float((merged[key] - w).abs().max())
    out["max_err"], out["min_moved"] = errs, min(moved.values()) if moved else 0.0
    out["adapted"] = sorted(moved)
    pool = manager.memory_pool
    out["pool_bytes"] = sum(
        t.numel() * t.element_size()
        for buffers in (pool.A_buffer, pool.B_buffer)
        for per_layer in buffers.values()
        for t in per_layer
    )
    # the name is loaded: SGLang refuses the same name again (hence unload first)
    again = engine.load_lora_adapter_from_tensors(
        sb.LORA_ADAPTER_NAME,
        sb.peft_adapter_tensors(lora_adapter_tensors(model, torch.float32)),
        sb.lora_config_dict(lora),
    )
    out["load_again"] = [again.success, again.error_message]
    return out


def outcome(targets: list[str]) -> str:
    """What SGLang makes of an adapter on ``targets``: "ok" (it computes our merged weights),
    else how it fails (at load, or when a batch first uses the adapter)."""
    try:
        r = sync(targets, versions=1)
    except Exception as exc:  # raised by SGLang's pool as a batch brings the adapter in
        return f"batch: {type(exc).__name__}: {exc}"[:300]
    if r["errors"]:
        return f"load: {r['errors'][0]}"[:300]
    if max(r["max_err"].values()) > 1e-5 or len(r["adapted"]) != LAYERS * len(targets):
        return "wrong weights"
    return "ok"


def host_for(adapter: Any, export: Any) -> Any:
    """The real ``WorkerHost`` of a colocated sglang engine (one TP rank, no peers), LoRA on."""
    from collections import deque

    from ppojob_api.training import TrainerConfig
    from ppojob_trainer.workers.host import RecordedEngine, WorkerHost

    cfg = TrainerConfig.model_validate(
        {
            "model": {"lora": {"rank": RANK, "alpha": ALPHA}},
            "roles": {
                "rollout": {
                    "backend": "sglang",
                    "colocateWithActor": True,
                    "weightSyncBucketMb": 64 / 2**20,
                }
            },
            "algorithm": {"advantageEstimator": "grpo"},
        }
    )
    host = WorkerHost.__new__(WorkerHost)
    host.cfg, host.device, host.events = cfg, "cpu", deque()
    host.rollout = types.SimpleNamespace(engine=RecordedEngine(adapter, host.events))
    host.actor = types.SimpleNamespace(trainer=types.SimpleNamespace(export_weights=export))
    host._weights = host._staged = None
    host.policy_version = 0
    return host


def server_args_check(lora: dict[str, Any]) -> str:
    """Our ``engine_args`` of a LoRA job as SGLang's ``ServerArgs``, through its own LoRA
    argument check (``check_lora_server_args``): "ok" or its refusal."""
    from sglang.srt.arg_groups.lora_hook import check_lora_server_args
    from sglang.srt.server_args import ServerArgs

    from ppojob_api.training import TrainerConfig
    from ppojob_trainer.backends.sglang_backend import engine_args

    cfg = TrainerConfig.model_validate(
        {
            "model": {"lora": lora},
            "roles": {"rollout": {"backend": "sglang", "colocateWithActor": True}},
            "algorithm": {"advantageEstimator": "grpo"},
        }
    )
    try:
        check_lora_server_args(ServerArgs(**engine_args(cfg, Path("/models/m"), (30001, 30002))))
    except (AssertionError, ValueError) as exc:
        return f"refused: {exc}"
    return "ok"


def main() -> None:
    import ray  # before the stand-ins (Ray looks for IPython)

    install_stand_ins()
    cpu_tensors_through_torch()
    parallel_one_rank()

    def get(refs: Any) -> Any:  # no peers, so the host waits on nothing; put: the object
        return [] if refs == [] else refs

    ray.get, ray.put = get, lambda obj: obj
    result = {
        "attn_mlp": sync(
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        ),
        "q_v": sync(["q_proj", "v_proj"]),
        "store": sync(["q_proj", "v_proj", "o_proj"], store=True),
        "server_args": {
            "listed": server_args_check({"rank": 8, "targetModules": ["q_proj", "v_proj"]}),
            "all_linear": server_args_check({"rank": 8, "targetModules": ["all-linear"]}),
        },
        "outcomes": {
            ",".join(t): outcome(t)
            for t in (
                ["k_proj", "v_proj"],
                ["q_proj"],
                ["q_proj", "k_proj"],
                ["up_proj"],
                ["gate_proj"],
                ["q_proj", "k_proj", "v_proj", "up_proj"],
                ["o_proj", "down_proj"],
                ["q_proj", "v_proj", "up_proj", "gate_proj"],
            )
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
