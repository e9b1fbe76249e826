"""`ppojob run` with the algorithm pack (issue 25) on the tiny built-in model: a couple of steps
each, the settings reaching the loop and its metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppojob_cli.main import main as ppojob
from ppojob_trainer.progress import read_metrics

TINY = Path(__file__).resolve().parents[2] / "examples" / "ppojob-tiny.yaml"
SMALL = [
    "--set", "algorithm.advantageEstimator=grpo",
    "--set", "data.rolloutBatchSize=4",
    "--set", "data.samplesPerPrompt=4",
    "--set", "training.miniBatchSize=8",
]  # fmt: off

pytestmark = pytest.mark.usefixtures("ray_session")


def _run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *sets: str) -> list[dict]:
    out = tmp_path / "run"
    args = ["run", str(TINY), "--steps", "2", "--out", str(out), "--no-progress", *SMALL]
    for s in sets:
        args += ["--set", s]
    rc = ppojob(args)
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    return records


@pytest.mark.slow
def test_gspo_with_dynamic_sampling_and_overlong_shaping_runs(tmp_path, capsys) -> None:
    records = _run(
        tmp_path,
        capsys,
        "algorithm.policyLoss=gspo",
        "algorithm.clipRangeLow=3e-4",
        "algorithm.clipRangeHigh=4e-4",
        "algorithm.lossAggregation=seq-mean-token-mean",
        "algorithm.dynamicSampling={maxRounds: 3}",
        "algorithm.overlongShaping={bufferLength: 4}",
    )
    for r in records:
        rounds, short = r["dynamic_sampling/generation_rounds"], r["dynamic_sampling/short_groups"]
        assert 1 <= rounds <= 3
        assert r["dynamic_sampling/kept_groups"] + short == 4
        assert short == 0 or rounds == 3  # refilled until full, or until the cap
    # (seed 1: the untrained model's groups often score all 0; both steps needed a 2nd round
    # and stopped there, full)
    assert [r["dynamic_sampling/generation_rounds"] for r in records] == [2, 2]
    assert all(r["dynamic_sampling/filtered_groups"] > 0 for r in records)
    for r in records:
        # the untrained model's responses often run past 4 tokens, into the buffer (4, 8]
        assert r["reward/overlong_penalty_mean"] < 0
        assert "actor/seq_ratio_mean" in r


@pytest.mark.slow
def test_masking_truncated_samples_and_a_step_dynamic_sampling_cannot_fill_run(
    tmp_path, capsys
) -> None:
    """One round only: the step trains on its groups with differing rewards, the rest filled
    with filtered groups left out of the loss, like the truncated samples."""
    records = _run(
        tmp_path,
        capsys,
        "algorithm.maskTruncatedSamples=true",
        "algorithm.dynamicSampling={maxRounds: 1}",
    )
    # (seed 1: 4 of the first step's 64 responses are cut at maxResponseLength)
    assert records[0]["response/truncated_share"] > 0
    assert all(0 <= r["response/truncated_share"] <= 1 for r in records)
    for r in records:
        assert r["dynamic_sampling/generation_rounds"] == 1
        assert r["dynamic_sampling/short_groups"] == r["dynamic_sampling/filtered_groups"] > 0
