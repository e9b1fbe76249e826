"""Run by tests/trainer/backends/test_sglang_runtime.py in a subprocess whose path holds the
pinned SGLang package (``make install``: ``<virtualenv>/test-cache/sglang-runtime``): drives the
adapter (``backends/sglang_backend.py``) against SGLang's OWN scheduler-side weight updater
(``SchedulerWeightUpdaterManager``), its own model-runner ``WeightUpdater`` (sessions,
``flattened_bucket`` loading through ``FlattenedTensorBucket``), its own request structs
(``io_struct``) and its own ``MultiprocessingSerializer``, on the CPU with a one-rank gloo group
(a ``HashStore``: no listener). Prints one JSON object on its last line.

What is not SGLang's own here, and why:
- the ``Engine`` -> tokenizer manager -> scheduler hop (ZMQ between processes, a CUDA build):
  :class:`InProcessEngine` builds the same request struct ``Engine`` builds from the same
  keywords (the contract tests check the adapter's keywords against ``Engine``'s signatures)
  and returns ``(success, message)`` as ``FanOutCommunicator.merge_results`` does;
- the tensor-parallel worker's ``deserialize_own_rank`` (its module imports the CUDA
  scheduler): :class:`TpWorker` repeats its two lines (payload ``tp_rank``,
  ``MultiprocessingSerializer.deserialize``);
- SGLang's CUDA-IPC tensor reduction (``monkey_patch_torch_reductions``: a CUDA device index
  travels as the GPU's UUID) handles CUDA tensors only; :func:`cpu_tensors_through_torch` sends
  CPU tensors through torch's own reduction (shared memory) and keeps SGLang's for CUDA ones.
  ``MultiprocessingSerializer`` (``ForkingPickler`` out, ``SafeUnpickler`` in) is SGLang's;
- the model: a small ``nn.Module`` whose ``load_weights`` copies by name, as SGLang models do;
- modules the import chain names but nothing here calls (vision, TVM FFI, sentencepiece,
  IPython, partial JSON parsing) are empty stand-ins; transformers is told first that they
  are absent.
"""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types
from pathlib import Path
from typing import Any

import torch

STAND_INS = (
    "IPython",
    "IPython.display",
    "torchvision",
    "torchvision.transforms",
    "torchvision.transforms.functional",
    "tvm_ffi",
    "sentencepiece",
    "partial_json_parser",
    "partial_json_parser.core",
    "partial_json_parser.core.exceptions",
    "partial_json_parser.core.options",
)


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


def install_stand_ins() -> None:
    import transformers.utils.import_utils as iu

    iu.is_torchvision_available()  # cached as absent before the stand-ins exist
    iu.is_sentencepiece_available()
    for name in STAND_INS:
        module = _StandIn(name)
        module.__path__ = []
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = module


def cpu_tensors_through_torch() -> None:
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from torch.multiprocessing import reductions

    monkey_patch_torch_reductions()
    sglang_reduce = reductions.reduce_tensor

    def reduce_tensor(tensor: torch.Tensor) -> Any:
        return (sglang_reduce if tensor.is_cuda else reductions._reduce_tensor_original)(tensor)

    reductions.reduce_tensor = reduce_tensor
    reductions.init_reductions()


class TinyModel(torch.nn.Module):
    """Stands for an SGLang model: parameters by HF name, ``load_weights`` copies by name."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)
        self.proj = torch.nn.Linear(4, 3)
        self.loads: list[list[str]] = []

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        self.loads.append([n for n, _ in named])
        with torch.no_grad():
            for name, tensor in named:
                params[name].copy_(tensor)


def build(model: TinyModel, memory_saver: Any = None) -> tuple[Any, list[str]]:
    """SGLang's scheduler-side manager over its model-runner weight updater, one rank;
    ``memory_saver``: the memory saver adapter it drives (else one that records the tags)."""
    from sglang.srt.managers.scheduler_components.weight_updater import (
        SchedulerWeightUpdaterManager,
    )
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.runtime_context import _ConfigBag, get_context, get_parallel
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    events: list[str] = []
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    group = types.SimpleNamespace(cpu_group=torch.distributed.group.WORLD)
    get_parallel().override_permanently(tp_rank=0, tp_size=1, tp_group=group)
    # the one model-config leaf the updaters read (ServerArgs' default), published as a bag
    bag = _ConfigBag("model")
    object.__getattribute__(bag, "_fields")["weight_cache_mode"] = "off"
    get_context()._config_bags = {"model": bag}

    updater = WeightUpdater(
        tp_rank=0,
        device="cpu",
        gpu_id=0,
        model_config=None,
        custom_weight_loaders={},
        get_model=lambda: model,
        update_model_fields=lambda **_: None,
        recapture_cuda_graph=lambda: None,
        get_model_runner=lambda: None,
    )
    runner = types.SimpleNamespace(weight_updater=updater)

    class TpWorker:
        model_runner = types.SimpleNamespace(weight_updater=updater, model=model)

        def weight_update_runners(self) -> list[tuple[str, Any]]:
            return [("target", runner)]

        def deserialize_own_rank(self, payloads: list[bytes]) -> Any:
            monkey_patch_torch_reductions()
            return MultiprocessingSerializer.deserialize(payloads[get_parallel().tp_rank])

    class MemorySaver:
        def pause(self, tag: str) -> None:
            events.append(f"pause({tag})")

        def resume(self, tag: str) -> None:
            events.append(f"resume({tag})")

    class Scheduler:
        _engine_paused = False
        disaggregation_mode = None

        def record_weight_version_change(self, new_version: Any) -> None:
            events.append("weight_version")

    manager = SchedulerWeightUpdaterManager(
        tp_worker=TpWorker(),
        draft_worker=None,
        memory_saver_adapter=memory_saver or MemorySaver(),
        flush_cache=lambda **_: True,
        is_fully_idle=lambda **_: True,
        scheduler=Scheduler(),
    )
    return manager, events


class InProcessEngine:
    """``sglang.Engine``'s weight and memory methods, each building the request struct Engine
    builds and handing it to the scheduler's manager in this process."""

    def __init__(self, manager: Any, events: list[str]) -> None:
        self.manager = manager
        self.events = events

    @staticmethod
    def _result(out: Any) -> tuple[bool, str]:
        return out.success, out.message

    def begin_weight_update(self, selector: str = "all") -> tuple[bool, str]:
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

        self.events.append("begin_weight_update")
        out = self.manager.begin_weight_update(BeginWeightUpdateReqInput(selector=selector))
        return self._result(out)

    def end_weight_update(self) -> tuple[bool, str]:
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

        self.events.append("end_weight_update")
        return self._result(self.manager.end_weight_update(EndWeightUpdateReqInput()))

    def update_weights_from_tensor(
        self, named_tensors: list[Any], load_format: str | None = None, flush_cache: bool = True
    ) -> tuple[bool, str]:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        assert load_format == "flattened_bucket", load_format  # the colocated path's format
        self.events.append("update_weights_from_tensor")
        req = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=list(named_tensors),
            load_format=load_format,
            flush_cache=flush_cache,
        )
        return self._result(self.manager.update_weights_from_tensor(req))

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> tuple[bool, str]:
        from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

        req = UpdateWeightsFromDistributedReqInput(
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            group_name=group_name,
            flush_cache=flush_cache,
            load_format=load_format,
        )
        return self._result(self.manager.update_weights_from_distributed(req))

    def release_memory_occupation(self, tags: list[str] | None = None) -> Any:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        return self.manager.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=tags))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> Any:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        return self.manager.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=tags))


def host_for(adapter: Any, weights: dict[str, torch.Tensor], bucket_bytes: int) -> Any:
    """The real ``WorkerHost`` (workers/host.py) of a colocated engine with ``offload``, one
    tensor-parallel rank (no peer processes), without Ray: only its state is set here."""
    from collections import deque

    from ppojob_api.training import TrainerConfig
    from ppojob_trainer.backends.weight_sync import WeightStream
    from ppojob_trainer.workers.host import RecordedEngine, WorkerHost

    cfg = TrainerConfig.model_validate(
        {
            "roles": {
                "rollout": {
                    "backend": "sglang",
                    "colocateWithActor": True,
                    "offload": True,
                    "weightSyncBucketMb": bucket_bytes / 2**20,
                },
            },
            "algorithm": {"advantageEstimator": "grpo"},
        }
    )
    host = WorkerHost.__new__(WorkerHost)
    host.cfg, host.device, host.events = cfg, "cpu", deque()
    host.rollout = types.SimpleNamespace(engine=RecordedEngine(adapter, host.events))
    host.actor = types.SimpleNamespace(
        trainer=types.SimpleNamespace(
            export_weights=lambda: weights,
            export_weight_stream=lambda limit: WeightStream.of(weights, limit),
        )
    )
    host._weights = host._staged = None
    return host


def main() -> None:
    import ray  # before the stand-ins (Ray looks for IPython)

    install_stand_ins()
    cpu_tensors_through_torch()

    from ppojob_trainer.backends.sglang_backend import SGLangGenerationEngine, serialize_bucket
    from ppojob_trainer.backends.weight_sync import flatten

    def get(refs: list[Any]) -> list[Any]:  # no peers, so the host waits on nothing
        assert refs == [], refs
        return []

    ray.get = get

    model = TinyModel()
    manager, events = build(model)
    adapter = SGLangGenerationEngine.__new__(SGLangGenerationEngine)
    adapter.engine = InProcessEngine(manager, events)
    adapter.offload = True

    torch.manual_seed(0)
    ours = {
        "embed.weight": torch.randn(11, 4),
        "proj.weight": torch.randn(3, 4),
        "proj.bias": torch.randn(3),
    }
    host = host_for(adapter, ours, bucket_bytes=64)  # several buckets

    result: dict[str, Any] = {}
    # a step's sleep and wake and sync, as the loop drives them on the engine's process
    try:
        host.release_memory()
        host.resume_memory()
        host.sync_colocated(1, [])
    except RuntimeError as exc:
        result["error"] = str(exc)
    loaded = dict(model.named_parameters())
    result["equal"] = {n: bool(torch.equal(loaded[n].detach(), t)) for n, t in ours.items()}
    result["loads"] = model.loads
    result["sglang_events"] = events
    result["host_events"] = list(host.events)
    result["offload_tags_left"] = sorted(manager.offload_tags)

    # a call outside a session: SGLang refuses it, and the adapter must raise
    bucket = flatten(ours.items(), "cpu")
    try:
        adapter.update_weights_from_tensor([serialize_bucket(bucket)], flush_cache=True)
        result["outside_session"] = "accepted"
    except RuntimeError as exc:
        result["outside_session"] = str(exc)
    try:  # refused before any group is touched, so no sender is needed
        adapter.update_weights_from_distributed(
            ["proj.bias"], ["float32"], [[3]], group_name="g", flush_cache=True
        )
        result["distributed_outside_session"] = "accepted"
    except RuntimeError as exc:
        result["distributed_outside_session"] = str(exc)
    # our sampling parameters through SGLang's own SamplingParams and its validation
    from sglang.srt.sampling.sampling_params import SamplingParams

    from ppojob_trainer.backends.sglang_backend import row_seeds, sampling_params

    seeds = []
    for row_seed in row_seeds(7, 4):
        params = SamplingParams(**sampling_params(16, 0.8, 0.95, [2, 3], row_seed))
        params.verify(11)
        params.normalize(None)  # what SGLang does without a tokenizer (skip_tokenizer_init)
        seeds.append(params.sampling_seed)
    result["sampling_seeds"] = seeds
    try:  # the check runs: a stop string needs the tokenizer
        SamplingParams(**sampling_params(16, 0.8, 0.95, [2], 0), stop=["\n"]).normalize(None)
        result["stop_string_without_tokenizer"] = "accepted"
    except ValueError as exc:
        result["stop_string_without_tokenizer"] = str(exc)
    # the engine's arguments through SGLang's own ServerArgs (its resolution hooks run)
    from sglang.srt.server_args import ServerArgs

    from ppojob_api.training import TrainerConfig
    from ppojob_trainer.backends.sglang_backend import engine_args

    cfg = TrainerConfig.model_validate(
        {
            "roles": {"rollout": {"backend": "sglang", "colocateWithActor": True}},
            "algorithm": {"advantageEstimator": "grpo"},
        }
    )
    server_args = ServerArgs(**engine_args(cfg, Path("/models/m"), (30001, 30002)))
    result["skip_tokenizer_init"] = server_args.skip_tokenizer_init
    try:
        SamplingParams(**sampling_params(16, 0.8, 1.5, [2], 0)).verify(11)
        result["bad_top_p"] = "accepted"
    except ValueError as exc:
        result["bad_top_p"] = str(exc)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
