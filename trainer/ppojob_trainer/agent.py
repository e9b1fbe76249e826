"""Multi-turn agentic rollouts (``data.agent``): the model's turn, the environment's reply, ...

An agent hook is ``fn(prompt: str, label, turns: list[str]) -> {"observation": str | None,
"done": bool}``, called after every model turn with the model's turns so far (decoded, each cut
at its first special token). ``done`` (or no observation) ends the conversation; otherwise the
observation's tokens are appended to the response and the model takes its next turn. The hook
runs in a child process (forked) with a wall-clock timeout, a CPU-time limit and an
address-space limit (``resource``), so a tool that hangs, crashes or eats memory costs that
sample one observation, never the run: a timeout, an exception, a dead child or a malformed
reply becomes the observation text (``tool error: ...``).

Token-in/token-out: the response of a sample is the concatenation of the tokens the engine
sampled in each model turn (exactly those ids; nothing is re-tokenized) and of the observation
tokens. ``action_mask`` [B, T] is True on the model's tokens and False on the environment's
(and on padding); ``response_mask`` stays True on both, since the model reads the observations.
The environment's tokens carry no policy loss, no value loss and no KL; advantages (GAE as
well) run over the model's tokens only: an observation is skipped, so the last model token
before it is linked to the first model token after it, as if the observation were a
zero-reward, zero-discount transition (verl's multi-turn GAE does the same).

A reply may also carry ``"metrics"``: a mapping of names to numbers about that call (for
instance whether it was a well-formed call); each step reports their mean per sample as
``agent/env/<name>_mean`` (a sample with several calls adds them up). A malformed mapping is a
``tool error`` like any other malformed reply.

Built-in agent ``builtin:calculator`` (prompts ``builtin:calculator``): the prompt is four digits
``ABCD`` asking for the last digit of AB + CD (``3748`` -> ``5``: uniform, so a guess scores 0.1
and only adding, or the tool, does better). The calculator evaluates the call the model wrote,
with the model's own arguments: a turn of exactly four digits ``WXYZ`` (the form the built-in
models' digit vocabulary can spell: two two-digit operands, the calculator adds) is answered
with the value of WX + YZ (``3748`` -> ``85``, ``1111`` -> ``22``: wrong arguments, wrong
result); a turn holding ``<calc>EXPR</calc>`` (a model with a text vocabulary) is answered
``<result>VALUE</result>`` (an error saying why when EXPR is not an integer expression). Any
other turn is the model's final answer and ends the conversation: nothing is answered from the
prompt. The reward is 1 when the model's last turn is the answer digit. Each reply reports
``calls`` (1 for a call), ``exact_calls`` (1 when the call's value is AB + CD) and
``digit_calls`` (1 when its last digit is the answer) as metrics.
"""

from __future__ import annotations

import ast
import itertools
import json
import math
import multiprocessing
import multiprocessing.connection
import operator
import os
import re
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .algorithms.hooks import load_function

AgentFn = Callable[[str, Any, list[str]], Any]
BUILTIN_PREFIX = "builtin:"
_METRIC_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")
ADDRESS_SPACE_HEADROOM = 1 << 30  # a tool may map this much beyond the trainer's own size
PARALLEL_TOOL_CALLS = 8


# ---------------------------------------------------------------------------------------------
# The built-in calculator
# ---------------------------------------------------------------------------------------------
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
}
_CALL = re.compile(r"<calc>(.*?)</calc>", re.S)


def calculate(expr: str) -> int:
    """The value of an integer expression of ``+ - * //`` and parentheses (no names, no
    calls); ValueError on anything else."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"not an integer expression: {expr!r}")

    if len(expr) > 200:
        raise ValueError("expression longer than 200 characters")
    try:
        return ev(ast.parse(expr.strip(), mode="eval"))
    except SyntaxError:
        raise ValueError(f"not an integer expression: {expr!r}") from None


def calculator_question(prompt: str) -> str:
    """``3748`` -> ``37+48`` (``0703`` -> ``7+3``)."""
    return f"{int(prompt[:2])}+{int(prompt[2:4])}"


def calculator_answer(prompt: str) -> str:
    """The last digit of a calculator prompt's sum: ``3748`` -> ``5``."""
    return f"{calculate(calculator_question(prompt)) % 10}"


_DIGIT_CALL = re.compile(r"[0-9]{4}")


def calculator_agent(prompt: str, label: Any, turns: list[str]) -> dict[str, Any]:
    """The environment of ``builtin:calculator``: a last turn of four digits ``WXYZ`` is a call
    of WX + YZ, answered with its value; ``<calc>EXPR</calc>`` is a call of EXPR, answered
    ``<result>VALUE</result>``; any other turn is the final answer (done). The values come from
    the model's arguments only; the prompt only judges them (the ``metrics``)."""
    last = turns[-1]
    text = _CALL.search(last)
    if text is not None:
        expr, form = text.group(1), "<result>{}</result>"
    elif _DIGIT_CALL.fullmatch(last):
        expr, form = f"{int(last[:2])}+{int(last[2:])}", "{}"
    else:
        return {"observation": None, "done": True, "metrics": _call_metrics(prompt, None, False)}
    try:
        value = calculate(expr)
    except ValueError as exc:
        return {
            "observation": form.format(f"error: {exc}"),
            "done": False,
            "metrics": _call_metrics(prompt, None, True),
        }
    return {
        "observation": form.format(value),
        "done": False,
        "metrics": _call_metrics(prompt, value, True),
    }


def _call_metrics(prompt: str, value: int | None, called: bool) -> dict[str, float]:
    """``calls``, ``exact_calls`` (the value is the question's sum), ``digit_calls`` (its last
    digit is the answer) of one reply of the calculator."""
    exact = value is not None and value == calculate(calculator_question(prompt))
    digit = value is not None and f"{value % 10}" == calculator_answer(prompt)
    return {"calls": float(called), "exact_calls": float(exact), "digit_calls": float(digit)}


BUILTIN_AGENTS: dict[str, AgentFn] = {"calculator": calculator_agent}


def load_agent(spec: str, field: str = "data.agent.function") -> AgentFn:
    """The agent hook of ``spec``: ``builtin:<agent>`` or ``module:function``; errors name
    ``field``."""
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX) :]
        if name not in BUILTIN_AGENTS:
            raise ValueError(
                f"{field}: unknown built-in agent {spec!r}; "
                f"use one of {[BUILTIN_PREFIX + a for a in BUILTIN_AGENTS]}"
            )
        return BUILTIN_AGENTS[name]
    return load_function(spec, field)


# ---------------------------------------------------------------------------------------------
# Tool calls in child processes
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AgentReply:
    """What the environment said after a model turn."""

    observation: str | None
    done: bool
    error: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    """The reply's ``metrics``, by name (``agent/env/<name>``)."""


def parse_reply(value: Any) -> AgentReply:
    """An agent hook's return value as an :class:`AgentReply`; a malformed one becomes an
    error observation."""
    if not isinstance(value, dict):
        return AgentReply(
            f"tool error: the agent returned {type(value).__name__}, not a dict", False, True
        )
    obs = value.get("observation")
    done = value.get("done", obs is None)
    if obs is not None and not isinstance(obs, str):
        return AgentReply(
            f"tool error: observation is {type(obs).__name__}, not a string or None", False, True
        )
    if not isinstance(done, bool):
        return AgentReply("tool error: done is not a bool", False, True)
    metrics = value.get("metrics", {})
    if not (
        isinstance(metrics, dict)
        and all(
            isinstance(k, str)
            and _METRIC_NAME.fullmatch(k)
            and isinstance(v, int | float)
            and not isinstance(v, bool)
            and math.isfinite(v)
            for k, v in metrics.items()
        )
    ):
        return AgentReply(
            "tool error: metrics is not a mapping of names ([A-Za-z0-9_]) to finite numbers",
            False,
            True,
        )
    return AgentReply(obs, done or obs is None, False, {k: float(v) for k, v in metrics.items()})


def _limit_address_space() -> None:
    """In a tool process: address space limited to its size at the fork plus the headroom."""
    try:
        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        cap = size + ADDRESS_SPACE_HEADROOM
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    except (OSError, ValueError):
        pass


def _limit_cpu(timeout: float) -> None:
    """In a tool process, before a call: ``timeout`` more CPU seconds (to the next whole
    second, RLIMIT_CPU's unit), then SIGXCPU ends the process (the pool starts another)."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    spent = used.ru_utime + used.ru_stime
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    soft = math.ceil(spent + max(1.0, timeout))
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _serve(fn: AgentFn, timeout: float, conn: Any) -> None:
    """A tool process: run ``fn(*args)`` for each ``args`` received, answer ``(ok, value)``."""
    _limit_address_space()
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            _limit_cpu(timeout)
            out: tuple[bool, Any] = (True, fn(*args))
        except BaseException as exc:  # everything a tool does wrong is an observation
            out = (False, f"{type(exc).__name__}: {exc}")
        try:
            conn.send(out)
        except Exception as exc:  # an unpicklable reply
            conn.send((False, f"the reply could not be sent back ({type(exc).__name__}: {exc})"))


class ToolPool:
    """``size`` forked processes running an agent hook, each call with a wall-clock ``timeout``
    (the process is killed after it and another started), a CPU-time limit of the same and an
    address-space limit. Forked once and reused: a fork of a trainer process costs tens of
    milliseconds, more than most tool calls."""

    def __init__(self, fn: AgentFn, timeout: float, size: int = PARALLEL_TOOL_CALLS) -> None:
        self.fn, self.timeout, self.size = fn, timeout, size
        self.ctx = multiprocessing.get_context("fork")
        self.workers: list[tuple[Any, Any] | None] = [None] * size

    def _worker(self, k: int) -> tuple[Any, Any]:
        if self.workers[k] is None:
            mine, theirs = self.ctx.Pipe()
            proc = self.ctx.Process(
                target=_serve, args=(self.fn, self.timeout, theirs), daemon=True
            )
            proc.start()
            theirs.close()
            self.workers[k] = (proc, mine)
        return self.workers[k]  # type: ignore[return-value]

    def _drop(self, k: int, wait: float = 0.0) -> int | None:
        """End worker ``k`` (after up to ``wait`` seconds for it to exit by itself); its exit
        code (None if it was still running)."""
        entry = self.workers[k]
        self.workers[k] = None
        if entry is None:
            return None
        proc, conn = entry
        if wait:
            proc.join(wait)
        code = proc.exitcode
        if proc.is_alive():
            proc.kill()
        proc.join()
        conn.close()
        return code

    def map(self, calls: Sequence[tuple[Any, ...]]) -> list[AgentReply]:
        """``fn(*args)`` for each of ``calls``, in order. A timeout, an exception, a dead
        process or a malformed reply is an error :class:`AgentReply` saying so."""
        out: list[AgentReply | None] = [None] * len(calls)
        queue = list(range(len(calls)))[::-1]
        busy: dict[int, tuple[int, float]] = {}  # worker -> (call, deadline)
        while queue or busy:
            for k in range(self.size):
                if k not in busy and queue:
                    i = queue.pop()
                    conn = self._worker(k)[1]
                    try:
                        conn.send(calls[i])
                    except (BrokenPipeError, OSError):  # it died between two calls
                        self._drop(k)
                        self._worker(k)[1].send(calls[i])
                    busy[k] = (i, time.monotonic() + self.timeout)
            wait_s = max(0.0, min(d for _, d in busy.values()) - time.monotonic())
            conns = {self.workers[k][1]: k for k in busy}  # type: ignore[index]
            ready = multiprocessing.connection.wait(list(conns), timeout=wait_s)
            for conn in ready:
                k = conns[conn]  # type: ignore[index]
                i, _ = busy.pop(k)
                try:
                    ok, value = conn.recv()
                except (EOFError, OSError):
                    code = self._drop(k, wait=2.0)
                    out[i] = AgentReply(
                        f"tool error: the tool process died (exit code {code})", False, True
                    )
                else:
                    out[i] = (
                        parse_reply(value)
                        if ok
                        else AgentReply(f"tool error: {value}", False, True)
                    )
            now = time.monotonic()
            for k, (i, deadline) in list(busy.items()):
                if now >= deadline:
                    busy.pop(k)
                    self._drop(k)
                    out[i] = AgentReply(
                        f"tool error: timed out after {self.timeout:g} s", False, True
                    )
        return [r for r in out if r is not None]

    def close(self) -> None:
        """End every tool process."""
        for k in range(self.size):
            self._drop(k)


class RemoteToolPool:
    """The tool calls of an engine sent to the sandbox workers (``roles.sandbox``): each
    :meth:`map` splits its calls into one contiguous part per worker and sends the parts at
    once, by Ray actor calls from the engine's process; each worker runs its part in its own
    :class:`ToolPool` (same timeout and limits) and answers the replies in order. ``first``:
    the worker this engine's first part goes to (its data-parallel rank, so that engines with
    few calls spread out). What crosses
    the process boundary is the calls' arguments (the prompt and turns as strings, the label)
    and the replies, never through the driver. A worker lost mid-call fails the call with one
    line naming roles.sandbox."""

    def __init__(self, workers: Sequence[Any], first: int = 0) -> None:
        if not workers:
            raise ValueError("RemoteToolPool: no sandbox workers")
        k = first % len(workers)  # (engines start at different workers: few calls spread out)
        self.workers = [*workers[k:], *workers[:k]]
        self.remote_calls = 0
        """Calls answered by a sandbox worker in another process (``agent/sandbox_calls``)."""

    def map(self, calls: Sequence[tuple[Any, ...]]) -> list[AgentReply]:
        """``fn(*args)`` for each of ``calls``, in order, on the sandbox workers."""
        import ray

        n = len(self.workers)
        bounds = [len(calls) * w // n for w in range(n + 1)]
        refs = [
            (w, self.workers[w].call.remote([list(c) for c in calls[lo:hi]]))
            for w, (lo, hi) in enumerate(itertools.pairwise(bounds))
            if hi > lo
        ]
        out: list[AgentReply] = []
        for w, ref in refs:
            try:
                pid, replies = ray.get(ref)
            except ray.exceptions.RayError as exc:
                raise RuntimeError(
                    f"roles.sandbox: sandbox worker {w} did not answer its tool calls "
                    f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
                ) from None
            out += [AgentReply(*r) for r in replies]
            if pid != os.getpid():
                self.remote_calls += len(replies)
        return out

    def close(self) -> None:
        """Nothing to end here: the sandbox workers keep their tool processes."""


class SandboxTools:
    """The environment of ``data.agent`` on a sandbox worker: the hook, or the declared tools'
    functions, in a :class:`ToolPool` of this process."""

    def __init__(self, agent: Any) -> None:
        if agent.tools:
            table = tool_table(agent.tools)
            fn: AgentFn = lambda name, args: _dispatch(table, name, args)  # noqa: E731
        else:
            fn = load_agent(agent.function)
        self.pool = ToolPool(fn, agent.tool_timeout_seconds)

    def call(self, calls: list[list[Any]]) -> list[tuple[str | None, bool, bool, dict[str, float]]]:
        """The replies to ``calls`` (each the arguments of one call), in order."""
        return [
            (r.observation, r.done, r.error, r.metrics)
            for r in self.pool.map([tuple(c) for c in calls])
        ]

    def close(self) -> None:
        self.pool.close()


def call_tools(
    fn: AgentFn,
    calls: Sequence[tuple[Any, ...]],
    timeout: float,
    parallel: int = PARALLEL_TOOL_CALLS,
) -> list[AgentReply]:
    """``fn(*args)`` for each of ``calls`` in a fresh :class:`ToolPool` (closed after)."""
    pool = ToolPool(fn, timeout, max(1, min(parallel, len(calls))))
    try:
        return pool.map(calls)
    finally:
        pool.close()


# ---------------------------------------------------------------------------------------------
# The conversation loop
# ---------------------------------------------------------------------------------------------
@dataclass
class Conversation:
    """One sample's response so far: token ids, which of them the model sampled, their
    sampling log-probs, and the model's turns as text."""

    ids: list[int]
    action: list[bool]
    logprobs: list[float]
    turns: list[str]
    done: bool = False
    tool_errors: int = 0
    env_calls: int = 0
    env_metrics: dict[str, float] = field(default_factory=dict)  # the replies' metrics, summed
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat tools: the history
    sampled: str = ""  # chat tools: the last turn's tokens decoded, special tokens included


def run_conversations(
    engine: Any,
    tokenizer: Any,
    prompt_rows: list[list[int]],
    prompts: list[Any],
    labels: list[Any],
    agent: AgentFn | ToolPool | RemoteToolPool | None,
    *,
    max_turns: int,
    max_response_length: int,
    max_tool_response_tokens: int,
    tool_timeout: float,
    temperature: float,
    top_p: float,
    seed: int,
    special: set[int],
    chat: ChatTools | None = None,
) -> list[Conversation]:
    """Drive every sample's conversation to its end: each round samples the next model turn of
    every open conversation in one engine call (prompt + response so far, left-padded), then
    asks the agent (in child processes) for the observations. A conversation ends when the
    agent says done, after ``max_turns`` model turns, or when its response reaches
    ``max_response_length`` tokens (an observation is cut to what is left). ``agent``: the
    hook, or a :class:`ToolPool` running it (kept open for the next call). ``chat``: the
    declared tools instead of a hook (``agent`` None; ``prompts`` the prompts as given, a
    string or chat messages): each turn's tool calls are answered through the chat template
    (:class:`ChatTools`), a turn without a call ends the conversation."""
    convs = [Conversation([], [], [], []) for _ in prompt_rows]
    pad = tokenizer.pad_token_id
    pool: ToolPool | RemoteToolPool | None = None
    if chat is not None:
        for c, p in zip(convs, prompts, strict=True):
            c.messages = chat.prompt_messages(p)
    elif agent is None:
        raise ValueError("run_conversations: an agent hook or chat tools are needed")
    else:
        pool = (
            agent if isinstance(agent, ToolPool | RemoteToolPool) else ToolPool(agent, tool_timeout)
        )
    for turn in range(max_turns):
        open_ = [i for i, c in enumerate(convs) if not c.done]
        if not open_:
            break
        rows = [prompt_rows[i] + convs[i].ids for i in open_]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for j, r in enumerate(rows):
            ids[j, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[j, width - len(r) :] = True
        budget = max(max_response_length - len(convs[i].ids) for i in open_)
        gen = engine.generate(
            ids,
            mask,
            max_new_tokens=budget,
            temperature=temperature,
            top_p=top_p,
            seed=seed * 1_000_003 + turn,
        )
        for j, i in enumerate(open_):
            c = convs[i]
            left = max_response_length - len(c.ids)
            n = min(int(gen.lengths[j]), left)
            new = gen.response_ids[j, :n].tolist()
            c.ids += new
            c.action += [True] * n
            c.logprobs += gen.logprobs[j, :n].tolist()
            cut = next((k for k, t in enumerate(new) if t in special), len(new))
            c.turns.append(tokenizer.decode(new[:cut]))
            if chat is not None:
                c.sampled = tokenizer.decode(new, skip_special_tokens=False)
            if len(c.ids) >= max_response_length or turn + 1 == max_turns:
                c.done = True
        asking = [i for i in open_ if not convs[i].done]
        if chat is not None:
            _answer_with_tools(chat, tokenizer, [convs[i] for i in asking], max_response_length)
            continue
        assert pool is not None
        replies = pool.map([(prompts[i], labels[i], list(convs[i].turns)) for i in asking])
        for i, reply in zip(asking, replies, strict=True):
            c = convs[i]
            c.env_calls += 1
            c.tool_errors += int(reply.error)
            for k, v in reply.metrics.items():
                c.env_metrics[k] = c.env_metrics.get(k, 0.0) + v
            if reply.done or reply.observation is None:
                c.done = True
                continue
            obs = tokenizer(reply.observation, add_special_tokens=False)["input_ids"]
            obs = obs[: min(max_tool_response_tokens, max_response_length - len(c.ids))]
            c.ids += obs
            c.action += [False] * len(obs)
            c.logprobs += [0.0] * len(obs)
            if len(c.ids) >= max_response_length:
                c.done = True
    if pool is not None and pool is not agent:
        pool.close()
    return convs


def _answer_with_tools(
    chat: ChatTools, tokenizer: Any, convs: list[Conversation], max_response_length: int
) -> None:
    """Append to each conversation the template's rendering of the tool messages answering
    its last turn (environment tokens), or end it when the turn calls nothing."""
    answers = chat.respond([c.turns[-1] for c in convs])
    for c, (messages, errors) in zip(convs, answers, strict=True):
        if messages is None:
            c.done = True
            continue
        c.env_calls += len(messages)
        c.tool_errors += errors
        text = chat.environment_text(c.messages, c.turns[-1], c.sampled, messages)
        c.messages += [{"role": "assistant", "content": c.turns[-1]}, *messages]
        env = tokenizer(text, add_special_tokens=False)["input_ids"]
        left = max_response_length - len(c.ids)
        if len(env) >= left:  # no room for another model turn after it
            env = env[:left]
            c.done = True
        c.ids += env
        c.action += [False] * len(env)
        c.logprobs += [0.0] * len(env)


def conversation_tensors(convs: list[Conversation], pad_id: int) -> dict[str, torch.Tensor]:
    """``response_ids``, ``response_mask``, ``action_mask``, ``rollout_logprobs`` [B, T]
    (right-padded) and ``lengths`` [B] of finished conversations."""
    width = max(1, max(len(c.ids) for c in convs))
    b = len(convs)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    resp = torch.zeros((b, width), dtype=torch.bool)
    action = torch.zeros((b, width), dtype=torch.bool)
    logp = torch.zeros((b, width), dtype=torch.float32)
    for i, c in enumerate(convs):
        n = len(c.ids)
        ids[i, :n] = torch.tensor(c.ids, dtype=torch.long)
        resp[i, :n] = True
        action[i, :n] = torch.tensor(c.action, dtype=torch.bool)
        logp[i, :n] = torch.tensor(c.logprobs, dtype=torch.float32)
    lengths = torch.tensor([len(c.ids) for c in convs], dtype=torch.long)
    return {
        "response_ids": ids,
        "response_mask": resp,
        "action_mask": action,
        "rollout_logprobs": logp,
        "lengths": lengths,
    }


def policy_mask(batch: Any) -> torch.Tensor:
    """The tokens the policy owns: ``response_mask``, and ``action_mask`` where the batch is
    multi-turn (environment tokens left out)."""
    mask = batch["response_mask"].bool()
    action = batch.get("action_mask") if hasattr(batch, "get") else None
    return mask if action is None else mask & action.bool()


# ---------------------------------------------------------------------------------------------
# Tools through the model's own chat template (data.agent.tools)
# ---------------------------------------------------------------------------------------------
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}
_SENTINEL = "\x00ppojob-assistant-content\x00"


class TemplateError(ValueError):
    """The tokenizer's chat template cannot carry a token-exact multi-turn conversation."""


def builtin_calculate(expression: str) -> str:
    """Tool ``builtin:calculate``: the value of an integer expression, as text."""
    return str(calculate(expression))


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculate": builtin_calculate}


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: a declared tool's name and arguments that match its schema."""

    name: str
    arguments: dict[str, Any]


def check_arguments(schema: dict[str, Any], args: dict[str, Any]) -> str | None:
    """Why ``args`` do not match a tool's parameter ``schema`` (required names, unknown names,
    JSON types and ``enum`` of the properties), or None when they do."""
    props = schema.get("properties", {}) or {}
    missing = [r for r in schema.get("required", []) if r not in args]
    if missing:
        return f"missing required argument(s) {missing}"
    unknown = [k for k in args if k not in props]
    if unknown and schema.get("additionalProperties", False) is not True:
        return f"unknown argument(s) {unknown}; the tool takes {sorted(props)}"
    for k, v in args.items():
        want = props.get(k, {}).get("type")
        kinds = [want] if isinstance(want, str) else list(want or [])
        if kinds and not any(_json_type_ok(v, t) for t in kinds):
            return f"argument {k!r} is {type(v).__name__}, not {'/'.join(kinds)}"
        allowed = props.get(k, {}).get("enum")
        if allowed is not None and v not in allowed:
            return f"argument {k!r} is {v!r}, not one of {allowed}"
    return None


def _json_type_ok(value: Any, kind: str) -> bool:
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES.get(kind, (object,)))


def parse_tool_calls(text: str, schemas: dict[str, dict[str, Any]]) -> list[ToolCall | str]:
    """The tool calls of a model turn, in order: ``<tool_call>{json}</tool_call>`` blocks (an
    unterminated last block included), or, without any, a turn that is one JSON object with a
    ``name``. Each is a :class:`ToolCall` or, when it is malformed JSON, names an unknown tool
    or has arguments that do not match the schema, the error text the model is answered
    with. ``[]``: the turn calls nothing (its final answer)."""
    bodies = [m.group(1) for m in _TOOL_CALL.finditer(text)]
    if not bodies:
        stripped = text.strip()
        if not (stripped.startswith("{") and stripped.endswith("}") and '"name"' in stripped):
            return []
        bodies = [stripped]
    out: list[ToolCall | str] = []
    for body in bodies:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            out.append(f"error: the tool call is not valid JSON ({exc.msg} at {exc.pos})")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            out.append('error: a tool call is {"name": ..., "arguments": {...}}')
            continue
        name = call["name"]
        if name not in schemas:
            out.append(f"error: unknown tool {name!r}; the tools are {sorted(schemas)}")
            continue
        args = call.get("arguments", call.get("parameters", {}))
        if isinstance(args, str):  # OpenAI style: the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError as exc:
                out.append(f"error: the arguments of {name} are not valid JSON ({exc.msg})")
                continue
        if not isinstance(args, dict):
            out.append(f"error: the arguments of {name} are not a JSON object")
            continue
        why = check_arguments(schemas[name], args)
        out.append(f"error: {name}: {why}" if why else ToolCall(name, args))
    return out


def tool_table(
    tools: Sequence[Any], field: str = "data.agent.tools"
) -> dict[str, Callable[..., Any]]:
    """Each declared tool's function by the tool's name; errors name ``field[i].function``."""
    table: dict[str, Callable[..., Any]] = {}
    for i, t in enumerate(tools):
        where = f"{field}[{i}].function"
        if t.function.startswith(BUILTIN_PREFIX):
            name = t.function[len(BUILTIN_PREFIX) :]
            if name not in BUILTIN_TOOLS:
                raise ValueError(
                    f"{where}: unknown built-in tool {t.function!r}; use one of "
                    f"{[BUILTIN_PREFIX + n for n in BUILTIN_TOOLS]}"
                )
            table[t.name] = BUILTIN_TOOLS[name]
        else:
            table[t.name] = load_function(t.function, where)
    return table


def _dispatch(table: dict[str, Callable[..., Any]], name: str, args: dict[str, Any]) -> Any:
    """In a tool process: call tool ``name`` and return its result as an agent reply."""
    value = table[name](**args)
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return {"observation": text, "done": False}


class ChatTools:
    """The environment of ``data.agent.tools``: the tools declared through the tokenizer's chat
    template, their calls parsed from each model turn, run in a :class:`ToolPool`, and their
    results rendered back through the template as ``role: tool`` messages.

    Environment tokens are incremental: the conversation is rendered with and without the new
    tool messages and only the difference is tokenized and appended (after what the template
    writes to close the model's turn, less what the model already sampled of it, e.g. its
    end-of-turn token). The template must be prefix-stable (each rendering a prefix of the
    next); one that is not raises :class:`TemplateError`."""

    def __init__(
        self,
        tokenizer: Any,
        tools: Sequence[Any],
        timeout: float,
        max_tool_response_tokens: int,
        field: str = "data.agent.tools",
        pool: RemoteToolPool | None = None,
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(
                f"{field}: tools are declared through the tokenizer's chat template, and the "
                "model's tokenizer has none; use a model whose tokenizer_config.json has one, "
                "or an agent function"
            )
        self.tokenizer = tokenizer
        self.field = field
        self.max_tool_response_tokens = max_tool_response_tokens
        self.schemas = {t.name: dict(t.parameters) for t in tools}
        self.declared = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": dict(t.parameters),
                },
            }
            for t in tools
        ]
        # a template that is not prefix-stable fails here, at the start, not at the first call
        probe = [{"role": "user", "content": "probe"}]
        self.environment_text(probe, "call", "call", [{"role": "tool", "content": "result"}])
        self.pool: ToolPool | RemoteToolPool
        if pool is not None:  # roles.sandbox: the functions are loaded and run there
            self.pool = pool
        else:
            table = tool_table(tools, field)
            self.pool = ToolPool(lambda name, args: _dispatch(table, name, args), timeout)

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        """``messages`` rendered by the template with the tools declared."""
        return self.tokenizer.apply_chat_template(
            messages, tools=self.declared, tokenize=False, add_generation_prompt=generation_prompt
        )

    def prompt_messages(self, prompt: Any) -> list[dict[str, Any]]:
        """A prompt as chat messages (a string is one user message)."""
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return [dict(m) for m in prompt]

    def respond(self, turns: list[str]) -> list[tuple[list[dict[str, Any]] | None, int]]:
        """For each model turn: (the tool messages answering it, or None when it calls
        nothing; the number of calls that failed: malformed, refused or crashed)."""
        parsed = [parse_tool_calls(t, self.schemas) for t in turns]
        jobs = [(i, j, c) for i, p in enumerate(parsed) for j, c in enumerate(p)]
        calls = [(c.name, c.arguments) for _, _, c in jobs if isinstance(c, ToolCall)]
        replies = iter(self.pool.map(calls))
        out: list[tuple[list[dict[str, Any]] | None, int]] = []
        by_turn: dict[int, list[tuple[str, str, bool]]] = {}
        for i, _, c in jobs:
            if isinstance(c, ToolCall):
                r = next(replies)
                text = r.observation if r.observation is not None else ""
                by_turn.setdefault(i, []).append((c.name, text, r.error))
            else:
                by_turn.setdefault(i, []).append(("", c, True))
        for i, p in enumerate(parsed):
            if not p:
                out.append((None, 0))
                continue
            msgs = []
            for name, text, _ in by_turn[i]:
                msg = {"role": "tool", "content": self._cut(text)}
                if name:
                    msg["name"] = name
                msgs.append(msg)
            out.append((msgs, sum(int(e) for _, _, e in by_turn[i])))
        return out

    def _cut(self, text: str) -> str:
        """A tool result cut to maxToolResponseTokens tokens."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= self.max_tool_response_tokens:
            return text
        return self.tokenizer.decode(ids[: self.max_tool_response_tokens])

    def environment_text(
        self,
        history: list[dict[str, Any]],
        content: str,
        sampled: str,
        tool_messages: list[dict[str, Any]],
    ) -> str:
        """The text between the model's turn (``sampled``: its tokens decoded, end-of-turn
        token included; ``content``: its text) and the model's next turn: what the template
        writes to close the turn (less its part the model sampled), the tool messages, and
        the next turn's generation prompt. ``history``: the messages before the turn."""
        turn = {"role": "assistant", "content": content}
        before = self.render(history, True)
        prev = self.render([*history, turn], False)
        nxt = self.render([*history, turn, *tool_messages], True)
        if not (prev.startswith(before) and nxt.startswith(prev)):
            raise TemplateError(
                f"{self.field}: the tokenizer's chat template is not prefix-stable (rendering "
                "a conversation with one more message changes its beginning), so tool results "
                "cannot be appended token-exactly; use a template that only appends, or an "
                "agent function"
            )
        probe = self.render([*history, {"role": "assistant", "content": _SENTINEL}], False)
        closing = probe[probe.rfind(_SENTINEL) + len(_SENTINEL) :]
        k = next(k for k in range(len(closing), -1, -1) if sampled.endswith(closing[:k]))
        return closing[k:] + nxt[len(prev) :]

    def close(self) -> None:
        """End the tool processes."""
        self.pool.close()
