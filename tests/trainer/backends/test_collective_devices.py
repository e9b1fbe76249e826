"""Issue 40, finding 2: no tensor the torch or megatron backend hands to a collective of an NCCL
group lives where NCCL cannot take it (``sharding: fsdp`` with ``maxTokensPerMicroBatch``
all-reduced a CPU micro-batch count).

``collective_device_cases.py`` drives every collective of ``torch_backend/optimiser.py``,
``megatron_sharded.py`` and ``megatron_logprobs.py`` on 2 gloo processes under the
collective-device check (``tests/helpers/collective_check.py``); an ``ast`` read of those
modules says which functions issue collectives, and every one of them must have been judged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.collective_check import collective_sites

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
TRAINER = ROOT / "trainer" / "ppojob_trainer"
MODULES = {
    "ppojob_trainer.backends.torch_backend.optimiser": TRAINER
    / "backends/torch_backend/optimiser.py",
    "ppojob_trainer.backends.megatron_sharded": TRAINER / "backends/megatron_sharded.py",
    "ppojob_trainer.backends.megatron_logprobs": TRAINER / "backends/megatron_logprobs.py",
}
GPU_ONLY = {
    # megatron's DistributedDataParallel and distributed optimizer take CUDA parameters only
    "ppojob_trainer.backends.megatron_sharded:_Sharded._distributed_adam_state",
}


@pytest.fixture(scope="module")
def judged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    from ppojob_trainer import models

    tmp = tmp_path_factory.mktemp("collectives")
    model_dir = models.materialize_builtin("tiny-llama", 5, tmp / "cache")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(str(ROOT / d) for d in ("api", "trainer", "operator", ".")),
        "GLOO_SOCKET_IFNAME": "lo",
    }
    cmd = [sys.executable, str(HERE / "collective_device_cases.py"), str(tmp), str(model_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {f"rank{r}": json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)}


def _violations(judged: dict[str, dict], case: str) -> list[str]:
    return sorted(
        {
            f"{v['call']} of a {v['device']} {v['dtype']} {v['shape']} at {v['line']}"
            for per_rank in judged.values()
            for v in per_rank[case]["violations"]
        }
    )


@pytest.mark.parametrize(
    ("case", "sites"),
    [
        ("torch/fsdp+budget", {"_Optimised.micro_batches", "_Optimised.global_count"}),
        ("torch/replicas", {"_Optimised.step", "_Optimised.global_count"}),
        ("torch/replicas+budget", {"_Optimised.step", "_Optimised.global_count"}),
        (
            "megatron/tp2",
            {
                "vocab_parallel_entropy",
                "_SumGradOverRanks.backward",
                "_Sharded._global_grad_norm",
                "_Sharded._hf_tensor",
            },
        ),
        (
            "megatron/pp2",
            {"_Sharded._cpu_schedule", "_Sharded._global_grad_norm", "_Sharded._hf_tensor"},
        ),
        ("megatron/pp2+aux", {"_Sharded._cpu_schedule", "_Sharded._pipeline_sum"}),
        ("megatron/dp2", {"_Sharded._dp_sum", "_Sharded._step"}),
        ("megatron/dp2+budget", {"_Sharded._dp_sum", "_Sharded._step"}),
        (
            "megatron/ep2+budget",
            {"_Sharded._align_for_experts", "_Sharded._every_expert", "_Sharded._step"},
        ),
    ],
)
def test_every_tensor_handed_to_an_nccl_group_was_placed_for_it(
    judged: dict[str, dict], case: str, sites: set[str]
) -> None:
    seen = {s.split(":", 1)[1] for per_rank in judged.values() for s in per_rank[case]["sites"]}
    assert sites <= seen, f"{case}: collectives never judged: {sorted(sites - seen)}"
    assert _violations(judged, case) == [], case


def test_every_function_that_issues_a_collective_was_judged(judged: dict[str, dict]) -> None:
    issued = set().union(*(collective_sites(path, mod) for mod, path in MODULES.items()))
    seen = {s for per_rank in judged.values() for case in per_rank.values() for s in case["sites"]}
    assert issued - GPU_ONLY, "the ast read found no collective at all"
    assert sorted(issued - GPU_ONLY - seen) == []
    assert issued >= GPU_ONLY  # a GPU-only entry that no longer exists goes from the list
