"""The pinned SGLang package, installed without its dependencies into a test cache by
``make install``, and the drivers that run SGLang's own code from it in a process of their own
(its CUDA-only imports and global state stay out of pytest's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ppojob_api
import ppojob_trainer


def runtime_dir() -> Path:
    """Where the SGLang runtime lies (``PPOJOB_SGLANG_RUNTIME``, else the virtualenv's cache)."""
    env = os.environ.get("PPOJOB_SGLANG_RUNTIME")
    return Path(env) if env else Path(sys.prefix) / "test-cache" / "sglang-runtime"


def driver_env(**extra: str | None) -> dict[str, str]:
    """The environment of a driver process: the SGLang runtime and our packages on its path,
    and ``extra`` (a None there removes the variable). Without the runtime the test is
    skipped, except under CI, where a missing cache is an error."""
    folder = runtime_dir()
    if not (folder / "sglang" / "srt").is_dir():
        message = f"no SGLang runtime in {folder}: fill it with `make install`"
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"{message} (under CI a missing cache is an error)")
        pytest.skip(message)
    ours = [str(Path(m.__file__).parents[1]) for m in (ppojob_api, ppojob_trainer)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), *ours]), **extra}
    return {k: v for k, v in env.items() if v is not None}


def run_driver(driver: Path) -> dict[str, Any]:
    """Run ``driver`` against the SGLang runtime and return the JSON of its last line."""
    env = driver_env()
    proc = subprocess.run(
        [sys.executable, str(driver)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def start_driver(driver: Path, *args: str, **extra_env: str | None) -> subprocess.Popen[str]:
    """Start ``driver args...`` against the SGLang runtime (several may run side by side); its
    last line of output is its JSON result (:func:`driver_result`)."""
    return subprocess.Popen(
        [sys.executable, str(driver), *args],
        env=driver_env(**extra_env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def driver_results(procs: list[subprocess.Popen[str]], timeout_s: float) -> list[dict[str, Any]]:
    """Each started driver's JSON result, waited for in order within ``timeout_s`` in all.
    Once one has failed, or the time is up, the ones still running are killed (they wait on a
    peer that is gone) and answer ``{"error": ...}``, as does one that failed (its stderr's
    tail) or printed no result."""
    import time

    deadline = time.monotonic() + timeout_s
    results: list[dict[str, Any]] = []
    failed = False
    for proc in procs:
        if failed and proc.poll() is None:
            proc.kill()
            proc.wait()
            results.append({"error": "killed: a peer driver failed first"})
            continue
        try:
            stdout, stderr = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            results.append({"error": f"still running after {timeout_s:.0f} s: killed"})
            failed = True
            continue
        lines = stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            results.append({"error": stderr[-3000:] or f"exit status {proc.returncode}"})
            failed = True
        else:
            results.append(json.loads(lines[-1]))
    return results
