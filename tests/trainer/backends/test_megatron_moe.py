"""Mixture-of-experts models on the megatron backend (CPU): the HF <-> megatron conversion of
Qwen3-MoE and Mixtral experts under tensor and expert parallelism, what it refuses, the expert
ranks, and parity with HF and the torch backend with experts split over 2 processes
(``megatron_cases.py --moe``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppojob_trainer import models
from ppojob_trainer.backends.megatron_convert import (
    STACKED_FC1,
    STACKED_FC2,
    ModelShape,
    hf_to_megatron,
    megatron_to_hf,
    parallel_problems,
    stack_experts,
    unstack_experts,
)
from ppojob_trainer.distributed import identity

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def _moe_model(family: str, **extra: object):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        pad_token_id=0,
    )
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common, num_experts=4, moe_intermediate_size=12, head_dim=8, **extra
        )
    else:
        config = MixtralConfig(**common, num_local_experts=4, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_round_trip_under_tensor_and_expert_parallelism_is_bit_identical(family: str) -> None:
    model = _moe_model(family)
    hf = model.state_dict()
    shape = ModelShape.from_hf_config(model.config)
    assert (shape.experts, shape.experts_per_token, shape.qk_norm) == (
        4,
        2,
        family == "qwen3_moe",
    )
    inter = 12 if family == "qwen3_moe" else 24
    assert shape.intermediate == inter  # each expert's
    for tp, ep in ((1, 1), (2, 1), (1, 2), (2, 2), (1, 4)):
        assert not parallel_problems(shape, tp, 1, ep)
        per_ep = [
            [hf_to_megatron(hf, shape, t, tp, ep_rank=e, ep_size=ep) for t in range(tp)]
            for e in range(ep)
        ]
        local = per_ep[-1][-1]
        # the last expert rank holds the last 4 / ep experts, 1 / tp of each
        fc1 = local["decoder.layers.1." + STACKED_FC1]
        assert fc1.shape == (4 // ep, 2 * inter // tp, 32), (tp, ep)
        gate_up = hf["model.layers.1.mlp.experts.gate_up_proj"][-(4 // ep) :]
        gate, up = gate_up.chunk(2, 1)
        assert torch.equal(fc1[:, : inter // tp], gate[:, -(inter // tp) :])
        assert torch.equal(fc1[:, inter // tp :], up[:, -(inter // tp) :])
        assert local["decoder.layers.0.mlp.router.weight"].shape == (4, 32)  # replicated
        # the expert ranks' stacks concatenate into every expert's
        merged = [
            {
                **per_ep[0][t],
                **{
                    k: torch.cat([per_ep[e][t][k] for e in range(ep)], 0)
                    for k in per_ep[0][t]
                    if k.endswith((STACKED_FC1, STACKED_FC2))
                },
            }
            for t in range(tp)
        ]
        back = megatron_to_hf([merged], shape)
        assert set(back) == set(hf), sorted(set(back) ^ set(hf))
        for k, v in hf.items():
            assert torch.equal(back[k], v), (tp, ep, k)


def test_stacked_experts_are_megatrons_local_experts() -> None:
    shape = ModelShape.from_hf_config(_moe_model("mixtral").config)
    local = hf_to_megatron(_moe_model("mixtral").state_dict(), shape, ep_rank=1, ep_size=2)
    own = unstack_experts(local)
    assert "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight" in own
    assert not any(k.endswith(STACKED_FC1) for k in own)
    assert sum(".local_experts." in k for k in own) == 2 * 2 * 2  # layers x local experts x fc
    again = stack_experts(own)
    assert set(again) == set(local) and all(torch.equal(again[k], local[k]) for k in local)
    with pytest.raises(ValueError, match=r"experts \[0, 2\]"):
        stack_experts(
            {
                f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc1.weight": torch.zeros(1)
                for j in (0, 2)
            }
        )


@pytest.mark.parametrize(
    ("family", "extra", "words"),
    [
        ("qwen3_moe", {"mlp_only_layers": [1]}, "dense layers"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, "dense layers"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise 0.1"),
        ("mixtral", {"sliding_window": 16}, "sliding_window 16"),
    ],
)
def test_moe_configs_megatron_would_compute_differently_are_named(family, extra, words) -> None:  # type: ignore[no-untyped-def]
    config = _moe_model(family).config.to_dict()
    with pytest.raises(ValueError, match=rf"spec.model.path: .*{words}.*backend torch"):
        ModelShape.from_hf_config({**config, **extra})


def test_expert_layouts_that_cannot_split_the_model_are_named() -> None:
    shape = ModelShape.from_hf_config(_moe_model("qwen3_moe").config)
    assert parallel_problems(shape, 1, 1, 3) == [
        ("expert 3 does not divide the model's 4 experts", "use an expert size that divides 4")
    ]
    dense = ModelShape.from_hf_config(models.builtin_config("tiny-llama"))
    what = " ".join(w for w, _ in parallel_problems(dense, 1, 1, 2))
    assert "needs a mixture-of-experts model" in what


def test_expert_ranks_follow_megatrons_expert_order() -> None:
    # tensor 2 over 8 workers: data parallel 4; experts over 2 of them: ep = dp % 2
    got = [identity("actor", r, 8, tensor=2, expert=2) for r in range(8)]
    assert [(s.tp_rank, s.dp_rank, s.ep_rank) for s in got] == [
        (0, 0, 0),
        (1, 0, 0),
        (0, 1, 1),
        (1, 1, 1),
        (0, 2, 0),
        (1, 2, 0),
        (0, 3, 1),
        (1, 3, 1),
    ]
    with pytest.raises(ValueError, match="expert parallelism 3 does not divide the 4 data"):
        identity("actor", 0, 4, expert=3)


def test_tensor_parallel_moe_without_sequence_parallelism_is_refused(tmp_path: Path) -> None:
    from ppojob_api.training import TrainingSettings
    from ppojob_trainer.backends.megatron_sharded import _Sharded

    path = models.materialize_builtin("tiny-mixtral", 5, tmp_path / "cache")
    shard = identity("actor", 0, 2, tensor=2)
    with pytest.raises(ValueError, match=r"parallelism.sequenceParallel: .*tensor parallelism"):
        _Sharded(
            path,
            "float32",
            shard,
            TrainingSettings(),
            total_updates=1,
            value=False,
            device="cpu",
            seed=0,
        )


@pytest.mark.slow
def test_moe_on_megatron_matches_hf_and_the_torch_backend_with_experts_split(
    tmp_path: Path,
) -> None:
    """Experts over 2 gloo processes (expert 2, data 2) for both MoE families (and under a
    token budget that gives the two ranks different numbers of micro-batches), and pipeline 2:
    logits, log-probs, values, one actor and one critic update, the round trip through the
    expert-parallel gather and a checkpoint state round trip, against HF and the torch backend
    (which sees the whole batch in one process). The expert-2 and pipeline-2 updates add a
    router load-balancing loss (coefficient ``megatron_cases.AUX``): the same update, and the
    same reported loss, in both backends."""
    dirs = [
        str(models.materialize_builtin(n, 5, tmp_path / "cache"))
        for n in ("tiny-mixtral", "tiny-qwen3-moe")
    ]
    out = tmp_path / "parity.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / d) for d in ("api", "trainer", "operator")]),
    }
    cmd = [sys.executable, str(HERE / "megatron_cases.py"), "--moe", str(out), *dirs]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert set(results) == {
        "tiny-mixtral-seed5/ep2",
        "tiny-qwen3-moe-seed5/ep2",
        "tiny-mixtral-seed5/pp2",
        "tiny-mixtral-seed5/ep2-budget",
    }
    # under the token budget one rank ran filler micro-batches to match the other's count
    assert results["tiny-mixtral-seed5/ep2-budget"]["fillers"] > 0
    assert all(r["fillers"] == 0 for n, r in results.items() if n.endswith(("ep2", "pp2")))
    for name, r in results.items():
        assert r["roundtrip_exact"] is True, name
        assert r["logits_max_abs"] < 1e-5, (name, r)
        assert r["logprobs_max_abs"] < 1e-5 and r["ref_logprobs_max_abs"] < 1e-5, (name, r)
        assert r["values_max_abs"] < 1e-5, (name, r)
        for prefix in ("", "critic_"):  # the bounds of test_megatron.py's parity test
            size = r[f"{prefix}update_changed"]
            assert size > 1e-3, (name, prefix, r)
            assert r[f"{prefix}update_noise"] <= 1e-4 * size, (name, prefix, r)
            assert r[f"{prefix}update_weights_max_abs"] <= 1e-4 * size, (name, prefix, r)
        m_norm, t_norm = r["grad_norm"]
        assert abs(m_norm - t_norm) < 1e-5 * t_norm, (name, r)
        assert r["resume_max_abs"] == 0.0, (name, r)
    m_balance, t_balance = results["tiny-mixtral-seed5/pp2"]["router_balance"]
    assert m_balance > 1.0 and abs(m_balance - t_balance) < 1e-6 * t_balance
    # expert 2: each rank holds half of the experts. tiny-mixtral: vocabulary 14, hidden 64,
    # 2 layers of 8 experts (intermediate 64), 4 heads of 16 with as many key/value heads
    hidden, vocab, layers = 64, 14, 2
    experts = layers * 8 * 3 * hidden * hidden
    per_layer = 4 * hidden * hidden + 2 * hidden + 8 * hidden  # q k v o, two norms, router
    whole = 2 * vocab * hidden + hidden + layers * per_layer + experts
    assert results["tiny-mixtral-seed5/ep2"]["local_params"] == whole - experts // 2


@pytest.mark.slow
@pytest.mark.parametrize(("name", "packing"), [("tiny-qwen3-moe", False), ("tiny-mixtral", True)])
def test_megatron_replays_the_engines_routing_and_lowers_the_mismatch(
    tmp_path: Path, name: str, packing: bool
) -> None:
    """A bfloat16 engine's samples and recorded experts; the float32 megatron actor's old
    log-probs with its experts over 2 processes, without and with replay
    (``megatron_routing_case.py``): with replay every token-layer uses the engine's experts,
    though its routers would choose otherwise for some, and the log-prob mismatch falls."""
    path = models.materialize_builtin(name, 1, tmp_path / "cache")
    out = tmp_path / "routing.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / d) for d in ("api", "trainer", "operator", "tests/trainer")]
        ),
    }
    cmd = [sys.executable, str(HERE / "megatron_routing_case.py"), str(out), str(path)]
    cmd += ["--packing"] if packing else []
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    print(name, r)
    same, total = r["used_agreement"]
    assert total > 500 and same == total
    assert 0.9 < r["own_agreement"] < 1.0
    (off_mean, off_max), (on_mean, on_max) = r["none"], r["rollout"]
    assert on_mean < off_mean and on_max < off_max
