"""`ppojob validate --set/--unset`: every job of every file is checked with the changes that
`ppojob run --set/--unset` would make, so a run's command line can be checked before it runs."""

from __future__ import annotations

from ppojob_cli.main import main
from tests.helpers.controlplane import ROOT

TINY = str(ROOT / "examples" / "ppojob-tiny.yaml")
GRPO = str(ROOT / "examples" / "ppojob-grpo-kueue.yaml")


def test_a_set_that_breaks_a_valid_job_is_refused_in_every_file(capsys) -> None:
    assert main(["validate", TINY, GRPO]) == 0
    capsys.readouterr()
    assert main(["validate", TINY, GRPO, "--set", "training.steps=0"]) == 1
    err = capsys.readouterr().err
    assert err.count("spec.training.steps: Input should be greater than or equal to 1") == 2
    assert f"{TINY}: 1 problem(s)" in err and f"{GRPO}: 1 problem(s)" in err


def test_sets_and_unsets_change_the_job_checked(tmp_path, capsys) -> None:
    """An invalid manifest made valid on the command line passes; the same fields as run's."""
    bad = tmp_path / "bad.yaml"
    text = (ROOT / "examples" / "ppojob-tiny.yaml").read_text()
    bad.write_text(text.replace("spec:\n", "spec:\n  suspend: maybe\n", 1))
    assert main(["validate", str(bad)]) == 1
    assert "spec.suspend" in capsys.readouterr().err
    assert main(["validate", str(bad), "--set", "suspend=true"]) == 0
    assert main(["validate", str(bad), "--unset", "suspend"]) == 0
    assert "bad.yaml: valid" in capsys.readouterr().out


def test_malformed_and_pointless_overrides_name_the_flag(capsys) -> None:
    assert main(["validate", TINY, "--set", "training.steps"]) == 1
    assert "--set training.steps: expected KEY=VALUE" in capsys.readouterr().err
    assert main(["validate", TINY, "--unset", "roles.nothing"]) == 1
    assert "--unset roles.nothing: the manifest has no spec.roles.nothing" in (
        capsys.readouterr().err
    )


def test_a_warmup_longer_than_the_run_is_a_warning_naming_the_field_set(capsys) -> None:
    """lrWarmupSteps >= the optimizer updates of the whole run (the tiny example: 500 steps x
    1 epoch x 2 mini-batches = 1000): valid, with a warning on the field the user wrote."""
    assert main(["validate", TINY, "--set", "training.lrWarmupSteps=999"]) == 0
    assert "lrWarmupSteps" not in capsys.readouterr().err
    assert main(["validate", TINY, "--set", "training.lrWarmupSteps=1000"]) == 0
    err = capsys.readouterr().err
    actor, critic = [line for line in err.splitlines() if "warning:" in line]
    assert "spec.training.lrWarmupSteps: 1000 warm-up updates, but the actor makes only 1000" in (
        actor
    )
    assert "spec.training.lrWarmupSteps" in critic and "the critic makes only 1000" in critic
    overrides = "roles.critic.overrides.lrWarmupSteps=4000"
    assert main(["validate", TINY, "--set", overrides]) == 0
    [line] = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    assert "spec.roles.critic.overrides.lrWarmupSteps: 4000" in line


def test_a_decay_longer_than_the_run_is_a_warning_naming_the_field_set(capsys) -> None:
    """lrDecaySteps longer than the updates after the warm-up (the tiny example: 1000 updates,
    20 of warm-up): valid (the trainer decays over the 980), with a warning; a shortened run of
    the example (`--set training.steps=100`) is valid too, warned the same way."""
    assert main(["validate", TINY, "--set", "training.lrDecaySteps=980"]) == 0
    assert "lrDecaySteps" not in capsys.readouterr().err
    assert main(["validate", TINY, "--set", "training.lrDecaySteps=5000"]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "warning: spec.training.lrDecaySteps" in line]
    assert len(warnings) == 2  # the actor and the critic (colocated, inheriting spec.training)
    assert "5000 decay updates, but the actor makes only 980 optimizer updates after" in err
    assert main(["validate", TINY, "--set", "training.steps=100"]) == 0
    err = capsys.readouterr().err  # 200 updates: 180 after the warm-up
    assert "spec.training.lrDecaySteps: 400 decay updates, but the actor makes only 180" in err
