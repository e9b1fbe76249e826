"""Load benchmark of the operator against kmock (in-memory Kubernetes API emulator).

The emulator runs here (a thread), the operator in its own process (as in production), and the
PPOJobs are created by a third process. Times are taken inside the emulator when it stores an
object, so they include the operator's watch, handler and request latency.

(a) one job at a time: PPOJob stored -> RayJob stored, and -> first status write
(b) a burst of N jobs: total time until all RayJobs exist, p50/p99 per-job latency
(c) API requests per job (from the emulator's requests), writes attributed
(d) the operator's peak RSS

Run: .venv/bin/python bench/operator_load.py [--burst 500] [--single 20]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "operator"))

from kmockenv import Emulator, wait_for  # noqa: E402

FLOOR = {"single_ms": 3.0, "burst_s": 1.9, "p50_s": 0.76, "p99_s": 1.38, "writes": 3, "rss": 130}

CREATOR = textwrap.dedent("""
    import json, sys, time, urllib.request
    from concurrent.futures import ThreadPoolExecutor
    url, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    def post(i):
        body = {"apiVersion": "ppojob.io/v1alpha1", "kind": "PPOJob",
                "metadata": {"name": f"{mode}-{i}", "namespace": "ns1", "uid": f"uid-{mode}-{i}"},
                "spec": {"image": "img:1"}}
        req = urllib.request.Request(url + "/apis/ppojob.io/v1alpha1/namespaces/ns1/ppojobs",
            data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req).read()
    def exists(i):
        try:
            urllib.request.urlopen(f"{url}/apis/ray.io/v1/namespaces/ns1/rayjobs/{mode}-{i}").read()
            return True
        except Exception:
            return False
    if mode == "single":
        for i in range(n):
            post(i)
            deadline = time.time() + 10
            while not exists(i) and time.time() < deadline:
                time.sleep(0.005)
            time.sleep(0.05)  # let the status write land before the next job
    else:
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(post, range(n)))
""")

OPERATOR = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.WARNING)
    from ppojob_operator import handlers
    handlers.run(namespaces=["ns1"], host=sys.argv[1], post_events=False)
""")


class Recorder:
    """Wraps the emulator's request handling: timestamps and request counts, no growing log."""

    def __init__(self, em: Emulator) -> None:
        self.t: dict[tuple[str, str], float] = {}
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        km = em.km
        cls = type(km)
        orig = cls._handle

        async def handle(self_, request):
            resp = await orig(self_, request)
            path = request.url.path
            method = request.method.value
            watch = request.params.get("watch") == "true"
            parts = path.strip("/").split("/")
            now = time.monotonic()
            name = None
            if method == "POST":
                name = (request.data or {}).get("metadata", {}).get("name")
                kind = parts[-1]
                if kind in ("ppojobs", "rayjobs"):
                    self.t.setdefault((kind, name), now)
            elif "ppojobs" in parts and len(parts) > parts.index("ppojobs") + 1:
                name = parts[parts.index("ppojobs") + 1]
                if method == "PATCH" and path.endswith("/status"):
                    self.t.setdefault(("status", name), now)
            job = (name or "").rsplit("-trainer", 1)[0]
            if job:
                if method in ("POST", "PATCH"):
                    what = (
                        "status"
                        if path.endswith("/status")
                        else "kopf"
                        if method == "PATCH" and "ppojobs" in parts
                        else f"create {parts[-1]}"
                    )
                    if not (method == "POST" and parts[-1] == "ppojobs"):
                        self.counts[job]["w:" + what] += 1
                elif method == "GET" and not watch:
                    self.counts[job]["r:" + parts[-2] if len(parts) > 1 else "r"] += 1
            return resp

        cls._handle = handle

        async def clear_periodically():
            while True:
                km._requests.clear()  # kmock matches against its whole log: keep it short
                await asyncio.sleep(0.2)

        em.call(lambda: asyncio.ensure_future(clear_periodically()))


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def rss_peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--burst", type=int, default=500)
    ap.add_argument("--single", type=int, default=20)
    args = ap.parse_args()
    with Emulator() as em:
        import urllib.request

        req = urllib.request.Request(
            em.url + "/api/v1/namespaces",
            data=json.dumps(
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns1"}}
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(req).read()
        rec = Recorder(em)
        op = subprocess.Popen([sys.executable, "-c", OPERATOR, em.url])
        try:
            # the operator is ready once it watches PPOJobs; wait for a probe job's RayJob
            subprocess.run([sys.executable, "-c", CREATOR, em.url, "warmup", "1"], check=True)
            wait_for(lambda: ("rayjobs", "warmup-0") in rec.t, timeout=60)
            wait_for(lambda: ("status", "warmup-0") in rec.t, timeout=10)
            time.sleep(0.3)  # settle: a quiet job makes no more requests

            subprocess.run(
                [sys.executable, "-c", CREATOR, em.url, "single", str(args.single)], check=True
            )
            names = [f"single-{i}" for i in range(args.single)]
            wait_for(lambda: all(("status", n) in rec.t for n in names), timeout=30)
            time.sleep(0.5)
            to_rj = [rec.t[("rayjobs", n)] - rec.t[("ppojobs", n)] for n in names]
            to_st = [rec.t[("status", n)] - rec.t[("ppojobs", n)] for n in names]
            counts = collections.Counter()
            for n in names:
                counts.update(rec.counts[n])
            per_job = {k: v / len(names) for k, v in sorted(counts.items())}
            writes = sum(v for k, v in per_job.items() if k.startswith("w:"))
            reads = sum(v for k, v in per_job.items() if k.startswith("r:"))

            t0 = time.monotonic()
            subprocess.run(
                [sys.executable, "-c", CREATOR, em.url, "burst", str(args.burst)], check=True
            )
            bnames = [f"burst-{i}" for i in range(args.burst)]
            wait_for(
                lambda: all(("rayjobs", n) in rec.t for n in bnames), timeout=300, interval=0.05
            )
            first = min(rec.t[("ppojobs", n)] for n in bnames)
            total = max(rec.t[("rayjobs", n)] for n in bnames) - first
            lat = [rec.t[("rayjobs", n)] - rec.t[("ppojobs", n)] for n in bnames]
            wait_for(lambda: all(("status", n) in rec.t for n in bnames), timeout=120)
            rss = rss_peak_mb(op.pid)
            del t0
        finally:
            op.terminate()
            try:
                op.wait(10)
            except subprocess.TimeoutExpired:
                op.kill()
                op.wait()

    print(f"{'measure':44s} {'ppojob':>10s} {'floor':>10s}")
    print(
        f"{'(a) one at a time: PPOJob -> RayJob, ms (p50)':44s} "
        f"{statistics.median(to_rj) * 1000:10.1f} {FLOOR['single_ms']:10.1f}"
    )
    print(
        f"{'(a) one at a time: PPOJob -> status, ms (p50)':44s} "
        f"{statistics.median(to_st) * 1000:10.1f} {'-':>10s}"
    )
    print(
        f"{f'(b) burst {args.burst}: total until all RayJobs, s':44s} "
        f"{total:10.2f} {FLOOR['burst_s']:10.2f}"
    )
    print(f"{'(b) burst p50 latency, s':44s} {pct(lat, 50):10.2f} {FLOOR['p50_s']:10.2f}")
    print(f"{'(b) burst p99 latency, s':44s} {pct(lat, 99):10.2f} {FLOOR['p99_s']:10.2f}")
    print(f"{'(c) writes per job':44s} {writes:10.1f} {FLOOR['writes']:10d}")
    print(f"{'(c) reads per job (non-watch GETs)':44s} {reads:10.1f} {'-':>10s}")
    for k, v in per_job.items():
        print(f"      {k:38s} {v:10.2f}")
    print("    minimum writes: 5 children + 1 status + 1 kopf bookkeeping = 7")
    print(f"{'(d) operator peak RSS, MB':44s} {rss:10.0f} {FLOOR['rss']:10d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
