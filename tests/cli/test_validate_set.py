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
