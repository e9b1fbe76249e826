"""Sharded megatron checkpoints (issue 40, finding 4): every worker writes only its shard through
megatron-core's ``dist_checkpointing`` (``torch_dist`` on gloo), and a checkpoint resumes under
another data-parallel size (and tensor split) with bit-identical weights, Adam moments, Adam's
step and update count. Four phases, each a fresh gloo world forked from one script process that
imported megatron-core once (``megatron_ckpt_cases.py``):

    data 2 --save--> A --load at data 1, step, save--> B --load at data 2, step, save--> C
    --load at tensor 2 (data 1)

Before, every worker's ``state_dict`` was gathered (``gather_object`` over the model-parallel
group) and the data-parallel leader wrote one ``state.pt`` holding the whole training state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ppojob_api
import ppojob_trainer
from ppojob_trainer import models

SCRIPT = Path(__file__).with_name("megatron_ckpt_cases.py")
OVERHEAD = 64 * 2**10  # bytes a rank may write beyond its share (common.pt, .metadata, headers)


def _phases(tmp: Path, model: Path, phases: list[tuple]) -> dict:  # type: ignore[type-arg]
    """Run ``phases`` (name, world, tensor, load from, save to[, expert]) one after the other in
    one script process, which forks each phase's fresh gloo world (``megatron_ckpt_cases.py``)."""
    ours = [str(Path(m.__file__).parents[1]) for m in (ppojob_api, ppojob_trainer)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(ours), "OMP_NUM_THREADS": "1"}
    specs = [
        ",".join(map(str, (name, world, tp, 1, load, save, *ep)))
        for name, world, tp, load, save, *ep in phases
    ]
    cmd = [sys.executable, str(SCRIPT), str(model), str(tmp), *specs]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: json.loads((tmp / name / "result.json").read_text()) for name, *_ in phases}


@pytest.fixture(scope="module")
def phases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    pytest.importorskip("megatron.core")
    tmp = tmp_path_factory.mktemp("megatron_ckpt")
    model = models.materialize_builtin("tiny-llama", 5, tmp / "cache")
    ck = {k: str(tmp / f"ckpt-{k}") for k in "ABC"}
    return _phases(
        tmp,
        model,
        [
            ("dp2", 2, 1, "-", ck["A"]),
            ("dp1", 1, 1, ck["A"], ck["B"]),
            ("dp2_again", 2, 1, ck["B"], ck["C"]),
            ("tp2", 2, 2, ck["C"], "-"),
        ],
    )


def test_each_rank_writes_its_share_and_no_object_collective_carries_state(phases) -> None:  # type: ignore[no-untyped-def]
    """At data 2, each of the two ranks writes about half of the role's state (the replicas'
    writes spread over them), none the whole; the save's object collectives carry metadata
    (plans, shard descriptions), never tensors: far below one rank's state."""
    res = phases["dp2"]
    for role in ("actor", "critic"):
        written, shard = res["written"][role], res["shard_bytes"][role]
        total = shard[0]  # data-parallel replicas: each rank's shard is the whole state
        assert len(written) == 2 and all(w > 0 for w in written), (role, written)
        assert max(written) <= total / 2 * 1.15 + OVERHEAD, (role, written, total)
        assert sum(written) <= total + 2 * OVERHEAD, (role, written, total)
    assert res["largest_object_collective"] < min(res["shard_bytes"]["actor"]) / 20, res


@pytest.mark.parametrize(
    ("phase", "saved_at"), [("dp1", "data 2"), ("dp2_again", "data 1"), ("tp2", "data 2")]
)
def test_a_checkpoint_resumes_bit_identically_under_another_layout(phases, phase, saved_at) -> None:  # type: ignore[no-untyped-def]
    """Weights, both Adam moments, Adam's step and the update count of actor and critic, as
    gathered to HF names, are bit-identical after the load to what was saved at ``saved_at``."""
    res = phases[phase]
    assert "load_diffs" in res, res
    assert res["load_diffs"] == [], res["load_diffs"]
    assert res["loaded_updates"] >= 1, res


def test_a_moe_checkpoint_resumes_bit_identically_with_and_without_expert_parallelism(
    tmp_path: Path,
) -> None:
    """A Mixtral's experts split over 2 ranks (expert 2, data 2) saved, loaded by one rank
    holding all of them, saved again and loaded at expert 2: weights, Adam moments, step and
    update count bit-identical after each load (megatron-core's sharded state of the experts,
    whose global offsets follow the expert-parallel rank)."""
    pytest.importorskip("megatron.core")
    model = models.materialize_builtin("tiny-mixtral", 5, tmp_path / "cache")
    ck = {k: str(tmp_path / f"ckpt-{k}") for k in "AB"}
    res = _phases(
        tmp_path,
        model,
        [
            ("ep2", 2, 1, "-", ck["A"], 2),
            ("ep1", 1, 1, ck["A"], ck["B"], 1),
            ("ep2_again", 2, 1, ck["B"], "-", 2),
        ],
    )
    for phase in ("ep1", "ep2_again"):
        assert res[phase]["load_diffs"] == [], (phase, res[phase]["load_diffs"])
        assert res[phase]["loaded_updates"] >= 1, res[phase]
    # at expert 2 each rank writes about half of the experts' state, not all of it
    written, shard = res["ep2"]["written"]["actor"], res["ep2"]["shard_bytes"]["actor"]
    assert len(written) == 2 and max(written) <= max(shard) * 1.15 + OVERHEAD, (written, shard)


def test_the_distributed_optimizers_format_is_one_megatron_core_can_save() -> None:
    """The GPU path's distributed optimizer saves in ``DISTRIB_OPTIM_SHARDING``. It does not run
    on the CPU, so this reads megatron-core 0.16.1 itself: the builder of the deprecated default
    (``fully_sharded_model_space``) makes ShardedTensors with a ``flattened_range``, which its
    mapping refuses at construction; the builder of ours passes none."""
    import dataclasses
    import inspect

    import torch
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from ppojob_trainer.backends.megatron_sharded import DISTRIB_OPTIM_SHARDING

    builders = {
        "dp_reshardable": DistributedOptimizer.sharded_param_state_dp_reshardable,
        "fully_sharded_model_space": DistributedOptimizer.sharded_param_state_fs_model_space,
    }
    ok = ShardedTensor.from_rank_offsets("k", torch.zeros(4))
    with pytest.raises(CheckpointingException, match="flattened_range"):
        dataclasses.replace(ok, data=torch.zeros(2), flattened_range=slice(0, 2))
    assert "flattened_range=item_slice" in inspect.getsource(builders["fully_sharded_model_space"])
    ours = inspect.getsource(builders[DISTRIB_OPTIM_SHARDING])
    assert "ShardedTensor(" in ours
    assert all(
        arg.strip() == "flattened_range=None,"
        for arg in ours.splitlines()
        if "flattened_range=" in arg
    ), ours
