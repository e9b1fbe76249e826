"""PPOJobs end to end on a real node: `kubectl apply` -> the operator (the chart's Deployment)
makes the RayJob -> KubeRay makes the head and worker pods as real containers of the trainer
image built here -> Ray forms a cluster across them -> the trainer runs the PPO loop -> KubeRay
reads the verdict from the Ray dashboard -> the PPOJob ends. Nothing here writes a status by hand.

The job is the tiny example (count-up, 133k-parameter Llama) sized for this 2-core node: head
0.1 CPU (+ KubeRay's 0.5-CPU submitter sidecar), one 0.3-CPU worker (Ray counts it as 1: KubeRay
rounds up) that holds actor, critic and rollout: two jobs fit beside the operator, one per lane
(session.py; the node's kubelet enforces no CPU limit). Checkpoints go to a hostPath
PersistentVolume the test provisions on the node, so the test reads the trainer's own
metrics.jsonl and checkpoints from the host.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ppojob_trainer.progress import read_attempts
from tests.helpers.controlplane import ROOT, wait_until
from tests.helpers.kubectl_plugin import launcher, plugin_env
from tests.helpers.realnode import GATEWAY
from tests.realnode.conftest import RealCluster, operator_pod

RANDOM_REWARD = 0.03  # count-up's reward under the untrained policy (docs: ~0.03)
STEPS = 40  # about 40 s of training on this node: several progress reports (every 5 s)


def ppojob(
    cluster: RealCluster,
    name: str,
    ns: str,
    steps: int,
    claim: str | None = None,
    interval: int = 0,
    backoff: int = 0,
    image: str | None = None,
    reward_function: str | None = None,
    suspend: bool = False,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "image": image or cluster.trainer_image,
        "imagePullPolicy": "Never",  # imported into the node; there is no registry
        "head": {"cpus": 0.1, "memory": "3Gi"},
        "model": {"path": "builtin:tiny-llama"},
        "roles": {
            "actor": {"replicas": 1, "resources": {"cpus": 0.3, "memory": "4Gi"}},
            "rollout": {"colocateWithActor": True},
        },
        "algorithm": {
            "advantageEstimator": "gae",
            "kl": {"coefficient": 0.1, "estimator": "low_var_kl", "mode": "loss"},
        },
        "data": {
            "prompts": "builtin:count-up",
            "rolloutBatchSize": 16,
            "samplesPerPrompt": 8,
            "maxPromptLength": 4,
            "maxResponseLength": 8,
        },
        "training": {"steps": steps, "seed": 1, "learningRate": 1.0e-3, "miniBatchSize": 64},
        "scheduling": {"gangScheduler": "none"},
        "backoffLimit": backoff,
        # restart at once after a failure (the default waits 30 s after an application error)
        "failurePolicy": {"retryDelaySeconds": 0},
    }
    if reward_function:
        spec["data"]["rewardFunction"] = reward_function
    if claim:
        spec["checkpointVolume"] = {"persistentVolumeClaim": {"claimName": claim}}
        spec["training"].update({"checkpointDir": "/ckpt", "checkpointInterval": interval})
    if suspend:
        spec["suspend"] = True
    return {
        "apiVersion": "ppojob.io/v1alpha1",
        "kind": "PPOJob",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }


def namespace(cluster: RealCluster, ns: str) -> None:
    cluster.kubectl("create", "namespace", ns)


def volume(cluster: RealCluster, ns: str, claim: str = "ckpt") -> Path:
    """A hostPath PersistentVolume on the node, bound to PVC ``claim`` in ``ns``; returns the
    host directory (writable by the trainer image's user)."""
    host = cluster.workdir / "volumes" / ns
    host.mkdir(parents=True)
    host.chmod(0o777)
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"pv-{ns}"},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "manual",
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": str(host), "type": "Directory"},
            "claimRef": {"namespace": ns, "name": claim},
        },
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim, "namespace": ns},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "manual",
            "resources": {"requests": {"storage": "1Gi"}},
            "volumeName": f"pv-{ns}",
        },
    }
    cluster.cp.apply([pv, pvc])
    return host


def apply(cluster: RealCluster, doc: dict[str, Any]) -> None:
    cluster.cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))


def get_job(cluster: RealCluster, ns: str, name: str) -> dict[str, Any]:
    job = cluster.cp.get("ppojobs.ppojob.io", name, ns)
    assert job is not None, f"PPOJob {ns}/{name} is gone"
    return job


def job_pods(cluster: RealCluster, ns: str) -> list[dict[str, Any]]:
    pods = cluster.cp.get("pods", namespace=ns) or {}
    return [
        p for p in pods.get("items", []) if "ray.io/node-type" in p["metadata"].get("labels", {})
    ]


def pod_of(
    cluster: RealCluster, ns: str, node_type: str, ray_cluster: str | None = None
) -> dict[str, Any] | None:
    """A live pod of ``node_type`` of the job (of the Ray cluster ``ray_cluster`` when given: a
    restarted job's old cluster can still have pods while the new one runs)."""
    live = [
        p
        for p in job_pods(cluster, ns)
        if p["metadata"]["labels"]["ray.io/node-type"] == node_type
        and not p["metadata"].get("deletionTimestamp")
        and ray_cluster in (None, p["metadata"]["labels"].get("ray.io/cluster"))
    ]
    return live[0] if live else None


def table_row(cluster: RealCluster, ns: str, name: str) -> dict[str, str]:
    """`kubectl get ppojobs` as a user reads it: the printer columns of the CRD."""
    text = cluster.kubectl("get", "ppojobs", "-n", ns, name)
    head, row = text.splitlines()[:2]
    cols = head.split()
    # the value of a column starts where its header starts
    starts = [head.index(c) for c in cols] + [len(row) + 1]
    return {c: row[starts[i] : starts[i + 1]].strip() for i, c in enumerate(cols)}


def watch(
    cluster: RealCluster,
    ns: str,
    name: str,
    timeout: float,
    on_row: Callable[[dict[str, str], dict[str, Any]], None] | None = None,
) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """Poll the job's table row until it ends (Succeeded or Failed); every distinct row seen is
    returned, in order, with the final object."""
    rows: list[dict[str, str]] = []

    def ended() -> dict[str, Any] | None:
        # the object first, then the row: the last row is at least as new as the ended job
        job = get_job(cluster, ns, name)
        row = table_row(cluster, ns, name)
        if not rows or row != rows[-1]:
            rows.append(row)
        if on_row is not None:
            on_row(row, job)
        return job if job.get("status", {}).get("phase") in ("Succeeded", "Failed") else None

    job = wait_until(ended, timeout, f"PPOJob {ns}/{name} to end", interval=1.0)
    return job, rows


class TableWatch:
    """`kubectl get ppojobs -w` for one job, with the CRD's own printer columns (Phase, Step,
    Reward: their jsonPaths, as custom columns so empty cells stay parseable): every status the
    API server sends is one line, nothing is missed between polls."""

    COLUMNS = ("Phase", "Step", "Reward")

    def __init__(self, cluster: RealCluster, ns: str, name: str, path: Path) -> None:
        crd = yaml.safe_load((ROOT / "crds" / "ppojob.io_ppojobs.yaml").read_text())
        printed = {
            c["name"]: c["jsonPath"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]
        }
        spec = ",".join(f"{c.upper()}:{printed[c]}" for c in self.COLUMNS)
        self.path = path
        kubectl = [str(cluster.cp.kubectl_bin), f"--kubeconfig={cluster.cp.admin_kubeconfig}"]
        self.proc = subprocess.Popen(
            [*kubectl, "get", "ppojobs", "-n", ns, name, "-w", f"-o=custom-columns={spec}"],
            stdout=path.open("w"),
            stderr=subprocess.STDOUT,
        )

    def rows(self) -> list[dict[str, str]]:
        self.proc.terminate()
        self.proc.wait(10)
        lines = self.path.read_text().splitlines()
        return [
            dict(zip(self.COLUMNS, line.split(), strict=True))
            for line in lines[1:]
            if len(line.split()) == len(self.COLUMNS)
        ]


def metrics(host: Path) -> list[dict[str, Any]]:
    """The trainer's metrics.jsonl from the checkpoint volume (every attempt appends to it)."""
    path = host / "output" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def checkpoints(host: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in host.glob("step-*") if p.is_dir())


def with_probe(*stops: int) -> list[int]:
    """The checkpoints of a first attempt with no periodic checkpoint: the one after its first
    step (in a pod a grace period is set, and the trainer times a checkpoint before any stop)
    and the stop's."""
    return sorted({1, *stops})


def condition(job: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in job["status"].get("conditions", []) if c["type"] == type_), {})


# --------------------------------------------------------------------------- a job that trains


TOKEN_PROBE = r"""
import json, os, ssl, sys, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
token = open(f"{sa}/token").read()
ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt")
env = os.environ
base = f"https://{env['KUBERNETES_SERVICE_HOST']}:{env['KUBERNETES_SERVICE_PORT']}"
ns = open(f"{sa}/namespace").read()
jobs = f"/apis/ppojob.io/v1alpha1/namespaces/{ns}/ppojobs"
own, other = sys.argv[1:3]
out = {}
for label, method, path, body in [
    ("own status", "PATCH", f"{jobs}/{own}/status", {"status": {}}),
    ("own phase", "PATCH", f"{jobs}/{own}/status?dryRun=All", {"status": {"phase": "Failed"}}),
    ("other status", "PATCH", f"{jobs}/{other}/status", {"status": {}}),
    ("own spec", "PATCH", f"{jobs}/{own}", {"spec": {"suspend": True}}),
    ("secrets", "GET", f"/api/v1/namespaces/{ns}/secrets", None),
]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {token}"}
    headers["Content-Type"] = "application/merge-patch+json"
    req = urllib.request.Request(base + path, method=method, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            out[label] = r.status
    except urllib.error.HTTPError as e:
        out[label] = e.code
print(json.dumps(out))
"""


DASHBOARD_PROBE = r"""
import json, os, sys, urllib.request
url = f"http://{sys.argv[1]}:8265/api/jobs/"
out = {}
for label, token in [("none", None), ("wrong", "x" * 32), ("own", os.environ["RAY_AUTH_TOKEN"])]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            out[label] = r.status
    except urllib.error.HTTPError as e:
        out[label] = e.code
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def trained(real_cluster: RealCluster) -> Iterator[dict[str, Any]]:
    """One tiny job run to the end, observed on the way: its table rows, a token probe from
    inside its head pod, the pods' network, `kubectl logs` of the head."""
    cluster, ns, name = real_cluster, "train", "tiny"
    namespace(cluster, ns)
    host = volume(cluster, ns)
    # a second job in the namespace, suspended (it never runs): the token must not reach it
    apply(cluster, ppojob(cluster, "other", ns, 5, suspend=True))
    apply(cluster, ppojob(cluster, name, ns, STEPS, claim="ckpt", interval=10))
    seen: dict[str, Any] = {"pods": {}}
    probes: list[threading.Thread] = []

    def probe() -> None:
        """From inside the running job (on a thread of its own: the watch goes on polling)."""
        head, worker = pod_of(cluster, ns, "head"), pod_of(cluster, ns, "worker")
        assert head is not None and worker is not None
        head_name = head["metadata"]["name"]
        argv = ["python", "-c", TOKEN_PROBE, name, "other"]
        out = cluster.kubectl("exec", "-n", ns, head_name, "-c", "ray-head", "--", *argv)
        seen["token"] = json.loads(out.strip().splitlines()[-1])
        # the head's dashboard (job API), from another pod of the job, over the pod network
        argv = ["python", "-c", DASHBOARD_PROBE, head["status"]["podIP"]]
        worker_name = worker["metadata"]["name"]
        out = cluster.kubectl("exec", "-n", ns, worker_name, "-c", "ray-worker", "--", *argv)
        seen["dashboard"] = json.loads(out.strip().splitlines()[-1])
        seen["network"] = cluster.node.network_report(ns, head_name)
        seen["worker network"] = cluster.node.network_report(ns, worker["metadata"]["name"])
        seen["logs"] = cluster.kubectl("logs", "-n", ns, head_name, "-c", "ray-head")
        sub = ["logs", "-n", ns, head_name, "-c", "ray-job-submitter"]
        seen["submitter logs"] = wait_until(
            lambda: "step" in cluster.kubectl(*sub).lower() and cluster.kubectl(*sub),
            60,
            "the driver's output in the submitter's log",
        )
        seen["listeners"] = cluster.node.listeners()
        # the kubectl plugin's logs, through the real kubectl, per role
        bindir = cluster.workdir / "plugin-bin"
        bindir.mkdir(exist_ok=True)
        launcher(bindir)
        plugin = [str(cluster.cp.kubectl_bin), "ppojob", "logs", name, "-n", ns]
        plugin += [f"--kubeconfig={cluster.cp.admin_kubeconfig}"]
        for role, extra in (("head", ["--container", "ray-job-submitter"]), ("rollout", [])):
            got = subprocess.run(
                [*plugin, "--role", role, *extra],
                capture_output=True,
                text=True,
                env=plugin_env(bindir),
                timeout=120,
            )
            seen[f"plugin logs {role}"] = (got.returncode, got.stdout, got.stderr)
        version = ["python", "-c", "import ray; print(ray.__version__)"]
        out = cluster.kubectl("exec", "-n", ns, head_name, "-c", "ray-head", "--", *version)
        seen["ray version"] = out.strip().splitlines()[-1]

    def observe(row: dict[str, str], job: dict[str, Any]) -> None:
        step = (job.get("status", {}).get("progress") or {}).get("step") or 0
        for p in job_pods(cluster, ns):
            seen["pods"][p["metadata"]["name"]] = p
        if step >= 3 and not probes:
            probes.append(threading.Thread(target=probe, daemon=True))
            probes[0].start()

    table = TableWatch(cluster, ns, name, host.parent / f"{ns}-watch.txt")
    t0 = time.monotonic()
    job, rows = watch(cluster, ns, name, 600, observe)
    seen["watched"] = table.rows()
    for t in probes:
        t.join(120)
    seen.update(job=job, rows=rows, host=host, seconds=time.monotonic() - t0)
    seen["rayjob"] = cluster.cp.get("rayjobs.ray.io", name, ns)
    yield seen


def test_the_job_trains_in_pods_kuberay_made_and_succeeds(trained: dict[str, Any]) -> None:
    job, rayjob = trained["job"], trained["rayjob"]
    assert job["status"]["phase"] == "Succeeded", json.dumps(job["status"], indent=1)
    # KubeRay's own verdict, read from the Ray dashboard of the head pod
    assert rayjob["status"]["jobStatus"] == "SUCCEEDED", rayjob["status"]
    assert rayjob["status"]["jobDeploymentStatus"] == "Complete", rayjob["status"]
    # the pods were real containers of the trainer image, on the real node, with pod addresses
    pods = trained["pods"].values()
    types = {p["metadata"]["labels"]["ray.io/node-type"] for p in pods}
    assert types == {"head", "worker"}, types
    for p in pods:
        assert p["spec"]["nodeName"] == "node-0"
        assert p["status"].get("podIP", "").startswith("10.77.0."), p["status"]
        for c in p["status"].get("containerStatuses", []):
            assert c["containerID"].startswith("containerd://"), c
    assert job["status"]["progress"]["step"] == STEPS


def test_kubectl_get_ppojobs_shows_step_and_reward_moving(trained: dict[str, Any]) -> None:
    """`kubectl get ppojobs -w`: the printer columns Step and Reward change as the job trains
    (the trainer writes its progress at most every 5 s), Phase ends Succeeded; and the table as
    polled has the same columns."""
    rows = trained["watched"]
    steps = [int(r["Step"]) for r in rows if r["Step"].isdigit()]
    rewards = [float(r["Reward"]) for r in rows if r["Reward"] != "<none>"]
    assert len(set(steps)) >= 3, rows
    assert steps == sorted(steps), steps
    assert len(set(rewards)) >= 2, rows
    phases = [r["Phase"] for r in rows if r["Phase"] != "<none>"]
    assert "Running" in phases and phases[-1] == "Succeeded", phases
    # once running, never back (the Ray job's end before KubeRay's Complete once read
    # Initializing here)
    assert set(phases[phases.index("Running") :]) == {"Running", "Succeeded"}, phases
    polled = trained["rows"]
    assert {"PHASE", "STEP", "STEPS", "REWARD"} <= set(polled[-1]), polled[-1]
    assert polled[-1]["STEP"] == str(STEPS) and polled[-1]["PHASE"] == "Succeeded"


def test_the_final_reward_is_clearly_above_the_start(trained: dict[str, Any]) -> None:
    """From the trainer's own metrics on the checkpoint volume: steps 1..STEPS in order, and the
    last five steps' mean reward at least twice the first step's and 0.03 above it (the first
    step scores the untrained policy, ~0.03; 128 samples x 8 positions a step)."""
    rows = metrics(trained["host"])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    events = attempt_events(trained["host"])  # one attempt: the run was never restarted
    assert [(e["event"], e["step"]) for e in events] == [("start", 0), ("finished", STEPS)]
    first = rows[0]["reward_mean"]
    last = sum(r["reward_mean"] for r in rows[-5:]) / 5
    assert first < 2 * RANDOM_REWARD, first
    assert last >= 2 * first and last >= first + 0.03, (first, last)
    # the status carries the trainer's last report
    assert trained["job"]["status"]["progress"]["rewardMean"] == pytest.approx(
        rows[-1]["reward_mean"]
    )
    # and the checkpoints of interval 10 and the end are on the volume
    assert checkpoints(trained["host"])[-1] == STEPS


def test_the_jobs_token_patches_only_its_own_jobs_status(trained: dict[str, Any]) -> None:
    """From a trainer pod, with its ServiceAccount token: its own job's status (the chart's
    admission policy refuses any change but ``status.progress``: its phase), and nothing else."""
    assert trained["token"] == {
        "own status": 200,
        "own phase": 403,
        "other status": 403,
        "own spec": 403,
        "secrets": 403,
    }


def test_the_dashboards_job_api_answers_only_the_clusters_token(trained: dict[str, Any]) -> None:
    """KubeRay >= 1.6 with ``authOptions.mode: token`` (the operator's default there): a real
    request to the head's job API from another pod is refused without the token (401) and
    with a wrong one (403); the token KubeRay gave the job's containers is accepted."""
    assert trained["dashboard"] == {"none": 401, "wrong": 403, "own": 200}, trained["dashboard"]


def test_the_images_ray_is_the_spec_default(trained: dict[str, Any]) -> None:
    from ppojob_api.spec import RAY_VERSION

    assert trained["ray version"] == RAY_VERSION
    assert trained["rayjob"]["spec"]["rayClusterSpec"]["rayVersion"] == RAY_VERSION


def test_kubectl_logs_reach_the_head_pod(trained: dict[str, Any]) -> None:
    """API server -> kubelet (by InternalIP) -> containerd's stream server: the Ray head's log
    and the submitter's, which follows the driver's output (SidecarMode)."""
    assert "to view the status of the cluster" in trained["logs"].lower(), trained["logs"][-2000:]
    assert "step" in trained["submitter logs"].lower(), trained["submitter logs"][-2000:]


def test_kubectl_ppojob_logs_reach_each_roles_pod(trained: dict[str, Any]) -> None:
    """`kubectl ppojob logs --role ...` (the plugin, found on PATH by the real kubectl): the
    driver's output from the head's submitter container, and a rollout's log from the actor's
    pod it is colocated in, said so."""
    code, out, err = trained["plugin logs head"]
    # the driver's own line (the head's ray-head log has "step" in Ray's "Next steps" too)
    assert code == 0 and "placement group" in out, (code, out[-2000:], err[-2000:])
    code, out, err = trained["plugin logs rollout"]
    assert code == 0, (code, out[-2000:], err[-2000:])
    assert "role rollout runs in the actor's pods" in out, out[:500]
    assert "ray" in out.lower(), out[-2000:]  # the worker pod's Ray log


def test_pods_reach_only_their_subnet_and_services(trained: dict[str, Any]) -> None:
    """The network rule, checked inside the pods' network namespaces and on the host."""
    for key in ("network", "worker network"):
        report = trained[key]
        routes = sorted(r.split()[0] for r in report["routes"])
        assert routes == ["10.0.0.0/24", "10.77.0.0/24"], report["routes"]  # no default route
        assert report["masquerade"] == [], report["masquerade"]
        assert "forward" not in report["corefile"]


def test_every_listener_of_the_run_is_on_loopback_or_the_pod_network(
    trained: dict[str, Any],
) -> None:
    """`ss -lntup` on the host while the job runs: every socket the control plane, the node and
    containerd's shims listen on is on 127.0.0.1 or the bridge's gateway (the API server, the
    kubelet and CoreDNS, which pods must reach); nothing on all interfaces."""
    found = trained["listeners"]
    names = {name for _, name in found}
    assert {"kube-apiserver", "kubelet", "coredns", "containerd"} <= names, found
    for addr, name in found:
        host = addr.rsplit(":", 1)[0]
        assert host in ("127.0.0.1", "[::1]", GATEWAY), (name, addr)


def test_the_operator_runs_as_the_charts_deployment(real_cluster: RealCluster) -> None:
    pod = operator_pod(real_cluster)
    assert pod["status"]["phase"] == "Running"
    assert pod["spec"]["nodeName"] == "node-0"
    (container,) = pod["spec"]["containers"]
    assert container["image"] == real_cluster.images["operator"]
    # in-cluster configuration: the ServiceAccount token, no kubeconfig
    assert not any(e.get("name") == "KUBECONFIG" for e in container.get("env", []))
    mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
    assert "/var/run/secrets/kubernetes.io/serviceaccount" in mounts


# --------------------------------------------------------------------------- failures


def test_a_reward_function_that_raises_fails_the_job_with_its_message_though_a_pod_is_deleted(
    real_cluster: RealCluster,
) -> None:
    """Issue 42: a user deletes the crashing job's worker pod as soon as the trainer's error is
    in the PPOJob's status, while KubeRay still holds the attempt as running (the operator
    records the pod's loss as evidence for the attempt). An error of the trainer's own stays an
    application error: the job fails with the reward's message (``backoffLimit: 0``), no
    uncounted disruption restarts it."""
    cluster, ns, name = real_cluster, "reward-raises", "bad-reward"
    namespace(cluster, ns)
    # os.path.join takes any arguments, then refuses the lists the reward gets
    apply(cluster, ppojob(cluster, name, ns, 5, reward_function="posixpath:join"))

    def trainer_error() -> str | None:
        job = get_job(cluster, ns, name)
        return ((job.get("status") or {}).get("progress") or {}).get("error")

    error = wait_until(trainer_error, 400, "the trainer's error in the PPOJob's status", 0.1)
    worker = pod_of(cluster, ns, "worker")
    assert worker is not None, "no worker pod when the trainer's error came"
    cluster.kubectl("delete", "pod", "-n", ns, worker["metadata"]["name"], "--wait=false")
    rayjob = cluster.cp.get("rayjob.ray.io", name, ns) or {}
    # the deletion came while the attempt was running: the operator holds it as evidence
    assert (rayjob.get("status") or {}).get("jobDeploymentStatus") == "Running", rayjob.get(
        "status"
    )
    assert get_job(cluster, ns, name)["status"]["phase"] == "Running"
    job, _ = watch(cluster, ns, name, 300)
    status = job["status"]
    assert status["phase"] == "Failed", json.dumps(status, indent=1)
    assert not status.get("disruptions") and not status.get("restarts"), status
    assert not status.get("lastRestart"), status
    message = condition(job, "Failed").get("message", "")
    assert "data.rewardFunction" in message and "posixpath:join" in message, message
    assert "TypeError" in message and "TypeError" in error, (message, error)


def test_an_image_that_does_not_exist_fails_the_job_with_the_reason(
    real_cluster: RealCluster,
) -> None:
    cluster, ns = real_cluster, "no-image"
    namespace(cluster, ns)
    missing = "localhost/ppojob-trainer:does-not-exist"
    apply(cluster, ppojob(cluster, "no-image", ns, 5, image=missing))
    job, _ = watch(cluster, ns, "no-image", 300)
    assert job["status"]["phase"] == "Failed"
    message = condition(job, "Failed").get("message", "")
    assert missing in message and "ErrImageNeverPull" in message, message
    # and nothing is left running for it
    wait_until(lambda: not job_pods(cluster, ns), 120, "the job's pods to go")


def test_a_worker_hung_inside_a_step_is_named_and_on_stall_is_applied(
    real_cluster: RealCluster,
) -> None:
    """Issue 42: rank 0 of the actor blocks for ever on entering ``train`` inside a real step (the
    tests' fault gate ``PPOJOB_HANG_GATE``, in the actor's pods through ``roles.actor.env``).
    The stall watchdog (its floor, 20 s: the steps here take well under a second) ends the
    attempt with one line naming the role, rank and phase; the operator applies
    ``failurePolicy.onStall: Restart``: an uncounted restart, which hangs the same way, and with
    ``maxDisruptions: 1`` the job then fails, naming the hung rank."""
    cluster, ns, name = real_cluster, "stall", "tiny"
    namespace(cluster, ns)
    doc = ppojob(cluster, name, ns, 20)
    gate = {"name": "PPOJOB_HANG_GATE", "value": "actor:0:train"}
    doc["spec"]["roles"]["actor"]["env"] = [gate]
    doc["spec"]["failurePolicy"].update(
        {"stallTimeoutSeconds": 20, "onStall": "Restart", "maxDisruptions": 1}
    )
    apply(cluster, doc)
    job, _ = watch(cluster, ns, name, 900)
    status = job["status"]
    assert status["phase"] == "Failed", json.dumps(status, indent=1)
    assert status.get("disruptions") == 1 and not status.get("restarts"), status
    last = status["lastRestart"]
    assert (last["failureClass"], last["reason"]) == ("Disruption", "RestartingAfterDisruption")
    for text in (last["message"], condition(job, "Failed").get("message", "")):
        assert "Stalled: " in text and "actor rank 0 (train)" in text, text
        assert "no step progress for 20s" in text, text
    events = json.loads(cluster.kubectl("get", "events", "-n", ns, "-o", "json"))["items"]
    assert any(e["reason"] == "DisruptionLimitExceeded" for e in events), [
        (e["reason"], e["message"]) for e in events
    ]


# --------------------------------------------------------------------------- disruptions


def steps_run(host: Path) -> list[int]:
    """The steps in the trainer's metrics.jsonl on the volume (a resumed attempt drops the
    lines of the steps it redoes: each step once)."""
    return [int(r["step"]) for r in metrics(host)]


def attempt_events(host: Path) -> list[dict[str, Any]]:
    """The trainer's attempts.jsonl on the volume: where each attempt started (the steps its
    checkpoint held) and how it ended (absent when it was killed)."""
    return read_attempts(host / "output")


def first_end(host: Path, what: str) -> dict[str, Any]:
    """Wait for the first attempt's end in attempts.jsonl (the trainer's account of its stop)."""
    return wait_until(
        lambda: next((e for e in attempt_events(host) if e["event"] != "start"), None),
        300,
        what,
        interval=0.5,
    )


def starts(host: Path) -> list[int]:
    return [e["step"] for e in attempt_events(host) if e["event"] == "start"]


STOPPED = re.compile(r"^Preempted: .*?(\d+) completed steps are in checkpoint \S*step-0*(\d+)\b")
"""The trainer's account of a stop (``status.progress.error`` and attempts.jsonl, written before
it exits 75): the completed steps, and the checkpoint that holds them."""


def stop_checkpoint(error: str) -> int:
    """The step of the checkpoint a ``Preempted`` account names (the steps it says it holds)."""
    m = STOPPED.match(error)
    assert m, error
    steps, ckpt = int(m.group(1)), int(m.group(2))
    assert steps == ckpt, error
    return ckpt


def progress_step(job: dict[str, Any]) -> int:
    return int(((job.get("status") or {}).get("progress") or {}).get("step") or 0)


# A step of the tiny job takes about 0.15 s in these pods and the trainer reports its progress
# every 5 s: the disruption, sent once the first report is seen, must land well before the end.
DISRUPTION_STEPS = 80  # ~0.25 s a step here; each disruption came within 5 steps of its cue
SUSPEND_STEPS = 80  # a suspension goes through KubeRay (a few seconds more); it came at step 3


# One job, two disruptions in turn (one job start instead of two: pods take about a minute to
# start on this node), with no periodic checkpoint (checkpointInterval 0): a preemption first,
# the head pod deleted as usual (SIGTERM, the pod's grace period), then a lost node, the
# restarted attempt's worker containers killed at once (no SIGTERM grace).
DISRUPTIONS = [("head", []), ("worker", ["--grace-period=0", "--force"])]


@pytest.mark.second_lane
def test_a_preempted_head_checkpoints_its_last_step_and_a_lost_worker_resumes_from_it(
    real_cluster: RealCluster,
) -> None:
    """Delete a pod mid-training, twice, with no periodic checkpoint: each attempt fails, the
    operator classifies it as a disruption and restarts the job uncounted (spec.failurePolicy)
    with a new RayJob, and the job finishes.
    The head deleted gracefully: the trainer finishes the step in flight, checkpoints it (the
    only checkpoint of the run until the end), says so (``Preempted: ... N completed steps are
    in checkpoint .../step-N``) and exits 75; the next attempt starts at step N.
    The worker killed (2 s from SIGTERM to SIGKILL): its Ray node drains and the trainer hears
    of it at once; the next attempt resumes from a checkpoint the trainer wrote in those 2 s, or
    from the stop's checkpoint again (a lost node with no periodic checkpoint costs the steps
    since)."""
    cluster, ns, name = real_cluster, "disrupt", "tiny"
    namespace(cluster, ns)
    host = volume(cluster, ns)
    apply(cluster, ppojob(cluster, name, ns, DISRUPTION_STEPS, claim="ckpt", interval=0, backoff=2))
    deleted: list[dict[str, Any]] = []
    messages: set[str] = set()

    def disrupt(row: dict[str, str], job: dict[str, Any]) -> None:
        status = job.get("status") or {}
        if (status.get("lastRestart") or {}).get("message"):
            messages.add(status["lastRestart"]["message"])
        if len(deleted) == len(DISRUPTIONS):
            return
        step = progress_step(job)
        if step < 1:  # the first once the trainer reports a step
            return
        if deleted:
            # the next once the restarted attempt has completed a step of its own (its first
            # progress report is the step it resumed at, not one it ran)
            if status.get("disruptions", 0) < len(deleted):
                return
            try:
                begun = starts(host)
                if len(begun) <= len(deleted) or steps_run(host)[-1] <= begun[-1]:
                    return
            except (OSError, ValueError, IndexError):  # not written yet
                return
        node_type, how = DISRUPTIONS[len(deleted)]
        ray_cluster = status.get("rayClusterName")
        pod = pod_of(cluster, ns, node_type, ray_cluster) if ray_cluster else None
        if pod is None:
            return
        deleted.append(
            {"step": step, "pod": pod["metadata"]["name"], "type": node_type, "of": ray_cluster}
        )
        cluster.kubectl("delete", "pod", "-n", ns, pod["metadata"]["name"], "--wait=false", *how)

    job, _ = watch(cluster, ns, name, 900, disrupt)
    assert [d["type"] for d in deleted] == ["head", "worker"], f"the job ended first: {deleted}"
    assert job["status"]["phase"] == "Succeeded", json.dumps(job["status"], indent=1)
    status = job["status"]
    # disruptions: restarted, and not counted against spec.backoffLimit
    assert status.get("disruptions", 0) >= 2 and not status.get("restarts"), status
    assert status["lastRestart"]["failureClass"] == "Disruption", status["lastRestart"]
    messages.add(status["lastRestart"]["message"])
    for d in deleted:  # each restart named the pod that went
        assert any(f"pod {d['pod']} was deleted" in m for m in messages), json.dumps(
            {"deleted": deleted, "messages": sorted(messages), "attempts": attempt_events(host)},
            indent=1,
        )
    events = attempt_events(host)
    # the first attempt ended with the trainer's account of its stop, naming the checkpoint
    first_end = next(e for e in events if e["event"] != "start")
    stopped = stop_checkpoint(first_end["error"])
    assert first_end["step"] == stopped, events  # every completed step is in it
    # the second attempt began from that checkpoint (not from scratch); the worker's kill is a
    # SIGTERM with the kubelet's least grace (2 s) before its SIGKILL: the trainer hears of the
    # drain at once (its Ray node's), and when it finished the step and checkpointed in time,
    # the third attempt starts at that checkpoint, else at the first stop's again
    begun = starts(host)
    assert begun[:2] == [0, stopped] and len(begun) == 3, events
    if begun[2] != stopped:
        second_end = [e for e in events if e["event"] != "start"][1]
        assert stop_checkpoint(second_end["error"]) == begun[2] > stopped, events
    assert events[-1]["event"] == "finished" and events[-1]["step"] == DISRUPTION_STEPS, events
    assert steps_run(host) == list(range(1, DISRUPTION_STEPS + 1))


def test_suspend_removes_every_pod_and_resume_continues_from_the_stop_checkpoint(
    real_cluster: RealCluster,
) -> None:
    """With no periodic checkpoint (checkpointInterval 0): a suspension stops the trainer with a
    checkpoint of its last completed step (the only one on the volume), named in its
    ``Preempted`` account in the job's status; resumed, the job starts there and redoes no
    step."""
    cluster, ns, name = real_cluster, "suspend", "tiny"
    namespace(cluster, ns)
    host = volume(cluster, ns)
    apply(cluster, ppojob(cluster, name, ns, SUSPEND_STEPS, claim="ckpt", interval=0))
    wait_until(lambda: progress_step(get_job(cluster, ns, name)) >= 1, 600, "step 1", interval=1.0)
    done = steps_run(host)[-1]
    t0 = time.monotonic()
    cluster.cp.kubectl(
        "patch", "ppojob", name, "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":true}}'
    )
    first_end(host, "the trainer's account of the stop")
    took = time.monotonic() - t0
    wait_until(
        lambda: get_job(cluster, ns, name)["status"].get("phase") == "Suspended",
        300,
        "phase Suspended",
        interval=1.0,
    )
    wait_until(lambda: not job_pods(cluster, ns), 300, "every pod of the job to go", interval=1.0)
    suspended = get_job(cluster, ns, name)["status"]
    before = steps_run(host)
    assert before and before[-1] < SUSPEND_STEPS, before  # stopped mid-run
    # SIGTERM: the last completed step checkpointed, beside the first step's (the probe)
    assert checkpoints(host) == with_probe(before[-1]), (checkpoints(host), before)
    error = (suspended.get("progress") or {}).get("error") or ""
    assert stop_checkpoint(error) == before[-1], suspended
    assert [(e["event"], e["step"]) for e in attempt_events(host)] == [
        ("start", 0),
        ("failed", before[-1]),
    ]
    cluster.cp.kubectl(
        "patch", "ppojob", name, "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":false}}'
    )
    job, _ = watch(cluster, ns, name, 900)
    assert job["status"]["phase"] == "Succeeded", json.dumps(job["status"], indent=1)
    assert starts(host) == [0, before[-1]], attempt_events(host)  # resumed at the checkpoint
    assert steps_run(host) == list(range(1, SUSPEND_STEPS + 1))
    print(
        f"\nsuspend: completed {done} when patched, checkpoint {before[-1]}, steps redone 0, "
        f"patch to the trainer's account {took:.1f}s"
    )


LONG_STEPS = 7  # 2 steps and the one in flight in each of 2 attempts, then the last one
LONG_STEP_S = 12  # the actor's train sleeps this long every step (PPOJOB_HANG_GATE's seconds)


@pytest.mark.second_lane
def test_long_steps_in_flight_finish_and_checkpoint_when_the_head_then_a_worker_go(
    real_cluster: RealCluster,
) -> None:
    """Issue 42 with steps of a real job's kind (each over 12 s: the actor's train sleeps, the
    tests' gate), no periodic checkpoint, the default grace period (120 s): the head deleted,
    then, in the next attempt, the actor's worker pod deleted. Each time the step in flight is
    finished, not abandoned (it fits the grace period), and checkpointed: the stop's account
    names that step and its checkpoint; the next attempt starts there and no step is run
    twice. The worker's SIGTERM reaches ``ray start --block``, which drains its Ray node and
    keeps the actor alive (the drain's bound is the grace period) while the driver, told of the
    drain by the GCS, finishes the step and has that actor write its share of the checkpoint."""
    cluster, ns, name = real_cluster, "long-steps", "tiny"
    namespace(cluster, ns)
    host = volume(cluster, ns)
    doc = ppojob(cluster, name, ns, LONG_STEPS, claim="ckpt", interval=0)
    gate = {"name": "PPOJOB_HANG_GATE", "value": f"actor:0:train:{LONG_STEP_S}"}
    doc["spec"]["roles"]["actor"]["env"] = [gate]
    apply(cluster, doc)
    figures = []
    for n, node_type in enumerate(("head", "worker")):
        begun = 0 if n == 0 else figures[-1]["checkpoint"]

        # an attempt's first step is followed by a checkpoint (its cost, which a stop needs, is
        # measured there): a pod deleted while it is written finds no step in flight (seen, in
        # CI), so the pod goes once the attempt's second step is in the metrics, when the third
        # has just begun (a step is over 12 s, the poll 0.5 s)
        def ran_two_steps_of_its_own(n: int = n, begun: int = begun) -> bool:
            try:
                return len(starts(host)) == n + 1 and steps_run(host)[-1] >= begun + 2
            except (OSError, ValueError, IndexError):  # not written yet
                return False

        wait_until(ran_two_steps_of_its_own, 600, f"attempt {n}'s two steps", interval=0.5)
        done = steps_run(host)[-1]
        pod = pod_of(cluster, ns, node_type)
        assert pod is not None, node_type
        worker = pod_of(cluster, ns, "worker")
        assert worker is not None
        t0 = time.monotonic()
        cluster.kubectl("delete", "pod", "-n", ns, pod["metadata"]["name"], "--wait=false")
        ended = wait_until(
            lambda n=n: ([e for e in attempt_events(host) if e["event"] != "start"][n:] or [None])[
                0
            ],
            300,
            f"attempt {n}'s end in attempts.jsonl",
            interval=0.5,
        )
        took = time.monotonic() - t0
        stopped = stop_checkpoint(ended["error"])
        assert "finished the step in flight" in ended["error"], ended
        # the step in flight at the signal (the one after the last completed) is in it
        assert stopped == done + 1, (done, ended)
        figures.append({"pod": node_type, "in flight": done + 1, "checkpoint": stopped})
        figures[-1]["signal to account (s)"] = round(took, 1)
        if node_type == "head":
            # the restart tears the old cluster down after its head: the old worker pod's
            # preStop hook finds no GCS and ends its Ray node at once, instead of the SIGTERM
            # drain's retries to the gone GCS holding the pod (and its CPU) for the grace period
            t_end, gone = time.monotonic(), worker["metadata"]["name"]
            wait_until(
                lambda gone=gone: (
                    gone not in {p["metadata"]["name"] for p in job_pods(cluster, ns)}
                ),
                120,
                f"the old attempt's worker pod {gone} to go",
                interval=0.5,
            )
            figures[-1]["old worker gone after the account (s)"] = round(
                time.monotonic() - t_end, 1
            )
            assert figures[-1]["old worker gone after the account (s)"] < 45, figures
    job, _ = watch(cluster, ns, name, 900)
    assert job["status"]["phase"] == "Succeeded", json.dumps(job["status"], indent=1)
    assert job["status"].get("disruptions") == 2 and not job["status"].get("restarts")
    assert starts(host) == [0] + [f["checkpoint"] for f in figures], attempt_events(host)
    assert steps_run(host) == list(range(1, LONG_STEPS + 1))  # each step once: none redone
    print(f"\nlong steps ({LONG_STEP_S}s each): {figures}, steps redone 0")


LONGER_STEPS = 3
LONGER_GENERATE_S = 8  # the engine's generation sleeps this long every step (the gate)
LONGER_TRAIN_S = 30  # and the actor's training this long: a step of about 40 s
LONGER_GRACE_S = 30  # the pods' grace period (the least with a volume): shorter than a step


@pytest.mark.second_lane
def test_a_step_longer_than_the_grace_period_is_abandoned_with_the_completed_steps_saved(
    real_cluster: RealCluster,
) -> None:
    """Issue 42, a step (about 40 s: 8 s of generation, 30 s of training, the tests' gate)
    longer than the pods' grace period (30 s), no periodic checkpoint: the actor's worker pod
    deleted as the third step begins. The trainer cannot finish the step; it lets the generation end
    (its engine is colocated in the actor's process), sees at the step's commit that the
    training the last step took no longer fits, abandons the step there, before any training,
    and checkpoints the completed steps while the worker's Ray node drains. Its account says it
    abandoned the step and names that checkpoint; the next attempt starts there and redoes no
    completed step. The grace period's check (after the first step) warned beforehand."""
    cluster, ns, name = real_cluster, "longer", "tiny"
    namespace(cluster, ns)
    host = volume(cluster, ns)
    doc = ppojob(cluster, name, ns, LONGER_STEPS, claim="ckpt", interval=0)
    doc["spec"]["failurePolicy"]["terminationGracePeriodSeconds"] = LONGER_GRACE_S
    gates = f"rollout:0:generate:{LONGER_GENERATE_S},actor:0:train:{LONGER_TRAIN_S}"
    doc["spec"]["roles"]["actor"]["env"] = [{"name": "PPOJOB_HANG_GATE", "value": gates}]
    apply(cluster, doc)

    def two_steps() -> bool:
        try:
            return len(steps_run(host)) >= 2
        except (OSError, ValueError):  # not written yet
            return False

    # the second step's record is written as the third step begins: its generation has 8 s
    wait_until(two_steps, 600, "two completed steps", interval=0.2)
    done = steps_run(host)[-1]
    warning = ((get_job(cluster, ns, name).get("status") or {}).get("progress") or {}).get(
        "warning"
    ) or ""
    assert warning.startswith("GracePeriodTooShort: "), warning
    pod = pod_of(cluster, ns, "worker")
    assert pod is not None
    t0 = time.monotonic()
    cluster.kubectl("delete", "pod", "-n", ns, pod["metadata"]["name"], "--wait=false")
    ended = first_end(host, "the first attempt's end in attempts.jsonl")
    took = time.monotonic() - t0
    stopped = stop_checkpoint(ended["error"])
    assert "abandoned the step in flight" in ended["error"], ended
    assert stopped == done == steps_run(host)[-1], (done, ended)  # every completed step
    assert checkpoints(host) == with_probe(stopped)
    job, _ = watch(cluster, ns, name, 900)
    assert job["status"]["phase"] == "Succeeded", json.dumps(job["status"], indent=1)
    assert job["status"].get("disruptions") == 1 and not job["status"].get("restarts")
    assert starts(host) == [0, stopped], attempt_events(host)
    assert steps_run(host) == list(range(1, LONGER_STEPS + 1))  # each step once: none redone
    print(
        f"\nstep longer than the grace period ({LONGER_GRACE_S}s): completed {done}, step "
        f"{done + 1} in flight, checkpoint {stopped}, steps redone 0, signal to the trainer's "
        f"account {took:.1f}s"
    )


DRAIN_STEPS = 80


@pytest.mark.whole_node
def test_a_drained_node_stops_the_job_with_its_checkpoint_and_uncordoned_it_resumes(
    real_cluster: RealCluster,
) -> None:
    """``kubectl drain`` of the node (its job's pods; the operator stays) through the Eviction
    API, with no periodic checkpoint and no PodDisruptionBudget (with one, the drain would wait
    for the job: ``tests/cluster/test_children.py``): every pod of the job gets its SIGTERM, the
    trainer checkpoints its last completed step and exits ``Preempted`` naming it; the operator
    classifies the evictions as a disruption (the pods' ``DisruptionTarget``) and restarts the
    job uncounted, whose pods wait while the node is cordoned; uncordoned, the job resumes at
    that checkpoint and redoes no step."""
    cluster, ns, name = real_cluster, "drain", "tiny"
    namespace(cluster, ns)
    host = volume(cluster, ns)
    doc = ppojob(cluster, name, ns, DRAIN_STEPS, claim="ckpt", interval=0, backoff=2)
    doc["spec"]["failurePolicy"]["podDisruptionBudget"] = False
    apply(cluster, doc)
    wait_until(lambda: progress_step(get_job(cluster, ns, name)) >= 1, 600, "step 1", interval=1.0)
    head = pod_of(cluster, ns, "head")
    assert head is not None
    node = head["spec"]["nodeName"]
    at_signal = progress_step(get_job(cluster, ns, name))
    t0 = time.monotonic()
    try:
        out = cluster.kubectl(
            "drain",
            node,
            "--pod-selector=ray.io/node-type",
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--timeout=300s",
            timeout=330,
        )
        drained = time.monotonic() - t0
        assert "evicting pod" in out or "evicted" in out, out
        # the first attempt's end: the trainer's account of its stop
        ended = wait_until(
            lambda: next((e for e in attempt_events(host) if e["event"] != "start"), None),
            120,
            "the first attempt's end in attempts.jsonl",
            interval=1.0,
        )
        stopped = stop_checkpoint(ended["error"])
        assert checkpoints(host) == with_probe(stopped), (checkpoints(host), stopped)
        assert stopped >= at_signal, (stopped, at_signal)
    finally:
        cluster.kubectl("uncordon", node)
    job, _ = watch(cluster, ns, name, 900)
    assert job["status"]["phase"] == "Succeeded", json.dumps(job["status"], indent=1)
    status = job["status"]
    why = json.dumps({"status": status, "attempts": attempt_events(host)}, indent=1)
    assert not status.get("restarts"), why  # never an application error's counted restart
    if status.get("lastRestart"):
        # the operator saw the attempt fail: a disruption, named by the pods' eviction
        assert status.get("disruptions", 0) >= 1, why
        assert status["lastRestart"]["failureClass"] == "Disruption", status["lastRestart"]
        assert "(EvictionByEvictionAPI)" in status["lastRestart"]["message"], why
        how = "the operator restarted it as a disruption"
    else:
        # KubeRay 1.6.1 fails a SidecarMode RayJob only when a reconcile finds no head pod or
        # the old head's submitter terminated non-zero; when the RayCluster controller has
        # already made the new head by then, the RayJob stays Running and the new head's
        # submitter runs the job again: the same attempt of the PPOJob resumes (a limit,
        # docs/troubleshooting.md). The resume itself must be the same.
        assert not status.get("disruptions"), why
        assert [e["event"] for e in attempt_events(host)][:3] == ["start", "failed", "start"], why
        how = "KubeRay ran it again on the new head, inside the same RayJob"
    assert starts(host)[:2] == [0, stopped], attempt_events(host)
    assert steps_run(host) == list(range(1, DRAIN_STEPS + 1))
    print(
        f"\ndrain: step {at_signal} reported at the drain, checkpoint at step {stopped}, "
        f"drain returned after {drained:.1f}s, steps redone 0; {how}"
    )


# --------------------------------------------------------------------------- elastic rollout

ELASTIC_STEPS = 200


@pytest.mark.whole_node
def test_a_lost_elastic_rollout_pod_costs_only_its_samples(real_cluster: RealCluster) -> None:
    """Issue 24 on real pods: rollout engines in a worker group of their own, elastic between 1
    and 2, started with 1 pod. The trainer asks for a second engine, and KubeRay's in-tree
    autoscaler (a container of the head pod, reading that Ray demand) raises the group to 2 pods:
    nothing else writes the RayCluster's replicas. Once both engines generate, one rollout pod
    is deleted: the job is not restarted and does not fail; the trainer goes on with the engine
    left (any prompts the lost one was generating are generated again there:
    tests/trainer/test_elastic_rollout.py makes that happen on cue), a new pod comes for the
    group, and every step runs exactly once."""
    cluster, ns, name = real_cluster, "elastic", "tiny"
    namespace(cluster, ns)
    host = volume(cluster, ns)
    doc = ppojob(cluster, name, ns, ELASTIC_STEPS, claim="ckpt", interval=100)
    # the node has 2 CPUs: the operator 0.1, head 0.1 (+ 0.5 for KubeRay's submitter, + 0.1
    # for its autoscaler), actor 0.5, 2 x 0.2
    doc["spec"]["roles"] = {
        "actor": {"replicas": 1, "resources": {"cpus": 0.5, "memory": "3Gi"}},
        "rollout": {
            "replicas": 1,  # the autoscaler adds the second pod
            "resources": {"cpus": 0.2, "memory": "2Gi"},
            "elastic": {"minReplicas": 1, "maxReplicas": 2},
        },
    }
    apply(cluster, doc)
    deleted: list[str] = []

    def rollout_pods() -> list[dict[str, Any]]:
        return [
            p
            for p in job_pods(cluster, ns)
            if p["metadata"]["labels"].get("ray.io/group") == "rollout"
            and not p["metadata"].get("deletionTimestamp")
        ]

    def both_engines_generate() -> bool:
        try:
            rows = metrics(host)
        except OSError:  # not written yet
            return False
        return bool(rows) and rows[-1].get("rollout/engines") == 2

    scaled: list[int] = []  # the rollout group's replicas once both engines generate
    head_containers: list[str] = []

    seen: dict[str, Any] = {}  # the last look at the group (told when the test fails)

    def disrupt(row: dict[str, str], job: dict[str, Any]) -> None:
        if not deleted:
            seen["rollout pods"] = [
                (p["metadata"]["name"], p["status"].get("phase"), p["status"].get("conditions"))
                for p in rollout_pods()
            ]
            rj = cluster.cp.get("rayjob.ray.io", name, ns) or {}
            rc_name = (rj.get("status") or {}).get("rayClusterName")
            rc = cluster.cp.get("raycluster.ray.io", rc_name, ns) if rc_name else None
            if rc:
                seen["replicas"] = [
                    (g["groupName"], g.get("replicas")) for g in rc["spec"]["workerGroupSpecs"]
                ]
            seen["looks"] = seen.get("looks", 0) + 1
            head = pod_of(cluster, ns, "head") if seen["looks"] % 10 == 0 else None
            if head is not None and any(
                c["name"] == "autoscaler" for c in head["spec"]["containers"]
            ):
                seen["autoscaler log"] = cluster.kubectl(
                    "logs",
                    "-n",
                    ns,
                    head["metadata"]["name"],
                    "-c",
                    "autoscaler",
                    "--tail=8",
                    check=False,
                )
        if deleted or not both_engines_generate():
            return
        if not scaled:
            rj = cluster.cp.get("rayjob.ray.io", name, ns)
            rc = cluster.cp.get("raycluster.ray.io", rj["status"]["rayClusterName"], ns)
            groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
            scaled.append(groups["rollout"]["replicas"])
            head = pod_of(cluster, ns, "head") or {"spec": {"containers": []}}
            head_containers.extend(c["name"] for c in head["spec"]["containers"])
        pods = rollout_pods()
        if len(pods) == 2:
            deleted.append(pods[0]["metadata"]["name"])
            cluster.kubectl(
                "delete", "pod", "-n", ns, deleted[0], "--wait=false", "--grace-period=0", "--force"
            )

    job, _ = watch(cluster, ns, name, 900, disrupt)
    assert deleted, f"the job ended before a rollout pod could be deleted: {seen}"
    # the group was made with 1 pod; KubeRay's autoscaler (in the head pod) raised it to 2
    assert scaled == [2], scaled
    assert "autoscaler" in head_containers, head_containers
    status = job["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    # (told in full when it fails: the restart's condition and the attempt's end name the cause)
    assert not status.get("restarts") and not status.get("disruptions"), json.dumps(
        {"status": status, "attempts": attempt_events(host)}, indent=1
    )
    rows = metrics(host)
    assert [r["step"] for r in rows] == list(range(1, ELASTIC_STEPS + 1))
    # one attempt, never restarted (metrics.jsonl alone keeps each step once either way)
    assert [(e["event"], e["step"]) for e in attempt_events(host)] == [
        ("start", 0),
        ("finished", ELASTIC_STEPS),
    ]
    engines = [r["rollout/engines"] for r in rows]
    two = engines.index(2)
    assert min(engines[two:]) == 1, engines  # one was lost, the job went on
    assert sum(r["rollout/lost"] for r in rows) >= 1, [r["rollout/lost"] for r in rows]
    # a new pod came for the group (it keeps its 2 replicas)
    assert len(wait_until(lambda: len(p := rollout_pods()) == 2 and p, 120, "2 rollout pods")) == 2


# --------------------------------------------------------------------------- Kueue preemption

KUEUE_STEPS = 30
KUEUE_STEP_S = 3  # the low job's actor trains this long every step (the tests' gate)


@pytest.mark.whole_node
def test_a_kueue_preemption_checkpoints_the_step_in_flight_and_the_job_resumes_there(
    real_cluster: RealCluster, real_kueue: Any
) -> None:
    """Issue 42 on the real Kueue: a low-priority job (steps of over 3 s, no periodic checkpoint)
    runs in a ClusterQueue with room for one job; a high-priority job comes, Kueue preempts the
    low one (its Workload evicted, its RayJob suspended, KubeRay deletes its pods) and the
    trainer, told by the head's preStop hook, finishes the step in flight, checkpoints it and
    exits ``Preempted``. The high job runs; once it has finished Kueue admits the low one
    again, which resumes at that checkpoint and runs no step twice."""
    from tests.helpers.controlplane import KUEUE_API

    cluster, ns = real_cluster, "kueue-preempt"
    namespace(cluster, ns)
    host = volume(cluster, ns)
    cq = f"cq-{ns}"
    cluster.cp.apply(
        [
            {"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": "node"}},
            {
                "apiVersion": KUEUE_API,
                "kind": "ClusterQueue",
                "metadata": {"name": cq},
                "spec": {
                    "namespaceSelector": {},
                    "preemption": {"withinClusterQueue": "LowerPriority"},
                    "resourceGroups": [
                        {
                            "coveredResources": ["cpu", "memory"],
                            "flavors": [
                                {
                                    "name": "node",
                                    # one job (head 0.1 + KubeRay's submitter 0.5 + actor
                                    # 0.3), not two
                                    "resources": [
                                        {"name": "cpu", "nominalQuota": "1500m"},
                                        {"name": "memory", "nominalQuota": "20Gi"},
                                    ],
                                }
                            ],
                        }
                    ],
                },
            },
            {
                "apiVersion": KUEUE_API,
                "kind": "LocalQueue",
                "metadata": {"name": "lq", "namespace": ns},
                "spec": {"clusterQueue": cq},
            },
            *[
                {
                    "apiVersion": "scheduling.k8s.io/v1",
                    "kind": "PriorityClass",
                    "metadata": {"name": f"{ns}-{level}"},
                    "value": value,
                }
                for level, value in (("low", 100), ("high", 1000))
            ],
        ]
    )

    def queued(name: str, steps: int, level: str, claim: str | None) -> dict[str, Any]:
        doc = ppojob(cluster, name, ns, steps, claim=claim, interval=0)
        doc["spec"]["scheduling"] = {
            "gangScheduler": "kueue",
            "queue": "lq",
            "priorityClassName": f"{ns}-{level}",
        }
        return doc

    low = queued("low", KUEUE_STEPS, "low", "ckpt")
    gate = {"name": "PPOJOB_HANG_GATE", "value": f"actor:0:train:{KUEUE_STEP_S}"}
    low["spec"]["roles"]["actor"]["env"] = [gate]
    apply(cluster, low)

    def ran() -> list[int]:
        try:
            return steps_run(host)
        except (OSError, ValueError):  # not written yet, or a line being written
            return []

    # past the checkpoint after its first step (a stop there finds no step in flight)
    done = wait_until(lambda: ran()[1:], 600, "two steps of the low job", interval=0.5)[-1]
    t0 = time.monotonic()
    apply(cluster, queued("high", 3, "high", None))
    ended = first_end(host, "the low job's first attempt to end")
    took = time.monotonic() - t0
    stopped = stop_checkpoint(ended["error"])
    assert "finished the step in flight" in ended["error"], ended
    # the step in flight when the stop came (Kueue's eviction and KubeRay's deletion take a
    # step or two) was finished: every step run so far is in the checkpoint
    assert stopped > done and ran()[-1] == stopped, (done, ran(), ended)
    assert checkpoints(host) == with_probe(stopped)  # and no other so far
    high, _ = watch(cluster, ns, "high", 900)
    assert high["status"]["phase"] == "Succeeded", json.dumps(high["status"], indent=1)
    job, _ = watch(cluster, ns, "low", 900)
    assert job["status"]["phase"] == "Succeeded", json.dumps(job["status"], indent=1)
    assert starts(host) == [0, stopped], attempt_events(host)
    assert steps_run(host) == list(range(1, KUEUE_STEPS + 1))  # none run twice
    print(
        f"\nkueue preemption: step {done} done at the high job's creation, checkpoint at step "
        f"{stopped}, "
        f"{took:.1f}s from the high job's creation to the low trainer's account, steps redone 0"
    )
