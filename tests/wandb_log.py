"""Read the history rows of an offline wandb run file (a LevelDB-style log of protobuf records).

wandb 0.31 ships no reader for its .wandb files, so the tests read them: a 7-byte header
(":W&B", magic, version), then 32 KiB blocks of records, each with a 7-byte header (crc32,
little-endian length, type: 1 full, 2 first, 3 middle, 4 last).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32768
HEADER = 7


def records(path: str):
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # block trailer padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            yield rec


def history(path: str) -> list[dict]:
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in rec.history.item
                }
            )
    return rows


def one_wandb_run(run_dir: Path, starts: int, steps: int) -> None:
    """The offline wandb files of `starts` starts: one run id, every step sent once."""
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == starts and len({f.name for f in files}) == 1, files
    sent = {f.parent.name: [r["_step"] for r in history(str(f)) if "loss" in r] for f in files}
    every = sorted(step for steps_of in sent.values() for step in steps_of)
    assert every == list(range(1, steps + 1)), sent
