"""Findings 3 and 8 of issue 40: on a local run (loopback), SGLang's engines join our
weight-update group, and SGLang's own ``flattened_bucket`` receiver unpacks what our sender sends.

SGLang's ``init_weights_update_group`` always rendezvouses over TCP
(``init_custom_process_group(init_method="tcp://host:port")``: a ``TCPStore`` client dialling
rank 0), so our side, rank 0, must serve a TCP store there. ``sglang_group_driver.py`` runs both
ends in two processes: ours through ``weight_sync.init_custom_group`` and a broadcast per tensor,
the engine's through the adapter into SGLang's OWN weight updater (its ``init_custom_process_group``
from the pinned package), with gloo over loopback; every listener binds loopback.

Finding 8: a disaggregated sync broadcast tensor by tensor, though SGLang 0.5.23 receives a whole
bucket in one broadcast (``load_format="flattened_bucket"``: ``FlattenedTensorBucket.empty``
lays the bucket out from names, dtypes and shapes, unpadded, and refuses an unaligned tensor).
Our sender (``weight_sync.broadcast_stream``) now packs each bucket so, one collective each, and
cuts a bucket where a tensor would land unaligned.
"""

from __future__ import annotations

from pathlib import Path

from ppojob_trainer.distributed import free_port
from tests.helpers.sglang_runtime import driver_results, start_driver

DRIVER = Path(__file__).with_name("sglang_group_driver.py")
WAIT_S = 90.0  # our side gives up after sglang_group_driver.TIMEOUT_S (20 s) without the engine


def test_sglangs_own_group_init_joins_ours_over_loopback_and_receives_a_broadcast():
    port = str(free_port())
    # our side picks its interface itself (GLOO_SOCKET_IFNAME unset); the engine's process is
    # told loopback, as the trainer's environment tells the engines it starts
    ours = start_driver(DRIVER, "actor", port, "weights-test", GLOO_SOCKET_IFNAME=None)
    engine = start_driver(DRIVER, "engine", port, "weights-test", GLOO_SOCKET_IFNAME="lo")
    actor, received = driver_results([ours, engine], WAIT_S)
    assert "error" not in actor, actor["error"]
    assert "error" not in received, received["error"]
    names = ["embed.weight", "norm.weight", "proj.weight", "proj.bias"]
    assert received["equal"] == dict.fromkeys(names, True)
    # one collective per packed bucket: the bf16 tensor of odd length cuts the one bucket in
    # two (proj.weight would start at byte 142, unaligned for float32); SGLang loaded each
    # broadcast as one bucket
    assert actor["collectives"] == 2
    assert [s[0] for s in actor["sent"]] == [names[:2], names[2:]]
    assert received["loads"] == [names[:2], names[2:]]
    assert actor["bytes"] == 33 * 4 + 5 * 2 + 12 * 4 + 3 * 4  # unpadded: the tensors' bytes
    assert actor["listening"], "our side listens somewhere: nothing found means the check broke"
    off = [a for a in actor["listening"] if not a.startswith("127.0.0.1:")]
    assert not off, f"our side listens off loopback: {off}"
