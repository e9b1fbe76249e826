"""Routing replay's rollout record from SGLang (``algorithm.routingReplay: rollout``): the
adapter's reader of ``meta_info.routed_experts`` against SGLang's own capture, encoding and
reader (``sglang_routing_driver.py``, a subprocess with the pinned SGLang package; skipped
without it, failed under CI), and the engine arguments and request that ask for it."""

from __future__ import annotations

from pathlib import Path

from ppojob_api.training import TrainerConfig
from ppojob_trainer.backends.sglang_backend import engine_args
from tests.helpers.sglang_runtime import run_driver

DRIVER = Path(__file__).with_name("sglang_routing_driver.py")


def test_our_reader_places_what_sglang_writes_in_the_prompt_and_response_columns() -> None:
    result = run_driver(DRIVER)
    assert result["sglang_reads_its_own"]  # the layout we decode is SGLang's own
    assert result["placed"]
    assert result["shapes"] == [[3, 4, 3, 2], [3, 4, 3, 2]]
    assert result["dtype"] == "torch.int16"
    assert "not the 6 it fed" in result["refused_a_wrong_count"]  # 2 + 5 - 1


def test_the_engine_is_started_to_return_routed_experts_only_under_replay() -> None:
    def cfg(replay: str) -> TrainerConfig:
        return TrainerConfig.model_validate(
            {
                "model": {"path": "builtin:tiny-qwen3-moe", "dtype": "bfloat16"},
                "roles": {
                    "actor": {"resources": {"gpus": 1}},
                    "rollout": {
                        "backend": "sglang",
                        "colocateWithActor": True,
                        "gpuMemoryFraction": 0.5,
                    },
                },
                "algorithm": {"routingReplay": replay},
            }
        )

    on = engine_args(cfg("rollout"), Path("/models/m"), gpu_gib=80.0)
    off = engine_args(cfg("none"), Path("/models/m"), gpu_gib=80.0)
    assert on["enable_return_routed_experts"] is True
    assert "enable_return_routed_experts" not in off
