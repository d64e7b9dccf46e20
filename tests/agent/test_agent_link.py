"""The agent<->agent control channel: real TCP sockets, HMAC handshake, hostile peers."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from weightsync.agent.wire.link import (
    AuthError,
    FrameError,
    Link,
    LinkListener,
    LinkTimeout,
    Mailbox,
    PeerClosed,
    RemoteAbort,
    connect,
)

TOKEN = "job-token-abc"


@pytest.fixture
def listener():
    with LinkListener("127.0.0.1", 0, TOKEN, handshake_timeout=1.0) as lst:
        yield lst


def pair(listener: LinkListener) -> tuple[Link, Link]:
    client = connect("127.0.0.1", listener.port, TOKEN)
    return client, listener.accept(timeout=5)


def test_roundtrip_headers_and_payloads(listener: LinkListener) -> None:
    c, s = pair(listener)
    c.send({"kind": "hello", "n": 1}, b"\x00\x01payload")
    h, p = s.recv(timeout=5)
    assert h == {"kind": "hello", "n": 1} and bytes(p) == b"\x00\x01payload"
    big = bytes(range(256)) * 4096  # 1 MiB, sent in pieces
    s.send({"kind": "big"}, memoryview(big))
    h, p = c.recv(timeout=5)
    assert h["kind"] == "big" and bytes(p) == big
    with pytest.raises(LinkTimeout):
        c.recv(timeout=0.05)
    c.send({"kind": "still-usable"})  # a timeout leaves the link usable
    assert s.recv(timeout=5)[0]["kind"] == "still-usable"


def test_wrong_token_is_refused_both_ways(listener: LinkListener) -> None:
    with pytest.raises(AuthError, match="rejected our job token"):
        connect("127.0.0.1", listener.port, "wrong-token")
    # a listener with another token cannot impersonate the job either
    with LinkListener("127.0.0.1", 0, "other-token") as impostor, pytest.raises(AuthError):
        connect("127.0.0.1", impostor.port, TOKEN)
    # the listener survived and still serves good peers
    c, s = pair(listener)
    c.send({"kind": "ok"})
    assert s.recv(timeout=5)[0]["kind"] == "ok"
    assert listener.rejected >= 1


def test_listener_survives_garbage_silence_and_floods(listener: LinkListener) -> None:
    for junk in (b"", b"GET / HTTP/1.1\r\n\r\n", b"WSH1" + b"\x00" * 64, b"\xff" * 10000):
        with socket.create_connection(("127.0.0.1", listener.port)) as raw:
            raw.sendall(junk)
    silent = socket.create_connection(("127.0.0.1", listener.port))  # never speaks: times out
    c, s = pair(listener)  # handshakes run concurrently: the silent client does not block us
    c.send({"kind": "ok"})
    assert s.recv(timeout=5)[0]["kind"] == "ok"
    time.sleep(1.5)
    silent.close()
    deadline = time.monotonic() + 5
    while listener.rejected < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert listener.rejected >= 5


def _raw_frame(link: Link, header: bytes, payload: bytes, seq: int, key: bytes | None = None) -> bytes:
    import hashlib
    import hmac

    prefix = struct.pack("!4sBBHIQQ", b"WSL1", 1, 0, 0, len(header), len(payload), seq)
    mac = hmac.new(key if key is not None else link._send_key, prefix + header + payload, hashlib.sha256).digest()
    return prefix + header + payload + mac


def test_tampered_frame_is_rejected_and_closes_the_link(listener: LinkListener) -> None:
    c, s = pair(listener)
    frame = bytearray(_raw_frame(c, b'{"kind":"x"}', b"data", 0))
    frame[-40] ^= 1  # flip a payload bit
    c._sock.sendall(bytes(frame))
    with pytest.raises(AuthError, match="MAC"):
        s.recv(timeout=5)
    assert s.closed


def test_replayed_frame_is_rejected(listener: LinkListener) -> None:
    c, s = pair(listener)
    frame = _raw_frame(c, b'{"kind":"x"}', b"", 0)
    c._sock.sendall(frame + frame)  # the same authenticated frame twice
    assert s.recv(timeout=5)[0]["kind"] == "x"
    with pytest.raises(FrameError, match="sequence"):
        s.recv(timeout=5)


def test_truncated_frame_is_a_clear_error(listener: LinkListener) -> None:
    c, s = pair(listener)
    frame = _raw_frame(c, b'{"kind":"x"}', b"y" * 1000, 0)
    c._sock.sendall(frame[:200])
    c._sock.shutdown(socket.SHUT_WR)
    with pytest.raises(FrameError, match="truncated frame"):
        s.recv(timeout=5)


def test_oversized_and_malformed_frames(listener: LinkListener) -> None:
    c, s = pair(listener)
    s.max_payload = 1024
    c._sock.sendall(struct.pack("!4sBBHIQQ", b"WSL1", 1, 0, 0, 10, 1 << 40, 0))
    with pytest.raises(FrameError, match="exceeds the limit"):
        s.recv(timeout=5)
    c2, s2 = pair(listener)
    c2._sock.sendall(b"HTTP" + b"\x00" * 24)
    with pytest.raises(FrameError, match="magic"):
        s2.recv(timeout=5)
    c3, s3 = pair(listener)
    c3._sock.sendall(_raw_frame(c3, b"[1,2]", b"", 0))  # authentic but not a JSON object
    with pytest.raises(FrameError, match="not a JSON object"):
        s3.recv(timeout=5)
    with pytest.raises(FrameError, match="exceeds the link's limit"):
        c3.send({"kind": "x"}, b"z" * (c3.max_payload + 1))


def test_an_idle_link_outlives_the_io_timeout() -> None:
    with LinkListener("127.0.0.1", 0, TOKEN, io_timeout=0.2) as lst:
        c = connect("127.0.0.1", lst.port, TOKEN, io_timeout=0.2)
        s = lst.accept(timeout=5)
        mb = Mailbox(s)
        time.sleep(0.6)  # idle for 3x the I/O timeout: the reader keeps waiting, the link stays open
        c.send({"kind": "late"})
        assert mb.get("late", timeout=5)[0]["kind"] == "late"


def test_peer_closed(listener: LinkListener) -> None:
    c, s = pair(listener)
    c.close()
    with pytest.raises(PeerClosed):
        s.recv(timeout=5)


def test_mailbox_demultiplexes_and_propagates_aborts(listener: LinkListener) -> None:
    c, s = pair(listener)
    mb = Mailbox(s)
    c.send({"kind": "b", "index": 2})
    c.send({"kind": "a"})
    c.send({"kind": "b", "index": 1})
    assert mb.get("b", timeout=5, match={"index": 1})[0]["index"] == 1
    assert mb.get("a", timeout=5)[0]["kind"] == "a"
    assert mb.get("b", timeout=5)[0]["index"] == 2
    with pytest.raises(LinkTimeout):
        mb.get("a", timeout=0.05)
    got: list[BaseException] = []

    def wait_for_never() -> None:
        try:
            mb.get("never", timeout=5)
        except RemoteAbort as exc:
            got.append(exc)

    t = threading.Thread(target=wait_for_never)
    t.start()
    Mailbox(c).abort("engine refused the bucket")
    t.join(5)
    assert got and "engine refused the bucket" in str(got[0])
    c2, s2 = pair(listener)
    mb2 = Mailbox(s2)
    c2.send({"kind": "done"})
    c2.close()
    assert mb2.get("done", timeout=5)[0]["kind"] == "done"  # queued frames survive the close
    with pytest.raises(PeerClosed):
        mb2.get("more", timeout=5)
