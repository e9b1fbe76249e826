"""The megatron backend reads a Hugging Face checkpoint per rank as slices (issue 40, finding 5).

Each rank's tensors come from ``safe_open(...).get_slice(name)[...]`` of only the rows or
columns it holds (``_SliceShard``), equal bit for bit to cutting the whole state dict
(``hf_to_megatron``), for every layout and model family, a sharded checkpoint, a bf16 one, a
backbone saved alone and a critic's value head. The slow test measures it: peak resident memory
per rank at tensor parallel 2 is the rank's shard plus a fixed overhead, not the whole model
(bench/megatron_load_memory.py; before, every rank loaded the whole model with transformers).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ppojob_trainer import models
from ppojob_trainer.backends.megatron_convert import ModelShape, hf_to_megatron, parallel_problems
from ppojob_trainer.distributed import identity

MiB = 2**20
MODELS = [("llama", 4, False), ("qwen2", 2, False), ("qwen2", 2, True), ("llama", 1, False)]


def _hf_model(family: str, *, kv_heads: int, tied: bool):  # type: ignore[no-untyped-def]
    """A random 4-layer HF causal LM (4 heads of 8, vocabulary 16)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    cls = LlamaConfig if family == "llama" else Qwen2Config
    config = cls(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _saved(model, directory: Path, **kwargs) -> Path:  # type: ignore[no-untyped-def]
    models.save_pretrained_here(model, directory, **kwargs)
    return directory


def _shard(tp: int, pp: int, tp_rank: int, pp_rank: int, role: str = "actor"):  # type: ignore[no-untyped-def]
    return identity(role, tp_rank + tp * pp_rank, tp * pp, tp, pp, 1)


def _assert_slices_equal_the_cut(directory: Path, hf: dict, shape: ModelShape, **kw) -> int:  # type: ignore[no-untyped-def]
    from ppojob_trainer.backends.megatron_sharded import _SliceShard

    slices = models.CheckpointSlices.open(directory)
    assert slices is not None
    tried = 0
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            if parallel_problems(shape, tp, pp):
                continue
            tried += 1
            for p in range(pp):
                for t in range(tp):
                    want = hf_to_megatron(hf, shape, t, tp, p, pp, **kw)
                    head = kw.get("value_head")
                    got = _SliceShard(
                        slices, shape, _shard(tp, pp, t, p), torch.float32, value_head=head
                    )
                    assert got.missing == []
                    assert set(got) == set(want), (tp, pp, sorted(set(got) ^ set(want)))
                    for k, v in want.items():
                        g = got[k]
                        assert g.dtype == torch.float32 and torch.equal(g, v), (tp, pp, t, p, k)
    return tried


@pytest.mark.parametrize(("family", "kv_heads", "tied"), MODELS)
def test_each_rank_reads_its_slices_equal_to_cutting_the_whole_model(
    family: str, kv_heads: int, tied: bool, tmp_path: Path
) -> None:
    model = _hf_model(family, kv_heads=kv_heads, tied=tied)
    hf = model.state_dict()
    shape = ModelShape.from_hf_config(model.config)
    d = _saved(model, tmp_path / "m")
    assert (d / "model.safetensors").is_file()
    assert _assert_slices_equal_the_cut(d, hf, shape) >= 2


def test_a_sharded_bf16_checkpoint_is_read_across_its_files_and_cast(tmp_path: Path) -> None:
    model = _hf_model("qwen2", kv_heads=2, tied=False).to(torch.bfloat16)
    d = _saved(model, tmp_path / "m", max_shard_size="20KB")
    assert (d / "model.safetensors.index.json").is_file()
    slices = models.CheckpointSlices.open(d)
    assert slices is not None and len(set(slices.files.values())) > 1
    hf = {k: v.float() for k, v in model.state_dict().items()}  # what from_pretrained casts to
    _assert_slices_equal_the_cut(d, hf, ModelShape.from_hf_config(model.config))


def test_a_critic_reads_its_backbone_saved_alone_and_its_value_head(tmp_path: Path) -> None:
    """An exported critic's directory: the backbone without the ``model.`` prefix (AutoModel)
    and ``value_head.safetensors``; the value head the torch backend would load."""
    causal = _hf_model("llama", kv_heads=2, tied=False)
    shape = ModelShape.from_hf_config(causal.config)  # (saving the backbone renames its class)
    d = _saved(causal.model, tmp_path / "critic")
    assert "layers.0.mlp.up_proj.weight" in models.CheckpointSlices.open(d)  # type: ignore[operator]
    from safetensors.torch import save_file

    saved = {"weight": torch.randn(1, 32), "bias": torch.randn(1)}
    save_file(saved, str(d / models.VALUE_HEAD_FILE))
    head = models.value_head_state(d, 32, "float32", seed=4)
    vm = models.load_value_model(d, "float32", seed=4)
    assert all(torch.equal(head[k], getattr(vm.value_head, k).detach()) for k in saved)
    hf = {k: v for k, v in causal.state_dict().items() if k != "lm_head.weight"}
    _assert_slices_equal_the_cut(d, hf, shape, value_head=head)


def test_a_new_value_head_is_the_torch_backends() -> None:
    vm = models.ValueModel(torch.nn.Identity(), 32, seed=7)
    new = models.initial_value_head(32, 7)
    assert torch.equal(new["weight"], vm.value_head.weight.detach())
    assert torch.equal(new["bias"], vm.value_head.bias.detach())


def test_a_checkpoint_without_safetensors_has_no_slices(tmp_path: Path) -> None:
    """(The backend then loads the whole model with transformers, as before.)"""
    model = _hf_model("llama", kv_heads=4, tied=False)
    model.config.save_pretrained(str(tmp_path))
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    assert models.CheckpointSlices.open(tmp_path) is None


@pytest.mark.slow
def test_peak_host_memory_per_rank_is_its_shard_not_the_model(tmp_path: Path) -> None:
    """A 360 MiB fp32 Llama at tensor parallel 2 (2 gloo processes), actor with its reference:
    each rank's peak resident memory added by the build is what its two model copies hold plus
    at most 64 MiB (measured 27 MiB); loading the whole model on every rank added ~470 MiB over
    the shard (the model itself, once more)."""
    from bench.megatron_load_memory import measure, write_random_llama

    model_bytes = write_random_llama(tmp_path / "model", layers=6)
    assert model_bytes > 300 * MiB
    ranks = measure(tmp_path / "model", tp=2, reference=True)
    assert len(ranks) == 2
    for r in ranks:
        assert r["shard"] < 0.55 * 2 * model_bytes  # two copies of half the model (norms whole)
        overhead = r["added"] - r["shard"]
        assert overhead <= 64 * MiB, (
            f"rank {r['rank']}: the load added {r['added'] / MiB:.0f} MiB for a "
            f"{r['shard'] / MiB:.0f} MiB shard (overhead {overhead / MiB:.0f} MiB; the whole "
            f"model is {model_bytes / MiB:.0f} MiB)"
        )


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_a_moe_rank_reads_its_experts_slices_from_the_per_expert_files(
    name: str, tmp_path: Path
) -> None:
    """transformers writes a MoE model's fused experts per expert (``experts.<e>.gate_proj``,
    Mixtral's ``block_sparse_moe.experts.<e>.w1``): each rank reads its experts' rows from
    those, equal bit for bit to cutting the in-memory model (fused ``gate_up_proj``)."""
    from ppojob_trainer.backends.megatron_sharded import _SliceShard

    model = models.build_builtin_model(name, 0)
    hf = model.state_dict()
    shape = ModelShape.from_hf_config(model.config)
    d = _saved(model, tmp_path / "m")
    slices = models.CheckpointSlices.open(d)
    assert slices is not None and not any("gate_up_proj" in n for n in slices.files)
    for tp, pp, ep in ((1, 1, 1), (2, 1, 2), (1, 2, 4), (2, 2, 8)):
        for rank in range(tp * pp * ep):
            shard = identity("actor", rank, tp * pp * ep, tp, pp, 1, ep)
            want = hf_to_megatron(
                hf, shape, shard.tp_rank, tp, shard.pp_rank, pp, ep_rank=shard.ep_rank, ep_size=ep
            )
            got = _SliceShard(slices, shape, shard, torch.float32)
            assert got.missing == [], got.missing[:3]
            assert set(got) == set(want)
            for k, v in want.items():
                assert torch.equal(got[k], v), (tp, pp, ep, rank, k)
