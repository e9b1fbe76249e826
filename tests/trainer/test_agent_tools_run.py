"""Tools through the chat template (``data.agent.tools``) in a real training loop (issue 43): a
``ppojob run`` of 2 steps whose model is a local directory (tests/helpers/chat_tools.py: a tiny
Llama trained for a few seconds to write ``calc`` calls with arguments of its own, and a local
character tokenizer whose chat template declares the tools), on the built-in calculator task.

The tool is ``builtin:calculate``'s function plus a log line per call (written by the tool
process; ``$PPOJOB_TEST_TOOL_LOG`` is set before Ray starts, so the workers inherit it). What is
checked: the calls the model wrote were parsed and run with the model's own arguments (the log
holds the expressions the model sampled, and their count is the step's calls less its tool
errors), the environment's tokens stay out of the loss (the engine's and the actor's log-probs
agree on the trained tokens; an observation's rollout log-probs are 0, so training on them would
not), and the job finishes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers.chat_tools import CALC_TOOL, TOOL_LOG_ENV, tool_calling_model

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ppojob-tiny-calculator.yaml"
SAMPLES = 16  # per step: 4 prompts x 4 samples


@pytest.fixture(scope="module")
def tool_log(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("tools") / "calls.jsonl"
    mp = pytest.MonkeyPatch()
    mp.setenv(TOOL_LOG_ENV, str(path))
    try:
        yield path
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def session(tool_log: Path, ray_session: None) -> Path:
    """The log's variable first, then Ray (whose workers inherit the environment)."""
    return tool_log


def _manifest(tmp: Path, model: Path) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    data = doc["spec"]["data"]
    data["agent"] = {
        "tools": [{**CALC_TOOL, "function": "tests.helpers.chat_tools:calculate_logged"}],
        "maxTurns": 2,
        "maxToolResponseTokens": 8,
        "toolTimeoutSeconds": 5,
    }
    data.update(
        rolloutBatchSize=4,
        samplesPerPrompt=4,
        maxPromptLength=64,
        maxResponseLength=48,
    )
    doc["spec"]["model"]["path"] = str(model)
    doc["spec"]["training"]["miniBatchSize"] = SAMPLES
    path = tmp / "tools.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_tools_run_calls_the_tool_with_the_models_arguments(
    session: Path, tmp_path: Path, capsys: Any
) -> None:
    from ppojob_cli.main import main as ppojob
    from ppojob_trainer.agent import calculate
    from ppojob_trainer.progress import read_metrics

    model = tool_calling_model(tmp_path / "model")
    out = tmp_path / "run"
    args = ["run", str(_manifest(tmp_path, model)), "--steps", "2", "--out", str(out)]
    rc = ppojob([*args, "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    calls = [json.loads(line) for line in session.read_text().splitlines()]
    # the tool answered each call the steps counted as answered (calls less errors: refused
    # ones, which never reach the tool, and ones the tool raised on, logged as such)
    answered = [c for c in calls if not c["result"].startswith("ValueError")]
    ran = sum((r["agent/env_calls_mean"] - r["agent/tool_errors_mean"]) * SAMPLES for r in records)
    assert len(answered) == pytest.approx(ran) and len(answered) >= SAMPLES // 2, (calls, records)
    # with the model's arguments: the expressions it sampled (operands of its own, not the
    # prompt's), each answered with its own value
    assert len({c["expression"] for c in answered}) >= 4, calls
    for c in answered:
        assert c["result"] == str(calculate(c["expression"]))
    for r in records:
        assert r["agent/turns_mean"] > 1.0  # a second turn after the tool's reply
        assert 0.0 <= r["reward_mean"] <= 1.0
        # the environment's tokens are not trained: the engine's and the actor's log-probs
        # agree on the trained tokens (the observations' rollout log-probs are 0)
        assert r["rollout/logprob_diff_mean"] < 1e-4, r
