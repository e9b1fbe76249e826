"""`ppojob validate --plan`: each job's memory plan and, beside it, its time plan with the
assumptions it rests on; a CPU job says why it has no time plan."""

from __future__ import annotations

from ppojob_api.validation import load_manifests
from ppojob_cli.main import main
from ppojob_trainer.time_plan import format_time_plan, plan_time
from tests.helpers.controlplane import ROOT

GRPO = ROOT / "examples" / "ppojob-grpo-kueue.yaml"


def test_plan_prints_memory_and_time(capsys) -> None:
    assert main(["validate", "--plan", str(GRPO), str(ROOT / "examples" / "ppojob-tiny.yaml")]) == 0
    out = capsys.readouterr().out
    (job,) = load_manifests(GRPO.read_text())
    assert "actor: peak " in out  # the memory plan
    assert format_time_plan(plan_time(job.spec)) in out
    assert "assumes: H100-class GPU" in out
    assert "time: no plan (the actor has no GPUs" in out  # the tiny CPU job


def test_without_plan_nothing_more(capsys) -> None:
    assert main(["validate", str(GRPO)]) == 0
    assert "time:" not in capsys.readouterr().out
