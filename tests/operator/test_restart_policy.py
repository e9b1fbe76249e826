"""Pure: a failed RayJob attempt -> restart or fail (ppojob_operator.restarts), the status it
leaves (counters, lastRestart, the Restarted condition, Initializing while the next attempt is
made), and the pod settings a preemption needs (grace period, the head's preStop hook)."""

from __future__ import annotations

import http.server
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from ppojob_api.failures import PodLoss
from ppojob_api.validation import validate_manifest
from ppojob_operator import builders, restarts
from ppojob_operator.status import desired_status
from tests.helpers.manifests import base_manifest

NOW = "2026-01-01T00:00:00Z"


def job(**spec):
    return validate_manifest(base_manifest(**spec))


def rayjob(j, dep="Failed", js="FAILED", attempt=0, **status):
    rj = builders.build_children(j, namespace="ns1", restart=attempt)[-1]
    rj["status"] = {"jobDeploymentStatus": dep, "jobStatus": js, **status}
    return rj


PREEMPTED = "Preempted: SIGTERM: finished the step in flight; 3 completed steps are in ..."
TABLE = [
    # (RayJob dep/js, its reason/message, trainer error, backoffLimit, status) -> action, reason
    (
        "Failed",
        "FAILED",
        {"reason": "AppFailed"},
        PREEMPTED,
        0,
        {},
        "Restart",
        "RestartingAfterDisruption",
    ),
    (
        "Failed",
        "",
        {"reason": "AppFailed", "message": "Ray head pod not found."},
        None,
        0,
        {},
        "Restart",
        "RestartingAfterDisruption",
    ),
    (
        "Complete",
        "FAILED",
        {"message": "failed with exit code 2"},
        "training failed: KeyError: 'x'",
        1,
        {},
        "Restart",
        "RestartingAfterError",
    ),
    (
        "Complete",
        "FAILED",
        {},
        "training failed: KeyError: 'x'",
        1,
        {"restarts": 1},
        "Fail",
        "BackoffLimitExceeded",
    ),
    (
        "Complete",
        "FAILED",
        {},
        "training failed: KeyError: 'x'",
        0,
        {},
        "Fail",
        "BackoffLimitExceeded",
    ),
    ("Failed", "", {"reason": "DeadlineExceeded"}, None, 3, {}, "Fail", "PermanentFailure"),
    ("Failed", "FAILED", {}, PREEMPTED, 0, {"disruptions": 10}, "Fail", "DisruptionLimitExceeded"),
    ("Complete", "SUCCEEDED", {}, None, 3, {}, None, None),
    ("Running", "RUNNING", {}, None, 3, {}, None, None),
]


@pytest.mark.parametrize(
    ("dep", "js", "extra", "error", "limit", "status", "action", "reason"), TABLE
)
def test_decision(dep, js, extra, error, limit, status, action, reason) -> None:
    j = job(backoffLimit=limit)
    d = restarts.decision(j, rayjob(j, dep, js, **extra), status, error)
    assert (d and d.action, d and d.reason) == (action, reason)


STALLED = "Stalled: no step progress for 1800s: actor rank 1 (train) did not report"


@pytest.mark.parametrize(
    ("on_stall", "action", "reason"),
    [("Restart", "Restart", "RestartingAfterDisruption"), ("Fail", "Fail", "PermanentFailure")],
)
def test_a_stalled_attempt_follows_on_stall(on_stall, action, reason) -> None:
    j = job(failurePolicy={"onStall": on_stall})
    d = restarts.decision(j, rayjob(j), {}, STALLED)
    assert (d.action, d.reason) == (action, reason)
    assert "actor rank 1 (train)" in d.message


def test_the_trainer_config_carries_the_stall_timeout() -> None:
    from ppojob_api.validation import trainer_config_from_spec

    assert trainer_config_from_spec(job().spec).stall_timeout_seconds == 1800
    off = job(failurePolicy={"stallTimeoutSeconds": 0}).spec
    assert trainer_config_from_spec(off).stall_timeout_seconds is None


def test_an_attempt_already_decided_is_not_decided_again() -> None:
    j = job()
    rj = rayjob(j, attempt=2)
    assert restarts.decision(j, rj, {"lastRestart": {"attempt": 2}}, PREEMPTED) is None
    assert restarts.decision(j, rj, {"lastRestart": {"attempt": 1}}, PREEMPTED) is not None


def test_a_suspended_job_is_not_restarted() -> None:
    j = job(suspend=True)
    assert restarts.decision(j, rayjob(j), {}, PREEMPTED) is None


def test_a_disruption_restart_leaves_counters_condition_and_initializing() -> None:
    j = job(backoffLimit=1)
    rj = rayjob(j, attempt=0)
    d = restarts.decision(j, rj, {}, PREEMPTED)
    prev = restarts.restart_status({}, d, rj, NOW)
    assert (prev["restarts"], prev["disruptions"]) == (0, 1)  # not counted against backoffLimit
    st = desired_status(j, rj, generation=1, previous=prev, now=NOW)
    assert st["phase"] == "Initializing"  # the failed attempt is being replaced
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["Failed"]["status"] == "False"
    assert conds["Restarted"]["status"] == "True"
    assert conds["Restarted"]["reason"] == "RestartingAfterDisruption"
    assert "Preempted: SIGTERM" in conds["Restarted"]["message"]
    assert conds["Running"]["reason"] == "RestartingAfterDisruption"
    assert restarts.pending_restart(st, rj) and restarts.pending_restart(st, None)
    # the next attempt's RayJob exists: recreated, and the job follows it again
    nxt = rayjob(j, "Running", "RUNNING", attempt=restarts.next_attempt(st))
    assert nxt["metadata"]["annotations"][restarts.ATTEMPT_ANNOTATION] == "1"
    st2 = desired_status(j, nxt, generation=1, previous=st, now=NOW)
    assert st2["phase"] == "Running" and st2["lastRestart"]["recreated"] is True
    assert not restarts.pending_restart(st2, nxt)
    assert (st2["restarts"], st2["disruptions"]) == (0, 1)
    # a later application error is counted once
    failed = rayjob(j, "Complete", "FAILED", attempt=1)
    d2 = restarts.decision(j, failed, st2, "training failed: ValueError: bad reward")
    assert d2.counts and restarts.restart_status(st2, d2, failed, NOW)["restarts"] == 1


def test_restart_delay_counts_from_the_decision() -> None:
    st = {"lastRestart": {"time": "2026-01-01T00:00:00Z"}}
    t0 = 1767225600.0  # 2026-01-01T00:00:00Z
    assert restarts.restart_delay(st, 30, t0 + 10) == pytest.approx(20)
    assert restarts.restart_delay(st, 30, t0 + 40) == 0


def test_pods_get_the_grace_period_and_the_head_its_prestop_hook() -> None:
    """The head's preStop hook asks the driver to stop. A worker's SIGTERM goes straight to its
    ``ray start --block``, which drains the Ray node (the driver hears of it from the GCS) for up
    to RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S: the grace period, so that the worker's actors live
    until the driver has checkpointed; the worker's own preStop hook only ends its node early
    once the head is gone."""
    j = job(failurePolicy={"terminationGracePeriodSeconds": 300})
    rj = builders.build_children(j, namespace="ns1")[-1]
    spec = rj["spec"]
    assert spec["backoffLimit"] == 0  # the operator decides retries, not KubeRay
    head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    workers = [g["template"]["spec"] for g in spec["rayClusterSpec"]["workerGroupSpecs"]]
    for pod in (head, *workers):
        assert pod["terminationGracePeriodSeconds"] == 300
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["PPOJOB_GRACE_SECONDS"] == "300"
    hook = head["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    env = {e["name"]: e.get("value") for e in head["containers"][0]["env"]}
    assert env["PPOJOB_STOP_FILE"] in hook[-1] and env["PPOJOB_RUNNING_FILE"] in hook[-1]
    for w in workers:  # (the worker's hook: test_a_worker_pods_prestop_...)
        assert w["containers"][0]["lifecycle"] == {
            "preStop": {"exec": {"command": builders.WORKER_PRESTOP_COMMAND}}
        }
    assert "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S" not in env  # the head: its preStop hook
    for w in workers:
        env = {e["name"]: e.get("value") for e in w["containers"][0]["env"]}
        assert env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == "300"


def test_a_pod_disruption_budget_covers_every_pod_of_the_job_unless_turned_off() -> None:
    kinds = [c["kind"] for c in builders.build_children(job(), namespace="ns1")]
    assert kinds.index("PodDisruptionBudget") < kinds.index("RayJob")  # before the pods exist
    pdb = next(
        c
        for c in builders.build_children(job(), namespace="ns1", uid="u1")
        if c["kind"] == "PodDisruptionBudget"
    )
    # every pod the job can have: head, 2 actor, critic, rollout pods of the default job
    pods = builders.build_children(job(), namespace="ns1")[-1]["spec"]["rayClusterSpec"]
    count = 1 + sum(g["maxReplicas"] for g in pods["workerGroupSpecs"])
    assert pdb["spec"] == {
        "minAvailable": count,
        "selector": {"matchLabels": {"ppojob.io/job": "demo"}},
        "unhealthyPodEvictionPolicy": "AlwaysAllow",  # a pod that is not Ready blocks no drain
    }
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == "u1"
    rj = builders.build_children(job(), namespace="ns1")[-1]["spec"]["rayClusterSpec"]
    templates = [rj["headGroupSpec"]["template"]] + [g["template"] for g in rj["workerGroupSpecs"]]
    assert all(t["metadata"]["labels"]["ppojob.io/job"] == "demo" for t in templates)
    off = job(failurePolicy={"podDisruptionBudget": False})
    assert "PodDisruptionBudget" not in [
        c["kind"] for c in builders.build_children(off, namespace="ns1")
    ]


def test_the_budget_counts_every_pod_an_elastic_job_can_have() -> None:
    """minAvailable is the head plus each group at its largest (elastic engines at their
    maximum): a Ready pod of the job is never evictable, however far the engines grew."""
    elastic = job(
        roles={
            "actor": {"replicas": 2, "resources": {"gpus": 1}},
            "critic": {"replicas": 1, "resources": {"gpus": 1}},
            "rollout": {"replicas": 1, "resources": {"gpus": 1}, "elastic": {"maxReplicas": 5}},
        }
    )
    (pdb,) = [
        c
        for c in builders.build_children(elastic, namespace="ns1")
        if c["kind"] == "PodDisruptionBudget"
    ]
    assert pdb["spec"]["minAvailable"] == 1 + 2 + 1 + 5
    assert "maxUnavailable" not in pdb["spec"]


def test_the_trainer_token_is_mounted_only_in_the_head_pod() -> None:
    rj = builders.build_children(job(), namespace="ns1")[-1]["spec"]["rayClusterSpec"]
    head = rj["headGroupSpec"]["template"]["spec"]
    assert head.get("automountServiceAccountToken", True) is True  # the driver writes progress
    for group in rj["workerGroupSpecs"]:
        assert group["template"]["spec"]["automountServiceAccountToken"] is False


TEMPLATE = {
    "labels": {"team": "rl"},
    "annotations": {"karpenter.sh/do-not-disrupt": "true"},
    "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
    "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "APP_"}],
    "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
    "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
}


def test_the_pod_template_reaches_every_pod_and_ppojob_render(tmp_path, capsys) -> None:
    import yaml

    from ppojob_cli.main import main as ppojob

    j = job(podTemplate=TEMPLATE)
    rj = builders.build_children(j, namespace="ns1")[-1]["spec"]["rayClusterSpec"]
    templates = [rj["headGroupSpec"]["template"]] + [g["template"] for g in rj["workerGroupSpecs"]]
    for t in templates:
        assert t["metadata"]["labels"]["team"] == "rl"
        assert t["metadata"]["labels"]["ppojob.io/job"] == "demo"
        assert t["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
        c = t["spec"]["containers"][0]
        assert TEMPLATE["env"][0] in c["env"]
        assert c["envFrom"] == TEMPLATE["envFrom"]
        assert TEMPLATE["volumes"][0] in t["spec"]["volumes"]
        assert TEMPLATE["volumeMounts"][0] in c["volumeMounts"]
        assert {"name": "trainer-config"}.items() <= t["spec"]["volumes"][0].items()
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(base_manifest(podTemplate=TEMPLATE)))
    assert ppojob(["render", str(path)]) == 0
    out = capsys.readouterr().out
    assert (
        "karpenter.sh/do-not-disrupt" in out and "secretKeyRef" in out and "claimName: data" in out
    )


@pytest.mark.parametrize(("timeout", "permit", "applied"), [(600, 60, 60), (42, 60, 42)])
def test_the_permit_timeout_is_short_and_never_beyond_the_job_timeout(timeout, permit, applied):
    j = job(
        scheduling={
            "gangScheduler": "scheduler-plugins",
            "timeoutSeconds": timeout,
            "permitTimeoutSeconds": permit,
        }
    )
    pg = next(c for c in builders.build_children(j, namespace="ns1") if c["kind"] == "PodGroup")
    assert pg["spec"]["scheduleTimeoutSeconds"] == applied


def test_an_attempt_that_lost_a_pod_is_a_disruption_whatever_the_trainer_saw() -> None:
    """Seen on a real node (tests/realnode): a worker pod killed mid-step reaches the trainer as
    Ray's ActorDiedError, a message that names no cause; the operator saw the pod deleted."""
    j = job(backoffLimit=3)
    died = "training failed: ActorDiedError: The actor died unexpectedly before finishing this task"
    alone = restarts.decision(j, rayjob(j), {}, died)
    assert alone is not None and alone.failure_class == "Application"
    deleted = PodLoss("tiny-x-worker-1", None, None)
    lost = restarts.decision(j, rayjob(j), {}, died, [deleted])
    assert lost is not None and lost.failure_class == "Disruption" and lost.action == "Restart"
    assert "pod tiny-x-worker-1 was deleted" in lost.message


class _Health(http.server.BaseHTTPRequestHandler):
    answers: list[int] = []

    def do_GET(self) -> None:
        code = self.answers.pop(0) if self.answers else 200
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b"raylet: success\ngcs: success" if code == 200 else b"gcs: failed")

    def log_message(self, *args: object) -> None:
        pass


def test_the_heads_poststart_hook_holds_the_submitter_until_the_agent_answers() -> None:
    """The head's postStart hook (SidecarMode: kubelet finishes it before it starts the next
    container, KubeRay's submitter) returns once the dashboard agent's health check answers 200
    after its 503s, or answers anything else (an older Ray without that check); with nothing but
    503s it gives up at its bound by the clock; a missing ``python`` does not fail it (a failed
    postStart hook kills the container). Run as the container runs it, against a health check on
    loopback on a free port (the hook's port swapped for it), ``python`` this interpreter. With
    K8sJobMode (no submitter container) there is no hook to wait in."""
    j = job()
    head = builders.build_children(j, namespace="ns1")[-1]["spec"]["rayClusterSpec"]
    container = head["headGroupSpec"]["template"]["spec"]["containers"][0]
    hook = container["lifecycle"]["postStart"]["exec"]["command"]
    assert hook == builders.POSTSTART_COMMAND
    assert f"localhost:{builders.AGENT_PORT}/api/healthz" in hook[-1]
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    shim = tempfile.mkdtemp()
    os.symlink(sys.executable, os.path.join(shim, "python"))
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}"}
    program = hook[-1].replace(str(builders.AGENT_PORT), str(port))

    def run(program: str, path: str = env["PATH"]) -> tuple[int, float]:
        t = time.monotonic()
        sh = shutil.which(hook[0])  # found on this PATH: the one given may have no python
        done = subprocess.run(
            [sh, *hook[1:-1], program], env={**env, "PATH": path}, timeout=60, check=False
        )
        return done.returncode, time.monotonic() - t

    try:
        _Health.answers = [503, 503]
        assert run(program)[0] == 0
        assert _Health.answers == []  # it asked until the agent answered 200
        _Health.answers = [503, 404, 503]
        assert run(program)[0] == 0 and _Health.answers == [503]  # up, without that check
        _Health.answers = [503] * 1000  # an agent that never comes up
        bounded = program.replace(f"+ {builders.AGENT_WAIT_S}", "+ 3")
        assert bounded != program
        code, took = run(bounded)
        assert code == 0 and 3 <= took < 15 and 1000 - 5 <= len(_Health.answers) < 1000
        assert run(program, path="/nonexistent")[0] == 0  # no python: no failure either
    finally:
        server.shutdown()
    k8s_job = job(submissionMode="K8sJobMode")
    rayjob = builders.build_children(k8s_job, namespace="ns1")[-1]
    pod = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert set(pod["containers"][0]["lifecycle"]) == {"preStop"}


def test_a_worker_pods_prestop_ends_its_ray_node_at_once_only_when_the_head_is_gone(
    tmp_path: Path,
) -> None:
    """A worker pod's preStop hook, run as the container runs it (``python`` this interpreter),
    in a PID namespace of its own whose first process stands for ``ray start --block`` (it ends
    when its raylet, a process whose argv[0] ends in ``/raylet``, dies; the namespace, and the
    hook, end with it). The head's GCS is a loopback listener on ``RAY_ADDRESS``'s port:
    - the node connected to it: the hook returns at once, the raylet lives; so it does when the
      GCS no longer takes new connections (a suspend removed a ClusterIP Service while the head
      writes its checkpoint) but the node's connection stands: no new one is tried;
    - no connection to the GCS port (the GCS closed them: the head is gone): the raylet is
      killed and the container ends before the hook's own bound;
    - an address with a scheme (``ray://``, not the GCS): nothing is touched.
    The hook never fails. The head gets the stop-file hook instead."""
    j = job()
    spec = builders.build_children(j, namespace="ns1")[-1]["spec"]["rayClusterSpec"]
    worker = spec["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    hook = worker["lifecycle"]["preStop"]["exec"]["command"]
    assert hook == builders.WORKER_PRESTOP_COMMAND
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["lifecycle"]["preStop"]["exec"]["command"] == builders.PRESTOP_COMMAND
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python").symlink_to(sys.executable)
    raylet = tmp_path / "ray" / "raylet"
    raylet.parent.mkdir()
    shutil.copy(shutil.which("sleep") or "/bin/sleep", raylet)
    hook_sh = " ".join(shlex.quote(a) for a in hook)
    start_raylet = f"{shlex.quote(str(raylet))} 600 & pid=$!; "
    # the hook in front, then whether the raylet still runs (a killed child is a zombie, state
    # Z, until the shell reaps it: then it is gone)
    returns = (
        f"{start_raylet}{hook_sh}; echo rc=$?; "
        "state=$(cut -d' ' -f3 /proc/$pid/stat 2>/dev/null); "
        '[ "${state:-Z}" = Z ] && echo raylet=dead || echo raylet=alive; '
        "kill -9 $pid 2>/dev/null; wait 2>/dev/null; true"
    )
    # As the pod runs them: the first process stands for `ray start --block`, which looks at its
    # raylet once a second and ends when it died; kubelet sends its SIGTERM (which would start
    # the drain) as soon as the hook returns. The hook must not return first.
    block = f"""import subprocess, sys, time
raylet = subprocess.Popen([{str(raylet)!r}, "600"])
hook = subprocess.Popen({hook!r})
while True:
    for _ in range(20):
        if hook.poll() is not None:
            print("SIGTERM before the raylet's death was seen"); sys.exit(0)
        time.sleep(0.05)
    if raylet.poll() is not None:
        print("raylet=dead"); sys.exit(0)
"""
    ends = f"exec python -c {shlex.quote(block)}"

    def run(port: int, script: str, address: str | None = None) -> tuple[str, float]:
        env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}"}
        # (a name never resolved: the hook reads the port alone)
        env["RAY_ADDRESS"] = address or f"head-svc.ns1.svc.cluster.local:{port}"
        t = time.monotonic()
        out = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        return out, time.monotonic() - t

    gcs = socket.socket()
    gcs.bind(("127.0.0.1", 0))
    gcs.listen()
    port = gcs.getsockname()[1]
    node = socket.create_connection(("127.0.0.1", port))  # the raylet's connection to the GCS
    peer, _ = gcs.accept()
    try:
        out, took = run(port, returns)
        assert "rc=0" in out and "raylet=alive" in out, out
        assert took < builders.WORKER_EXIT_WAIT_S, took
        gcs.close()  # no new connection is taken; the node's own stands
        out, took = run(port, returns)
        assert "rc=0" in out and "raylet=alive" in out, out
    finally:
        node.close()
        peer.close()
        gcs.close()
    out, took = run(port, ends)  # no connection to the GCS port left
    assert out.strip() == "raylet=dead" and took < builders.WORKER_EXIT_WAIT_S - 1, (out, took)
    out, _ = run(port, returns, address=f"ray://head-svc:{port}")
    assert "rc=0" in out and "raylet=alive" in out, out
