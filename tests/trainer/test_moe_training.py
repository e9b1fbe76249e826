"""A tiny MoE model trains under PPO and GRPO (torch backend, CPU), with and without routing
replay, and the rollout/training log-prob mismatch shows replay's effect.

The engine samples in bfloat16 and the actor computes in float32 master weights under bfloat16
autocast (``model.dtype: bfloat16``): some tokens' routers pick other experts in the actor than
in the engine. The first step of a run with replay and one without samples the same tokens
(same seed, same weights): only the actor's forward differs, so their mismatch compares replay
alone."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from ppojob_trainer.manifest import load_manifest
from ppojob_trainer.progress import LocalProgressReporter, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]

TINY = Path(__file__).resolve().parents[2] / "examples" / "ppojob-tiny.yaml"


def run(out: Path, model: str, estimator: str, replay: str, *extra: Any) -> list[dict]:
    from ppojob_trainer.driver.run import train

    sets = [
        ("model.path", f"builtin:{model}"),
        ("model.dtype", "bfloat16"),
        ("algorithm.advantageEstimator", estimator),
        ("algorithm.routingReplay", replay),
        ("training.steps", 2),
        ("training.seed", 5),
        *extra,
    ]
    cfg = load_manifest(TINY, sets)[1]
    train(cfg, out, LocalProgressReporter(out, show_bar=False))
    return read_metrics(out)


@pytest.mark.parametrize(
    ("model", "estimator"), [("tiny-qwen3-moe", "gae"), ("tiny-mixtral", "grpo")]
)
def test_a_tiny_moe_trains_with_and_without_replay_and_replay_lowers_the_mismatch(
    tmp_path: Path, model: str, estimator: str
) -> None:
    off = run(tmp_path / "off", model, estimator, "none")
    on = run(tmp_path / "on", model, estimator, "rollout")
    for records in (off, on):
        assert [r["step"] for r in records] == [1, 2]
        assert all(math.isfinite(r["actor/pg_loss"]) for r in records)
        assert all(r["actor/grad_norm"] > 0 for r in records)
    if estimator == "gae":
        assert all(math.isfinite(r["value_loss"]) for r in on)  # the critic's
    assert all("moe/router_agreement" not in r for r in off)
    agreement = [r["moe/router_agreement"] for r in on]
    # the same samples at step 1; replay changes only the actor's forward
    assert on[0]["reward_mean"] == off[0]["reward_mean"]
    figures = {
        "agreement": agreement,
        "diff_mean": (off[0]["rollout/logprob_diff_mean"], on[0]["rollout/logprob_diff_mean"]),
        "diff_max": (off[0]["rollout/logprob_diff_max"], on[0]["rollout/logprob_diff_max"]),
    }
    print(json.dumps({model: figures}))
    assert all(0.9 < a < 1.0 for a in agreement)  # the precisions route some tokens apart
    assert on[0]["rollout/logprob_diff_mean"] < off[0]["rollout/logprob_diff_mean"]
    assert on[0]["rollout/logprob_diff_max"] < off[0]["rollout/logprob_diff_max"]


def test_two_fsdp_actor_workers_replay_routing_over_packed_rows(tmp_path: Path) -> None:
    """FSDP2 shards the MoE actor over two workers (gloo); replay runs over packed rows with
    a KL reference (replayed too). FSDP2's mixed precision casts the parameters to bfloat16
    and computes as the engine does (no float32 norms as under autocast): here the routers
    agreed on every choice (rollout/logprob_diff_mean about 2.7e-4, against 7.8e-4 unsharded),
    so this run shows that replay works sharded and packed, not its effect. A router
    load-balancing loss joins the actor's (the run reports it)."""
    records = run(
        tmp_path / "fsdp",
        "tiny-qwen3-moe",
        "grpo",
        "rollout",
        ("training.sharding", "fsdp"),
        ("training.packing", True),
        ("roles.actor.replicas", 2),
        ("roles.actor.resources.cpus", 1),
        ("algorithm.routerAuxLossCoefficient", 0.01),
    )
    assert [r["step"] for r in records] == [1, 2]
    assert all(0.9 < r["moe/router_agreement"] <= 1.0 for r in records)
    assert all(0.5 < r["actor/router_balance"] < 4.0 for r in records)  # (1: uniform; E/k: 4)
    assert all(math.isfinite(r["actor/kl_loss"]) for r in records)


@pytest.mark.parametrize(
    ("model", "estimator", "replay", "extra"),
    [
        ("tiny-qwen3-moe", "gae", "rollout", ()),
        (
            "tiny-mixtral",
            "grpo",
            "none",
            (
                ("roles.actor.replicas", 2),
                ("roles.actor.parallelism.expert", 2),
                ("roles.actor.resources.cpus", 1),
            ),
        ),
    ],
)
def test_a_tiny_moe_trains_on_the_megatron_backend(
    tmp_path: Path, model: str, estimator: str, replay: str, extra: tuple
) -> None:
    """megatron-core's MoE layers (float32 on the CPU, as the engine: the routers agree), PPO
    with a critic and routing replay on one worker, GRPO with the experts over two (expert 2),
    both with a router load-balancing loss.
    Step 2's rollout ran on the weights step 1 trained and synced to the engine (the expert-
    parallel shards gathered): the engine's and the actor's log-probs still agree to ~1e-7."""
    records = run(
        tmp_path / "m",
        model,
        estimator,
        replay,
        ("model.dtype", "float32"),
        ("roles.actor.backend", "megatron"),
        ("algorithm.routerAuxLossCoefficient", 0.01),
        *extra,
    )
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["actor/pg_loss"]) and r["actor/grad_norm"] > 0 for r in records)
    assert all(0.5 < r["actor/router_balance"] < 4.0 for r in records)  # (1: uniform; E/k: 4)
    assert all(r["rollout/logprob_diff_mean"] < 1e-5 for r in records)
    if replay == "rollout":
        assert all(r["moe/router_agreement"] > 0.99 for r in records)
        assert all(math.isfinite(r["value_loss"]) for r in records)
    else:
        assert all("moe/router_agreement" not in r for r in records)
