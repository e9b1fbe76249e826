"""A real node for the test control plane: kubelet, containerd + runc, CNI bridge, CoreDNS,
kube-proxy, all on this machine, set up and torn down by the test run itself.

What runs, and why each setting (found on this machine: root without CAP_SYS_RESOURCE, a hybrid
cgroup layout, no reachable registry, no route out):

- **Network.** One Linux bridge (:data:`BRIDGE`) with the gateway address :data:`GATEWAY` on
  :data:`POD_CIDR`, made here before the API server starts (the API server listens on the
  gateway, so pods reach it through the ``kubernetes`` Service; every other component stays on
  127.0.0.1). The CNI ``bridge`` plugin attaches pods to it with ``ipMasq: false`` and one route,
  to the Service range through the gateway: no default route, so a pod can reach only its own
  subnet and the Services kube-proxy translates to it. :meth:`RealNode.network_report` checks
  that from inside a pod's network namespace.
- **DNS.** CoreDNS built with only the ``kubernetes`` plugin and its helpers (no ``forward``
  compiled in: hack/control-plane/build.sh), listening on the gateway, answering
  ``cluster.local`` and refusing everything else. The kubelet gives pods an empty host
  resolver file, so no pod learns the machine's resolver either.
- **containerd 1.6 + runc** (Debian's packages; crun refuses the hybrid cgroup layout), CRI's
  ``restrict_oom_score_adj`` (the kubelet's negative ``oom_score_adj`` for sandboxes would be
  refused: runc then reports only "can't get final child's PID from pipe"), the sandbox image
  built locally from ``hack/node/pause.c`` (hack/images/build.sh), the CRI stream server on
  127.0.0.1. Its image store lives in the cache (images survive runs: import is done once per
  content hash); its state, sockets and the kubelet's directories live in the run's directory.
- **kubelet** (cgroupfs driver, ``failCgroupV1: false``), node IP and serving address the
  gateway (the kubelet refuses a loopback node IP; its health endpoint stays on 127.0.0.1),
  webhook authentication/authorization (the API server's client certificate is the admin
  certificate), an empty resolver file, no swap check, image garbage collection off (the
  images are imported, not pullable).
- **kube-proxy** in iptables mode, removed with ``kube-proxy --cleanup`` at the end.

Teardown (:meth:`RealNode.stop`) deletes every pod through the API so the kubelet tears down
each sandbox (CNI DEL, network namespace), stops the processes, kills any containerd shim of
this run, unmounts what is still mounted under the run's directories, removes leftover network
namespaces of this run and the bridge, and checks nothing is left (:meth:`RealNode.leftovers`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from tests.helpers.controlplane import (
    ROOT,
    Component,
    ControlPlane,
    ControlPlaneError,
    free_port,
    wait_until,
)

BRIDGE = "ppojob0"
POD_CIDR = "10.77.0.0/24"
GATEWAY = "10.77.0.1"
SERVICE_CIDR = "10.0.0.0/24"  # ControlPlane's --service-cluster-ip-range
NODE_NAME = "node-0"
IMAGES = ROOT / "hack" / "images" / "build.sh"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ppojob" / "node"
# the node's containerd snapshotter: CRI's, and the one images are unpacked into at import
SNAPSHOTTER = "overlayfs"
PACKAGES = {
    "containerd": "containerd",
    "runc": "runc",
    "/usr/lib/cni/bridge": "containernetworking-plugins",
    "ip": "iproute2",
    "iptables": "iptables",
    "buildah": "buildah",
    "debootstrap": "debootstrap",
    "nsenter": "util-linux",
}


class NodeUnavailable(ControlPlaneError):
    """This machine cannot run the real node (not root, a package cannot be installed)."""


def run(*argv: str, check: bool = True, timeout: float = 120, **kw: Any) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise ControlPlaneError(f"{' '.join(argv)} -> {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout


def _has(tool: str) -> bool:
    return Path(tool).exists() if tool.startswith("/") else shutil.which(tool) is not None


def ensure_packages() -> None:
    """Install the Debian packages the node needs (root only); a clear error otherwise."""
    missing = sorted({pkg for tool, pkg in PACKAGES.items() if not _has(tool)})
    if not missing:
        return
    if os.geteuid() != 0:
        raise NodeUnavailable(
            f"the real node needs root to install {', '.join(missing)} "
            "(Debian packages) and to run a kubelet; run the tests as root"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
    ):
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
        if proc.returncode != 0:
            raise NodeUnavailable(
                f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr[-1500:]}"
            )


def build_images(*names: str) -> dict[str, str]:
    """hack/images/build.sh: name -> image reference in buildah's store (warm: seconds)."""
    proc = subprocess.run(
        ["bash", str(IMAGES), *names], capture_output=True, text=True, timeout=3600
    )
    if proc.returncode != 0:
        raise ControlPlaneError(f"{IMAGES} failed:\n{proc.stderr[-6000:]}")
    return dict(line.split("=", 1) for line in proc.stdout.split())


# --------------------------------------------------------------------------- network


def make_bridge() -> None:
    """The pods' bridge with the gateway address (before the API server binds it)."""
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        run("ip", "link", "delete", BRIDGE)  # a crashed run's
    run("ip", "link", "add", BRIDGE, "type", "bridge")
    prefix = ipaddress.ip_network(POD_CIDR).prefixlen
    run("ip", "addr", "add", f"{GATEWAY}/{prefix}", "dev", BRIDGE)
    run("ip", "link", "set", BRIDGE, "up")


def remove_bridge() -> None:
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        run("ip", "link", "delete", BRIDGE, check=False)


def cni_config(ipam_dir: Path) -> dict[str, Any]:
    return {
        "cniVersion": "0.4.0",
        "name": "ppojob-test",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "isDefaultGateway": False,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR, "gateway": GATEWAY}]],
                    # the only route: Services (kube-proxy turns them into the gateway or a pod)
                    "routes": [{"dst": SERVICE_CIDR}],
                    "dataDir": str(ipam_dir),
                },
            }
        ],
    }


# --------------------------------------------------------------------------- the node


class RealNode:
    """kubelet + containerd + CoreDNS + kube-proxy for a started real-node :class:`ControlPlane`."""

    def __init__(self, cp: ControlPlane, workdir: Path) -> None:
        if not cp.real_nodes or cp.api_address != GATEWAY:
            raise ControlPlaneError(
                "start the ControlPlane with real_nodes=True, api_address=GATEWAY"
            )
        self.cp = cp
        # short: containerd's shim sockets live under its state directory (108-byte limit)
        self.dir = workdir
        self.state = Path(f"/run/ppojob-{os.getpid()}")
        self.components: dict[str, Component] = {}
        self.netns_before: set[str] = set()
        self.kubelet_root = self.dir / "kubelet"
        self.sock = self.state / "containerd.sock"
        self.imported: list[str] = []

    # ---- one node, several processes
    def handoff(self) -> dict[str, Any]:
        """What another process needs to use this started node (:meth:`attach`)."""
        return {"dir": str(self.dir), "state": str(self.state), "netns": sorted(self.netns_before)}

    @classmethod
    def attach(cls, cp: ControlPlane, state: dict[str, Any]) -> RealNode:
        """A handle on a node another process started (and stops): its checks
        (:meth:`network_report`, :meth:`listeners`), never :meth:`stop`."""
        node = cls(cp, Path(state["dir"]))
        node.state = Path(state["state"])
        node.sock = node.state / "containerd.sock"
        node.netns_before = set(state["netns"])
        return node

    # ---- processes
    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Component:
        comp = Component(name, argv, self.cp.logdir / f"{name}.log", env)
        comp.start()
        self.components[name] = comp
        self.cp.components[name] = comp  # its log goes into failure reports
        return comp

    def ctr(self, *args: str, timeout: float = 600) -> str:
        return run(
            "ctr", "--address", str(self.sock), "--namespace", "k8s.io", *args, timeout=timeout
        )

    def start(self, images: dict[str, str]) -> RealNode:
        """Start containerd (importing ``images`` it lacks), CoreDNS, the kubelet and kube-proxy;
        return when the node is Ready and DNS answers."""
        self.netns_before = (
            set(os.listdir("/var/run/netns")) if Path("/var/run/netns").is_dir() else set()
        )
        try:
            self._start_containerd(images)
            self._start_coredns()
            self._start_kubelet(images["pause"])
            self._start_kube_proxy()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_containerd(self, images: dict[str, str]) -> None:
        self.state.mkdir(parents=True, exist_ok=True)
        cfg = self.dir / "containerd.toml"
        net = self.dir / "cni"
        (net / "net.d").mkdir(parents=True, exist_ok=True)
        (net / "net.d" / "10-ppojob.conflist").write_text(json.dumps(cni_config(net / "ipam")))
        root = CACHE / "containerd"
        root.mkdir(parents=True, exist_ok=True)
        # an import a killed run left half done (the trainer's layer alone is about 6 GB):
        # containerd is not running yet, so nothing is writing there
        shutil.rmtree(root / "io.containerd.content.v1.content" / "ingest", ignore_errors=True)
        cfg.write_text(
            f"""version = 2
root = "{root}"
state = "{self.state / "state"}"
[grpc]
  address = "{self.sock}"
[ttrpc]
  address = "{self.sock}.ttrpc"
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{images["pause"]}"
  restrict_oom_score_adj = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_cdi = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    discard_unpacked_layers = true
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{shutil.which("runc")}"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{net / "net.d"}"
"""
        )
        comp = self._spawn("containerd", ["containerd", "--config", str(cfg)])
        wait_until(
            lambda: comp.check_alive() and self.sock.exists() and self.ctr("version"),
            60,
            "containerd",
        )
        # earlier builds of these images go once the new ones are in, and their layers with them
        # (``--sync`` runs containerd's garbage collection now): the store keeps only what this
        # run uses. Imported first, a rebuild after a source change shares the big dependency
        # layer (and its unpacked snapshot) with the build it replaces; removed first when the
        # disk is too short for both.
        # CRI keeps a second name for each image it has seen, ``sha256:<image id>``: a stale
        # build goes with both, or its layers are never collected (6 GB for the trainer's)
        wanted = set(images.values())
        ids = {
            "sha256:"
            + run(
                "buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", r
            ).strip()
            for r in wanted
        }
        present = self.ctr("images", "list", "--quiet").split()
        stale = [
            r
            for r in present
            if (r.startswith("localhost/ppojob-") and r not in wanted)
            or (r.startswith("sha256:") and r not in ids)
        ]
        for ref in images.values():
            if ref in present and not self._unpacked(ref):
                # imported by an earlier version of this file (``--no-unpack``) and never run:
                # its blobs may not be dropped before it is unpacked, so it comes in again
                self.ctr("images", "remove", "--sync", ref)
                present.remove(ref)
            if ref not in present:
                if stale and self._shortfall(ref) is not None:
                    self.ctr("images", "remove", "--sync", *stale)
                    stale = []
                self._import(ref)
            self.imported.append(ref)
        if stale:
            self.ctr("images", "remove", "--sync", *stale)
        # every image's blobs once the stale ones are gone (an image imported by an earlier
        # version of this file kept its own, and with them any layer it shares with ours)
        self._release_layer_blobs()
        present = set(self._labels())
        for ref in images.values():
            kept = [x["digest"] for x in self._manifest(ref)[1]["layers"] if x["digest"] in present]
            if kept:
                raise ControlPlaneError(
                    f"{ref}: the node's containerd kept {len(kept)} layer blob(s)"
                )

    def _shortfall(self, ref: str) -> tuple[float, float] | None:
        """(needed, free) bytes to import ``ref`` when the disk is too short, else None."""
        number, unit = run("buildah", "images", "--format", "{{.Size}}", ref).split()[:2]
        size = float(number) * 1000 ** ["B", "KB", "MB", "GB", "TB"].index(unit)
        need = 2 * size + 2**30  # its layers, then their unpacked copy
        free = shutil.disk_usage(CACHE / "containerd").free
        return (need, free) if free < need else None

    def _import(self, ref: str) -> None:
        """buildah's image ``ref`` into containerd through a pipe (no archive on disk), unpacked
        there, then without its layer blobs (:meth:`_release_layer_blobs`)."""
        short = self._shortfall(ref)
        if short is not None:
            root = CACHE / "containerd"
            raise ControlPlaneError(
                f"importing {ref} needs about {short[0] / 2**30:.1f} GiB free under {root} (its "
                f"layers and their unpacked copy), {short[1] / 2**30:.1f} GiB is: free disk space "
                f"(rm -rf {root} empties this cache when no test runs)"
            )
        push = subprocess.Popen(
            ["buildah", "push", "--quiet", ref, f"docker-archive:/dev/stdout:{ref}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        ctr = ["ctr", "--address", str(self.sock), "--namespace", "k8s.io"]
        # unpacked into CRI's snapshotter (the config's ``snapshotter``): the pods' containers
        # start from those snapshots, and CRI never needs the layer blobs again
        imp = subprocess.run(
            [*ctr, "images", "import", "--snapshotter", SNAPSHOTTER, "-"],
            stdin=push.stdout,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        assert push.stdout is not None
        push.stdout.close()
        _, err = push.communicate(timeout=60)
        if push.returncode != 0 or imp.returncode != 0:
            raise ControlPlaneError(f"importing {ref}: {err.decode()[-1500:]} {imp.stderr[-1500:]}")
        if ref not in self.ctr("images", "list", "--quiet").split():
            raise ControlPlaneError(f"importing {ref} gave no image of that name")
        self._release_layer_blobs()  # now: the next import needs the room

    def _manifest(self, ref: str) -> tuple[str, dict[str, Any]]:
        """The digest and the manifest of the node's image ``ref``."""
        digest = next(
            (
                line.split()[2]
                for line in self.ctr("images", "list", f"name=={ref}").splitlines()[1:]
                if line.split()[:1] == [ref]
            ),
            None,
        )
        if digest is None:
            raise ControlPlaneError(f"no image {ref} in the node's containerd")
        manifest = json.loads(self.ctr("content", "get", digest))
        if not isinstance(manifest.get("layers"), list):  # buildah's docker-archive: no index
            raise ControlPlaneError(f"{ref}: {digest} is not an image manifest")
        return digest, manifest

    def _labels(self) -> dict[str, str]:
        """Each blob of the content store: its labels (``ctr content list``'s last column)."""
        rows = self.ctr("content", "list").splitlines()[1:]
        return {row.split()[0]: row.split()[-1] for row in rows if row.split()}

    def _unpacked(self, ref: str) -> bool:
        """Whether ``ref`` is unpacked into :data:`SNAPSHOTTER` (its config then holds the top
        snapshot: ``containerd.io/gc.ref.snapshot.<snapshotter>``)."""
        _, manifest = self._manifest(ref)
        labels = self._labels().get(manifest["config"]["digest"], "")
        return f"containerd.io/gc.ref.snapshot.{SNAPSHOTTER}=" in labels

    def _release_layer_blobs(self) -> None:
        """Let containerd collect the layer blobs of every unpacked image of the node: an image
        keeps its manifest, its config and the snapshots (the config's
        ``containerd.io/gc.ref.snapshot.<snapshotter>`` label holds them), which is all CRI
        reads to start a container. The blobs are as big as the unpacked image (7 GB for the
        trainer's; docker-archive layers are uncompressed), so this halves the node's image
        cache. What CRI's ``discard_unpacked_layers`` does for images it pulls: each manifest's
        ``containerd.io/gc.ref.content.l.<i>`` labels go, then a synchronous garbage collection
        (deleting a lease with ``--sync`` runs one) removes the blobs nothing references. Every
        image, not one: the images share the base's layers, and one manifest still labelled
        keeps a shared blob. An image not unpacked (none, unless imported by other means) keeps
        its blobs."""
        for ref in self.ctr("images", "list", "--quiet").split():
            digest, manifest = self._manifest(ref)
            if self._unpacked(ref):
                labels = (
                    f"containerd.io/gc.ref.content.l.{i}=" for i in range(len(manifest["layers"]))
                )
                self.ctr("content", "label", digest, *labels)
        lease = self.ctr("leases", "create").strip()
        self.ctr("leases", "delete", "--sync", lease)

    def _start_coredns(self) -> None:
        health, ready = free_port(), free_port()
        corefile = self.dir / "Corefile"
        corefile.write_text(
            f"""cluster.local:53 {{
    bind {GATEWAY}
    errors
    health 127.0.0.1:{health}
    ready 127.0.0.1:{ready}
    kubernetes cluster.local {{
        kubeconfig {self.cp.admin_kubeconfig}
    }}
    cache 5
}}
"""
        )
        comp = self._spawn("coredns", [str(self.cp.bin / "coredns"), "-conf", str(corefile)])
        from tests.helpers.controlplane import _http_get

        wait_until(
            lambda: comp.check_alive() and _http_get(f"http://127.0.0.1:{ready}/ready")[0] == 200,
            60,
            "CoreDNS /ready",
        )

    def _start_kubelet(self, pause: str) -> None:
        p = self.cp.pki
        self.kubelet_root.mkdir(parents=True, exist_ok=True)
        resolv = self.dir / "resolv.conf"
        resolv.write_text("")  # pods learn no resolver of the machine's
        port, healthz = free_port(), free_port()
        cfg = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # the kubelet refuses a loopback node IP: the node's address is the bridge's gateway,
            # where the API server reaches it (InternalIP) for logs and exec
            "address": GATEWAY,
            "port": port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": healthz,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(p["ca.crt"])},
            },
            "authorization": {"mode": "Webhook"},
            "tlsCertFile": str(p["webhook.crt"]),
            "tlsPrivateKeyFile": str(p["webhook.key"]),
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": False,
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.sock}",
            "clusterDomain": "cluster.local",
            "clusterDNS": [GATEWAY],
            "resolvConf": str(resolv),
            "staticPodPath": "",
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%"},
            "cgroupsPerQOS": False,
            "enforceNodeAllocatable": [],
            "localStorageCapacityIsolation": False,
            "serializeImagePulls": False,
            "registerNode": True,
            "podPidsLimit": -1,
            # CPU limits are not enforced here: the jobs' pods ask for fractions of the node's 2
            # cores so that two jobs fit beside the operator (tests/realnode/session.py), and
            # under a CFS quota that small the head's Ray processes and the driver took twice as
            # long to start (an attempt's pods to its first step: 64 s with the quota, 36 s
            # without; the suspend test 246 s against 169 s, 2026-12-07, with the head at 0.3
            # CPU). Scheduling still counts requests.
            "cpuCFSQuota": False,
        }
        cfg_path = self.dir / "kubelet.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        self._spawn(
            "kubelet",
            [
                str(self.cp.bin / "kubelet"),
                f"--config={cfg_path}",
                f"--kubeconfig={self.cp.admin_kubeconfig}",
                f"--root-dir={self.kubelet_root}",
                f"--hostname-override={NODE_NAME}",
                f"--node-ip={GATEWAY}",
                f"--pod-infra-container-image={pause}",
                "--v=1",
            ],
        )

        def ready() -> bool:
            self.components["kubelet"].check_alive()
            node = self.cp.get("node", NODE_NAME)
            conds = {
                c["type"]: c["status"] for c in (node or {}).get("status", {}).get("conditions", [])
            }
            return conds.get("Ready") == "True"

        wait_until(ready, 120, f"node {NODE_NAME} Ready (kubelet)", interval=0.5)

    def _start_kube_proxy(self) -> None:
        cfg = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.cp.admin_kubeconfig)},
            "mode": "iptables",
            "hostnameOverride": NODE_NAME,
            "clusterCIDR": POD_CIDR,
            "healthzBindAddress": f"127.0.0.1:{free_port()}",
            "metricsBindAddress": f"127.0.0.1:{free_port()}",
            "nodePortAddresses": [f"{GATEWAY}/32"],
            # leave the machine's conntrack sysctls alone
            "conntrack": {
                "maxPerCore": 0,
                "min": 0,
                "tcpEstablishedTimeout": "0s",
                "tcpCloseWaitTimeout": "0s",
            },
        }
        path = self.dir / "kube-proxy.yaml"
        path.write_text(yaml.safe_dump(cfg))
        comp = self._spawn(
            "kube-proxy", [str(self.cp.bin / "kube-proxy"), f"--config={path}", "--v=1"]
        )
        # ready once the `kubernetes` Service's rule exists
        wait_until(
            lambda: (
                comp.check_alive()
                and "default/kubernetes:https" in run("iptables-save", "-t", "nat")
            ),
            60,
            "kube-proxy's rule for the kubernetes Service",
        )

    # ---- checks
    def pod_netns(self, namespace: str, pod: str) -> str:
        """The network namespace path of a running pod's sandbox (from containerd)."""
        for line in self.ctr("containers", "list", "--quiet").split():
            info = json.loads(self.ctr("containers", "info", line))
            labels = info.get("Labels", {})
            if (
                labels.get("io.kubernetes.pod.name") == pod
                and labels.get("io.kubernetes.pod.namespace") == namespace
                and labels.get("io.cri-containerd.kind") == "sandbox"
            ):
                for ns in info["Spec"]["linux"]["namespaces"]:
                    if ns["type"] == "network":
                        return ns["path"]
        raise ControlPlaneError(f"no sandbox for pod {namespace}/{pod}")

    def network_report(self, namespace: str, pod: str) -> dict[str, Any]:
        """Routes inside a pod's network namespace, the host's NAT rules that masquerade, and the
        Corefile's plugins: what the network rule says must hold."""
        netns = self.pod_netns(namespace, pod)
        routes = run("nsenter", f"--net={netns}", "ip", "-4", "route", "show").splitlines()
        masq = [
            line
            for line in run("iptables-save", "-t", "nat").splitlines()
            if "MASQUERADE" in line and "KUBE-" not in line.split()[1]
        ]
        return {
            "routes": routes,
            "masquerade": masq,
            "corefile": (self.dir / "Corefile").read_text(),
        }

    def listeners(self) -> list[tuple[str, str]]:
        """(address:port, process) of every TCP/UDP socket listening on the host that a process
        of this run (control plane, node, containerd's shims) holds: ``ss -lntupH``."""
        pids = {c.proc.pid for c in self.cp.components.values() if c.proc is not None}
        pids |= self.cp.foreign_pids
        pids |= {
            pid
            for pid, argv in _processes()
            if "containerd-shim" in argv and str(self.sock) in argv
        }
        out = []
        for line in run("ss", "-lntupH").splitlines():
            fields = line.split()
            procs = dict(
                (int(m.split("pid=")[1].split(",")[0]), m.split('"')[1])
                for m in line.split("((", 1)[-1].split("),(")
                if "pid=" in m
            )
            for pid, name in procs.items():
                if pid in pids:
                    out.append((fields[4], name))
        return out

    def leftovers(self) -> list[str]:
        """What this run's node left on the machine (empty after :meth:`stop`)."""
        found = []
        dirs = (str(self.dir), str(self.state), str(CACHE))
        with open("/proc/self/mountinfo") as f:
            for line in f:
                mnt = line.split()[4]
                if mnt.startswith(dirs):
                    found.append(f"mount {mnt}")
        # the control plane's processes too (Kueue's manager, started by a test, among them)
        dirs = (*dirs, str(self.cp.workdir))
        if Path("/var/run/netns").is_dir():
            found += [f"netns {n}" for n in set(os.listdir("/var/run/netns")) - self.netns_before]
        if Path(f"/sys/class/net/{BRIDGE}").exists():
            found.append(f"bridge {BRIDGE}")
        for pid, argv in _processes():
            if str(self.sock) in argv or any(d in argv for d in dirs):
                found.append(f"process {pid}: {argv[:120]}")
        for save in ("iptables-save", "ip6tables-save"):
            chains = [
                line.split()[0][1:]
                for line in run(save, check=False).splitlines()
                if line.startswith(":KUBE-")
            ]
            found += [f"{save.removesuffix('-save')} chain {c}" for c in chains]
        return found

    # ---- teardown
    def stop(self) -> None:
        kubelet = self.components.get("kubelet")
        if kubelet is not None and kubelet.alive():
            t = time.monotonic()
            self._drain()
            print(f"\nreal node: drained in {time.monotonic() - t:.1f}s", file=sys.stderr)
        for name in ("kube-proxy", "kubelet", "coredns"):
            if name in self.components:
                self.components[name].stop()
        if "kube-proxy" in self.components:
            run(str(self.cp.bin / "kube-proxy"), "--cleanup", check=False)
        if "kubelet" in self.components:
            remove_kube_chains()  # the kubelet's own (KUBE-FIREWALL, KUBE-KUBELET-CANARY, ...)
        self._kill_shims()
        if "containerd" in self.components:
            self.components["containerd"].stop()
        self._unmount()
        if Path("/var/run/netns").is_dir():
            for n in set(os.listdir("/var/run/netns")) - self.netns_before:
                run("ip", "netns", "delete", n, check=False)
        remove_bridge()
        shutil.rmtree(self.state, ignore_errors=True)

    def _drain(self) -> None:
        """Delete every pod on the node and wait until the kubelet has stopped their sandboxes
        (no task of the node's containerd runs, and every network namespace a sandbox made is
        gone: its CNI DEL ran). What would make new pods goes first: the controllers' objects
        (PPOJobs, RayJobs, RayClusters, Deployments, ReplicaSets, Jobs). The stopped
        containers' removal is the kubelet's garbage collection, a minute or more later: not
        waited for (the sweep in :meth:`stop` removes them with the node's state)."""
        for kinds in (
            "ppojobs.ppojob.io,rayjobs.ray.io,rayclusters.ray.io",
            "deployments.apps,replicasets.apps,jobs.batch",
            "pods",
        ):
            self.cp.kubectl(
                "delete",
                kinds,
                "--all",
                "--all-namespaces",
                "--grace-period=0",
                "--force",
                "--wait=false",
                check=False,
            )

        def sandboxes_stopped() -> bool:
            tasks = self.ctr("tasks", "list").splitlines()[1:]  # TASK PID STATUS
            if any(line.split()[2:3] != ["STOPPED"] for line in tasks if line.strip()):
                return False
            netns = Path("/var/run/netns")
            return not netns.is_dir() or not set(os.listdir(netns)) - self.netns_before

        with contextlib.suppress(TimeoutError):  # the sweep in stop() removes what is left
            wait_until(sandboxes_stopped, 90, "the node's sandboxes stopped", interval=0.5)

    def _kill_shims(self) -> None:
        for pid, argv in _processes():
            if "containerd-shim" in argv and str(self.sock) in argv:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
            "containerd-shim" in a and str(self.sock) in a for _, a in _processes()
        ):
            time.sleep(0.1)

    def _unmount(self) -> None:
        dirs = (str(self.dir), str(self.state), str(CACHE))
        for _ in range(3):
            mounts = []
            with open("/proc/self/mountinfo") as f:
                for line in f:
                    mnt = line.split()[4]
                    if mnt.startswith(dirs):
                        mounts.append(mnt)
            if not mounts:
                return
            for mnt in sorted(mounts, key=len, reverse=True):
                run("umount", "-l", mnt, check=False)


def remove_kube_chains() -> None:
    """Delete every iptables/ip6tables chain named KUBE-* and the rules that jump to them (this
    machine runs no other Kubernetes node: they are ours)."""
    for tool in ("iptables", "ip6tables"):
        if not shutil.which(tool):
            continue
        table, chains, jumps = "", [], []
        for line in run(f"{tool}-save", check=False).splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":KUBE-"):
                chains.append((table, line.split()[0][1:]))
            elif (
                line.startswith("-A ")
                and " -j KUBE-" in line
                and not line.split()[1].startswith("KUBE-")
            ):
                jumps.append((table, line[3:]))
        for table, rule in jumps:
            run(tool, "-t", table, "-D", *_split_rule(rule), check=False)
        for table, chain in chains:
            run(tool, "-t", table, "-F", chain, check=False)
        for table, chain in chains:
            run(tool, "-t", table, "-X", chain, check=False)


def _split_rule(rule: str) -> list[str]:
    import shlex

    return shlex.split(rule)


def _processes() -> list[tuple[int, str]]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out.append((int(d.name), argv))
    return out
