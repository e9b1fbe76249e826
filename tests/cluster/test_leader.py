"""Leader election on the real control plane: two operators with the chart's RBAC and flags
(``--leader-elect`` on the Lease in the release's namespace), watching one namespace. One holds
the Lease and acts; the other waits (alive: its /healthz answers) and acts on nothing. Killed
with SIGKILL (no release: a lost node), the leader's Lease is taken by the other within the
lease time, which then acts, and no job gets a second child."""

from __future__ import annotations

import time
import uuid
from datetime import datetime

from tests.cluster.conftest import OperatorProcess, chart_rbac
from tests.helpers.cluster_jobs import CHILDREN, JOB_LABEL, gpu_job, status, wait_children
from tests.helpers.controlplane import wait_until

LEASE_S = 6


def lease_spec(cp, home: str, name: str) -> dict:
    lease = cp.request("GET", f"/apis/coordination.k8s.io/v1/namespaces/{home}/leases/{name}")
    return (lease or {}).get("spec") or {}


def holder(cp, home: str, name: str) -> str:
    return lease_spec(cp, home, name).get("holderIdentity") or ""


def renewed_after(cp, home: str, name: str, epoch: float) -> bool:
    """Whether the Lease's renewTime (written on this host's clock) is later than ``epoch``."""
    raw = lease_spec(cp, home, name).get("renewTime")
    return bool(raw) and datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp() > epoch


def children(cp, ns: str) -> dict[str, list[str]]:
    """resource -> the uids of its objects labelled with a job, in ``ns``."""
    return {
        kind: sorted(
            i["metadata"]["uid"] for i in cp.get(kind, namespace=ns, selector=JOB_LABEL)["items"]
        )
        for kind, _ in CHILDREN
    }


def test_two_operators_one_acts_and_a_killed_leader_hands_over(cp, request, tmp_path) -> None:
    # the session's cluster-wide operator steps aside: it elects no leader
    session_op = request.getfixturevalue("operator")
    session_op.stop()
    tag = uuid.uuid4().hex[:6]
    home, watched, release = f"ppojob-le-{tag}", f"le-{tag}", "ppojob-le"
    for name in (home, watched):
        cp.kubectl("create", "namespace", name)
    rbac = chart_rbac(cp, release, home, f"watchNamespaces={{{watched}}}")
    assert ("Role", home) in {(d["kind"], d["metadata"].get("namespace")) for d in rbac}
    cp.apply(rbac)
    [sa] = [d["metadata"]["name"] for d in rbac if d["kind"] == "ServiceAccount"]
    lease = f"{release}-ppojob-operator"
    kubeconfig = cp.token_kubeconfig(tmp_path / "le.kubeconfig", home, sa)

    def candidate(who: str) -> OperatorProcess:
        args = [
            "--leader-elect",
            f"--leader-election-namespace={home}",
            f"--leader-election-name={lease}",
            f"--leader-election-identity={who}-{tag}",
            f"--leader-election-lease-seconds={LEASE_S}",
        ]
        return OperatorProcess(cp, kubeconfig, args, namespaces=[watched], name=f"le-{who}-{tag}")

    a, b = candidate("a"), candidate("b")
    try:
        a.start()
        wait_until(lambda: holder(cp, home, lease) == f"a-{tag}", 30, "a holds the Lease")
        b.start()  # returns once its /healthz answers: alive while it waits
        b_started = time.time()
        cp.apply(gpu_job("first", watched, suspend=True))
        wait_children(cp, "first", watched)
        wait_until(lambda: status(cp, "first", watched).get("phase"), 60, "first's phase")
        # a keeps renewing past b's first lease time: b goes on waiting
        later = b_started + 1.5 * LEASE_S
        wait_until(lambda: renewed_after(cp, home, lease, later), 4 * LEASE_S, "a renews")
        assert holder(cp, home, lease) == f"a-{tag}"
        b_log = cp.logdir / f"le-b-{tag}.log"
        assert "waiting for the leader lease" in b_log.read_text()
        assert "became the leader" not in b_log.read_text()
        before = children(cp, watched)

        a.kill()  # SIGKILL: the Lease is not released
        killed = time.monotonic()
        wait_until(lambda: holder(cp, home, lease) == f"b-{tag}", 4 * LEASE_S, "b takes over")
        took = time.monotonic() - killed
        # b takes the Lease once its record stood still for LEASE_S of b's clock (counted from
        # a's last renewal, at most a retry period before the kill), plus one retry period
        assert took <= LEASE_S + 2 * LEASE_S * 2 / 15 + 1.0, took

        cp.apply(gpu_job("second", watched, suspend=True))
        wait_children(cp, "second", watched)
        wait_until(lambda: status(cp, "second", watched).get("phase"), 60, "second's phase")
        after = children(cp, watched)
        for kind, uids in before.items():
            # the first job's children untouched (no second one, none recreated) and the
            # second job's one each
            assert set(uids) <= set(after[kind]), kind
            assert len(after[kind]) == 2 * len(uids), (kind, after[kind])
        assert "became the leader" in b_log.read_text()
    finally:
        a.kill()
        b.stop()
        cp.kubectl("delete", "ppojob", "--all", "-n", watched, "--wait=false", check=False)
        for d in rbac:
            if d["kind"] in ("ClusterRole", "ClusterRoleBinding"):
                cp.kubectl("delete", d["kind"].lower(), d["metadata"]["name"], check=False)
        for name in (home, watched):
            cp.kubectl("delete", "namespace", name, "--wait=false", check=False)
        session_op.start()
