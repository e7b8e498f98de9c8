"""Where the processes come from: join torchrun or SLURM, or relaunch under torchrun locally."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from launcher.cli import fail
from launcher.config import Config
from launcher.runtime import early, rendezvous
from launcher.runtime.failures import (
    EXIT_FILE,
    EXIT_STOPPED,
    STOPPED_FILE,
    no_rank_ran,
    parent_of,
    stopped_message,
    write_record,
)

# Set by relaunch() in the children, so that they do not print the plan a second time.
CHILD_ENV = "LAUNCHER_CHILD"
# parallel.auto's choice as the launcher printed it; the ranks print theirs only if it differs.
CHOICE_ENV = "LAUNCHER_CHOICE"


def slurm_env() -> None:
    """Map a SLURM task (srun without torchrun) onto torch.distributed's env:// variables."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    if int(os.environ.get("SLURM_NTASKS", "1")) < 2:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    if "MASTER_ADDR" not in os.environ:
        nodelist = os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1")
        hosts = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True
        ).stdout.split()
        os.environ["MASTER_ADDR"] = node_address(hosts[0]) if hosts else "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", str(29500 + int(os.environ.get("SLURM_JOB_ID", 0)) % 1000))


def node_address(node: str) -> str:
    """An address the other tasks can reach node `node` at: its name when that resolves, else
    the NodeAddr SLURM knows it by (node names need not be DNS names; on the test cluster
    n1 and n2 are both 127.0.0.1)."""
    try:
        socket.getaddrinfo(node, None)
        return node
    except OSError:
        pass
    line = subprocess.run(
        ["scontrol", "show", "node", node, "-o"], capture_output=True, text=True
    ).stdout
    for field in line.split():
        if field.startswith("NodeAddr="):
            return field.removeprefix("NodeAddr=")
    return node


def in_distributed_env() -> bool:
    """True inside torchrun (or another env:// launcher) or a multi-task SLURM step."""
    slurm_env()
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def actual_world() -> tuple[int, int] | None:
    """(nodes, processes per node) of the group this process runs in (torchrun, a SLURM
    step), or None outside one."""
    if not in_distributed_env():
        return None
    world = world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if not per_node:
        per_node = max(1, world // int(os.environ.get("SLURM_NNODES", "1")))
    return max(1, world // per_node), per_node


def global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_child() -> bool:
    return os.environ.get(CHILD_ENV) == "1"


def relaunch(cfg: Config, overrides: list[str], run_dir: str, composed: bytes) -> int:
    """Run this command again under torchrun with one process per device
    (cfg.hardware.devices_per_node), restarted cfg.train.max_restarts times; its status.

    This process stays in charge until every rank has exited. SIGINT, SIGTERM, SIGUSR1,
    SIGUSR2 and SIGHUP go to the ranks themselves (torchrun's children): they finish the
    step, save a checkpoint and exit 0, so that torchrun neither restarts them nor reports a
    failure, and this process exits EXIT_STOPPED. Ranks still running cfg.train.timeout_s
    later, or at a second SIGINT, are killed. torchrun runs in a session of its own (a
    terminal's Ctrl-C reaches this process only, once) and gets SIGTERM if this process dies.

    With cfg.launch.rendezvous (HOST:PORT) this is one node of cfg.hardware.nodes, each running
    this command: the agents meet in a c10d rendezvous there, elastic between launch.min_nodes
    and nodes when 0 < min_nodes < nodes (launcher.runtime.rendezvous holds the store).
    `composed` is this process's composed config (launcher.train.rank_config), which the ranks
    start from.
    """
    nodes, devices_per_node = cfg.hardware.nodes, cfg.hardware.devices_per_node
    rendezvous, stop_timeout_s = cfg.launch.rendezvous, cfg.train.timeout_s
    if nodes > 1 and not rendezvous:
        fail(
            f"hardware.nodes={nodes}: a multi-node run starts on every node under SLURM or "
            "torchrun, or with launch.rendezvous=HOST:PORT and the same command on each node; "
            "without one this launcher only uses one node (use launcher.plan to check a "
            "multi-node layout)"
        )
    env = dict(os.environ, **{CHILD_ENV: "1"})
    # One BLAS thread pool per process sharing the cores, not one per core per process.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // devices_per_node)))
    if rendezvous:
        env.update(ELASTIC_ENV)
        join = rendezvous_args(rendezvous, run_dir, nodes, cfg.launch.min_nodes, stop_timeout_s)
    else:
        join = ["--standalone"]
    args = [
        *join,
        f"--nproc-per-node={devices_per_node}",
        f"--max-restarts={cfg.train.max_restarts}",
        "-m",
        "launcher.train",
        *overrides,
        f"hydra.run.dir={hydra_quoted(run_dir)}",
        "hydra.output_subdir=null",
    ]
    for record in (STOPPED_FILE, EXIT_FILE):
        (Path(run_dir) / record).unlink(missing_ok=True)
    with contextlib.ExitStack() as stack:
        if rendezvous:
            stack.enter_context(joined(rendezvous, Path(run_dir), stop_timeout_s))
        return supervise(lambda: early.take(args, env, composed), Path(run_dir), stop_timeout_s)


# Workers of one rendezvous round connect to an address of their own round: without this a
# round after a membership change waits for an address the agents never write (MACHINE.md).
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def rendezvous_args(
    endpoint: str, run_dir: str, nodes: int, min_nodes: int, join_timeout_s: float
) -> list[str]:
    """torchrun's options for one node of a run meeting at `endpoint` (the store is
    launcher.runtime.rendezvous's: is_host=false). A node that leaves is noticed within ~3 s
    (keep-alive every 1 s, 3 missed); a round closes 5 s after the minimum has joined."""
    low = min_nodes or nodes
    conf = (
        f"is_host=false,join_timeout={join_timeout_s:g},last_call_timeout=5,"
        "keep_alive_interval=1,keep_alive_max_attempt=3"
    )
    return [
        f"--nnodes={low}:{nodes}" if low < nodes else f"--nnodes={nodes}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        # Every node of the run agrees on its directory, and so on this id.
        f"--rdzv-id=run-{hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]}",
        f"--rdzv-conf={conf}",
    ]


@contextlib.contextmanager
def joined(endpoint: str, run_dir: Path, wait_s: float):
    """The rendezvous store up (started here when its host is this machine), and this
    launcher counted among its members while the block runs."""

    try:
        rendezvous.ensure(endpoint, run_dir / "rendezvous.log", wait_s)
    except rendezvous.RendezvousProblem as e:
        fail(str(e))
    with rendezvous.member(endpoint):
        yield


def supervise(start: Callable[[], subprocess.Popen], run_dir: Path, stop_timeout_s: float) -> int:
    """Run the torchrun agent `start` starts, forwarding stop signals to the ranks; its status,
    or how the ranks said the run ended (EXIT_FILE, STOPPED_FILE)."""
    stopped, ended = run_dir / STOPPED_FILE, run_dir / EXIT_FILE
    received: list[tuple[int, float]] = []
    started: list[subprocess.Popen] = []  # torchrun, once started
    ranks_seen: list[bool] = [False]  # torchrun has started ranks (at some point)
    status = 0

    def forward(signum: int, frame) -> None:
        received.append((signum, time.monotonic()))
        if not started:
            return  # torchrun is not started: it will not be
        ranks = children(started[0].pid)
        if ranks and not (len(received) > 1 and signum == signal.SIGINT):
            ranks_seen[0] = True
            for pid in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
        else:  # the second Ctrl-C, or no rank yet: no checkpoint can be made, stop now
            kill_tree(started[0].pid)  # (torchrun itself, starting, prints a traceback)

    # Installed before torchrun starts: a stop at any instant of the hand-over is this one's.
    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        if not received:
            started.append(start())
        while started:
            proc = started[0]
            if not ranks_seen[0] and children(proc.pid):
                ranks_seen[0] = True
            if received and not ranks_seen[0]:
                kill_tree(proc.pid)  # a stop between the check above and the start
            try:
                status = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if received and time.monotonic() - received[0][1] > stop_timeout_s:
                    late = f"ranks still running {stop_timeout_s:g} s after the stop signal"
                    print(f"{late} (train.timeout_s): killing them", file=sys.stderr)
                    kill_tree(proc.pid)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if ended.exists():  # the ranks agreed on an end of their own (failures.RunEnded)
        record = json.loads(ended.read_text())
        print(record["message"], file=sys.stderr)
        return record["status"]
    if stopped.exists():
        record = json.loads(stopped.read_text())
        message = stopped_message(record["signal"], record["step"], record["checkpoint"])
        print(message, file=sys.stderr)
        return EXIT_STOPPED
    if received and not ranks_seen[0]:  # torchrun ended while it started: as if never started
        print(no_rank_ran(received[0][0]), file=sys.stderr)
        return EXIT_STOPPED
    if received and status:  # status 0: the ranks finished the run (a stop on its last step)
        # Killed before a checkpoint of this step (a second Ctrl-C, ranks past the stop's
        # timeout): a stop all the same, ended as a shell reports one, 128 + the signal.
        signum = received[0][0]
        print(
            f"stopped by {signal.Signals(signum).name} before a checkpoint of this step was "
            "complete: the same command resumes from the newest checkpoint",
            file=sys.stderr,
        )
        write_record(run_dir, STOPPED_FILE, {"signal": signum, "step": None, "checkpoint": None})
        return 128 + signum
    if status < 0:  # torchrun itself was killed; its ranks exit on their own (watch_parent)
        name = signal.Signals(-status).name
        print(f"torchrun (PID {proc.pid}) was killed by {name}: its ranks exit", file=sys.stderr)
        return 128 - status
    return status


def hydra_quoted(value: str) -> str:
    """`value` as one quoted string of Hydra's override grammar: a quote is escaped, and so
    are backslashes that precede a quote or end the string (the only ones Hydra reads)."""
    out = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, value)
    return "'" + out.replace("'", "\\'") + "'"


FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (the ranks run in sessions of their own)."""
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def process_tree() -> dict[int, list[int]]:
    """Parent pid -> child pids of every process, from /proc (empty where there is none)."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = parent_of(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def children(pid: int) -> list[int]:
    return process_tree().get(pid, [])


def descendants(pid: int) -> list[int]:
    tree = process_tree()
    out, todo = [], [pid]
    while todo:
        below = tree.get(todo.pop(), [])
        out += below
        todo += below
    return out
