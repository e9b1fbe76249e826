"""Run kmock (an in-memory Kubernetes API emulator) and the real operator, each in a thread.

Shared by the integration tests and ``bench/operator_load.py``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import kmock
from kmock._internal import parsing

_parse_path = parsing.parse_path


def _parse_path_with_namespaces(path: str) -> Any:
    # kmock 0.8 cannot parse the cluster-wide namespace list (`/api/v1/namespaces`), which kopf
    # requests to observe namespaces; everything else goes to kmock's own parser.
    if path.rstrip("/") == "/api/v1/namespaces":
        return parsing.ParsedPath(group="", version="v1", plural="namespaces")
    return _parse_path(path)


parsing.parse_path = _parse_path_with_namespaces

VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}
RESOURCES = {
    "v1/namespaces": ("Namespace", False, set()),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, set()),
    "ppojob.io/v1alpha1/ppojobs": ("PPOJob", True, {"status"}),
    "ray.io/v1/rayjobs": ("RayJob", True, {"status"}),
    "v1/configmaps": ("ConfigMap", True, set()),
    "v1/serviceaccounts": ("ServiceAccount", True, set()),
    "v1/events": ("Event", True, set()),
    "rbac.authorization.k8s.io/v1/roles": ("Role", True, set()),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True, set()),
    "scheduling.x-k8s.io/v1alpha1/podgroups": ("PodGroup", True, set()),
}


def wait_for(pred: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> Any:
    """Poll ``pred`` until it returns something truthy; raise TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout}s")
        time.sleep(interval)


class Emulator:
    """kmock's KubernetesEmulator served over HTTP from a background thread."""

    def __init__(self) -> None:
        self.url = ""
        self.km: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="kmock", daemon=True)

    def __enter__(self) -> Emulator:
        self._thread.start()
        if not self._ready.wait(20):
            raise TimeoutError("kmock did not start")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with kmock.KubernetesEmulator() as km, kmock.Server(km) as server:
            for key, (kind, namespaced, subs) in RESOURCES.items():
                km.resources[key] = kmock.ResourceInfo(
                    kind=kind, namespaced=namespaced, verbs=VERBS, subresources=subs
                )
            self.km = km
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in the emulator's loop (thread-safe access to its state)."""
        assert self._loop is not None

        async def _do() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(_do(), self._loop).result(10)

    def requests(self) -> list[Any]:
        return self.call(lambda: list(self.km._requests))

    def clear_log(self) -> None:
        self.call(self.km._requests.clear)


class Operator:
    """The real kopf operator (``handlers.run``) in a background thread."""

    def __init__(self, url: str, namespaces: list[str] | None = None, **config: Any) -> None:
        from ppojob_operator.handlers import OperatorConfig

        self.url = url
        self.namespaces = namespaces
        self.config = OperatorConfig(**config)
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="operator", daemon=True)

    def _main(self) -> None:
        from ppojob_operator import handlers

        try:
            handlers.run(
                namespaces=self.namespaces or [],
                clusterwide=not self.namespaces,
                config=self.config,
                host=self.url,
                stop_flag=self.stop_flag,
                ready_flag=self.ready_flag,
                post_events=False,
            )
        except BaseException as exc:  # surfaced by the tests
            self.error = exc

    def __enter__(self) -> Operator:
        self._thread.start()
        if not self.ready_flag.wait(30):
            raise TimeoutError(f"operator did not become ready: {self.error!r}")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop_flag.set()
        self._thread.join(30)
