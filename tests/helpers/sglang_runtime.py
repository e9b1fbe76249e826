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


def run_driver(driver: Path) -> dict[str, Any]:
    """Run ``driver`` against the SGLang runtime and return the JSON of its last line. Without
    the runtime the test is skipped, except under CI, where a missing cache is an error."""
    folder = runtime_dir()
    if not (folder / "sglang" / "srt").is_dir():
        message = f"no SGLang runtime in {folder}: fill it with `make install`"
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"{message} (under CI a missing cache is an error)")
        pytest.skip(message)
    ours = [str(Path(m.__file__).parents[1]) for m in (ppojob_api, ppojob_trainer)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), *ours])}
    proc = subprocess.run(
        [sys.executable, str(driver)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
