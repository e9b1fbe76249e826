"""`ppojob run`'s closing summary: where the run ended (the last 50 steps' mean reward, not one
noisy step) and where its reward curve, metrics and summary are."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from ppojob_trainer.run_cmd import closing_reward, format_summary


def _write_metrics(out: Path, rewards: list[float]) -> None:
    lines = [json.dumps({"step": i + 1, "reward_mean": r}) for i, r in enumerate(rewards)]
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_closing_reward_is_the_mean_of_the_last_50_steps(tmp_path: Path) -> None:
    _write_metrics(tmp_path, [0.0] * 100 + [1.0] * 40 + [0.5] * 10)
    n, mean = closing_reward(tmp_path)
    assert n == 50 and mean == (40 * 1.0 + 10 * 0.5) / 50
    _write_metrics(tmp_path, [0.25, 0.75])  # a shorter run: all its steps
    assert closing_reward(tmp_path) == (2, 0.5)
    assert closing_reward(tmp_path / "nowhere") is None


def test_summary_names_the_curve_metrics_and_closing_reward(tmp_path: Path) -> None:
    _write_metrics(tmp_path, [0.5] * 60)
    (tmp_path / "reward_curve.png").write_bytes(b"\x89PNG")
    cfg = SimpleNamespace(job_name="tiny", training=SimpleNamespace(steps=60))
    result = SimpleNamespace(steps_completed=60, final_reward=0.8125, checkpoint=None)
    text = format_summary(cfg, result, tmp_path, 12.0)
    assert "final reward:  0.8125" in text
    assert "last 50 steps: mean reward 0.5000" in text
    assert f"reward curve:  {tmp_path / 'reward_curve.png'}" in text
    assert f"metrics:       {tmp_path / 'metrics.jsonl'}" in text
    assert "summary:" not in text  # no summary.json written: not claimed
