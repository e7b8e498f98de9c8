"""One run per run directory, and directories a run can write, checked before it starts.

The lock is an flock on RUN_DIR/run.lock, taken by the process in charge of the run (the
launcher process that relaunches under torchrun, or global rank 0 under an outside torchrun
or SLURM) and held until it exits: the kernel releases it when the holder dies, however it
dies, so a crashed run never keeps it. The file says who holds it (host, PID, since when) for
the message a second run gets.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK = "run.lock"
_held: list[int] = []  # the open lock file of this process (closing it would release it)


class DirectoryProblem(Exception):
    """A run directory or checkpoint directory the run cannot use, in words."""


def writable(path: Path, what: str) -> None:
    """Create `path` if needed and write into it, or say why not (DirectoryProblem)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise DirectoryProblem(f"{what}={path} is not writable: {e.strerror or e}") from None


def lock(run_dir: Path) -> None:
    """Hold RUN_DIR's lock for the rest of this process, or say who holds it."""
    path = run_dir / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = holder_of(path)
        os.close(fd)
        raise DirectoryProblem(
            f"hydra.run.dir={run_dir} is in use by another run ({holder}); one run per run "
            "directory: wait for it to end, or choose another hydra.run.dir"
        ) from None
    os.ftruncate(fd, 0)
    record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    os.write(fd, (json.dumps(record) + "\n").encode())
    _held.append(fd)


def holder_of(path: Path) -> str:
    try:
        record = json.loads(path.read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record["since"]))
        return f"host {record['host']}, PID {record['pid']}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"
