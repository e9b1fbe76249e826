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
SAME = (
    "reward_mean",
    "agent/turns_mean",
    "agent/env_calls_mean",
    "agent/tool_errors_mean",
    "agent/env/calls_mean",  # the replies' metrics cross the sandbox boundary too
)

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


CALC_TOOL = {
    "name": "calc",
    "description": "The value of an integer expression",
    "parameters": {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    },
    "function": "builtin:calculate",
}


def test_an_engines_calls_are_split_over_the_sandbox_workers_and_answered_in_order() -> None:
    """Two sandbox workers running declared tools: an engine's five calls go out as one
    contiguous part per worker (its first part to the worker of its rank: 2 calls to worker 1,
    3 to worker 0), each runs in that worker's tool processes (a bad expression is an error
    reply, not a failure), and the replies come back in the calls' order, from processes other
    than the engine's."""
    import os

    import ray

    from ppojob_api.training import TrainerConfig
    from ppojob_trainer.agent import RemoteToolPool
    from ppojob_trainer.workers.sandbox import RemoteSandboxHost

    cfg = TrainerConfig.model_validate({"data": {"agent": {"tools": [CALC_TOOL]}}})
    hosts = [
        RemoteSandboxHost.options(num_cpus=0.1).remote(cfg.model_dump_json(), r, 2)
        for r in range(2)
    ]
    try:
        ids = ray.get([h.ready.remote() for h in hosts])
        assert all("error" not in i and i["pid"] != os.getpid() for i in ids), ids
        pool = RemoteToolPool(hosts, first=1)
        exprs = ["1+1", "2*3", "__import__('os')", "7//2", "10-4"]
        replies = pool.map([("calc", {"expression": e}) for e in exprs])
        assert [r.observation for r in replies[:2]] == ["2", "6"]
        assert replies[2].error and "not an integer expression" in (replies[2].observation or "")
        assert [r.observation for r in replies[3:]] == ["3", "6"]
        assert not any(r.error for i, r in enumerate(replies) if i != 2)
        assert ray.get([h.call_count.remote() for h in hosts]) == [3, 2]
        assert pool.remote_calls == 5
    finally:
        for h in hosts:
            ray.kill(h)


def test_a_sandbox_worker_that_cannot_load_its_agent_says_so_in_one_line() -> None:
    """A hook the sandbox worker cannot import is its startup error (the trainer's
    StartupError), one line naming the field."""
    import ray

    from ppojob_api.training import TrainerConfig
    from ppojob_trainer.workers.sandbox import RemoteSandboxHost

    cfg = TrainerConfig.model_validate({"data": {"agent": {"function": "no_such_module:f"}}})
    host = RemoteSandboxHost.options(num_cpus=0.1).remote(cfg.model_dump_json(), 0, 1)
    try:
        ident = ray.get(host.ready.remote())
        assert ident["roles"] == ["sandbox"]
        assert ident["error"].startswith("data.agent.function") and "\n" not in ident["error"]
    finally:
        ray.kill(host)


def test_declared_tools_answer_through_the_template_as_in_the_engine() -> None:
    """``data.agent.tools`` with ``roles.sandbox``: the engine's :class:`ChatTools` parses the
    calls and renders the replies as before, but the calls run on the sandbox worker (its
    tool processes): the same tool messages and error counts as the engine's own tool
    processes give, for a good call, a crashing one and a turn without a call."""
    import ray

    from ppojob_api.training import TrainerConfig
    from ppojob_trainer.agent import ChatTools, RemoteToolPool
    from ppojob_trainer.workers.sandbox import RemoteSandboxHost
    from tests.helpers.chat_tools import ADD_SCHEMA, chat_tokenizer

    tools = [
        {"name": "add", "parameters": ADD_SCHEMA, "function": "tests.helpers.chat_tools:add"},
        {
            "name": "divide",
            "parameters": ADD_SCHEMA,
            "function": "tests.helpers.chat_tools:divide",
        },
    ]
    cfg = TrainerConfig.model_validate({"data": {"agent": {"tools": tools}}})
    host = RemoteSandboxHost.options(num_cpus=0.1).remote(cfg.model_dump_json(), 0, 1)
    try:
        assert "error" not in ray.get(host.ready.remote())
        tok = chat_tokenizer()
        spec = cfg.data.agent
        assert spec is not None
        here = ChatTools(tok, spec.tools, 10, 200)
        there = ChatTools(tok, spec.tools, 10, 200, pool=RemoteToolPool([host]))
        turns = [
            '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
            '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>',
            "The answer is 5",
        ]
        expected = here.respond(turns)
        assert expected[0] == ([{"role": "tool", "content": "5", "name": "add"}], 0)
        assert expected[1][1] == 1 and expected[2] == (None, 0)
        assert there.respond(turns) == expected
        assert ray.get(host.call_count.remote()) == 2  # the two calls, on the sandbox worker
        here.close()
    finally:
        ray.kill(host)
