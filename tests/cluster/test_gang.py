"""Gang scheduling, all-or-nothing, with the real scheduler-plugins Coscheduling scheduler.

Each test gets its own pool of fake GPU nodes (label ``pool``) that only its jobs select, so
other tests' pods never change its arithmetic. The job: a head (no GPU) and four GPU workers
(actor x2, critic, rollout) of 4 GPUs each, 16 GPUs in all.
"""

from __future__ import annotations

import uuid

from tests.helpers.cluster_jobs import bound, gpu_job, pods, unschedulable, wait_children
from tests.helpers.cluster_jobs import status as status_of
from tests.helpers.controlplane import SP_SCHEDULER, wait_until


def _pool_nodes(cp, pool: str, names_gpus: dict[str, int]) -> None:
    docs = []
    for name, gpus in names_gpus.items():
        cap = {"cpu": "96", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": str(gpus)}
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {"kwok.x-k8s.io/node": "fake"},
                    "labels": {"type": "kwok", "pool": pool},
                },
                "status": {"capacity": cap, "allocatable": cap},
            }
        )
    cp.apply(docs)

    def ready() -> bool:
        for name in names_gpus:
            node = cp.get("node", name) or {}
            conds = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
            if conds.get("Ready") != "True":
                return False
        return True

    wait_until(ready, 60, f"pool {pool} nodes Ready")


def test_gang_is_all_or_nothing(cp, operator, ns):
    pool = f"gang-{uuid.uuid4().hex[:6]}"
    # 8 + 7 = 15 GPUs: three of the four 4-GPU workers (and the head) would fit one by one
    _pool_nodes(cp, pool, {f"{pool}-a": 8, f"{pool}-b": 7})
    cp.apply(gpu_job("big", ns, scheduler="scheduler-plugins", gpus=4, pool=pool))
    wait_children(cp, "big", ns)
    pg = wait_until(
        lambda: cp.get("podgroup.scheduling.x-k8s.io", "big", ns), 30, "the job's PodGroup"
    )
    assert pg["spec"]["minMember"] == 5

    def all_refused():
        p = pods(cp, "big", ns)
        return len(p) == 5 and all(unschedulable(x) for x in p) and p

    refused = wait_until(all_refused, 90, "the scheduler refusing every pod of the gang")
    assert all(x["spec"]["schedulerName"] == SP_SCHEDULER for x in refused)
    assert not [x["metadata"]["name"] for x in pods(cp, "big", ns) if bound(x)]

    # the PPOJob says why it waits, in the scheduler's own words on one of its pods
    def said(found):
        return {
            f"pod {x['metadata']['name']}: {c['message']}"
            for x in found
            for c in x["status"].get("conditions") or []
            if c["type"] == "PodScheduled" and c["status"] == "False"
        }

    status = wait_until(
        lambda: (s := status_of(cp, "big", ns)).get("reason") == "Unschedulable" and s,
        60,
        "the PPOJob's reason Unschedulable",
    )
    [running] = [c for c in status["conditions"] if c["type"] == "Running"]
    words = said(refused) | said(pods(cp, "big", ns))  # (the scheduler may have reworded it)
    assert any(running["message"].endswith(m) for m in words), (running["message"], words)

    # the missing capacity arrives: every pod of the gang is bound
    _pool_nodes(cp, pool, {f"{pool}-c": 4})
    wait_until(
        lambda: (p := pods(cp, "big", ns)) and len(p) == 5 and all(map(bound, p)),
        120,
        "every pod of the gang bound",
    )

    # a smaller job now finds 3 free GPUs for its one 4-GPU worker: none of its pods is bound,
    # not even its head, which alone would fit
    cp.apply(
        gpu_job(
            "small",
            ns,
            scheduler="scheduler-plugins",
            actor=1,
            critic=1,
            rollout=1,
            gpus=2,
            pool=pool,
        )
    )
    wait_children(cp, "small", ns)
    wait_until(
        lambda: (p := pods(cp, "small", ns)) and len(p) == 4 and all(map(unschedulable, p)),
        90,
        "the scheduler refusing every pod of the small gang",
    )
    assert not [x["metadata"]["name"] for x in pods(cp, "small", ns) if bound(x)]
    assert all(map(bound, pods(cp, "big", ns)))
