"""Finding 1 of issue 40: a colocated LoRA engine with ``offload`` keeps its base weights.

With LoRA a sync sends the adapters only, so the engine's base weights must come back from the
sleep as they were. ``sglang_offload_driver.py`` runs, in a subprocess whose path holds the
pinned SGLang package, SGLang's own ``ServerArgs`` (from exactly our ``engine_args``), its own
model loading under the memory saver's ``weights`` region, and its own scheduler-side
release/resume, through the real ``WorkerHost`` and adapter, for two training steps; the memory
saver stands in for ``torch_memory_saver`` (a released region's memory comes back undefined
unless it was opened with a host backup). Without the runtime folder the tests skip; under CI
they fail.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from ppojob_api.training import TrainerConfig
from ppojob_trainer.backends.sglang_backend import SGLangGenerationEngine, engine_args
from tests.helpers.sglang_runtime import run_driver

DRIVER = Path(__file__).with_name("sglang_offload_driver.py")


@pytest.fixture(scope="module")
def run() -> dict:
    return run_driver(DRIVER)


def test_a_lora_engine_samples_from_its_own_base_weights_after_each_wake(run):
    """SGLang releases every tag (weights included) and wakes them; the adapter sync sends no
    base weight, so SGLang must have kept a host copy of them (its weights region opened with
    ``enable_cpu_backup``, which it takes from ``enable_weights_cpu_backup``)."""
    assert "error" not in run, run["error"]
    assert all(run["base_kept"].values()), run["base_kept"]
    assert run["regions"] == {"weights": True}
    assert run["engine_args"]["enable_weights_cpu_backup"] is True
    assert run["engine_args"]["enable_memory_saver"] is True


def test_each_step_sleeps_wakes_and_loads_only_the_adapter(run):
    """Every tag released and woken each step (nothing stays offloaded), the weights before the
    adapter load, and the adapter replaced under one name: no base-weight update at all."""
    events = run["sglang_events"]
    step = len(events) // 2
    first, second = events[:step], events[step:]
    for events_of_step in (first, second):
        assert sorted(events_of_step[:3]) == [
            "pause(cuda_graph)",
            "pause(kv_cache)",
            "pause(weights)",
        ]
        assert events_of_step[3] == "resume(weights)"
        assert sorted(events_of_step[-2:]) == ["resume(cuda_graph)", "resume(kv_cache)"]
    assert first[4:-2] == ["load(policy)"]
    assert second[4:-2] == ["unload(policy)", "load(policy)"]
    assert run["offload_tags_left"] == []


def _cfg(lora: bool, **rollout: object) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "model": {"lora": {"rank": 2}} if lora else {},
            "roles": {"rollout": {"backend": "sglang", **rollout}},
            "algorithm": {"advantageEstimator": "grpo"},
        }
    )


@pytest.mark.parametrize(
    ("lora", "rollout", "saver", "backup"),
    [
        (True, {"colocateWithActor": True}, True, True),  # offload is the default
        (False, {"colocateWithActor": True}, True, False),  # a full sync rewrites every weight
        (True, {"colocateWithActor": True, "offload": False}, False, False),
        (True, {"resources": {"gpus": 1}}, False, False),  # its own GPUs: never released
    ],
)
def test_the_host_copy_of_the_weights_is_asked_for_exactly_when_a_sync_sends_adapters_only(
    lora: bool, rollout: dict, saver: bool, backup: bool
):
    args = engine_args(_cfg(lora, **rollout), Path("/m"))
    assert args["enable_memory_saver"] is saver
    assert args["enable_weights_cpu_backup"] is backup


class ReleasingEngine:
    def __init__(self, backup: bool) -> None:
        self.server_args = SimpleNamespace(enable_weights_cpu_backup=backup)
        self.calls: list[str] = []

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.calls.append("release")


@pytest.mark.parametrize("backup", [False, True])
def test_a_lora_engine_without_the_host_copy_is_never_released(backup: bool):
    """Whatever started the engine, the adapter refuses to release a LoRA engine whose base
    weights would not come back (an error, not undefined samples)."""
    cfg = _cfg(True, colocateWithActor=True)
    adapter = SGLangGenerationEngine.__new__(SGLangGenerationEngine)
    adapter.engine, adapter.offload, adapter.lora = ReleasingEngine(backup), True, cfg.model.lora
    if backup:
        adapter.release_memory()
        assert adapter.engine.calls == ["release"]
        return
    with pytest.raises(RuntimeError, match="would lose the base weights"):
        adapter.release_memory()
    assert adapter.engine.calls == []
