"""Run by tests/trainer/backends/test_sglang_group.py, twice side by side, as the two ends of a
disaggregated weight sync on this host (a local run: loopback), with gloo:

``python sglang_group_driver.py actor PORT GROUP``
    our side: ``weight_sync.init_custom_group`` as rank 0 (as ``WorkerHost.init_weight_sender``
    calls it), then one broadcast from rank 0 per tensor (as ``broadcast_weights`` sends a
    bucket); prints the TCP sockets this process listened on.
``python sglang_group_driver.py engine PORT GROUP``
    an SGLang engine's side, through the adapter (``SGLangGenerationEngine``) and SGLang's OWN
    scheduler-side manager and model-runner ``WeightUpdater`` (``sglang_runtime_driver.py``'s
    stand-ins): ``init_weights_update_group`` (SGLang's ``init_custom_process_group``, dialling
    ``tcp://127.0.0.1:PORT``) as rank 1, then ``update_weights_from_distributed`` in a session;
    prints whether its model now holds the actor's tensors.

Each prints one JSON object on its last line. Stand-in on the engine's side, and why: the
tensor-parallel worker's ``init_weights_update_group`` (its module imports the CUDA scheduler)
repeats its one call into the model runner's updater.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

TIMEOUT_S = 20.0
"""How long our side waits for the engine to join (the test waits a little longer)."""


def actor_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "embed.weight": torch.randn(11, 4, generator=g),
        "proj.weight": torch.randn(3, 4, generator=g),
        "proj.bias": torch.randn(3, generator=g),
    }


def actor(port: int, group_name: str) -> dict[str, Any]:
    import torch.distributed as dist

    from ppojob_trainer.backends.weight_sync import init_custom_group

    group = init_custom_group("gloo", "127.0.0.1", port, 2, 0, group_name, timeout_s=TIMEOUT_S)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/trainer
    from local_listeners_driver import listening

    listeners = listening()
    for tensor in actor_tensors().values():
        dist.broadcast(tensor, src=0, group=group)
    return {"sent": True, "listening": listeners}


def engine(port: int, group_name: str) -> dict[str, Any]:
    import ray  # before the stand-ins (Ray looks for IPython)
    from sglang_runtime_driver import (
        InProcessEngine,
        TinyModel,
        build,
        cpu_tensors_through_torch,
        install_stand_ins,
    )

    del ray
    install_stand_ins()
    cpu_tensors_through_torch()
    from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput

    from ppojob_trainer.backends.sglang_backend import SGLangGenerationEngine

    model = TinyModel()
    manager, _ = build(model)
    updater = manager.tp_worker.model_runner.weight_updater
    manager.tp_worker.init_weights_update_group = lambda req: updater.init_weights_update_group(
        req.master_address,
        req.master_port,
        req.rank_offset,
        req.world_size,
        req.group_name,
        req.backend,
    )

    class Engine(InProcessEngine):
        def init_weights_update_group(self, **kwargs: Any) -> tuple[bool, str]:
            req = InitWeightsUpdateGroupReqInput(**kwargs)
            return self._result(self.manager.init_weights_update_group(req))

    adapter = SGLangGenerationEngine.__new__(SGLangGenerationEngine)
    adapter.engine, adapter.lora, adapter.offload = Engine(manager, []), None, False
    ours = actor_tensors()
    adapter.init_weights_update_group("127.0.0.1", port, 1, 2, group_name, backend="gloo")
    adapter.begin_weight_update()
    adapter.update_weights_from_distributed(
        list(ours),
        [str(t.dtype).removeprefix("torch.") for t in ours.values()],
        [list(t.shape) for t in ours.values()],
        group_name=group_name,
        flush_cache=True,
    )
    adapter.end_weight_update()
    loaded = dict(model.named_parameters())
    return {"equal": {n: bool(torch.equal(loaded[n].detach(), t)) for n, t in ours.items()}}


def main() -> None:
    role, port, group_name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    result = (actor if role == "actor" else engine)(port, group_name)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
