"""Load benchmark of the operator against kmock (in-memory Kubernetes API emulator).

The emulator, the operator (as in production) and the PPOJob creator each run in a process of
their own. Times are taken inside the emulator when it stores an
object, so they include the operator's watch, handler and request latency.

(a) one job at a time: PPOJob stored -> RayJob stored, and -> first status write
(b) a burst of N jobs: total time until all RayJobs exist, p50/p99 per-job latency
(c) API requests per job (from the emulator's requests), writes attributed
(d) the operator's peak RSS
and the CPU seconds of each process (operator, emulator, creator) per phase, so a slow emulator
or load generator shows up instead of being charged to the operator. kmock matches each request
against its whole request log; the emulator keeps only in-flight requests in it (see kmockenv),
and runs in its own process.

``--floor`` also measures the simplest possible kopf operator (one handler creating one child
with the official client) in this same harness, printed beside ours.

Run: .venv/bin/python bench/operator_load.py [--burst 500] [--single 20] [--floor]
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "operator"))

from kmockenv import Emulator, wait_for  # noqa: E402

CREATOR = textwrap.dedent("""
    import json, sys, time, urllib.request
    from concurrent.futures import ThreadPoolExecutor
    url, mode, n, child = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    HDR = {"X-Bench": "creator"}  # the recorder leaves the creator's requests out of (c)
    def post(i):
        body = {"apiVersion": "ppojob.io/v1alpha1", "kind": "PPOJob",
                "metadata": {"name": f"{mode}-{i}", "namespace": "ns1", "uid": f"uid-{mode}-{i}"},
                "spec": {"image": "img:1"}}
        req = urllib.request.Request(url + "/apis/ppojob.io/v1alpha1/namespaces/ns1/ppojobs",
            data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **HDR})
        urllib.request.urlopen(req).read()
    def exists(i):
        try:
            req = urllib.request.Request(f"{url}{child}/{mode}-{i}", headers=HDR)
            urllib.request.urlopen(req).read()
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

# The simplest possible kopf operator: one handler, one child (a ConfigMap named like the job,
# adopted), created with the official client's typed API. Same emulator, creator and clock.
FLOOR_OPERATOR = textwrap.dedent("""
    import logging, sys
    import kopf
    from kubernetes import client
    logging.basicConfig(level=logging.WARNING)
    cfg = client.Configuration()
    cfg.host = sys.argv[1]
    api = client.CoreV1Api(client.ApiClient(cfg))

    @kopf.on.login()
    def login(**_):
        return kopf.ConnectionInfo(server=sys.argv[1], insecure=True)

    @kopf.on.startup()
    def configure(settings, **_):
        settings.posting.enabled = False

    @kopf.on.create("ppojob.io", "v1alpha1", "ppojobs")
    def create(body, name, namespace, **_):
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name},
              "data": {"image": body["spec"]["image"]}}
        kopf.adopt(cm, owner=body)
        api.create_namespaced_config_map(namespace, cm)

    kopf.run(standalone=True, namespaces=["ns1"])
""")


class Recorder:
    """Wraps the emulator's request handling: timestamps and request counts per job.

    ``target`` is the plural of the child whose creation ends a job's latency (``rayjobs``, or
    ``configmaps`` for the floor operator)."""

    def __init__(self, em: Emulator, target: str) -> None:
        self.target = target
        self.t: dict[tuple[str, str], float] = {}
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        em.after_each_request(self.record)

    def record(self, _km, request) -> None:
        creator = request.headers.get("X-Bench") == "creator"
        path = request.url.path
        method = request.method.value
        watch = request.params.get("watch") == "true"
        parts = path.strip("/").split("/")
        now = time.monotonic()
        name = None
        if method == "POST":
            name = (request.data or {}).get("metadata", {}).get("name")
            kind = parts[-1]
            if kind in ("ppojobs", self.target) and not (creator and kind != "ppojobs"):
                self.t.setdefault((kind, name), now)
        elif "ppojobs" in parts and len(parts) > parts.index("ppojobs") + 1:
            name = parts[parts.index("ppojobs") + 1]
            if method == "PATCH" and path.endswith("/status"):
                self.t.setdefault(("status", name), now)
        elif method == "GET" and not watch and len(parts) > 1:
            name = parts[-1]  # a GET of a child, named after its job
        job = (name or "").rsplit("-trainer", 1)[0]
        if job and not creator:
            if method in ("POST", "PATCH", "PUT", "DELETE"):
                what = (
                    "status"
                    if path.endswith("/status")
                    else "kopf"
                    if method == "PATCH" and "ppojobs" in parts
                    else f"{method.lower()} {parts[-1] if method == 'POST' else parts[-2]}"
                )
                if not (method == "POST" and parts[-1] == "ppojobs"):
                    self.counts[job]["w:" + what] += 1
            elif method == "GET" and not watch:
                self.counts[job]["r:get " + parts[-2]] += 1


def emulator_main(conn, target: str) -> None:
    """The emulator's own process: serve kmock, answer the parent's queries over ``conn``."""
    with Emulator(bounded_log=True) as em:
        rec = Recorder(em, target)
        conn.send(em.url)
        while True:
            cmd, *args = conn.recv()
            if cmd == "stop":
                return
            if cmd == "missing":  # how many of names lack a timestamp of this kind
                kind, names = args
                conn.send(em.call(lambda: sum((kind, n) not in rec.t for n in names)))  # noqa: B023
            elif cmd == "times":
                conn.send(em.call(lambda: dict(rec.t)))
            elif cmd == "counts":
                conn.send(em.call(lambda: {k: dict(v) for k, v in rec.counts.items()}))


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


CHILD_PATH = {
    "rayjobs": "/apis/ray.io/v1/namespaces/ns1/rayjobs",
    "configmaps": "/api/v1/namespaces/ns1/configmaps",
}


def run_creator(url: str, mode: str, n: int, target: str) -> float:
    """Run the creator process to completion; its CPU seconds."""
    p = subprocess.Popen([sys.executable, "-c", CREATOR, url, mode, str(n), CHILD_PATH[target]])
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise RuntimeError(f"creator {mode} failed: {p.returncode}")
    return ru.ru_utime + ru.ru_stime


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def rss_peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(script: str, target: str, single: int, burst: int) -> dict:
    """Run one operator against a fresh emulator process: (a)-(d) and CPU per process."""
    parent, child = mp.Pipe()
    emu = mp.get_context("fork").Process(target=emulator_main, args=(child, target), daemon=True)
    emu.start()
    url = parent.recv()

    def ask(*cmd):
        parent.send(cmd)
        return parent.recv()

    def wait_all(kind, names, timeout):
        wait_for(lambda: ask("missing", kind, names) == 0, timeout=timeout, interval=0.05)

    import urllib.request

    req = urllib.request.Request(
        url + "/api/v1/namespaces",
        data=json.dumps(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns1"}}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    urllib.request.urlopen(req).read()
    op = subprocess.Popen([sys.executable, "-c", script, url])
    has_status = target == "rayjobs"
    out: dict = {}
    try:
        # the operator is ready once it watches PPOJobs; wait for a probe job's child
        run_creator(url, "warmup", 1, target)
        wait_all(target, ["warmup-0"], 60)
        if has_status:
            wait_all("status", ["warmup-0"], 10)
        time.sleep(0.3)  # settle: a quiet job makes no more requests

        names = [f"single-{i}" for i in range(single)]
        c0 = (cpu_s(op.pid), cpu_s(emu.pid))
        run_creator(url, "single", single, target)
        wait_all("status" if has_status else target, names, 30)
        time.sleep(0.5)
        out["cpu_single"] = (cpu_s(op.pid) - c0[0], cpu_s(emu.pid) - c0[1])
        t = ask("times")
        out["to_child"] = [t[(target, n)] - t[("ppojobs", n)] for n in names]
        out["to_status"] = (
            [t[("status", n)] - t[("ppojobs", n)] for n in names] if has_status else []
        )
        all_counts = ask("counts")
        counts = collections.Counter()
        for n in names:
            counts.update(all_counts.get(n, {}))
        out["per_job"] = {k: v / len(names) for k, v in sorted(counts.items())}

        bnames = [f"burst-{i}" for i in range(burst)]
        c0 = (cpu_s(op.pid), cpu_s(emu.pid))
        out["cpu_creator"] = run_creator(url, "burst", burst, target)
        wait_all(target, bnames, 600)
        out["cpu_burst"] = (cpu_s(op.pid) - c0[0], cpu_s(emu.pid) - c0[1])
        t = ask("times")
        first = min(t[("ppojobs", n)] for n in bnames)
        out["total"] = max(t[(target, n)] for n in bnames) - first
        out["lat"] = [t[(target, n)] - t[("ppojobs", n)] for n in bnames]
        if has_status:
            wait_all("status", bnames, 300)
        time.sleep(0.5)
        all_counts = ask("counts")
        bcounts = collections.Counter()
        for n in bnames:
            bcounts.update(all_counts.get(n, {}))
        out["burst_writes"] = sum(v for k, v in bcounts.items() if k.startswith("w:")) / burst
        out["rss"] = rss_peak_mb(op.pid)
    finally:
        op.terminate()
        try:
            op.wait(10)
        except subprocess.TimeoutExpired:
            op.kill()
            op.wait()
        parent.send(("stop",))
        emu.join(10)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--burst", type=int, default=500)
    ap.add_argument("--single", type=int, default=20)
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also measure the simplest possible kopf operator (one handler, one child, "
        "official client) in this same harness and print it beside ours",
    )
    args = ap.parse_args()
    res = {"ppojob": measure(OPERATOR, "rayjobs", args.single, args.burst)}
    if args.floor:
        res["floor"] = measure(FLOOR_OPERATOR, "configmaps", args.single, args.burst)
    cols = list(res)

    def row(label, fn, fmt="10.2f"):
        cells = []
        for c in cols:
            v = fn(res[c])
            cells.append(f"{v:{fmt}}" if isinstance(v, (int, float)) else f"{v:>10s}")
        print(f"{label:48s} " + " ".join(cells))

    def writes(r):
        return sum(v for k, v in r["per_job"].items() if k.startswith("w:"))

    def reads(r):
        return sum(v for k, v in r["per_job"].items() if k.startswith("r:"))

    print(f"{'measure':48s} " + " ".join(f"{c:>10s}" for c in cols))
    row(
        "(a) one at a time: PPOJob -> child, ms (p50)",
        lambda r: statistics.median(r["to_child"]) * 1000,
        "10.1f",
    )
    row(
        "(a) one at a time: PPOJob -> status, ms (p50)",
        lambda r: statistics.median(r["to_status"]) * 1000 if r["to_status"] else "-",
        "10.1f",
    )
    row(f"(b) burst {args.burst}: total until all children, s", lambda r: r["total"])
    row("(b) burst p50 latency, s", lambda r: pct(r["lat"], 50))
    row("(b) burst p99 latency, s", lambda r: pct(r["lat"], 99))
    row("(b) burst CPU: operator, s", lambda r: r["cpu_burst"][0])
    row("(b) burst CPU: emulator (kmock), s", lambda r: r["cpu_burst"][1])
    row("(b) burst CPU: creator, s", lambda r: r["cpu_creator"])
    row("(b) operator CPU per job, ms", lambda r: r["cpu_burst"][0] / args.burst * 1000, "10.1f")
    row(
        "(a) operator CPU per job one at a time, ms",
        lambda r: r["cpu_single"][0] / args.single * 1000,
        "10.1f",
    )
    row("(c) writes per job (one at a time)", writes, "10.1f")
    row("(c) writes per job (burst)", lambda r: r["burst_writes"], "10.1f")
    row("(c) reads per job (non-watch GETs)", reads, "10.1f")
    keys = sorted({k for c in cols for k in res[c]["per_job"]})
    for k in keys:
        row(f"      {k}", lambda r, k=k: r["per_job"].get(k, 0.0))
    print("    minimum writes (ppojob): 5 children + 1 status + 1 kopf bookkeeping = 7")
    row("(d) operator peak RSS, MB", lambda r: r["rss"], "10.0f")
    return 0


if __name__ == "__main__":
    sys.exit(main())
