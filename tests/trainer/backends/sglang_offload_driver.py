"""Run by tests/trainer/backends/test_sglang_offload.py in a subprocess whose path holds the
pinned SGLang package (as ``sglang_runtime_driver.py``, whose stand-ins it reuses): a colocated
LoRA engine with ``offload`` through a training step's sleep, wake and adapter sync, on the CPU.
Prints one JSON object on its last line.

SGLang's own code here: ``ServerArgs`` built from exactly our ``engine_args`` and published the
way its model runner publishes them (``RuntimeContext.set_server_args``), its
``load_model_with_memory_saver`` (which reads ``enable_weights_cpu_backup`` from those published
arguments and opens the memory saver's ``weights`` region with or without a host backup), its
scheduler-side ``release_memory_occupation`` / ``resume_memory_occupation`` (the tags released
and resumed, the model's static state stashed and restored), its request structs.

Stand-ins, and why:
- :class:`UnmappingSaver` for ``torch_memory_saver`` (CUDA virtual memory only): it keeps what
  the library documents: a paused region's device memory is unmapped; resumed, it is mapped
  again with undefined contents unless the region was opened with ``enable_cpu_backup``, whose
  bytes are copied to the host on pause and back on resume. Undefined is NaN here, so a lost
  weight cannot pass for a kept one. The tensors of a region are the ones the model loader
  makes inside it (:class:`Loader` hands them over: the real library sees them through its
  allocator hook);
- the model loader (``get_model_loader``: a Hugging Face checkpoint on a CUDA device):
  :class:`Loader` makes the driver's tiny model inside SGLang's region;
- the adapter load itself (``load_lora_adapter_from_tensors``; ``test_sglang_lora.py`` drives
  SGLang's own LoRA manager): it is recorded, and never touches the base weights.
"""

from __future__ import annotations

import contextlib
import json
import types
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from sglang_runtime_driver import (
    InProcessEngine,
    TinyModel,
    build,
    cpu_tensors_through_torch,
    install_stand_ins,
)


class UnmappingSaver:
    """``torch_memory_saver`` as SGLang's adapter drives it, on CPU tensors (see the module's
    docstring)."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.regions: dict[str, bool] = {}  # tag -> enable_cpu_backup
        self.tensors: dict[str, list[torch.Tensor]] = {}
        self.backups: dict[str, list[torch.Tensor]] = {}
        self.open: str | None = None

    @contextlib.contextmanager
    def region(self, tag: str, enable_cpu_backup: bool = False) -> Iterator[None]:
        self.regions[tag] = enable_cpu_backup
        self.open = tag
        try:
            yield
        finally:
            self.open = None

    def allocated(self, tensors: list[torch.Tensor]) -> None:
        assert self.open is not None, "a region's tensors are made inside it"
        self.tensors.setdefault(self.open, []).extend(tensors)

    def pause(self, tag: str) -> None:
        self.events.append(f"pause({tag})")
        held = self.tensors.get(tag, [])
        if self.regions.get(tag):
            self.backups[tag] = [t.detach().clone() for t in held]
        with torch.no_grad():
            for t in held:
                t.fill_(float("nan"))  # unmapped: whatever the pages hold next is undefined

    def resume(self, tag: str) -> None:
        self.events.append(f"resume({tag})")
        if tag not in self.backups:  # mapped again, its contents undefined
            return
        with torch.no_grad():
            for t, saved in zip(self.tensors[tag], self.backups.pop(tag), strict=True):
                t.copy_(saved)


class Loader:
    """A model loader that makes the tiny model inside the region SGLang opened around it."""

    def __init__(self, saver: UnmappingSaver, model: TinyModel) -> None:
        self.saver, self.model = saver, model

    def load_model(self, *, model_config: Any, device_config: Any) -> TinyModel:
        self.saver.allocated([p.data for p in self.model.parameters()])
        return self.model


class LoraEngine(InProcessEngine):
    """The in-process engine of ``sglang_runtime_driver.py`` with ``Engine``'s LoRA calls
    recorded (answered with SGLang's own ``LoRAUpdateOutput``) and its ``server_args``."""

    def __init__(self, manager: Any, events: list[str], server_args: Any) -> None:
        super().__init__(manager, events)
        self.server_args = server_args

    def load_lora_adapter_from_tensors(self, lora_name: str, **_: Any) -> Any:
        from sglang.srt.managers.io_struct import LoRAUpdateOutput

        self.events.append(f"load({lora_name})")
        return LoRAUpdateOutput(success=True)

    def unload_lora_adapter(self, lora_name: str) -> Any:
        from sglang.srt.managers.io_struct import LoRAUpdateOutput

        self.events.append(f"unload({lora_name})")
        return LoRAUpdateOutput(success=True)


def lora_cfg() -> Any:
    from ppojob_api.training import TrainerConfig

    return TrainerConfig.model_validate(
        {
            "model": {"lora": {"rank": 2}},
            "roles": {"rollout": {"backend": "sglang", "colocateWithActor": True}},
            "algorithm": {"advantageEstimator": "grpo"},
        }
    )


def host_for(adapter: Any, cfg: Any) -> Any:
    """The real ``WorkerHost`` of the colocated engine (one TP rank, no peers), without Ray."""
    from ppojob_trainer.workers.host import RecordedEngine, WorkerHost

    adapters = {
        "proj.lora_A": torch.randn(2, 4),
        "proj.lora_B": torch.randn(3, 2),
    }
    host = WorkerHost.__new__(WorkerHost)
    host.cfg, host.device, host.events = cfg, "cpu", deque()
    host.rollout = types.SimpleNamespace(engine=RecordedEngine(adapter, host.events))
    host.actor = types.SimpleNamespace(
        trainer=types.SimpleNamespace(export_weights=lambda: adapters)
    )
    host._weights = host._staged = None
    host.policy_version = 0
    return host


def main() -> None:
    import ray  # before the stand-ins (Ray looks for IPython)

    install_stand_ins()
    cpu_tensors_through_torch()
    ray.get = lambda refs: [] if refs == [] else refs  # no peers: the host waits on nothing

    import sglang.srt.model_executor.model_runner_components.load_model_utils as load_utils
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs

    from ppojob_trainer.backends.sglang_backend import SGLangGenerationEngine, engine_args

    cfg = lora_cfg()
    args = engine_args(cfg, Path("/models/m"), (30001, 30002))
    server_args = ServerArgs(**args)  # the pinned release takes exactly these arguments

    torch.manual_seed(0)
    model = TinyModel()
    events: list[str] = []
    saver = UnmappingSaver(events)
    manager, manager_events = build(model, memory_saver=saver)
    get_context().set_server_args(server_args)  # what the model runner reads from

    load_utils.get_model_loader = lambda **_: Loader(saver, model)
    loaded = load_utils.load_model_with_memory_saver(
        model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(architectures=[])),
        load_config=None,
        device="cpu",
        gpu_id=0,
        memory_saver_adapter=saver,
        is_draft_worker=False,
    )
    assert loaded.model is model
    base = {n: p.detach().clone() for n, p in model.named_parameters()}

    adapter = SGLangGenerationEngine.__new__(SGLangGenerationEngine)
    adapter.engine = LoraEngine(manager, events, server_args)
    adapter.offload = cfg.roles.rollout.colocate_with_actor and cfg.roles.rollout.offload
    adapter.lora, adapter.adapter_loaded = cfg.model.lora, False
    host = host_for(adapter, cfg)

    result: dict[str, Any] = {
        "engine_args": {k: args[k] for k in sorted(args) if k != "model_path"}
    }
    try:  # two steps: sleep, wake for the sync, the adapter sync, the rest of the wake
        for step in (1, 2):
            host.release_memory()
            host.resume_memory()
            host.sync_colocated(step, [])
    except (RuntimeError, AssertionError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["regions"] = saver.regions
    result["sglang_events"] = events + manager_events
    result["offload_tags_left"] = sorted(manager.offload_tags)
    result["base_kept"] = {
        n: bool(torch.equal(p.detach(), base[n])) for n, p in model.named_parameters()
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
