"""`python -m launcher.agent --hold -- LAUNCHER_ARGS`: torchrun for launcher.train's local runs,
with ranks forked from a process that has imported the engine.

torchrun starts each rank as a new Python, which imports torch and the engine again (about five
CPU-seconds each here, the largest part of a small run's start, paid again at every restart).
This is torchrun's own elastic agent (`torch.distributed.run`'s options, rendezvous, restarts and
membership changes unchanged) given a function instead of a command: it imports the engine once
and forks every rank of every attempt from itself (`start_method=fork`), so that a rank starts
with its imports done. Each rank is then what torchrun's would be: in a session of its own, no
death signal of its parent's (the rank watches its parent: failures.watch_parent), unbuffered
standard streams, launcher.train's task on the launcher's composed config, the atexit handlers
at its end.

Nothing in the agent may start a thread pool, touch a GPU or open a process group before the
forks: it only imports. launcher.train starts it at its own start (launcher.runtime.early) and,
its checks passed, writes one line on its standard input: torchrun's arguments (`--standalone
--nproc-per-node=N ... -m launcher.train OVERRIDES`), the ranks' environment and the launcher's
composed config, which the ranks take rather than composing the same config again. The end of
the input instead (the launcher starts no ranks): exit 0.
"""

from __future__ import annotations

import os
import sys
import time

from launcher.runtime.early import STARTED_ENV
from launcher.runtime.imports import uncollected

os.environ[STARTED_ENV] = repr(time.time())  # before the imports: they are the ranks' start

import atexit  # noqa: E402
import base64  # noqa: E402
import ctypes  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import multiprocessing  # noqa: E402
import shutil  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402

with uncollected():  # the ranks' objects too: frozen before the forks
    import torch
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import PContext
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch

    import launcher.train
    import launcher.training.engine  # noqa: F401  (what every rank imports, done once here)
    from launcher.cli import exit_steps, quick_exit
    from launcher.runtime import early
    from launcher.runtime.failures import hold_stops


# Whether the agent is ending its ranks (torchrun's PContext.close: the agent stopped by a
# signal, a rank failed, a regroup), shared with the forked ranks. A rank whose task has
# returned waits in torchrun's function wrapper until the agent has read every rank's return
# value, which an agent ending its ranks never does: it waits 30 s for them to exit, then
# SIGKILLs them. Set before the close's signals, cleared before each attempt's forks.
CLOSING = multiprocessing.RawValue("b", 0)


def _flagging(method, value: int):
    def flagged(self, *args, **kwargs):
        CLOSING.value = value
        return method(self, *args, **kwargs)

    return flagged


PContext.start = _flagging(PContext.start, 0)
PContext.close = _flagging(PContext.close, 1)


def leave_when_closing() -> None:
    """A returned rank's exit as soon as its agent ends the ranks (its return value unread)."""
    while not CLOSING.value:
        time.sleep(0.05)
    os._exit(0)


def rank(composed: bytes) -> None:
    """One rank, forked from the agent: launcher.train's task as a rank torchrun started would
    run it, from the launcher's `composed` config (launcher.train.rank_config)."""
    hold_stops()  # before anything else: the agent's handlers are torchrun's
    atexit._clear()  # the agent's handlers are the agent's; the rank's own run at its end
    os.setsid()  # torchrun starts each rank in a session of its own
    if sys.platform.startswith("linux"):  # torch.multiprocessing asked for SIGINT at its death
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 0)  # PR_SET_PDEATHSIG: none
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)  # python -u
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        os.environ.pop(STARTED_ENV, None)  # a restart starts at its fork, imports done
    status = 0
    try:
        launcher.train.rank_task(composed)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception:  # what Python prints of an uncaught exception, and its status
        traceback.print_exc()
        status = 1
    finally:
        exit_steps()  # what the interpreter's exit would run: a forked rank ends in os._exit
    if status:
        sys.exit(status)  # torchrun sees the rank's status, as a command's
    # Status 0 returns: torchrun's agent waits for every rank's return value, unless it is
    # ending the ranks (a stop signal, which this rank has just obeyed, or a failure).
    if CLOSING.value:
        os._exit(0)
    threading.Thread(target=leave_when_closing, name="leave-when-closing", daemon=True).start()


class OneLine(logging.Filter):
    """torchrun's agent logs a rank that failed in one line when the rank is a command, with
    the traceback of its own poll (torch.multiprocessing's ProcessExitedException) when it is a
    function: the line alone, as a command's."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = record.exc_text = None
        return True


def agent(argv: list[str], composed: bytes) -> None:
    """torchrun with `argv` (its options, then `-m launcher.train OVERRIDES`, which its own
    parser requires and `ps` shows), every rank `rank(composed)`."""
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(OneLine())
    args = torchrun.parse_args(argv)
    if args.standalone:  # what torch.distributed.run.run does before config_from_args
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = os.urandom(16).hex()
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = torchrun.config_from_args(args)
    config.start_method = "fork"
    if torch.cuda.is_initialized():  # a forked rank could not use it (CUDA is not fork-safe)
        raise RuntimeError("the agent initialised CUDA before forking its ranks")
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        elastic_launch(config=config, entrypoint=rank)(composed)
    finally:  # the temporary torchelastic_* directory torchrun makes for its logs, never removed
        logs = config.logs_specs.root_log_dir
        if args.log_dir is None and os.path.basename(logs).startswith("torchelastic_"):
            shutil.rmtree(logs, ignore_errors=True)


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] != [early.HOLD]:
        sys.exit(f"usage: python -m launcher.agent {early.HOLD} -- ARGS (launcher.train starts it)")
    line = sys.stdin.readline()  # (its imports done) what launcher.train has decided
    if not line:  # no run here: the launcher ended without starting ranks
        quick_exit(0)
    word = json.loads(line)
    os.environ.update(word["env"])
    record(agent)(word["args"], base64.b64decode(word["composed"]))
    quick_exit(0)


if __name__ == "__main__":
    main()
