"""Bad input to the command lines ends in one clear message and an exit code, never a traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from ppojob_cli.main import main as ppojob

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "ppojob-tiny.yaml"


def test_render_of_a_binary_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(bytes(range(256)) * 4)
    assert ppojob(["render", str(path)]) == 1
    err = capsys.readouterr().err
    assert "not a UTF-8 text file" in err and "Traceback" not in err
    assert ppojob(["validate", str(path)]) == 1
    assert "not a UTF-8 text file" in capsys.readouterr().err


def test_render_with_an_unknown_gang_scheduler(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        ppojob(["render", str(TINY), "--gang-scheduler", "bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'bogus'" in err and "Traceback" not in err


@pytest.mark.parametrize("namespace", ["Team_A", "ml.team", "ns-", "n" * 64, ""])
def test_render_namespace_must_be_a_dns_1123_label(
    namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ppojob(["render", str(TINY), "--namespace", namespace]) == 1
    err = capsys.readouterr().err
    assert "--namespace" in err and "DNS-1123" in err, err


def test_render_refuses_a_nameless_job_instead_of_emitting_dash_trainer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = yaml.safe_load(TINY.read_text())
    del doc["metadata"]["name"]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert ppojob(["render", str(path)]) == 1
    captured = capsys.readouterr()
    assert "metadata.name: required field is missing" in captured.err
    assert "-trainer" not in captured.out


def test_operator_without_a_kubeconfig(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ppojob_operator import __main__ as operator_main

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert operator_main.main(["--metrics-port", "0", "--health-port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ppojob-operator: no Kubernetes API") and "KUBECONFIG" in err
    assert "Traceback" not in err


def test_run_without_the_trainer_extra_says_which_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # as if torch/ray were missing
    monkeypatch.setitem(sys.modules, "ppojob_trainer.driver.run", None)
    rc = ppojob(["run", str(TINY), "--steps", "1", "--out", str(tmp_path / "o"), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "pip install 'ppojob[trainer]'" in err and "Traceback" not in err


def test_render_needs_a_name_not_a_generate_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = yaml.safe_load(TINY.read_text())
    doc["metadata"] = {"generateName": "tiny-"}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert ppojob(["validate", str(path)]) == 0  # kubectl create accepts it
    capsys.readouterr()
    assert ppojob(["render", str(path)]) == 1
    captured = capsys.readouterr()
    assert "metadata.name: required to render" in captured.err and captured.out == ""


def test_help_of_validate_and_crd_says_what_they_check(capsys) -> None:
    for command, words in (
        ("validate", ["camelCase", "Kubernetes quantities", "Not checked here", "one line"]),
        ("crd", ["CustomResourceDefinition", "defaults", "crds/ppojob.io_ppojobs.yaml"]),
    ):
        with pytest.raises(SystemExit):
            ppojob([command, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        for word in words:
            assert word in out, (command, word)
