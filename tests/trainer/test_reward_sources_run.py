"""`ppojob run` with reward sources, end to end on a local Ray (2 short steps each): a tiny
reward model combined with the built-in count-up function, and an HTTP endpoint on 127.0.0.1.
Each step's reward is the weighted sum of its sources, each source's mean is in the metrics; a
reward model on reward workers of its own (``roles.reward``) scores as in the engine."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from ppojob_cli.main import main as ppojob
from ppojob_trainer.progress import read_metrics
from ppojob_trainer.tasks import count_up_answer
from tests.trainer.test_rewards import build_reward_model

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "ppojob-tiny.yaml"
SMALL = ["--set", "data.rolloutBatchSize=4", "--set", "training.miniBatchSize=32"]

pytestmark = pytest.mark.usefixtures("ray_session")


def _run(out: Path, rewards: str, extra: tuple[str, ...] | list[str] = ()) -> list[dict[str, Any]]:
    argv = ["run", str(TINY), "--steps", "2", "--out", str(out), "--no-progress", *SMALL, *extra]
    rc = ppojob([*argv, "--set", f"data.rewards={rewards}"])
    assert rc == 0
    return read_metrics(out)


def test_a_reward_model_and_a_function_combined(tmp_path: Path) -> None:
    rm = build_reward_model(tmp_path / "rm")
    sources = f"[{{function: 'builtin:count-up'}}, {{model: {{path: '{rm}'}}, weight: 0.5}}]"
    records = _run(tmp_path / "out", sources)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        count_up, model = r["reward/count-up_mean"], r["reward/model_mean"]
        assert 0.0 <= count_up <= 1.0 and model != 0.0
        assert r["reward_mean"] == pytest.approx(count_up + 0.5 * model, abs=1e-5)


class _Judge(BaseHTTPRequestHandler):
    """Rewards a completion by its share of the digit 5; records what it was sent."""

    seen: list[dict[str, Any]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        rewards = [c.count("5") / 8 for c in body["completions"]]
        type(self).seen.append({**body, "rewards": rewards})
        answer = json.dumps({"rewards": rewards}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def judge() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    _Judge.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/judge", _Judge.seen
    finally:
        server.shutdown()
        server.server_close()


def test_an_http_reward_endpoint(tmp_path: Path, judge: tuple[str, list[dict[str, Any]]]) -> None:
    url, seen = judge
    records = _run(tmp_path / "out", f"[{{http: {{url: '{url}', timeoutSeconds: 10}}, weight: 2}}]")
    # one engine, one request per step, all of its 4 x 8 samples (the prompts: count-up digits)
    assert len(seen) == 2 and all(len(s["prompts"]) == 32 for s in seen)
    for s in seen:  # the labels are each prompt's reference answer
        assert s["labels"] == [count_up_answer(p) for p in s["prompts"]]
    for r, s in zip(records, seen, strict=True):
        mean = sum(s["rewards"]) / 32
        assert r["reward/http_mean"] == pytest.approx(mean)
        assert r["reward_mean"] == pytest.approx(2 * mean)


def test_a_generative_judge_on_the_policys_engine(tmp_path: Path) -> None:
    """``judge: {model: policy}``: the policy's own engine writes a verdict after the prompt and
    the response (the built-in models spell digits only); its first digit is the score."""
    judge = (
        "{judge: {model: policy, template: '{prompt}{response}', scorePattern: '(\\d)', "
        "maxScore: 9, maxNewTokens: 2}, weight: 0.1}"
    )
    records = _run(tmp_path / "out", f"[{{function: 'builtin:count-up'}}, {judge}]")
    assert [r["step"] for r in records] == [1, 2]
    n = 4 * 8  # rolloutBatchSize x samplesPerPrompt
    for r in records:
        count_up, verdict = r["reward/count-up_mean"], r["reward/judge_mean"]
        # the seeded policy writes digits (here 6 and 17 of the 32 verdicts have none): the
        # parsed ones' scores reach the reward, the unparsed ones score the default 0. A judge
        # that parses nothing, or ignores what it parsed, scores 0.
        parsed = n - r["reward/judge_unparsed"]
        assert parsed > 0, r
        assert 0.5 <= verdict <= 9.0 * parsed / n, r
        assert r["reward_mean"] == pytest.approx(count_up + 0.1 * verdict, abs=1e-5)


def test_a_reward_model_on_reward_workers_scores_as_in_the_engines(tmp_path: Path) -> None:
    """``roles.reward``: the reward model runs on two reward workers of their own, the engine
    sends them its samples' texts, and each step's scores are those of the same model loaded
    in the engine's process (the colocated path): same seed, same samples, same rewards."""
    rm = build_reward_model(tmp_path / "rm")
    sources = f"[{{model: {{path: '{rm}', batchSize: 5}}}}]"
    here = _run(tmp_path / "colocated", sources)
    workers = ["--set", "roles.reward={replicas: 2, resources: {cpus: 0.5, memory: 1Gi}}"]
    remote = _run(tmp_path / "remote", sources, workers)
    assert [r["step"] for r in remote] == [1, 2]
    for a, b in zip(here, remote, strict=True):
        assert "reward/model_remote" not in a  # the engine scored them itself
        assert b["reward/model_remote"] == 32  # every sample of the step, on the workers
        assert b["reward/model_mean"] != 0.0
        assert b["reward/model_mean"] == pytest.approx(a["reward/model_mean"], rel=1e-5)
        assert b["reward_mean"] == pytest.approx(a["reward_mean"], rel=1e-5)
