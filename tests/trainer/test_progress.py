"""Progress reporting: metrics.jsonl (one line per step, no duplicates on resume), the curve, the
composite reporter."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ppojob_trainer import progress
from ppojob_trainer.progress import (
    REQUIRED_KEYS,
    CompositeReporter,
    LocalProgressReporter,
    ProgressReporter,
    read_attempts,
    read_metrics,
)


def metrics(step: int) -> dict[str, float]:
    return {
        "elapsed_seconds": 1.5 * step,
        "reward_mean": 0.1 * step,
        "kl": 0.01 * step,
        "value_loss": 1.0 / step,
        "tokens_per_second": 100.0 + step,
    }


def run(out: Path, steps: range, total: int, start: int = 0) -> LocalProgressReporter:
    rep = LocalProgressReporter(out, show_bar=False)
    rep.start(total, start)
    for step in steps:
        rep.report(step, metrics(step))
    return rep


def test_one_json_line_per_step_with_required_keys_and_a_curve(tmp_path: Path) -> None:
    rep = run(tmp_path, range(1, 5), total=4)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for rec in records:
        assert set(REQUIRED_KEYS) <= set(rec)
    rep.finish({"steps_completed": 4, "final_reward": 0.4})
    png = tmp_path / "reward_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "summary.json").read_text())["steps_completed"] == 4


@pytest.mark.parametrize("pass_start_step", [True, False])
def test_resume_keeps_earlier_lines_and_never_duplicates_a_step(
    tmp_path: Path, pass_start_step: bool
) -> None:
    run(tmp_path, range(1, 7), total=10)  # crashed after step 6; newest checkpoint at step 4
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "rew')  # a line cut short by the crash
    rep = run(tmp_path, range(5, 11), total=10, start=4 if pass_start_step else 0)
    rep.report(10, metrics(10))  # a repeated report is ignored
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 11))
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 10
    # elapsed_seconds continues across the resume: step 4's 6.0 s plus this run's own clock
    assert records[3]["elapsed_seconds"] == 6.0
    assert records[4]["elapsed_seconds"] == 6.0 + 7.5


def test_a_resumed_run_that_dies_before_its_first_step_loses_nothing(tmp_path: Path) -> None:
    run(tmp_path, range(1, 4), total=10)
    rep = LocalProgressReporter(tmp_path, show_bar=False)
    rep.start(10, 2)
    rep.finish({"error": "placement failed"})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_every_attempt_is_recorded_where_metrics_keep_only_the_steps_kept(tmp_path: Path) -> None:
    """A stop after step 5 (checkpointed), an attempt killed after step 8 (no record of its
    end), a resume from the stop's checkpoint that finishes: metrics.jsonl has each step once,
    attempts.jsonl tells the three attempts apart and keeps the stop's own account."""
    stopped = run(tmp_path, range(1, 6), total=10)
    stopped.fail("Preempted: SIGTERM: finished the step in flight; 5 completed steps are in ...")
    run(tmp_path, range(6, 9), total=10, start=5)  # killed: nothing more is written
    last = run(tmp_path, range(6, 11), total=10, start=5)
    last.finish({"steps": 10})
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 11))
    events = [(e["event"], e["step"]) for e in read_attempts(tmp_path)]
    assert events == [
        ("start", 0),
        ("failed", 5),
        ("start", 5),
        ("start", 5),
        ("finished", 10),
    ]
    failed = read_attempts(tmp_path)[1]
    assert failed["error"].startswith("Preempted: ") and failed["time"].endswith("Z"), failed
    assert all(e["totalSteps"] == 10 for e in read_attempts(tmp_path) if e["event"] == "start")


def test_values_are_plain_json_and_elapsed_is_filled_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without an `elapsed_seconds` from the loop, the reporter's own clock since `start` is
    written (a fake monotonic clock: 100.0 at start, 103.25 at the report)."""
    now = [50.0]
    monkeypatch.setattr(progress, "time", SimpleNamespace(monotonic=lambda: now[0]))
    rep = LocalProgressReporter(tmp_path, show_bar=False)
    now[0] = 100.0
    rep.start(2)
    now[0] = 103.25
    rep.report(1, {"reward_mean": torch.tensor(0.5), "kl": float("nan"), "value_loss": 2})
    (rec,) = read_metrics(tmp_path)
    assert rec["reward_mean"] == 0.5 and rec["kl"] is None and rec["value_loss"] == 2
    assert rec["elapsed_seconds"] == 3.25


def test_bar_shows_the_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rep = LocalProgressReporter(tmp_path, show_bar=True, plain=False)
    rep.start(2)
    rep.report(1, metrics(1))
    rep.report(2, metrics(2))
    rep.finish({})
    err = capsys.readouterr().err
    assert "2/2" in err and "reward=0.200" in err and "tok/s=102" in err and "vloss=" in err
    assert "\r" in err  # a redrawn bar


def test_off_a_terminal_progress_is_plain_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """stderr not a terminal (capsys's is not; a log file, a pod's log): one line every
    ceil(total / 20) steps and the last, no carriage-return frames."""
    rep = LocalProgressReporter(tmp_path, show_bar=True)
    rep.start(50)
    for step in range(1, 51):
        rep.report(step, metrics(step))
    rep.finish({})
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert [line.split()[1] for line in lines] == [f"{s}/50" for s in range(3, 51, 3)] + ["50/50"]
    assert "reward=" in lines[-1] and " s " in lines[-1]


def test_composite_forwards_in_order() -> None:
    calls: list[tuple] = []

    class Recorder(ProgressReporter):
        def __init__(self, name: str) -> None:
            self.name = name

        def start(self, total_steps: int, start_step: int = 0) -> None:
            calls.append((self.name, "start", total_steps, start_step))

        def report(self, step: int, metrics: dict[str, float]) -> None:
            calls.append((self.name, "report", step))

        def finish(self, summary: dict) -> None:
            calls.append((self.name, "finish"))

    rep = CompositeReporter([Recorder("a"), Recorder("b"), ProgressReporter()])
    rep.start(3, 1)
    rep.report(2, {})
    rep.finish({})
    assert calls == [
        ("a", "start", 3, 1),
        ("b", "start", 3, 1),
        ("a", "report", 2),
        ("b", "report", 2),
        ("a", "finish"),
        ("b", "finish"),
    ]


def test_namespaced_loop_metrics_fill_the_required_keys(tmp_path: Path) -> None:
    rep = LocalProgressReporter(tmp_path, show_bar=False)
    rep.start(1)
    rep.report(1, {"reward/mean": 0.25, "kl/mean": 0.5, "critic/vf_loss": 3.0, "time/elapsed": 9.0})
    (rec,) = read_metrics(tmp_path)
    assert (rec["reward_mean"], rec["kl"], rec["value_loss"], rec["elapsed_seconds"]) == (
        0.25,
        0.5,
        3.0,
        9.0,
    )
    assert rec["tokens_per_second"] is None
    # one name per value: the loop's namespaced names are not written a second time
    assert not {"reward/mean", "kl/mean", "critic/vf_loss", "time/elapsed"} & set(rec)


def test_every_value_has_one_name_in_metrics_jsonl(tmp_path: Path) -> None:
    """The same number never appears under two names (e.g. `kl` and `kl/mean`)."""
    rep = LocalProgressReporter(tmp_path, show_bar=False)
    rep.start(1)
    loop_metrics = {
        "reward/mean": 0.25,
        "kl/mean": 0.5,
        "critic/vf_loss": 3.0,
        "time/elapsed": 9.0,
        "time/tokens_per_second": 77.0,
        "actor/pg_loss": 0.1,
        "response/length": 8.0,
    }
    rep.report(1, loop_metrics)
    (rec,) = read_metrics(tmp_path)
    names = [k for k in rec if k != "step"]
    assert len(names) == len(loop_metrics) + 0  # five renamed, two kept, none doubled
    assert set(names) == {
        "reward_mean",
        "kl",
        "value_loss",
        "elapsed_seconds",
        "tokens_per_second",
        "actor/pg_loss",
        "response/length",
    }


def test_a_fresh_start_keeps_the_earlier_metrics_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run(tmp_path, range(1, 4), total=3).finish({"final_reward": 0.3})
    with caplog.at_level("WARNING", logger="ppojob_trainer.progress"):
        run(tmp_path, range(1, 2), total=5)  # no checkpoint: starts again at step 1
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    kept = tmp_path / "metrics.jsonl.1"
    assert [json.loads(line)["step"] for line in kept.read_text().splitlines()] == [1, 2, 3]
    assert "kept as metrics.jsonl.1" in caplog.text


def test_a_run_with_nothing_left_does_not_null_the_summary(tmp_path: Path) -> None:
    run(tmp_path, range(1, 3), total=2).finish({"steps": 2, "final_reward": 0.9, "wall_s": 5.0})
    again = LocalProgressReporter(tmp_path, show_bar=False)
    again.start(2, 2)  # resumed at its last step: no step runs
    again.finish({"steps": 2, "final_reward": None, "wall_s": 0.1})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_reward"] == 0.9 and summary["steps"] == 2


def test_the_bar_line_ends_before_a_failure_or_interrupt_is_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rep = LocalProgressReporter(tmp_path, show_bar=True, plain=False)
    rep.start(5)
    rep.report(1, metrics(1))
    capsys.readouterr()
    rep.fail("interrupted")
    err = capsys.readouterr().err
    assert err.endswith("\n"), repr(err)  # what is printed next starts on its own line


def test_the_curve_labels_its_axes_with_units(tmp_path: Path, monkeypatch) -> None:
    """Each panel names its quantity and units; no text of one panel overlaps the other's."""
    from matplotlib.figure import Figure

    labels: list[str] = []
    boxes: list[list] = []
    real = Figure.savefig

    def spy(self, *args, **kwargs):
        out = real(self, *args, **kwargs)  # lays the figure out
        renderer = self.canvas.get_renderer()
        for ax in self.axes:
            labels.extend([ax.get_xlabel(), ax.get_ylabel(), ax.get_title()])
            texts = [ax.yaxis.label, ax.title, ax.xaxis.label]
            boxes.append([t.get_window_extent(renderer) for t in texts if t.get_text()])
        return out

    monkeypatch.setattr(Figure, "savefig", spy)
    run(tmp_path, range(1, 4), total=3).finish({})
    assert "mean reward" in labels and "KL" in labels
    assert "mean reward per step (3 steps; the reward function's units)" in labels
    assert "KL to the reference policy (nats per sequence)" in labels
    assert "training step (one rollout batch each)" in labels
    top, bottom = boxes
    assert not any(a.overlaps(b) for a in top for b in bottom)
