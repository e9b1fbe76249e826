"""Fixtures of the real-node tests: the control plane with a kubelet node, both images and the
operator installed by `helm install` (tests/realnode/session.py).

``pytest -m realnode`` starts that node for the run and stops it at the end; under
``python -m tests.realnode.session`` (`make test`) the tests attach to the node it started
(``PPOJOB_REALNODE_STATE``) and that process stops it. The node needs root (a kubelet,
containerd, a bridge): on a machine where that is impossible the session fails with the reason
(never a silent skip). The teardown checks the machine is left as found (no mount, network
namespace, bridge, process or iptables chain of the run): a leftover fails the session.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.controlplane import Kueue, wait_until
from tests.realnode import session
from tests.realnode.session import OPERATOR_NS, RELEASE, RealCluster


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/realnode/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.realnode)


@pytest.fixture(scope="module")  # torn down before the next test directory runs
def real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        # a killed pytest still runs its teardowns (the node's, Kueue's)
        signal.signal(signal.SIGTERM, session.interrupt)
    if os.environ.get(session.STATE_ENV):
        yield session.attach(Path(os.environ[session.STATE_ENV]))
        return
    # short: the kubelet's and containerd's paths end up in socket names and mount tables
    workdir = Path(tmp_path_factory.mktemp("rn"))
    cluster = session.start(workdir)
    atexit.register(session.stop, cluster)
    try:
        yield cluster
    finally:
        left = session.stop(cluster)
        atexit.unregister(session.stop)
    assert not left, f"the real node left these behind: {left}"


def operator_pod(cluster: RealCluster) -> dict:
    pods = cluster.cp.get("pods", namespace=OPERATOR_NS)
    items = [p for p in (pods or {}).get("items", []) if p["metadata"]["name"].startswith(RELEASE)]
    assert len(items) == 1, items
    return items[0]


__all__ = ["RealCluster", "operator_pod", "wait_until"]


@pytest.fixture()
def real_kueue(real_cluster: RealCluster) -> Iterator[Kueue]:
    """Kueue's manager (RayJob integration, its real webhooks) on the real node's control plane,
    for one test; stopped with its webhook configurations deleted after it (the API server
    would otherwise call a webhook that is gone for every later RayJob)."""
    k = Kueue(real_cluster.cp)
    try:
        k.start()
        print(f"\nkueue started in {k.start_seconds:.1f}s", file=sys.stderr)
        yield k
    finally:
        k.stop()
        for hook in k.webhooks():
            real_cluster.cp.kubectl(
                "delete", hook["kind"].lower(), hook["metadata"]["name"], check=False
            )
