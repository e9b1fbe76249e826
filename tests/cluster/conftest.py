"""Fixtures of the cluster tests: a real control plane and our operator running against it.

The control plane (tests/cluster/controlplane.py) is built from Go modules by
hack/control-plane/build.sh (`make control-plane`; cached outside the clone, a warm build takes
seconds) and started once per session. Our operator runs as a subprocess whose only credential is
a token of the chart's ServiceAccount, bound to the chart's ClusterRole (rendered by `helm
template`), so a verb missing from the chart fails these tests. When a test fails, every
component's log (and the operator's) is attached to its report.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers.controlplane import ROOT, Component, ControlPlane, Kueue, free_port, wait_until

CHART = ROOT / "charts" / "ppojob-operator"
OPERATOR_NS = "ppojob-system"
RELEASE = "ppojob-operator"
# Fake GPU nodes every test may use (8 GPUs each, 64 in all: the 7B example alone asks for 32);
# the gang test adds its own labelled pool.
SHARED_NODES = [f"gpu-{i}" for i in range(8)]

_current: dict[str, Any] = {}


class OperatorProcess:
    """`ppojob-operator` as a subprocess with the chart's ServiceAccount token."""

    def __init__(
        self,
        cp: ControlPlane,
        kubeconfig: Path,
        extra_args: list[str] | None = None,
        namespaces: list[str] | None = None,
        name: str = "ppojob-operator",
    ):
        self.cp, self.kubeconfig = cp, kubeconfig
        self.extra_args = extra_args or []
        # the chart's args: --all-namespaces, or one --namespace per watched namespace
        self.scope = [f"--namespace={n}" for n in namespaces or []] or ["--all-namespaces"]
        self.name = name
        self.comp: Component | None = None
        self.starts = 0

    def start(self, kubeconfig: Path | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
        env["KUBECONFIG"] = str(kubeconfig or self.kubeconfig)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "operator"), str(ROOT / "trainer"), env.get("PYTHONPATH", "")]
        )
        env["PYTHONUNBUFFERED"] = "1"
        self.starts += 1
        name = self.name if self.starts == 1 else f"{self.name}-{self.starts}"
        health = free_port()
        self.comp = Component(
            name,
            [
                sys.executable,
                "-m",
                "ppojob_operator",
                *self.scope,
                "--metrics-port=0",
                f"--health-port={health}",
                "--listen-address=127.0.0.1",
                "--log-level=INFO",
                *self.extra_args,
            ],
            self.cp.logdir / f"{name}.log",
            env,
        )
        self.comp.start()
        self.cp.components[name] = self.comp

        def live() -> bool:
            assert self.comp is not None
            self.comp.check_alive()
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=2) as r:
                return r.status == 200

        wait_until(live, 90, "ppojob-operator /healthz")

    def kill(self) -> None:
        if self.comp:
            self.comp.kill()

    def stop(self) -> None:
        if self.comp:
            self.comp.stop()


def chart_rbac(
    cp: ControlPlane, release: str = RELEASE, namespace: str = OPERATOR_NS, *values: str
) -> list[dict[str, Any]]:
    """The chart's ServiceAccount, RBAC and admission policy objects, rendered by helm
    (``values``: --set ...)."""
    import subprocess

    sets = [a for v in values for a in ("--set", v)]
    proc = subprocess.run(
        [str(cp.helm_bin), "template", release, str(CHART), "--namespace", namespace, *sets],
        capture_output=True,
        text=True,
        check=True,
    )
    kinds = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    kinds |= {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    return [d for d in yaml.safe_load_all(proc.stdout) if d and d.get("kind") in kinds]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = ControlPlane(tmp_path_factory.mktemp("control-plane"))
    atexit.register(plane.stop)  # also when pytest is interrupted
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        # A terminated pytest (a CI timeout, `kill`) still stops every component it started:
        # pytest ends the session on KeyboardInterrupt and runs the fixtures' teardown (a
        # SystemExit raised in a test only fails that test and the session went on).
        signal.signal(signal.SIGTERM, _interrupt)
    plane.start()
    _current["cp"] = plane
    print(f"\ncontrol plane started in {plane.start_seconds:.1f}s", file=sys.stderr)
    try:
        plane.add_gpu_nodes(SHARED_NODES)
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def operator(
    cp: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    cp.kubectl("create", "namespace", OPERATOR_NS)
    rbac = chart_rbac(cp)
    assert {d["kind"] for d in rbac} >= {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
    cp.apply(rbac)
    kubeconfig = cp.token_kubeconfig(
        tmp_path_factory.mktemp("operator") / "operator.kubeconfig", OPERATOR_NS, RELEASE
    )
    op = OperatorProcess(cp, kubeconfig)
    op.start()
    try:
        yield op
    finally:
        op.stop()


@pytest.fixture(scope="session")
def kueue(cp: ControlPlane) -> Iterator[Kueue]:
    """Kueue's manager (RayJob integration) with its real webhooks, started on first use."""
    k = Kueue(cp)
    try:
        k.start()
    except BaseException:
        sys.stderr.write(cp.logs())
        k.stop()
        raise
    print(f"\nkueue started in {k.start_seconds:.1f}s", file=sys.stderr)
    try:
        yield k
    finally:
        k.stop()


@pytest.fixture()
def ns(cp: ControlPlane) -> Iterator[str]:
    """A fresh namespace (deleted afterwards, without waiting)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    cp.kubectl("create", "namespace", name)
    wait_until(lambda: cp.get("serviceaccount", "default", name), 30, f"default SA in {name}")
    yield name
    cp.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    plane = _current.get("cp")
    if report.failed and plane is not None:
        report.sections.append(("control-plane logs", plane.logs()))
