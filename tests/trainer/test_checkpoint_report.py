"""A checkpoint written by the loop tells the reporter which complete checkpoints are kept
(oldest first, the pruned ones gone), so the PPOJob status can list them."""

from __future__ import annotations

from pathlib import Path

from ppojob_trainer.driver.run import save
from ppojob_trainer.progress import ProgressReporter


class _Trainer:
    def save_workers(self, path: Path) -> None:
        (Path(path) / "actor").mkdir(parents=True, exist_ok=True)

    def state(self, step: int) -> dict:
        return {"driver": {"step": step}}


class _Recorder(ProgressReporter):
    def __init__(self) -> None:
        self.seen: list[list[tuple[int, str]]] = []

    def checkpointed(self, checkpoints: list[tuple[int, str]]) -> None:
        self.seen.append(checkpoints)


def test_each_save_reports_the_kept_checkpoints(tmp_path: Path) -> None:
    rec = _Recorder()
    for step in (2, 4, 6):
        save(_Trainer(), tmp_path, step, 2, rec)
    assert rec.seen[0] == [(2, str(tmp_path / "step-000002"))]
    assert rec.seen[-1] == [(4, str(tmp_path / "step-000004")), (6, str(tmp_path / "step-000006"))]
    assert save(_Trainer(), tmp_path, 8, 2, object()) == str(tmp_path / "step-000008")
