"""The memory plan: parameter counts, the examples' verdicts, and `ppojob validate` warnings.
(The plan against measured CPU peaks is `bench/memory.py --measure`.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ppojob_api import memory_plan as M
from ppojob_trainer.manifest import load_manifest

ROOT = Path(__file__).resolve().parents[2]
SEVEN_B = ROOT / "examples" / "ppojob-7b-megatron-volcano.yaml"


@pytest.mark.parametrize(
    "name", ["tiny-llama", "tiny-qwen2", "small-llama", "tiny-qwen3-moe", "tiny-mixtral"]
)
def test_shapes_count_the_parameters_of_the_real_models(name):
    from ppojob_trainer.models import build_builtin_model, count_parameters

    model = build_builtin_model(name, 0)
    shape = M.shape_from_config(model.config.to_dict())
    assert shape == M.KNOWN_SHAPES[f"builtin:{name}"]
    assert shape.params == count_parameters(model)


def test_the_7b_example_fits_80gb_gpus_and_so_does_a_torch_fsdp_layout():
    _, cfg = load_manifest(SEVEN_B)
    plans = M.plan_job(cfg, M.gpu_gib_of(cfg.roles.actor.node_selector))
    assert [p.name for p in plans] == ["actor", "critic", "rollout"]
    assert M.KNOWN_SHAPES["Qwen/Qwen2.5-7B"].params == pytest.approx(7.62e9, rel=0.01)
    assert all(p.peak < 80e9 for p in plans)
    torch_fsdp = [
        ("roles.actor.backend", "torch"),
        ("roles.actor.parallelism.tensor", 1),
        ("roles.critic.backend", "torch"),
        ("roles.critic.parallelism.tensor", 1),
        ("training.sharding", "fsdp"),
        ("training.gradientCheckpointing", True),
    ]
    _, cfg = load_manifest(SEVEN_B, torch_fsdp)
    actor = M.plan_job(cfg)[0]
    assert actor.persistent["actor optimizer"] == pytest.approx(8 * 7.62e9 / 16, rel=0.01)
    assert actor.peak < 80e9 and not M.plan_problems(cfg)


def test_fsdp_gradient_accumulation_holds_unsharded_float32_gradients():
    """FSDP2 accumulates micro-batch gradients unsharded (``set_requires_gradient_sync(False)``
    until the last micro-batch): ~30 GB for a 7B model, on every GPU, during an update with
    several micro-batches; none with one micro-batch per worker."""
    layout = [
        ("roles.actor.backend", "torch"),
        ("roles.actor.parallelism.tensor", 1),
        ("roles.critic.backend", "torch"),
        ("roles.critic.parallelism.tensor", 1),
        ("training.sharding", "fsdp"),
        ("training.gradientCheckpointing", True),
    ]
    key = "unsharded grads (accumulation)"
    _, cfg = load_manifest(SEVEN_B, layout)  # micro-batches of 4 of 8 rows per worker
    actor = M.plan_job(cfg)[0]
    assert actor.phases["actor update"][f"actor {key}"] == pytest.approx(4 * 7.62e9, rel=0.01)
    _, cfg = load_manifest(SEVEN_B, [*layout, ("training.microBatchSize", 8)])
    assert f"actor {key}" not in M.plan_job(cfg)[0].phases["actor update"]


def test_validate_refuses_a_plan_that_cannot_fit(tmp_path, capsys):
    from ppojob_cli.main import main

    doc = yaml.safe_load(SEVEN_B.read_text())
    actor = doc["spec"]["roles"]["actor"]
    actor.update(backend="torch", parallelism={"tensor": 1})  # a 7B replica per GPU, no sharding
    doc["spec"]["roles"]["critic"].update(backend="torch", parallelism={"tensor": 1})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["validate", str(path)]) == 1  # refused, with the numbers and the fix
    err = capsys.readouterr().err
    assert "spec.roles.actor: the memory plan needs" in err
    assert "training.sharding: fsdp" in err
    assert main(["validate", str(SEVEN_B)]) == 0
    assert "memory plan" not in capsys.readouterr().err


def test_lora_counts_adapter_grads_and_moments_and_no_reference_copy():
    """A LoRA actor: grads and AdamW moments of the adapters only (counted as PEFT counts
    them), no reference copy; a token budget sizes the activations."""
    from ppojob_api.training import LoraSpec
    from ppojob_trainer.backends.torch_backend.lora import apply_lora
    from ppojob_trainer.models import build_builtin_model

    lora = LoraSpec(rank=4, target_modules=["q_proj", "v_proj", "down_proj"])
    peft = apply_lora(build_builtin_model("tiny-llama", 0), lora)
    trainable = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    shape = M.KNOWN_SHAPES["builtin:tiny-llama"]
    assert shape.lora_params(4, lora.target_modules) == trainable

    tiny = ROOT / "examples" / "ppojob-tiny.yaml"
    _, full = load_manifest(tiny)
    _, with_lora = load_manifest(tiny, [("model.lora", lora.model_dump(by_alias=True))])
    p_full, p_lora = M.plan_job(full)[0], M.plan_job(with_lora)[0]
    assert p_lora.persistent["actor grads"] == 4 * trainable
    assert p_lora.persistent["actor optimizer"] == 8 * trainable
    assert "reference" in p_full.persistent and "reference" not in p_lora.persistent

    update = "actor update"
    acts = p_full.phases[update]["actor activations"]  # 64 rows x 12 tokens
    _, budget = load_manifest(tiny, [("training.maxTokensPerMicroBatch", 96)])
    small = M.plan_job(budget)[0].phases[update]["actor activations"]
    assert small == pytest.approx(acts * 96 / (64 * 12))


def _judge_plans(judge: dict, **roles: dict) -> dict[str, M.ProcessPlan]:
    from ppojob_api.training import TrainerConfig

    cfg = TrainerConfig.model_validate(
        {
            "model": {"path": "builtin:tiny-llama", "dtype": "bfloat16"},
            "roles": {"rollout": {"replicas": 2, "resources": {"gpus": 1}}, **roles},
            "data": {
                "rolloutBatchSize": 16,
                "samplesPerPrompt": 8,
                "rewards": [{"judge": {"maxPromptLength": 100, "maxNewTokens": 12, **judge}}],
            },
        }
    )
    return {p.name: p for p in M.plan_job(cfg)}


def test_a_generative_judge_of_its_own_is_counted_on_each_engine_gpu():
    """A judge model (not the policy) loaded on each engine: its weights in model.dtype, and
    while it judges the engine's 8 x 8 samples, a KV cache of 100 + 12 tokens each and the
    sampling logits, in a phase of its own. roles.reward does not move it off the engines."""
    small = M.KNOWN_SHAPES["builtin:small-llama"]
    rollout = _judge_plans({"model": "builtin:small-llama"})["rollout"]
    assert rollout.persistent["judge judge weights"] == 2 * small.params
    rows = 16 // 2 * 8
    kv = rows * (100 + 12) * small.layers * 2 * small.kv_dim * 2
    assert rollout.phases["judge judge judging"] == {
        "judge judge KV cache": kv,
        "judge judge sampling": rows * small.vocab * 4 * 3,
    }
    assert rollout.peak >= sum(rollout.persistent.values()) + kv
    with_workers = _judge_plans({"model": "builtin:small-llama"}, reward={"resources": {"gpus": 1}})
    assert "reward" not in with_workers
    assert with_workers["rollout"].persistent["judge judge weights"] == 2 * small.params


def test_a_policy_judge_adds_only_its_kv_cache_and_an_unknown_one_a_note(tmp_path):
    tiny = M.KNOWN_SHAPES["builtin:tiny-llama"]
    rollout = _judge_plans({"model": "policy"})["rollout"]
    assert not any(k.startswith("judge") for k in rollout.persistent)
    kv = rollout.phases["judge judge judging"]["judge judge KV cache"]
    assert kv == 64 * 112 * tiny.layers * 2 * tiny.kv_dim * 2
    colocated = _judge_plans(
        {"model": "policy"},
        actor={"resources": {"gpus": 1}},
        rollout={"colocateWithActor": True},
    )
    assert "rollout" not in colocated
    assert colocated["actor"].phases["judge judge judging"]["judge judge KV cache"] == 2 * kv
    on_sglang = _judge_plans({"model": "policy"}, rollout={"backend": "sglang", "replicas": 2})
    assert "judge judge judging" not in on_sglang["rollout"].phases  # its memory fraction
    unknown = _judge_plans({"model": str(tmp_path / "nowhere")})["rollout"]
    assert unknown.notes == ["data.rewards[0].judge.model: shape unknown here"]
    assert "judge judge judging" not in unknown.phases


GRPO = ROOT / "examples" / "ppojob-grpo-kueue.yaml"  # sglang colocated with offload, 8 x 80 GB


def _actor(path: Path, sets=()) -> tuple[M.ProcessPlan, float, object]:
    """The actor's plan of a manifest whose schema is valid, whether or not the plan fits (the
    checks, the plan's verdict among them, are not run)."""
    from ppojob_api.setflags import apply_spec_overrides
    from ppojob_api.spec import PPOJob
    from ppojob_trainer.manifest import read_manifest_doc

    doc = apply_spec_overrides(read_manifest_doc(path), list(sets))
    cfg = PPOJob.model_validate(doc, by_alias=True, by_name=False).spec
    gib = M.gpu_gib_of(cfg.roles.actor.node_selector)
    return M.plan_job(cfg, gib)[0], gib, cfg


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_examples_verdict_follows_from_its_printed_numbers(path, capsys):
    """Each example's plan, printed: its verdict (fits or not, per process and for a colocated
    engine's wake) is the sum of the printed parts against the GPU, and `validate` warns
    exactly when one does not fit."""
    _, cfg = load_manifest(path)
    gib = M.gpu_gib_of(cfg.roles.actor.node_selector)
    plans = M.plan_job(cfg, gib)
    with capsys.disabled():
        print(f"\n{path.name} ({gib:.1f} GiB GPUs)\n{M.format_plan(plans, gib)}")
    misfits = 0
    for plan in plans:
        total = sum(v for _, v in plan.rows())
        assert total == pytest.approx(plan.peak)
        misfits += total > gib * M.GiB
        misfits += any(sum(parts.values()) > gib * M.GiB for parts in plan.wake.values())
    assert bool(M.plan_problems(cfg)) == bool(misfits)
    if path == SEVEN_B:  # megatron, engines on their own GPUs: no wake; every process fits
        assert not misfits and all(not p.wake for p in plans)
        assert max(p.peak for p in plans) / M.GiB == pytest.approx(63.33, abs=0.01)


def test_the_wake_follows_the_hosts_order_and_what_the_allocator_keeps():
    """Colocated sglang with offload (the GRPO example): after training the allocator still
    holds the update's blocks; the first empty cache returns all but the kept share; the engine's
    weights wake, then the sync stages one 512 MiB bucket (the embedding is smaller), then the
    cache is emptied and the KV cache wakes, never beside the bucket."""
    plan, gib, cfg = _actor(GRPO)
    ro, shape = cfg.roles.rollout, M.KNOWN_SHAPES["Qwen/Qwen2.5-1.5B"]
    assert list(plan.wake) == [
        "training done",
        "empty cache",
        "resume weights",
        "weight sync",
        "empty cache after sync",
        "resume KV cache",
    ]
    totals = {k: sum(v.values()) for k, v in plan.wake.items()}
    update = sum(plan.phases["actor update"].values())
    assert totals["training done"] - totals["empty cache"] == pytest.approx(
        (1 - M.ALLOCATOR_KEPT) * update
    )
    weights = 2 * shape.params / ro.parallelism.tensor
    assert totals["resume weights"] - totals["empty cache"] == pytest.approx(weights)
    bucket = plan.wake["weight sync"]["weight sync bucket"]
    assert bucket == 512 * 2**20 > 2 * shape.vocab * shape.hidden
    assert totals["empty cache after sync"] == pytest.approx(totals["resume weights"])
    assert "sglang KV cache" not in plan.wake["weight sync"]
    # SGLang's static memory is its fraction of what was free when it started (after the
    # actor's weights and reference were loaded)
    started = plan.persistent["actor weights"] + plan.persistent["reference"] + M.GiB
    kv = plan.wake["resume KV cache"]["sglang KV cache"]
    assert plan.engine_fraction_source == "auto"  # the example leaves it to the plan
    assert kv + weights == pytest.approx(plan.engine_fraction * (gib * M.GiB - started))
    assert max(totals, key=totals.get) == "resume KV cache"
    print({k: round(v / M.GiB, 2) for k, v in totals.items()}, plan.wake_max_fraction)


def test_a_fraction_that_just_fits_wakes_and_one_just_above_is_refused(tmp_path, capsys):
    """The largest fraction whose wake fits, rounded down to a hundredth, fits with no
    problem; a hundredth above it does not, at 'resume KV cache', and `ppojob validate`
    refuses it in one line naming roles.rollout.gpuMemoryFraction and the fraction that fits."""
    from ppojob_cli.main import main

    plan, gib, _ = _actor(GRPO)
    best = plan.wake_max_fraction
    below, above = int(best * 100) / 100, int(best * 100) / 100 + 0.01
    fits, _, cfg = _actor(GRPO, [("roles.rollout.gpuMemoryFraction", below)])
    assert fits.wake_over(gib * M.GiB) is None and not M.plan_problems(cfg)
    over, _, cfg = _actor(GRPO, [("roles.rollout.gpuMemoryFraction", above)])
    step, total, excess = over.wake_over(gib * M.GiB)
    assert step == "resume KV cache" and 0 < excess < 0.01 * gib * M.GiB
    print(
        f"fraction {below}: fits; {above}: {total / M.GiB:.2f} GiB, {excess / 2**20:.0f} MiB over"
    )
    (problem,) = M.plan_problems(cfg)
    assert problem.path == "spec.roles.rollout.gpuMemoryFraction"
    assert problem.message.startswith("waking the colocated sglang engine after a training step")
    assert f"set it to at most {below:.2f}" in problem.fix

    doc = yaml.safe_load(GRPO.read_text())
    doc["spec"]["roles"]["rollout"]["gpuMemoryFraction"] = above
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["validate", str(path)]) == 1
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "waking" in ln]
    assert len(lines) == 1 and "roles.rollout.gpuMemoryFraction" in lines[0]


def test_a_sync_bucket_that_does_not_fit_names_the_bucket_size():
    """A 60 GiB bucket beside the woken weights: the wake stops at 'weight sync', and the
    warning names roles.rollout.weightSyncBucketMb; the same job with 512 MiB buckets fits."""
    plan, gib, cfg = _actor(GRPO, [("roles.rollout.weightSyncBucketMb", 60 * 1024)])
    step, _, _ = plan.wake_over(gib * M.GiB)
    assert step == "weight sync"
    (problem,) = M.plan_problems(cfg)
    assert "'weight sync'" in problem.message
    assert problem.path == "spec.roles.rollout.weightSyncBucketMb"
    assert not M.plan_problems(_actor(GRPO)[2])


def test_training_that_leaves_no_room_to_wake_names_the_actors_layout():
    """A 7B actor replicated on every GPU (no sharding) beside a colocated engine: its states
    alone exceed the GPU, so the wake fails at its first step after training and the one
    problem points at the actor's layout, not the engine's fraction."""
    plan, gib, cfg = _actor(GRPO, [("model.path", "Qwen/Qwen2.5-7B-Instruct")])
    step, total, _ = plan.wake_over(gib * M.GiB)
    assert step == "training done" and total > gib * M.GiB
    (problem,) = M.plan_problems(cfg)
    assert problem.path == "spec.roles.actor" and "training.sharding: fsdp" in problem.fix


def test_a_megatron_sync_counts_a_split_tensors_pieces_beside_its_joined_copy():
    """A megatron actor at tensor 2 joins each split tensor from its tensor-parallel pieces
    on the GPU: while the embedding is made, its pieces and the joined copy both exist, so the
    colocated wake's sync step holds one embedding more than the torch actor's; tensor 1 joins
    nothing."""
    meg = [("roles.actor.backend", "megatron"), ("roles.actor.parallelism.tensor", 2)]
    torch_plan = _actor(GRPO)[0]
    tp2 = _actor(GRPO, meg)[0]
    tp1 = _actor(GRPO, meg[:1])[0]
    shape = M.KNOWN_SHAPES["Qwen/Qwen2.5-1.5B"]
    pieces = "megatron: a tensor's pieces while it is joined"
    assert tp2.wake["weight sync"][pieces] == 2 * shape.vocab * shape.hidden
    assert pieces not in torch_plan.wake["weight sync"] and pieces not in tp1.wake["weight sync"]
    sync = {k: sum(v.values()) for k, v in tp2.wake.items()}
    assert sync["weight sync"] - sync["resume weights"] == pytest.approx(
        tp2.wake["weight sync"]["weight sync bucket"] + 2 * shape.vocab * shape.hidden
    )


def test_a_released_lora_engine_keeps_its_lora_buffers_and_a_host_copy_of_its_weights():
    """A colocated sglang LoRA engine with offload: SGLang allocates its LoRA pool outside its
    memory saver's regions, so the pool stays through training (in every step of the wake, and
    out of the KV cache SGLang sized after it); its base weights wait on the host (a note gives
    the host memory), since an adapter sync sends none."""
    lora = {"rank": 16, "targetModules": ["q_proj", "v_proj"]}
    plan, gib, cfg = _actor(GRPO, [("model.lora", lora)])
    plain, _, _ = _actor(GRPO)
    ro, shape = cfg.roles.rollout, M.KNOWN_SHAPES["Qwen/Qwen2.5-1.5B"]
    pool = shape.sglang_lora_pool(16, ["q_proj", "v_proj"], 2, ro.parallelism.tensor)
    assert pool > 0
    assert plan.persistent[M.SGLANG_LORA_KEPT] == pool
    assert all(step[M.SGLANG_LORA_KEPT] == pool for step in plan.wake.values())
    weights = 2 * shape.params / ro.parallelism.tensor
    started = plan.persistent["actor weights"] + M.GiB  # LoRA: no reference copy
    kv = plan.wake["resume KV cache"]["sglang KV cache"]
    assert kv + weights + pool == pytest.approx(plan.engine_fraction * (gib * M.GiB - started))
    (note,) = [n for n in plan.notes if "host copy" in n]
    assert f"{weights / M.GiB:.1f} GiB of host memory per GPU" in note
    assert not [n for n in plain.notes if "host copy" in n]
