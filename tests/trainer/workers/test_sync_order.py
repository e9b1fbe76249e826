"""Item 5 of issue 21: a colocated engine spanning several actor workers' GPUs (SGLang with
tensor > 1) with an FSDP actor. The actor's export is then a collective over every actor worker,
while the engine's host asks its peers for their buckets only after its own export: every
worker must be told to export before any sync starts (Ray runs each worker's calls in order).
The driver's calls are recorded by stand-in worker handles, in the order they are submitted."""

from __future__ import annotations

from types import SimpleNamespace

from ppojob_api.training import TrainerConfig
from ppojob_trainer.driver.groups import Group, Groups
from ppojob_trainer.driver.topology import resolve_topology
from ppojob_trainer.driver.weights import ColocatedSync, weight_sync


class Handle:
    """A Ray actor handle stand-in: ``h.method.remote(*args)`` appends to a shared log."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def __getattr__(self, method: str):  # type: ignore[no-untyped-def]
        def remote(*args):  # type: ignore[no-untyped-def]
            self.log.append(f"{self.name}.{method}")
            return f"ref:{self.name}.{method}"

        return SimpleNamespace(remote=remote)


def test_every_actor_worker_exports_before_a_colocated_engine_asks_its_peers():
    log: list[str] = []
    hosts = [Handle(f"w{i}", log) for i in range(4)]
    cfg = TrainerConfig.model_validate(
        {"roles": {"actor": {"replicas": 4}, "rollout": {"colocateWithActor": True}}}
    )
    engines = [hosts[:2], hosts[2:]]  # two engines of tensor 2
    groups = Groups(Group(hosts), Group(), Group([hosts[0], hosts[2]]), engines, hosts, [])
    sync = weight_sync(resolve_topology(cfg), groups)
    assert isinstance(sync, ColocatedSync)
    sync.start()
    first_sync = min(i for i, c in enumerate(log) if c.endswith(".sync_colocated"))
    assert sorted(log[:first_sync]) == [f"w{i}.export" for i in range(4)]
    assert log[first_sync:] == ["w0.sync_colocated", "w2.sync_colocated"]
