"""`ppojob-operator` / `python -m ppojob_operator`: run the PPOJob operator.

Flags (the Helm chart passes exactly these):

--namespace NS        watch this namespace (repeatable); none given means --all-namespaces
--all-namespaces      watch every namespace (cluster-wide)
--metrics-port 8080   Prometheus metrics at http://:PORT/metrics (0 disables)
--health-port 8081    liveness probe at http://:PORT/healthz (kopf's liveness endpoint; 0 disables)
--listen-address A    address both endpoints bind (default 0.0.0.0 for the pod's probes and
                      scrapes; 127.0.0.1 when run outside a cluster, as tests/cluster does)
--gang-scheduler S    cluster default gang scheduler, used only for jobs whose spec omits
                      `spec.scheduling.gangScheduler` (an explicit `none` in the spec stays `none`)
--kuberay-batch-scheduler B
                      KubeRay's batchScheduler.name (none, volcano, yunikorn, scheduler-plugins,
                      kai-scheduler): jobs whose gang scheduler cannot work with it are refused
                      (reason BatchSchedulerMismatch); auto: read at start-up from KubeRay's
                      Deployment in --kuberay-namespace; unset: not checked
--kuberay-namespace NS
                      the namespace KubeRay's operator runs in (default: default): each job's
                      NetworkPolicy lets KubeRay's operator pods reach the dashboard from there
                      only
--kuberay-sidecar-mode auto|supported|unsupported
                      whether KubeRay supports submissionMode SidecarMode (>= 1.5.0); auto (the
                      default) reads the installed RayJob CRD at start-up
--ray-auth auto|token|off
                      token authentication of each job's Ray dashboard and RPCs (KubeRay
                      authOptions, KubeRay >= 1.6, rayVersion >= 2.52); auto (the default): on
                      when the installed RayJob CRD has authOptions
--network-policy JSON|off
                      each job's NetworkPolicy: off, or {"dashboardFrom": [peers], "extraIngress":
                      [rules]}; always: the job's own pods, and KubeRay's operator pods in
                      --kuberay-namespace to the dashboard port; dashboardFrom adds peers
--leader-elect        act only while holding the Lease --leader-election-namespace/
                      --leader-election-name (default ppojob-operator); others wait (leader.py)
--leader-election-identity ID
                      this candidate's name in the Lease (default: $POD_NAME, else host-random)
--leader-election-lease-seconds 15
                      a silent leader's Lease is taken after this long (renewed every 2/15 of it)
--log-level LEVEL     DEBUG, INFO, WARNING, ERROR
--trainer-entrypoint  override the trainer command run in the head pod
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    from ppojob_operator.builders import KUBERAY_NAMESPACE
    from ppojob_operator.scheduling import GANG_SCHEDULERS, KUBERAY_BATCH_SCHEDULERS

    p = argparse.ArgumentParser(
        prog="ppojob-operator", description="Run the PPOJob operator (kopf, standalone)."
    )
    p.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        metavar="NS",
        help="namespace to watch (repeatable); none means --all-namespaces",
    )
    p.add_argument(
        "--all-namespaces", "-A", action="store_true", help="watch all namespaces (cluster-wide)"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=8080,
        help="port of the Prometheus /metrics endpoint (0 disables)",
    )
    p.add_argument(
        "--health-port",
        type=int,
        default=8081,
        help="port of the /healthz liveness endpoint (0 disables)",
    )
    p.add_argument(
        "--listen-address",
        default="0.0.0.0",
        help="address the metrics and health endpoints bind: 0.0.0.0 in a pod (probes and "
        "scrapes come to the pod's IP), 127.0.0.1 when run outside a cluster",
    )
    p.add_argument(
        "--gang-scheduler",
        choices=GANG_SCHEDULERS,
        default=None,
        help="default gang scheduler for jobs whose spec omits gangScheduler",
    )
    p.add_argument(
        "--kuberay-batch-scheduler",
        choices=["auto", "none", *filter(None, KUBERAY_BATCH_SCHEDULERS)],
        default=None,
        help="KubeRay's batchScheduler.name (none: unset); jobs that cannot work with it are "
        "refused. auto: read at start-up from KubeRay's Deployment in --kuberay-namespace. "
        "Omitted: not checked",
    )
    p.add_argument(
        "--kuberay-namespace",
        default=KUBERAY_NAMESPACE,
        metavar="NS",
        help="the namespace KubeRay's operator runs in: only its pods there reach a job's "
        f"dashboard port (default: {KUBERAY_NAMESPACE})",
    )
    p.add_argument(
        "--kuberay-sidecar-mode",
        choices=["auto", "supported", "unsupported"],
        default="auto",
        help="whether KubeRay supports submissionMode SidecarMode (KubeRay >= 1.5.0); auto reads "
        "the installed RayJob CRD",
    )
    p.add_argument(
        "--ray-auth",
        choices=["auto", "token", "off"],
        default="auto",
        help="token authentication of each job's Ray dashboard and RPCs (KubeRay authOptions: "
        "KubeRay >= 1.6, rayVersion >= 2.52); auto: on when the RayJob CRD has authOptions",
    )
    p.add_argument(
        "--network-policy",
        default=None,
        metavar="JSON|off",
        help='each job\'s NetworkPolicy: off, or JSON {"dashboardFrom": [NetworkPolicyPeer...], '
        '"extraIngress": [NetworkPolicyIngressRule...]}: dashboardFrom adds peers to the dashboard '
        "port besides the job's pods and KubeRay's operator pods in --kuberay-namespace",
    )
    p.add_argument(
        "--leader-elect",
        action="store_true",
        help="act only while holding a coordination.k8s.io Lease (several replicas: one acts)",
    )
    p.add_argument("--leader-election-namespace", default=None, help="the Lease's namespace")
    p.add_argument("--leader-election-name", default="ppojob-operator", help="the Lease's name")
    p.add_argument("--leader-election-identity", default=None, help="this candidate's name")
    p.add_argument(
        "--leader-election-lease-seconds", type=int, default=15, help="the Lease's duration"
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level",
    )
    p.add_argument(
        "--trainer-entrypoint",
        default=None,
        help="trainer command run in the head pod (default: ppojob-train ...)",
    )
    return p


def network_settings(value: str | None, kuberay_namespace: str | None = None) -> Any:
    """``--network-policy``: None (the default settings), ``off`` (no NetworkPolicy) or JSON with
    ``dashboardFrom`` and ``extraIngress`` lists; ``kuberay_namespace``: ``--kuberay-namespace``
    (None: the default). ValueError names what is wrong."""
    from ppojob_operator.builders import KUBERAY_NAMESPACE, NetworkPolicySettings

    kuberay_namespace = kuberay_namespace or KUBERAY_NAMESPACE
    if value is None:
        return NetworkPolicySettings(kuberay_namespace=kuberay_namespace)
    if value == "off":
        return None
    try:
        doc = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg}); write off or a JSON object") from None
    if not isinstance(doc, dict) or set(doc) - {"dashboardFrom", "extraIngress"}:
        raise ValueError("a JSON object with only dashboardFrom and extraIngress (lists)")
    lists = {k: doc.get(k, []) for k in ("dashboardFrom", "extraIngress")}
    for key, items in lists.items():
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise ValueError(f"{key} must be a list of objects")
    return NetworkPolicySettings(
        kuberay_namespace=kuberay_namespace,
        dashboard_from=lists["dashboardFrom"],
        extra_ingress=lists["extraIngress"],
    )


def operator_config(args: argparse.Namespace) -> Any:
    """The operator's settings from its parsed flags (ValueError: a flag's value is wrong)."""
    from ppojob_operator.state import OperatorConfig

    return OperatorConfig(
        gang_default=args.gang_scheduler,
        entrypoint=args.trainer_entrypoint,
        kuberay_batch_scheduler=(
            None
            if args.kuberay_batch_scheduler in (None, "auto")
            else ""
            if args.kuberay_batch_scheduler == "none"
            else args.kuberay_batch_scheduler
        ),
        sidecar_supported={"auto": None, "supported": True, "unsupported": False}[
            args.kuberay_sidecar_mode
        ],
        dashboard_auth={"auto": None, "token": True, "off": False}[args.ray_auth],
        detect_batch_scheduler=args.kuberay_batch_scheduler == "auto",
        kuberay_namespace=args.kuberay_namespace,
        network_policy=network_settings(args.network_policy, args.kuberay_namespace),
    )


def elector_of(args: argparse.Namespace) -> Any:
    """The operator's :class:`leader.Elector` (None without ``--leader-elect``); ValueError
    when the Lease's namespace is not given."""
    if not args.leader_elect:
        return None
    import os
    import socket
    import uuid

    from ppojob_operator.leader import Elector, Timing

    namespace = args.leader_election_namespace or os.environ.get("POD_NAMESPACE")
    if not namespace:
        raise ValueError("--leader-elect needs --leader-election-namespace (or $POD_NAMESPACE)")
    identity = args.leader_election_identity or os.environ.get("POD_NAME")
    identity = identity or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    timing = Timing.for_lease(args.leader_election_lease_seconds)
    return Elector(namespace, args.leader_election_name, identity, timing)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.namespace and args.all_namespaces:
        print("--namespace and --all-namespaces are exclusive", file=sys.stderr)
        return 2
    import logging

    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from ppojob_operator import handlers, k8s, metrics

    try:
        config = operator_config(args)
    except ValueError as exc:
        print(f"ppojob-operator: --network-policy: {exc}", file=sys.stderr)
        return 2

    try:
        elector = elector_of(args)
    except ValueError as exc:
        print(f"ppojob-operator: {exc}", file=sys.stderr)
        return 2

    try:
        k8s.configure()
    except Exception as exc:  # kubernetes.config.ConfigException: neither in a pod nor kubeconfig
        print(
            "ppojob-operator: no Kubernetes API to talk to: not running in a pod and no usable "
            f"kubeconfig ({exc}). Set KUBECONFIG or run it in the cluster (the Helm chart).",
            file=sys.stderr,
        )
        return 2
    metrics.serve(args.metrics_port, args.listen_address)
    handlers.run(
        namespaces=args.namespace,
        clusterwide=not args.namespace,
        config=config,
        health_port=args.health_port,
        listen_address=args.listen_address,
        elector=elector,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
