"""A checkpoint is proven whole by what it holds: every way of deleting, truncating or editing
any one of its files is found before a byte of it is loaded, with or without its sums.*.json
and whatever meta.json's list of files says (launcher/checkpoint/reader.py checkpoint_damage)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from launcher.checkpoint.reader import checkpoint_damage
from launcher.checkpoint.store import (
    CheckpointError,
    open_checkpoint,
    seal,
    step_dir,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real DCP save of one rank, with meta.json and its sums, as the Checkpointer makes one."""
    root = tmp_path_factory.mktemp("integrity")
    final = step_dir(root, 3)
    partial = final.with_name(final.name + ".partial")
    state = {"w": torch.arange(4096, dtype=torch.float32), "step": torch.tensor(3)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(partial)), no_dist=True)
    seal(partial, final, {"step": 3})
    assert checkpoint_damage(open_checkpoint(final)) == []
    return final


def spoiled(path, how: str) -> None:
    if how == "deleted":
        path.unlink()
    elif how == "truncated":
        os.truncate(path, path.stat().st_size // 2)
    else:  # one byte changed in the middle
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))


def found(path) -> list[str]:
    """What resuming sees of the checkpoint at `path`: its damage, or why it is not complete."""
    try:
        return checkpoint_damage(open_checkpoint(path))
    except CheckpointError as e:
        return [str(e)]


def names(saved) -> list[str]:
    return sorted(p.name for p in saved.iterdir())


@pytest.mark.parametrize("how", ["deleted", "truncated", "edited"])
def test_every_file_spoiled_in_turn_is_found(saved, tmp_path, how):
    """meta.json's own edit is the exception that is harmless when it leaves valid JSON that
    still names the format: what it says is not what proves the rest whole."""
    assert {"meta.json", ".metadata", "sums.0.json"} <= set(names(saved))
    for name in names(saved):
        copy = tmp_path / name / saved.name
        shutil.copytree(saved, copy)
        spoiled(copy / name, how)
        problems = found(copy)
        if name == "meta.json" and how == "edited" and not problems:
            json.loads((copy / name).read_text())  # still JSON: then nothing else is trusted
            continue
        assert problems, (name, how)


def test_without_its_sums_and_with_a_flipped_byte_it_is_not_resumed(saved, tmp_path):
    copy = tmp_path / saved.name
    shutil.copytree(saved, copy)
    (copy / "sums.0.json").unlink()
    spoiled(copy / "__0_0.distcp", "edited")
    assert any("has no saved checksum" in p for p in found(copy)), found(copy)


@pytest.mark.parametrize("files", [{}, {"__0_0.distcp": {"bytes": 10}}])
def test_an_edited_list_of_files_hides_no_truncated_shard(saved, tmp_path, files):
    """meta.json's `files` emptied, or naming the size the shard has after it was cut short:
    its CRC-32 finds it, and so does .metadata alone (the sums removed too)."""
    copy = tmp_path / saved.name
    shutil.copytree(saved, copy)
    os.truncate(copy / "__0_0.distcp", 10)
    meta = json.loads((copy / "meta.json").read_text())
    (copy / "meta.json").write_text(json.dumps({**meta, "files": files}))
    assert any("__0_0.distcp has changed since it was saved" in p for p in found(copy))
    (copy / "sums.0.json").unlink()
    assert any("__0_0.distcp has 10 bytes; .metadata reads" in p for p in found(copy)), found(copy)
