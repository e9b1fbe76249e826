"""A fault-injecting HTTP proxy between one client (our operator) and the real API server.

The client speaks plain HTTP to 127.0.0.1:<port> with its bearer token; the proxy forwards over
TLS to the API server and, with seeded probabilities, answers 500, answers 429 with Retry-After,
answers 409 Conflict to updates, resets the connection before forwarding, resets it after the
server has acted (the client never learns the outcome), and drops watch streams after a few
seconds. It runs in its own thread and event loop and stops with :meth:`FaultProxy.stop`.
"""

from __future__ import annotations

import asyncio
import json
import random
import ssl
import threading
from collections import Counter
from pathlib import Path
from typing import Any

HOP = {"host", "connection", "keep-alive", "transfer-encoding", "content-length", "upgrade"}


def _status(code: int, reason: str, message: str) -> bytes:
    return json.dumps(
        {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": f"injected by the fault proxy: {message}",
            "reason": reason,
            "code": code,
        }
    ).encode()


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        ca: Path,
        *,
        seed: int = 1,
        p500: float = 0.05,
        p429: float = 0.05,
        p409: float = 0.05,
        p_reset_before: float = 0.03,
        p_reset_after: float = 0.03,
        watch_seconds: tuple[float, float] = (1.0, 5.0),
        hold_after: tuple[str, int] | None = None,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.ca = ca
        self.rng = random.Random(seed)
        self.p = dict(p500=p500, p429=p429, p409=p409, before=p_reset_before, after=p_reset_after)
        self.watch_seconds = watch_seconds
        self.hold_after = hold_after
        """``(plural, n)``: once the server has created ``n`` objects of ``plural`` through the
        proxy, every later write waits in it (counted in :attr:`held`) until :meth:`release`,
        which answers them 503 unsent: the client is stopped at that point however fast it
        runs (and killed there, what it had not sent is lost with it)."""
        self.held = 0
        self.injected: Counter = Counter()
        # objects the API server created (201) through the proxy, per collection (resource
        # plural): the operator's children, counted per job by the test
        self.created: Counter = Counter()
        self.pending = 0
        """Requests other than watches being handled now (held writes included, until
        :meth:`release` answers them)."""
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._released: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the fault proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop and self._stop:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread:
            self._thread.join(15)

    def release(self) -> None:
        """Answer the writes :attr:`hold_after` holds (503, never sent), and pass every later
        one."""
        if self._loop and self._released is not None:
            self._loop.call_soon_threadsafe(self._released.set)

    def _run(self) -> None:
        asyncio.run(self._main())

    def _pick(self, method: str, watch: bool) -> str:
        if watch:
            return "watch"
        r = self.rng.random()
        for kind in ("p500", "p429", "before", "after"):
            if r < self.p[kind]:
                return kind
            r -= self.p[kind]
        if method in ("PATCH", "PUT") and r < self.p["p409"]:
            return "p409"
        return "pass"

    async def _main(self) -> None:
        import aiohttp
        from aiohttp import web

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        ctx = ssl.create_default_context(cafile=str(self.ca))
        # Bodies pass through as the server sent them: the API server gzips responses over
        # 128 KiB (a list of 100+ jobs, KubeRay's CRDs) and the client must get the gzip bytes
        # that its Content-Encoding header names (an earlier version decoded them here and
        # forwarded the header: every big list failed to decode and kopf's watcher went silent).
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ctx, limit=200),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,
        )

        self._released = asyncio.Event()

        async def handle(request: web.Request) -> web.StreamResponse:
            watch = request.query.get("watch") in ("true", "1")
            self.pending += not watch
            try:
                return await forward(request, watch)
            finally:
                self.pending -= not watch

        async def forward(request: web.Request, watch: bool) -> web.StreamResponse:
            plural, n = self.hold_after or ("", 0)
            writes = request.method in ("POST", "PUT", "PATCH", "DELETE")
            if plural and writes and self.created[plural] >= n and not self._released.is_set():
                self.held += 1
                await self._released.wait()
                self.injected["dropped"] += 1  # (its client is gone: it never left it)
                return web.Response(
                    status=503,
                    body=_status(503, "ServiceUnavailable", "a held write"),
                    content_type="application/json",
                )
            kind = self._pick(request.method, watch)
            self.injected[kind] += 1
            if kind == "p500":
                return web.Response(
                    status=500,
                    body=_status(500, "InternalError", "500"),
                    content_type="application/json",
                )
            if kind == "p429":
                return web.Response(
                    status=429,
                    headers={"Retry-After": "1"},
                    body=_status(429, "TooManyRequests", "429"),
                    content_type="application/json",
                )
            if kind == "p409":
                return web.Response(
                    status=409,
                    body=_status(409, "Conflict", "the object has been modified"),
                    content_type="application/json",
                )
            if kind == "before":
                assert request.transport is not None
                request.transport.abort()
                return web.Response(status=502)
            headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
            body = await request.read()
            up = await session.request(
                request.method, self.upstream + request.path_qs, headers=headers, data=body or None
            )
            try:
                if request.method == "POST" and up.status == 201:
                    # what the server really created (the client may never learn it: "after")
                    self.created[request.path.rsplit("/", 1)[-1]] += 1
                if kind == "after":
                    await up.read()
                    assert request.transport is not None
                    request.transport.abort()
                    return web.Response(status=502)
                resp_headers = {k: v for k, v in up.headers.items() if k.lower() not in HOP}
                if up.headers.get("Content-Encoding") == "gzip":
                    self.injected["gzip-passed"] += 1  # not a fault: counted to show it is covered
                if not watch:
                    data = await up.read()
                    return web.Response(status=up.status, body=data, headers=resp_headers)
                resp = web.StreamResponse(status=up.status, headers=resp_headers)
                await resp.prepare(request)
                deadline = self._loop.time() + self.rng.uniform(*self.watch_seconds)
                while True:
                    left = deadline - self._loop.time()
                    if left <= 0:
                        self.injected["watch-dropped"] += 1
                        assert request.transport is not None
                        request.transport.abort()
                        return resp
                    try:
                        chunk = await asyncio.wait_for(up.content.readany(), left)
                    except asyncio.TimeoutError:
                        continue
                    if not chunk:
                        return resp
                    await resp.write(chunk)
            finally:
                up.release()

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        server: Any = site._server
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()
            await session.close()
