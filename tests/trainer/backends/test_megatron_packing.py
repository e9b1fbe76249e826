"""Packing and token-budget micro-batches in the megatron backend: the inputs of a packed row
(mask, rotary positions, Transformer Engine's ``cu_seqlens``) and, on CPU with 2 gloo
processes (``megatron_packing_cases.py``), the same log-probs, values, losses and gradients as
padded micro-batches, and a token budget on skewed lengths that leaves the gradient unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppojob_trainer import models
from ppojob_trainer.backends.megatron_inputs import (
    block_causal_mask,
    packed_lengths,
    packed_seq_params,
    rope_positions,
)
from ppojob_trainer.backends.torch_backend.packing import pack_rows
from tests.helpers.batches import PROMPT_LENS, RESPONSE_LENS, mixed_batch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
LENGTHS = [p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS, strict=True)]  # 10, 1, 7, 11, 5


def test_packed_row_lengths_mask_and_cu_seqlens():
    _, pos, *_ = pack_rows(mixed_batch())
    assert packed_lengths(pos) == LENGTHS
    mask = block_causal_mask([3, 2], torch.device("cpu"))[0, 0]
    # True = masked out (megatron's convention): causal within each sequence, nothing across
    allowed = [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    assert (~mask).long().tolist() == allowed
    params = packed_seq_params(LENGTHS, torch.device("cpu"))
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 10, 11, 18, 29, 34]
    assert params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_kv.tolist() == params.cu_seqlens_q.tolist()
    assert (params.max_seqlen_q, params.max_seqlen_kv) == (11, 11)


def test_rotary_positions_restart_per_packed_sequence(monkeypatch):
    """megatron-core's GPTModel asks its rotary embedding for positions 0..N-1 of the row;
    under ``rope_positions`` each packed sequence gets 0..len-1, as when it is alone."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    # the CPU backend's shim (megatron_parallel._install_cpu_shims): RoPE's device is the CPU
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))

    rope = RotaryEmbedding(
        kv_channels=8, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True
    )
    holder = torch.nn.Sequential(rope)
    pos = torch.cat([torch.arange(n) for n in (3, 5, 2)])[None]
    alone = {n: rope(n) for n in (3, 5, 2)}
    with rope_positions(holder, pos):
        packed = rope(10)
    assert packed.shape == (10, 1, 1, 8)
    torch.testing.assert_close(packed, torch.cat([alone[3], alone[5], alone[2]]), rtol=0, atol=0)
    assert torch.equal(rope(10)[:3], alone[3]) and not torch.equal(rope(10)[3:8], alone[5])


@pytest.mark.slow
def test_packed_and_token_budget_micro_batches_match_padded_on_megatron(tmp_path: Path) -> None:
    """Tensor 2 and pipeline 2 (2 gloo processes), fp32, the local attention's block-diagonal
    mask: packed and padded micro-batches give the same log-probs (policy and reference),
    values, losses and gradients (actor with an entropy bonus, critic); micro-batches sized by a
    40-token budget on skewed lengths (3 padded, 2 packed) accumulate the gradient of one
    micro-batch holding the whole mini-batch, and the same log-probs in the batch's row order.
    Measured differences ~3e-7 (fp32 summation
    order); a sequence attending across a boundary or a loss weighed by rows instead of tokens
    is off by ~1e-2 or more."""
    model_dir = models.materialize_builtin("tiny-llama", 5, tmp_path / "cache")
    out = tmp_path / "packing.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / d) for d in ("api", "trainer", "operator")] + [str(ROOT)]
        ),
    }
    cmd = [sys.executable, str(HERE / "megatron_packing_cases.py"), str(out), str(model_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert set(results) == {"tp2", "pp2"}
    for name, r in results.items():
        print(name, r)
        for key in ("logp", "ref", "values"):
            assert r[f"{key}_max_abs"] < 1e-5, (name, key, r)
        assert r["loss_abs"] < 1e-6 and r["vf_loss_abs"] < 1e-6, (name, r)
        assert r["grad_scale"] > 1e-2, (name, r)  # the gradient is not ~0
        assert r["grad_rel"] < 1e-5 and r["vf_grad_rel"] < 1e-5, (name, r)
        micro_batches = [r[f"budget_{k}_micro_batches"] for k in ("whole", "padded", "packed")]
        assert micro_batches == [1, 3, 2], (name, r)
        assert r["budget_padded_grad_rel"] < 1e-5, (name, r)
        assert r["budget_packed_grad_rel"] < 1e-5, (name, r)
        assert r["budget_padded_logp_max_abs"] < 1e-5, (name, r)
        assert r["budget_packed_logp_max_abs"] < 1e-5, (name, r)
