"""Evaluation on held-out prompts: greedy decoding, eval/reward_mean in metrics.jsonl, the
progress bar and the PPOJob status."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ppojob_api.checks import check_training_half
from ppojob_api.training import TrainerConfig, TrainingSettings
from ppojob_trainer import models
from ppojob_trainer.backends.torch_backend.generation import TorchGenerationEngine
from ppojob_trainer.backends.torch_backend.policy import TorchPolicyTrainer
from ppojob_trainer.distributed import ShardIdentity
from ppojob_trainer.k8s_progress import KubernetesProgressReporter
from ppojob_trainer.progress import LocalProgressReporter, _postfix, read_metrics
from ppojob_trainer.tasks import make_task


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return models.materialize_builtin("tiny-llama", 5, tmp_path_factory.mktemp("cache"))


def test_temperature_zero_is_greedy_decoding(model_dir):
    tok = models.load_tokenizer(model_dir)
    enc = tok(["1", "2345", "67"], padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"].bool()
    engine = TorchGenerationEngine(model_dir, "float32", [], tok.pad_token_id)  # no stop token
    a = engine.generate(ids, mask, max_new_tokens=5, temperature=0.0, top_p=1.0, seed=1)
    b = engine.generate(ids, mask, max_new_tokens=5, temperature=0.0, top_p=1.0, seed=2)
    assert torch.equal(a.response_ids, b.response_ids)  # no sampling: the seed does not matter
    trainer = TorchPolicyTrainer(
        model_dir,
        "float32",
        TrainingSettings(),
        total_updates=1,
        temperature=1.0,
        need_reference=False,
    )
    batch = {"prompt_ids": ids, "prompt_mask": mask, "response_ids": a.response_ids}
    with torch.no_grad():
        logits = _response_logits(trainer, batch)
    assert torch.equal(logits.argmax(-1), a.response_ids)  # the most likely token every time


def test_the_rollout_worker_scores_greedy_completions_of_the_eval_set(model_dir):
    from ppojob_trainer.tasks import count_up_reward
    from ppojob_trainer.workers.rollout import RolloutWorker

    cfg = TrainerConfig.model_validate(
        {"data": {"evalPrompts": "builtin:count-up", "maxResponseLength": 8}}
    )
    worker = RolloutWorker(cfg, ShardIdentity("rollout"), model_dir, "cpu")
    examples = make_task("builtin:count-up").eval_set()
    assert examples == make_task("builtin:count-up").eval_set() and len(examples) == 64
    out = worker.evaluate(examples)
    prompts = [e.prompt for e in examples]
    _, ids, mask = worker.encode(prompts)
    gen = worker.engine.generate(ids, mask, max_new_tokens=8, temperature=0.0, top_p=1.0, seed=9)
    expected = count_up_reward(prompts, worker.completions(gen.response_ids), [None] * 64)
    assert out == {"reward_sum": pytest.approx(sum(expected)), "n": 64.0}


def test_eval_prompts_are_validated():
    bad = TrainerConfig.model_validate({"data": {"evalPrompts": "builtin:nope"}})
    assert [p.path for p in check_training_half(bad)] == ["spec.data.evalPrompts"]
    no_reward = TrainerConfig.model_validate({"data": {"evalPrompts": "held_out.jsonl"}})
    # blamed where the user wrote it (issue 23, item 8), the fix naming rewardFunction
    (problem,) = check_training_half(no_reward)
    assert problem.path == "spec.data.evalPrompts" and "rewardFunction" in str(problem)


def test_eval_reward_reaches_the_bar_and_the_status():
    assert "eval=0.250" in _postfix({"reward_mean": 0.5, "eval/reward_mean": 0.25})

    class Api:
        calls: list = []

        def patch_namespaced_custom_object_status(self, *args):
            self.calls.append(args[-1]["status"]["progress"])

    t = [0.0]
    rep = KubernetesProgressReporter("j", "ns", api=Api(), min_interval=60, clock=lambda: t[0])
    rep.start(10)
    rep.report(1, {"reward_mean": 0.1})  # the first report: always written
    rep.report(2, {"reward_mean": 0.2})  # throttled
    rep.report(3, {"reward_mean": 0.3, "eval/reward_mean": 0.4})  # an evaluation: written
    assert [c.get("step") for c in Api.calls] == [0, 1, 3]
    assert Api.calls[-1]["evalRewardMean"] == 0.4
    rep.finish({"step": 10, "eval/reward_mean": 0.6})
    assert Api.calls[-1]["evalRewardMean"] == 0.6


def test_the_status_schema_has_eval_reward_mean():
    from ppojob_api.crd import build_crd
    from ppojob_api.spec import Progress

    assert Progress.model_validate({"evalRewardMean": 0.5}).eval_reward_mean == 0.5
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    progress = schema["properties"]["status"]["properties"]["progress"]["properties"]
    assert progress["evalRewardMean"]["type"] == "number"


@pytest.mark.slow
def test_training_evaluates_every_interval_and_at_the_end(local_ray, tmp_path: Path, monkeypatch):
    from ppojob_trainer.driver.run import train

    monkeypatch.setenv("PPOJOB_CACHE_DIR", str(tmp_path / "cache"))
    cfg = TrainerConfig.model_validate(
        {
            "algorithm": {"advantageEstimator": "grpo"},
            "data": {
                "rolloutBatchSize": 2,
                "samplesPerPrompt": 2,
                "maxResponseLength": 8,
                "evalPrompts": "builtin:count-up",
            },
            "training": {"steps": 3, "evalInterval": 2, "learningRate": 1e-3, "seed": 1},
        }
    )
    result = train(cfg, tmp_path, LocalProgressReporter(tmp_path, show_bar=False))
    records = read_metrics(tmp_path)
    evals = {r["step"]: r.get("eval/reward_mean") for r in records}
    assert evals[1] is None and evals[2] is not None and evals[3] is not None
    assert 0.0 <= evals[3] <= 1.0 and result.eval_reward == evals[3]


def _response_logits(trainer, batch):
    """Full-vocabulary logits at the response positions, from the policy's HF model on the
    backend's own inputs (the backend itself never materialises them)."""
    from ppojob_trainer.backends.torch_backend.common import full_inputs

    ids, attn, pos, plen = full_inputs(batch)
    out = trainer.lm(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    return out[:, plen - 1 : plen - 1 + batch["response_ids"].shape[1]].float()
