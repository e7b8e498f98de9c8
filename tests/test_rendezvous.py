"""The rendezvous store of a run on several nodes (launcher/runtime/rendezvous.py): started on
its host by the first launcher there, held while launchers are members, gone after the last
leaves."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from launcher.runtime import rendezvous

NOT_HERE = "192.0.2.1"  # TEST-NET-1: no machine has it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_only_this_machines_addresses_are_local():
    assert rendezvous.is_local("127.0.0.1") and rendezvous.is_local("localhost")
    assert not rendezvous.is_local(NOT_HERE)
    assert not rendezvous.is_local("no-such-host.invalid")


def test_no_store_on_another_host_is_refused_after_the_wait(tmp_path):
    endpoint = f"{NOT_HERE}:{free_port()}"
    with pytest.raises(rendezvous.RendezvousProblem, match=f"launch.rendezvous={endpoint}"):
        rendezvous.ensure(endpoint, tmp_path / "rendezvous.log", wait_s=1)
    assert not (tmp_path / "rendezvous.log").exists()  # nothing was started here


def test_store_started_here_is_shared_and_leaves_with_the_last_member(tmp_path):
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    log = tmp_path / "rendezvous.log"
    rendezvous.ensure(endpoint, log, wait_s=60)
    rendezvous.ensure(endpoint, log, wait_s=60)  # a second launcher finds it: no second store
    assert rendezvous.listening("127.0.0.1", port)
    with rendezvous.member(endpoint), rendezvous.member(endpoint):
        time.sleep(2 * rendezvous.HEARTBEAT_S)
        assert rendezvous.listening("127.0.0.1", port)  # members keep it
    deadline = time.monotonic() + 15
    while rendezvous.listening("127.0.0.1", port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not rendezvous.listening("127.0.0.1", port), log.read_text()
    assert "every launcher has left" in log.read_text()


def test_a_store_that_cannot_start_here_says_why_at_once(tmp_path):
    """A port held by a program that does not listen (bound only): the store started here
    cannot bind it; the launcher says so with the store's reason, not after the whole wait as
    if the store were to come from another machine."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{held.getsockname()[1]}"
        begun = time.monotonic()
        with pytest.raises(rendezvous.RendezvousProblem) as problem:
            rendezvous.ensure(endpoint, tmp_path / "rendezvous.log", wait_s=120)
    assert time.monotonic() - begun < 60
    said = str(problem.value)
    assert said.startswith(f"launch.rendezvous={endpoint}: the store could not start on this")
    assert "address already in use" in said.lower() and str(tmp_path / "rendezvous.log") in said


def test_a_host_that_does_not_resolve_is_refused_at_once(tmp_path):
    begun = time.monotonic()
    with pytest.raises(rendezvous.RendezvousProblem, match="no such host no-such-host.invalid"):
        rendezvous.ensure("no-such-host.invalid:29500", tmp_path / "rendezvous.log", wait_s=60)
    assert time.monotonic() - begun < 30


@pytest.mark.parametrize("reply", [None, b"HTTP/1.0 400 Bad Request\r\n\r\n"])
def test_a_port_another_program_holds_is_refused_not_waited_on(tmp_path, reply, monkeypatch):
    """A listener that never answers (torch's client would wait on it forever) or answers
    something else is not taken for the store."""
    monkeypatch.setattr(rendezvous, "PROBE_START_S", 5.0)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        held = []  # the connections, open until the end

        def serve() -> None:
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                held.append(conn)
                if reply:
                    conn.recv(64)
                    conn.sendall(reply)

        threading.Thread(target=serve, daemon=True).start()
        begun = time.monotonic()
        assert not rendezvous.answers("127.0.0.1", port, wait_s=1)
        assert time.monotonic() - begun < 10
