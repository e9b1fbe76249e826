"""The real node of a test run: started once, used by one pytest process or by several.

- :func:`start` / :func:`stop`: the control plane with a kubelet node (tests/helpers/realnode.py),
  both images built here from the project's Dockerfiles (hack/images/build.sh) and the operator
  installed by `helm install` of charts/ppojob-operator, running as the chart's Deployment on
  the node with its in-cluster configuration. :func:`stop` returns what the node left behind.
- ``python -m tests.realnode.session`` (what `make test` runs, hack/test.sh): starts the node
  once and runs the real-node tests in three pytest processes that attach to it
  (``PPOJOB_REALNODE_STATE``, :func:`attach`). Most of a real-node test is waiting (pods
  starting, Ray forming, steps gated to last seconds, grace periods), so two lanes run side by
  side, each with one job at a time on the node (a job asks for 0.9 of its 2 CPUs); then the
  tests marked ``whole_node`` (a drained node, a Kueue quota, an elastic group that fills the
  node) run alone. The node is stopped, and checked to have left nothing, at the end. A lane's
  output goes to ``build/realnode-<lane>.log`` and is printed after the run; the exit code is
  the first failing lane's (pytest's 5, "no tests collected", included), else 1 when the node
  left something behind.

``pytest -m realnode`` alone starts and stops a node of its own, as before (conftest.py).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers import realnode as rn
from tests.helpers.controlplane import ROOT, ControlPlane, wait_until

CHART = ROOT / "charts" / "ppojob-operator"
OPERATOR_NS = "ppojob-system"
RELEASE = "ppojob-operator"
STATE_ENV = "PPOJOB_REALNODE_STATE"
"""Names the state file of a node another process started: the tests attach to it."""
LANES = {
    "lane-a": "realnode and not whole_node and not second_lane",
    "lane-b": "realnode and second_lane",
}
"""The pytest processes that share the node side by side (marker expressions)."""
ALONE = ("whole-node", "realnode and whole_node")
"""The tests that need the node to themselves, run after the lanes."""


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

    def handoff(self) -> dict[str, Any]:
        """What another process needs to use this node (:func:`attach`)."""
        return {
            "cp": self.cp.handoff(),
            "node": self.node.handoff(),
            "images": self.images,
            "workdir": str(self.workdir),
        }


def start(workdir: Path) -> RealCluster:
    """Build the images, start the control plane and the node, install the chart; on a failure
    stop what started (with the control plane's logs on stderr) and raise."""
    timings: dict[str, float] = {}
    t = time.monotonic()
    rn.ensure_packages()
    images = rn.build_images()
    timings["images"] = time.monotonic() - t
    rn.make_bridge()
    cp = ControlPlane(workdir / "cp", api_address=rn.GATEWAY, real_nodes=True)
    node = rn.RealNode(cp, workdir / "node")
    (workdir / "node").mkdir()
    cluster = RealCluster(cp, node, images, workdir, timings)
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
    except BaseException:
        sys.stderr.write(cp.logs())
        stop(cluster)
        raise
    print("\nreal node: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()), file=sys.stderr)
    return cluster


def stop(cluster: RealCluster) -> list[str]:
    """Stop the node and the control plane; what the node left on the machine (empty: clean)."""
    t = time.monotonic()
    cluster.node.stop()
    stopped = {"node stop": time.monotonic() - t}
    cluster.cp.stop()
    rn.remove_bridge()
    stopped["control plane stop"] = time.monotonic() - t - stopped["node stop"]
    print(
        "\nreal node teardown: " + ", ".join(f"{k} {v:.1f}s" for k, v in stopped.items()),
        file=sys.stderr,
    )
    return cluster.node.leftovers()


def attach(path: Path) -> RealCluster:
    """A started node's handle from its state file (another process stops it)."""
    state = json.loads(path.read_text())
    cp = ControlPlane.attach(state["cp"])
    return RealCluster(
        cp, rn.RealNode.attach(cp, state["node"]), state["images"], Path(state["workdir"])
    )


def interrupt(signum: int, frame: object) -> None:
    """SIGTERM as KeyboardInterrupt: a killed run still runs its teardown."""
    raise KeyboardInterrupt(f"signal {signum}")


def _pytest(lane: str, expression: str, env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
    log = ROOT / "build" / f"realnode-{lane}.log"
    argv = [sys.executable, "-m", "pytest", "-q", "--durations=10", "-m", expression]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*argv, "tests/realnode"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    return proc, log


START_DEADLINE_S = 2400
"""The node's start (a cold one builds both images: about 13 min on this machine) must end by
then, or the run fails with the traceback of where it was."""


def _deadline(signum: int, frame: object) -> None:
    raise TimeoutError(f"the real node did not start within {START_DEADLINE_S} s")


def clear_jobs(cluster: RealCluster) -> None:
    """Every PPOJob and RayJob deleted and their pods gone (force: no grace period): what the
    lanes left (a finished job keeps its pods for ``ttlSecondsAfterFinished``; a failed test's
    job may still run) must not share the node with the whole-node tests."""
    cluster.kubectl("delete", "ppojobs,rayjobs", "--all", "-A", "--wait=false", check=False)
    ray_pods = ["pods", "-A", "-l", "ray.io/node-type"]
    cluster.kubectl("delete", *ray_pods, "--grace-period=0", "--force", "--wait=false", check=False)
    wait_until(
        lambda: not cluster.kubectl("get", *ray_pods, "-o", "name").strip(),
        300,
        "the lanes' pods to go",
        interval=1.0,
    )


def main() -> int:
    """Start the node, run the lanes side by side, then the whole-node tests, stop the node."""
    signal.signal(signal.SIGTERM, interrupt)  # a killed run still tears the node down
    (ROOT / "build").mkdir(exist_ok=True)
    # short: the kubelet's and containerd's paths end up in socket names and mount tables
    workdir = Path(tempfile.mkdtemp(prefix="ppojob-rn-"))
    t0 = time.monotonic()
    signal.signal(signal.SIGALRM, _deadline)
    signal.alarm(START_DEADLINE_S)
    try:
        cluster = start(workdir)  # stops what it started when it fails
    finally:
        signal.alarm(0)
    atexit.register(stop, cluster)  # should the teardown below be cut short
    running: list[subprocess.Popen] = []
    results: list[tuple[str, int, Path, float]] = []
    left: list[str] | None = None
    try:
        state = workdir / "state.json"
        state.write_text(json.dumps(cluster.handoff()))
        env = {**os.environ, STATE_ENV: str(state)}
        t = time.monotonic()
        lanes = {}
        for lane, expression in LANES.items():
            lanes[lane] = _pytest(lane, expression, env)
            running.append(lanes[lane][0])
        for lane, (proc, log) in lanes.items():
            results.append((lane, proc.wait(), log, time.monotonic() - t))
        running = []
        clear_jobs(cluster)
        t = time.monotonic()
        proc, log = _pytest(*ALONE, env)
        running = [proc]
        results.append((ALONE[0], proc.wait(), log, time.monotonic() - t))
        running = []
    finally:
        # the teardown is not to be cut short by a second signal (hack/test.sh's trap sends one)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for proc in running:  # an interrupted run: each lane's pytest runs its teardowns
            proc.send_signal(signal.SIGTERM)
        for proc in running:
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        left = stop(cluster)
        atexit.unregister(stop)
        for lane, rc, log, seconds in results:
            print(f"\n---------- {lane} (exit code {rc}, {seconds:.0f} s) ----------")
            print(log.read_text())
        print(f"real-node run: {time.monotonic() - t0:.0f} s in all")
        if left:
            print(f"the real node left these behind: {left}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    failed = [rc for _, rc, _, _ in results if rc != 0]
    return failed[0] if failed else int(bool(left))


if __name__ == "__main__":
    sys.exit(main())
