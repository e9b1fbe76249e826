"""Workers on Ray: data-parallel layouts, value routing through the object store, hook errors."""

from __future__ import annotations

import itertools
import math
import sys
import textwrap

import pytest
import ray
import torch

from ppojob_api.training import TrainerConfig
from ppojob_trainer.algorithms import compute_advantages, masked_whiten, shape_token_rewards
from ppojob_trainer.distributed import ShardIdentity
from ppojob_trainer.driver.trainer import PPOTrainer
from ppojob_trainer.workers.actor import ActorWorker
from ppojob_trainer.workers.group import overlap, shard_range
from ppojob_trainer.workers.rollout import RolloutWorker, cat_batches

pytestmark = pytest.mark.usefixtures("ray_session")  # conftest: loopback Ray + model cache


def _cfg(actor_dp: int = 1, critic_dp: int | None = None, **algo) -> TrainerConfig:
    roles: dict = {"actor": {"replicas": actor_dp, "resources": {"cpus": 1}}}
    if critic_dp is not None:
        roles["critic"] = {"replicas": critic_dp, "resources": {"cpus": 1}}
    roles["rollout"] = {"replicas": 1, "resources": {"cpus": 1}}
    return TrainerConfig.model_validate(
        {
            "roles": roles,
            "algorithm": {"advantageEstimator": "gae", **algo},
            "data": {"rolloutBatchSize": 3, "samplesPerPrompt": 2, "maxResponseLength": 8},
            "training": {"steps": 2, "learningRate": 1e-3, "seed": 3},
        }
    )


def _tensors_in(obj, seen=None) -> list:
    """Every torch.Tensor reachable from obj (containers, dataclass-like dicts)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors_in(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors_in(v)]
    return []


def test_shard_ranges_cover_and_overlap():
    for n, size in ((6, 2), (7, 3), (6, 1)):
        ranges = [shard_range(n, size, r) for r in range(size)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert overlap((0, 3), (3, 6)) is None and overlap((0, 4), (3, 6)) == (3, 4)


@pytest.mark.slow
@pytest.mark.parametrize(("actor_dp", "critic_dp"), [(2, 1), (1, 2)])
def test_values_reach_the_actor_bit_identical_and_never_touch_the_driver(
    actor_dp, critic_dp, monkeypatch
):
    cfg = _cfg(actor_dp, critic_dp)
    trainer = PPOTrainer(cfg)
    try:
        ids = trainer.groups.identities
        actor_ids = sorted(
            (i["actor"]["dp_rank"], i["actor"]["dp_size"]) for i in ids if "actor" in i
        )
        critic_ids = sorted(
            (i["critic"]["dp_rank"], i["critic"]["dp_size"]) for i in ids if "critic" in i
        )
        assert actor_ids == [(r, actor_dp) for r in range(actor_dp)]
        assert critic_ids == [(r, critic_dp) for r in range(critic_dp)]

        fetched: list = []
        real_get = ray.get

        def recording_get(refs, *args, **kwargs):
            out = real_get(refs, *args, **kwargs)
            fetched.append(out)
            return out

        monkeypatch.setattr(ray, "get", recording_get)
        metrics = [trainer.step(s) for s in range(2)]
        monkeypatch.setattr(ray, "get", real_get)
        assert fetched, "the driver fetched nothing: the recording is broken"
        assert not [t for obj in fetched for t in _tensors_in(obj)], "driver pulled a tensor"
        assert all(math.isfinite(v) for m in metrics for v in m.values())
        assert "critic/vf_loss" in metrics[-1] and "actor/pg_loss" in metrics[-1]
        # each role's optimizer figures under its own name; neither overwrites the other's
        assert {"actor/grad_norm", "actor/lr", "critic/grad_norm", "critic/lr"} <= set(metrics[-1])
        assert not {"grad_norm", "lr"} & set(metrics[-1])

        computed = ray.get([h.computed_values.remote() for h in trainer.hosts["critic"]])
        received = ray.get([h.received_values.remote() for h in trainer.hosts["actor"]])
        by_sample = {}
        for idx, values in computed:
            for i, row in zip(idx.tolist(), values, strict=False):
                by_sample[i] = row
        seen = 0
        for idx, values in received:
            assert values.dtype == torch.float32
            for i, row in zip(idx.tolist(), values, strict=False):
                assert torch.equal(row, by_sample[i]), f"sample {i} changed on the way"
                seen += 1
        assert seen == cfg.data.samples_per_step
    finally:
        trainer.shutdown()


@pytest.fixture
def hooks(tmp_path, monkeypatch):
    (tmp_path / "my_hooks.py").write_text(
        textwrap.dedent("""
        import torch
        def wrong_shape(token_rewards, scores, values, response_masks, group_ids, gamma, lam):
            return {"advantages": [torch.zeros(1)] * len(token_rewards),
                    "returns": [torch.zeros(1)] * len(token_rewards)}
        def missing_key(token_rewards, scores, values, response_masks, group_ids, gamma, lam):
            return {"advantages": token_rewards}
        def good(token_rewards, scores, values, response_masks, group_ids, gamma, lam):
            return {"advantages": [t * 2 for t in token_rewards], "returns": token_rewards}
        def bad_reward(prompts, completions, labels):
            return [0.5]
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_hooks"
    sys.modules.pop("my_hooks", None)


def _rollout_parts(cfg):
    from ppojob_trainer.models import resolve_model_path

    path = resolve_model_path(cfg.model.path, cfg.training.seed)
    worker = RolloutWorker(cfg, ShardIdentity("rollout"), path, "cpu")
    import random

    from ppojob_trainer.tasks import make_task

    examples = make_task(cfg.data.prompts).sample(cfg.data.rollout_batch_size, random.Random(0))
    batch, _ = worker.generate(examples, 0, seed=0)
    n = cfg.data.samples_per_step
    return path, [(0, n, ray.put(batch))], batch


def test_custom_advantage_function(hooks):
    cfg = _cfg(
        **{
            "advantageEstimator": "grpo",
            "customAdvantageFunction": f"{hooks}:good",
            "normalizeAdvantages": False,
        }
    )
    path, parts, batch = _rollout_parts(cfg)
    actor = ActorWorker(cfg, ShardIdentity("actor"), path, "cpu", None)
    refs, metrics = actor.prepare(parts, None, None, 0.0)
    assert refs is None and metrics["tokens"] == float(batch["response_mask"].sum())
    adv = actor.batch["advantages"]
    last = batch["response_mask"].long().cumsum(1).argmax(1)
    assert torch.allclose(adv[torch.arange(adv.shape[0]), last], 2 * batch["scores"])
    # normalizeAdvantages applies to a custom function's output too
    algo_on = cfg.algorithm.model_copy(update={"normalize_advantages": True})
    on = ActorWorker(
        cfg.model_copy(update={"algorithm": algo_on}), ShardIdentity("actor"), path, "cpu", None
    )
    on.prepare(parts, None, None, 0.0)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(on.batch["advantages"], masked_whiten(adv, mask))
    trained = actor.train(0)
    assert math.isfinite(trained["actor/pg_loss"])
    assert {"actor/grad_norm", "actor/lr"} <= set(trained) and "grad_norm" not in trained


@pytest.mark.parametrize(("fn", "message"), [("wrong_shape", "shape"), ("missing_key", "returns")])
def test_bad_advantage_functions_give_clear_errors(hooks, fn, message):
    cfg = _cfg(**{"advantageEstimator": "grpo", "customAdvantageFunction": f"{hooks}:{fn}"})
    path, parts, _ = _rollout_parts(cfg)
    actor = ActorWorker(cfg, ShardIdentity("actor"), path, "cpu", None)
    with pytest.raises(ValueError, match=message) as err:
        actor.prepare(parts, None, None, 0.0)
    assert fn in str(err.value)


def test_unloadable_advantage_function():
    cfg = _cfg(**{"advantageEstimator": "grpo", "customAdvantageFunction": "no_such_mod_q:f"})
    from ppojob_trainer.models import resolve_model_path

    path = resolve_model_path(cfg.model.path, cfg.training.seed)
    with pytest.raises(ValueError, match="customAdvantageFunction"):
        ActorWorker(cfg, ShardIdentity("actor"), path, "cpu", None)


def test_bad_reward_function_in_the_rollout(hooks):
    cfg = _cfg()
    cfg.data.reward_function = f"{hooks}:bad_reward"
    with pytest.raises(ValueError, match="bad_reward") as err:
        _rollout_parts(cfg)
    assert "6" in str(err.value)  # says how many values were expected


def test_completions_are_cut_at_the_first_special_token():
    cfg = _cfg()
    from ppojob_trainer.models import resolve_model_path

    path = resolve_model_path(cfg.model.path, cfg.training.seed)
    worker = RolloutWorker(cfg, ShardIdentity("rollout"), path, "cpu")
    tok = worker.tokenizer
    d = {str(i): tok.convert_tokens_to_ids(str(i)) for i in range(10)}
    rows = torch.tensor(
        [
            [d["8"], d["9"], tok.eos_token_id, d["1"]],
            [d["8"], tok.bos_token_id, d["0"], d["1"]],
            [d["1"], d["2"], d["3"], d["4"]],
        ]
    )
    assert worker.completions(rows) == ["89", "8", "1234"]


def test_cat_batches_pads_to_the_widest():
    a = {
        "prompt_ids": torch.ones(1, 2, dtype=torch.long),
        "prompt_mask": torch.ones(1, 2).bool(),
        "response_ids": torch.ones(1, 3, dtype=torch.long),
        "scores": torch.ones(1),
    }
    b = {
        "prompt_ids": torch.ones(2, 1, dtype=torch.long),
        "prompt_mask": torch.ones(2, 1).bool(),
        "response_ids": torch.ones(2, 1, dtype=torch.long),
        "scores": torch.zeros(2),
    }
    out = cat_batches([a, b])
    assert out["prompt_ids"].shape == (3, 2) and out["response_ids"].shape == (3, 3)
    assert out["prompt_mask"][1:].tolist() == [[False, True], [False, True]]


def _live_ours(name: str) -> tuple[list[str], list[str]]:
    """(states of our placement groups not removed, ids of our worker hosts alive)."""
    from ray._private import state

    groups = [
        g["state"]
        for g in ray.util.placement_group_table().values()
        if g["name"] == name and g["state"] != "REMOVED"
    ]
    hosts = [
        a_id
        for a_id, a in state.actors(actor_state_name="ALIVE").items()
        if "WorkerHost" in str(a.get("ActorClassName", ""))
    ]
    return groups, hosts


def test_a_worker_failing_to_start_leaves_no_group_and_no_worker():
    """The actor host starts fine, the rollout host's reward module does not import: the
    constructor must kill the started host and release the placement group, then re-raise."""
    import time

    cfg = _cfg()
    cfg.job_name = "startup-leak"
    cfg.data.reward_function = "no_such_reward_mod_q:score"
    assert _live_ours("ppojob-startup-leak") == ([], [])
    with pytest.raises(Exception, match="no_such_reward_mod_q"):
        PPOTrainer(cfg)
    # Killing is asynchronous in Ray: wait (bounded) for the state to say so, never a fixed sleep.
    deadline = time.monotonic() + 30
    while _live_ours("ppojob-startup-leak") != ([], []) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _live_ours("ppojob-startup-leak") == ([], [])


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_normalize_advantages_switches_whitening(estimator):
    """Same batch: normalizeAdvantages false gives the estimator's raw advantages, true gives
    them whitened over the batch's response tokens (once: GAE's own whitening is not doubled)."""
    cfg = _cfg(advantageEstimator=estimator, normalizeAdvantages=False, kl={"coefficient": 0.0})
    path, _, batch = _rollout_parts(cfg)
    n, width = batch["response_ids"].shape
    # scores that differ inside the prompt groups, so that GRPO's advantages are not all 0
    batch["scores"] = torch.arange(n, dtype=torch.float32) % 3 * 0.5
    parts = [(0, n, ray.put(batch))]
    mask = batch["response_mask"]
    value_lists = critic_ranges = None
    values = None
    if estimator == "gae":
        values = torch.randn(n, width, generator=torch.Generator().manual_seed(1))
        value_lists, critic_ranges = [[ray.put(values)]], [(0, n)]
    out = {}
    for on in (False, True):
        c = cfg.model_copy(
            update={"algorithm": cfg.algorithm.model_copy(update={"normalize_advantages": on})}
        )
        actor = ActorWorker(c, ShardIdentity("actor"), path, "cpu", None)
        actor.prepare(parts, value_lists, critic_ranges, 0.0)
        out[on] = actor.batch["advantages"]
    options = {"whiten": False} if estimator == "gae" else {}
    raw, _ = compute_advantages(
        estimator,
        token_rewards=shape_token_rewards(batch["scores"], mask),
        scores=batch["scores"],
        values=values,
        mask=mask,
        group_ids=batch["group_ids"],
        gamma=cfg.algorithm.gamma,
        lam=cfg.algorithm.lam,
        **options,
    )
    torch.testing.assert_close(out[False], raw)
    torch.testing.assert_close(out[True], masked_whiten(raw, mask.bool()))
    assert not torch.allclose(out[True], out[False])
    sel = out[True][mask.bool()]
    assert abs(float(sel.mean())) < 1e-5 and abs(float(sel.std(unbiased=False)) - 1) < 1e-3


def test_lr_schedule_length_counts_the_updates_each_role_makes():
    from ppojob_trainer.workers.actor import planned_updates

    cfg = TrainerConfig.model_validate(
        {
            "roles": {
                "actor": {"replicas": 1, "resources": {"cpus": 1}},
                "critic": {
                    "replicas": 1,
                    "resources": {"cpus": 1},
                    "overrides": {"ppoEpochs": 3, "miniBatchSize": 2},
                },
                "rollout": {"replicas": 1, "resources": {"cpus": 1}},
            },
            "algorithm": {
                "advantageEstimator": "gae",
                "criticWarmupSteps": 2,
                "criticUpdatesPerStep": 2,
            },
            "data": {"rolloutBatchSize": 4, "samplesPerPrompt": 2},
            "training": {"steps": 10, "ppoEpochs": 2, "miniBatchSize": 4},
        }
    )
    # actor: (10 - 2) steps x 2 epochs x (8 / 4) mini-batches
    assert planned_updates(cfg, "actor") == 8 * 2 * 2
    # critic: 10 steps x 2 updates per step x 3 epochs x (8 / 2) mini-batches
    assert planned_updates(cfg, "critic") == 10 * 2 * 3 * 4
    # without a critic the warm-up does not apply: the actor trains at every step
    grpo = cfg.model_copy(
        update={"algorithm": cfg.algorithm.model_copy(update={"advantage_estimator": "grpo"})}
    )
    assert grpo.roles.effective_critic(grpo.algorithm.needs_critic) is None
    assert planned_updates(grpo, "actor") == 10 * 2 * 2


def test_long_prompts_are_truncated_from_the_left():
    """maxPromptLength keeps the end of the prompt (next to the answer), not its start."""
    cfg = _cfg()
    cfg.data.max_prompt_length = 4
    from ppojob_trainer.models import resolve_model_path

    path = resolve_model_path(cfg.model.path, cfg.training.seed)
    worker = RolloutWorker(cfg, ShardIdentity("rollout"), path, "cpu")
    tok = worker.tokenizer
    long_prompt, short = "1234567890", "12"
    _, ids, mask = worker.encode([long_prompt, short])
    assert ids.shape[1] == 4
    full = tok(long_prompt)["input_ids"]
    assert len(full) > 4
    kept = ids[0][mask[0]].tolist()
    assert kept[-2:] == full[-2:] and tok.convert_tokens_to_ids("0") in kept
    assert tok.convert_tokens_to_ids("1") not in kept
    assert ids[1][mask[1]].tolist() == tok(short)["input_ids"]  # short prompts untouched


def _one_process_cfg() -> TrainerConfig:
    roles = {
        "actor": {"replicas": 1, "resources": {"cpus": 1}},
        "rollout": {"colocateWithActor": True},
    }
    return TrainerConfig.model_validate(
        {
            "roles": roles,
            "algorithm": {"advantageEstimator": "gae"},
            "data": {"rolloutBatchSize": 3, "samplesPerPrompt": 2, "maxResponseLength": 8},
            "training": {"steps": 3, "learningRate": 1e-3, "seed": 3},
        }
    )


@pytest.mark.slow
def test_a_one_process_run_hands_over_in_memory_and_trains_as_through_the_store(monkeypatch):
    from ppojob_trainer.driver.topology import Topology

    cfg = _one_process_cfg()
    runs = {}
    for mode in ("memory", "store"):
        if mode == "store":  # the same layout, told it is not one process
            monkeypatch.setattr(Topology, "one_process", property(lambda self: False))
        trainer = PPOTrainer(cfg)
        try:
            assert len(trainer.groups.all_hosts) == 1
            host = trainer.groups.all_hosts[0]
            runs[mode] = [trainer.step(s) for s in range(3)]
            # every object handed over was read, and none is left behind in the process
            assert ray.get(host.handoffs.remote()) == (mode, 0)
            received = ray.get(host.received_values.remote())
            computed = ray.get(host.computed_values.remote())
            assert torch.equal(received[1], computed[1])
        finally:
            trainer.shutdown()
    keys = ("reward/mean", "actor/pg_loss", "critic/vf_loss", "actor/grad_norm")
    assert [[m[k] for k in keys] for m in runs["memory"]] == [
        [m[k] for k in keys] for m in runs["store"]
    ]
