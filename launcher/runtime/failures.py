"""What a run does when something goes wrong: a stop signal, a hung peer, an injected fault.

- A stop signal (SIGTERM, SIGINT, or SIGUSR1 / SIGUSR2, which SLURM sends with `--signal`
  before a time limit or a preemption; submitit asks for USR2) only sets a flag; every rank
  finishes its current step, the ranks agree that one of them was signalled, save a
  checkpoint together and exit with EXIT_STOPPED. A second SIGINT stops at once.
- A step whose loss or gradient norm is not finite is not applied; past
  `train.max_skipped_steps` such steps in a row the run stops with EXIT_NONFINITE.
- Every collective gives up after `train.timeout_s`; the error names the rank and what it was
  doing (`timed`).
- LAUNCHER_FAULT_INJECT="RANK:STEP[:KIND]" makes one rank fail at one step, on the first
  attempt only (a torchrun restart runs clean): KIND raise (default), kill (SIGKILL itself),
  hang (sleep forever), nan (a NaN in that rank's gradients after its backward), stop
  (SIGTERM to itself and to the `python -m launcher.train` above it, as a user's kill that
  lands in that step: the docs' examples stop at a step they can name). Tests use it; users
  never need it. (A kill inside a save: tests/checkpoint/save_window.py.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

# EX_TEMPFAIL (sysexits.h): stopped by a signal after saving a checkpoint of the current
# step; running the same command again resumes from it. A scheduler can requeue on it.
EXIT_STOPPED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
FAULT_ENV = "LAUNCHER_FAULT_INJECT"
# Written into the run directory by global rank 0 once the stop checkpoint is complete.
STOPPED_FILE = "stopped.json"
# A step's loss or gradient norm was not finite more than train.max_skipped_steps times in a
# row: the step was not applied, nothing was saved after it, and the run stopped. Its newest
# checkpoint holds finite training; running the same command again repeats the same steps.
EXIT_NONFINITE = 3
# Written into the run directory by global rank 0 when the ranks agree to end the run with a
# status of their own (RunEnded), for the launcher process to report: under torchrun the ranks
# exit 0, so that it neither restarts them into the same end nor reports a crash.
EXIT_FILE = "exit.json"
# Room for one of those records, taken by global rank 0 at start while the disk has room: a
# disk that fills during the run still lets the launcher hear how it ended (write_record).
RESERVED = ".record.reserved"
RECORD_BYTES = 16 << 10


def reserve_record(run_dir: str | Path) -> None:
    with contextlib.suppress(OSError):
        Path(run_dir, RESERVED).write_bytes(b" " * RECORD_BYTES)


def write_record(run_dir: str | Path, name: str, record: dict) -> None:
    """`record` as RUN_DIR/NAME (JSON), written over the reserved room when there is one (its
    blocks are allocated already: a full disk does not refuse it), then renamed."""
    text = (json.dumps(record) + "\n").encode()
    reserved = Path(run_dir, RESERVED)
    if reserved.is_file() and len(text) <= RECORD_BYTES:
        with open(reserved, "r+b") as f:
            f.write(text + b" " * (RECORD_BYTES - len(text)))  # trailing blanks: still JSON
        os.replace(reserved, Path(run_dir, name))
    else:
        Path(run_dir, name).write_bytes(text)


class RunEnded(Exception):
    """Every rank agreed to end the run: exit `status`, rank 0 says `message`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class NonFinite(RunEnded):
    """Training stopped at a step whose loss or gradient norm was not finite (or, checked
    before a save, whose parameters were not)."""

    def __init__(self, step: int, what: str, skipped: int, allowed: int, checkpoint: str | None):
        self.step, self.what, self.checkpoint = step, what, checkpoint
        self.skipped, self.allowed = skipped, allowed
        super().__init__(EXIT_NONFINITE, nonfinite_message(self.record()))

    def record(self) -> dict:
        return {
            "step": self.step,
            "what": self.what,
            "skipped": self.skipped,
            "allowed": self.allowed,
            "checkpoint": self.checkpoint,
        }


def ended(e: RunEnded, run_dir: str, report: bool) -> bool:
    """On global rank 0: record the end for the launcher process (EXIT_FILE), or say it.
    False: the record could not be written (a full disk), so it was said here instead."""
    if not report:
        try:
            write_record(run_dir, EXIT_FILE, {"status": e.status, "message": e.message})
            return True
        except OSError:
            Path(run_dir, EXIT_FILE).unlink(missing_ok=True)
    print(e.message, file=sys.stderr, flush=True)
    return report


def nonfinite_message(record: dict) -> str:
    """What the launcher says when a run stopped on a non-finite step."""
    where = (
        f"the newest checkpoint, {record['checkpoint']}, holds finite training"
        if record["checkpoint"]
        else "no checkpoint was saved before it"
    )
    row = (
        f"{record['skipped']} such steps in a row, train.max_skipped_steps={record['allowed']}; "
        if record["skipped"]
        else ""
    )
    return (
        f"stopped at step {record['step']}: {record['what']} is not finite; the step was not "
        f"applied and nothing after it was saved ({row}{where}). Running the same command again "
        "repeats the same steps: lower train.lr, raise train.warmup_steps or "
        f"train.max_skipped_steps, or check the data (exit status {EXIT_NONFINITE})"
    )


# Stop signals received before StopRequest took over (hold_stops).
HELD: list[int] = []


def hold_stops() -> None:
    """From a command's first moment until StopRequest takes over: a stop signal is remembered
    rather than fatal (Python's default ends the process with -15 and no word, in the seconds
    torch takes to import), so that one during start-up ends like any stop."""
    for s in STOP_SIGNALS:
        signal.signal(s, _hold)


def _hold(signum: int, frame) -> None:
    if HELD and signum == signal.SIGINT:
        raise KeyboardInterrupt  # a second Ctrl-C: stop now
    HELD.append(signum)


def no_rank_ran(signum: int) -> str:
    """The line of a run stopped before any rank started (it ends with EXIT_STOPPED)."""
    return (
        f"stopped by {signal.Signals(signum).name} before the run started: no rank ran; "
        f"the same command starts it (exit status {EXIT_STOPPED})"
    )


def stop_before_start() -> None:
    """In a launcher that has started no rank yet (its rendezvous, torchrun's start): a stop
    signal, held or to come, ends it at once with its line and EXIT_STOPPED."""

    def end(signum: int, frame=None) -> None:
        print(no_rank_ran(signum), file=sys.stderr, flush=True)
        sys.exit(EXIT_STOPPED)

    if HELD:
        end(HELD[0])
    for s in STOP_SIGNALS:
        signal.signal(s, end)


class StopRequest:
    """Remembers the first stop signal; `agreed()` tells every rank whether any rank got one.

    A stop (the current step and its checkpoint) has `deadline_s` (train.timeout_s): a rank
    still running that long after its first stop signal is stuck (a hung peer, a hang of its
    own) and exits by itself, saying so, rather than waiting for torchrun's SIGKILL 30 s after
    its SIGTERM, or for ever under a launcher that sends none."""

    def __init__(self, deadline_s: float | None = None) -> None:
        self.signum = 0
        self.deadline_s = deadline_s
        for s in STOP_SIGNALS:  # for the rest of the process's life
            signal.signal(s, self._handle)
        if HELD:  # one came during start-up
            self._handle(HELD[0], None)

    def _handle(self, signum: int, frame) -> None:
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without a checkpoint
        if not self.signum and self.deadline_s:
            watchdog = threading.Timer(self.deadline_s, self._overdue, (signum,))
            watchdog.daemon = True  # a rank that stops in time exits without waiting for it
            watchdog.start()
        self.signum = self.signum or signum

    def _overdue(self, signum: int) -> None:
        rank = os.environ.get("RANK", "0")
        name = signal.Signals(signum).name
        print(
            f"rank {rank}: still running {self.deadline_s:g} s after {name} "
            "(train.timeout_s): exiting without finishing its step or checkpoint",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    def agreed(self, failed: bool = False) -> tuple[int, bool]:
        """The largest signal number any rank received (0: none), and whether any rank says
        `failed` (a run file it could not write); a collective."""
        import torch
        import torch.distributed as dist

        flags = torch.tensor([self.signum, int(failed)], dtype=torch.int64)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return int(flags[0].item()), bool(flags[1].item())


def stopped_message(signum: int, step: int, checkpoint: str) -> str:
    """What the launcher says when a run stopped on a signal and saved."""
    return (
        f"stopped by {signal.Signals(signum).name} after step {step}: checkpoint {checkpoint} "
        f"is complete; the same command resumes from it (exit status {EXIT_STOPPED})"
    )


# What a rank does before it exits because its launcher is gone (watch_parent): the metrics
# logger finishes its wandb run here, so that the steps it has logged are not lost with it.
ON_ORPHANED: list = []
ORPHANED_WAIT_S = 30.0


def watch_parent(period_s: float = 1.0) -> None:
    """Exit this rank when the process that started it (torchrun, srun's step) is gone: a
    SIGKILLed torchrun cannot stop its ranks, and they would go on training under PID 1,
    writing checkpoints nobody waits for. A daemon thread polls the parent PID; before the
    exit it runs ON_ORPHANED (each given ORPHANED_WAIT_S at most)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        rank = os.environ.get("RANK", "0")
        print(f"rank {rank}: its launcher (PID {parent}) is gone: exiting", file=sys.stderr)
        for last_words in list(ON_ORPHANED):
            done = threading.Thread(target=last_words, daemon=True)
            done.start()
            done.join(ORPHANED_WAIT_S)
        os._exit(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


class NoStops:
    """The trainer's stop check with no signal handlers: for work that is never resumed (the
    self-test's rows, the tests' jobs), which a signal simply ends."""

    signum = 0

    def agreed(self, failed: bool = False) -> tuple[int, bool]:
        return 0, failed


class CollectiveTimeout(RuntimeError):
    pass


# What gloo says when a peer's process is gone (its node left, it was killed).
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def peer_gone(e: BaseException) -> str | None:
    """The line to print for a collective that failed because a peer process is gone (the
    failure itself is in that peer's log), or None for any other error."""
    text = str(e)
    if not isinstance(e, RuntimeError) or not any(p in text for p in PEER_GONE):
        return None
    rank = os.environ.get("RANK", "0")
    detail = text.split("] ", 1)[-1].split(". ", 1)[0]
    return (
        f"rank {rank}: a peer process is gone ({detail}); torchrun restarts the group while "
        "train.max_restarts allows, and the run resumes from its newest complete checkpoint"
    )


@contextmanager
def timed(what: str, rank: int, timeout_s: float):
    """Name the rank and the operation when a collective inside gives up waiting."""
    try:
        yield
    except RuntimeError as e:  # torch.distributed.DistError is one
        text = str(e).lower()
        if "timed out" in text or "timeout" in text:
            raise CollectiveTimeout(
                f"rank {rank}: {what} waited longer than train.timeout_s={timeout_s:g} s for "
                f"its peers (one of them is hung, stopped or gone): {str(e)[:300]}"
            ) from e
        raise


def restart_attempt() -> int:
    """0 on a first start, n on torchrun's n-th restart of the ranks."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def restarts_left() -> int:
    """How many more times torchrun restarts the ranks after a failure (0 outside it)."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - restart_attempt()


def resume_mode(configured: str) -> str:
    """checkpoint.resume for this start: a restart always resumes its own run (never means
    "do not continue an earlier run", not "lose the steps before a crash")."""
    return "auto" if restart_attempt() > 0 else configured


def fault(rank: int, step: int) -> str | None:
    """The kind of fault injected at this rank and step on this attempt, if any."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or restart_attempt() != 0:
        return None
    at_rank, at_step, *kind = spec.split(":")
    if (at_rank, at_step) != (str(rank), str(step)):
        return None
    return kind[0] if kind else "raise"


def parent_of(pid: int) -> int:
    """The parent process of `pid`, from /proc (OSError when it is gone)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def inject(rank: int, step: int) -> None:
    """Fail here if LAUNCHER_FAULT_INJECT says so (before the step's work)."""
    kind = fault(rank, step)
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step} ({FAULT_ENV})")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "stop":
        launcher = os.getpid()
        if os.environ.get("LAUNCHER_CHILD") == "1":  # under the torchrun the launcher started
            launcher = parent_of(os.getppid())
            os.kill(launcher, signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
    if kind == "hang":
        while True:
            time.sleep(60)
