"""Shared fixtures of the trainer tests.

`local_ray`: one loopback-only Ray session per test module (module scope), with 4 logical CPUs
so that a few actors and placement groups fit on a 2-core machine. Use it as a fixture argument;
Ray is shut down when the module's tests are done.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

LOCAL_RAY_CPUS = 4


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    from ppojob_trainer.runtime import shutdown_ray, start_local_ray

    shutdown_ray()  # a previous module's session, if one leaked
    start_local_ray(num_cpus=LOCAL_RAY_CPUS)
    try:
        yield
    finally:
        shutdown_ray()
