"""Masked statistics against float64 loop references, and distributed whitening over gloo."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from ppojob_trainer.algorithms import (
    masked_mean,
    masked_var,
    masked_whiten,
)

SETTINGS = settings(max_examples=40, deadline=None)


def ref_stats(x, mask):
    vals = [x[b][t] for b in range(len(x)) for t in range(len(x[0])) if mask[b][t]]
    n = len(vals)
    mean = sum(vals) / n
    ss = sum((v - mean) ** 2 for v in vals)
    return mean, ss / (n - 1) if n > 1 else None, ss / n


def batch(seed, B, T):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, generator=g, dtype=torch.float64) * 3 + 1
    mask = torch.rand(B, T, generator=g) < 0.5
    mask[0, 0] = True
    x[~mask] = float("nan")  # never reaches a result
    return x, mask


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 6), T=st.integers(1, 20))
def test_masked_mean_var_whiten_match_reference(seed, B, T):
    x, mask = batch(seed, B, T)
    mean, var_u, var_b = ref_stats(x.tolist(), mask.tolist())
    assert math.isclose(float(masked_mean(x, mask)), mean, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(
        float(masked_var(x, mask, unbiased=False)), var_b, rel_tol=1e-9, abs_tol=1e-12
    )
    if var_u is not None:
        assert math.isclose(float(masked_var(x, mask.float())), var_u, rel_tol=1e-9)
    w = masked_whiten(x, mask)
    for b in range(B):
        for t in range(T):
            exp = (float(x[b, t]) - mean) / math.sqrt(var_b + 1e-8) if mask[b, t] else 0.0
            assert math.isclose(float(w[b, t]), exp, rel_tol=1e-7, abs_tol=1e-9)
    w_keep = masked_whiten(x, mask, shift_mean=False)
    torch.testing.assert_close(w_keep[mask], w[mask] + mean)
    assert bool((w_keep[~mask] == 0).all())
    # float32 input stays float32 and close
    w32 = masked_whiten(x.float(), mask)
    assert w32.dtype == torch.float32
    torch.testing.assert_close(w32.double(), w, atol=1e-4, rtol=1e-4)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 6), T=st.integers(1, 20))
def test_masked_mean_along_dim(seed, B, T):
    x, mask = batch(seed, B, T)
    mask[-1] = False  # an empty row gives 0, not NaN
    out = masked_mean(x, mask, dim=1)
    for b in range(B):
        vals = [float(x[b, t]) for t in range(T) if mask[b, t]]
        exp = sum(vals) / len(vals) if vals else 0.0
        assert math.isclose(float(out[b]), exp, rel_tol=1e-9, abs_tol=1e-12)


def test_hand_computed_and_edge_cases():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -7.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert float(masked_mean(x, m)) == 2.5
    assert math.isclose(float(masked_var(x, m)), 5 / 3, rel_tol=1e-6)
    assert math.isclose(float(masked_var(x, m, unbiased=False)), 1.25, rel_tol=1e-6)
    # one element: biased variance 0, whitened value 0, unbiased variance is an error
    one = torch.tensor([[0, 0, 1], [0, 0, 0]])
    assert masked_whiten(x, one).tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(x, one)
    # constant values: whitening gives 0, not NaN
    assert bool((masked_whiten(torch.ones(2, 3), torch.ones(2, 3)) == 0).all())
    empty = torch.zeros(2, 3)
    for fn in (masked_mean, masked_whiten, lambda a, b: masked_var(a, b, unbiased=False)):
        with pytest.raises(ValueError, match=r"no element|at least 1"):
            fn(x, empty)
    with pytest.raises(ValueError, match="mask shape"):
        masked_mean(x, torch.ones(3, 2))


def test_collective_device_follows_the_backend():
    """NCCL reduces CUDA tensors only: the stats go to the current CUDA device for nccl and
    stay on the CPU for gloo (checked without a GPU through the explicit index)."""
    from ppojob_trainer.algorithms.stats import collective_device

    assert collective_device("gloo") == torch.device("cpu")
    assert collective_device("nccl", cuda_index=0) == torch.device("cuda", 0)
    assert collective_device("NCCL", cuda_index=3) == torch.device("cuda", 3)
    assert collective_device(dist.Backend.NCCL, cuda_index=1) == torch.device("cuda", 1)
    assert collective_device(dist.Backend.GLOO, cuda_index=1) == torch.device("cpu")
