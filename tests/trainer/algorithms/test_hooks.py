"""Custom advantage hooks, reward validation and the step plan."""

from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest
import torch

from ppojob_trainer.algorithms import (
    StepPlan,
    compute_gae,
    load_function,
    plan_step,
    run_custom_advantage,
    validate_rewards,
)


@pytest.fixture
def user_module():
    mod = types.ModuleType("ppojob_test_user_hooks")

    def gae_hook(*, token_rewards, scores, values, response_masks, group_ids, gamma, lam):
        advs, rets = [], []
        for r, v, m in zip(token_rewards, values, response_masks, strict=True):
            a, ret = compute_gae(r[None], v[None], m[None], gamma, lam)
            advs.append(a[0])
            rets.append(ret[0])
        return {"advantages": advs, "returns": rets}

    class Holder:
        @staticmethod
        def method(**kw):
            return {}

    mod.gae_hook = gae_hook
    mod.Holder = Holder
    mod.not_callable = 3
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def test_load_function_ok_and_errors(user_module):
    assert (
        load_function("ppojob_test_user_hooks:gae_hook", "advantage.custom") is user_module.gae_hook
    )
    assert load_function("ppojob_test_user_hooks:Holder.method", "f") is user_module.Holder.method
    assert load_function("math:sqrt", "f") is math.sqrt
    cases = [
        ("no_colon", "malformed"),
        ("a:b:c", "malformed"),
        (":fn", "malformed"),
        ("mod:", "malformed"),
        ("bad-name:fn", "malformed"),
        ("ppojob_no_such_module_xyz:fn", "cannot import module 'ppojob_no_such_module_xyz'"),
        ("ppojob_test_user_hooks:missing", "has no attribute 'missing'"),
        ("ppojob_test_user_hooks:not_callable", "not callable"),
    ]
    for path, match in cases:
        with pytest.raises(ValueError, match=match) as info:
            load_function(path, "spec.algorithm.customAdvantage")
        assert "spec.algorithm.customAdvantage" in str(info.value)
        assert repr(path) in str(info.value)
    with pytest.raises(ValueError, match="myfield"):
        load_function(None, "myfield")  # type: ignore[arg-type]


def _batch():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor(
        [[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 1, 1], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]]
    )
    return dict(
        token_rewards=torch.randn(4, 6, generator=g),
        scores=torch.randn(4, generator=g),
        values=torch.randn(4, 6, generator=g),
        mask=mask,
        group_ids=torch.tensor([0, 0, 1, 1]),
        gamma=0.9,
        lam=0.8,
    )


def test_run_custom_advantage_matches_builtin_gae(user_module):
    batch = _batch()
    adv, ret = run_custom_advantage(user_module.gae_hook, **batch)
    ref_adv, ref_ret = compute_gae(
        batch["token_rewards"], batch["values"], batch["mask"], batch["gamma"], batch["lam"]
    )
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)


def test_run_custom_advantage_slicing_contract():
    seen = {}

    def spy(**kwargs):
        seen.update(kwargs)
        return {
            "advantages": [torch.full(m.shape, 7.0) for m in kwargs["response_masks"]],
            "returns": tuple(torch.ones(m.shape) for m in kwargs["response_masks"]),
        }

    batch = _batch()
    adv, ret = run_custom_advantage(spy, **{**batch, "values": None})
    # spans: first to last response position, gaps inside marked 0
    assert [m.tolist() for m in seen["response_masks"]] == [
        [1, 1, 1],
        [1, 1, 0, 1, 1],
        [],
        [1, 1, 1, 1, 1, 1],
    ]
    torch.testing.assert_close(seen["token_rewards"][1], batch["token_rewards"][1, 1:6])
    assert seen["values"] is None and seen["group_ids"] == [0, 0, 1, 1]
    assert seen["gamma"] == 0.9 and seen["lam"] == 0.8
    assert adv.tolist() == (batch["mask"] * 7.0).tolist()
    assert ret.tolist() == batch["mask"].float().tolist()


def _returning(result):
    def user_fn(**kwargs):
        return result(kwargs["response_masks"])

    return user_fn


@pytest.mark.parametrize(
    "result, match",
    [
        (lambda ms: [], "must return a mapping"),
        (lambda ms: {"advantages": [torch.zeros(m.shape) for m in ms]}, "missing key 'returns'"),
        (lambda ms: {"advantages": torch.zeros(4, 6), "returns": []}, "list or tuple of 4"),
        (
            lambda ms: {"advantages": [torch.zeros(m.shape) for m in ms[:3]], "returns": []},
            "expected 4, got 3",
        ),
        (
            lambda ms: {
                "advantages": [torch.zeros(m.shape) for m in ms[:3]] + [[0.0] * 6],
                "returns": [],
            },
            r"advantages\[3\] \(sample 3\) must be a tensor of shape \(6,\), got list",
        ),
        (
            lambda ms: {"advantages": [torch.zeros(5) for m in ms], "returns": []},
            r"advantages\[0\] \(sample 0\) has shape \(5,\), expected \(3,\)",
        ),
        (
            lambda ms: {
                "advantages": [torch.zeros(m.shape) for m in ms],
                "returns": [torch.zeros(m.shape) for m in ms[:1]]
                + [torch.tensor([0.0, float("nan"), 0.0, 0.0, 0.0])]
                + [torch.zeros(m.shape) for m in ms[2:]],
            },
            r"returns\[1\] \(sample 1\) has a non-finite value nan at response position 1",
        ),
    ],
)
def test_run_custom_advantage_validation(result, match):
    fn = _returning(result)
    with pytest.raises(ValueError, match=match) as info:
        run_custom_advantage(fn, **_batch())
    assert f"{fn.__module__}:{fn.__qualname__}" in str(info.value)


def test_non_finite_in_gap_is_ignored_and_user_errors_propagate():
    def gap_nan(*, response_masks, **_):
        out = [torch.where(m > 0, 1.0, float("nan")) for m in response_masks]
        return {"advantages": out, "returns": out}

    adv, _ = run_custom_advantage(gap_nan, **_batch())
    assert torch.isfinite(adv).all() and adv[1, 3] == 0

    def boom(**_):
        raise KeyError("user bug")

    with pytest.raises(KeyError, match="user bug"):
        run_custom_advantage(boom, **_batch())


def test_validate_rewards():
    out = validate_rewards([1, 0.5, True, np.float32(2.0), torch.tensor(3.0)], 5, "m:f")
    assert out.dtype == torch.float32 and out.tolist() == [1.0, 0.5, 1.0, 2.0, 3.0]
    assert validate_rewards(np.array([1.0, 2.0]), 2, "m:f").tolist() == [1.0, 2.0]
    assert validate_rewards(torch.tensor([1.0, 2.0]), 2, "m:f").tolist() == [1.0, 2.0]
    cases = [
        ([1.0], "expected 2, got 1"),
        ([1.0, float("nan")], "sample 1 is nan"),
        ([1.0, None], "sample 1 must be a real number, got NoneType"),
        ([1.0, "1"], "sample 1 must be a real number"),
        ([1.0, 1e300], "sample 1"),
        ([1.0, torch.ones(2)], r"sample 1 must be a single real number"),
        (3.0, "must return a list of 2 floats"),
        (torch.ones(2, 1), "1-D tensor"),
    ]
    for values, match in cases:
        with pytest.raises(ValueError, match=match) as info:
            validate_rewards(values, 2, "my.rewards:score")
        assert "my.rewards:score" in str(info.value)


def test_plan_step():
    kw = dict(has_critic=True, critic_warmup_steps=2, critic_updates_per_step=3)
    assert [plan_step(s, **kw) for s in range(4)] == [
        StepPlan(3, False),
        StepPlan(3, False),
        StepPlan(3, True),
        StepPlan(3, True),
    ]
    assert plan_step(
        0, has_critic=True, critic_warmup_steps=0, critic_updates_per_step=1
    ) == StepPlan(1, True)
    # without a critic, warm-up is ignored and the actor always trains
    for s in range(3):
        assert plan_step(
            s, has_critic=False, critic_warmup_steps=5, critic_updates_per_step=4
        ) == StepPlan(0, True)
    with pytest.raises(ValueError, match="step"):
        plan_step(-1, **kw)
    with pytest.raises(ValueError, match="critic_updates_per_step"):
        plan_step(0, has_critic=True, critic_warmup_steps=0, critic_updates_per_step=0)
    with pytest.raises(ValueError, match="critic_warmup_steps"):
        plan_step(0, has_critic=True, critic_warmup_steps=-1, critic_updates_per_step=1)
    with pytest.raises(ValueError, match="integer"):
        plan_step(1.5, **kw)  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        plan_step(0, **kw).actor_trains = True  # type: ignore[misc]
