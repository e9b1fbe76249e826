"""The chart's namespaced mode (`watchNamespaces`) on the real control plane: the operator runs with
only the chart's Roles in the namespaces it watches (and the small ClusterRole for CRDs), makes a
job's children there, never touches a job elsewhere, and is refused by RBAC outside."""

from __future__ import annotations

import uuid

from tests.cluster.conftest import OperatorProcess, chart_rbac
from tests.helpers.cluster_jobs import gpu_job, job, status, wait_children
from tests.helpers.controlplane import wait_until


def test_the_namespaced_chart_mode_runs_jobs_only_where_it_may(cp, request, tmp_path) -> None:
    # the session's cluster-wide operator steps aside: two operators would both reconcile
    session_op = request.getfixturevalue("operator")
    session_op.stop()
    tag = uuid.uuid4().hex[:6]
    watched, other, home = f"team-a-{tag}", f"team-b-{tag}", f"ppojob-ns-{tag}"
    for name in (watched, other, home):
        cp.kubectl("create", "namespace", name)
    rbac = chart_rbac(cp, "ppojob-ns", home, f"watchNamespaces={{{watched}}}")
    kinds = sorted((d["kind"], d["metadata"].get("namespace")) for d in rbac)
    assert ("ClusterRoleBinding", None) in kinds and ("RoleBinding", watched) in kinds
    assert not [k for k in kinds if k[1] == other]
    cp.apply(rbac)
    [sa] = [d["metadata"]["name"] for d in rbac if d["kind"] == "ServiceAccount"]
    kubeconfig = cp.token_kubeconfig(tmp_path / "namespaced.kubeconfig", home, sa)
    op = OperatorProcess(cp, kubeconfig, namespaces=[watched], name=f"ppojob-operator-ns-{tag}")
    try:
        op.start()
        cp.apply(gpu_job("elsewhere", other, actor=1))
        cp.apply(gpu_job("here", watched, actor=1))
        wait_children(cp, "here", watched)
        wait_until(lambda: status(cp, "here", watched).get("phase"), 60, "the job's phase")

        def can(verb: str, what: str, namespace: str) -> bool:
            got = cp.kubectl(
                "auth", "can-i", verb, what, "-n", namespace, kubeconfig=kubeconfig, check=False
            )
            return got.stdout.strip() == "yes"

        assert can("list", "ppojobs.ppojob.io", watched) and can(
            "create", "rayjobs.ray.io", watched
        )
        assert not can("list", "ppojobs.ppojob.io", other)
        assert not can("create", "rayjobs.ray.io", other)
        # the other namespace's job: not watched, so no status and no child
        assert job(cp, "elsewhere", other) is not None
        assert status(cp, "elsewhere", other) == {}
        assert cp.get("rayjob.ray.io", "elsewhere", other) is None
        assert cp.get("configmap", "elsewhere-trainer", other) is None
        log = (cp.logdir / f"ppojob-operator-ns-{tag}.log").read_text()
        assert "Forbidden" not in log and " 403" not in log, log[-3000:]
    finally:
        op.stop()
        cp.kubectl("delete", "ppojob", "--all", "-n", watched, "--wait=false", check=False)
        for d in rbac:
            if d["kind"] in ("ClusterRole", "ClusterRoleBinding"):
                cp.kubectl("delete", d["kind"].lower(), d["metadata"]["name"], check=False)
        for name in (watched, other, home):
            cp.kubectl("delete", "namespace", name, "--wait=false", check=False)
        session_op.start()
