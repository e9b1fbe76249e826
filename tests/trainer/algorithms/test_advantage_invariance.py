"""Advantages do not depend on the data-parallel size; estimator-dependent whitening default.

Each actor worker computes its rows' token rewards (with its own KL term) and values; the
advantages it keeps must be the rows of the whole step's advantages, whatever the number of
workers. The workers here run :func:`shard_advantages` in real gloo process groups of 2 and 3
ranks; the reference is one worker (no group).
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ppojob_api.training import Algorithm, TrainerConfig
from ppojob_trainer.algorithms import masked_whiten, shape_token_rewards
from ppojob_trainer.workers.actor import shard_advantages
from ppojob_trainer.workers.group import shard_range

N_PROMPTS, K, T = 4, 3, 9
N = N_PROMPTS * K
KL_COEF = 0.3

# (case name, algorithm settings, KL in the reward, custom advantage function)
CASES = {
    "gae": ({"advantageEstimator": "gae"}, True),
    "reinforce_plus_plus": ({"advantageEstimator": "reinforce_plus_plus"}, True),
    "grpo": ({"advantageEstimator": "grpo"}, False),
    "rloo": ({"advantageEstimator": "rloo"}, False),
    "reinforce_plus_plus_baseline": ({"advantageEstimator": "reinforce_plus_plus_baseline"}, False),
    "custom": (
        {
            "advantageEstimator": "grpo",
            "customAdvantageFunction": "x:group_centred",
            "normalizeAdvantages": True,
        },
        True,
    ),
}


def group_centred(*, token_rewards, scores, values, response_masks, group_ids, gamma, lam):
    """A custom estimator that needs whole groups: score minus its group's mean score."""
    ids = torch.tensor(group_ids)
    adv = []
    for i, m in enumerate(response_masks):
        mean = scores[ids == group_ids[i]].mean()
        adv.append((scores[i] - mean + token_rewards[i].sum()) * m)
    return {"advantages": adv, "returns": adv}


def _step() -> dict[str, torch.Tensor]:
    """A whole step: responses of different lengths, scores, per-token KL and values."""
    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return {
        "response_mask": mask,
        "scores": (torch.rand(N, generator=g) > 0.5).float(),
        "group_ids": torch.arange(N) // K,
        "kl": torch.randn(N, T, generator=g).abs() * 0.2,
        "values": torch.randn(N, T, generator=g),
    }


def _algo(case: str) -> Algorithm:
    settings, _ = CASES[case]
    return Algorithm.model_validate(settings)


def _shard(case: str, step: dict, lo: int, hi: int, group) -> torch.Tensor:
    _, kl_in_reward = CASES[case]
    algo = _algo(case)
    mask = step["response_mask"][lo:hi]
    kl = step["kl"][lo:hi] if kl_in_reward else None
    tr = shape_token_rewards(step["scores"][lo:hi], mask, kl, KL_COEF if kl_in_reward else 0.0)
    values = step["values"][lo:hi] if algo.needs_critic else None
    custom = group_centred if algo.custom_advantage_function else None
    full = {k: step[k] for k in ("response_mask", "scores", "group_ids")}
    adv, _ = shard_advantages(algo, custom, full, lo, hi, tr, values, group)
    return adv


def _worker(rank: int, world: int, port: int, results) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        step = _step()
        for dp in (2, 3):
            group = dist.new_group(list(range(dp)))  # every rank takes part in new_group
            if rank >= dp:
                continue
            lo, hi = shard_range(N, dp, rank)
            for case in CASES:
                results[(case, dp, rank)] = _shard(case, step, lo, hi, group).clone()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sharded():
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(3, _free_port(), results), nprocs=3, join=True)
    return dict(results)


@pytest.mark.parametrize("case", list(CASES))
def test_advantages_are_the_same_for_dp_1_2_and_3(case, sharded):
    step = _step()
    whole = _shard(case, step, 0, N, None)
    assert whole.abs().sum() > 0
    for dp in (2, 3):
        parts = [sharded[(case, dp, r)] for r in range(dp)]
        torch.testing.assert_close(
            torch.cat(parts),
            whole,
            atol=1e-6,
            rtol=1e-6,
            msg=lambda m, dp=dp: f"{case}, dp={dp}: {m}",
        )


# --- normalizeAdvantages: the default depends on the estimator; an explicit value is honoured
@pytest.mark.parametrize(
    ("estimator", "default"),
    [
        ("gae", True),
        ("reinforce_plus_plus", True),
        ("reinforce_plus_plus_baseline", True),
        ("grpo", False),
        ("rloo", False),
    ],
)
def test_normalize_advantages_default_depends_on_the_estimator(estimator, default):
    assert Algorithm(advantage_estimator=estimator).whitens_advantages is default
    for explicit in (True, False):
        algo = Algorithm(advantage_estimator=estimator, normalize_advantages=explicit)
        assert algo.whitens_advantages is explicit
    custom = Algorithm(advantage_estimator=estimator, custom_advantage_function="m:f")
    assert custom.whitens_advantages is False


def test_grpo_by_default_keeps_the_sign_of_each_answer():
    """Long wrong answers must not turn into positive advantages (token whitening would)."""
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    lengths = torch.tensor([2, 2, 2, 12, 2, 12, 12, 12])
    mask = torch.arange(12)[None, :] < lengths[:, None]
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    full = {"response_mask": mask, "scores": scores, "group_ids": group_ids}
    tr = shape_token_rewards(scores, mask)
    for settings in (
        {"advantageEstimator": "grpo"},
        {"advantageEstimator": "grpo", "grpoNormByStd": False},
    ):
        algo = Algorithm.model_validate(settings)
        adv, _ = shard_advantages(algo, None, full, 0, 8, tr, None, None)
        per_sample = adv[:, 0]
        centred = scores - scores.view(2, 4).mean(1).repeat_interleave(4)
        assert torch.equal(torch.sign(per_sample), torch.sign(centred)), settings
    # Dr. GRPO (no division by the std) differs from GRPO when nothing re-whitens it
    a = shard_advantages(Algorithm(advantage_estimator="grpo"), None, full, 0, 8, tr, None, None)
    b = shard_advantages(
        Algorithm(advantage_estimator="grpo", grpo_norm_by_std=False),
        None,
        full,
        0,
        8,
        tr,
        None,
        None,
    )
    assert not torch.allclose(a[0], b[0])
    # explicit true whitens the group advantages over the step's tokens
    on = Algorithm(advantage_estimator="grpo", normalize_advantages=True)
    c, _ = shard_advantages(on, None, full, 0, 8, tr, None, None)
    torch.testing.assert_close(c, masked_whiten(a[0], mask))


def test_unset_and_stored_manifest_mean_the_same():
    """The CRD gives normalizeAdvantages no default, so the API server stores nothing for it and
    the trainer resolves the estimator's default in both cases."""
    from ppojob_api.crd import build_crd

    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    algo = schema["properties"]["spec"]["properties"]["algorithm"]["properties"]
    assert "default" not in algo["normalizeAdvantages"]
    assert algo["normalizeAdvantages"].get("nullable") is True
    cfg = TrainerConfig.model_validate({"algorithm": {"advantageEstimator": "grpo"}})
    stored = TrainerConfig.model_validate(
        {"algorithm": {"advantageEstimator": "grpo", "normalizeAdvantages": None}}
    )
    assert cfg.algorithm.whitens_advantages is stored.algorithm.whitens_advantages is False
