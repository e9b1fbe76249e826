"""`ppojob run` checks paths, hook modules and hook signatures before it starts Ray (issue 23
item 9): each problem one line naming the field; the valid neighbours go on to train."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ppojob_cli.main import main as ppojob
from ppojob_trainer import run_cmd

TINY = Path(__file__).parents[2] / "examples" / "ppojob-tiny.yaml"
HOOKS = {
    "good_reward.py": "def score(prompts, completions, labels):\n    return [0.0] * len(prompts)\n",
    "star_reward.py": "def score(*args, **kwargs):\n    return [0.0]\n",
    "bad_reward.py": "def score(completions):\n    return [0.0]\n",
    "bad_adv.py": "def adv(token_rewards, scores):\n    return {}\n",
    "good_adv.py": "def adv(**kw):\n    return {}\n",
}


@pytest.fixture()
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project directory holding the hook modules, as the cwd of `ppojob run`."""
    for name, text in HOOKS.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "data.jsonl").write_text('{"prompt": "1", "label": "2"}\n')
    (tmp_path / "empty-model").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run(sets: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, bool]:
    started: list[Any] = []
    monkeypatch.setattr(run_cmd, "train_locally", lambda *a, **k: started.append(a) or 0)
    argv = ["run", str(TINY), "--out", "out", "--no-progress"]
    for item in sets:
        argv += ["--set", item]
    return ppojob(argv), bool(started)


REWARD = "data.rewardFunction=good_reward:score"
BAD = [
    (["data.rewardFunction=no_such_module_xyz:score"], "data.rewardFunction: 'no_such_module"),
    (["data.rewardFunction=good_reward:nope"], "'good_reward' has no attribute 'nope'"),
    (["data.rewardFunction=bad_reward:score"], "does not take the call fn(prompts, completions"),
    (["data.prompts=missing.jsonl", REWARD], "data.prompts: 'missing.jsonl' does not exist"),
    (["data.prompts=openai/gsm8k", REWARD], "a Hugging Face hub dataset id is not downloaded"),
    (["data.evalPrompts=./nope.jsonl", REWARD], "data.evalPrompts: './nope.jsonl' does not"),
    (["model.path=/no/such/model"], "model.path: model directory '/no/such/model' does not"),
    (["algorithm.customAdvantageFunction=bad_adv:adv"], "Function: 'bad_adv:adv': its signature"),
    (["model.path=./empty-model"], "model.path: directory './empty-model' holds no config.json"),
]


@pytest.mark.parametrize(("sets", "expected"), BAD)
def test_problems_are_found_before_ray_starts(
    project: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    sets: list[str],
    expected: str,
) -> None:
    rc, started = _run(sets, monkeypatch)
    err = capsys.readouterr().err
    assert rc == 1 and not started, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("  - ")]
    assert len(lines) == 1 and expected in lines[0], err


GOOD = [
    ["data.rewardFunction=good_reward:score"],
    ["data.rewardFunction=star_reward:score"],
    ["data.prompts=data.jsonl", "data.rewardFunction=good_reward:score"],
    ["algorithm.customAdvantageFunction=good_adv:adv"],
    [],
]


@pytest.mark.parametrize("sets", GOOD)
def test_valid_neighbours_go_on_to_train(
    project: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    sets: list[str],
) -> None:
    rc, started = _run(sets, monkeypatch)
    assert rc == 0 and started, capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("openai/gsm8k", "a Hugging Face hub dataset id is not downloaded by the trainer"),
        ("/no/such/train.jsonl", "give a .jsonl, .json or .parquet file"),
    ],
)
def test_the_trainers_dataset_loader_says_what_the_preflight_says(
    project: Path, value: str, expected: str
) -> None:
    from ppojob_trainer.tasks import load_dataset

    with pytest.raises(ValueError) as info:
        load_dataset(value)
    assert str(info.value).startswith(f"data.prompts: {value!r} does not exist")
    assert expected in str(info.value)
    assert len(load_dataset("data.jsonl")) == 1  # its valid neighbour


@pytest.mark.parametrize(
    ("message", "about", "expected"),
    [
        ("Unrecognized model in /m. Should have", "/m", "model.path: Unrecognized model in /m."),
        ("data.prompts: x does not exist", "x", "data.prompts: x does not exist"),
        ("CUDA out of memory", "/m", "CUDA out of memory"),
    ],
)
def test_a_library_error_about_the_model_is_told_its_field(
    message: str, about: str, expected: str
) -> None:
    from ppojob_trainer.errors import naming

    assert naming("model.path", OSError(message), about).startswith(expected)


def test_an_error_raised_inside_a_hook_is_one_line_naming_the_hook() -> None:
    """What the pre-flight cannot see (the hook raising at step time) reaches the user as one
    line naming the hook and its field, also through Ray's task error."""
    import torch
    from ray.exceptions import RayTaskError

    from ppojob_trainer.algorithms.hooks import run_custom_advantage
    from ppojob_trainer.errors import describe_failure

    def boom(**_: Any) -> None:
        raise KeyError("user bug")

    mask = torch.ones(2, 3)
    with pytest.raises(KeyError) as info:
        run_custom_advantage(
            boom,
            token_rewards=torch.zeros(2, 3),
            scores=torch.zeros(2),
            values=None,
            mask=mask,
            group_ids=torch.zeros(2, dtype=torch.long),
            gamma=1.0,
            lam=1.0,
        )
    wrapped = RayTaskError("WorkerHost.prepare", "Traceback ...", info.value).as_instanceof_cause()
    line = describe_failure(wrapped)
    assert "\n" not in line and line.startswith("KeyError: 'user bug' (raised inside the custom")
    assert "boom" in line and "(algorithm.customAdvantageFunction)" in line
    assert describe_failure(KeyError("plain")) == "KeyError: 'plain'"  # its neighbour: no note
