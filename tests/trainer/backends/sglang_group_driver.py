"""Run by tests/trainer/backends/test_sglang_group.py, twice side by side, as the two ends of a
disaggregated weight sync on this host (a local run: loopback), with gloo:

``python sglang_group_driver.py actor PORT GROUP``
    our side: ``weight_sync.init_custom_group`` as rank 0 (as ``WorkerHost.init_weight_sender``
    calls it), then our sender, ``weight_sync.broadcast_stream`` (what
    ``WorkerHost.broadcast_weights`` runs): one broadcast per packed bucket; prints the TCP
    sockets this process listened on and what it sent (collectives, bytes, the announced
    names/dtypes/shapes of each).
``python sglang_group_driver.py engine PORT GROUP``
    an SGLang engine's side, through the adapter (``SGLangGenerationEngine``) and SGLang's OWN
    scheduler-side manager and model-runner ``WeightUpdater`` (``sglang_runtime_driver.py``'s
    stand-ins): ``init_weights_update_group`` (SGLang's ``init_custom_process_group``, dialling
    ``tcp://127.0.0.1:PORT``) as rank 1, then ``update_weights_from_distributed`` in a session,
    once per collective our sender makes, with the names, dtypes and shapes it announces (the
    same pure plan on the same tensors: in a run the leader hands them over Ray); SGLang's own
    ``flattened_bucket`` receiver (``FlattenedTensorBucket.empty``, one broadcast,
    ``reconstruct_tensors``) unpacks what we sent; prints whether its model now holds the
    actor's tensors and what each of SGLang's loads held.

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


BUCKET_BYTES = 1 << 20
"""One bucket holds every tensor: only the alignment cut makes a second collective."""


def actor_tensors() -> dict[str, torch.Tensor]:
    """Mixed dtypes as a real export has them: a bf16 tensor of odd length, packed without
    padding, leaves the next float32 tensor unaligned, so the sender must cut the bucket there
    (SGLang's receiver refuses an unaligned tensor)."""
    g = torch.Generator().manual_seed(7)
    return {
        "embed.weight": torch.randn(11, 3, generator=g),
        "norm.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "proj.weight": torch.randn(3, 4, generator=g),
        "proj.bias": torch.randn(3, generator=g),
    }


def announced() -> list[tuple[list[str], list[str], list[list[int]], bool]]:
    """What our sender announces per collective for :func:`actor_tensors`, in order (its pure
    plan, run without a group)."""
    from ppojob_trainer.backends.weight_sync import WeightStream, broadcast_stream

    calls: list[tuple[list[str], list[str], list[list[int]], bool]] = []

    def receive(*meta: Any) -> None:
        calls.append(meta)  # type: ignore[arg-type]

    import torch.distributed as dist

    real, dist.broadcast = dist.broadcast, lambda *a, **k: None  # type: ignore[assignment]
    try:
        broadcast_stream(WeightStream.of(actor_tensors(), BUCKET_BYTES), None, "cpu", receive)
    finally:
        dist.broadcast = real
    return calls


def actor(port: int, group_name: str) -> dict[str, Any]:
    from ppojob_trainer.backends.weight_sync import (
        WeightStream,
        broadcast_stream,
        init_custom_group,
    )

    group = init_custom_group("gloo", "127.0.0.1", port, 2, 0, group_name, timeout_s=TIMEOUT_S)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/trainer
    from local_listeners_driver import listening

    listeners = listening()
    sent: list[Any] = []
    stream = WeightStream.of(actor_tensors(), BUCKET_BYTES)
    stats = broadcast_stream(stream, group, "cpu", lambda *meta: sent.append(meta))
    return {
        "sent": sent,
        "collectives": stats.collectives,
        "bytes": stats.bytes,
        "listening": listeners,
    }


class GroupModel(torch.nn.Module):
    """Stands for an SGLang model holding :func:`actor_tensors`' names and dtypes;
    ``load_weights`` copies by name and records each load's names."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 3)
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
        self.proj = torch.nn.Linear(4, 3)
        self.loads: list[list[str]] = []

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        self.loads.append([n for n, _ in named])
        with torch.no_grad():
            for name, tensor in named:
                assert params[name].dtype == tensor.dtype, (name, tensor.dtype)
                params[name].copy_(tensor)


def engine(port: int, group_name: str) -> dict[str, Any]:
    import ray  # before the stand-ins (Ray looks for IPython)
    from sglang_runtime_driver import (
        InProcessEngine,
        build,
        cpu_tensors_through_torch,
        install_stand_ins,
    )

    del ray
    install_stand_ins()
    cpu_tensors_through_torch()
    from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput

    from ppojob_trainer.backends.sglang_backend import SGLangGenerationEngine

    model = GroupModel()
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
    for names, dtypes, shapes, last in announced():
        adapter.update_weights_from_distributed(
            names, dtypes, shapes, group_name=group_name, flush_cache=last
        )
    adapter.end_weight_update()
    loaded = dict(model.named_parameters())
    return {
        "equal": {n: bool(torch.equal(loaded[n].detach(), t)) for n, t in ours.items()},
        "loads": model.loads,
    }


def main() -> None:
    role, port, group_name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    result = (actor if role == "actor" else engine)(port, group_name)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
