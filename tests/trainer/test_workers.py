"""Workers on Ray: data-parallel layouts, value routing through the object store, hook errors."""

from __future__ import annotations

import itertools
import math
import sys
import textwrap

import pytest
import ray
import torch
from ppojob_trainer.backends.base import ShardIdentity
from ppojob_trainer.config import TrainerConfig
from ppojob_trainer.loop import PPOTrainer
from ppojob_trainer.workers.actor import ActorWorker
from ppojob_trainer.workers.group import overlap, shard_range
from ppojob_trainer.workers.rollout import RolloutWorker, cat_batches


@pytest.fixture(scope="module", autouse=True)
def ray_session(local_ray, tmp_path_factory):
    """The shared loopback Ray (conftest) and a private cache for built-in models."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PPOJOB_CACHE_DIR", str(tmp_path_factory.mktemp("ppojob-cache")))
    yield
    mp.undo()


def _cfg(actor_dp: int = 1, critic_dp: int | None = None, **algo) -> TrainerConfig:
    roles: dict = {"actor": {"replicas": actor_dp, "resources": {"cpus": 1}}}
    if critic_dp is not None:
        roles["critic"] = {"replicas": critic_dp, "resources": {"cpus": 1}}
    roles["rollout"] = {"replicas": 1, "resources": {"cpus": 1}}
    return TrainerConfig.model_validate({
        "roles": roles,
        "algorithm": {"advantageEstimator": "gae", **algo},
        "data": {"rolloutBatchSize": 3, "samplesPerPrompt": 2, "maxResponseLength": 8},
        "training": {"steps": 2, "learningRate": 1e-3, "seed": 3},
    })  # fmt: skip


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
        ids = trainer.identities
        actor_ids = sorted(
            (i["actor"]["dp_rank"], i["actor"]["dp_size"]) for i in ids if "actor" in i
        )
        critic_ids = sorted((i["critic"]["dp_rank"], i["critic"]["dp_size"]) for i in ids
                            if "critic" in i)  # fmt: skip
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
    cfg = _cfg(**{"advantageEstimator": "grpo", "customAdvantageFunction": f"{hooks}:good"})
    path, parts, batch = _rollout_parts(cfg)
    actor = ActorWorker(cfg, ShardIdentity("actor"), path, "cpu", None)
    refs, metrics = actor.prepare(parts, None, None, 0.0)
    assert refs is None and metrics["tokens"] == float(batch["response_mask"].sum())
    adv = actor.batch["advantages"]
    last = batch["response_mask"].long().cumsum(1).argmax(1)
    assert torch.allclose(adv[torch.arange(adv.shape[0]), last], 2 * batch["scores"])
    assert math.isfinite(actor.train(0)["actor/pg_loss"])


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
    rows = torch.tensor([[d["8"], d["9"], tok.eos_token_id, d["1"]],
                         [d["8"], tok.bos_token_id, d["0"], d["1"]],
                         [d["1"], d["2"], d["3"], d["4"]]])  # fmt: skip
    assert worker.completions(rows) == ["89", "8", "1234"]


def test_cat_batches_pads_to_the_widest():
    a = {
        "prompt_ids": torch.ones(1, 2, dtype=torch.long),
        "prompt_mask": torch.ones(1, 2).bool(),
        "response_ids": torch.ones(1, 3, dtype=torch.long),
        "scores": torch.ones(1),
    }
    b = {"prompt_ids": torch.ones(2, 1, dtype=torch.long), "prompt_mask": torch.ones(2, 1).bool(),
         "response_ids": torch.ones(2, 1, dtype=torch.long), "scores": torch.zeros(2)}  # fmt: skip
    out = cat_batches([a, b])
    assert out["prompt_ids"].shape == (3, 2) and out["response_ids"].shape == (3, 3)
    assert out["prompt_mask"][1:].tolist() == [[False, True], [False, True]]
