"""Load benchmark of the operator on the real API server, against a minimal kopf operator (floor).

etcd and kube-apiserver (built by hack/control-plane/build.sh, started by
tests/cluster/controlplane.py, with an audit log of the operators' requests) and the CRDs; no
KubeRay, scheduler or pods, so the figures are the operator's. Each operator runs as its own
process with a ServiceAccount token (ours: the chart's ClusterRole; the floor: the rules it
needs). The floor is the simplest possible kopf operator: one create handler that makes one
adopted ConfigMap with the official client.

(a) one job at a time: PPOJob created -> its RayJob (floor: ConfigMap) seen by a watch, p50.
    Each job finds the operator idle: the next is created once this one's status has settled
    and no watch event came for ``--single-quiet`` s (default 0.5). ``--single-quiet 0`` creates
    them back to back (the next job as soon as this one's child is seen, as before 2026-12-07),
    which also measures the previous job's last writes (its status, the trainer's Role and
    RoleBinding, kopf's handling of its children's watch events) on the same event loop.
(b) a burst of N jobs: total until every child is seen, p50 and p99 per-job latency, and the
    time until the last write of the burst (statuses settled, below)
(c) writes per job (from the API server's audit log: create/patch/update/delete by the operator)
(d) the operator's peak RSS
(e) each one-at-a-time job's requests (reads included) from its create to its child's create,
    from the audit log (which also logs the bench's creates of the jobs: time zero): the median
    job's are printed with their start and duration, and the p50 count is recorded
and the operator's and the API server's CPU seconds during the burst beside them.

End of a measurement: the operator is stopped only once every job's status has settled (ours:
``status.observedGeneration`` equals the job's generation and ``status.rayJobName`` names its
RayJob; the floor writes no status: kopf's last-handled-configuration annotation is on the job)
AND no watch event on any PPOJob or child of the namespace arrived for ``--quiet`` seconds
(default 2; measured from the watches' event times, not a sleep), so the writes that land after
the child (status patches, kopf's annotations) are all counted. The CPU seconds run from the
burst's first create to that point; the "settled" time is the burst's last watch event.
Figures are printed for both operators and as ratios ours / floor.

Run: .venv/bin/python bench/operator_load.py [--burst 300] [--single 20] [--quiet 2]
     [--single-quiet 0.5] [--grant-escalation] [--record [NAME]]

The trainer's Role and RoleBinding: the operator holds neither ``escalate`` nor ``bind`` on
roles, so the API server lists the operator's own (Cluster)RoleBindings to confirm each grants no
more than it holds. That list is a consistent read from the watch cache, which waits until the
cache has caught up with etcd (progress requested every 100 ms: k8s.io/apiserver
pkg/storage/cacher): the RoleBinding takes ~100 ms every time (the timeline shows it). Since
2026-12-01 both are posted beside the RayJob, off its path; ``--grant-escalation`` (``bind`` and
``escalate`` on roles, which skips both checks; the chart does not grant them: they would let the
operator grant, through any Role in any namespace, permissions it does not hold) shows whether
they still cost the child anything.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers.controlplane import ControlPlane, wait_until  # noqa: E402

FLOOR_OPERATOR = textwrap.dedent("""
    import logging, sys
    import kopf
    from kubernetes import client, config
    logging.basicConfig(level=logging.WARNING)
    config.load_kube_config()
    api = client.CoreV1Api()

    @kopf.on.startup()
    def configure(settings, **_):
        settings.posting.enabled = False

    @kopf.on.create("ppojob.io", "v1alpha1", "ppojobs")
    def create(body, name, namespace, **_):
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name},
              "data": {"image": body["spec"]["image"]}}
        kopf.adopt(cm, owner=body)
        api.create_namespaced_config_map(namespace, cm)

    kopf.run(standalone=True, namespaces=[sys.argv[1]])
""")

FLOOR_RULES = [
    {
        "apiGroups": ["ppojob.io"],
        "resources": ["ppojobs"],
        "verbs": ["get", "list", "watch", "patch"],
    },
    {"apiGroups": ["ppojob.io"], "resources": ["ppojobs/finalizers"], "verbs": ["update"]},
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["list", "watch"],
    },
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


class Watcher:
    """Per object (by name) in one namespace, from a watch of its own: the arrival time, the
    latest version; and the time of the latest event of any object (``last_event``)."""

    def __init__(self, kubeconfig: Path, namespace: str, plural: str) -> None:
        from kubernetes import client, config, watch

        api = client.ApiClient(config.new_client_from_config(str(kubeconfig)).configuration)
        self.seen: dict[str, float] = {}
        self.latest: dict[str, dict] = {}
        self.last_event = time.monotonic()
        self._w = watch.Watch()
        self._stopping = threading.Event()
        custom = client.CustomObjectsApi(api).list_namespaced_custom_object
        if plural == "configmaps":
            fn, args = client.CoreV1Api(api).list_namespaced_config_map, (namespace,)
        elif plural == "ppojobs":
            fn, args = custom, ("ppojob.io", "v1alpha1", namespace, "ppojobs")
        else:
            fn, args = custom, ("ray.io", "v1", namespace, "rayjobs")
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self._thread.start()

    def _run(self, fn, args) -> None:
        try:
            for ev in self._w.stream(fn, *args, timeout_seconds=3600):
                now = time.monotonic()
                obj = ev["object"]
                if not isinstance(obj, dict):
                    obj = obj.to_dict()
                name = obj["metadata"]["name"]
                self.seen.setdefault(name, now)
                self.latest[name] = obj
                self.last_event = now
        except Exception:
            # Watch.stop() shuts the socket down under the blocked read, which then raises
            # (urllib3 ProtocolError "Response ended prematurely"): the expected end
            if not self._stopping.is_set():
                raise

    def stop(self) -> None:
        self._stopping.set()
        self._w.stop()
        self._thread.join(10)


def ours_settled(job: dict) -> bool:
    """Our operator's status of a job follows its RayJob: the spec's generation observed and
    the RayJob named (no KubeRay here, so the phase stays what a RayJob without status gives)."""
    st = job.get("status") or {}
    gen = job["metadata"].get("generation")
    return st.get("observedGeneration") == gen and bool(st.get("rayJobName"))


def floor_settled(job: dict) -> bool:
    """The floor writes no status: kopf has recorded the handled spec (its last write)."""
    notes = job["metadata"].get("annotations") or {}
    return "kopf.zalando.org/last-handled-configuration" in notes


def job_body(name: str, ns: str) -> dict:
    return {
        "apiVersion": "ppojob.io/v1alpha1",
        "kind": "PPOJob",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"image": "ghcr.io/ppojob/trainer:0.1.0", "model": {"path": "builtin:tiny-llama"}},
    }


def audit_writes(log: Path, user: str, names: set[str]) -> collections.Counter:
    """Write requests of ``user`` per (job, verb resource), from the audit log."""
    counts: collections.Counter = collections.Counter()
    with log.open() as f:
        for line in f:
            ev = json.loads(line)
            if ev.get("stage") != "ResponseComplete" or ev["user"]["username"] != user:
                continue
            if ev["verb"] not in ("create", "patch", "update", "delete"):
                continue
            ref = ev.get("objectRef") or {}
            job = (ref.get("name") or "").removesuffix("-trainer")
            if job in names:
                what = ref.get("resource", "") + (
                    "/" + ref["subresource"] if ref.get("subresource") else ""
                )
                counts[(job, f"{ev['verb']} {what}")] += 1
    return counts


def _stamp(ts: str) -> float:
    """An audit timestamp (RFC 3339 with microseconds) as seconds since the epoch."""
    from datetime import datetime

    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def request_timelines(log: Path, user: str, names: list[str], child: str) -> list[list[tuple]]:
    """For each job created one at a time: every request of ``user`` (reads included) from the
    job's create (the admin's, in the audit log) until its ``child`` create was answered, as
    (start ms, duration ms, "verb resource[/sub] name") from the job's create."""
    created: dict[str, float] = {}
    answered: dict[str, float] = {}
    mine: list[tuple[float, float, str, str]] = []
    with log.open() as f:
        for line in f:
            ev = json.loads(line)
            if ev.get("stage") != "ResponseComplete":
                continue
            ref = ev.get("objectRef") or {}
            start, end = _stamp(ev["requestReceivedTimestamp"]), _stamp(ev["stageTimestamp"])
            if ev["user"]["username"] != user:
                if ev["verb"] == "create" and ref.get("resource") == "ppojobs":
                    created[ref.get("name") or ""] = start
                    answered[ref.get("name") or ""] = end
                continue
            what = ref.get("resource", "") + (
                "/" + ref["subresource"] if ref.get("subresource") else ""
            )
            mine.append((start, end, f"{ev['verb']} {what} {ref.get('name') or ''}".strip(), what))
    mine.sort()
    out = []
    for n in names:
        t0 = created.get(n)
        if t0 is None:
            continue
        done = [
            e
            for s, e, label, what in mine
            if s >= t0 and what == child and label.rsplit(" ", 1)[-1] == n
        ]
        if not done:
            continue
        out.append(
            [(0.0, (answered[n] - t0) * 1e3, f"(the job's create, {n})")]
            + [
                ((s - t0) * 1e3, (e - s) * 1e3, label)
                for s, e, label, _ in mine
                if t0 <= s <= done[0]
            ]
        )
    return out


def measure(
    cp: ControlPlane,
    label: str,
    argv_for,
    plural: str,
    rules,
    single: int,
    burst: int,
    tmp: Path,
    audit: Path,
    settled: Callable[[dict], bool],
    quiet: float,
    single_quiet: float,
) -> dict:
    ns = f"bench-{label}"
    sa = f"{label}-operator"
    cp.kubectl("create", "namespace", ns)
    cp.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": sa, "namespace": ns},
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRole",
                "metadata": {"name": sa},
                "rules": rules,
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": sa},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": sa,
                },
                "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
            },
        ]
    )
    kubeconfig = cp.token_kubeconfig(tmp / f"{label}.kubeconfig", ns, sa)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
    env["KUBECONFIG"] = str(kubeconfig)
    env["PYTHONPATH"] = os.pathsep.join(str(REPO / d) for d in ("api", "operator"))
    log = (tmp / f"{label}.log").open("w")
    op = subprocess.Popen(argv_for(ns), env=env, stdout=log, stderr=subprocess.STDOUT)
    watcher = Watcher(cp.admin_kubeconfig, ns, plural)
    jobs = Watcher(cp.admin_kubeconfig, ns, "ppojobs")
    from kubernetes import client, config

    api = client.CustomObjectsApi(config.new_client_from_config(str(cp.admin_kubeconfig)))

    def create(name: str) -> float:
        t = time.monotonic()
        api.create_namespaced_custom_object(
            "ppojob.io", "v1alpha1", ns, "ppojobs", job_body(name, ns)
        )
        return t

    out: dict = {}
    try:
        create("warmup")  # the operator is ready once its first child appears
        wait_until(lambda: op.poll() is None and "warmup" in watcher.seen, 120, f"{label} warm-up")
        names = [f"single-{i}" for i in range(single)]
        lat = []
        for n in names:
            t = create(n)
            wait_until(lambda n=n: n in watcher.seen, 30, n, interval=0.002)
            lat.append(watcher.seen[n] - t)
            # one at a time: the next job finds the operator idle (this job's status written,
            # no watch event for `single_quiet` s), not busy with this one's last writes
            wait_until(
                lambda n=n: (
                    n in jobs.latest
                    and settled(jobs.latest[n])
                    and time.monotonic() - max(jobs.last_event, watcher.last_event) >= single_quiet
                ),
                30,
                f"{n} settles",
                interval=0.01,
            )
        out["single"] = lat
        bnames = [f"burst-{i}" for i in range(burst)]
        api_pid = cp.components["kube-apiserver"].proc.pid
        c0 = (cpu_s(op.pid), cpu_s(api_pid))
        with ThreadPoolExecutor(8) as ex:
            started = dict(zip(bnames, ex.map(create, bnames), strict=True))
        wait_until(
            lambda: all(n in watcher.seen for n in bnames), 900, f"{label} burst", interval=0.02
        )
        first = min(started.values())
        out["total"] = max(watcher.seen[n] for n in bnames) - first
        # Then until every job's status has settled and no PPOJob or child has changed for
        # `quiet` seconds (by the watches' event times), so that late writes are counted.
        every = ["warmup", *names, *bnames]

        def quiet_and_settled() -> bool:
            if not all(n in jobs.latest and settled(jobs.latest[n]) for n in every):
                return False
            return time.monotonic() - max(jobs.last_event, watcher.last_event) >= quiet

        wait_until(quiet_and_settled, 900, f"{label} statuses settle", interval=0.02)
        out["cpu_op"], out["cpu_api"] = cpu_s(op.pid) - c0[0], cpu_s(api_pid) - c0[1]
        out["settle"] = max(jobs.last_event, watcher.last_event) - first
        out["lat"] = [watcher.seen[n] - started[n] for n in bnames]
        out["rss"] = rss_peak_mb(op.pid)
    finally:
        watcher.stop()
        jobs.stop()
        op.terminate()
        try:
            op.wait(15)
        except subprocess.TimeoutExpired:
            op.kill()
            op.wait()
        log.close()
    # every write of the operator until it stopped (the audit log is blocking: a write is
    # logged before it is answered)
    user = f"system:serviceaccount:{ns}:{sa}"
    counts = audit_writes(audit, user, set(names) | set(bnames))
    per_job = collections.Counter()
    for (job, what), v in counts.items():
        if job in names:
            per_job[what] += v
    out["per_job"] = {k: v / len(names) for k, v in sorted(per_job.items())}
    out["burst_writes"] = sum(v for (j, _), v in counts.items() if j in bnames) / burst
    out["timelines"] = request_timelines(audit, user, names, plural)
    return out


RECORD_KEYS = (
    "single_p50",
    "burst_total",
    "burst_settled",
    "burst_p50",
    "burst_p99",
    "burst_cpu_operator",
    "burst_cpu_apiserver",
    "writes_per_job_single",
    "writes_per_job_burst",
    "peak_rss_mb",
)
"""The record's keys of the printed rows, in their order (``ppojob.``, ``floor.``, ``ratio.``)."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--burst", type=int, default=300)
    ap.add_argument("--single", type=int, default=20)
    ap.add_argument(
        "--quiet",
        type=float,
        default=2.0,
        help="seconds without a watch event on any PPOJob or child that end the measurement, "
        "once every job's status has settled",
    )
    ap.add_argument(
        "--single-quiet",
        type=float,
        default=0.5,
        help="one at a time: after a job's child is seen, wait until its status has settled and "
        "no watch event came for this many seconds before the next job (0: back to back)",
    )
    ap.add_argument(
        "--grant-escalation",
        action="store_true",
        help="also grant our operator `bind` and `escalate` on roles (the chart does not): the API "
        "server then skips the escalation checks of the trainer's Role and RoleBinding",
    )
    from bench.records import Figure, add_record_arguments, write_record

    add_record_arguments(ap, "operator_load")
    args = ap.parse_args()
    from ppojob_operator.rbac import OPERATOR_RULES

    rules = list(OPERATOR_RULES)
    if args.grant_escalation:
        rules.append(
            {
                "apiGroups": ["rbac.authorization.k8s.io"],
                "resources": ["roles"],
                "verbs": ["bind", "escalate"],
            }
        )

    with tempfile.TemporaryDirectory(prefix="operator-load-") as d:
        tmp = Path(d)
        audit = tmp / "audit.log"
        policy = tmp / "audit-policy.yaml"
        policy.write_text(
            json.dumps(
                {
                    "apiVersion": "audit.k8s.io/v1",
                    "kind": "Policy",
                    "omitStages": ["RequestReceived"],
                    "rules": [
                        {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
                        {  # the bench's creates of the jobs (each job's time zero)
                            "level": "Metadata",
                            "verbs": ["create"],
                            "resources": [{"group": "ppojob.io", "resources": ["ppojobs"]}],
                        },
                        {"level": "None"},
                    ],
                }
            )
        )
        cp = ControlPlane(
            tmp / "cp",
            apiserver_args=[
                f"--audit-policy-file={policy}",
                f"--audit-log-path={audit}",
                "--audit-log-mode=blocking",
            ],
        )
        cp.start(controllers=False)
        try:
            res = {
                "ppojob": measure(
                    cp,
                    "ppojob",
                    lambda ns: [
                        sys.executable,
                        "-m",
                        "ppojob_operator",
                        f"--namespace={ns}",
                        "--metrics-port=0",
                        "--health-port=0",
                        "--log-level=WARNING",
                    ],
                    "rayjobs",
                    rules,
                    args.single,
                    args.burst,
                    tmp,
                    audit,
                    ours_settled,
                    args.quiet,
                    args.single_quiet,
                ),
                "floor": measure(
                    cp,
                    "floor",
                    lambda ns: [sys.executable, "-c", FLOOR_OPERATOR, ns],
                    "configmaps",
                    FLOOR_RULES,
                    args.single,
                    args.burst,
                    tmp,
                    audit,
                    floor_settled,
                    args.quiet,
                    args.single_quiet,
                ),
            }
        finally:
            cp.stop()
    ours, floor = res["ppojob"], res["floor"]
    rows = [
        (
            "(a) one at a time: PPOJob -> child, ms p50",
            lambda r: statistics.median(r["single"]) * 1e3,
        ),
        (f"(b) burst {args.burst}: total until every child, s", lambda r: r["total"]),
        (f"(b) burst {args.burst}: until the last write (settled), s", lambda r: r["settle"]),
        ("(b) burst latency p50, s", lambda r: pct(r["lat"], 50)),
        ("(b) burst latency p99, s", lambda r: pct(r["lat"], 99)),
        ("(b) burst CPU: operator, s", lambda r: r["cpu_op"]),
        ("(b) burst CPU: kube-apiserver, s", lambda r: r["cpu_api"]),
        ("(c) writes per job, one at a time", lambda r: sum(r["per_job"].values())),
        ("(c) writes per job, burst", lambda r: r["burst_writes"]),
        ("(d) operator peak RSS, MB", lambda r: r["rss"]),
    ]
    print(f"{'measure':48s} {'ppojob':>10s} {'floor':>10s} {'ratio':>8s}")
    figures: dict[str, Figure] = {}
    for (label, fn), key in zip(rows, RECORD_KEYS, strict=True):
        a, b = fn(ours), fn(floor)
        ratio = a / b if b else float("nan")
        print(f"{label:48s} {a:10.2f} {b:10.2f} {ratio:7.2f}x")
        unit, digits = ("ms", 1) if key == "single_p50" else ("", 2)
        figures[f"ppojob.{key}"] = Figure(a, unit, digits)
        figures[f"floor.{key}"] = Figure(b, unit, digits)
        if b:
            figures[f"ratio.{key}"] = Figure(ratio, "x", 1)
    print("writes per job (one at a time), ppojob:")
    for k, v in ours["per_job"].items():
        print(f"    {k:44s} {v:6.2f}")
    print("writes per job (one at a time), floor:")
    for k, v in floor["per_job"].items():
        print(f"    {k:44s} {v:6.2f}")
    for label, res in (("ppojob", ours), ("floor", floor)):
        lines = res["timelines"]
        if not lines:
            continue
        ends = [t[-1][0] + t[-1][1] for t in lines]
        mid = lines[ends.index(statistics.median_low(ends))]
        count = statistics.median(len(t) - 1 for t in lines)
        print(
            f"{label}: requests from the job's create to its child's (audit log; the median "
            f"job, {len(mid) - 1} requests; p50 over jobs: {count})"
        )
        figures[f"{label}.requests_to_child_p50"] = Figure(count, "", 1)
        for start, took, what in mid:
            print(f"    +{start:6.1f} ms  {took:5.1f} ms  {what}")
    if args.record:
        write_record(args.record, figures, load=args.load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
