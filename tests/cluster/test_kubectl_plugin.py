"""`kubectl ppojob`: the real kubectl finds the plugin on PATH and runs its commands against the
real control plane, with our operator, KubeRay and KWOK's fake GPU nodes (so every role has pods).

The plugin is on PATH as `kubectl-ppojob`, written here from pyproject's [project.scripts] entry
the way pip writes a console script. The trainer's progress is written into the status as the
trainer would (a status patch), and KubeRay's verdict as in test_cluster_progress.py: the fake
pods run no trainer and no Ray dashboard. For the same reason `logs` can only be checked up to
the API server's answer: it picks the role's pod and asks for its log, and the API server, which
cannot reach a kubelet for a KWOK node, answers with an error naming that pod.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers.cluster_jobs import PPOJOB, gpu_job, pods, status, wait_children
from tests.helpers.controlplane import wait_until
from tests.helpers.kubectl_plugin import launcher, plugin_env

ROLES = ("head", "actor", "critic", "rollout")


@pytest.fixture()
def kubectl(cp, tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    launcher(bindir)
    env = plugin_env(bindir)

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [str(cp.kubectl_bin), *args], capture_output=True, text=True, env=env, timeout=60
        )
        if check:
            assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
        return proc

    run.env = env  # type: ignore[attr-defined]
    return run


def _patch_status(cp, name: str, ns: str, status_patch: dict) -> None:
    cp.kubectl(
        "patch",
        PPOJOB,
        name,
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status_patch}),
    )


@pytest.mark.slow
def test_kubectl_ppojob_commands(cp, operator, ns, kubectl, tmp_path):
    assert "kubectl-ppojob" in kubectl("plugin", "list", check=False).stdout
    conn = ["--kubeconfig", str(cp.admin_kubeconfig), "-n", ns]
    cp.apply(gpu_job("pj", ns, steps=10))
    cp.apply(gpu_job("other", ns, steps=10))
    wait_children(cp, "pj", ns)
    # head, 2 actors, a critic and a rollout pod, as gpu_job asks
    wait_until(lambda: len(pods(cp, "pj", ns)) == 5, 60, "the job's 5 pods")
    assert {p["metadata"]["labels"]["ppojob.io/role"] for p in pods(cp, "pj", ns)} == set(ROLES)
    progress = {
        "step": 3,
        "totalSteps": 10,
        "rewardMean": 0.5,
        "kl": 0.25,
        "tokensPerSecond": 1234.0,
        "phaseSeconds": {"generate": 1.5, "weightSync": 0.125},
        "checkpoints": [
            {"step": 2, "path": "/ckpt/step-000002"},
            {"step": 3, "path": "/ckpt/step-000003"},
        ],
    }
    _patch_status(cp, "pj", ns, {"progress": progress})

    # list: both jobs, with step and reward; -A adds the namespace
    out = kubectl("ppojob", "list", *conn).stdout.splitlines()
    assert out[0].split() == ["NAME", "PHASE", "STEP", "REWARD", "TOKENS/S", "AGE"]
    rows = {ln.split()[0]: ln.split() for ln in out[1:]}
    assert set(rows) == {"pj", "other"} and rows["pj"][2:5] == ["3/10", "0.5", "1234"]
    everywhere = kubectl("ppojob", "list", "-A", "--kubeconfig", str(cp.admin_kubeconfig))
    assert any(ln.split()[:2] == [ns, "pj"] for ln in everywhere.stdout.splitlines())

    # describe: progress, the operator's conditions, one pod per role, checkpoints, events
    st = status(cp, "pj", ns)
    # the events of the job and of its RayJob so far (events only come, before the describe)
    events = [
        e
        for e in cp.get("events", namespace=ns)["items"]
        if (e["involvedObject"]["kind"], e["involvedObject"]["name"])
        in {("PPOJob", "pj"), ("RayJob", "pj")}
    ]
    assert {e["involvedObject"]["kind"] for e in events} == {"PPOJob", "RayJob"}
    text = kubectl("ppojob", "describe", "pj", *conn, "--context", "test").stdout
    assert "Step:             3/10" in text and "Reward mean:      0.5" in text
    assert "Phase seconds:    generate 1.5, weightSync 0.125" in text
    for ev in events:
        assert any(
            ln.split()[:3] == [ev["involvedObject"]["kind"], ev["type"], ev["reason"]]
            for ln in text.splitlines()
        ), (ev, text)
    for cond in st["conditions"]:  # (its status may move on meanwhile; the types stay)
        assert any(ln.split()[:1] == [cond["type"]] for ln in text.splitlines()), (cond, text)
    for pod in pods(cp, "pj", ns):
        role = pod["metadata"]["labels"]["ppojob.io/role"]
        assert any(ln.split()[:2] == [role, pod["metadata"]["name"]] for ln in text.splitlines())
    assert "/ckpt/step-000003" in text

    # checkpoints
    lines = kubectl("ppojob", "checkpoints", "pj", *conn).stdout.splitlines()
    assert [ln.split() for ln in lines[:3]] == [
        ["STEP", "PATH"],
        ["2", "/ckpt/step-000002"],
        ["3", "/ckpt/step-000003"],
    ]

    # logs: the role's pod is the one asked for (KWOK's fake node has no kubelet to answer)
    for role in ("actor", "rollout", "head"):
        got = kubectl("ppojob", "logs", "pj", "--role", role, *conn, check=False)
        names = [
            p["metadata"]["name"]
            for p in pods(cp, "pj", ns)
            if p["metadata"]["labels"]["ppojob.io/role"] == role
        ]
        assert got.returncode == 1 and f"logs of pod {names[0]}:" in got.stderr, got.stderr

    # watch --once, then --until-done following the status to Succeeded
    once = kubectl("ppojob", "watch", "pj", "--once", *conn).stdout.strip()
    assert "step=3/10" in once and "reward=0.5" in once and "tokens/s=1234" in once
    watch = subprocess.Popen(
        [str(cp.kubectl_bin), "ppojob", "watch", "pj", "--until-done", "--timeout", "120", *conn],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=kubectl.env,
    )
    try:
        assert "step=3/10" in watch.stdout.readline()  # its first line: the current state
        _patch_status(cp, "pj", ns, {"progress": {"step": 4, "rewardMean": 0.75}})
        while "step=4/10" not in (line := watch.stdout.readline()):
            assert line, watch.stderr.read()
        assert "reward=0.75" in line
        cp.kubectl(
            "patch",
            "rayjob.ray.io",
            "pj",
            "-n",
            ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            '{"status":{"jobDeploymentStatus":"Complete","jobStatus":"SUCCEEDED"}}',
        )
        rest = watch.communicate(timeout=90)[0]
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
    assert watch.returncode == 0 and "phase=Succeeded" in rest.splitlines()[-1], rest

    # suspend / resume: spec.suspend, and the operator's phase follows
    assert "suspended" in kubectl("ppojob", "suspend", "other", *conn).stdout
    wait_until(lambda: status(cp, "other", ns).get("phase") == "Suspended", 60, "Suspended")
    assert "resumed" in kubectl("ppojob", "resume", "other", *conn).stdout
    assert cp.get(PPOJOB, "other", ns)["spec"]["suspend"] is False
    wait_until(lambda: status(cp, "other", ns).get("phase") != "Suspended", 60, "resumed")

    # errors: one line naming the job and the cause
    missing = kubectl("ppojob", "describe", "nope", *conn, check=False)
    assert missing.returncode == 1
    assert missing.stderr.strip().startswith(f"kubectl ppojob describe: PPOJob {ns}/nope: ")
    bad = kubectl("ppojob", "list", *conn, "--context", "nosuch", check=False)
    assert bad.returncode == 1 and "nosuch" in bad.stderr and "Traceback" not in bad.stderr
