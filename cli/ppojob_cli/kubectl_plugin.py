"""`kubectl ppojob`: PPOJobs at the terminal (a kubectl plugin, installed as `kubectl-ppojob`).

    kubectl ppojob list [-A]
    kubectl ppojob describe NAME        progress, conditions, pods per role, checkpoints, events
    kubectl ppojob logs NAME --role actor|critic|rollout|head [--tail N] [--container C]
    kubectl ppojob watch NAME [--once | --until-done] [--timeout S]
    kubectl ppojob suspend NAME | resume NAME
    kubectl ppojob checkpoints NAME

Every command takes the usual --kubeconfig, --context and -n/--namespace (default: the
context's namespace, else `default`). kubectl finds the plugin as the executable
`kubectl-ppojob` on PATH (pip installs it with the `ppojob` distribution) and passes it
everything after `ppojob`.

The formatting functions are pure (they take the objects the API returned); the ``Cluster``
class is the one place that talks to the API server, through the `kubernetes` client.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from ppojob_api.spec import GROUP, PLURAL, VERSION
from ppojob_operator.builders import JOB_LABEL, ROLE_LABEL

ROLES = ("head", "actor", "critic", "rollout", "reward", "sandbox")
TERMINAL = ("Succeeded", "Failed", "Invalid")


class PluginError(Exception):
    """One line for the user; the command exits 1."""


# ---------------------------------------------------------------------------------------------
# Pure formatting
# ---------------------------------------------------------------------------------------------
def _num(value: Any, fmt: str = ".4g") -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "-"
    return format(value, fmt)


def _age(stamp: str | None, now: dt.datetime) -> str:
    if not stamp:
        return "-"
    try:
        then = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return "-"
    secs = max(0, int((now - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs // size}{unit}"
    return f"{secs}s"


def table(rows: list[list[str]]) -> str:
    """Columns padded like kubectl's tables (two spaces between columns)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def step_text(progress: dict[str, Any]) -> str:
    step, total = progress.get("step"), progress.get("totalSteps")
    if step is None:
        return "-"
    return f"{step}/{total}" if total is not None else str(step)


def format_list(jobs: list[dict[str, Any]], all_namespaces: bool, now: dt.datetime) -> str:
    if not jobs:
        return "No PPOJobs found."
    head = ["NAME", "PHASE", "STEP", "REWARD", "TOKENS/S", "AGE"]
    rows = [(["NAMESPACE"] if all_namespaces else []) + head]
    for job in jobs:
        meta, st = job["metadata"], job.get("status") or {}
        p = st.get("progress") or {}
        row = [
            meta["name"],
            st.get("phase") or "-",
            step_text(p),
            _num(p.get("rewardMean")),
            _num(p.get("tokensPerSecond"), ".0f"),
            _age(meta.get("creationTimestamp"), now),
        ]
        rows.append(([meta.get("namespace", "")] if all_namespaces else []) + row)
    return table(rows)


def watch_line(job: dict[str, Any]) -> str:
    """One line of `watch`: phase, step, reward, KL and tokens/s."""
    st = job.get("status") or {}
    p = st.get("progress") or {}
    return (
        f"{job['metadata']['name']}  phase={st.get('phase') or '-'}  step={step_text(p)}  "
        f"reward={_num(p.get('rewardMean'))}  kl={_num(p.get('kl'))}  "
        f"tokens/s={_num(p.get('tokensPerSecond'), '.0f')}"
    )


def pod_role(pod: dict[str, Any]) -> str:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(ROLE_LABEL, "-")


def format_checkpoints(job: dict[str, Any]) -> str:
    p = (job.get("status") or {}).get("progress") or {}
    kept = p.get("checkpoints") or []
    spec = job.get("spec") or {}
    volume = spec.get("checkpointVolume")
    where = (
        f"on volume {volume}"
        if volume
        else "in the trainer's output directory (no checkpointVolume)"
    )
    if not kept:
        return f"No checkpoints reported yet ({where})."
    rows = [["STEP", "PATH"]] + [[str(c.get("step")), str(c.get("path"))] for c in kept]
    return f"{table(rows)}\n(newest last; kept {where}; a restart resumes from the newest)"


def format_describe(
    job: dict[str, Any], pods: list[dict[str, Any]], events: list[dict[str, Any]]
) -> str:
    meta, st = job["metadata"], job.get("status") or {}
    p = st.get("progress") or {}
    out = [
        f"Name:         {meta['name']}",
        f"Namespace:    {meta.get('namespace', '')}",
        f"Phase:        {st.get('phase') or '-'}"
        + (f" ({st['reason']})" if st.get("reason") else ""),
        f"RayJob:       {st.get('rayJobName') or '-'}",
        f"Dashboard:    {st.get('dashboardURL') or '-'}",
        f"Started:      {st.get('startTime') or '-'}",
        f"Completed:    {st.get('completionTime') or '-'}",
        f"Restarts:     {st.get('restarts') or 0} after errors, "
        f"{st.get('disruptions') or 0} after disruptions",
        "Progress:",
        f"  Step:             {step_text(p)}",
        f"  Reward mean:      {_num(p.get('rewardMean'))}",
        f"  Eval reward:      {_num(p.get('evalRewardMean'))}",
        f"  KL:               {_num(p.get('kl'))}",
        f"  Entropy:          {_num(p.get('entropy'))}",
        f"  Value loss:       {_num(p.get('valueLoss'))}",
        f"  Tokens/s:         {_num(p.get('tokensPerSecond'), '.0f')}",
        f"  Step seconds:     {_num(p.get('stepSeconds'))}",
    ]
    phases = p.get("phaseSeconds") or {}
    if phases:
        out.append(
            "  Phase seconds:    "
            + ", ".join(f"{k} {_num(v)}" for k, v in phases.items() if v is not None)
        )
    out.append(
        f"  Log-prob diff:    mean {_num(p.get('logprobDiffMean'))}, max "
        f"{_num(p.get('logprobDiffMax'))}"
    )
    out.append(f"  Updated:          {p.get('updatedAt') or '-'}")
    if p.get("error"):
        out.append(f"  Error:            {p['error']}")
    out.append("Conditions:")
    conds = st.get("conditions") or []
    if conds:
        rows = [["TYPE", "STATUS", "REASON", "MESSAGE"]]
        rows += [
            [c.get("type", ""), c.get("status", ""), c.get("reason", ""), c.get("message", "")]
            for c in conds
        ]
        out += ["  " + ln for ln in table(rows).splitlines()]
    else:
        out.append("  <none>")
    out.append("Pods:")
    if pods:
        rows = [["ROLE", "POD", "PHASE", "NODE"]]
        order = {r: i for i, r in enumerate(ROLES)}
        for pod in sorted(pods, key=lambda q: (order.get(pod_role(q), 9), q["metadata"]["name"])):
            rows.append(
                [
                    pod_role(pod),
                    pod["metadata"]["name"],
                    (pod.get("status") or {}).get("phase") or "-",
                    (pod.get("spec") or {}).get("nodeName") or "-",
                ]
            )
        out += ["  " + ln for ln in table(rows).splitlines()]
    else:
        out.append("  <none>")
    out.append("Checkpoints:")
    out += ["  " + ln for ln in format_checkpoints(job).splitlines()]
    out.append("Events:")
    if events:
        rows = [["OBJECT", "TYPE", "REASON", "COUNT", "MESSAGE"]]
        for ev in events:
            rows.append(
                [
                    (ev.get("involvedObject") or {}).get("kind") or "",
                    ev.get("type") or "",
                    ev.get("reason") or "",
                    str(ev.get("count") or 1),
                    ev.get("message") or "",
                ]
            )
        out += ["  " + ln for ln in table(rows).splitlines()]
    else:
        out.append("  <none>")
    return "\n".join(out)


def pods_of_role(
    job: dict[str, Any], pods: list[dict[str, Any]], role: str
) -> tuple[list[dict[str, Any]], str]:
    """The pods running ``role`` and the role whose pods they are: a role colocated with the
    actor runs in the actor's pods. Raises PluginError when there are none."""
    roles = ((job.get("spec") or {}).get("roles")) or {}
    found = role
    if role in ("critic", "rollout") and (roles.get(role) or {}).get("colocateWithActor"):
        found = "actor"
    chosen = [p for p in pods if pod_role(p) == found]
    if not chosen:
        have = sorted({pod_role(p) for p in pods})
        raise PluginError(
            f"PPOJob {job['metadata']['name']} has no pods of role {found}"
            + (f" (pods of roles: {', '.join(have)})" if have else " (no pods yet)")
        )
    return sorted(chosen, key=lambda p: p["metadata"]["name"]), found


# ---------------------------------------------------------------------------------------------
# The API
# ---------------------------------------------------------------------------------------------
class Cluster:
    """The API calls of the plugin (the `kubernetes` client, imported here only)."""

    def __init__(self, kubeconfig: str | None, context: str | None, namespace: str | None):
        try:
            from kubernetes import client, config
        except ImportError as exc:  # pragma: no cover - the operator extra brings it
            raise PluginError(
                "kubectl ppojob needs the kubernetes client: pip install 'ppojob[operator]'"
            ) from exc
        try:
            self.api_client = config.new_client_from_config(config_file=kubeconfig, context=context)
            contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
            current = (
                next((c for c in contexts if c["name"] == context), active) if context else active
            )
            default_ns = ((current or {}).get("context") or {}).get("namespace") or "default"
        except config.ConfigException as exc:
            if kubeconfig or context:
                raise PluginError(f"--kubeconfig/--context: {exc}") from None
            try:
                config.load_incluster_config()
            except config.ConfigException:
                raise PluginError(f"no kubeconfig found ({exc}); pass --kubeconfig") from None
            self.api_client = client.ApiClient()
            default_ns = "default"
        self.namespace = namespace or default_ns
        self.custom = client.CustomObjectsApi(self.api_client)
        self.core = client.CoreV1Api(self.api_client)
        self._exc = client.exceptions.ApiException

    def call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._exc as exc:
            reason = exc.reason or ""
            try:
                import json

                reason = json.loads(exc.body or "{}").get("message") or reason
            except ValueError:
                pass
            raise PluginError(f"{what}: {reason} (HTTP {exc.status})") from None

    def job(self, name: str) -> dict[str, Any]:
        return self.call(
            f"PPOJob {self.namespace}/{name}",
            self.custom.get_namespaced_custom_object,
            GROUP,
            VERSION,
            self.namespace,
            PLURAL,
            name,
        )

    def jobs(self, all_namespaces: bool) -> list[dict[str, Any]]:
        if all_namespaces:
            out = self.call(
                "list PPOJobs", self.custom.list_cluster_custom_object, GROUP, VERSION, PLURAL
            )
        else:
            out = self.call(
                "list PPOJobs",
                self.custom.list_namespaced_custom_object,
                GROUP,
                VERSION,
                self.namespace,
                PLURAL,
            )
        return sorted(
            out.get("items") or [],
            key=lambda j: (j["metadata"].get("namespace", ""), j["metadata"]["name"]),
        )

    def pods(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        name = job["metadata"]["name"]
        selector = f"{JOB_LABEL}={name}"
        cluster = (job.get("status") or {}).get("rayClusterName")
        if cluster:  # the current attempt's pods only
            selector += f",ray.io/cluster={cluster}"
        out = self.call(
            "list pods", self.core.list_namespaced_pod, self.namespace, label_selector=selector
        )
        return [self.api_client.sanitize_for_serialization(p) for p in out.items]

    def events(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        """Events of the PPOJob and of its RayJob (KubeRay's: cluster created, job submitted),
        oldest first."""
        name = job["metadata"]["name"]
        wanted = [("PPOJob", name)]
        rayjob = (job.get("status") or {}).get("rayJobName")
        if rayjob:
            wanted.append(("RayJob", rayjob))
        evs: list[dict[str, Any]] = []
        for kind, obj in wanted:
            out = self.call(
                "list events",
                self.core.list_namespaced_event,
                self.namespace,
                field_selector=f"involvedObject.kind={kind},involvedObject.name={obj}",
            )
            evs += [self.api_client.sanitize_for_serialization(e) for e in out.items]
        return sorted(evs, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")

    def logs(self, pod: str, container: str | None, tail: int | None) -> str:
        kwargs: dict[str, Any] = {}
        if container:
            kwargs["container"] = container
        if tail is not None:
            kwargs["tail_lines"] = tail
        return self.call(
            f"logs of pod {pod}", self.core.read_namespaced_pod_log, pod, self.namespace, **kwargs
        )

    def patch_suspend(self, name: str, suspend: bool) -> dict[str, Any]:
        return self.call(
            f"PPOJob {self.namespace}/{name}",
            self.custom.patch_namespaced_custom_object,
            GROUP,
            VERSION,
            self.namespace,
            PLURAL,
            name,
            {"spec": {"suspend": suspend}},
        )

    def watch(self, name: str, resource_version: str, timeout: int) -> Iterable[dict[str, Any]]:
        """Events of the one PPOJob from ``resource_version`` for at most ``timeout`` s."""
        from kubernetes import watch

        w = watch.Watch()
        try:
            yield from w.stream(
                self.custom.list_namespaced_custom_object,
                GROUP,
                VERSION,
                self.namespace,
                PLURAL,
                field_selector=f"metadata.name={name}",
                resource_version=resource_version,
                timeout_seconds=max(1, timeout),
            )
        except self._exc as exc:
            if exc.status == 410:  # too old: the caller re-reads
                return
            raise PluginError(f"watch PPOJob {self.namespace}/{name}: {exc.reason}") from None
        finally:
            w.stop()


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------
def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def cmd_list(c: Cluster, args: argparse.Namespace) -> int:
    print(format_list(c.jobs(args.all_namespaces), args.all_namespaces, _now()))
    return 0


def cmd_describe(c: Cluster, args: argparse.Namespace) -> int:
    job = c.job(args.name)
    print(format_describe(job, c.pods(job), c.events(job)))
    return 0


def cmd_logs(c: Cluster, args: argparse.Namespace) -> int:
    job = c.job(args.name)
    pods, found = pods_of_role(job, c.pods(job), args.role)
    note = f" (role {args.role} runs in the actor's pods)" if found != args.role else ""
    for pod in pods:
        name = pod["metadata"]["name"]
        if len(pods) > 1 or note:
            print(f"==> pod {name}, role {found}{note} <==", flush=True)
        container = args.container or pod["spec"]["containers"][0]["name"]
        sys.stdout.write(c.logs(name, container, args.tail))
        sys.stdout.flush()
    return 0


def cmd_watch(c: Cluster, args: argparse.Namespace) -> int:
    """Print a line whenever the job's phase or progress changes; --once prints one line,
    --until-done ends at Succeeded, Failed or Invalid, --timeout bounds the whole watch."""
    deadline = time.monotonic() + args.timeout if args.timeout else None
    job = c.job(args.name)
    last = watch_line(job)
    print(last, flush=True)
    if args.once:
        return 0
    while True:
        phase = (job.get("status") or {}).get("phase")
        if args.until_done and phase in TERMINAL:
            return 0 if phase == "Succeeded" else 1
        left = int(deadline - time.monotonic()) if deadline else 300
        if left <= 0:
            print(f"kubectl ppojob watch: --timeout {args.timeout}s reached", file=sys.stderr)
            return 2
        rv = job["metadata"].get("resourceVersion", "")
        for ev in c.watch(args.name, rv, left):
            if ev["type"] == "DELETED":
                print(f"{args.name}: deleted", flush=True)
                return 1
            if ev["type"] not in ("ADDED", "MODIFIED"):
                continue
            job = ev["object"]
            line = watch_line(job)
            if line != last:
                print(line, flush=True)
                last = line
            if args.until_done and (job.get("status") or {}).get("phase") in TERMINAL:
                break
        else:
            job = c.job(args.name)  # the watch ended (timeout or 410): re-read, go on
            line = watch_line(job)
            if line != last:
                print(line, flush=True)
                last = line


def cmd_suspend(c: Cluster, args: argparse.Namespace) -> int:
    suspend = args.command == "suspend"
    job = c.patch_suspend(args.name, suspend)
    verb = "suspended" if suspend else "resumed"
    print(
        f"ppojob.ppojob.io/{job['metadata']['name']} {verb} (spec.suspend={str(suspend).lower()})"
    )
    return 0


def cmd_checkpoints(c: Cluster, args: argparse.Namespace) -> int:
    print(format_checkpoints(c.job(args.name)))
    return 0


COMMANDS: dict[str, Callable[[Cluster, argparse.Namespace], int]] = {
    "list": cmd_list,
    "describe": cmd_describe,
    "logs": cmd_logs,
    "watch": cmd_watch,
    "suspend": cmd_suspend,
    "resume": cmd_suspend,
    "checkpoints": cmd_checkpoints,
}


def _connection_flags(suppress: bool) -> argparse.ArgumentParser:
    """--kubeconfig, --context, -n: accepted before and after the command (after it, a flag
    left out does not reset what was given before it)."""
    common = argparse.ArgumentParser(add_help=False)
    default = argparse.SUPPRESS if suppress else None
    common.add_argument(
        "--kubeconfig", default=default, help="kubeconfig (default: $KUBECONFIG, ~/.kube/config)"
    )
    common.add_argument("--context", default=default, help="kubeconfig context (default: current)")
    common.add_argument("-n", "--namespace", default=default, help="default: the context's")
    return common


def build_parser() -> argparse.ArgumentParser:
    common = _connection_flags(suppress=True)
    parser = argparse.ArgumentParser(
        prog="kubectl ppojob",
        description="PPOJobs at the terminal.",
        parents=[_connection_flags(suppress=False)],
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", parents=[common], help="PPOJobs with phase, step, reward")
    p.add_argument("-A", "--all-namespaces", action="store_true")
    p = sub.add_parser("describe", parents=[common], help="progress, conditions, pods, events")
    p.add_argument("name")
    p = sub.add_parser("logs", parents=[common], help="logs of a role's pods")
    p.add_argument("name")
    p.add_argument(
        "--role", required=True, choices=("actor", "critic", "rollout", "reward", "sandbox", "head")
    )
    p.add_argument("--container", help="container (default: the pod's first)")
    p.add_argument("--tail", type=int, help="last N lines of each pod")
    p = sub.add_parser("watch", parents=[common], help="live phase, step, reward, tokens/s")
    p.add_argument("name")
    bound = p.add_mutually_exclusive_group()
    bound.add_argument("--once", action="store_true", help="print the current line and exit")
    bound.add_argument(
        "--until-done", action="store_true", help="exit when the job is Succeeded/Failed/Invalid"
    )
    p.add_argument("--timeout", type=int, default=0, help="give up after S seconds (0: never)")
    for verb, what in (
        ("suspend", "stop the job (spec.suspend=true)"),
        ("resume", "resume a suspended job"),
    ):
        p = sub.add_parser(verb, parents=[common], help=what)
        p.add_argument("name")
    p = sub.add_parser("checkpoints", parents=[common], help="the checkpoints the trainer keeps")
    p.add_argument("name")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "timeout", 0) < 0:
        print("kubectl ppojob watch: --timeout must be >= 0", file=sys.stderr)
        return 1
    try:
        cluster = Cluster(args.kubeconfig, args.context, args.namespace)
        return COMMANDS[args.command](cluster, args)
    except PluginError as exc:
        print(f"kubectl ppojob {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
