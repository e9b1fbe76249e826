"""Live progress: `ppojob-train` with the job's ServiceAccount token as its only credential.

The trainer runs here as a local process on a local (loopback) Ray, with the trainer config the
operator rendered into the job's ConfigMap. It patches ``status.progress`` of its PPOJob through
the API server; `kubectl get ppojobs` shows Step and Reward move. The Ray dashboard KubeRay asks
for the Ray job's state does not exist on KWOK's fake pods, so the test itself writes the
terminal RayJob status KubeRay would write, and checks the PPOJob turns Succeeded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.helpers.cluster_jobs import PPOJOB, gpu_job, status, table, wait_children
from tests.helpers.controlplane import ROOT, wait_until


def tiny_job(name: str, ns: str, steps: int) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / "ppojob-tiny.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": ns}
    doc["spec"]["training"]["steps"] = steps
    return doc


def columns(cp, name: str, ns: str) -> dict[str, str]:
    """The job's row of `kubectl get ppojobs -o wide`."""
    return table(cp.kubectl("get", "ppojobs", name, "-n", ns, "-o", "wide").stdout)[0]


@pytest.mark.slow
def test_trainer_progress_with_the_job_token(cp, operator, ns, tmp_path):
    cp.apply(tiny_job("prog", ns, steps=6))
    cp.apply(gpu_job("other", ns))
    children = wait_children(cp, "prog", ns)
    wait_children(cp, "other", ns)
    config = tmp_path / "trainer.yaml"
    config.write_text(children["configmap"]["data"]["trainer.yaml"])
    kubeconfig = cp.token_kubeconfig(tmp_path / "trainer.kubeconfig", ns, "prog-trainer")

    def as_trainer(*args: str) -> subprocess.CompletedProcess:
        return cp.kubectl(*args, kubeconfig=kubeconfig, check=False)

    status_patch = ("patch", PPOJOB, "prog", "-n", ns, "--subresource=status", "--type=merge")
    # the token is good for its own job's status and for nothing else
    ok = as_trainer(*status_patch, "-p", '{"status":{"progress":{"step":0}}}')
    assert ok.returncode == 0, ok.stderr
    # a warning as the trainer writes it (its grace-period check): stored by the API server's
    # schema, posted once by the operator as a Warning event of its reason; the run's start
    # clears it (below)
    short = "GracePeriodTooShort: spec.failurePolicy.terminationGracePeriodSeconds 5s is short"
    body = json.dumps({"status": {"progress": {"warning": short}}})
    warned = as_trainer(*status_patch, "-p", body)
    assert warned.returncode == 0, warned.stderr
    assert status(cp, "prog", ns)["progress"]["warning"] == short

    def warning_event() -> list[dict]:
        items = cp.get("events", namespace=ns)["items"]
        return [e for e in items if e["reason"] == "GracePeriodTooShort"]

    [event] = wait_until(warning_event, 30, "the operator's GracePeriodTooShort event")
    assert event["type"] == "Warning" and event["message"] == short.split(": ", 1)[1]
    assert event["involvedObject"]["name"] == "prog"

    # ... and for its progress only: the chart's admission policy refuses any other change of
    # the status (phase, conditions, the restart counters) made with the job's token
    def refused(change: dict) -> str:
        body = json.dumps({"status": change})
        out = as_trainer(*status_patch, "--dry-run=server", "-p", body)
        return out.stderr if out.returncode else ""

    message = "a trainer writes only status.progress of its job"
    assert message in wait_until(lambda: refused({"phase": "Succeeded"}), 30, "the policy")
    for change in ({"conditions": []}, {"restarts": 7}, {"disruptions": 3}, {"rayJobName": "x"}):
        assert message in refused(change), change
    assert not refused({"progress": {"step": 0}})
    counters = '{"status":{"restarts":7}}'
    admin = cp.kubectl(*status_patch, "--dry-run=server", "-p", counters, check=False)
    assert not admin.returncode, admin.stderr  # the operator's (the admin's) writes pass
    for args in [
        (
            "patch",
            PPOJOB,
            "other",
            "-n",
            ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            '{"status":{"progress":{"step":1}}}',
        ),
        ("patch", PPOJOB, "prog", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":true}}'),
        ("get", "configmaps", "-n", ns),
        ("get", "pods", "-n", ns),
        ("get", "rayjobs.ray.io", "-n", ns),
        ("get", PPOJOB, "-n", ns),
        ("get", "secrets", "-n", ns),
    ]:
        denied = as_trainer(*args)
        assert denied.returncode != 0 and "Forbidden" in denied.stderr, (args, denied.stderr)

    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
    env.pop("RAY_ADDRESS", None)
    env.update(
        KUBECONFIG=str(kubeconfig),
        PPOJOB_NAME="prog",
        PPOJOB_NAMESPACE=ns,
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        PYTHONPATH=os.pathsep.join([str(ROOT / d) for d in ("api", "operator", "trainer")]),
    )
    # Every write of the job is seen through a watch (`kubectl get -w` prints a line per event),
    # so a short run whose steps come faster than any poll still shows each status patch.
    line = '{.status.progress.step}{" "}{.status.progress.rewardMean}{"\\n"}'
    watch_out = (tmp_path / "watch.txt").open("w")
    watch = subprocess.Popen(
        [
            str(cp.kubectl_bin),
            f"--kubeconfig={cp.admin_kubeconfig}",
            "get",
            "ppojobs",
            "prog",
            "-n",
            ns,
            f"-o=jsonpath={line}",
            "--watch",
        ],
        stdout=watch_out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log = (tmp_path / "trainer.log").open("w")
    trainer = None
    try:
        # the watch is established once it has printed the job's current row
        wait_until(
            lambda: len((tmp_path / "watch.txt").read_text().splitlines()) >= 1,
            30,
            "kubectl get --watch printing the job's row",
        )
        trainer = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ppojob_trainer.entrypoint",
                "--config",
                str(config),
                "--out",
                str(tmp_path / "out"),
                "--no-progress",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            trainer.wait(240)
        except subprocess.TimeoutExpired:
            trainer.kill()
            trainer.wait(10)
        # the final patch precedes the trainer's exit; the watch shows it once it has the row
        wait_until(
            lambda: any(
                ln.split(" ")[0] == "6" for ln in (tmp_path / "watch.txt").read_text().splitlines()
            ),
            30,
            "the watch showing step 6",
        )
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)
        watch.terminate()
        watch.wait(10)
        watch_out.close()
        log.close()
    events = [ln.split(" ") for ln in (tmp_path / "watch.txt").read_text().splitlines()]
    seen = [(e[0], e[1] if len(e) > 1 else "") for e in events if e[0] not in ("", "0")]
    out = (tmp_path / "trainer.log").read_text()
    assert trainer.returncode == 0, out[-4000:]
    final = columns(cp, "prog", ns)
    steps = [int(s) for s, _ in seen]
    assert steps[-1] == 6 and final["STEPS"] == "6" and final["REWARD"], (seen, final)
    assert len(set(steps)) >= 2, seen  # Step moved while training ran
    assert all(r for _, r in seen), seen  # Reward shown with every Step
    progress = status(cp, "prog", ns)["progress"]
    assert progress["step"] == 6 and isinstance(progress["rewardMean"], float)
    assert "warning" not in progress  # the run's start cleared the earlier warning

    # KubeRay's verdict (it cannot reach a dashboard on fake pods): the job succeeded
    cp.kubectl(
        "patch",
        "rayjob.ray.io",
        "prog",
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        '{"status":{"jobDeploymentStatus":"Complete","jobStatus":"SUCCEEDED"}}',
    )
    wait_until(lambda: columns(cp, "prog", ns)["PHASE"] == "Succeeded", 60, "phase Succeeded")
    assert status(cp, "prog", ns)["progress"]["step"] == 6
