"""The async API client reuses its Authorization header for a moment instead of running the
client's token refresh hook (the kubeconfig loader's re-applies the whole kubeconfig) on every
request, and still picks up a refreshed token once that moment has passed or after a 401."""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from ppojob_operator import k8s
from tests.helpers.ophelpers import serve_on_loopback


def _run(statuses: list[int], steps: list[float], monkeypatch) -> tuple[list[str], int]:
    """One request per entry of ``steps`` (seconds the clock moves before it); returns the
    Authorization headers the server saw and how often the refresh hook ran."""
    seen: list[str] = []
    hook_calls = 0
    clock = [1000.0]
    monkeypatch.setattr(k8s, "_clock", lambda: clock[0])

    async def handle(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("Authorization", ""))
        status = statuses.pop(0) if statuses else 200
        return web.json_response({"kind": "Status"}, status=status)

    async def main() -> None:
        nonlocal hook_calls
        runner, url = await serve_on_loopback(handle)
        k8s.configure(url, token="t0")
        cfg = k8s._state.config

        def hook(c) -> None:  # like the kubeconfig loader's: sets the current token
            nonlocal hook_calls
            hook_calls += 1
            c.api_key = {"authorization": f"t{hook_calls}"}

        cfg.refresh_api_key_hook = hook
        try:
            for step in steps:
                clock[0] += step
                with contextlib.suppress(k8s.ApiError):  # the 401
                    await k8s.arequest("GET", "/api/v1/namespaces/a/configmaps/b")
        finally:
            await k8s.aclose()
            await runner.cleanup()

    asyncio.run(main())
    return seen, hook_calls


def test_the_refresh_hook_runs_once_per_interval(monkeypatch):
    half = k8s.AUTH_REFRESH_S / 2
    seen, calls = _run([], [0, 0, half, half + 0.01, 0], monkeypatch)
    assert calls == 2
    assert seen == ["Bearer t1"] * 3 + ["Bearer t2"] * 2


def test_a_401_makes_the_next_request_refresh_the_token(monkeypatch):
    seen, calls = _run([401], [0, 0, 0], monkeypatch)
    assert calls == 2
    assert seen == ["Bearer t1", "Bearer t2", "Bearer t2"]


def test_configure_reads_kubeconfig_as_set_when_it_is_called(tmp_path, monkeypatch) -> None:
    """The kubernetes client reads ``$KUBECONFIG`` once, when its config module is first
    imported: ``configure`` passes the variable's value at the time of the call (a process that
    sets it later, as the operator's tests do, gets its own cluster, not ``~/.kube/config``)."""
    import kubernetes.config  # imported first: the client's default is fixed from here on

    assert kubernetes.config is not None
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:6443"}}]
users: [{name: u, user: {token: t0k3n}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "")  # not in a pod
    monkeypatch.setattr(k8s._state, "config", None, raising=False)
    k8s.configure()
    assert k8s._state.config.host == "https://127.0.0.1:6443"
