"""Fixtures of the real-node tests: the control plane with a kubelet node
(tests/helpers/realnode.py), both images built here from the project's Dockerfiles
(hack/images/build.sh), and the operator installed by `helm install` of
charts/ppojob-operator, running as the chart's Deployment on the node with its in-cluster
configuration.

Run alone with `pytest -m realnode`. The node needs root (a kubelet, containerd, a bridge): on a
machine where that is impossible the session fails with the reason (never a silent skip).
The teardown checks the machine is left as found (no mount, network namespace, bridge, process
or iptables chain of the run): a leftover fails the session.
"""

from __future__ import annotations

import atexit
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import realnode as rn
from tests.helpers.controlplane import ROOT, ControlPlane, Kueue, wait_until

CHART = ROOT / "charts" / "ppojob-operator"
OPERATOR_NS = "ppojob-system"
RELEASE = "ppojob-operator"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/realnode/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.realnode)


@dataclass
class RealCluster:
    cp: ControlPlane
    node: rn.RealNode
    images: dict[str, str]
    workdir: Path
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def trainer_image(self) -> str:
        return self.images["trainer"]

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60) -> str:
        return self.cp.kubectl(*args, check=check, timeout=timeout).stdout


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="module")  # torn down before the next test directory runs
def real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    timings: dict[str, float] = {}
    t = time.monotonic()
    rn.ensure_packages()
    images = rn.build_images()
    timings["images"] = time.monotonic() - t
    # short: the kubelet's and containerd's paths end up in socket names and mount tables
    workdir = Path(tmp_path_factory.mktemp("rn"))
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)  # a killed pytest still tears the node down
    rn.make_bridge()
    cp = ControlPlane(workdir / "cp", api_address=rn.GATEWAY, real_nodes=True)
    node = rn.RealNode(cp, workdir / "node")
    (workdir / "node").mkdir()

    def teardown() -> None:
        t = time.monotonic()
        node.stop()
        stopped = {"node stop": time.monotonic() - t}
        cp.stop()
        rn.remove_bridge()
        stopped["control plane stop"] = time.monotonic() - t - stopped["node stop"]
        print(
            "\nreal node teardown: " + ", ".join(f"{k} {v:.1f}s" for k, v in stopped.items()),
            file=sys.stderr,
        )

    atexit.register(teardown)
    try:
        t = time.monotonic()
        cp.start()
        timings["control plane"] = time.monotonic() - t
        t = time.monotonic()
        node.start(images)
        timings["node"] = time.monotonic() - t
        t = time.monotonic()
        repo, tag = images["operator"].rsplit(":", 1)
        proc = subprocess.run(
            [
                str(cp.helm_bin),
                "install",
                RELEASE,
                str(CHART),
                f"--kubeconfig={cp.admin_kubeconfig}",
                f"--namespace={OPERATOR_NS}",
                "--create-namespace",
                f"--set=image.repository={repo}",
                f"--set=image.tag={tag}",
                "--set=image.pullPolicy=Never",
                "--wait",
                "--timeout=3m",
            ],
            capture_output=True,
            text=True,
            timeout=240,
        )
        if proc.returncode != 0:
            raise rn.ControlPlaneError(f"helm install failed: {proc.stderr[-3000:]}")
        timings["helm install"] = time.monotonic() - t
        cluster = RealCluster(cp, node, images, workdir, timings)
        print(
            "\nreal node: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()),
            file=sys.stderr,
        )
        yield cluster
    except BaseException:
        sys.stderr.write(cp.logs())
        raise
    finally:
        teardown()
        atexit.unregister(teardown)
    left = node.leftovers()
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
