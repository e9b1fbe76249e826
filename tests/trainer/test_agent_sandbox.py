"""``roles.sandbox``: the agent's tool calls on sandbox workers of their own, end to end on a
local Ray with ``ppojob run`` (the built-in calculator task, 2 short steps): every call of a
step is answered by a sandbox worker's process (not the engine's), and the run is the one the
engine gets running the calls itself (same seed, same samples, same rewards, same losses)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ppojob_cli.main import main as ppojob
from ppojob_trainer.progress import read_metrics

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ppojob-tiny-calculator.yaml"
SMALL = ["--set", "data.rolloutBatchSize=4", "--set", "training.miniBatchSize=16"]
SAME = ("reward_mean", "agent/turns_mean", "agent/env_calls_mean", "agent/tool_errors_mean")

pytestmark = pytest.mark.usefixtures("ray_session")


def _run(out: Path, capsys: Any, extra: list[str]) -> list[dict[str, Any]]:
    argv = ["run", str(EXAMPLE), "--steps", "2", "--out", str(out), "--no-progress", *SMALL]
    rc = ppojob([*argv, *extra])
    assert rc == 0, capsys.readouterr().err
    return read_metrics(out)


def test_tool_calls_run_on_sandbox_workers_and_the_run_is_the_engines_own(
    tmp_path: Path, capsys: Any
) -> None:
    here = _run(tmp_path / "engine", capsys, [])
    sandbox = "roles.sandbox={replicas: 2, resources: {cpus: 0.5, memory: 1Gi}}"
    remote = _run(tmp_path / "sandbox", capsys, ["--set", sandbox])
    assert [r["step"] for r in remote] == [1, 2]
    for a, b in zip(here, remote, strict=True):
        assert "agent/sandbox_calls_mean" not in a  # the engine ran its calls itself
        # every call of the step came back from a sandbox worker's process
        assert b["agent/env_calls_mean"] > 0
        assert b["agent/sandbox_calls_mean"] == b["agent/env_calls_mean"]
        for key in SAME:
            assert b[key] == a[key], key
        assert b["actor/pg_loss"] == pytest.approx(a["actor/pg_loss"], rel=1e-6, abs=1e-9)
