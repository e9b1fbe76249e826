"""Item 12 of issue 21: a colocated SGLang sync must not let the next bucket land on GPU memory
the engine may still be copying. SGLang 0.5.23's ``update_weights_from_tensor`` returns once its
scheduler has queued the copies (``load_weights`` and a CPU barrier, no device synchronisation),
so each staged bucket stays referenced until the engine's call for it has returned, and is then
released with this process's device work finished and torch's IPC blocks collected, before the
next bucket is flattened and before the KV cache wakes.

The real ``WorkerHost`` runs the sync on the CPU; ``torch.cuda``'s ``synchronize``,
``ipc_collect`` and ``empty_cache`` are replaced by recorders, the engine by one that logs its
calls and checks that the bucket it is handed is still alive."""

from __future__ import annotations

import types
import weakref
from collections import deque
from typing import Any

import torch

from ppojob_api.training import TrainerConfig
from ppojob_trainer.backends import sglang_backend
from ppojob_trainer.backends.weight_sync import WeightStream
from ppojob_trainer.workers import host as host_module
from ppojob_trainer.workers.host import WorkerHost


class Engine:
    """A colocated engine: logs its calls; each update checks its payloads' buckets are alive."""

    def __init__(self, log: list[str]) -> None:
        self.log, self.updates = log, 0

    def begin_weight_update(self) -> None:
        self.log.append("engine.begin")

    def end_weight_update(self) -> None:
        self.log.append("engine.end")

    def update_weights_from_tensor(self, payloads: list[Any], *, flush_cache: bool) -> None:
        assert all(p["flat"]() is not None for p in payloads), (
            "bucket freed before the engine read it"
        )
        self.log.append(f"engine.update({self.updates})")
        self.updates += 1

    def resume_memory(self, tags: Any) -> None:
        self.log.append(f"engine.resume({','.join(tags)})")


def test_each_bucket_outlives_the_engines_call_and_is_collected_before_the_next(monkeypatch):
    log: list[str] = []
    flats: list[weakref.ref[torch.Tensor]] = []

    def serialize(bucket: Any) -> dict[str, Any]:  # a CUDA IPC handle holds no reference
        flats.append(weakref.ref(bucket.flattened_tensor))
        log.append(f"stage({len(flats) - 1})")
        return {"flat": flats[-1]}

    def ipc_collect() -> None:
        # everything staged before the bucket being staged now (if any) is no longer ours
        assert all(f() is None for f in flats), "a bucket still referenced when collecting"
        log.append("cuda.ipc_collect")

    def flatten(*args: Any) -> Any:  # the next bucket's memory is taken here
        log.append("flatten")
        return real_flatten(*args)

    real_flatten = host_module.flatten
    monkeypatch.setattr(host_module, "flatten", flatten)
    monkeypatch.setattr(sglang_backend, "serialize_bucket", serialize)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: log.append("cuda.synchronize"))
    monkeypatch.setattr(torch.cuda, "ipc_collect", ipc_collect)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append("cuda.empty_cache"))
    monkeypatch.setattr(host_module.ray, "get", lambda refs: [] if refs == [] else 1 / 0)

    weights = {f"w{i}": torch.full((4, 4), float(i)) for i in range(3)}  # 64 bytes each
    host = WorkerHost.__new__(WorkerHost)
    host.cfg = TrainerConfig.model_validate(
        {
            "roles": {
                "rollout": {
                    "backend": "sglang",
                    "colocateWithActor": True,
                    "offload": True,
                    "weightSyncBucketMb": 64 / 2**20,  # one tensor a bucket
                },
            },
            "algorithm": {"advantageEstimator": "grpo"},
        }
    )
    host.device, host.events = "cpu", deque()
    host.rollout = types.SimpleNamespace(engine=Engine(log))
    host.actor = types.SimpleNamespace(
        trainer=types.SimpleNamespace(
            export_weights=lambda: weights,
            export_weight_stream=lambda limit: WeightStream.of(weights, limit),
        )
    )
    host._weights = host._staged = None

    host.sync_colocated(1, [])

    release = ["cuda.synchronize", "cuda.ipc_collect"]
    assert log == [
        "engine.begin",
        "flatten",
        "stage(0)",
        "engine.update(0)",
        *release,
        "flatten",
        "stage(1)",
        "engine.update(1)",
        *release,
        "flatten",
        "stage(2)",
        "engine.update(2)",
        "engine.end",
        *release,  # the last bucket, before the KV cache wakes
        "cuda.empty_cache",
        "engine.resume(kv_cache,cuda_graph)",
    ]
