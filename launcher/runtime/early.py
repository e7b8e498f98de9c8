"""The agent of a local relaunch (launcher.agent), started at launcher.train's first moment.

Its imports (torch and the engine, about five CPU-seconds here) are the longest part of a local
run's start. Started before launcher.train imports, composes its config and plans (about 1.3 s
here), they run beside that on another core. The agent starts nothing until the launcher, its
checks passed, hands it its arguments (take()); a command that runs no ranks here ends it at once
(end(), and at its exit in any case): a second or so of CPU on a core the launcher did not use.

Not started where a command surely runs no ranks of its own: help and Hydra's information
options, a sweep (`-m`: each of its jobs starts its own agent), inside torchrun or a SLURM step
(the ranks are there already). The agent's command line holds the launcher's arguments (ps
tells which run it is for). Standard library only: imported before anything else.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys

AGENT = [sys.executable, "-m", "launcher.agent"]
HOLD = "--hold"  # the agent's option: its arguments come on its standard input
NO_RANKS_HERE = ("-h", "--help", "--hydra-help", "--info", "-c", "--cfg", "--shell-completion")
SWEEP = ("-m", "--multirun")
_held: list[subprocess.Popen] = []
# Set by the agent to its start (time.time()): a rank's start_s counts its imports.
STARTED_ENV = "LAUNCHER_AGENT_STARTED"


def start(argv: list[str]) -> None:
    """launcher.train's first step: the agent, importing until take() or end()."""
    if any(a in NO_RANKS_HERE or a.split("=")[0] in NO_RANKS_HERE or a in SWEEP for a in argv):
        return
    if "RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1:
        return
    hold(argv, dict(os.environ))


def hold(argv: list[str], env: dict) -> None:
    """An agent that imports, then waits for take()."""
    if not _held:
        atexit.register(end)
    _held.append(spawn([*AGENT, HOLD, "--", *argv], env, stdin=subprocess.PIPE))


def take(args: list[str], env: dict, composed: bytes) -> subprocess.Popen:
    """The held agent (or a new one), given its torchrun arguments, its environment and the
    launcher's composed config, which its ranks take rather than composing their own."""
    if not _held:
        hold(args, env)
    agent = _held.pop()
    word = {"args": args, "env": env, "composed": base64.b64encode(composed).decode()}
    with contextlib.suppress(OSError):  # one that ended (a failed import) has said why
        agent.stdin.write(json.dumps(word).encode() + b"\n")
        agent.stdin.close()
    return agent


def end() -> None:
    """End the held agent: this command starts no ranks."""
    while _held:
        _kill(_held.pop())


def _kill(agent: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(agent.pid, signal.SIGKILL)  # it has no child: it only imports, or waits
    agent.wait()


def spawn(cmd: list[str], env: dict, **popen) -> subprocess.Popen:
    """A process of the launcher's: in a session of its own (a terminal's Ctrl-C reaches the
    launcher only), ended with SIGTERM when the launcher dies."""
    return subprocess.Popen(
        cmd, env=env, start_new_session=True, preexec_fn=die_with_parent, **popen
    )


def die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the launcher process dies (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
