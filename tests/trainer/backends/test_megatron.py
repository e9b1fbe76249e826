"""The megatron backend on CPU: conversion, rank layout, parity with HF and the torch backend,
validation of megatron settings.

The parity test runs ``megatron_cases.py`` in a fresh process (2 gloo workers): megatron-core
keeps its parallel state in process globals, which must not leak into pytest's process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppojob_api.checks import check_training_half
from ppojob_api.training import TrainerConfig
from ppojob_api.trainspec.constants import BUILTIN_MEGATRON_SHAPES
from ppojob_trainer import models
from ppojob_trainer.backends.megatron_convert import (
    ModelShape,
    hf_to_megatron,
    megatron_to_hf,
    parallel_problems,
)
from ppojob_trainer.backends.megatron_inputs import left_aligned
from ppojob_trainer.distributed import identity
from ppojob_trainer.driver.topology import dp_leaders

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def _hf_model(family: str, *, kv_heads: int, tied: bool, layers: int = 4):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    cls = LlamaConfig if family == "llama" else Qwen2Config
    config = cls(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


MODELS = [("llama", 4, False), ("qwen2", 2, False), ("qwen2", 2, True), ("llama", 1, False)]


@pytest.mark.parametrize(("family", "kv_heads", "tied"), MODELS)
def test_hf_megatron_hf_round_trip_is_bit_identical(family: str, kv_heads: int, tied: bool) -> None:
    model = _hf_model(family, kv_heads=kv_heads, tied=tied)
    hf = model.state_dict()
    shape = ModelShape.from_hf_config(model.config)
    assert shape.qkv_bias == (family == "qwen2") and shape.tied == tied
    tried = 0
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            if parallel_problems(shape, tp, pp):
                continue
            tried += 1
            shards = [
                [hf_to_megatron(hf, shape, t, tp, p, pp) for t in range(tp)] for p in range(pp)
            ]
            # Each rank holds 1/tp of the split weights and 1/pp of the layers.
            qkv = shards[0][0]["decoder.layers.0.self_attention.linear_qkv.weight"]
            assert qkv.shape[0] == (4 + 2 * kv_heads) * 8 // tp
            assert sum(k.endswith("linear_fc2.weight") for k in shards[0][0]) == 4 // pp
            back = megatron_to_hf(shards, shape)
            assert set(back) == set(hf), (tp, pp, sorted(set(back) ^ set(hf)))
            for k, v in hf.items():
                assert torch.equal(back[k], v), (tp, pp, k)
    assert tried >= 2  # tied: pipeline 1 only


def test_critic_value_head_round_trip() -> None:
    model = _hf_model("qwen2", kv_heads=2, tied=True)
    shape = ModelShape.from_hf_config(model.config)
    hf = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    head = {"weight": torch.randn(1, 32), "bias": torch.randn(1)}
    shards = [
        [hf_to_megatron(hf, shape, t, 2, p, 1, value_head=head) for t in range(2)] for p in range(1)
    ]
    assert torch.equal(shards[0][1]["output_layer.weight"], head["weight"])  # replicated
    back = megatron_to_hf(shards, shape, value=True)
    assert torch.equal(back["value_head.weight"], head["weight"])
    assert torch.equal(back["value_head.bias"], head["bias"])
    assert all(torch.equal(back[k], v) for k, v in hf.items())


def test_unsupported_architecture_and_layouts_are_named() -> None:
    from transformers import GPT2Config

    with pytest.raises(ValueError, match=r"spec.model.path: architecture .*GPT2LMHeadModel"):
        ModelShape.from_hf_config({**GPT2Config().to_dict(), "architectures": ["GPT2LMHeadModel"]})
    shape = ModelShape.from_hf_config(_hf_model("qwen2", kv_heads=2, tied=True).config)
    problems = " | ".join(w for w, _ in parallel_problems(shape, 4, 3))
    assert "tensor 4 does not divide the model's 2 key/value heads" in problems
    assert "pipeline 3 does not divide the model's 4 layers" in problems
    assert "ties its input embedding" in problems


def test_missing_megatron_core_names_the_field_and_the_extra(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from ppojob_trainer.backends.megatron_parallel import _import

    monkeypatch.setitem(sys.modules, "megatron.core", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"spec.roles.critic.backend: .*ppojob\[megatron\]"):
        _import("critic")


def test_rope_of_hf_and_megatron_agree_with_llama3_scaling() -> None:
    """Llama 3.1/3.2's RoPE scaling maps onto megatron-core's ``rope_scaling``; others refused."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=2,
        max_position_embeddings=16384,
        rope_scaling=rope,
        rope_theta=500000.0,
    )
    shape = ModelShape.from_hf_config(config)
    assert (shape.rope_scaling_factor, shape.rope_theta) == (32.0, 500000.0)
    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = RotaryEmbedding(
        kv_channels=shape.head_dim,
        rotary_percent=1.0,
        rotary_base=int(shape.rope_theta),
        rope_scaling=True,
        rope_scaling_factor=shape.rope_scaling_factor,
        use_cpu_initialization=True,
    ).inv_freq
    torch.testing.assert_close(ours, hf_inv.float(), rtol=1e-6, atol=0)
    assert ModelShape.from_hf_config(LlamaConfig()).rope_scaling_factor is None
    linear = LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match=r"spec\.model\.path: RoPE scaling"):
        ModelShape.from_hf_config(linear)


def test_builtin_shapes_table_matches_the_models() -> None:
    for name, (family, hidden, inter, layers, heads, kv, vocab) in BUILTIN_MEGATRON_SHAPES.items():
        shape = ModelShape.from_hf_config(models.builtin_config(name))
        got = (
            shape.family,
            shape.hidden,
            shape.intermediate,
            shape.layers,
            shape.heads,
            shape.kv_heads,
            shape.vocab,
        )
        assert got == (family, hidden, inter, layers, heads, kv, vocab), name
    assert set(BUILTIN_MEGATRON_SHAPES) == set(models.BUILTIN_MODELS)


def test_identity_follows_megatron_rank_order() -> None:
    # rank = tp + T * (cp + C * (dp + D * pp)), here T=2, C=1, D=2, P=2.
    got = [identity("actor", r, 8, tensor=2, pipeline=2) for r in range(8)]
    assert [(s.tp_rank, s.dp_rank, s.pp_rank) for s in got] == [
        (0, 0, 0),
        (1, 0, 0),
        (0, 1, 0),
        (1, 1, 0),
        (0, 0, 1),
        (1, 0, 1),
        (0, 1, 1),
        (1, 1, 1),
    ]
    assert all(s.dp_size == 2 and s.tp_size == 2 and s.pp_size == 2 for s in got)
    assert [i for i, s in enumerate(got) if s.is_dp_leader] == [0]
    assert dp_leaders([s.__dict__ for s in got]) == [0, 2]
    plain = identity("critic", 3, 4)
    assert (plain.dp_rank, plain.dp_size, plain.tp_size) == (3, 4, 1)


def test_left_aligned_gives_hf_positions() -> None:
    batch = {
        "prompt_ids": torch.tensor([[0, 0, 5, 6], [7, 8, 9, 4]]),
        "prompt_mask": torch.tensor([[False, False, True, True], [True, True, True, True]]),
        "response_ids": torch.tensor([[10, 11, 0], [12, 13, 1]]),
    }
    ids, index = left_aligned(batch)
    assert ids.tolist() == [[5, 6, 10, 11, 0, 0, 0], [7, 8, 9, 4, 12, 13, 1]]
    assert index.tolist() == [[1, 2, 3], [3, 4, 5]]  # the logits that predict each response token
    ids4, _ = left_aligned(batch, pad_to=4)
    assert ids4.shape == (2, 8)


@pytest.mark.slow
def test_megatron_matches_hf_and_the_torch_backend_on_cpu(tmp_path: Path) -> None:
    """TP 2, PP 2 and DP 2 (2 gloo processes) against HF and the torch backend, fp32."""
    dirs = [
        str(models.materialize_builtin(n, 5, tmp_path / "cache"))
        for n in ("tiny-llama", "tiny-qwen2")
    ]
    out = tmp_path / "parity.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / d) for d in ("api", "trainer", "operator")]),
    }
    cmd = [sys.executable, str(HERE / "megatron_cases.py"), str(out), *dirs]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert set(results) == {
        "tiny-llama-seed5/tp2",
        "tiny-llama-seed5/pp2",
        "tiny-llama-seed5/dp2",
        "tiny-qwen2-seed5/tp2",
    }
    for name, r in results.items():
        print(name, {k: v for k, v in r.items() if "update" in k or k == "grad_norm"})
    for name, r in results.items():
        assert r["roundtrip_exact"] is True, name
        assert r["logits_max_abs"] < 1e-5, (name, r)
        assert r["logprobs_max_abs"] < 1e-5 and r["ref_logprobs_max_abs"] < 1e-5, (name, r)
        assert r["values_max_abs"] < 1e-5, (name, r)
        # The update moved the weights (by ~lr) and both backends moved them alike, within what
        # fp32 reordering can do to one Adam step with eps 1e-3 (megatron_cases.py's docstring):
        # 1e-4 of the update's size (~1e-6, about 10 ulps of a weight near 1; measured ~1e-7,
        # like the torch backend's own update under another summation order, *_noise).
        for prefix in ("", "critic_"):
            size = r[f"{prefix}update_changed"]
            bound = 1e-4 * size
            assert size > 1e-3, (name, prefix, r)
            assert r[f"{prefix}update_noise"] <= bound, (name, prefix, r)  # the bound's premise
            assert r[f"{prefix}update_weights_max_abs"] <= bound, (name, prefix, r)
        m_norm, t_norm = r["grad_norm"]
        assert abs(m_norm - t_norm) < 1e-5 * t_norm, (name, r)
        assert r["resume_max_abs"] == 0.0, (name, r)


def test_megatron_logits_are_projected_a_chunk_at_a_time(tmp_path: Path) -> None:
    """The actor's vocabulary projection runs 3 positions at a time (several chunks per
    micro-batch) and gives the log-probs, the entropy and one update's gradient (log-probs and
    entropy weighted alike; and again with the entropy as a metric only) of the actor before
    chunking (megatron-core's output layer over every
    position, the entropy of the gathered vocabulary), at tensor 2, tensor 1 (data 2), pipeline 2
    and tensor 2 of a model whose output layer is its input embedding (2 gloo processes,
    ``megatron_chunk_cases.py``).

    Bounds: 32 fp32 epsilons (2**-23) of the compared tensor's largest magnitude. Chunking only
    regroups sums (a gradient entry's sum over a micro-batch's <= 18 positions, in chunks of 3;
    a matmul's blocking over fewer rows; the entropy's sums per rank, then over ranks), and a
    regrouped sum of k terms moves by at most ~k rounding errors of its terms; measured: <= 3e-7
    (about 2 epsilons); a lost term or a wrong entropy gradient is off by orders more.

    Memory: the largest logits tensor ever built is [3, V/tp] (before chunking: [L * b, V/tp],
    which the same record sees), backward recomputes each chunk of a micro-batch with more than
    one (no chunk's logits outlive its forward), and the vocabulary is never gathered."""
    tiny = models.materialize_builtin("tiny-llama", 5, tmp_path / "cache")
    tied = tmp_path / "tied-qwen2"
    _hf_model("qwen2", kv_heads=2, tied=True).save_pretrained(tied)
    out = tmp_path / "chunks.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / d) for d in ("api", "trainer", "operator")] + [str(ROOT)]
        ),
    }
    cmd = [sys.executable, str(HERE / "megatron_chunk_cases.py"), str(out), str(tiny), str(tied)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert set(results) == {"tp2", "tp1", "pp2", "tp2_tied"}
    vocab = {"tp2": 7, "tp1": 14, "pp2": 14, "tp2_tied": 8}  # V / tp (14 and 16 tokens)
    bound = 32 * 2.0**-23
    for name, r in results.items():
        print(name, r)
        assert r["grad_scale"] > 1e-2, (name, r)  # the gradient is not ~0
        assert r["grad_rel"] <= bound and r["grad_nograd_rel"] <= bound, (name, r)
        assert r["entropy_grad_share"] > 1e-2, (name, r)  # the entropy's gradient counts
        for key in ("logp_rel", "ent_rel", "ent_nograd_rel"):
            assert r[key] <= bound, (name, key, r)
        assert r["chunked_vocab_cols"] == r["megatron_vocab_cols"] == vocab[name], (name, r)
        assert r["chunked_max_rows"] == 3 < r["megatron_max_rows"], (name, r)
        assert r["chunked_logp_calls"] > r["micro_batches"], (name, r)  # several chunks ran
        # backward recomputed every chunk of each micro-batch of more than one chunk
        recomputed = r["chunked_update_calls"] - r["chunked_logp_calls"]
        assert recomputed >= r["chunked_logp_calls"] - r["micro_batches"], (name, r)
        assert r["gathers"] == 0, (name, r)


# ---------------------------------------------------------------------------------------------
# Validation of megatron settings
# ---------------------------------------------------------------------------------------------
def _tiny(actor: dict, critic: dict | None = None, **model: str) -> TrainerConfig:
    doc = {
        "model": {"path": "builtin:tiny-llama", **model},
        "roles": {"actor": actor},
        "data": {"rolloutBatchSize": 4, "samplesPerPrompt": 2},
    }
    if critic is not None:
        doc["roles"]["critic"] = critic
    return TrainerConfig.model_validate(doc)


def _paths(cfg: TrainerConfig) -> dict[str, str]:
    return {p.path: f"{p.message} (fix: {p.fix})" for p in check_training_half(cfg)}


MEG = {"replicas": 2, "backend": "megatron", "parallelism": {"tensor": 2}}
COLOCATED = {"colocateWithActor": True, "backend": "megatron", "parallelism": {"tensor": 2}}


def test_the_pad_row_gets_the_output_layers_gradient_but_not_the_lookups(tmp_path: Path) -> None:
    """HF's ``nn.Embedding(padding_idx=pad)`` keeps only the lookup's gradient off the pad row:
    a tied model's ``lm_head`` (the same weight) still sends it its projection's gradient. The
    megatron actor's embedding and output-layer gradients of one backward equal the HF model's,
    pad row included, tied and untied (``megatron_pad_row_case.py``, one process). Before, a
    hook on the embedding's weight zeroed the pad row of the summed gradient: a tied model's
    pad row (the EOS row where pad is EOS, as in Qwen2.5's base models) never trained.
    Bound: 1e-5 of the gradient's largest entry (fp32, another summation order; measured ~1e-7);
    the pad row's lm_head gradient is of the order of every other row's."""
    out = tmp_path / "pad.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / d) for d in ("api", "trainer", "operator")] + [str(ROOT)]
        ),
    }
    cmd = [sys.executable, str(HERE / "megatron_pad_row_case.py"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    print(results)
    tied, untied = results["tied=True"], results["tied=False"]
    assert tied["pad_row_hf"] > 0.1  # the premise: lm_head's gradient reaches the pad row
    assert abs(tied["pad_row_megatron"] - tied["pad_row_hf"]) <= 1e-5 * tied["pad_row_hf"]
    assert untied["pad_row_hf"] == 0.0 and untied["pad_row_megatron"] == 0.0
    for r in (tied, untied):
        assert r["grad_rel"] < 1e-5, results


def test_megatron_tensor_parallel_on_cpu_is_valid() -> None:
    assert _paths(_tiny(MEG, COLOCATED)) == {}


@pytest.mark.parametrize(
    ("actor", "critic", "model", "path", "words"),
    [
        (
            {**MEG, "parallelism": {"context": 2}},
            None,
            {},
            "spec.roles.actor.parallelism.context",
            "context parallelism (2) is not implemented by the megatron backend",
        ),
        (MEG, None, {"dtype": "bfloat16"}, "spec.model.dtype", "set model.dtype: float32"),
        (
            {**MEG, "replicas": 3, "parallelism": {"tensor": 3}},
            None,
            {},
            "spec.roles.actor.parallelism.tensor",
            "tensor 3 does not divide the 4 attention heads",
        ),
        (
            {**MEG, "parallelism": {"pipeline": 2}, "replicas": 4},
            None,
            {"path": "builtin:small-llama"},
            "spec.roles.actor.parallelism.pipeline",
            "pipeline 2 does not divide the 5 layers",
        ),
        (
            MEG,
            {**COLOCATED, "parallelism": {"tensor": 1}},
            {},
            "spec.roles.critic.parallelism",
            "give the critic the actor's parallelism",
        ),
        (
            {**MEG, "parallelism": {"tensor": 2, "sequenceParallel": True}},
            None,
            {},
            "spec.roles.actor.parallelism.sequenceParallel",
            "use GPUs with tensor > 1",
        ),
        (
            {"parallelism": {"sequenceParallel": True}},
            None,
            {},
            "spec.roles.actor.parallelism.sequenceParallel",
            "torch backend has no sequence",
        ),
    ],
)
def test_megatron_settings_that_cannot_run_are_named(actor, critic, model, path, words) -> None:  # type: ignore[no-untyped-def]
    problems = _paths(_tiny(actor, critic, **model))
    assert path in problems, problems
    assert words in problems[path]


def test_top_p_below_one_is_refused_for_a_megatron_actor() -> None:
    """pi_old must be the sampling policy: the megatron actor's log-probs are not truncated to
    the top-p nucleus, so a megatron actor with topP < 1 is refused (the torch actor accepts it)."""
    doc = {
        "model": {"path": "builtin:tiny-llama"},
        "roles": {"actor": MEG},
        "data": {"rolloutBatchSize": 4, "samplesPerPrompt": 2, "topP": 0.9},
    }
    problems = _paths(TrainerConfig.model_validate(doc))
    assert "set data.topP: 1.0" in problems.get("spec.data.topP", ""), problems
    doc["roles"]["actor"] = {"replicas": 2}
    assert "spec.data.topP" not in _paths(TrainerConfig.model_validate(doc))


# ---------------------------------------------------------------------------------------------
# The loop with actor and critic on megatron (tensor parallel 2, 2 Ray workers)
# ---------------------------------------------------------------------------------------------
class _Quiet:
    def start(self, total, start_step=0):  # type: ignore[no-untyped-def]
        pass

    def report(self, step, metrics):  # type: ignore[no-untyped-def]
        pass

    def finish(self, summary):  # type: ignore[no-untyped-def]
        pass


@pytest.mark.slow
def test_loop_trains_checkpoints_and_resumes_on_megatron_tp2(local_ray, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """Two steps of the tiny example with a megatron TP 2 actor and critic, then a resume for a
    third: each role's checkpoint is megatron-core's dist_checkpointing (one file per worker,
    no gathered state.pt), and the resumed run continues from it."""
    import yaml

    from ppojob_trainer.checkpoint import latest_checkpoint, load_checkpoint
    from ppojob_trainer.driver.run import train
    from ppojob_trainer.manifest import config_from_doc

    monkeypatch.setenv("PPOJOB_CACHE_DIR", str(tmp_path / "cache"))
    doc = yaml.safe_load((ROOT / "examples" / "ppojob-tiny.yaml").read_text())
    doc["spec"]["roles"]["actor"] = {**MEG, "resources": {"cpus": 1, "memory": "2Gi"}}
    doc["spec"]["roles"]["critic"] = COLOCATED
    doc["spec"]["training"]["steps"] = 3
    cfg = config_from_doc(doc)
    model_dir = models.materialize_builtin("tiny-llama", 1, tmp_path / "cache")
    first = train(cfg, tmp_path / "run", _Quiet(), max_steps=2)
    assert first.steps == 2 and "critic/vf_loss" in first.history[-1]
    assert all(m["reward/mean"] >= 0 and m["actor/grad_norm"] > 0 for m in first.history)
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    state = load_checkpoint(ckpt)  # the driver's small state; each role's under <role>/
    assert "actor" not in state
    for role in ("actor", "critic"):  # dist_checkpointing: one file per worker, no state.pt
        files = {f.name for f in (ckpt / role).iterdir()}
        assert {"metadata.json", "common.pt", ".metadata"} <= files, files
        assert "state.pt" not in files and any(f.endswith(".distcp") for f in files), files
        common = torch.load(ckpt / role / "common.pt", weights_only=False)
        assert common["updates"] == 4  # 128 samples in mini-batches of 64, 2 steps
    assert model_dir.is_dir()
    second = train(cfg, tmp_path / "run", _Quiet())
    assert second.steps == 3 and len(second.history) == 1


@pytest.mark.slow
def test_multi_turn_on_megatron_trains_as_on_the_torch_backend(local_ray, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """Two steps of the multi-turn calculator example (the calculator's tokens in the response
    with no loss) with actor and critic on megatron train exactly as on the torch backend: the
    workers' loss mask reaches megatron's loss and its normalisation."""
    import yaml

    from ppojob_trainer.driver.run import train
    from ppojob_trainer.manifest import config_from_doc

    monkeypatch.setenv("PPOJOB_CACHE_DIR", str(tmp_path / "cache"))
    doc = yaml.safe_load((ROOT / "examples" / "ppojob-tiny-calculator.yaml").read_text())
    doc["spec"]["algorithm"]["advantageEstimator"] = "gae"
    doc["spec"]["training"]["steps"] = 2
    doc["spec"]["training"]["microBatchSize"] = 16  # micro-batches weighted by loss tokens
    runs = {}
    for backend in ("torch", "megatron"):
        spec = yaml.safe_load(yaml.safe_dump(doc))["spec"]
        spec["roles"]["actor"] = {"backend": backend, "resources": {"cpus": 1, "memory": "2Gi"}}
        spec["roles"]["critic"] = {"backend": backend, "colocateWithActor": True}
        cfg = config_from_doc({**doc, "spec": spec})
        runs[backend] = train(cfg, tmp_path / backend, _Quiet()).history
    keys = (
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/kl_loss",
        "critic/vf_loss",
        "critic/grad_norm",
    )
    for torch_step, meg_step in zip(runs["torch"], runs["megatron"], strict=True):
        assert torch_step["agent/env/calls_mean"] > 0  # calculator calls: environment tokens
        for k in keys:
            assert meg_step[k] == pytest.approx(torch_step[k], rel=1e-4, abs=1e-6), k
