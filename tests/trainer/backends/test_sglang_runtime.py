"""The sglang adapter and the worker host against SGLang's OWN weight-update code, on the CPU.

``sglang_runtime_driver.py`` runs in a subprocess whose path holds the pinned SGLang package and
the few pure-Python modules its weight updater imports (``make install`` puts them in
``<virtualenv>/test-cache/sglang-runtime``; ``$PPOJOB_SGLANG_RUNTIME`` names another folder). It
runs a colocated step's sleep, wake and weight sync through the real ``WorkerHost`` and adapter
into SGLang's scheduler-side ``SchedulerWeightUpdaterManager`` and model-runner
``WeightUpdater`` (see the driver's docstring for the few parts that are stand-ins, and why).
Without the folder the test skips, saying how to fill it; under CI (``CI=true``) it fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.sglang_runtime import run_driver

DRIVER = Path(__file__).with_name("sglang_runtime_driver.py")


@pytest.fixture(scope="module")
def run() -> dict:
    return run_driver(DRIVER)


def test_a_colocated_sync_loads_our_buckets_inside_a_session_of_sglangs_own_updater(run):
    """SGLang 0.5.23 refuses ``update_weights_from_tensor`` outside a weight-update session; the
    host opens one around the buckets, SGLang deserializes each flattened-bucket payload with
    its own serializer and rebuilds our tensors exactly."""
    assert "error" not in run, run.get("error")
    assert all(run["equal"].values()), run["equal"]
    assert run["loads"] == [["embed.weight"], ["proj.weight", "proj.bias"]]  # one per bucket
    engine_calls = [e for e in run["host_events"] if e.startswith("engine.")]
    assert engine_calls[engine_calls.index("engine.begin_weight_update") + 1 :][:3] == [
        "engine.update_weights_from_tensor",
        "engine.update_weights_from_tensor",
        "engine.end_weight_update",
    ]


def test_a_refused_update_raises_instead_of_leaving_stale_weights(run):
    """A ``(False, message)`` from SGLang is an error (it used to be discarded, and the engine
    went on sampling from stale weights)."""
    for key in ("outside_session", "distributed_outside_session"):
        assert run[key].startswith("sglang update_weights_from_"), run[key]
        assert "must run between begin_weight_update() and end_weight_update()" in run[key]


def test_a_colocated_engine_wakes_in_two_halves_around_the_sync(run):
    """verl's order: empty the allocator's cache -> resume weights -> sync -> empty cache ->
    resume KV cache (and CUDA graphs); SGLang's own memory-saver tag handling sees exactly
    that, and nothing stays offloaded."""
    assert run["host_events"] == [
        "engine.release_memory",
        "cuda.empty_cache",
        "engine.resume_memory(weights)",
        "engine.begin_weight_update",
        "engine.update_weights_from_tensor",
        "engine.update_weights_from_tensor",
        "engine.end_weight_update",
        "cuda.empty_cache",
        "engine.resume_memory(kv_cache,cuda_graph)",
    ]
    sglang = run["sglang_events"]
    assert sorted(sglang[:3]) == ["pause(cuda_graph)", "pause(kv_cache)", "pause(weights)"]
    assert sglang[3:5] == ["resume(weights)", "begin_weight_update"]
    end = sglang.index("end_weight_update")
    assert sorted(sglang[end + 1 : end + 3]) == ["resume(cuda_graph)", "resume(kv_cache)"]
    assert run["offload_tags_left"] == []


def test_our_sampling_parameters_pass_sglangs_own_validation(run):
    """Every row's parameters build SGLang's ``SamplingParams`` and pass its ``verify``, each
    with its own seed; SGLang's validation itself runs (an out-of-range top_p is refused)."""
    assert len(set(run["sampling_seeds"])) == 4, run["sampling_seeds"]
    assert "top_p" in run["bad_top_p"], run["bad_top_p"]


def test_the_engine_runs_without_its_tokenizer_and_our_requests_need_none(run):
    """Our engine arguments through SGLang's own ``ServerArgs`` keep ``skip_tokenizer_init``,
    and every row's sampling parameters pass SGLang's own ``normalize`` with no tokenizer (what
    its scheduler does under that setting); the check itself runs: a stop string is refused."""
    assert run["skip_tokenizer_init"] is True
    assert "skip_tokenizer_init" in run["stop_string_without_tokenizer"]
