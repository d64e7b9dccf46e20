"""The Unix socket protocol between an app process (trainer or inference engine) and its pod's agent.

Why a socket and not shared state: the app and the agent are separate containers sharing only an emptyDir
(`contract.SOCKET_DIR`). The socket carries small JSON headers; tensor bytes never travel through it, they
go through staging segments (agent/staging/segments.py) named in the headers.

Frame: `!IQ` (header length, payload length), then the UTF-8 JSON header, then the payload bytes.
Every request gets exactly one reply: `{"op": "ok", ...}` or `{"op": "error", "message": ...}`.

Ops, app -> agent (trainer side):
  hello   {kind: "trainer"|"inference", rank, pid}                    -> ok {pod, role, job}
  stage   {version, rank, nbytes, device}                             -> ok {segment: <handle>}
  publish {version, rank, segment: <name>, tensors: [TensorMeta...]}  -> ok {version}
  served                                                              -> ok {replicas, pods, served_version}
  wait_served {version, timeout, only_serving?}                 -> ok {version, reached, replicas, pods, served_version}
      replicas: [{replica, served}], pods: {pod: version}, both from the inference agents' ws.served reports
      (agent/wire/protocol.py); wait_served answers once every inference replica serves >= version (only_serving:
      every replica that serves something, at least one), or with reached=false after `timeout` s
Ops, agent -> app (inference side, the agent drives; the app answers):
  pause / resume / begin {version} / bucket {version, segment, tensors} / commit {version} /
  abort {version, reason} / served                                     -> ok {version?}
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_PREFIX = struct.Struct("!IQ")
MAX_HEADER = 256 << 20  # metadata of very many tiny tensors still fits
MAX_PAYLOAD = 1 << 30

Header = dict[str, Any]


class LocalProtocolError(RuntimeError):
    """The peer on the local socket sent something that is not a valid frame, or replied with an error."""


class PeerAnswer(LocalProtocolError):
    """The peer answered the request with an error (e.g. a version that does not increase): a reply, so
    the connection is fine and asking again would get the same answer."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"local peer closed the socket ({got} of {n} bytes received)")
        got += k
    return bytes(buf)


def send_frame(sock: socket.socket, header: Header, payload: bytes = b"") -> None:
    data = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_PREFIX.pack(len(data), len(payload)) + data + payload)


def recv_frame(sock: socket.socket) -> tuple[Header, bytes]:
    hlen, plen = _PREFIX.unpack(_recv_exact(sock, _PREFIX.size))
    if hlen > MAX_HEADER or plen > MAX_PAYLOAD:
        raise LocalProtocolError(f"frame too large (header {hlen} B, payload {plen} B)")
    try:
        header = json.loads(_recv_exact(sock, hlen))
    except ValueError as exc:
        raise LocalProtocolError(f"frame header is not JSON: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise LocalProtocolError("frame header must be a JSON object with a string 'op'")
    payload = _recv_exact(sock, plen) if plen else b""
    return header, payload


def peer_closed(sock: socket.socket, timeout: float) -> bool:
    """True once the peer closed `sock` (EOF pending), without consuming data another reader expects."""
    try:
        ready, _, _ = select.select([sock], [], [], timeout)
        if not ready:
            return False
        if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
            return True
        time.sleep(0.05)  # a reply another thread is about to read: do not spin on it
        return False
    except BlockingIOError:
        return False
    except (OSError, ValueError):
        return True


class LocalConn:
    """One connection: `request` sends and waits for the reply, serialised by a lock."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()

    def request(self, header: Header, payload: bytes = b"", timeout: float | None = None) -> Header:
        """Send and wait for the reply; TimeoutError after `timeout` s (the connection is then unusable:
        a late reply would be read as the answer to the next request, so the caller must drop it)."""
        with self._lock:
            previous = self.sock.gettimeout()
            self.sock.settimeout(timeout)
            try:
                send_frame(self.sock, header, payload)
                reply, _ = recv_frame(self.sock)
            finally:
                with contextlib.suppress(OSError):
                    self.sock.settimeout(previous)
        if reply.get("op") == "error":
            raise PeerAnswer(f"{header.get('op')} failed: {reply.get('message', 'no message')}")
        return reply

    def recv(self) -> tuple[Header, bytes]:
        return recv_frame(self.sock)

    def reply_ok(self, **fields: Any) -> None:
        send_frame(self.sock, {"op": "ok", **fields})

    def reply_error(self, message: str) -> None:
        send_frame(self.sock, {"op": "error", "message": message})

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def connect(path: str | os.PathLike[str], timeout: float = 60.0) -> LocalConn:
    """Connect to the agent's socket, waiting up to `timeout` s for the agent to start listening."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(os.fspath(path))
            return LocalConn(sock)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"no weightsync agent listening on {path} after {timeout:.0f}s: is the agent sidecar running "
                    "and is the socket directory shared with this container?"
                ) from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


class LocalServer:
    """Accepts app connections on the agent's Unix socket; one thread per connection runs `handler`."""

    def __init__(self, path: Path, handler: Callable[[LocalConn], None]) -> None:
        self.path = path
        self.handler = handler
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a stale socket from a previous agent in this pod
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(os.fspath(path))
        os.chmod(path, 0o660)
        self.sock.listen(16)
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="local-accept", daemon=True)

    def start(self) -> LocalServer:
        self._thread.start()
        log.info("local socket listening path=%s", self.path)
        return self

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                if self._closed:
                    return
                log.exception("local accept failed")
                time.sleep(0.1)
                continue
            threading.Thread(target=self._run, args=(LocalConn(conn),), name="local-conn", daemon=True).start()

    def _run(self, conn: LocalConn) -> None:
        try:
            self.handler(conn)
        except (ConnectionError, OSError) as exc:
            log.info("local client disconnected: %s", exc)
        except LocalProtocolError as exc:
            log.warning("local client sent a bad frame, closing: %s", exc)
        except Exception:
            log.exception("local connection handler failed")
        finally:
            conn.close()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
