"""One run per run directory, and directories a run can write, checked before it starts.

The lock is an flock on RUN_DIR/run.lock, taken by the process in charge of the run (the
launcher process that relaunches under torchrun, or global rank 0 under an outside torchrun
or SLURM) and held until it exits: the kernel releases it when the holder dies, however it
dies, so a crashed run never keeps it. The file says who holds it (host, PID, since when) for
the message a second run gets. The launchers of a run on several nodes (launch.rendezvous)
share it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

LOCK = "run.lock"
_held: list[int] = []  # the open lock file of this process (closing it would release it)


class DirectoryProblem(Exception):
    """A run directory or checkpoint directory the run cannot use, in words."""


PROBE_BYTES = 64 << 10  # what a run writes before its first step (.hydra/, plan.json), and more


def writable(path: Path, what: str) -> None:
    """Create `path` if needed and write PROBE_BYTES into it (a read-only or full disk is found
    before anything is half-written there), or say why not (DirectoryProblem)."""
    if path.is_symlink() and not path.exists():
        raise DirectoryProblem(
            f"{what}={path} is a symbolic link that leads nowhere (a loop or a missing target)"
        )
    if path.exists() and not path.is_dir():
        raise DirectoryProblem(f"{what}={path} is a file, not a directory")
    made = [p for p in (path, *path.parents) if not (p.exists() or p.is_symlink())]
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DirectoryProblem(f"{what}={path} is not writable: {e.strerror or e}") from None
    if why := unwritable(path):
        for p in made:  # deepest first: a refused directory is not left behind
            with contextlib.suppress(OSError):
                p.rmdir()
        raise DirectoryProblem(f"{what}={path} is not writable: {why}")


def write_failure(error: BaseException, directory: Path) -> str | None:
    """Why a write into `directory` failed, in words, when the disk is the cause: an OS error
    inside the error (DCP gathers each rank's as (exception, traceback)), else what the
    directory says (torch.save reports a full disk as "unexpected pos", safetensors and numpy
    as errors of their own). None: the disk is not the cause."""
    inner = [error]
    for v in getattr(error, "failures", {}).values():
        inner.append(v[0] if isinstance(v, tuple) else getattr(v, "exception", v))
    for e in inner:
        if isinstance(e, OSError) and e.errno is not None:
            return f"{e.strerror or e} ({e.filename or directory})"
    try:
        free = shutil.disk_usage(directory).free
    except OSError as e:
        return f"{e.strerror or e} ({directory})"
    if why := unwritable(directory):
        return f"{why} ({directory})"
    if free < 2**20:
        return f"No space left on device ({directory}: {free:,} bytes free)"
    return None


def unwritable(directory: Path) -> str | None:
    """Why PROBE_BYTES cannot be written into `directory` (read-only, full), or None. The
    probe is a file without a name (O_TMPFILE): a process killed while probing leaves nothing;
    a named one where the file system has no such files."""
    probe = None
    try:
        try:
            fd = os.open(directory, os.O_TMPFILE | os.O_WRONLY, 0o600)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.EISDIR):
                raise
            probe = directory / f".write-test-{os.getpid()}"
            fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            if os.write(fd, bytes(PROBE_BYTES)) < PROBE_BYTES:  # the disk filled part-way
                return os.strerror(errno.ENOSPC)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        return str(e.strerror or e)
    finally:
        if probe is not None:
            with contextlib.suppress(OSError):
                probe.unlink()
    return None


# The files a run reads back from its directory (metrics to resume, the wandb run's id, who
# holds the lock, how it ended).
RUN_FILES = ("metrics.jsonl", "plan.json", LOCK, "wandb_run_id", "stopped.json", "exit.json")


def regular_files(run_dir: Path) -> None:
    """Each of RUN_FILES that exists is a plain file: one that is a device, a pipe or a link to
    one (/dev/zero, /dev/full) would be read without end (DirectoryProblem)."""
    for name in RUN_FILES:
        path = run_dir / name
        if (path.exists() or path.is_symlink()) and not path.is_file():
            what = "a directory" if path.is_dir() else "not a regular file"
            target = f" (it leads to {os.path.realpath(path)})" if path.is_symlink() else ""
            raise DirectoryProblem(f"{path} is {what}{target}: move it aside")


def lock(run_dir: Path, rendezvous: str = "") -> None:
    """Hold RUN_DIR's lock for the rest of this process, or say who holds it. The launchers of
    one run's nodes (`launch.rendezvous`) share it: the first takes it and records the
    rendezvous, the others join while the record names the same one."""
    path = run_dir / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    if _try(fd, fcntl.LOCK_EX):
        os.ftruncate(fd, 0)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        if rendezvous:
            record["rendezvous"] = rendezvous
        os.write(fd, (json.dumps(record) + "\n").encode())
        if rendezvous:
            fcntl.flock(fd, fcntl.LOCK_SH)  # the other nodes' launchers may join
        _held.append(fd)
        return
    deadline = time.monotonic() + 5  # the first member between writing and sharing it
    while rendezvous and rendezvous == record_of(path).get("rendezvous"):
        if _try(fd, fcntl.LOCK_SH):
            _held.append(fd)
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    os.close(fd)
    raise DirectoryProblem(
        f"hydra.run.dir={run_dir} is in use by another run ({holder_of(path)}); one run per run "
        "directory: wait for it to end, or choose another hydra.run.dir"
    )


def _try(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def record_of(path: Path) -> dict:
    """The JSON object in `path`; {} when it is missing, unreadable or not an object (or not
    a plain file: a device would be read without end)."""
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def holder_of(path: Path) -> str:
    record = record_of(path)
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record["since"]))
        held = f"host {record['host']}, PID {record['pid']}, since {since}"
    except (KeyError, TypeError, ValueError, OverflowError):
        return "holder unknown"
    if record.get("rendezvous"):
        held += f"; its nodes meet at launch.rendezvous={record['rendezvous']}"
    return held
