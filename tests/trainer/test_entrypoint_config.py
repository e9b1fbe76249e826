"""`ppojob-train --config` answers a wrong file in one line (issue 23 item 7): an empty file, a
PPOJob manifest, a binary file, a recursive YAML alias; its valid neighbour is read."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppojob_api.problems import SpecError
from ppojob_api.validation import load_trainer_config
from ppojob_trainer.entrypoint import main

EXAMPLE = Path(__file__).parents[2] / "examples" / "ppojob-tiny.yaml"


@pytest.mark.parametrize(
    ("content", "message", "fix"),
    [
        (b"", "is empty", "write the training half of a PPOJob spec"),
        (b"# only a comment\n", "is empty", "write the training half"),
        (EXAMPLE.read_bytes(), "is a PPOJob manifest, not a trainer config", "`ppojob run "),
        (b"\x7fELF\x02\x01\x01\x00\xff\xfe", "is not a UTF-8 text file", "as a YAML mapping"),
        (b"- 1\n- 2\n", "expected a mapping, got list", "as a YAML mapping"),
        (b"a: &a [1, *a]\n", "refers to itself through a YAML alias", "write the value out"),
        (b"training: {learning_rate: 0.1}\n", "unknown field", "write it as `learningRate`"),
    ],
)
def test_a_wrong_config_file_is_one_line_before_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str, fix: str
) -> None:
    path = tmp_path / "trainer.yaml"
    path.write_bytes(content)
    assert main(["--config", str(path), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    problems = [line for line in err.splitlines() if line.startswith("  - ")]
    assert len(problems) == 1, err
    assert message in problems[0] and fix in problems[0], err


@pytest.mark.parametrize("content", ["{}\n", "training: {steps: 3}\n"])
def test_a_config_mapping_is_read(tmp_path: Path, content: str) -> None:
    path = tmp_path / "trainer.yaml"
    path.write_text(content)
    assert load_trainer_config(path).training.steps in (3, 100)


def test_help_says_what_the_config_is(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "not a PPOJob manifest" in out and "`ppojob run`" in out
    assert "before Ray starts" in out


def test_the_loader_raises_spec_error_not_unicode_error(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(SpecError):
        load_trainer_config(path)


def test_the_preflight_runs_before_ray_and_reaches_the_reporter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In the cluster, a reward module the image lacks is found before connecting to Ray, and
    the reporter (the PPOJob's status) gets the line."""
    from ppojob_trainer import entrypoint, runtime

    failed: list[str] = []

    class Reporter:
        def fail(self, message: str) -> None:
            failed.append(message)

    configs: list = []

    def reporters(out, show_bar, cfg=None):
        configs.append(cfg)  # the trainer's config: its spec.trackers get reporters too
        return Reporter()

    monkeypatch.setattr(entrypoint, "_reporters", reporters)
    monkeypatch.setattr(runtime, "connect_ray", lambda: pytest.fail("Ray was started"))
    config = tmp_path / "trainer.yaml"
    config.write_text(
        "data: {prompts: builtin:count-up, rewardFunction: no_such_module_xyz:score}\n"
    )
    rc = main(["--config", str(config), "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert failed and failed[0].startswith("data.rewardFunction: 'no_such_module_xyz:score'")
    assert "cannot import module" in err and "Traceback" not in err
    assert [c.data.reward_function for c in configs] == ["no_such_module_xyz:score"]
