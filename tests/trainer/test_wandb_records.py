"""The W&B run-file reader of the tests (tests/helpers/wandb_records.py) on a crafted file whose
framing hits each edge of LevelDB's log format as wandb-core's writer (core/pkg/leveldb/record.go)
produces it: a block's tail shorter than a chunk header is zero padding, a record that starts
with exactly a chunk header's room left in a block begins with an empty first chunk, a record
spans several blocks (first, middles, last) and a chunk ends exactly at a block's end."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

from tests.helpers.wandb_records import wandb_records

BLOCK, HEADER = 32768, 7  # LevelDB's log format: 32 KiB blocks, 7-byte chunk headers
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _frame(payloads: list[bytes]) -> tuple[bytes, list[list[int]]]:
    """A run file of these records, framed the way wandb-core's writer frames them, and each
    record's chunk types."""
    out = bytearray(b":W&B" + struct.pack("<HB", 0xBEE1, 0))
    kinds: list[list[int]] = []
    for payload in payloads:
        left = BLOCK - len(out) % BLOCK
        if left < HEADER:  # no room for a chunk header: pad the block with zeroes
            out += bytes(left)
        rest, first, record_kinds = payload, True, []
        while True:
            room = BLOCK - len(out) % BLOCK - HEADER
            chunk, rest = rest[:room], rest[room:]
            last = not rest
            kind = (FULL if first else LAST) if last else (FIRST if first else MIDDLE)
            crc = zlib.crc32(bytes([kind]) + chunk)
            out += struct.pack("<IHB", crc, len(chunk), kind) + chunk
            record_kinds.append(kind)
            first = False
            if last:
                break
        kinds.append(record_kinds)
    return bytes(out), kinds


def _record(step: int, size: int) -> Any:
    """A history record of exactly ``size`` bytes once serialised."""
    from wandb.proto import wandb_internal_pb2 as pb

    fill = size
    for _ in range(8):
        record = pb.Record(
            history=pb.HistoryRecord(
                item=[pb.HistoryItem(key="x", value_json=f'"{"a" * fill}"')],
                step=pb.HistoryStep(num=step),
            )
        )
        fill -= record.ByteSize() - size
        if record.ByteSize() == size:
            return record
    raise AssertionError(f"no record of {size} bytes")


def test_a_crafted_file_over_seven_blocks_reads_back_record_for_record(tmp_path: Path) -> None:
    sizes = [
        BLOCK - 2 * HEADER - 3,  # from the file header to 3 bytes before block 0's end: padding
        BLOCK - 2 * HEADER,  # all of block 1 but a chunk header's room
        70000,  # an empty first chunk at block 1's end, then blocks 2, 3 and part of 4
        0,  # (set below) the rest of block 4 and all of block 5, ending exactly at its end
        40,  # at the start of block 6
    ]
    start_of_4th = 4 * BLOCK + HEADER + (70000 - 2 * (BLOCK - HEADER))
    sizes[3] = 6 * BLOCK - start_of_4th - 2 * HEADER
    records = [_record(step, size) for step, size in enumerate(sizes, 1)]
    data, kinds = _frame([r.SerializeToString() for r in records])
    # the edges are really there
    assert data[BLOCK - 3 : BLOCK] == bytes(3)
    assert kinds == [[FULL], [FULL], [FIRST, MIDDLE, MIDDLE, LAST], [FIRST, LAST], [FULL]]
    assert struct.unpack("<H", data[2 * BLOCK - HEADER + 4 : 2 * BLOCK - HEADER + 6]) == (0,)
    assert len(data) == 6 * BLOCK + HEADER + 40
    path = tmp_path / "run-crafted.wandb"
    path.write_bytes(data)
    assert list(wandb_records(path)) == records
