"""The rendezvous store of a run on several nodes without SLURM (`launch.rendezvous=HOST:PORT`).

torchrun's c10d rendezvous keeps its state in a TCPStore, by default hosted by the first agent:
when that agent dies, the others lose the rendezvous and end with it (a
`RendezvousConnectionError`: docs/elastic.md). Here the store lives in a process of its own on
HOST, started by the first launcher there that finds nothing listening (a second one started at
the same time fails to bind and exits); the agents join it with `is_host=false`. Each launcher
counts itself in while its torchrun runs and beats a heart; the store exits once the last one
has counted itself out, or when no heart has beaten for LOST_S seconds (every launcher killed).

    python -m launcher.runtime.rendezvous HOST PORT      (what a launcher starts; not for users)
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

HEARTBEAT_S = 2.0
LOST_S = 60.0
PROBE_START_S = 15.0  # what the probe's interpreter may take to import torch.distributed
MEMBERS, BEATS = "launcher/members", "launcher/beats"


class RendezvousProblem(Exception):
    """No store at the rendezvous address, in words."""


def split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def listening(host: str, port: int, timeout: float = 1.0) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
        return True
    return False


def resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return True


def answers(host: str, port: int, wait_s: float = 10.0) -> bool:
    """Whether what listens at HOST:PORT answers as a store. torch's TCPStore client waits
    forever on a listener that never answers (another program holding the port), and retries
    one that answers something else with a stack trace per try, so it is asked in a process of
    its own, quietly, under a deadline."""
    probe = (
        "import datetime, torch.distributed as d; "
        f"d.TCPStore({host!r}, {port}, is_master=False, "
        f"timeout=datetime.timedelta(seconds={wait_s}))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, timeout=wait_s + PROBE_START_S
        )
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def is_local(host: str) -> bool:
    """Whether `host` names this machine: one of its addresses can be bound here."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        with contextlib.suppress(OSError), socket.socket(family, kind, proto) as s:
            s.bind((address[0], 0))
            return True
    return False


def last_line(log: Path) -> str:
    lines = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    return lines[-1] if lines else "it said nothing"


def ensure(endpoint: str, log: Path, wait_s: float) -> None:
    """Return once a store listens at `endpoint`, starting it when HOST is this machine; a host
    that does not resolve, or a listener that is not a store, ends it at once."""
    host, port = split(endpoint)
    if not resolves(host):
        raise RendezvousProblem(
            f"launch.rendezvous={endpoint}: no such host {host} (it does not resolve): check "
            "the address"
        )
    begun, store, said = time.monotonic(), None, False
    while not listening(host, port):
        if not said and time.monotonic() - begun > 5:
            print(
                f"waiting for the rendezvous store at {endpoint} (the launcher on {host} "
                f"starts it; giving up after {wait_s:g} s, train.timeout_s)",
                flush=True,
            )
            said = True
        if store is None and is_local(host):
            with open(log, "ab") as out:
                store = subprocess.Popen(
                    [sys.executable, "-m", "launcher.runtime.rendezvous", host, str(port)],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # neither a Ctrl-C nor this launcher's end stops it
                )
        elif store is not None and store.poll() is not None and not listening(host, port):
            # The store started here ended without listening: another launcher's won the
            # port only if something listens there now; else the port or address failed.
            raise RendezvousProblem(
                f"launch.rendezvous={endpoint}: the store could not start on this machine: "
                f"{last_line(log)} (the whole log: {log})"
            )
        if time.monotonic() - begun > wait_s:
            raise RendezvousProblem(
                f"nothing listens at launch.rendezvous={endpoint} after {wait_s:g} s: start the "
                f"launcher on {host} too (it starts the store there), or check the address"
            )
        time.sleep(0.2)
    if not answers(host, port):
        raise RendezvousProblem(
            f"launch.rendezvous={endpoint}: a program listens there that is not a rendezvous "
            f"store (another program holds port {port} on {host}): choose a free port"
        )


@contextlib.contextmanager
def member(endpoint: str):
    """This launcher counted in the store's members while the block runs, its heart beating."""
    import torch.distributed as dist

    host, port = split(endpoint)
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
    store.add(MEMBERS, 1)
    done = threading.Event()

    def beat() -> None:
        while not done.wait(HEARTBEAT_S):
            with contextlib.suppress(Exception):  # the store may be gone at the very end
                store.add(BEATS, 1)

    thread = threading.Thread(target=beat, name="rendezvous-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        with contextlib.suppress(Exception):
            store.add(MEMBERS, -1)


def serve(host: str, port: int) -> None:
    """Hold the store until its members have all left, or their hearts stopped."""
    import torch.distributed as dist

    try:
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False)
    except Exception as e:  # the port taken (by another launcher's store, or not), the address
        why = " ".join(str(e).split())
        print(f"rendezvous store on {host}:{port} not started: {why}", flush=True)
        return
    print(f"rendezvous store listening on port {port}", flush=True)
    joined, beats, heard = False, -1, time.monotonic()
    while True:
        time.sleep(1)
        members, now_beats = store.add(MEMBERS, 0), store.add(BEATS, 0)
        if now_beats != beats:
            beats, heard = now_beats, time.monotonic()
        joined |= members > 0
        if joined and members <= 0:
            print("rendezvous store: every launcher has left; exiting", flush=True)
            return
        if time.monotonic() - heard > LOST_S:
            print(f"rendezvous store: no launcher heard for {LOST_S:g} s; exiting", flush=True)
            return


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
