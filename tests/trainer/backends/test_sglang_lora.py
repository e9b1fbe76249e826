"""A LoRA actor's adapter-only sync into SGLang's OWN LoRA code, on the CPU.

``sglang_lora_driver.py`` runs in a subprocess whose path holds the pinned SGLang package (as
``test_sglang_runtime.py``'s driver; see its docstring for the few stand-ins): our adapters of a
tiny Qwen2 go through the real ``WorkerHost`` and adapter into SGLang's request structs, TP-worker
load, ``LoRAManager``, ``LoRAAdapter`` and memory pool, and SGLang's torch-native LoRA kernels then
compute each adapted weight's delta from the pool's buffers. Without the folder the tests that
need it skip, saying how to fill it; under CI (``CI=true``) they fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ppojob_api.checks.efficiency import check_lora
from ppojob_api.memory_plan import Shape
from ppojob_api.training import TrainerConfig
from ppojob_trainer.driver.topology import adapters_through_store
from tests.helpers.sglang_runtime import run_driver

DRIVER = Path(__file__).with_name("sglang_lora_driver.py")
TOLERANCE = 1e-5  # float32, the same products summed in another order


@pytest.fixture(scope="module")
def run() -> dict:
    return run_driver(DRIVER)


def layer_keys(*names: str) -> list[str]:
    blocks = {"o_proj": "self_attn", "q_proj": "self_attn", "k_proj": "self_attn"}
    blocks.update(v_proj="self_attn", gate_proj="mlp", up_proj="mlp", down_proj="mlp")
    return sorted(f"model.layers.{i}.{blocks[n]}.{n}.weight" for i in range(2) for n in names)


@pytest.mark.parametrize(
    ("case", "adapted"),
    [
        (
            "attn_mlp",
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
        ("q_v", ["q_proj", "v_proj"]),  # SGLang zero-fills the k slice of its qkv buffer
        ("store", ["q_proj", "v_proj", "o_proj"]),  # disaggregated: through the object store
    ],
)
def test_sglang_computes_our_merged_weights_from_the_adapters_we_send(run, case, adapted):
    """base + SGLang's scaling x B A (its kernels on its pool's buffers, filled from the PEFT
    tensors and config we send) equals our merged weights for every projection, adapted or not;
    our B carries alpha / r already, so the config's lora_alpha makes SGLang's scaling 1."""
    r = run[case]
    assert r["errors"] == [], r["errors"]
    assert r["adapted"] == layer_keys(*adapted)
    assert r["min_moved"] > 0.1  # the adapters do move every adapted weight
    assert max(r["max_err"].values()) < TOLERANCE, r["max_err"]


@pytest.mark.parametrize("case", ["attn_mlp", "store"])
def test_each_sync_replaces_the_adapter_under_one_name_without_a_weight_session(run, case):
    """Version 2 unloads version 1 first: SGLang refuses to load a name already loaded (as the
    driver's direct second load shows), and its registry then resolves the name to the newest
    adapter, the only one held. No weight-update session: SGLang does not need one for an
    adapter (its stand-in engine has none, and a call would fail the sync)."""
    r = run[case]
    assert r["engine_calls"] == ["generate", "load(policy)", "unload(policy)", "load(policy)"]
    assert r["loaded_ids"] == 1 and r["registry_resolves_newest"] is True
    # PEFT's names reach SGLang's parser (its q/k/v and gate/up stacking keeps their form)
    prefix = "base_model.model.model.layers.0."
    assert r["names_sglang_parsed"] and all(
        n.startswith(prefix) and n.endswith((".lora_A.weight", ".lora_B.weight"))
        for n in r["names_sglang_parsed"]
    ), r["names_sglang_parsed"]
    assert r["load_again"] == [
        False,
        "Failed to load LoRA adapter policy because it is already loaded",
    ]


def test_requests_name_the_adapter_once_one_is_loaded(run):
    """Before the first sync the engine samples from the base model (the actor's adapters start
    at B = 0); after it every row of a request names the adapter (SGLang's own
    ``GenerateReqInput`` normalization of our ``lora_path``)."""
    r = run["attn_mlp"]
    assert r["lora_paths_before"] is None
    assert r["lora_paths_after"] == ["policy", "policy"]


def test_sglangs_own_lora_argument_check_accepts_our_server_args(run):
    """``engine_args`` of a LoRA job as ``ServerArgs``, through ``check_lora_server_args``
    (which refuses LoRA without both a maximum rank and target modules when no adapter is
    given at start)."""
    assert run["server_args"] == {"listed": "ok", "all_linear": "ok"}
    args = run["attn_mlp"]["server_args"]
    assert args["max_lora_rank"] == 4 and args["max_loras_per_batch"] == 1


def spec_with(targets: list[str]) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "model": {"lora": {"rank": 4, "targetModules": targets}},
            "roles": {"rollout": {"backend": "sglang", "resources": {"gpus": 1}}},
            "algorithm": {"advantageEstimator": "grpo"},
        }
    )


def test_validate_refuses_exactly_the_targets_sglang_cannot_serve(run):
    """Each target set through SGLang's own loading: the ones it fails on (at load, or, worse,
    only when a batch first uses the adapter) are the ones ``check_lora`` refuses; the ones it
    serves correctly pass."""
    outcomes = run["outcomes"]
    assert "ok" in outcomes.values() and set(outcomes.values()) != {"ok"}
    for targets, outcome in outcomes.items():
        problems = check_lora(spec_with(targets.split(",")))
        assert (problems == []) == (outcome == "ok"), (targets, outcome, problems)


@pytest.mark.parametrize(
    ("case", "targets"),
    [
        ("attn_mlp", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        ("q_v", ["q_proj", "v_proj"]),
    ],
)
def test_the_memory_plan_counts_the_buffers_sglangs_pool_allocates(run, case, targets):
    """SGLang's real ``LoRAMemoryPool`` for the tiny Qwen2 (hidden 16, 2 layers, 4 heads, 2 KV
    heads, intermediate 32, rank 4, float32, one slot) against the plan's figure."""
    shape = Shape(16, 2, 4, 2, 32, 50)
    assert shape.sglang_lora_pool(4, targets, 4, 1) == run[case]["pool_bytes"]


def test_the_memory_plan_notes_the_lora_buffers_of_an_sglang_engine():
    from ppojob_api.memory_plan import plan_job

    cfg = TrainerConfig.model_validate(
        {
            "model": {
                "path": "Qwen/Qwen2.5-7B-Instruct",
                "dtype": "bfloat16",
                "lora": {"rank": 16},
            },
            "roles": {
                "actor": {"resources": {"gpus": 1}},
                "rollout": {"backend": "sglang", "colocateWithActor": True},
            },
            "algorithm": {"advantageEstimator": "grpo"},
        }
    )
    (note,) = [n for p in plan_job(cfg) for n in p.notes if "LoRA buffers" in n]
    # q/k/v (A: 3 x 3584 in; B: 3584 + 2 x 512 out) and o (3584, 3584) of 28 blocks, rank 16, bf16
    mib = 28 * 16 * (3 * 3584 + 3584 + 2 * 512 + 3584 + 3584) * 2 / 2**20
    assert note.startswith(f"the sglang engine's LoRA buffers take {mib:.1f} MiB")


def test_disaggregated_sglang_engines_take_adapters_through_the_object_store():
    """SGLang loads an adapter only from tensors handed to it, never from a broadcast group."""

    def cfg(**rollout) -> TrainerConfig:
        return TrainerConfig.model_validate(
            {
                "model": {"lora": {"rank": 4}},
                "roles": {"rollout": {"backend": "sglang", "resources": {"gpus": 1}, **rollout}},
                "algorithm": {"advantageEstimator": "grpo"},
            }
        )

    assert adapters_through_store(cfg())
    assert not adapters_through_store(cfg(colocateWithActor=True))
    assert not adapters_through_store(cfg(backend="torch", resources={"gpus": 0}))
    no_lora = cfg().model_copy(update={"model": cfg().model.model_copy(update={"lora": None})})
    assert not adapters_through_store(no_lora)


def test_a_lora_actor_exports_only_its_adapters_for_sglang_engines(tmp_path):
    """The actor's trainer for an sglang rollout exports adapter tensors (which the host renames
    to PEFT's), not the merged model: the point of the adapter-only sync."""
    from ppojob_trainer import models
    from ppojob_trainer.backends.sglang_backend import PEFT_PREFIX, peft_adapter_tensors
    from ppojob_trainer.distributed import ShardIdentity
    from ppojob_trainer.workers.actor import make_policy_trainer

    cfg = spec_with(["q_proj", "v_proj"])
    model_dir = models.materialize_builtin("tiny-llama", 5, tmp_path)
    trainer = make_policy_trainer(cfg, model_dir, None, ShardIdentity("actor"), "cpu", 1)
    weights = trainer.export_weights()
    # q and v of both blocks, A and B each
    assert len(weights) == 2 * 2 * 2 and all(k.endswith((".lora_A", ".lora_B")) for k in weights)
    peft = peft_adapter_tensors(weights)
    assert sorted(peft) == sorted(f"{PEFT_PREFIX}{k}.weight" for k in weights)


def test_the_lora_buffers_shard_like_their_base_layers_across_tensor_parallel_ranks():
    """SGLang's ``get_lora_A_shape`` / ``get_lora_B_shape`` (``lora/mem_pool.py``) split the
    input of row-parallel layers (o_proj, down_proj) and the output of column-parallel ones
    (qkv_proj, gate_up_proj) over ``tp``: o and down's A, qkv and gate_up's B halve at tp 2."""
    shape = Shape(16, 2, 4, 2, 32, 50)
    r, layers = 4, 2
    full = shape.sglang_lora_pool(r, ["q_proj", "v_proj", "o_proj", "down_proj"], 1, 1)
    half = shape.sglang_lora_pool(r, ["q_proj", "v_proj", "o_proj", "down_proj"], 1, 2)
    # qkv B: (16 + 2 x 8) x 4 -> halves; o A: 4 x 16; down A: 4 x 32
    assert full - half == layers * r * ((16 + 16) + 16 + 32) // 2


def test_an_adapter_sglang_refuses_to_load_fails_the_sync(run):
    """SGLang answers a failed load with ``LoRAUpdateOutput(success=False)`` (here: q_proj
    without v_proj, its q/k/v stacking reads v_proj's tensors); the sync raises instead of
    leaving the engine on the previous adapter or none."""
    assert run["outcomes"]["q_proj"].startswith(
        "load: RuntimeError: sglang LoRA load failed: 'base_model.model.model.layers.0."
        "self_attn.v_proj.lora_A.weight'"
    ), run["outcomes"]["q_proj"]


def test_an_adapter_sync_in_several_buckets_or_by_broadcast_is_refused():
    """SGLang loads an adapter in one call from tensors handed to it: a bucket that is not the
    sync's last, or a broadcast, would leave it half-loaded or not at all."""
    from ppojob_api.training import LoraSpec
    from ppojob_trainer.backends.sglang_backend import SGLangGenerationEngine

    engine = SGLangGenerationEngine.__new__(SGLangGenerationEngine)
    engine.engine, engine.lora = None, LoraSpec()
    with pytest.raises(RuntimeError, match="loads an adapter in one call"):
        engine.update_weights_from_tensor([b"payload"], flush_cache=False)
    with pytest.raises(RuntimeError, match="no adapter from a broadcast"):
        engine.update_weights_from_distributed(
            ["x"], ["float32"], [[1]], group_name="g", flush_cache=True
        )
