"""Failures a person can act on: one line naming the field and the cause, never a Ray traceback.

Imports neither torch nor Ray (the command lines import it before they know Ray is installed).
"""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
MAX_LENGTH = 600


class StartupError(RuntimeError):
    """A worker could not start (model not found, reward module not importable, ...).

    Its text is one line that names the field and the cause, e.g.
    ``the rollout worker could not start: data.rewardFunction: 'rewards:score': cannot import
    module 'rewards': ModuleNotFoundError: No module named 'rewards'``."""


def one_line(exc: BaseException) -> str:
    """`exc`'s message on one line, without ANSI colour codes."""
    text = _ANSI.sub("", str(exc))
    text = " ".join(part.strip() for part in text.splitlines() if part.strip())
    if len(text) > MAX_LENGTH:
        text = text[: MAX_LENGTH - 3] + "..."
    return text or type(exc).__name__


_NAMES_A_FIELD = re.compile(r"^[a-z][A-Za-z0-9]*(\.[A-Za-z0-9\[\]]+)+: ")


def naming(field: str, exc: BaseException, about: str) -> str:
    """`exc` on one line, prefixed with `field` when it is about `about` (the field's value, e.g.
    a model directory) and names no field itself: a library's own error, such as transformers'
    "Unrecognized model in DIR", names none."""
    text = one_line(exc)
    if _NAMES_A_FIELD.match(text) or about not in text:
        return text
    return f"{field}: {text}"


def describe_failure(exc: BaseException) -> str:
    """One line for a failed run: the root cause, unwrapped from Ray's task and actor errors."""
    if isinstance(exc, StartupError):
        return one_line(exc)
    cause = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError keeps the original
    if isinstance(cause, BaseException) and cause is not exc:
        return describe_failure(cause)
    name = type(exc).__name__
    if "RayActorError" in name or "ActorDiedError" in name:
        # the last line of the worker's traceback holds the original error
        lines = [ln.strip() for ln in _ANSI.sub("", str(exc)).splitlines() if ln.strip()]
        for line in reversed(lines):
            if re.match(r"^[A-Za-z_][\w.]*(Error|Exception): ", line):
                return line.split(": ", 1)[1][:MAX_LENGTH]
        return "a Ray worker died: " + (lines[-1] if lines else name)[:MAX_LENGTH]
    notes = [one_line(Exception(n)) for n in getattr(exc, "__notes__", None) or []]
    where = f" ({'; '.join(notes)})" if notes else ""  # e.g. which user hook raised it
    return f"{name}: {one_line(exc)}{where}"
