"""Prompts and rewards: built-in tasks, dataset files and user reward functions.

A reward function scores a batch: ``fn(prompts: list[str], completions: list[str], labels: list)
-> list[float]``, one finite float per sample. ``completions`` are the decoded responses cut at
their first special token (EOS, padding...). User functions are given as ``module:function``
and their output is checked with a clear error.

Built-in tasks (``builtin:<task>``), defined exactly so results compare across trainers:

``count-up``
    The prompt is one random digit ``d``; the ideal completion is the next 8 digits counting up
    mod 10 (``7`` -> ``89012345``). The reward is the fraction of the 8 positions that are
    correct. A uniformly random policy over the 14-token vocabulary scores about 0.03.
``reverse``
    The prompt is 5 random digits; the ideal completion is the same digits reversed
    (``31415`` -> ``51413``). The reward is the fraction of the 5 positions that are correct.
``calculator``
    The prompt is 4 random digits ``ABCD`` asking for the last digit of AB + CD (``3748`` ->
    ``5``); the reward is 1 when the model's last turn is exactly that digit, else 0 (a guess
    scores about 0.1). Meant for multi-turn rollouts with ``data.agent.function:
    builtin:calculator`` (see :mod:`ppojob_trainer.agent`): the model may call the calculator
    with operands it writes itself (four digits ``WXYZ``: WX + YZ) and read the value.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .algorithms.hooks import load_function, validate_rewards

BUILTIN_PREFIX = "builtin:"
COUNT_UP_LENGTH = 8
REVERSE_LENGTH = 5
CALCULATOR_ANSWER_LENGTH = 1
EVAL_BUILTIN_SIZE, EVAL_BUILTIN_SEED = 64, 20_250_101  # the fixed eval set of a built-in task

RewardFn = Callable[[list[str], list[str], list[Any]], Sequence[float]]
Prompt = str | list[dict[str, str]]
"""A prompt: plain text, or chat messages ``[{"role": ..., "content": ...}, ...]``."""


@dataclass(frozen=True)
class Example:
    """One prompt and its reference answer (None when the dataset has no label)."""

    prompt: Prompt
    label: Any = None


def as_prompt(value: Any) -> Prompt | None:
    """A dataset field as a prompt: a string, or a non-empty list of chat messages (objects
    with string ``role`` and ``content``); None when it is neither."""
    if isinstance(value, str):
        return value
    if (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        )
    ):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    return None


def _positional_score(completion: str, label: str) -> float:
    hits = sum(1 for i, ch in enumerate(label) if i < len(completion) and completion[i] == ch)
    return hits / len(label)


def count_up_answer(prompt: str) -> str:
    """The ideal count-up completion of a one-digit prompt: ``7`` -> ``89012345``."""
    d = int(prompt)
    return "".join(str((d + i) % 10) for i in range(1, COUNT_UP_LENGTH + 1))


def count_up_reward(prompts: list[str], completions: list[str], labels: list[Any]) -> list[float]:
    """Fraction of the 8 count-up positions the completion gets right."""
    return [
        _positional_score(c, lab if lab is not None else count_up_answer(p))
        for p, c, lab in zip(prompts, completions, labels, strict=True)
    ]


def reverse_reward(prompts: list[str], completions: list[str], labels: list[Any]) -> list[float]:
    """Fraction of the positions of the reversed prompt the completion gets right."""
    return [
        _positional_score(c, lab if lab is not None else p[::-1])
        for p, c, lab in zip(prompts, completions, labels, strict=True)
    ]


class Task:
    """A source of prompts: ``sample(n, rng)`` returns ``n`` examples."""

    name: str = "task"
    max_response_tokens: int | None = None

    def sample(self, n: int, rng: random.Random) -> list[Example]:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """The data position to checkpoint (built-in tasks draw from the rng alone: none)."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state` returned."""

    def eval_set(self) -> list[Example]:
        """The held-out evaluation examples when this task is ``data.evalPrompts``: a fixed
        set (the same every evaluation and every run)."""
        return self.sample(EVAL_BUILTIN_SIZE, random.Random(EVAL_BUILTIN_SEED))

    def digest(self) -> str:
        """Identifies the prompts (a checkpoint's data position is only valid for the same
        ones): built-in tasks by name, datasets by a digest of their examples."""
        return f"builtin:{self.name}"


class CountUpTask(Task):
    name = "count-up"
    max_response_tokens = COUNT_UP_LENGTH

    def sample(self, n: int, rng: random.Random) -> list[Example]:
        out = []
        for _ in range(n):
            d = str(rng.randrange(10))
            out.append(Example(d, count_up_answer(d)))
        return out


class ReverseTask(Task):
    name = "reverse"
    max_response_tokens = REVERSE_LENGTH

    def sample(self, n: int, rng: random.Random) -> list[Example]:
        out = []
        for _ in range(n):
            s = "".join(str(rng.randrange(10)) for _ in range(REVERSE_LENGTH))
            out.append(Example(s, s[::-1]))
        return out


class CalculatorTask(Task):
    name = "calculator"
    max_response_tokens = CALCULATOR_ANSWER_LENGTH

    def sample(self, n: int, rng: random.Random) -> list[Example]:
        out = []
        for _ in range(n):
            a, b = rng.randrange(100), rng.randrange(100)
            out.append(Example(f"{a:02d}{b:02d}", f"{(a + b) % 10}"))
        return out


def calculator_reward(prompts: list[str], completions: list[str], labels: list[Any]) -> list[float]:
    """1 when the completion (the model's last turn) is exactly the answer digit, else 0 (a
    long string of guesses earns nothing)."""
    out = []
    for p, c, lab in zip(prompts, completions, labels, strict=True):
        label = lab if lab is not None else f"{(int(p[:2]) + int(p[2:4])) % 10}"
        out.append(_positional_score(c, label) if len(c) == len(label) else 0.0)
    return out


class DatasetTask(Task):
    """Prompts from a dataset file, in epochs, shuffled per epoch when asked (seeded)."""

    def __init__(self, examples: list[Example], shuffle: bool, name: str = "dataset") -> None:
        if not examples:
            raise ValueError(f"data.prompts: dataset {name!r} has no examples")
        self.examples = examples
        self.shuffle = shuffle
        self.name = name
        self._order: list[int] = []
        self._pos = 0
        self._digest: str | None = None

    def sample(self, n: int, rng: random.Random) -> list[Example]:
        out = []
        while len(out) < n:
            if self._pos >= len(self._order):
                self._order = list(range(len(self.examples)))
                if self.shuffle:
                    rng.shuffle(self._order)
                self._pos = 0
            out.append(self.examples[self._order[self._pos]])
            self._pos += 1
        return out

    def state(self) -> dict[str, Any]:
        return {"order": list(self._order), "pos": self._pos}

    def eval_set(self) -> list[Example]:
        return list(self.examples)

    def digest(self) -> str:
        if self._digest is None:
            h = hashlib.sha256()
            for e in self.examples:
                h.update(json.dumps([e.prompt, e.label], sort_keys=True, default=str).encode())
                h.update(b"\n")
            self._digest = h.hexdigest()
        return self._digest

    def load_state(self, state: dict[str, Any]) -> None:
        self._order, self._pos = list(state.get("order", [])), int(state.get("pos", 0))


BUILTIN_TASKS: dict[str, tuple[type[Task], RewardFn]] = {
    "count-up": (CountUpTask, count_up_reward),
    "reverse": (ReverseTask, reverse_reward),
    "calculator": (CalculatorTask, calculator_reward),
}


def _read_saved_dataset(path: Path) -> list[dict[str, Any]]:
    """Rows of a directory written by ``datasets``' ``Dataset.save_to_disk`` (a
    ``DatasetDict``'s: its ``train`` split)."""
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"data.prompts: reading the saved dataset {path} needs the `datasets` package; "
            "install it in the trainer image (pip install datasets) or export the dataset "
            "to .jsonl"
        ) from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(
            f"data.prompts: {path} is a directory but not a dataset saved with "
            f"`datasets`' save_to_disk ({exc}); give a .jsonl, .json or .parquet file or such "
            "a directory"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ValueError(
                f"data.prompts: {path} holds the splits {sorted(loaded)} but no 'train' split; "
                f"point data.prompts at one split's directory, e.g. {path / sorted(loaded)[0]}"
            )
        loaded = loaded["train"]
    return loaded.to_list()


def _read_records(path: Path) -> list[dict[str, Any]]:
    if path.is_dir():
        return _read_saved_dataset(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        records = []
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"data.prompts: {path}:{i} is not valid JSON: {exc}") from None
        return records
    if suffix == ".json":
        doc = json.loads(path.read_text())
        if isinstance(doc, dict) and isinstance(doc.get("data"), list):
            doc = doc["data"]
        if not isinstance(doc, list):
            raise ValueError(f"data.prompts: {path} must hold a JSON list of objects")
        return doc
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(
                f"data.prompts: reading {path} needs pyarrow; install it in the trainer image "
                "or convert the dataset to .jsonl"
            ) from None
        return pq.read_table(path).to_pylist()
    raise ValueError(
        f"data.prompts: {path} is not a .jsonl, .json or .parquet file nor a directory saved "
        "with `datasets`' save_to_disk"
    )


def load_dataset(
    path: str | Path, prompt_key: str = "prompt", label_key: str = "label"
) -> list[Example]:
    """Examples of a dataset (a .jsonl, .json or .parquet file, or a ``save_to_disk``
    directory); every record needs a string ``prompt_key``."""
    from ppojob_trainer.preflight import dataset_problem

    missing = dataset_problem("data.prompts", str(path))
    if missing:
        raise ValueError(missing)
    path = Path(path)
    examples = []
    for i, rec in enumerate(_read_records(path)):
        prompt = as_prompt(rec.get(prompt_key)) if isinstance(rec, dict) else None
        if prompt is None:
            raise ValueError(
                f"data.prompts: record {i} of {path} has no {prompt_key!r} field holding a "
                f"string or chat messages ([{{role, content}}, ...]) (set data.promptKey to "
                f"the column holding the prompt)"
            )
        examples.append(Example(prompt, rec.get(label_key)))
    return examples


def make_task(
    prompts: str, prompt_key: str = "prompt", label_key: str = "label", shuffle: bool = True
) -> Task:
    """The task of ``data.prompts``: a built-in task or a dataset (file or saved directory)."""
    if prompts.startswith(BUILTIN_PREFIX):
        name = prompts[len(BUILTIN_PREFIX) :]
        if name not in BUILTIN_TASKS:
            raise ValueError(
                f"data.prompts: unknown built-in task {prompts!r}; "
                f"use one of {[BUILTIN_PREFIX + t for t in BUILTIN_TASKS]}"
            )
        return BUILTIN_TASKS[name][0]()
    return DatasetTask(load_dataset(prompts, prompt_key, label_key), shuffle, name=prompts)


class RewardScorer:
    """Scores completions with a reward function (built-in or ``module:function``); errors name
    ``field``, the config field the function came from."""

    def __init__(
        self, reward_function: str | None, prompts: str, field: str = "data.rewardFunction"
    ) -> None:
        spec = reward_function or prompts
        if spec.startswith(BUILTIN_PREFIX):
            name = spec[len(BUILTIN_PREFIX) :]
            if name not in BUILTIN_TASKS:
                raise ValueError(
                    f"{field}: unknown built-in reward {spec!r}; "
                    f"use one of {[BUILTIN_PREFIX + t for t in BUILTIN_TASKS]}"
                )
            self.fn: RewardFn = BUILTIN_TASKS[name][1]
        elif reward_function is None:
            raise ValueError(
                f"{field}: a dataset needs a reward function; "
                "set rewardFunction: package.module:function"
            )
        else:
            self.fn = load_function(spec, field)
        self.name = spec
        self.field = field

    def __call__(
        self, prompts: list[str], completions: list[str], labels: list[Any]
    ) -> list[float]:
        try:
            values = self.fn(list(prompts), list(completions), list(labels))
        except Exception as exc:
            raise ValueError(
                f"{self.field}: {self.name} raised {type(exc).__name__}: {exc}"
            ) from exc
        try:
            return validate_rewards(values, len(prompts), self.name).tolist()
        except ValueError as exc:  # name the field, as every other start-up or reward error does
            raise ValueError(f"{self.field}: {exc}") from None
