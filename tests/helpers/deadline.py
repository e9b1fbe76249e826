"""A deadline on every test (pytest plugin, loaded by tests/conftest.py).

A test that hangs (a rendezvous nobody joins, a pod that never starts) would otherwise run into
CI's own limit on the whole suite, which prints nothing about where it was. With this plugin each
test, its setup and teardown included, gets :func:`limit` seconds:

- at the deadline a ``SIGALRM`` raises :class:`DeadlineExceeded` where the test's setup or call
  is, so the test fails with its traceback and the run goes on with the next one (and the
  fixtures' teardowns run, stopping the control plane or the node). Teardown itself gets no
  signal: pytest lets only an ``Exception`` pass from one finalizer to the next, so a deadline
  raised in one would skip the rest;
- code that never returns to the interpreter (a C call blocked on a socket) cannot see that
  signal, and a teardown does not get it: :mod:`faulthandler` then prints every thread's stack
  and ends the process after a grace of :func:`grace` more seconds.

``PPOJOB_TEST_DEADLINE`` sets the limit in seconds (1800 by default: the real-node fixture's cold
start, images built and imported, took 12.5 min on a fresh machine, the longest real-node test
about 6 min).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Iterator

import pytest

DEFAULT_S = 1800.0
VARIABLE = "PPOJOB_TEST_DEADLINE"


class DeadlineExceeded(BaseException):
    """Raised in a test at its deadline. A ``BaseException``, so the ``except Exception`` of a
    polling loop under test does not swallow it; pytest records it as the test's failure."""


def limit() -> float:
    """Seconds a test may take: ``PPOJOB_TEST_DEADLINE``, else :data:`DEFAULT_S`."""
    raw = os.environ.get(VARIABLE)
    if raw is None:
        return DEFAULT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{VARIABLE}={raw!r}: seconds a test may take, a number above 0")
    return seconds


_stderr: dict[str, int] = {}


def pytest_configure(config: pytest.Config) -> None:
    # a copy of the terminal's stderr, taken before any test runs: while a test runs, pytest's
    # capture puts a file of its own on descriptor 2, and a dump written there would be lost
    _stderr["fd"] = os.dup(sys.stderr.fileno())


def pytest_unconfigure(config: pytest.Config) -> None:
    fd = _stderr.pop("fd", None)
    if fd is not None:
        os.close(fd)


def _alarms() -> bool:
    """Whether this process can arm the signal (the main thread, on a system with SIGALRM)."""
    return threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGALRM")


def grace(seconds: float) -> float:
    """How long after the deadline :mod:`faulthandler` ends a process the signal did not reach."""
    return min(120.0, seconds)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    seconds = limit()
    if not _alarms():
        yield
        return

    def on_alarm(signum: int, frame: object) -> None:
        raise DeadlineExceeded(f"{item.nodeid} was still running after {seconds:g} s ({VARIABLE})")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    faulthandler.dump_traceback_later(
        seconds + grace(seconds), exit=True, file=_stderr.get("fd", sys.stderr.fileno())
    )
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    # before any finalizer runs: from here only the backstop acts (see the module's docstring)
    if _alarms():
        signal.setitimer(signal.ITIMER_REAL, 0)
