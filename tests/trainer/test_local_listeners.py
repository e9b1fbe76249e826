"""Item 14 of issue 21: a local run with the megatron backend listens on loopback only.

torch's ``TCPStore`` server binds every interface whatever host it is given, and gloo's pairs
bind the address the host name resolves to; ``local_listeners_driver.py`` joins, in two
processes and in one, the groups a local megatron run makes (the role set's world, megatron-core's
groups and gloo groups, a weight-update group) and lists the TCP sockets it listens on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ppojob_api
import ppojob_trainer
from ppojob_trainer.distributed import free_port, rendezvous_port

DRIVER = Path(__file__).with_name("local_listeners_driver.py")


def finish(procs: list[subprocess.Popen], timeout_s: float) -> list[str]:
    """The output of every process, each given what is left of one deadline; past it, all are
    killed and the test fails with every rank's output (the driver dumps its threads' stacks
    before the deadline: where a hang is shows)."""
    deadline = time.monotonic() + timeout_s
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1.0))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            outs = [q.communicate()[0] for q in procs]
            pytest.fail("a rank hung:\n" + "\n".join(o[-6000:] for o in outs))
    return logs


@pytest.mark.parametrize("world", [1, 2])
def test_local_megatron_process_groups_listen_on_loopback_only(world: int, tmp_path: Path):
    pytest.importorskip("megatron.core")
    ours = [str(Path(m.__file__).parents[1]) for m in (ppojob_api, ppojob_trainer)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(ours), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("GLOO_SOCKET_IFNAME", None)  # the code under test must choose the interface
    # the world's port as a run hands it out (no store of an earlier group left at its path)
    ports = [str(rendezvous_port("127.0.0.1")), str(free_port())]
    procs = [
        subprocess.Popen(
            [sys.executable, str(DRIVER), str(r), str(world), *ports, str(tmp_path / f"{r}.json")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = finish(procs, 300)
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-4000:] for log in logs)
    for r in range(world):
        addresses = json.loads((tmp_path / f"{r}.json").read_text())
        assert addresses, "gloo listens somewhere: nothing found means the check is broken"
        off = [a for a in addresses if not a.startswith("127.0.0.1:")]
        assert not off, f"rank {r} listens off loopback: {off}"


def test_a_rendezvous_port_comes_with_no_store_left_from_a_killed_run(monkeypatch) -> None:
    """A killed run leaves its FileStore in the temporary directory; a new group meeting at the
    same port number would read the dead ranks' addresses from it (gloo: "Connection refused").
    The port rank 0 hands out comes with that path emptied, and a store opened there after is
    a fresh one."""
    import torch.distributed as dist

    from ppojob_trainer import distributed

    port = free_port("127.0.0.1")
    monkeypatch.setattr(distributed, "free_port", lambda host: port)
    stale = dist.FileStore(distributed.store_path(port), 2)  # a dead run's rank 0 wrote here
    stale.set("rank0-address", "127.0.0.1:18312")
    assert os.path.exists(distributed.store_path(port))
    assert distributed.rendezvous_port("127.0.0.1") == port
    assert not os.path.exists(distributed.store_path(port))
    fresh = dist.FileStore(distributed.store_path(port), 1)
    assert fresh.check(["rank0-address"]) is False
    del stale, fresh
    # the driver's rendezvous of each role's world (its rank 0's node) hands out the same: with
    # free_port there, a role's two workers hung in init_process_group on a stale store (seen)
    from ppojob_trainer.driver import cluster

    monkeypatch.setattr(cluster.ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    stale = dist.FileStore(distributed.store_path(port), 2)
    stale.set("rank0-address", "127.0.0.1:18312")
    assert cluster.rendezvous_address() == ("127.0.0.1", port)
    assert not os.path.exists(distributed.store_path(port))
    del stale


def test_a_free_port_comes_from_below_the_range_outgoing_connections_use(
    monkeypatch, tmp_path: Path
) -> None:
    """A rendezvous port is bound seconds after it is chosen (after a rank's imports). Outgoing
    connections take their local ports from the kernel's ephemeral range, so free_port hands out
    ports below it, each found free by binding it; a port in use there is passed over; with no
    range to read, the kernel's pick."""
    import random
    import socket

    from ppojob_trainer import distributed

    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    monkeypatch.setattr(distributed, "EPHEMERAL_RANGE", str(ranges))
    ports = [free_port() for _ in range(40)]
    assert all(distributed.PORT_FLOOR <= p < 32768 for p in ports), ports
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        script = iter([taken, 23456])
        monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: next(script))
        assert free_port() == 23456  # the listener's port passed over
    monkeypatch.undo()
    monkeypatch.setattr(distributed, "EPHEMERAL_RANGE", str(tmp_path / "absent"))
    kernels = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert free_port() >= kernels  # the kernel's pick, from its range


def test_free_ports_are_distinct(monkeypatch) -> None:
    """An engine's two ports (its server's, its NCCL group's) are two picks: never one twice."""
    from ppojob_trainer import distributed

    picks = iter([24001, 24001, 24002])
    monkeypatch.setattr(distributed, "free_port", lambda host: next(picks))
    assert distributed.free_ports(2) == [24001, 24002]
