"""The per-test deadline (tests/helpers/deadline.py), on hanging tests in a pytest of their own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.deadline import limit

ROOT = Path(__file__).resolve().parents[1]

HANGS = """
import signal
import threading

import pytest


def test_hangs():
    threading.Event().wait()


def test_blocks_the_alarm_then_hangs():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    threading.Event().wait()


def test_after():
    pass


@pytest.fixture(scope="module")
def outer(tmp_path_factory):
    yield
    (tmp_path_factory.getbasetemp().parent / "outer-torn-down").touch()


@pytest.fixture
def slow_teardown(outer):
    yield
    threading.Event().wait(3)  # a teardown past the deadline, but within its grace


def test_with_a_slow_teardown(slow_teardown):
    pass
"""


def _pytest(tmp_path: Path, *args: str, deadline: str = "1") -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_hang.py").write_text(HANGS)
    env = {**os.environ, "PPOJOB_TEST_DEADLINE": deadline, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.helpers.deadline",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_hang.py"),
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )


def test_a_hung_test_fails_at_its_deadline_and_the_run_goes_on(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, "-k", "test_hangs or test_after")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "test_hang.py::test_hangs was still running after 1 s (PPOJOB_TEST_DEADLINE)" in (
        proc.stdout
    )
    assert "1 failed, 1 passed" in proc.stdout


def test_a_hang_the_signal_cannot_reach_ends_the_process_with_every_stack(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, "-k", "test_blocks_the_alarm_then_hangs")
    assert proc.returncode != 0
    assert "Timeout (0:00:02)!" in proc.stderr
    assert "in test_blocks_the_alarm_then_hangs" in proc.stderr


def test_a_teardown_past_the_deadline_is_left_to_finish_and_every_finalizer_runs(
    tmp_path: Path,
) -> None:
    """pytest lets only an ``Exception`` pass between finalizers: a deadline raised in one would
    skip the rest (here the module fixture's). Teardown gets the backstop only."""
    proc = _pytest(
        tmp_path, "-k", "test_with_a_slow_teardown", "--basetemp", str(tmp_path / "t"), deadline="2"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
    assert (tmp_path / "outer-torn-down").exists()


@pytest.mark.parametrize("raw", ["soon", "0", "-5"])
def test_a_bad_deadline_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv("PPOJOB_TEST_DEADLINE", raw)
    with pytest.raises(ValueError, match="PPOJOB_TEST_DEADLINE"):
        limit()
