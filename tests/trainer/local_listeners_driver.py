"""Run by tests/trainer/test_local_listeners.py: ``python local_listeners_driver.py RANK WORLD
PORT PORT2 OUT.json``. Joins the process groups a local run with the megatron backend makes, as
its workers do (the role set's world, megatron-core's groups with their gloo groups, a
weight-update group), then writes every TCP socket this process listens on."""

from __future__ import annotations

import faulthandler
import ipaddress
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")


def listening() -> list[str]:
    """Addresses ``host:port`` of this process's listening TCP sockets (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                hexaddr, hexport = fields[1].split(":")
                raw = bytes.fromhex(hexaddr)
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                addr = ipaddress.ip_address(raw)
                addr = getattr(addr, "ipv4_mapped", None) or addr
                out.append(f"{addr}:{int(hexport, 16)}")
    return out


def main() -> None:
    rank, world, port, port2, out = (*map(int, sys.argv[1:5]), sys.argv[5])
    # a hang shows where it is: every thread's stack, before the test's deadline (300 s)
    faulthandler.dump_traceback_later(270)
    import torch
    import torch.distributed as dist

    from ppojob_trainer.backends.megatron_parallel import init_parallel
    from ppojob_trainer.backends.weight_sync import init_custom_group
    from ppojob_trainer.distributed import ShardIdentity, init_role_groups

    init_role_groups(["actor"], rank, world, "127.0.0.1", port, "gloo", timeout_s=200)
    init_parallel(ShardIdentity("actor", tp_rank=rank, tp_size=world), "cpu", 0)
    if world > 1:
        group = init_custom_group("gloo", "127.0.0.1", port2, world, rank, "weights", 200)
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        assert t.item() == world
    with open(out, "w") as f:
        json.dump(listening(), f)
    dist.barrier()
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
