"""What a side command (prepare, convert, checkpoint export, runs plot) writes before it is
whole, and how the command ends on a stop signal: nothing half-written stays, however the
command ends. One mechanism for every such output (a checkpoint's `step_N.partial` is the
store's own protocol: launcher/checkpoint/store.py).

`staged(out)` is where OUT is written until whole: `.OUT.HOST-PID.partial` beside it (the same
disk: renaming it to OUT, inside the block, is atomic), so it is never a file the launcher did
not make and never another command's. On an exception or a stop signal it is removed in the
process. A SIGKILL runs no code in the process, so the first scratch path also starts the
guard: a small process that reads the registered paths from a pipe and, when the pipe closes
(the command has exited, whatever the way), removes those still registered. It ignores the
terminal's signals, so a Ctrl-C that reaches the whole process group still leaves it to clean
up; a SIGKILL to the whole group (scancel, the OOM killer's group kill) takes the guard too, and
the next command writing the same OUT removes what a process of this host that is gone left.

`command(what)` decorates a command's main: a stop signal (SIGINT, SIGTERM, SIGHUP) raises
`Stopped` in it, unwinding through the scratch paths, and ends the command with one line saying
what was not written, exit 128 + the signal's number (as a shell reports a killed command);
inside `uninterrupted()` (starting worker processes) it raises at the block's end.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from launcher.runtime.rundir import unwritable, write_failure

# The guard: registered paths arrive as JSON lines "+PATH" / "-PATH"; at end of input (the
# command is gone) it removes what is still registered.
GUARD = r"""
import json, os, shutil, signal, sys
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(s, signal.SIG_IGN)
paths = set()
for line in sys.stdin:
    op, path = line[0], json.loads(line[1:])
    (paths.add if op == "+" else paths.discard)(path)
for path in paths:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass
"""

_guard: list[subprocess.Popen] = []  # started with the first scratch path of this process
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Stop signals received inside `uninterrupted` (None outside it): raised at its end.
_held: list[int] | None = None


class Stopped(BaseException):  # noqa: N818 (like KeyboardInterrupt: a stop, not an error)
    """A stop signal arrived (command)."""


def _tell_guard(op: str, path: Path) -> None:
    if not _guard or _guard[0].poll() is not None:
        _guard[:] = [
            subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", GUARD],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        ]
    with contextlib.suppress(BrokenPipeError):
        _guard[0].stdin.write(op + json.dumps(str(path.absolute())) + "\n")
        _guard[0].stdin.flush()


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def output_problem(out: Path, what: str) -> str | None:
    """Why a command's output OUT cannot be written where it is named (a file where one of its
    directories goes, a directory of its name, a read-only or full disk), in words; None when
    it can be written. Nothing is made: the nearest existing directory above OUT is probed."""
    if out.is_dir():
        return f"{what} {out} is a directory; name the file to write"
    above = next(p for p in out.absolute().parents if p.exists() or p.is_symlink())
    if not above.is_dir():
        return f"{what} {out}: {above} is not a directory"
    if why := unwritable(above):
        return f"{what} {out}: {above} is not writable: {why}"
    return None


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "_", socket.gethostname().split(".")[0]) or "host"


def partial_of(out: Path) -> Path:
    """Where this process writes OUT until it is whole (staged)."""
    return out.with_name(f".{out.name}.{_host()}-{os.getpid()}.partial")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def clear_leftovers(out: Path) -> list[Path]:
    """Partials of OUT left by processes of this host that are gone (SIGKILLed with their
    guard), removed; those of a live process, or of another host sharing the disk, stay."""
    name = re.compile(rf"\.{re.escape(out.name)}\.{re.escape(_host())}-(\d+)\.partial")
    removed = []
    with contextlib.suppress(OSError):  # no directory yet: nothing was left
        for path in out.parent.iterdir():
            if (m := name.fullmatch(path.name)) and not _alive(int(m.group(1))):
                remove(path)
                removed.append(path)
    return removed


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """OUT's partial path (partial_of), the command's until the block ends (scratch): the block
    writes it and renames it to OUT once whole. Leftovers of OUT are removed first."""
    clear_leftovers(out)
    with scratch(partial_of(out)) as partial:
        yield partial


@contextlib.contextmanager
def writing(out: Path, what: str | None = None) -> Iterator[Path]:
    """staged(OUT) for a command writing OUT (named `what` in its line): a failure the disk
    caused (full, read-only) ends the command with one line, exit 1, nothing of OUT left."""
    with staged(out) as partial:
        try:
            yield partial
        except BaseException as e:  # DCP's CheckpointException is one
            stop = isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit, Stopped))
            why = None if stop else write_failure(e, partial.parent)
            if why is None:
                raise
            print(f"error: {what or out} was not written: {why}", file=sys.stderr)
            sys.exit(1)


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """A block of a `command` that a stop signal does not cut: one received in it raises
    Stopped when the block ends. For starting processes: a spawned worker whose parent stopped
    while sending it its start-up data reads half of it and prints a traceback (EOFError)."""
    global _held
    outer, _held = _held, []
    try:
        yield
    finally:
        held, _held = _held, outer
    if held:
        raise Stopped(held[0])


@contextlib.contextmanager
def scratch(path: Path) -> Iterator[Path]:
    """`path` is the command's until the block ends: removed if the block raises (a stop
    signal included) or the process dies in it; renamed away inside it, nothing is removed."""
    _tell_guard("+", path)
    try:
        yield path
    except BaseException:
        # A second stop signal does not cut the removal short (the command is ending already).
        with contextlib.suppress(Stopped), uninterrupted():
            remove(path)
        raise
    finally:
        _tell_guard("-", path)


def command(what: str):
    """A decorator of a command's `main(argv) -> status`: a stop signal (SIGINT, SIGTERM,
    SIGHUP) ends it with one line saying `what` (was not written), and the status a shell gives
    a command killed by it. The signal raises Stopped where the command is; a library may wrap
    it in an exception of its own (DCP does), so the signal received is what is recorded."""

    def wrap(main):
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> int:
            received: list[int] = []

            def raise_stopped(signum, frame):
                received.append(signum)
                if _held is not None:  # inside `uninterrupted`: at its end
                    _held.append(signum)
                    return
                raise Stopped(signum)

            previous = {s: signal.signal(s, raise_stopped) for s in STOP_SIGNALS}
            try:
                return main(argv)
            except BaseException:
                if not received:
                    raise
                name = signal.Signals(received[0]).name
                print(f"stopped by {name}: {what}", file=sys.stderr)
                return 128 + received[0]
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

        return run

    return wrap
