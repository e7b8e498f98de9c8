"""Checkpoint directories: completeness, the newest complete one, pruning, the checks made
before any process starts, and what a save that fills the disk says."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from launcher.checkpoint.saver import Checkpointer, SaveFailed
from launcher.checkpoint.store import (
    CheckpointError,
    damage,
    finished,
    list_checkpoints,
    newest_complete,
    open_checkpoint,
    prune,
    publish,
    rank_files,
    recorded_sums,
    shape_mismatches,
    start_problems,
    step_dir,
    write_meta,
    write_sums,
)

MODEL = {"family": "llama", "dim": 128, "n_layers": 4, "n_heads": 8, "vocab_size": 320}


def make(directory, step: int, complete: bool = True, model: dict = MODEL):
    """A checkpoint directory as a save leaves it: shards, then meta.json and the rename."""
    final = step_dir(directory, step)
    partial = final.with_name(final.name + ".partial")
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"x" * 100)
    if complete:
        write_meta(partial, {"step": step, "config": {"model": model}, "layout": {"pp": 1}})
        publish(partial, final)
        return final
    return partial


def test_partial_saves_are_invisible(tmp_path):
    make(tmp_path, 2)
    make(tmp_path, 4, complete=False)
    entries = list_checkpoints(tmp_path)
    assert [(e.step, e.complete) for e in entries] == [(2, True), (4, False)]
    assert newest_complete(tmp_path).step == 2


def test_loading_a_partial_one_is_refused_with_the_reason(tmp_path):
    partial = make(tmp_path, 4, complete=False)
    with pytest.raises(CheckpointError, match="incomplete: a save did not finish"):
        open_checkpoint(partial)
    # The same directory without its rename (meta.json never written) is refused too.
    final = step_dir(tmp_path, 4)
    partial.rename(final)
    with pytest.raises(CheckpointError, match="incomplete"):
        open_checkpoint(final)


def test_prune_keeps_the_newest_complete_and_drops_older_partials(tmp_path):
    for step in (2, 4, 6):
        make(tmp_path, step)
    make(tmp_path, 5, complete=False)  # a crashed save older than the newest complete one
    make(tmp_path, 8, complete=False)  # one that may still be in flight: kept
    deleted = prune(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == ["step_00000002", "step_00000005.partial"]
    assert [(e.step, e.complete) for e in list_checkpoints(tmp_path)] == [
        (4, True),
        (6, True),
        (8, False),
    ]
    assert prune(tmp_path, keep=0) == []  # 0 keeps every complete checkpoint


def test_shape_mismatches_name_each_field():
    other = {**MODEL, "dim": 256, "n_layers": 8}
    assert shape_mismatches(MODEL, other) == [
        "dim=128 in the checkpoint but model.dim=256",
        "n_layers=4 in the checkpoint but model.n_layers=8",
    ]
    # max_seq_len sizes gpt's learned positions only; llama's RoPE table is not saved.
    assert shape_mismatches(MODEL, {**MODEL, "max_seq_len": 4096}) == []
    gpt = {**MODEL, "family": "gpt", "max_seq_len": 1024}
    assert shape_mismatches(gpt, {**gpt, "max_seq_len": 2048}) == [
        "max_seq_len=1024 in the checkpoint but model.max_seq_len=2048"
    ]


def test_start_problems(tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    assert start_problems(ckpts, "auto", None, "dcp", MODEL) == []
    make(ckpts, 3)
    assert start_problems(ckpts, "auto", None, "dcp", MODEL) == []
    (wrong,) = start_problems(ckpts, "auto", None, "dcp", {**MODEL, "dim": 64})
    assert "holds another model" in wrong and "dim=128 in the checkpoint but model.dim=64" in wrong
    (never,) = start_problems(ckpts, "never", None, "dcp", MODEL)
    assert "already holds checkpoints (newest: step 3)" in never
    partial = make(tmp_path / "other", 9, complete=False)
    (bad,) = start_problems(tmp_path / "empty", "auto", str(partial), "dcp", MODEL)
    assert bad.startswith("checkpoint.initial_load_path:") and "incomplete" in bad
    # A checkpoint in checkpoint.dir wins over initial_load_path (a restarted run resumes
    # its own), whatever its format; without one, a Hugging Face directory is checked.
    assert start_problems(ckpts, "auto", str(partial), "dcp", MODEL) == []
    assert start_problems(ckpts, "auto", str(tmp_path / "no_hf"), "hf", MODEL) == []
    (hf,) = start_problems(tmp_path / "empty", "auto", str(tmp_path / "no_hf"), "hf", MODEL)
    assert hf == f"checkpoint.initial_load_path: {tmp_path / 'no_hf'} is not a directory"
    # A head_dim left to its default (None) is dim // n_heads.
    assert shape_mismatches({**MODEL, "head_dim": None}, {**MODEL, "head_dim": 16}) == []


def test_meta_is_plain_json(tmp_path):
    final = make(tmp_path, 7)
    meta = json.loads((final / "meta.json").read_text())
    assert meta["format"] == "llm-launcher-checkpoint" and meta["step"] == 7


def saved_with_sums(directory, step: int):
    """A save of two ranks as the Checkpointer makes one: each rank's sums, then sizes in
    meta.json and the rename."""
    final = step_dir(directory, step)
    partial = final.with_name(final.name + ".partial")
    partial.mkdir(parents=True)
    for rank in (0, 1):
        (partial / f"__{rank}_0.distcp").write_bytes(bytes(range(256)) * (rank + 1))
    (partial / ".metadata").write_bytes(b"index")
    files = {}
    for rank in (0, 1):
        files.update(write_sums(partial, rank, rank_files(partial, rank)))
    write_meta(partial, {"step": step, "files": files})
    publish(partial, final)
    return open_checkpoint(final)


def test_sums_are_in_the_checkpoint_when_it_appears_and_find_each_kind_of_damage(tmp_path):
    entry = saved_with_sums(tmp_path, 4)
    assert sorted(p.name for p in entry.path.glob("sums.*.json")) == [
        "sums.0.json",
        "sums.1.json",
    ]
    assert sorted(recorded_sums(entry)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert damage(entry) == []
    shard = entry.path / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert "has changed since it was saved" in " ".join(damage(entry))
    assert damage(entry, None) == []  # sizes only: the same size
    # Ranks split the CRC reading: the file at position 2 of 3 is rank 0's of 2.
    assert damage(entry, (1, 2)) == [] and damage(entry, (0, 2)) != []
    shard.write_bytes(bytes(data[:100]))
    assert "has 100 bytes, 512 when saved" in " ".join(damage(entry, None))
    (entry.path / ".metadata").unlink()
    assert damage(entry, None) == [f"{entry.path / '.metadata'} is missing"]


def test_only_a_checkpoint_proven_whole_at_the_last_step_answers_nothing_left(tmp_path):
    """launcher.train's answer before any rank starts (store.finished): the newest complete
    checkpoint at or past train.steps whose every file has its saved CRC-32, matching;
    anything less is left to the ranks' resume."""
    entry = saved_with_sums(tmp_path, 4)
    assert finished(tmp_path, "auto", 4) == entry
    assert finished(tmp_path, "auto", 3) == entry  # past the steps asked for
    assert finished(tmp_path, "auto", 5) is None  # steps left
    assert finished(tmp_path, "never", 4) is None  # no resume: start_problems says why
    (entry.path / "sums.1.json").unlink()  # killed before its sums landed (issue 66)
    assert finished(tmp_path, "auto", 4) is None
    entry = saved_with_sums(tmp_path / "changed", 4)
    shard = entry.path / "__0_0.distcp"
    shard.write_bytes(bytes(reversed(shard.read_bytes())))  # same size, other bytes
    assert finished(tmp_path / "changed", "auto", 4) is None
    make(tmp_path / "unsummed", 4)  # no sizes or sums recorded at all
    assert finished(tmp_path / "unsummed", "auto", 4) is None


def test_a_meta_json_that_is_not_an_object_is_not_complete(tmp_path):
    final = make(tmp_path, 2)
    (final / "meta.json").write_text("[1, 2]")
    assert [e.complete for e in list_checkpoints(tmp_path)] == [False]
    with pytest.raises(CheckpointError, match="is not an llm-launcher-checkpoint file"):
        open_checkpoint(final)


def test_a_step_saved_again_replaces_the_old_one_whole(tmp_path):
    """A resume that fell back past step 4 saves step 4 again: the old one is renamed aside
    before the new one takes its name, so no instant has neither, and nothing of it stays."""
    old = make(tmp_path, 4)
    (old / "__1_0.distcp").write_bytes(b"old shard")
    renames = []
    real = os.rename

    def rename(src, dst):
        renames.append((Path(src).name, Path(dst).name, sorted(p.name for p in tmp_path.iterdir())))
        real(src, dst)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(os, "rename", rename)
        entry = saved_with_sums(tmp_path, 4)
    assert [(s, d) for s, d, _ in renames] == [
        ("step_00000004", "step_00000004.deleting"),
        ("step_00000004.partial", "step_00000004"),
    ]
    assert entry.path == old and damage(entry) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004"]
    assert (old / "__1_0.distcp").read_bytes() == bytes(range(256)) * 2


def test_a_step_name_held_by_a_link_to_itself_is_replaced_by_the_save(tmp_path):
    """A stray symbolic link in a checkpoint's place (here to itself) is not a checkpoint;
    the save of that step replaces the link, and pruning removes links, never their target."""
    make(tmp_path, 2)
    (tmp_path / "step_00000004").symlink_to("step_00000004")
    entry = saved_with_sums(tmp_path, 4)
    assert entry.path.is_dir() and not entry.path.is_symlink() and damage(entry) == []
    elsewhere = make(tmp_path / "elsewhere", 1)
    (tmp_path / "step_00000001").symlink_to(elsewhere)
    assert [p.name for p in prune(tmp_path, keep=1)] == ["step_00000001", "step_00000002"]
    assert (elsewhere / "meta.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "step_00000004"]


def test_prune_renames_a_checkpoint_out_before_deleting_its_files(tmp_path):
    """A kill while pruning leaves no half-deleted checkpoint that still looks complete: each
    is renamed out of the set first; what a killed removal left goes at the next prune."""
    for step in (2, 4):
        make(tmp_path, step)
    seen = []
    real = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if Path(path).exists():  # what is listed while files are deleted
            seen.append([(e.step, e.complete) for e in list_checkpoints(tmp_path)])
        real(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(shutil, "rmtree", rmtree)
        assert [p.name for p in prune(tmp_path, keep=1)] == ["step_00000002"]
    assert seen and all(s == [(4, True)] for s in seen)
    left = tmp_path / "step_00000006.deleting"  # a removal killed half way
    left.mkdir()
    (left / "meta.json").write_text("{}")
    assert [e.step for e in list_checkpoints(tmp_path)] == [4]
    prune(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004"]


@contextlib.contextmanager
def tmpfs(mount, size: str):
    """A tmpfs of `size` at `mount`, to be filled."""
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)])
    if made.returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def tiny_disk(tmp_path):
    with tmpfs(tmp_path / "disk", "64k") as mount:
        yield mount


def fill(directory) -> None:
    with contextlib.suppress(OSError), open(directory / "filler", "wb") as f:
        while True:
            f.write(bytes(4096))
            f.flush()


def test_a_save_with_no_room_for_its_sums_is_not_published(tiny_disk):
    """Sums are written before the checkpoint appears: with no room left for them the save
    is refused (one line naming the file), its partial removed, the previous one named."""
    previous = make(tiny_disk, 2)
    partial = tiny_disk / "step_00000004.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    (partial / ".metadata").write_bytes(b"index")
    fill(tiny_disk)
    with pytest.raises(OSError):
        write_sums(partial, 0, rank_files(partial, 0))
    assert not (partial / "sums.0.json").exists()
    saver = Checkpointer(tiny_disk, keep=1, async_save=False, rank=0, meta=dict)
    saver._finish(None, 4, partial, step_dir(tiny_disk, 4), {})
    with pytest.raises(SaveFailed) as failed:
        saver.wait()
    assert (
        "No space left on device" in failed.value.message and str(previous) in failed.value.message
    )
    assert not partial.exists() and [e.step for e in list_checkpoints(tiny_disk)] == [2]


def test_a_save_that_fills_the_disk_says_so_when_torch_hides_the_os_error(tmp_path):
    """On a full disk DCP may raise torch.save's RuntimeError ("file write failed") and no OS
    error: the disk says why, read before the partial save is removed (which frees it)."""
    disk = tmp_path / "disk"
    partial = disk / "step_00000004.partial"
    written = RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    error = CheckpointException("save", {0: (written, None), 1: (written, None)})
    with tmpfs(disk, "4m"):
        partial.mkdir()
        fill(partial)
        saver = Checkpointer(disk, keep=0, async_save=False, rank=0, meta=dict)
        failed = saver.failed(4, partial, error)
        assert not partial.exists()
    assert "step 4 could not be written: No space left on device" in failed.message


def test_a_peer_gone_while_a_save_is_published_is_raised_by_wait_not_printed(tmp_path, monkeypatch):
    """The sums' gather runs in the save's own thread: a peer gone there (its node lost)
    is raised by the next wait() on the main thread, which prints it in one line
    (engine.py), and not as a thread's traceback (CI's elastic run, 2026-11-29)."""
    import threading

    import torch

    from launcher.runtime.failures import peer_gone

    gone = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:5518. GLHF")
    unhandled = []
    monkeypatch.setattr(threading, "excepthook", unhandled.append)
    saver = Checkpointer(tmp_path, keep=1, async_save=False, rank=0, meta=lambda step: {})

    def gather_fails(*args):
        raise gone

    monkeypatch.setattr(saver, "_finish", gather_fails)
    saver.save(3, {"w": torch.ones(4)})
    with pytest.raises(RuntimeError) as raised:
        saver.wait()
    assert raised.value is gone and unhandled == []
    assert "a peer process is gone (Connection closed by peer" in peer_gone(raised.value)
    saver.wait()  # raised once: nothing pending after it
