"""On-policy distillation (issue 44): the built-in teacher's distribution, the signal's math, the
teacher's tokenizer check, and a tiny student that learns its teacher's distribution on CPU
(and does not without the signal)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ppojob_api.training import TrainerConfig
from ppojob_cli.main import main as ppojob
from ppojob_trainer import algorithms as A
from ppojob_trainer import models
from ppojob_trainer.progress import read_metrics
from ppojob_trainer.teacher import count_up_teacher_table, resolve_teacher_path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ppojob-tiny-distill.yaml"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def test_the_builtin_teacher_computes_its_table_exactly(cache: Path) -> None:
    path = resolve_teacher_path("builtin:count-up-teacher", 1, cache)
    lm = models.load_causal_lm(path)
    table = count_up_teacher_table()
    assert torch.allclose(table.sum(1), torch.ones(len(models.VOCAB), dtype=torch.float64))
    ids = torch.tensor([[1, 7, 8, 4, 13, 0, 2]])  # <s> 3 4 0 9 <pad> </s>
    with torch.no_grad():
        probs = lm(ids).logits.softmax(-1)[0].double()
    for pos, tok in enumerate(ids[0].tolist()):
        assert torch.allclose(probs[pos], table[tok], atol=1e-6), (pos, tok)
    assert table[7, 8] == pytest.approx(0.7) and table[13, 4] == pytest.approx(0.7)  # 3->4, 9->0


def test_the_loss_gradient_is_the_reverse_kl_gradient() -> None:
    """Expected over the student's own samples, the k2 loss's gradient is that of KL(pi ||
    teacher) (computed exactly over a 5-token vocabulary), and the reward is its negation."""
    torch.manual_seed(0)
    logits = torch.randn(5, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(5), -1)
    logp = torch.log_softmax(logits, -1)
    exact = (logp.exp() * (logp - teacher)).sum()
    (g_exact,) = torch.autograd.grad(exact, logits)
    # expectation over y ~ pi of grad of 0.5 (log pi(y) - log t(y))^2
    logp = torch.log_softmax(logits, -1)
    probs = logp.exp().detach()
    surrogate = sum(
        probs[y] * A.distill_loss(logp[y].view(1, 1), teacher[y].view(1, 1), torch.ones(1, 1))
        for y in range(5)
    )
    (g_loss,) = torch.autograd.grad(surrogate, logits)
    assert torch.allclose(g_exact, g_loss, atol=1e-6)
    mask = torch.tensor([[True, True, False]])
    s, t = torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.5, -1.0, 0.0]])
    rkl = A.reverse_kl(s, t, mask)
    assert rkl.tolist() == [[0.5, -1.0, 0.0]]
    assert A.distill_token_rewards(torch.zeros(1, 3), rkl, 2.0).tolist() == [[-1.0, 2.0, 0.0]]


def test_the_trainer_refuses_a_teacher_with_another_tokenizer(
    cache: Path, tmp_path: Path, local_ray, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ppojob_trainer.driver.trainer import PPOTrainer

    monkeypatch.setenv("PPOJOB_CACHE_DIR", str(tmp_path / "cache"))
    other = tmp_path / "teacher"
    shutil.copytree(resolve_teacher_path("builtin:count-up-teacher", 1, cache), other)
    tok = models.load_tokenizer(other)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    cfg = TrainerConfig.model_validate(
        {
            "algorithm": {
                "advantageEstimator": "reinforce_plus_plus",
                "distillation": {"teacher": str(other)},
            },
            "data": {"rolloutBatchSize": 2, "samplesPerPrompt": 2},
            "training": {"steps": 1},
        }
    )
    with pytest.raises(Exception, match=r"algorithm\.distillation\.teacher.*different tokenizer"):
        PPOTrainer(cfg)


def _reverse_kl(tmp_path: Path, name: str, steps: int, *sets: str) -> list[float]:
    out = tmp_path / name
    args = ["run", str(EXAMPLE), "--steps", str(steps), "--out", str(out), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    assert ppojob(args) == 0
    return [r["distill/reverse_kl"] for r in read_metrics(out)]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_a_student_learns_its_teachers_distribution_and_not_without_the_signal(
    tmp_path: Path,
) -> None:
    """The example (REINFORCE++, the teacher alone, reverse KL as the token reward) over 25
    steps: the reverse KL to the teacher falls to well under half; with coefficient 0 (the
    teacher measured, its signal unused) it stays where it started."""
    learned = _reverse_kl(tmp_path, "on", 25)
    control = _reverse_kl(tmp_path, "off", 25, "algorithm.distillation.coefficient=0")
    print(json.dumps({"on": learned, "off": control}))
    assert learned[0] == pytest.approx(control[0])  # the same first step (same seed)
    start = _mean(control[:5])
    assert start > 4.0  # the untrained student is far from the teacher
    assert _mean(learned[-5:]) < 0.4 * start
    assert abs(_mean(control[-5:]) - start) < 0.15 * start


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_the_loss_mode_with_grpo_on_a_dataset_without_a_reward_learns(tmp_path: Path) -> None:
    """The teacher alone as a loss term (GRPO's advantages are all 0 without a reward), on a
    prompt file that has no reward function: reward/mean is 0, the reverse KL falls."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": str(d)}) + "\n" for d in range(10)))
    kl = _reverse_kl(
        tmp_path,
        "loss",
        15,
        "algorithm.advantageEstimator=grpo",
        "algorithm.distillation.mode=loss",
        f"data.prompts={prompts}",
    )
    records = read_metrics(tmp_path / "loss")
    assert all(r["reward_mean"] == 0.0 for r in records)
    assert all("actor/distill_loss" in r for r in records)
    assert _mean(kl[-3:]) < 0.5 * _mean(kl[:3])


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_two_actor_workers_with_token_balanced_shares_a_critic_and_the_task_reward_run(
    tmp_path: Path,
) -> None:
    """Each of 2 data-parallel actor workers holds a teacher; with maxTokensPerMicroBatch
    every worker trains on token-balanced shares of the whole step, so the teacher's log-probs
    are gathered with the step's other rows; the loss term reaches every update."""
    out = tmp_path / "dp2"
    sets = [
        "roles.actor.replicas=2",
        "roles.actor.resources.cpus=1",
        "algorithm.advantageEstimator=gae",
        "algorithm.distillation.mode=loss",
        "algorithm.distillation.taskReward=true",
        "training.maxTokensPerMicroBatch=64",
    ]
    args = ["run", str(EXAMPLE), "--steps", "2", "--out", str(out), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    assert ppojob(args) == 0
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["actor/distill_loss"] > 0 and r["distill/reverse_kl"] > 0 for r in records)
    assert all("critic/value_loss" in r or "value_loss" in r for r in records)
