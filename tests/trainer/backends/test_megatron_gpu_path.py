"""The megatron backend's GPU path (megatron-core DDP and distributed optimizer) on the CPU, as
far as megatron-core runs there: two data-parallel ranks in a real gloo world
(``megatron_gpu_path.py`` says what each checks and exactly where megatron-core needs CUDA)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ppojob_api
import ppojob_trainer

SCRIPT = Path(__file__).with_name("megatron_gpu_path.py")


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("megatron.core")
    tmp = tmp_path_factory.mktemp("megatron_gpu_path")
    ours = [str(Path(m.__file__).parents[1]) for m in (ppojob_api, ppojob_trainer)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(ours),
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
    }
    out = tmp / "out.json"
    cmd = [sys.executable, str(SCRIPT), str(tmp / "store"), "both", str(out)]
    proc = subprocess.run(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    return json.loads(out.read_text())


def test_megatron_ddp_gradients_equal_one_full_batch_backward(result):
    """The reduced gradient of two data-parallel ranks (megatron's own DDP, reduce-scatter over
    gloo) is the single-process full-batch gradient of the token-mean loss, not twice it
    (``calculate_per_token_loss`` makes DDP sum; the micro-batch weights were scaled for an
    average). fp32 sums of 4 micro-batch gradients in another order: relative error ~1e-7."""
    assert result["grad_rel_err"] < 1e-5, result
    assert abs(result["grad_norm_ratio"] - 1.0) < 1e-5, result


def test_megatron_optimizer_builder_gets_past_its_process_groups(result):
    """With the process groups the GPU path creates, megatron-core's ``get_megatron_optimizer``
    passes its process-group setup (gloo groups were off on CUDA while it asked for them) and
    stops on a CPU only at its distributed optimizer's CUDA allocation."""
    opt = result["optimizer"]
    if opt["built"]:  # a machine with a GPU builds it
        return
    assert not any("parallel_state" in f for f in opt["frames"]), opt
    assert "megatron/core/optimizer/optimizer.py:__init__" in opt["frames"], opt
    assert opt["frames"][-1].startswith("torch/cuda/"), opt


def test_a_resume_of_the_distributed_optimizer_continues_where_it_stopped(result):
    """save -> load -> step: a shard resumed from a checkpoint makes exactly the update the
    uninterrupted one makes (bf16 weights, fp32 main weights and Adam moments of megatron's
    distributed optimizer, two data-parallel ranks each holding half of them)."""
    resume = result["resume"]
    assert {"adam", "adam_step", "master"} <= set(resume["saved"]), resume
    assert resume["a_moved"] > 1e-3, resume  # the updates did something to compare
    assert resume["b_vs_a"] == 0.0, resume  # same arithmetic on the same state: bit-identical
