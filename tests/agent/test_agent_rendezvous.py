"""F3 of the hostile-input issue: the NCCL-mode rendezvous store on the trainer agent's transport port.

It was torch's TCPStore: anyone who reached port 47102 could read, write and delete the keys every process
group of the job rendezvouses through, and fill its memory. Now it is agent/transports/rendezvous.py: the link
protocol with the job token. Here: real gloo process groups rendezvous through it (two ranks, PrefixStore
as the agents use it); a client without the token, a client with a wrong token and torch's own TCPStore
client get nothing in and nothing out; the limits hold."""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from weightsync.agent.transports import rendezvous
from weightsync.agent.transports.rendezvous import LinkStore, StoreError, StoreServer
from weightsync.agent.wire import link

HOST = "127.0.0.1"
TOKEN = b"job-token-for-tests"


@pytest.fixture
def server() -> Iterator[StoreServer]:
    s = StoreServer(HOST, 0, TOKEN, timeout=20)
    yield s
    s.close()


def test_gloo_groups_rendezvous_through_the_authenticated_store(server: StoreServer) -> None:
    got: dict[int, list[float]] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            base = LinkStore(HOST, server.port, TOKEN, timeout=20)
            ps = dist.PrefixStore("job/replica-0/g1/e1/", base)
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = datetime.timedelta(seconds=20)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
            pg = dist.ProcessGroupGloo(ps, r, 2, opts)
            t = torch.arange(8, dtype=torch.float32) * 3 if r == 0 else torch.zeros(8)
            pg.broadcast([t]).wait()
            got[r] = t.tolist()
            base.close()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    assert got[0] == got[1] == [float(3 * i) for i in range(8)]
    assert any(k.startswith("job/replica-0/g1/e1/") for k in server.table.data)


def test_store_operations(server: StoreServer) -> None:
    s = LinkStore(HOST, server.port, TOKEN, timeout=5)
    s.set("a", b"1")
    assert s.get("a") == b"1" and s.check(["a"]) and not s.check(["a", "b"])
    assert s.add("n", 2) == 2 and s.add("n", 3) == 5
    assert s.compare_set("c", b"", b"x") == b"x" and s.compare_set("c", b"nope", b"y") == b"x"
    assert s.num_keys() == 3 and s.delete_key("a") and not s.delete_key("a")
    threading.Timer(0.3, lambda: LinkStore(HOST, server.port, TOKEN).set("late", b"v")).start()
    s.wait(["late"], datetime.timedelta(seconds=5))
    assert s.get("late") == b"v"
    with pytest.raises(StoreError, match="timed out"):
        s.wait(["never"], datetime.timedelta(seconds=0.3))
    s.close()


def test_a_client_without_the_token_can_neither_read_nor_write(server: StoreServer) -> None:
    LinkStore(HOST, server.port, TOKEN).set("secret/unique-id", b"nccl-id")
    before = dict(server.table.data)
    # 1. raw TCP: torch's TCPStore wire bytes, then garbage; the server answers nothing and hangs up
    with socket.create_connection((HOST, server.port), timeout=10) as raw:
        raw.sendall(b"\x00" * 64 + b"secret/unique-id" + b"\xff" * 64)
        raw.settimeout(10)
        reply = b""
        try:
            while chunk := raw.recv(4096):
                reply += chunk
        except OSError:
            pass
        assert b"nccl-id" not in reply
    # 2. the agent protocol with a wrong token
    with pytest.raises(link.LinkError):
        link.connect(HOST, server.port, b"not-the-job-token", timeout=5)
    with pytest.raises(StoreError):
        LinkStore(HOST, server.port, b"not-the-job-token", timeout=1).set("secret/unique-id", b"forged")
    # 3. torch's own TCPStore client
    with pytest.raises(Exception):  # noqa: B017  (torch raises RuntimeError / DistStoreError by version)
        c = dist.TCPStore(HOST, server.port, None, False, timeout=datetime.timedelta(seconds=3),
                          wait_for_workers=False)
        c.set("secret/unique-id", b"forged")
        c.get("secret/unique-id")
    assert server.table.data == before, "an unauthenticated client changed the store"


def test_limits(server: StoreServer, monkeypatch: pytest.MonkeyPatch) -> None:
    s = LinkStore(HOST, server.port, TOKEN, timeout=5)
    with pytest.raises(StoreError, match="at most 1024 bytes"):
        s.set("k" * 2000, b"v")
    monkeypatch.setattr(rendezvous, "MAX_KEYS", 2)
    s.set("one", b"1")
    s.set("two", b"2")
    s.set("two", b"22")  # an overwrite is not a new key
    with pytest.raises(StoreError, match="store full: 2 keys"):
        s.set("three", b"3")
    monkeypatch.setattr(rendezvous, "MAX_BYTES", 10)
    with pytest.raises(StoreError, match="bytes of values"):
        s.set("one", b"x" * 20)


def test_close_wakes_a_wait_in_flight_at_once_and_no_request_follows(server: StoreServer) -> None:
    """An agent closing on SIGTERM while a group's rendezvous waits for a peer that is gone: close() must not
    queue behind that wait (it held the request lock for up to the store's timeout, so the agent outlived its
    grace period and was killed). The wait fails at once; later requests fail without reconnecting."""
    s = LinkStore(HOST, server.port, TOKEN, timeout=120)
    outcome: list[BaseException | None] = []

    def waiter() -> None:
        try:
            s.wait(["never-set"])
            outcome.append(None)
        except BaseException as exc:  # the assertion below looks at it
            outcome.append(exc)

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.5)  # the wait is in flight on the server
    t0 = time.monotonic()
    s.close()
    assert time.monotonic() - t0 < 1.0
    th.join(5)
    assert not th.is_alive() and time.monotonic() - t0 < 2.0, "the wait outlived close()"
    assert isinstance(outcome[0], StoreError), outcome
    with pytest.raises(StoreError, match="closed"):
        s.set("k", b"v")
    assert "k" not in server.table.data
