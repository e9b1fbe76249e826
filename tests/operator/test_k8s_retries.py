"""The async API client retries transient answers within the request (429 after its
Retry-After, 5xx, a reset connection, a 409 Conflict on a patch) and never a final one."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from ppojob_operator import k8s
from tests.helpers.ophelpers import serve_on_loopback


def _status(code: int, reason: str) -> bytes:
    return json.dumps({"kind": "Status", "code": code, "reason": reason}).encode()


async def _serve(answers: list[str], seen: list[str]) -> tuple[web.AppRunner, str]:
    async def handle(request: web.Request) -> web.StreamResponse:
        seen.append(request.method)
        kind = answers.pop(0) if answers else "ok"
        if kind == "429":
            return web.Response(status=429, headers={"Retry-After": "0"}, body=_status(429, "x"))
        if kind == "500":
            return web.Response(status=500, body=_status(500, "InternalError"))
        if kind == "reset":
            assert request.transport is not None
            request.transport.abort()
            return web.Response(status=502)
        if kind == "conflict":
            return web.Response(status=409, body=_status(409, "Conflict"))
        if kind == "exists":
            return web.Response(status=409, body=_status(409, "AlreadyExists"))
        if kind == "404":
            return web.Response(status=404, body=_status(404, "NotFound"))
        return web.json_response({"ok": True})

    return await serve_on_loopback(handle)


def _run(answers: list[str], method: str, body: Any = None) -> tuple[Any, list[str]]:
    seen: list[str] = []

    async def main() -> Any:
        runner, url = await _serve(list(answers), seen)
        k8s.configure(url)
        try:
            return await k8s.arequest(method, "/api/v1/namespaces/a/configmaps/b", body)
        except k8s.ApiError as exc:
            return exc
        finally:
            await k8s.aclose()
            await runner.cleanup()

    return asyncio.run(main()), seen


def test_transient_answers_are_retried_until_success():
    out, seen = _run(["429", "500", "reset", "conflict"], "PATCH", {"a": 1})
    assert out == {"ok": True}
    assert seen == ["PATCH"] * 5


def test_final_answers_are_not_retried():
    out, seen = _run(["exists"], "POST", {"a": 1})  # AlreadyExists: an answer (create_or_get)
    assert isinstance(out, k8s.ApiError) and out.status == 409 and seen == ["POST"]
    out, seen = _run(["conflict"], "POST", {"a": 1})  # a 409 on a create is never re-sent
    assert isinstance(out, k8s.ApiError) and seen == ["POST"]
    out, seen = _run(["404"], "GET")
    assert isinstance(out, k8s.ApiError) and out.status == 404 and seen == ["GET"]


def test_retries_are_bounded():
    out, seen = _run(["500"] * 20, "GET")
    assert isinstance(out, k8s.ApiError) and out.status == 500
    assert len(seen) == k8s.TRANSIENT_ATTEMPTS
