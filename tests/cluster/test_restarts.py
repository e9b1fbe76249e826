"""Restarts: the operator killed (SIGKILL) in the middle of a burst of 50 jobs, then restarted.

The burst's jobs are created suspended: the operator's work is the same (every child, the
RayJob suspended, a status), and KubeRay makes no pods, so 50 jobs stay cheap on two cores.
"""

from __future__ import annotations

from collections import Counter

from tests.helpers.cluster_jobs import CHILDREN, JOB_LABEL, PPOJOB, gpu_job
from tests.helpers.controlplane import wait_until

KINDS = [r for r, _ in CHILDREN]


def burst(ns: str, n: int, prefix: str) -> list[dict]:
    docs = []
    for i in range(n):
        doc = gpu_job(f"{prefix}{i:03d}", ns)
        doc["spec"]["suspend"] = True
        docs.append(doc)
    return docs


def children_per_job(cp, ns: str) -> dict[str, Counter]:
    """kind -> Counter(job name -> number of children of that kind labelled with the job)."""
    out = {}
    for kind in KINDS:
        items = cp.get(kind, namespace=ns, selector=JOB_LABEL)["items"]
        out[kind] = Counter(i["metadata"]["labels"][JOB_LABEL] for i in items)
    return out


def converged_jobs(cp, ns: str, phase: str) -> set[str]:
    """The jobs whose status is written for their spec: in ``phase``, with their RayJob."""
    items = cp.get(PPOJOB, namespace=ns)["items"]
    return {
        i["metadata"]["name"]
        for i in items
        if (i.get("status") or {}).get("phase") == phase
        and i["status"].get("observedGeneration") == i["metadata"]["generation"]
        and i["status"].get("rayJobName") == i["metadata"]["name"]
    }


def converged(cp, ns: str, names: list[str], phase: str) -> bool:
    return converged_jobs(cp, ns, phase) >= set(names)


def settled(cp, ns: str, names: list[str], phase: str) -> bool:
    """Every job's status converged and every child of every job there. (A status can be
    written before the trainer's Role and RoleBinding, which are off the critical path: a job
    whose RBAC an operator killed in between gets it on the restarted operator's resume pass.)"""
    if not converged(cp, ns, names, phase):
        return False
    return all(set(per_job) >= set(names) for per_job in children_per_job(cp, ns).values())


def assert_exactly_one_child_each(cp, ns: str, names: list[str]) -> None:
    counts = children_per_job(cp, ns)
    for kind, per_job in counts.items():
        assert set(per_job) == set(names), (kind, sorted(set(names) - set(per_job)))
        assert set(per_job.values()) == {1}, (kind, {k: v for k, v in per_job.items() if v != 1})


def test_operator_killed_during_a_burst_of_50(cp, operator, ns, tmp_path):
    """SIGKILL while the operator is part-way through 50 new jobs, then a restart: every job gets
    exactly one of each child, and the RayJobs stay suspended.

    The operator reaches the API server through a proxy that, once the server has created 3
    RayJobs, holds every later write: the operator is frozen mid-burst on any machine (unheld,
    a quiet machine finished all 50 before a poll saw the third RayJob, and a loaded one had
    written 35 statuses by the time the kill landed). It is killed there, and what it had not
    sent is lost with it (the proxy drops the held writes). A job's status is its last write,
    sent once its RayJob exists: at most the jobs of the first 2 RayJobs have one when the
    restart begins, whatever ran in parallel."""
    from tests.helpers.controlplane import write_kubeconfig
    from tests.helpers.faultproxy import FaultProxy

    none = dict(p500=0, p429=0, p409=0, p_reset_before=0, p_reset_after=0)
    proxy = FaultProxy(
        cp.server, cp.pki["ca.crt"], **none, watch_seconds=(1e6, 1e6), hold_after=("rayjobs", 3)
    ).start()
    kubeconfig = write_kubeconfig(
        tmp_path / "held.kubeconfig",
        proxy.url,
        cp.pki["ca.crt"],
        token=yaml_token(operator.kubeconfig),
    )
    docs = burst(ns, 50, "b")
    names = [d["metadata"]["name"] for d in docs]
    operator.stop()
    try:
        operator.start(kubeconfig)
        cp.apply(docs)
        wait_until(lambda: proxy.held, 60, "the operator's writes after 3 RayJobs to be held")
        operator.kill()
        proxy.release()
        wait_until(lambda: proxy.pending == 0, 60, "the killed operator's writes to end")
        rayjobs_at_kill = len(cp.get("rayjobs.ray.io", namespace=ns)["items"])
        done_at_kill = len(converged_jobs(cp, ns, "Suspended"))
        assert done_at_kill < proxy.hold_after[1] <= rayjobs_at_kill, (
            done_at_kill,
            rayjobs_at_kill,
        )
        operator.start(kubeconfig)
        wait_until(lambda: settled(cp, ns, names, "Suspended"), 240, "50 jobs settled")
    finally:
        operator.stop()
        proxy.stop()
        operator.start()
    assert_exactly_one_child_each(cp, ns, names)
    rayjobs = cp.get("rayjobs.ray.io", namespace=ns)["items"]
    assert [r["metadata"]["name"] for r in rayjobs if not r["spec"].get("suspend")] == []
    assert proxy.created["rayjobs"] == 50, dict(proxy.created)  # none deleted and made again
    print(
        f"when the operator was killed: {rayjobs_at_kill}/50 RayJobs, {done_at_kill}/50 jobs "
        f"with their status; {proxy.held} writes held and dropped"
    )


def test_fault_injecting_proxy_across_100_jobs(cp, operator, ns, tmp_path):
    """5xx, 429 with Retry-After, 409 on updates, connections reset before and after the server
    acted, watches dropped every few seconds: 0 lost jobs, 0 duplicate children, all converge."""
    from tests.helpers.controlplane import write_kubeconfig
    from tests.helpers.faultproxy import FaultProxy

    token = yaml_token(operator.kubeconfig)
    proxy = FaultProxy(cp.server, cp.pki["ca.crt"], seed=7).start()
    kubeconfig = write_kubeconfig(
        tmp_path / "proxied.kubeconfig", proxy.url, cp.pki["ca.crt"], token=token
    )
    operator.stop()
    docs = burst(ns, 100, "f")
    names = [d["metadata"]["name"] for d in docs]
    # half before the operator starts (its first list of them is over 128 KiB, so the API server
    # gzips it), half while it runs (watch events)
    cp.apply(docs[:50])
    try:
        operator.start(kubeconfig)
        cp.apply(docs[50:])
        wait_until(lambda: settled(cp, ns, names, "Suspended"), 300, "100 jobs settled")
        assert_exactly_one_child_each(cp, ns, names)
        # Names are fixed, so "one of each" could hold after a delete-and-recreate: the
        # server's 201s say each child was created exactly once (RayJobs: never re-run).
        for plural in ("configmaps", "serviceaccounts", "roles", "rolebindings", "rayjobs"):
            assert proxy.created[plural] == 100, (plural, dict(proxy.created))
    finally:
        operator.stop()
        proxy.stop()
        operator.start()
    print(f"faults injected: {dict(proxy.injected)}")
    for kind in ("p500", "p429", "p409", "before", "after", "watch-dropped", "gzip-passed"):
        assert proxy.injected[kind] > 0, (kind, dict(proxy.injected))


def yaml_token(kubeconfig) -> str:
    import yaml

    return yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]["token"]
