"""launcher/runtime/scratch.py: a partial output is removed however its command ends, and a
stop signal ends a command with one line and 128 + the signal's number."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

from launcher.runtime.scratch import command, partial_of, scratch, staged, uninterrupted

WRITER = """
import os, sys, time
from pathlib import Path
from launcher.runtime.scratch import scratch
with scratch(Path(sys.argv[1])) as part:
    part.mkdir()
    (part / "half").write_text("x")
    print("writing", flush=True)
    time.sleep(60)
"""


def test_the_guard_removes_the_partial_output_of_a_sigkilled_process(tmp_path):
    part = tmp_path / "out.partial"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(part)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "writing\n"
    assert (part / "half").exists()
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while part.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not part.exists()


def test_a_failure_removes_the_partial_and_a_rename_inside_keeps_the_output(tmp_path):
    part, out = tmp_path / "a.partial", tmp_path / "a"
    with pytest.raises(ValueError), scratch(part):
        part.write_text("half")
        raise ValueError("a failed write")
    assert not part.exists()
    with scratch(part):
        part.write_text("whole")
        part.rename(out)
    assert out.read_text() == "whole" and sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_a_partial_left_by_a_process_gone_with_its_guard_is_removed_by_the_next_writer(
    tmp_path,
):
    """A SIGKILL to a whole process group takes the guard too: the next command writing the
    same OUT removes that partial, and only it: not a live process's, not one of another host
    sharing the disk, not a user's own file named like a partial."""
    out = tmp_path / "out"
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = out.with_name(partial_of(out).name.replace(f"-{os.getpid()}.", f"-{gone.pid}."))
    dead.mkdir()
    (dead / "half").write_text("x")
    alive = out.with_name(partial_of(out).name.replace(f"-{os.getpid()}.", f"-{os.getppid()}."))
    alive.write_text("another writer's")
    elsewhere = tmp_path / f".out.otherhost-{gone.pid}.partial"
    elsewhere.write_text("another host's")
    (tmp_path / "out.partial").write_text("mine")
    with staged(out) as part:
        assert part.parent == tmp_path and part.name.startswith(".out.")
        part.write_text("whole")
        part.rename(out)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["out", alive.name, elsewhere.name, "out.partial"])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_ends_a_command_with_one_line_and_its_status(sig, tmp_path, capsys):
    part = tmp_path / "out.partial"

    @command("OUT was not written")
    def main(argv):
        with scratch(part):
            part.write_text("half")
            os.kill(os.getpid(), sig)
            time.sleep(5)  # the signal arrives first
        return 0

    before = signal.getsignal(sig)
    assert main([]) == 128 + sig
    assert capsys.readouterr().err == f"stopped by {sig.name}: OUT was not written\n"
    assert not part.exists()
    assert signal.getsignal(sig) is before  # the command's handlers are gone with it


def test_a_second_stop_signal_does_not_cut_the_removal_of_the_partial(
    tmp_path, monkeypatch, capsys
):
    """A user's second Ctrl-C lands while the partial output of the first is being removed:
    the removal goes on to the end (it was cut short, and the guard told to forget it)."""
    import shutil

    part = tmp_path / "out.partial"
    real = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # the second one, as the removal starts
        time.sleep(0.2)
        real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)

    @command("OUT was not written")
    def main(argv):
        with scratch(part):
            part.mkdir()
            for i in range(50):
                (part / f"{i}.bin").write_bytes(b"x")
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the first arrives here
        return 0

    assert main([]) == 128 + signal.SIGINT
    assert capsys.readouterr().err == "stopped by SIGINT: OUT was not written\n"
    assert not part.exists()


def test_a_stop_inside_an_uninterrupted_block_ends_the_command_at_the_blocks_end(capsys):
    """(launcher.prepare starts its workers in one: a worker whose start-up data was cut
    short by the stop printed a traceback, EOFError, after the command's line.)"""
    ran = []

    @command("OUT was not written")
    def main(argv):
        with uninterrupted():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # the signal arrives here, and is held
            ran.append("the block, whole")
        ran.append("after it")
        return 0

    assert main([]) == 128 + signal.SIGTERM
    assert ran == ["the block, whole"]
    assert capsys.readouterr().err == "stopped by SIGTERM: OUT was not written\n"


def test_a_command_that_ends_otherwise_is_untouched(capsys):
    @command("OUT was not written")
    def main(argv):
        raise ValueError("not a stop")

    with pytest.raises(ValueError, match="not a stop"):
        main([])
    assert capsys.readouterr().err == ""


def loaded(pid: int, library: str) -> bool:
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize(
    "args, library",
    [
        (("launcher.checkpoint", "export", "/nonexistent", "out.pt"), "libtorch_cpu"),
        (("launcher.plan",), "_yaml"),
        (("launcher.plan.calibrate", "--from", "/nonexistent"), "_yaml"),
    ],
    ids=[
        "checkpoint export, importing torch",
        "plan, importing Hydra's YAML",
        "calibrate, importing Hydra's YAML",
    ],
)
def test_a_stop_during_a_commands_imports_is_one_line_not_a_traceback(args, library, tmp_path):
    """Ctrl-C lands while the command still imports (seconds: torch, Hydra): the command ends
    with one line and 130, as a shell reports it (it was KeyboardInterrupt's traceback from
    inside the import)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not loaded(proc.pid, library) and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err == "stopped by SIGINT\n", err[-2000:]
