"""Reward sources (`data.rewards`): the weighted sum, the reward model, the HTTP endpoint and
their one-line errors. The reward model is a tiny random Llama with a one-output head, built in
a temporary directory with the built-in character tokenizer (nothing downloaded); the endpoint
is a server on 127.0.0.1 in a thread."""

from __future__ import annotations

import json
import math
import socket
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from ppojob_api import memory_plan as M
from ppojob_api.training import DataSpec, HttpRewardSource, RewardModelSource
from ppojob_trainer.rewards import (
    HttpRewardScorer,
    RemoteRewardModelScorer,
    RewardModelScorer,
    make_reward,
    reward_parts,
    shown_url,
)
from ppojob_trainer.tasks import count_up_reward


def build_reward_model(directory: Path, seed: int = 0, num_labels: int = 1) -> Path:
    """A tiny randomly initialised LlamaForSequenceClassification and the built-in tokenizer."""
    from transformers import AutoModelForSequenceClassification

    from ppojob_trainer.models import build_char_tokenizer, builtin_config, save_pretrained_here

    config = builtin_config("tiny-llama")
    config.num_labels = num_labels
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    # a random head scores near 0: scale it so that scores differ clearly between texts
    with torch.no_grad():
        model.score.weight.mul_(50.0)
    save_pretrained_here(model, directory)
    build_char_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_reward_model(tmp_path_factory.mktemp("rm"))


@pytest.fixture
def reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "rw_mod.py").write_text(
        textwrap.dedent("""
        def length(prompts, completions, labels):
            return [float(len(c)) for c in completions]
        def boom(prompts, completions, labels):
            raise KeyError("label")
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "rw_mod"
    sys.modules.pop("rw_mod", None)


PROMPTS = ["1", "2", "7", "4", "5"]
COMPLETIONS = ["23456789", "3", "89012345", "56", ""]
LABELS: list[Any] = [None] * 5


# ---------------------------------------------------------------------------------------------
# the weighted sum
# ---------------------------------------------------------------------------------------------
def test_the_reward_is_the_weighted_sum_of_the_sources(reward_module: str) -> None:
    data = DataSpec.model_validate(
        {
            "rewards": [
                {"function": "builtin:count-up", "weight": 2.0},
                {"function": f"{reward_module}:length", "weight": -0.5, "name": "len"},
            ]
        }
    )
    reward = make_reward(data, data.prompts)
    total, parts = reward.score(PROMPTS, COMPLETIONS, LABELS)
    count_up = count_up_reward(PROMPTS, COMPLETIONS, LABELS)
    lengths = [float(len(c)) for c in COMPLETIONS]
    assert parts == {"count-up": count_up, "len": lengths}
    expected = [2.0 * a - 0.5 * b for a, b in zip(count_up, lengths, strict=True)]
    assert total == pytest.approx(expected)
    assert reward.report_sources and reward(PROMPTS, COMPLETIONS, LABELS) == total


def test_reward_function_is_the_shorthand_of_one_source(reward_module: str) -> None:
    """rewardFunction alone, or nothing (the built-in task's reward): one source of weight 1,
    and no per-source metrics (the step's metrics stay as they were)."""
    for data in (
        DataSpec.model_validate({"rewardFunction": f"{reward_module}:length"}),
        DataSpec.model_validate({"prompts": "builtin:count-up"}),
    ):
        reward = make_reward(data, data.prompts)
        total, _ = reward.score(PROMPTS, COMPLETIONS, LABELS)
        expected = (
            [float(len(c)) for c in COMPLETIONS]
            if data.reward_function
            else count_up_reward(PROMPTS, COMPLETIONS, LABELS)
        )
        assert total == expected and not reward.report_sources


def test_a_failing_function_source_names_its_field(reward_module: str) -> None:
    data = DataSpec.model_validate(
        {"rewards": [{"function": "builtin:count-up"}, {"function": f"{reward_module}:boom"}]}
    )
    with pytest.raises(ValueError) as info:
        make_reward(data, data.prompts).score(PROMPTS, COMPLETIONS, LABELS)
    assert str(info.value).startswith("data.rewards[1].function: rw_mod:boom raised KeyError")


def test_rewards_beside_reward_function_is_refused_by_the_trainer_too() -> None:
    data = DataSpec.model_validate(
        {"rewardFunction": "builtin:count-up", "rewards": [{"function": "builtin:count-up"}]}
    )
    with pytest.raises(ValueError, match=r"^data.rewards: rewards and rewardFunction are both"):
        make_reward(data, data.prompts)


# ---------------------------------------------------------------------------------------------
# the reward model
# ---------------------------------------------------------------------------------------------
def _one_by_one(directory: Path, texts: list[str]) -> list[float]:
    """The reward model's score of each text alone (no padding), straight from transformers."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    model = AutoModelForSequenceClassification.from_pretrained(str(directory)).eval()
    with torch.no_grad():
        return [float(model(**tok(t, return_tensors="pt")).logits[0, 0]) for t in texts]


def test_the_reward_model_scores_prompt_and_completion_in_batches(reward_model: Path) -> None:
    """Batches of 2 over 5 texts of different lengths (padded) give each text's own score."""
    scorer = RewardModelScorer(
        RewardModelSource(path=str(reward_model), batch_size=2),
        "data.rewards[0].model",
        "cpu",
        "float32",
    )
    got = scorer(PROMPTS, COMPLETIONS, LABELS)
    want = _one_by_one(reward_model, [p + c for p, c in zip(PROMPTS, COMPLETIONS, strict=True)])
    assert got == pytest.approx(want, abs=1e-5)
    assert max(want) - min(want) > 1e-2  # the texts score differently: the check has teeth


def test_a_text_longer_than_max_length_loses_its_beginning(reward_model: Path) -> None:
    """maxLength 4: the BOS and the last 3 characters are what the model reads."""
    scorer = RewardModelScorer(
        RewardModelSource(path=str(reward_model), max_length=4), "f", "cpu", "float32"
    )
    got = scorer(["1"], ["23456789"], [None])
    assert got == pytest.approx(_one_by_one(reward_model, ["789"]), abs=1e-5)


def test_device_cpu_keeps_the_reward_model_off_the_engine_device(reward_model: Path) -> None:
    spec = RewardModelSource(path=str(reward_model), device="cpu")
    scorer = RewardModelScorer(spec, "f", "meta", "float32")  # the engine's device: elsewhere
    assert scorer.device == "cpu"
    assert all(math.isfinite(v) for v in scorer(PROMPTS, COMPLETIONS, LABELS))


def test_the_reward_model_dtype_defaults_to_the_model_dtype(reward_model: Path) -> None:
    scorer = RewardModelScorer(RewardModelSource(path=str(reward_model)), "f", "cpu", "bfloat16")
    assert scorer.model.dtype == torch.bfloat16
    spec = RewardModelSource(path=str(reward_model), dtype="float32")
    assert RewardModelScorer(spec, "f", "cpu", "bfloat16").model.dtype == torch.float32


def test_what_is_not_a_reward_model_gets_one_line_naming_the_field(
    tmp_path: Path, reward_model: Path
) -> None:
    from ppojob_trainer.models import materialize_builtin

    two = build_reward_model(tmp_path / "two", num_labels=2)
    empty = tmp_path / "empty"
    empty.mkdir()
    causal = materialize_builtin("tiny-llama", 0, tmp_path / "cache")
    cases = [
        (tmp_path / "missing", "is not a directory here"),
        (empty, "holds no config.json"),
        (causal, "is not a sequence-classification model (architectures: ['LlamaForCausalLM'])"),
        (two, "has 2 outputs (num_labels)"),
    ]
    for path, why in cases:
        with pytest.raises(ValueError) as info:
            RewardModelScorer(
                RewardModelSource(path=str(path)), "data.rewards[1].model", "cpu", "float32"
            )
        msg = str(info.value)
        assert msg.startswith(f"data.rewards[1].model.path: {str(path)!r}") and "\n" not in msg
        assert why in msg, msg


def test_the_memory_plan_counts_a_reward_model_on_the_engine_gpu(reward_model: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    from ppojob_api.training import TrainerConfig
    from ppojob_trainer.models import count_parameters

    def plan(**rm: Any) -> M.ProcessPlan:
        cfg = TrainerConfig.model_validate(
            {
                "roles": {"rollout": {"resources": {"gpus": 1}}},
                "data": {"rewards": [{"model": {"path": str(reward_model), **rm}, "name": "rm"}]},
            }
        )
        return next(p for p in M.plan_job(cfg) if p.name == "rollout")

    params = count_parameters(AutoModelForSequenceClassification.from_pretrained(str(reward_model)))
    on_gpu = plan(dtype="bfloat16")
    assert on_gpu.persistent["reward model rm weights"] == 2 * params
    assert on_gpu.phases["reward scoring"]["reward model rm scoring"] > 0
    off = plan(device="cpu")
    assert "reward model rm weights" not in off.persistent and "reward scoring" not in off.phases


def test_with_reward_workers_the_memory_plan_moves_the_reward_model_off_the_engine(
    reward_model: Path,
) -> None:
    """roles.reward: the engine's GPU holds no reward model; each reward worker's GPU (a
    `reward` process of the plan) holds it instead."""
    from ppojob_api.training import TrainerConfig

    cfg = TrainerConfig.model_validate(
        {
            "roles": {"rollout": {"resources": {"gpus": 1}}, "reward": {"resources": {"gpus": 1}}},
            "data": {"rewards": [{"model": {"path": str(reward_model)}, "name": "rm"}]},
        }
    )
    plans = {p.name: p for p in M.plan_job(cfg)}
    assert "reward model rm weights" not in plans["rollout"].persistent
    assert "reward scoring" not in plans["rollout"].phases
    assert plans["reward"].persistent["reward model rm weights"] > 0
    assert plans["reward"].phases["reward scoring"]["reward model rm scoring"] > 0


@pytest.mark.parametrize(
    ("n", "workers", "first", "parts"),
    [
        (32, 2, 0, [(0, 0, 16), (1, 16, 32)]),
        (10, 3, 0, [(0, 0, 4), (1, 4, 7), (2, 7, 10)]),
        (10, 3, 4, [(1, 0, 4), (2, 4, 7), (0, 7, 10)]),  # engine 4 starts at worker 1
        (2, 4, 3, [(3, 0, 1), (0, 1, 2)]),  # fewer samples than workers: no empty call
        (0, 2, 0, []),
    ],
)
def test_an_engines_samples_are_split_into_one_contiguous_part_per_reward_worker(
    n: int, workers: int, first: int, parts: list[tuple[int, int, int]]
) -> None:
    assert reward_parts(n, workers, first) == parts


class _FakeWorker:
    """A reward worker's ``score`` as the engine calls it (``.remote`` returning the answer)."""

    def __init__(self, seen: list[tuple[int, int, list[str]]], k: int) -> None:
        self.score = self
        self.seen, self.k = seen, k

    def remote(self, source: int, prompts: list[str], completions: list[str]) -> list[float]:
        self.seen.append((self.k, source, completions))
        return [float(len(p + c)) for p, c in zip(prompts, completions, strict=True)]


def test_a_remote_reward_model_source_sends_each_part_to_its_worker_and_joins_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray

    monkeypatch.setattr(ray, "get", lambda refs: list(refs))
    seen: list[tuple[int, int, list[str]]] = []
    scorer = RemoteRewardModelScorer(
        [_FakeWorker(seen, 0), _FakeWorker(seen, 1)], 3, "data.rewards[3].model", first=1
    )
    out = scorer(PROMPTS, COMPLETIONS, [None] * 5)
    assert out == [float(len(p + c)) for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    assert seen == [(1, 3, COMPLETIONS[:3]), (0, 3, COMPLETIONS[3:])]
    assert scorer.last_remote == 5


# ---------------------------------------------------------------------------------------------
# the HTTP endpoint
# ---------------------------------------------------------------------------------------------
class Endpoint:
    """A reward endpoint on 127.0.0.1: answers from a script of ``(status, body)`` (the last one
    repeats), records every request; ``hold`` makes it wait for ``release`` before answering."""

    def __init__(self) -> None:
        self.script: list[tuple[int, bytes]] = [(200, b"{}")]
        self.requests: list[dict[str, Any]] = []
        self.hold = False
        self.release = threading.Event()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                endpoint.requests.append({"body": json.loads(body), "headers": dict(self.headers)})
                if endpoint.hold:
                    endpoint.release.wait(30)
                    return
                status, answer = endpoint.script[
                    min(len(endpoint.requests), len(endpoint.script)) - 1
                ]
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    e = Endpoint()
    try:
        yield e
    finally:
        e.close()


def _scorer(
    url: str, sleeps: list[float] | None = None, env: dict[str, str] | None = None, **kw: Any
) -> HttpRewardScorer:
    spec = HttpRewardSource(url=url, **kw)
    record: Callable[[float], None] = sleeps.append if sleeps is not None else lambda s: None
    return HttpRewardScorer(spec, "data.rewards[1].http", env=env or {}, sleep=record)


def _rewards(values: list[Any]) -> bytes:
    return json.dumps({"rewards": values}).encode()


def test_the_endpoint_gets_prompts_completions_labels_and_a_bearer_token(
    endpoint: Endpoint,
) -> None:
    endpoint.script = [(200, _rewards([0.5, 1, -2]))]
    labels = ["a", {"x": 1}, object()]  # a label JSON cannot hold goes as a string
    scorer = _scorer(endpoint.url, env={"RM_TOKEN": "s3cret"}, token_env="RM_TOKEN")
    assert scorer(["p1", "p2", "p3"], ["c1", "c2", "c3"], labels) == [0.5, 1.0, -2.0]
    (req,) = endpoint.requests
    body = req["body"]
    assert body["prompts"] == ["p1", "p2", "p3"] and body["completions"] == ["c1", "c2", "c3"]
    assert body["labels"][:2] == ["a", {"x": 1}] and isinstance(body["labels"][2], str)
    assert req["headers"]["Authorization"] == "Bearer s3cret"
    assert req["headers"]["Content-Type"] == "application/json"


def test_batch_size_splits_the_samples_into_requests_in_order(endpoint: Endpoint) -> None:
    endpoint.script = [(200, _rewards([1, 2])), (200, _rewards([3, 4])), (200, _rewards([5]))]
    scorer = _scorer(endpoint.url, batch_size=2)
    assert scorer(list("abcde"), list("vwxyz"), [None] * 5) == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [r["body"]["prompts"] for r in endpoint.requests] == [["a", "b"], ["c", "d"], ["e"]]


def test_a_busy_endpoint_is_retried_with_doubling_backoff(endpoint: Endpoint) -> None:
    endpoint.script = [(503, b"busy"), (429, b"slow down"), (200, _rewards([7]))]
    sleeps: list[float] = []
    scorer = _scorer(endpoint.url, sleeps, retries=2, backoff_seconds=0.25)
    assert scorer(["p"], ["c"], [None]) == [7.0]
    assert len(endpoint.requests) == 3 and sleeps == [0.25, 0.5]


@pytest.mark.parametrize(
    ("script", "why", "attempts"),
    [
        ([(503, b"down")], "failed 3 time(s), last: answered HTTP 503", 3),
        ([(400, b"bad field 'prompts'")], "answered HTTP 400 Bad Request: bad field 'prompts'", 1),
        ([(200, b"<html>oops</html>")], "answered with invalid JSON", 1),
        ([(200, b'{"scores": [1]}')], "answered without a list under 'rewards'", 1),
        ([(200, _rewards([1, 2]))], "answered 2 rewards for 1 samples", 1),
        ([(200, b'{"rewards": [NaN]}')], "answered rewards[0] = nan, not a finite number", 1),
        ([(200, _rewards([None]))], "answered rewards[0] = None, not a finite number", 1),
        ([(200, _rewards(["1"]))], "answered rewards[0] = '1', not a finite number", 1),
    ],
)
def test_endpoint_failures_are_one_line_naming_the_url(
    endpoint: Endpoint, script: list[tuple[int, bytes]], why: str, attempts: int
) -> None:
    endpoint.script = script
    with pytest.raises(ValueError) as info:
        _scorer(endpoint.url, retries=2, backoff_seconds=0)(["p"], ["c"], [None])
    msg = str(info.value)
    assert msg.startswith(f"data.rewards[1].http.url: POST {endpoint.url} ") and "\n" not in msg
    assert why in msg, msg
    assert len(endpoint.requests) == attempts


def test_an_endpoint_that_is_down_is_retried_then_named() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/score"
    sleeps: list[float] = []
    with pytest.raises(ValueError) as info:
        _scorer(url, sleeps, retries=1, backoff_seconds=0.1)(["p"], ["c"], [None])
    msg = str(info.value)
    assert msg.startswith(
        f"data.rewards[1].http.url: POST {url} failed 2 time(s), last: cannot connect"
    )
    assert "reachable from the rollout role's pods" in msg and sleeps == [0.1]


def test_an_endpoint_that_does_not_answer_times_out(endpoint: Endpoint) -> None:
    endpoint.hold = True  # answers only when released (at teardown)
    with pytest.raises(ValueError) as info:
        _scorer(endpoint.url, retries=1, backoff_seconds=0, timeout_seconds=0.3)(
            ["p"], ["c"], [None]
        )
    assert "last: no answer within timeoutSeconds (0.3 s)" in str(info.value)
    assert len(endpoint.requests) == 2


def test_a_missing_token_variable_is_named_at_start() -> None:
    with pytest.raises(ValueError) as info:
        _scorer("http://127.0.0.1:1/score", env={}, token_env="RM_TOKEN")
    msg = str(info.value)
    assert msg.startswith("data.rewards[1].http.tokenEnv: the environment variable RM_TOKEN")
    assert "spec.podTemplate.env" in msg and "secretKeyRef" in msg


def test_a_model_and_an_http_source_combine(endpoint: Endpoint, reward_model: Path) -> None:
    """make_reward builds each kind from the spec, in order, with its default name."""
    endpoint.script = [(200, _rewards([1.0] * 5))]
    data = DataSpec.model_validate(
        {
            "rewards": [
                {"model": {"path": str(reward_model)}, "weight": 0.5},
                {"http": {"url": endpoint.url}, "weight": 3},
            ]
        }
    )
    total, parts = make_reward(data, data.prompts).score(PROMPTS, COMPLETIONS, LABELS)
    assert list(parts) == ["model", "http"] and parts["http"] == [1.0] * 5
    assert total == pytest.approx([0.5 * m + 3.0 for m in parts["model"]])


def test_preflight_names_a_missing_reward_model_and_an_unloadable_function(
    tmp_path: Path, reward_model: Path
) -> None:
    """`ppojob run` finds both before it starts Ray."""
    from ppojob_api.training import TrainerConfig
    from ppojob_trainer.preflight import preflight

    def problems(*sources: dict[str, Any]) -> list[str]:
        return preflight(TrainerConfig.model_validate({"data": {"rewards": list(sources)}}))

    assert problems({"function": "builtin:count-up"}, {"model": {"path": str(reward_model)}}) == []
    missing = str(tmp_path / "no-rm")
    found = problems({"function": "no_such_mod_rw:score"}, {"model": {"path": missing}})
    assert found == [
        f"data.rewards[1].model.path: reward model directory {missing!r} does not exist",
        found[1],
    ]
    assert found[1].startswith("data.rewards[0].function: 'no_such_mod_rw:score'")


def test_each_source_mean_is_over_every_engine_sample() -> None:
    """The step's reward/<name>_mean sums the sources' sums of all engines and divides by all
    samples, as reward/mean does."""
    from ppojob_trainer.driver.metrics import step_metrics

    def gen(n: float, total: float, model: float) -> dict[str, Any]:
        sums = {"reward_sum": total, "reward_sum/model": model, "length_sum": n}
        return {"metrics": {"n": n, "time/generate": 1.0, **sums}}

    prep = [(None, {"time/prepare": 1.0, "tokens": 1.0, "adv_abs_sum": 0.0})]
    prep[0][1].update({"logprob_diff_sum": 0.0, "logprob_diff_max": 0.0})
    out = step_metrics([gen(4, 2.0, 8.0), gen(12, 6.0, -4.0)], prep, [], [], [])
    assert out["reward/mean"] == 0.5 and out["reward/model_mean"] == 0.25


def test_a_cut_off_answer_is_retried_then_named() -> None:
    """An endpoint that closes the connection mid-answer (a status line and nothing else)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/score"

        def serve() -> None:
            for _ in range(2):
                conn, _ = listener.accept()
                with conn:
                    # the whole request first: closing with unread bytes would send a reset,
                    # not the cut-off answer this test is about
                    data = b""
                    while b"\r\n\r\n" not in data:
                        data += conn.recv(65536)
                    head, body = data.split(b"\r\n\r\n", 1)
                    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                    while len(body) < length:
                        body += conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{")

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        with pytest.raises(ValueError) as info:
            _scorer(url, retries=1, backoff_seconds=0)(["p"], ["c"], [None])
        thread.join(10)
    msg = str(info.value)
    assert "failed 2 time(s), last: broken answer (IncompleteRead" in msg and "\n" not in msg


def test_a_failure_names_the_url_without_its_query_values(endpoint: Endpoint) -> None:
    """A token in the query string (``?key=...``) is not repeated in the one-line error (nor
    would ``user:password@`` be: validation refuses it, :func:`shown_url` drops it)."""
    url = endpoint.url + "?key=abc123&dry"
    endpoint.script = [(400, b"no")]
    with pytest.raises(ValueError) as info:
        _scorer(url, retries=0)(["p"], ["c"], [None])
    msg = str(info.value)
    assert msg.startswith(f"data.rewards[1].http.url: POST {endpoint.url}?key=***&dry answered")
    assert "abc123" not in msg
    assert endpoint.requests  # (the request itself went to the URL as written)


def test_an_answer_trickled_past_the_timeout_is_cut_off() -> None:
    """The endpoint answers its headers at once, then one byte of its body every 20 ms (each
    read is quick, the whole answer would take 20 s): the attempt ends at timeoutSeconds."""
    body = _rewards([1]).ljust(1000)
    stop = threading.Event()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/score"

        def serve() -> None:
            conn, _ = listener.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                try:
                    conn.sendall(head)
                    for i in range(len(body)):
                        if stop.wait(0.02):
                            return
                        conn.sendall(body[i : i + 1])
                except OSError:  # the client hung up: what this test wants
                    return

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            with pytest.raises(ValueError) as info:
                _scorer(url, retries=0, timeout_seconds=0.5)(["p"], ["c"], [None])
        finally:
            stop.set()
            thread.join(10)
    assert "failed 1 time(s), last: no answer within timeoutSeconds (0.5 s)" in str(info.value)


def test_shown_url_drops_credentials() -> None:
    assert shown_url("https://u:p@h.example:8443/a/b?t=1&x") == "https://h.example:8443/a/b?t=***&x"
    assert shown_url("http://h/score") == "http://h/score"
