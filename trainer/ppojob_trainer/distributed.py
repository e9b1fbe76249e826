"""Shard identity and per-role ``torch.distributed`` groups.

Every worker process hosts one or more roles that share its workers (the actor with a colocated
critic and rollout). The process joins one ``torch.distributed`` world made of the processes of
its role set (gloo on CPU, nccl on GPU) and creates one process group per role in it, so the
actor's gradient all-reduce and the critic's never share a communicator. A role with a single
worker gets no group (``None``) and skips collectives.

:class:`ShardIdentity` says where a worker sits in its role's parallel layout (data, tensor,
pipeline and context parallel ranks). This module is a leaf: the backends, the workers and the
driver all import it, and it imports none of them.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

NCCL_ENV: dict[str, str] = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
"""NCCL settings every trainer process starts with. SGLang's ``Engine.__init__`` sets these in
the process that hosts it (0.5.23, ``_set_envs_and_config``: when unset, both to 0 unless
symmetric memory or NVLS is asked for), so without them an actor rank hosting a colocated engine
and one hosting none would build their communicators with different settings. Set in every
worker's environment before it starts (:func:`nccl_env`), SGLang keeps them (it overrides only
unset ones); ``test_sglang_contract`` runs SGLang's function and checks every NCCL variable it
sets is here with its value."""


def nccl_env() -> dict[str, str]:
    """:data:`NCCL_ENV`, a value the driver's own environment sets winning (one value for every
    worker either way)."""
    import os

    return {k: os.environ.get(k, v) for k, v in NCCL_ENV.items()}


@dataclass(frozen=True)
class ShardIdentity:
    """Where a worker sits in its role's parallel layout."""

    role: str
    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    ep_rank: int = 0  # expert parallel (MoE layers' experts): over the context x data ranks
    ep_size: int = 1

    @property
    def is_dp_leader(self) -> bool:
        return self.dp_rank == 0 and self.tp_rank == 0 and self.pp_rank == 0 and self.cp_rank == 0


EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
PORT_FLOOR = 20000
"""The lowest port :func:`free_port` hands out below the kernel's ephemeral range (above Ray's
default range of worker ports, 10002-19999, which Ray's workers bind as they start)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, for a listener that binds it later (a process
    group's rendezvous, an engine's server: seconds later, after imports).

    Taken below the kernel's ephemeral range where there is room (Linux: 32768 and up by
    default): every outgoing connection takes its local port from that range, so a port from
    it that is free now can be a client's by the time its listener binds it (on a busy host,
    the bind then fails or the group waits on the wrong peer). A random port below the range,
    found free by binding it, is taken only by another explicit bind. Elsewhere (no such
    range known, or none free below it after a few tries): the kernel's pick."""
    import random

    try:
        low = int(Path(EPHEMERAL_RANGE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    pick = random.SystemRandom()  # (not the seeded generator a checkpoint saves and restores)
    for _ in range(16 if low > PORT_FLOOR else 0):
        port = pick.randrange(PORT_FLOOR, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports from :func:`free_port` (two picks can be the same port)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    return ports


def is_loopback(address: str) -> bool:
    """Whether ``address`` is this machine's loopback (a local run: every rank on this host)."""
    import ipaddress

    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def loopback_gloo() -> None:
    """gloo's pairs of this process bind to the loopback interface (unless told otherwise):
    for process groups whose ranks all run on this host."""
    import os

    names = [n for _, n in socket.if_nameindex()]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo" if "lo" in names else "lo0")


def local_store(address: str, port: int, world: int, name: str = "world") -> Any:
    """The rendezvous store of a group whose ranks all run on this host, or None elsewhere.

    torch's ``TCPStore`` server listens on every interface (``::``) whatever host it is given
    (measured, libuv and legacy backends alike), so a local run keeps it out: its ranks meet in
    a ``FileStore`` named after the rendezvous port (free on this host when it was chosen), and
    gloo's pairs bind to the loopback interface (``GLOO_SOCKET_IFNAME``). No TCP listener of a
    local run's process groups is then off loopback. (The weight-update group, which SGLang's
    engines join by dialling TCP, meets in :func:`loopback_tcp_store` instead.)"""
    if not is_loopback(address):
        return None

    import torch.distributed as dist

    loopback_gloo()
    return dist.FileStore(store_path(port, name), world)


def store_path(port: int, name: str = "world") -> str:
    """Where :func:`local_store` keeps the store of the group meeting at ``port``."""
    import os
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"ppojob-{name}-store-{port}")


def rendezvous_port(host: str) -> int:
    """A port free on ``host`` for a group's rendezvous, with no store left at its path: a
    killed run leaves its ``FileStore`` behind (its ranks never closed it), and a new group
    meeting at the same port number would read the old ranks' addresses from it (gloo then
    dials ports nothing listens on: "Connection refused"). Called on rank 0's host before any
    rank opens the store."""
    import contextlib
    import os

    port = free_port(host)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(store_path(port))
    return port


def loopback_tcp_store(
    address: str, port: int, world: int, is_master: bool, timeout: timedelta
) -> Any:
    """A ``TCPStore`` at ``address:port`` for a group that other programs join by TCP (SGLang
    dials ``tcp://host:port``), on this host: the server's socket is bound here to
    ``127.0.0.1`` and handed to torch (``master_listen_fd``), since torch's own listener binds
    every interface whatever host it is given. A client (``is_master`` false) dials
    ``address``."""
    import torch.distributed as dist

    loopback_gloo()
    if not is_master:
        return dist.TCPStore(address, port, world, False, timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    # the store owns the socket from here (it closes it when it is destroyed: measured)
    return dist.TCPStore(
        "127.0.0.1",
        port,
        world,
        True,
        timeout,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )


def init_role_groups(
    roles: list[str],
    rank: int,
    world: int,
    master_addr: str,
    master_port: int,
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Join the world of this process's role set and create one group per role.

    Returns ``{role: group}``; groups are None when ``world == 1``.
    """
    if world <= 1:
        return {role: None for role in roles}
    import torch.distributed as dist

    if not dist.is_initialized():
        store = local_store(master_addr, master_port, world)
        rendezvous: dict[str, Any] = (
            {"store": store} if store else {"init_method": f"tcp://{master_addr}:{master_port}"}
        )
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
            **rendezvous,
        )
    return {role: dist.new_group(ranks=list(range(world)), backend=backend) for role in roles}


def identity(
    role: str,
    rank: int,
    world: int,
    tensor: int = 1,
    pipeline: int = 1,
    context: int = 1,
    expert: int = 1,
) -> ShardIdentity:
    """Shard identity of worker ``rank`` of ``world`` under tensor x pipeline x context model
    parallelism (data parallel over the rest), in megatron-core's rank order ``tp-cp-dp-pp``:
    ``rank = tp + T * (cp + C * (dp + D * pp))``. With no model parallelism: data parallel only.
    Expert parallelism (``expert``) splits the MoE layers' experts over the context x data
    parallel ranks of a stage, as megatron-core's expert order ``tp-ep-dp-pp`` (expert tensor
    parallelism = ``tensor``): ``ep = (cp + C * dp) % expert``."""
    mp = tensor * pipeline * context
    if world % mp:
        raise ValueError(f"{role}: {world} workers do not split into model-parallel groups of {mp}")
    dp = world // mp
    tp_rank, rest = rank % tensor, rank // tensor
    cp_rank, rest = rest % context, rest // context
    dp_rank, pp_rank = rest % dp, rest // dp
    if (context * dp) % expert:
        raise ValueError(
            f"{role}: expert parallelism {expert} does not divide the {context * dp} data "
            f"(x context) parallel ranks of {world} workers"
        )
    return ShardIdentity(
        role=role,
        dp_rank=dp_rank,
        dp_size=dp,
        tp_rank=tp_rank,
        tp_size=tensor,
        pp_rank=pp_rank,
        pp_size=pipeline,
        cp_rank=cp_rank,
        cp_size=context,
        ep_rank=(cp_rank + context * dp_rank) % expert,
        ep_size=expert,
    )


def model_parallel_identity(cfg: Any, role: str, rank: int, world: int) -> ShardIdentity:
    """Shard identity of a worker of ``role`` ("actor" or "critic"): its tensor, pipeline and
    context parallelism on the megatron backend, data parallel only on the torch backend."""
    spec = cfg.roles.actor if role == "actor" else cfg.roles.effective_critic(True)
    if spec.backend != "megatron":
        return identity(role, rank, world)
    p = spec.parallelism
    return identity(role, rank, world, p.tensor, p.pipeline, p.context, p.expert)


def data_parallel_group(group: Any, shard: ShardIdentity) -> Any:
    """The group of the workers that hold the same model shard as ``shard`` (its data-parallel
    replicas), for statistics over the role's samples: the role's group itself without model
    parallelism, else a subgroup of it (None when ``shard`` has no replica). Every worker of the
    role calls this in the same order (``new_group`` is collective)."""
    model_parallel = shard.tp_size * shard.pp_size * shard.cp_size
    if group is None or model_parallel == 1:
        return group
    if shard.dp_size == 1:
        return None
    import torch.distributed as dist

    mine = None
    world = model_parallel * shard.dp_size
    for first in range(world):
        coords = identity(shard.role, first, world, shard.tp_size, shard.pp_size, shard.cp_size)
        if coords.dp_rank != 0:
            continue
        ranks = [
            dist.get_global_rank(group, r)
            for r in range(world)
            if _same_shard(
                identity(shard.role, r, world, shard.tp_size, shard.pp_size, shard.cp_size), coords
            )
        ]
        sub = dist.new_group(ranks=ranks)
        if _same_shard(coords, shard):
            mine = sub
    return mine


def _same_shard(a: ShardIdentity, b: ShardIdentity) -> bool:
    return (a.tp_rank, a.pp_rank, a.cp_rank) == (b.tp_rank, b.pp_rank, b.cp_rank)
