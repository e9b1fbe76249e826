"""Run kmock (an in-memory Kubernetes API emulator) and the real operator, each in a thread.

Shared by the integration tests and ``bench/operator_load.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import kmock
from kmock._internal import parsing

from ppojob_operator import k8s
from tests.helpers.timeouts import scaled

_arequest, _aclose = k8s.arequest, k8s.aclose

_parse_path = parsing.parse_path


def _parse_path_with_namespaces(path: str) -> Any:
    # kmock 0.8 cannot parse the cluster-wide namespace list (`/api/v1/namespaces`), which kopf
    # requests to observe namespaces; everything else goes to kmock's own parser.
    if path.rstrip("/") == "/api/v1/namespaces":
        return parsing.ParsedPath(group="", version="v1", plural="namespaces")
    return _parse_path(path)


parsing.parse_path = _parse_path_with_namespaces


# id(emulator) -> functions called with (emulator, request) after each request it served
# (kmock's classes are slotted: an instance cannot carry a wrapper of its own).
_AFTER: dict[int, list[Callable[[Any, Any], None]]] = {}


def _forget_request(km: Any, request: Any) -> None:
    """Keep only in-flight requests in kmock's log (it matches each request against its whole
    log, so an unbounded log makes a load test measure kmock)."""
    with contextlib.suppress(ValueError):
        km._requests.remove(request)


def _install_resource_versions() -> None:
    """Give every stored object a ``metadata.resourceVersion`` that changes on each write.

    kmock 0.8 has none, so kopf cannot tell a stale watch event (one that predates its own
    bookkeeping patch) from a new one and re-runs the handlers of a just-created object. A real
    API server has them; kopf's consistency wait (``settings.persistence.consistency_timeout``)
    relies on them. Only the version is emulated, not optimistic concurrency.
    """
    cls = kmock.KubernetesEmulator
    if getattr(cls, "_ppojob_rv", False):
        return
    orig = cls._handle
    counter = itertools.count(1)

    async def _handle(self: Any, request: Any) -> Any:
        if (
            request.resource is not None
            and request.action in (kmock.action.CREATE, kmock.action.UPDATE)
            and isinstance(request.data, dict)
        ):
            meta = request.data.get("metadata")
            if not isinstance(meta, dict):
                meta = request.data["metadata"] = {}
            meta["resourceVersion"] = str(next(counter))
        try:
            return await orig(self, request)
        finally:
            for hook in _AFTER.get(id(self), ()):
                hook(self, request)

    get_objs = cls._KubernetesEmulator__get_objs  # type: ignore[attr-defined]

    def _get_objs(self: Any, request: Any, strict: bool) -> list[Any]:
        # kmock scans every stored object per request; a named, strict lookup is one dict hit.
        if strict and request.name is not None:
            obj = self._objects._objects.get((request.resource, request.namespace, request.name))
            if obj is not None:
                return [obj]
        return get_objs(self, request, strict)

    cls._handle = _handle
    cls._KubernetesEmulator__get_objs = _get_objs  # type: ignore[attr-defined]
    cls._ppojob_rv = True


_install_resource_versions()

VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}
RESOURCES = {
    "v1/namespaces": ("Namespace", False, set()),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, set()),
    "ppojob.io/v1alpha1/ppojobs": ("PPOJob", True, {"status"}),
    "ray.io/v1/rayjobs": ("RayJob", True, {"status"}),
    "v1/configmaps": ("ConfigMap", True, set()),
    "v1/serviceaccounts": ("ServiceAccount", True, set()),
    "v1/events": ("Event", True, set()),
    "v1/pods": ("Pod", True, {"status"}),
    "rbac.authorization.k8s.io/v1/roles": ("Role", True, set()),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True, set()),
    "scheduling.x-k8s.io/v1alpha1/podgroups": ("PodGroup", True, set()),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", True, set()),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", True, set()),
    "kueue.x-k8s.io/v1beta1/workloads": ("Workload", True, set()),
}


class Kube:
    """Blocking API calls for test code, through the operator's own client (``k8s.arequest``)
    run in an event loop of its own on a background thread (the operator's loop is another).
    Bound to the unpatched ``arequest``, so a test that patches the operator's calls does not
    patch its own."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _run(self, coro: Any) -> Any:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=self._loop.run_forever, name="kube", daemon=True
                )
                self._thread.start()
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> dict[str, Any]:
        return self._run(_arequest(method, path, body, content_type))

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None if it does not exist."""
        try:
            return self.request("GET", k8s.path_for(api_version, kind, namespace, name))
        except k8s.ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        body: dict[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any] | None:
        """JSON merge patch; None if the object is gone."""
        path = k8s.path_for(api_version, kind, namespace, name, subresource)
        try:
            return self.request("PATCH", path, body, "application/merge-patch+json")
        except k8s.ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def close(self) -> None:
        """Close the session and stop the loop (the next call starts them again)."""
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(_aclose(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


kube = Kube()
"""The tests' blocking API client (configured by ``k8s.configure``, like the operator's)."""


class OperatorFailed(AssertionError):
    """The operator's thread raised (the exception is the ``__cause__``)."""


_RUNNING: set[Operator] = set()
"""Operators between ``__enter__`` and ``__exit__``: :func:`wait_for` watches their threads."""


def wait_for(pred: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> Any:
    """Poll ``pred`` until it returns something truthy; raise TimeoutError after ``timeout``,
    and :class:`OperatorFailed` as soon as a running operator's thread has raised. The bound is
    scaled by ``PPOJOB_TEST_TIMEOUT_SCALE`` (tests/helpers/timeouts.py)."""
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    while True:
        for op in list(_RUNNING):
            op.check()
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout}s")
        time.sleep(interval)


class Emulator:
    """kmock's KubernetesEmulator served over HTTP from a background thread."""

    def __init__(self, *, bounded_log: bool = False) -> None:
        self.bounded_log = bounded_log
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
            hooks = _AFTER.setdefault(id(km), [])
            if self.bounded_log:
                hooks.append(_forget_request)
            self.km = km
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            try:
                await self._stop.wait()
            finally:
                _AFTER.pop(id(km), None)

    def after_each_request(self, fn: Callable[[Any, Any], None]) -> None:
        """Call ``fn(emulator, request)`` in the emulator's loop after each request served."""
        _AFTER[id(self.km)].append(fn)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in the emulator's loop (thread-safe access to its state)."""
        assert self._loop is not None

        async def _do() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(_do(), self._loop).result(10)

    def requests(self) -> list[Any]:
        """The request log (with ``bounded_log``, only the requests still being served)."""
        return self.call(lambda: list(self.km._requests))

    def clear_log(self) -> None:
        self.call(self.km._requests.clear)


class Operator:
    """The real kopf operator (``handlers.run``) in a background thread."""

    def __init__(self, url: str, namespaces: list[str] | None = None, **config: Any) -> None:
        from ppojob_operator.state import OperatorConfig

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
        except BaseException as exc:  # raised in the test's thread: check(), wait_for, exit
            self.error = exc

    def check(self) -> None:
        """Raise :class:`OperatorFailed` if the operator's thread has raised."""
        if self.error is not None:
            raise OperatorFailed(f"the operator's thread raised {self.error!r}") from self.error

    def __enter__(self) -> Operator:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.ready_flag.wait(0.05):  # ready, or the thread ended (it raised)
            self.check()
            if not self._thread.is_alive():
                raise OperatorFailed("the operator's thread ended before it was ready")
            if time.monotonic() > deadline:
                raise TimeoutError("operator did not become ready within 30s")
        _RUNNING.add(self)
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        _RUNNING.discard(self)
        self.stop_flag.set()
        self._thread.join(30)
        if exc_type is None:  # an exception of the test's own goes first
            self.check()


def job_pod(status: dict[str, Any], *, image: str = "i", container: str = "c") -> dict[str, Any]:
    """A pod of job ``demo`` in ns1 (labelled as KubeRay's pods of our jobs are), with ``status``
    written as the kubelet or the scheduler would leave it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "demo-head-x",
            "namespace": "ns1",
            "labels": {"ppojob.io/job": "demo"},
        },
        "spec": {"containers": [{"name": container, "image": image}]},
        "status": status,
    }
