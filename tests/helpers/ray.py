"""Ray fixtures shared by the trainer and CLI tests (their conftest.py files import them).

`local_ray`: one loopback-only Ray session per test module (module scope), with 4 logical CPUs
so that a few actors and placement groups fit on a 2-core machine. Use it as a fixture argument;
Ray is shut down when the module's tests are done.

`ray_session`: `local_ray` plus a private cache for built-in models (`PPOJOB_CACHE_DIR`), per
module; a module whose every test needs it sets
`pytestmark = pytest.mark.usefixtures("ray_session")`.
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


@pytest.fixture(scope="module")
def ray_session(local_ray: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    mp.setenv("PPOJOB_CACHE_DIR", str(tmp_path_factory.mktemp("ppojob-cache")))
    try:
        yield
    finally:
        mp.undo()
