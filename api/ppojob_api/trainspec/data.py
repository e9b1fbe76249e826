"""The training half of a PPOJob: the data (`spec.data`): prompts, rewards, agents and tools."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field

from ppojob_api.base import NAME_PATTERN, URL_PATTERN, ApiModel

from .constants import TOOL_NAME_PATTERN


class RewardModelSource(ApiModel):
    """A Hugging Face sequence-classification reward model (`AutoModelForSequenceClassification`
    saved with `num_labels=1`), run on the reward workers when spec.roles.reward is set, else in
    each rollout engine's process, on its device. It reads the prompt as the policy saw it (chat
    template applied when data.applyChatTemplate is on) followed by the completion, tokenized
    with the reward model's own tokenizer; its single output is the reward."""

    path: str = Field(min_length=1)
    """The reward model's directory (config.json, weights and tokenizer) in the trainer image or
    a volume: absolute, or relative to the working directory. Hub ids are not downloaded for
    reward models: download the model into a volume and give its directory."""

    batch_size: int = Field(32, ge=1, le=65_536)
    """Texts scored per forward pass."""

    max_length: int = Field(4096, ge=1, le=1_048_576)
    """Longest prompt + completion, in the reward model's tokens; a longer text loses its
    beginning (the completion's end, which the model's score is read at, is kept)."""

    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Dtype of the reward model's weights. Unset: model.dtype."""

    device: Literal["auto", "cpu"] = "auto"
    """`auto`: the device of the process holding the model (a reward worker's GPU when
    roles.reward is set and has GPUs; else the rollout engine's GPU when the rollout role has
    GPUs; else the CPU); `cpu`: always the CPU (no GPU memory, slower)."""


class HttpRewardSource(ApiModel):
    """A remote reward endpoint. The trainer POSTs JSON `{"prompts": [str], "completions": [str],
    "labels": [any]}` (one entry per sample, as a reward function gets them) and expects a 2xx
    answer `{"rewards": [number]}` with one finite number per sample, in order. Connection
    failures, timeouts, 408, 429 and 5xx answers are retried with exponential backoff; any other
    answer, invalid JSON, a wrong count or a non-finite reward fails the step with one line
    naming this source."""

    url: str = Field(min_length=1, pattern=URL_PATTERN)
    """The endpoint, `http://` or `https://`, reachable from the rollout role's pods. No
    credentials in it (`user:password@` is refused: a manifest is not a secret; use tokenEnv);
    messages show it without its query values."""

    timeout_seconds: float = Field(30.0, gt=0, le=3600)
    """Timeout of one request (connecting and reading the answer)."""

    retries: int = Field(2, ge=0, le=20)
    """Retries after a failed attempt (connection error, timeout, 408, 429 or 5xx)."""

    backoff_seconds: float = Field(1.0, ge=0, le=600)
    """Wait before the first retry; doubled before each further one."""

    batch_size: int | None = Field(None, ge=1, le=1_000_000)
    """Samples per request. Unset: all of an engine's samples of the step in one request."""

    token_env: str | None = Field(None, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    """Name of an environment variable holding a bearer token, sent as `Authorization: Bearer
    <token>`. Never write the token into the PPOJob: fill the variable from a Secret with
    spec.podTemplate.env (`valueFrom.secretKeyRef`)."""


JUDGE_PLACEHOLDERS = ("prompt", "response", "label")


class JudgeRewardSource(ApiModel):
    """A generative judge: a causal LM, run by a rollout engine (the torch engine the trainer
    samples with), reads `template` filled with the prompt and the response and writes a
    verdict; the first match of `scorePattern` in it is the reward, clamped to [minScore,
    maxScore]. A verdict without a number scores defaultScore and is counted in
    `reward/<name>_unparsed` (the step's count)."""

    model: str = Field(min_length=1)
    """`policy`: the policy's own rollout engine (its current weights, no extra memory);
    `builtin:<model>` (seed 0); or the directory of a Hugging Face causal LM in the trainer
    image or a volume (loaded once per rollout engine, on its device; hub ids are not
    downloaded)."""

    template: str = Field(
        "Rate the response to the prompt from 0 to 10.\nPrompt: {prompt}\nResponse: "
        "{response}\nScore:",
        min_length=1,
        max_length=65_536,
    )
    """The judge's prompt, a Python format string with `{prompt}`, `{response}` (required) and
    `{label}`; write a literal brace as `{{` or `}}`. Rendered with the judge's chat template
    when its tokenizer has one (applyChatTemplate)."""

    score_pattern: str = Field(r"(-?\d+(?:\.\d+)?)", min_length=1, max_length=1024)
    """Python regular expression with exactly one group, searched in the verdict (cut at its
    first special token); the group's text, read as a number, is the score."""

    min_score: float = 0.0
    """Scores below are raised to this."""

    max_score: float = 10.0
    """Scores above are lowered to this."""

    default_score: float = 0.0
    """The score of a verdict in which the pattern finds no number (within [minScore,
    maxScore])."""

    max_new_tokens: int = Field(16, ge=1, le=65_536)
    """Longest verdict, in the judge's tokens."""

    temperature: float = Field(0.0, ge=0, le=10)
    """Sampling temperature of the verdict; 0: greedy."""

    max_prompt_length: int = Field(4096, ge=1, le=1_048_576)
    """Longest judge prompt, in the judge's tokens; a longer one loses its beginning."""

    apply_chat_template: bool | None = None
    """Render the judge prompt with the judge tokenizer's chat template (as one user message).
    Unset: when the tokenizer has one."""


class RewardSource(ApiModel):
    """One source of the reward: exactly one of `function`, `model`, `http` and `judge`."""

    name: str | None = Field(None, pattern=NAME_PATTERN)
    """Name in the metrics (`reward/<name>_mean`, the source's unweighted mean). Unset: the
    function's name (`builtin:<task>`: the task), `model`, `http` or `judge`. Names must be
    unique."""

    weight: float = Field(1.0, ge=-1000, le=1000)
    """The reward is the sum over sources of weight x the source's reward."""

    function: str | None = Field(None, min_length=1)
    """`module:function` scoring a batch (as data.rewardFunction), or `builtin:<task>`."""

    model: RewardModelSource | None = None
    """A sequence-classification reward model."""

    http: HttpRewardSource | None = None
    """A remote reward endpoint."""

    judge: JudgeRewardSource | None = None
    """A generative judge (an LLM asked for a score)."""

    @property
    def kind(self) -> str | None:
        """`function`, `model`, `http` or `judge` when exactly one is set, else None."""
        kinds = [k for k in REWARD_KINDS if getattr(self, k) is not None]
        return kinds[0] if len(kinds) == 1 else None

    def default_name(self) -> str:
        """The name in the metrics: `name`, else one derived from the source."""
        if self.name is not None:
            return self.name
        if self.function is not None:
            tail = self.function.rsplit(":", 1)[-1]
            return re.sub(r"[^a-z0-9_.-]", "_", tail.lower()) or "function"
        return next((k for k in REWARD_KINDS[1:] if getattr(self, k) is not None), "http")


REWARD_KINDS = ("function", "model", "http", "judge")


class ToolSpec(ApiModel):
    """A tool the model may call, declared to it through the tokenizer's chat template
    (`apply_chat_template(..., tools=...)`, as an OpenAI-style function description)."""

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    """The function name the model calls (letters, digits, `_` and `-`; unique)."""

    description: str = Field("", max_length=4096)
    """What the tool does, shown to the model."""

    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    """JSON schema of the arguments: `{type: object, properties: {...}, required: [...]}`. A
    call's arguments are checked against it (required names, unknown names, the JSON types of
    `properties` and `enum`); a mismatch is the model's observation, not a call."""

    function: str = Field(min_length=1)
    """`module:function` called with the arguments as keywords, in a child process with
    toolTimeoutSeconds; its return value (a string, or JSON-encoded) is the tool message. Or
    `builtin:calculate` (`expression`: an integer expression of `+ - * //` and parentheses)."""


class AgentSpec(ApiModel):
    """A multi-turn agent: the model's turn (sampled by the rollout engine), then the
    environment's reply, until the agent says done or a budget runs out. The environment's
    tokens are part of the response (the model reads them) but carry no policy or value loss.
    The environment is either a hook (`function`) or declared `tools`."""

    function: str | None = Field(None, min_length=1)
    """`module:function` called as `fn(prompt, label, turns)` after each model turn (`turns`:
    the model's turns so far, decoded), in a child process with a timeout, returning a dict
    with `observation` (text, or None) and `done` (a bool), and optionally `metrics` (names to
    numbers, reported per sample as `agent/env/<name>_mean`); or `builtin:<agent>`
    (`builtin:calculator`: evaluates the call the model wrote). A crash, timeout or malformed
    reply becomes the observation text, never a failed run. Set this or tools."""

    tools: list[ToolSpec] = Field(default_factory=list, max_length=64)
    """Tools called through the model's own chat template (set this or function; needs a
    tokenizer with a chat template): the prompt is rendered with `tools=`; each model turn's
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (or a turn that is one
    such JSON object) are run and answered as `role: tool` messages rendered by the template; a
    turn without a call ends the conversation. Malformed JSON, an unknown tool or wrong
    arguments are answered with an error message, never a failed run."""

    max_turns: int = Field(4, ge=1, le=64)
    """Most model turns per conversation."""

    max_tool_response_tokens: int = Field(64, ge=1, le=1_048_576)
    """An observation is cut to this many tokens (maxResponseLength bounds the whole
    response, model and environment tokens together)."""

    tool_timeout_seconds: float = Field(10.0, gt=0, le=3600)
    """Wall-clock limit of one environment call (its child process is killed after it; CPU
    time is limited to the same, address space to the trainer's plus 1 GiB)."""


class DataSpec(ApiModel):
    """Prompts, reward and sampling."""

    prompts: str = Field("builtin:count-up", min_length=1)
    """Prompt dataset: a `.jsonl`, `.json` (a list of objects) or `.parquet` file, a directory
    written by `datasets`' `save_to_disk` (a DatasetDict's `train` split is used), all as paths
    the trainer's pods can read, or `builtin:<task>` (`builtin:count-up`, `builtin:reverse`,
    `builtin:calculator`)."""

    prompt_key: str = Field("prompt", min_length=1)
    """Column holding the prompt text in a dataset file."""

    label_key: str = Field("label", min_length=1)
    """Column holding the reference answer passed to the reward function (may be absent)."""

    reward_function: str | None = Field(None, min_length=1)
    """`module:function` scoring each completion, or `builtin:<task>`. Defaults to the built-in
    task's reward. The shorthand of `rewards: [{function: ...}]`; set one or the other."""

    rewards: list[RewardSource] = Field(default_factory=list, max_length=16)
    """Reward sources combined with weights: reward = sum of weight x source reward. Each is a
    `function`, a reward `model`, an `http` endpoint or a generative `judge`; each step reports
    every source's mean as `reward/<name>_mean`. Empty: rewardFunction (or the built-in task's
    reward)."""

    rollout_batch_size: int = Field(16, ge=1, le=1_000_000)
    """Prompts per training step."""

    samples_per_prompt: int = Field(8, ge=1, le=1024)
    """Completions sampled per prompt (the group size of grpo and rloo)."""

    max_prompt_length: int = Field(512, ge=1, le=1_048_576)
    """Prompts longer than this many tokens are truncated from the left."""

    max_response_length: int = Field(512, ge=1, le=1_048_576)
    """Maximum generated tokens per completion."""

    temperature: float = Field(1.0, gt=0, le=10)
    """Sampling temperature."""

    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold. Below 1 the policy (pi_old, the trained policy and the
    reference) is the top-p truncated distribution the engines sample from."""

    shuffle: bool = True
    """Shuffle prompts every epoch (seeded by spec.training.seed)."""

    eval_prompts: str | None = Field(None, min_length=1)
    """Held-out prompts to evaluate on, in the formats of `prompts` (`builtin:<task>`: a fixed
    set of 64 of that task's prompts). Every spec.training.evalInterval steps and after the last
    step, each prompt gets one greedy completion, scored by the reward function, reported as
    eval/reward_mean. Unset: no evaluation."""
    apply_chat_template: bool | None = None
    """Render each prompt with the tokenizer's chat template (a plain string becomes one user
    message; a prompt given as chat messages `[{role, content}, ...]` needs the template).
    Unset: on exactly when the tokenizer has a chat template."""

    agent: AgentSpec | None = None
    """Multi-turn rollouts driven by an agent hook (tool calls and their results). Unset: one
    model turn per sample. The reward function scores the model's last turn."""

    @property
    def samples_per_step(self) -> int:
        return self.rollout_batch_size * self.samples_per_prompt
