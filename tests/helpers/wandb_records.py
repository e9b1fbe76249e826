"""The records of a W&B run file (``run-<id>.wandb``), decoded with wandb's own protobuf
messages (``wandb.proto.wandb_internal_pb2.Record``).

wandb 0.31 writes the file from its Go core and ships no Python reader of it any more (the old
``wandb.sdk.internal.datastore``), so the framing is read here: a 7-byte header (``:W&B``, a
2-byte magic, a version byte), then LevelDB's log format in 32 KiB blocks: each chunk is a 4-byte
checksum, a 2-byte little-endian length and a type (1 full, 2 first, 3 middle, 4 last), and a
block's tail shorter than a chunk header is padding."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7


def wandb_records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 1:
            yield wandb_internal_pb2.Record.FromString(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield wandb_internal_pb2.Record.FromString(pending + chunk)


def offline_run(root: Path) -> dict[str, Any]:
    """The one offline run under ``root`` (a tracker's dir): its history (step -> {key: value}),
    config, summary updates, artifacts (name -> [file paths]) and exit code."""
    (path,) = Path(root).glob("wandb/offline-run-*/run-*.wandb")
    run: dict[str, Any] = {"history": {}, "config": {}, "summary": {}, "artifacts": {}}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            for item in record.run.config.update:
                run["config"][item.key] = json.loads(item.value_json)
            run["name"] = record.run.display_name
            run["project"] = record.run.project
        elif kind == "history":
            row = {
                "/".join(i.nested_key) or i.key: json.loads(i.value_json)
                for i in record.history.item
            }
            run["history"][record.history.step.num] = row
        elif kind == "summary":
            for i in record.summary.update:
                run["summary"]["/".join(i.nested_key) or i.key] = json.loads(i.value_json)
        elif kind == "artifact":
            files = [c.path for c in record.artifact.manifest.contents]
            run["artifacts"][record.artifact.name] = files
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    assert "project" in run, (
        f"{path} holds no run record ({path.stat().st_size} bytes): wandb's service has not "
        "written it out yet"
    )
    return run
