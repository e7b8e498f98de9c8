"""One run per run directory (launcher/runtime/rundir.py): flock semantics, in one process (an flock
belongs to the open file, so two opens of run.lock here conflict as two processes would)."""

from __future__ import annotations

import os

import pytest

from launcher.runtime import rundir


@pytest.fixture(autouse=True)
def release():
    yield
    while rundir._held:
        os.close(rundir._held.pop())


def test_a_second_run_is_refused_naming_the_first(tmp_path):
    rundir.lock(tmp_path)
    with pytest.raises(rundir.DirectoryProblem, match=f"PID {os.getpid()}, since"):
        rundir.lock(tmp_path)


def test_the_nodes_of_one_run_share_it_and_others_are_refused(tmp_path):
    rundir.lock(tmp_path, "n1:29500")
    rundir.lock(tmp_path, "n1:29500")  # a second node's launcher joins
    assert len(rundir._held) == 2
    meets = "its nodes meet at launch.rendezvous=n1:29500"
    with pytest.raises(rundir.DirectoryProblem, match=meets):
        rundir.lock(tmp_path)  # a run of one node
    with pytest.raises(rundir.DirectoryProblem, match=meets):
        rundir.lock(tmp_path, "n2:29500")  # another multi-node run


def test_a_run_of_several_nodes_is_refused_beside_a_plain_one(tmp_path):
    rundir.lock(tmp_path)
    with pytest.raises(rundir.DirectoryProblem, match="in use by another run"):
        rundir.lock(tmp_path, "n1:29500")


def test_the_lock_is_free_once_its_holders_are_gone(tmp_path):
    rundir.lock(tmp_path, "n1:29500")
    rundir.lock(tmp_path, "n1:29500")
    while rundir._held:
        os.close(rundir._held.pop())
    rundir.lock(tmp_path)


def test_a_file_where_a_directory_must_go_is_named(tmp_path):
    (tmp_path / "tensorboard").write_text("")
    with pytest.raises(rundir.DirectoryProblem) as e:
        rundir.writable(tmp_path / "tensorboard", "logging.tensorboard's directory")
    assert str(e.value) == (
        f"logging.tensorboard's directory={tmp_path / 'tensorboard'} is a file, not a directory"
    )
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(rundir.DirectoryProblem, match="a symbolic link that leads nowhere"):
        rundir.writable(tmp_path / "loop", "checkpoint.dir")
    rundir.writable(tmp_path / "a" / "b", "checkpoint.dir")  # made where missing
    assert (tmp_path / "a" / "b").is_dir()
