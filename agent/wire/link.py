"""The agent<->agent control channel: length-prefixed frames over TCP, authenticated with the job token.

Why: agents exchange plans, bucket handles and version verdicts across pods; anything that is not a
peer holding the job's token must not be able to inject a frame, replay one, or crash a listener.

Handshake (per connection, both sides prove the token, replay-safe):
    server -> client   b"WSH1" + nonce_s (32 random bytes)
    client -> server   b"WSH1" + nonce_c + HMAC(token, "client" | nonce_s | nonce_c)
    server -> client   HMAC(token, "server" | nonce_s | nonce_c)          (only if the client proved it)
Each direction then uses its own session key HMAC(token, "c2s"|"s2c" | nonce_s | nonce_c) and a frame
sequence number, so frames cannot be replayed across connections, reordered or reflected.

Frame:  prefix (magic, version, flags, header_len, payload_len, seq) | header (JSON object) | payload |
        HMAC-SHA256(session key, prefix | header | payload)
Sizes are bounded before anything is allocated; the MAC is checked before the header is parsed. A bad
frame raises (AuthError / FrameError), is logged and closes that link; a listener never dies of it.

The link carries control messages and small payloads. Bulk bytes go through a transport.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from weightsync.agent.wire.limits import ConnectionLimiter

log = logging.getLogger(__name__)

MAGIC = b"WSL1"
HELLO = b"WSH1"
_PREFIX = struct.Struct("!4sBBHIQQ")  # magic, version, flags, reserved, header_len, payload_len, seq
_VERSION = 1
_MAC_LEN = 32
_NONCE_LEN = 32
DEFAULT_MAX_HEADER = 1 << 20  # 1 MiB of JSON
DEFAULT_MAX_PAYLOAD = 64 << 20  # 64 MiB
DEFAULT_IO_TIMEOUT = 60.0
DEFAULT_HANDSHAKE_TIMEOUT = 5.0


class LinkError(RuntimeError):
    """A control-channel failure; subclasses say which."""


class AuthError(LinkError):
    """The peer could not prove the job token, or a frame's MAC did not verify."""


class FrameError(LinkError):
    """A frame was malformed, oversized, out of sequence or truncated."""


class PeerClosed(LinkError):
    """The peer closed the connection (or died) between frames."""


class LinkTimeout(LinkError, TimeoutError):
    """No frame arrived within the timeout; the link is still usable."""


class RemoteAbort(LinkError):
    """The peer reported a failure (a frame of kind "abort"); the message carries its reason."""


def _token_bytes(token: str | bytes) -> bytes:
    tok = token.encode() if isinstance(token, str) else bytes(token)
    tok = tok.strip()
    if not tok:
        raise AuthError("the job token is empty; mount the job's token Secret (WEIGHTSYNC_TOKEN_PATH)")
    return tok


def _mac(key: bytes, *parts: bytes | memoryview) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


def _recv_exact(sock: socket.socket, n: int, what: str, *, started: bool) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), what, started=started)
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview, what: str, *, started: bool) -> None:
    """Fill `view` from the socket; EOF before the first byte of a frame is PeerClosed, later a
    truncated frame."""
    got = 0
    n = len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            raise FrameError(f"timed out in the middle of {what} ({got} of {n} bytes)") from None
        except OSError as exc:
            if not started and got == 0:
                raise PeerClosed(f"connection lost while waiting for {what}: {exc}") from exc
            raise FrameError(f"connection lost in the middle of {what} ({got} of {n} bytes): {exc}") from exc
        if k == 0:
            if not started and got == 0:
                raise PeerClosed(f"peer closed the connection (waiting for {what})")
            raise FrameError(f"truncated frame: peer closed after {got} of {n} bytes of {what}")
        got += k


class Link:
    """An authenticated, framed, bidirectional channel to one peer agent. Thread-safe: one sender and
    one receiver may use it concurrently. Create with `connect()` or `LinkListener.accept()`."""

    def __init__(
        self,
        sock: socket.socket,
        send_key: bytes,
        recv_key: bytes,
        peer: str,
        *,
        max_header: int = DEFAULT_MAX_HEADER,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        io_timeout: float = DEFAULT_IO_TIMEOUT,
    ) -> None:
        self._sock = sock
        self._send_key = send_key
        self._recv_key = recv_key
        self.peer = peer
        self.max_header = max_header
        self.max_payload = max_payload
        self._send_seq = 0
        self._recv_seq = 0
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._closed = False
        sock.settimeout(io_timeout)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @property
    def closed(self) -> bool:
        return self._closed

    def send(self, header: Mapping[str, Any], payload: bytes | bytearray | memoryview = b"") -> None:
        """Send one frame: a JSON-serializable header and an optional binary payload."""
        body = json.dumps(header, separators=(",", ":")).encode()
        pl = memoryview(payload).cast("B") if not isinstance(payload, bytes) else memoryview(payload)
        if len(body) > self.max_header:
            raise FrameError(f"header of {len(body)} bytes exceeds the link's limit of {self.max_header}")
        if len(pl) > self.max_payload:
            raise FrameError(f"payload of {len(pl)} bytes exceeds the link's limit of {self.max_payload}")
        with self._send_lock:
            if self._closed:
                raise PeerClosed(f"link to {self.peer} is closed")
            prefix = _PREFIX.pack(MAGIC, _VERSION, 0, 0, len(body), len(pl), self._send_seq)
            mac = _mac(self._send_key, prefix, body, pl)
            try:
                if len(pl) <= 65536:
                    self._sock.sendall(b"".join((prefix, body, pl, mac)))
                else:
                    self._sock.sendall(prefix + body)
                    self._sock.sendall(pl)
                    self._sock.sendall(mac)
            except OSError as exc:
                self._close_quietly()
                raise PeerClosed(f"sending to {self.peer} failed: {exc}") from exc
            self._send_seq += 1

    def recv(self, timeout: float | None = None) -> tuple[dict[str, Any], memoryview]:
        """The next authenticated frame as (header, payload). `timeout` bounds the wait for a frame to
        start (LinkTimeout, link still usable); a frame that stalls half-way is a FrameError."""
        with self._recv_lock:
            if self._closed:
                raise PeerClosed(f"link to {self.peer} is closed")
            try:
                return self._recv_frame(timeout)
            except LinkTimeout:
                raise
            except (AuthError, FrameError) as exc:
                log.warning("link.reject peer=%s reason=%s", self.peer, exc)
                self._close_quietly()
                raise
            except LinkError:
                self._close_quietly()
                raise

    def _recv_frame(self, timeout: float | None) -> tuple[dict[str, Any], memoryview]:
        # Wait for a frame to start without the socket's I/O timeout (an idle link is fine, a stalled
        # frame is not): select, then read the frame under the I/O timeout.
        try:
            ready, _, _ = select.select([self._sock], [], [], None if timeout is None else max(0.0, timeout))
        except (OSError, ValueError) as exc:
            raise PeerClosed(f"link to {self.peer} is unusable: {exc}") from exc
        if not ready:
            raise LinkTimeout(f"no frame from {self.peer} within {timeout:.1f}s")
        prefix = _recv_exact(self._sock, _PREFIX.size, "a frame prefix", started=False)
        magic, version, _flags, _res, hlen, plen, seq = _PREFIX.unpack(prefix)
        if magic != MAGIC or version != _VERSION:
            raise FrameError(f"bad frame magic/version {magic!r}/{version} (not a weightsync agent link?)")
        if hlen > self.max_header:
            raise FrameError(f"frame header of {hlen} bytes exceeds the limit of {self.max_header}")
        if plen > self.max_payload:
            raise FrameError(f"frame payload of {plen} bytes exceeds the limit of {self.max_payload}")
        buf = bytearray(hlen + plen)
        view = memoryview(buf)
        _recv_into(self._sock, view, f"a frame body ({hlen}+{plen} bytes)", started=True)
        mac = _recv_exact(self._sock, _MAC_LEN, "a frame MAC", started=True)
        if not hmac.compare_digest(mac, _mac(self._recv_key, prefix, view)):
            raise AuthError(f"frame MAC from {self.peer} does not verify (tampered or wrong token)")
        if seq != self._recv_seq:
            raise FrameError(f"frame sequence {seq} from {self.peer}, expected {self._recv_seq} (replayed?)")
        self._recv_seq += 1
        try:
            header = json.loads(bytes(view[:hlen]))
        except ValueError as exc:
            raise FrameError(f"frame header from {self.peer} is not JSON: {exc}") from exc
        if not isinstance(header, dict):
            raise FrameError(f"frame header from {self.peer} is not a JSON object")
        return header, view[hlen:]

    def _close_quietly(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()

    def close(self) -> None:
        """Close the connection; pending and later calls on either side raise PeerClosed."""
        self._close_quietly()

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _client_handshake(sock: socket.socket, token: bytes) -> tuple[bytes, bytes]:
    try:
        hello = _recv_exact(sock, len(HELLO) + _NONCE_LEN, "the server hello", started=True)
    except LinkError as exc:
        raise AuthError(f"handshake failed before authentication: {exc}") from exc
    if hello[: len(HELLO)] != HELLO:
        raise AuthError("the server is not a weightsync agent (bad hello)")
    ns = hello[len(HELLO) :]
    nc = os.urandom(_NONCE_LEN)
    sock.sendall(HELLO + nc + _mac(token, b"client", ns, nc))
    try:
        proof = _recv_exact(sock, _MAC_LEN, "the server proof", started=True)
    except LinkError:
        raise AuthError(
            "the server closed the connection during the handshake: it rejected our job token "
            "(wrong or rotated token?)"
        ) from None
    if not hmac.compare_digest(proof, _mac(token, b"server", ns, nc)):
        raise AuthError("the server could not prove the job token: it is not a member of this job")
    return _mac(token, b"c2s", ns, nc), _mac(token, b"s2c", ns, nc)


def _server_handshake(sock: socket.socket, token: bytes) -> tuple[bytes, bytes]:
    ns = os.urandom(_NONCE_LEN)
    sock.sendall(HELLO + ns)
    try:
        msg = _recv_exact(sock, len(HELLO) + _NONCE_LEN + _MAC_LEN, "the client hello", started=True)
    except LinkError as exc:
        raise AuthError(f"client handshake incomplete: {exc}") from exc
    if msg[: len(HELLO)] != HELLO:
        raise AuthError("client is not a weightsync agent (bad hello)")
    nc = msg[len(HELLO) : len(HELLO) + _NONCE_LEN]
    if not hmac.compare_digest(msg[len(HELLO) + _NONCE_LEN :], _mac(token, b"client", ns, nc)):
        raise AuthError("client could not prove the job token")
    sock.sendall(_mac(token, b"server", ns, nc))
    return _mac(token, b"s2c", ns, nc), _mac(token, b"c2s", ns, nc)


def connect(
    host: str,
    port: int,
    token: str | bytes,
    timeout: float = 10.0,
    *,
    max_header: int = DEFAULT_MAX_HEADER,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    io_timeout: float = DEFAULT_IO_TIMEOUT,
) -> Link:
    """Connect to a peer agent's LinkListener and run the handshake. Raises AuthError when either side
    cannot prove the token, LinkError (PeerClosed/LinkTimeout) when the peer is unreachable."""
    tok = _token_bytes(token)
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except TimeoutError:
        raise LinkTimeout(f"connecting to {host}:{port} timed out after {timeout:.1f}s") from None
    except OSError as exc:
        raise PeerClosed(f"cannot connect to agent at {host}:{port}: {exc}") from exc
    try:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        send_key, recv_key = _client_handshake(sock, tok)
    except BaseException:
        sock.close()
        raise
    return Link(sock, send_key, recv_key, f"{host}:{port}", max_header=max_header, max_payload=max_payload,
                io_timeout=io_timeout)


class LinkListener:
    """Accepts authenticated links. Handshakes run in their own threads with a deadline, so a silent or
    hostile client never blocks other peers; failures are logged and counted (`rejected`), never raised
    out of the listener."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str | bytes,
        *,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
        max_pending: int = 64,
        max_pending_per_peer: int = 8,
        max_header: int = DEFAULT_MAX_HEADER,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        io_timeout: float = DEFAULT_IO_TIMEOUT,
    ) -> None:
        self._token = _token_bytes(token)
        self._handshake_timeout = handshake_timeout
        self._link_opts: dict[str, Any] = {"max_header": max_header, "max_payload": max_payload,
                                           "io_timeout": io_timeout}
        self._sock = socket.create_server((host, port), backlog=128)
        self._sock.settimeout(0.2)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._ready: queue.Queue[Link] = queue.Queue()
        # Handshakes in progress, bounded in total and per client address: a flood of idle connections
        # from one client holds at most max_pending_per_peer slots, each for at most handshake_timeout s.
        self._slots = ConnectionLimiter(max_pending, max_pending_per_peer)
        self._stop = threading.Event()
        self.accepted = 0
        self.rejected = 0
        self._thread = threading.Thread(target=self._accept_loop, name=f"link-listener-{self.address[1]}",
                                        daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self.address[1]

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                log.exception("link.listener accept failed port=%s", self.port)
                time.sleep(0.1)
                continue
            peer = f"{addr[0]}:{addr[1]}"
            if not self._slots.acquire(addr[0]):
                self.rejected += 1
                log.warning("link.reject peer=%s reason=too many pending handshakes (%d from this address, "
                            "%d in all)", peer, self._slots.per_peer, self._slots.total)
                conn.close()
                continue
            threading.Thread(target=self._handshake, args=(conn, peer, addr[0]), daemon=True,
                             name=f"link-handshake-{peer}").start()

    def _handshake(self, conn: socket.socket, peer: str, address: str) -> None:
        try:
            conn.settimeout(self._handshake_timeout)
            send_key, recv_key = _server_handshake(conn, self._token)
            link = Link(conn, send_key, recv_key, peer, **self._link_opts)
        except Exception as exc:  # anything a client can provoke ends here: log, count, drop
            self.rejected += 1
            log.warning("link.reject peer=%s reason=%s", peer, exc)
            with contextlib.suppress(OSError):
                conn.close()
            return
        finally:
            self._slots.release(address)
        self.accepted += 1
        log.debug("link.accept peer=%s", peer)
        self._ready.put(link)

    def serve(self, handle: Callable[[Link], None], stop: threading.Event, name: str) -> None:
        """Until STOP: every authenticated link to HANDLE, each in a thread of its own (`name-<peer>`)."""
        while not stop.is_set():
            try:
                link = self.accept(timeout=0.5)
            except LinkTimeout:
                continue
            threading.Thread(target=handle, args=(link,), name=f"{name}-{link.peer}", daemon=True).start()

    def accept(self, timeout: float | None = None) -> Link:
        """The next authenticated link; LinkTimeout if none within `timeout` seconds."""
        try:
            return self._ready.get(timeout=timeout)
        except queue.Empty:
            raise LinkTimeout(f"no authenticated peer connected within {timeout}s") from None

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        self._thread.join(timeout=2)
        while True:
            try:
                self._ready.get_nowait().close()
            except queue.Empty:
                break

    def __enter__(self) -> LinkListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Mailbox:
    """Demultiplexes one Link's incoming frames by header["kind"] from a reader thread, so several
    protocol layers (sync, a transport's handle exchange, the agent's own requests) share one link.

    A frame of kind "abort" poisons the mailbox: every pending and later `get` raises RemoteAbort with
    the peer's reason. When the link fails, queued frames are still delivered, then `get` raises the
    link's error. Once a Mailbox is attached, read the link only through it.
    """

    ABORT = "abort"

    def __init__(self, link: Link, name: str = "") -> None:
        self.link = link
        self.name = name or link.peer
        self._cond = threading.Condition()
        self._frames: list[tuple[dict[str, Any], memoryview]] = []
        self._error: LinkError | None = None
        self._abort: str | None = None
        self._thread = threading.Thread(target=self._reader, name=f"mailbox-{self.name}", daemon=True)
        self._thread.start()

    def _reader(self) -> None:
        while True:
            try:
                header, payload = self.link.recv()
            except LinkError as exc:
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return
            with self._cond:
                if header.get("kind") == self.ABORT:
                    self._abort = str(header.get("reason", "no reason given"))
                else:
                    self._frames.append((header, payload))
                self._cond.notify_all()

    def send(self, kind: str, payload: bytes | bytearray | memoryview = b"", **fields: Any) -> None:
        """Send a frame of `kind` with extra header fields."""
        self.link.send({"kind": kind, **fields}, payload)

    def abort(self, reason: str) -> None:
        """Tell the peer this side failed (best effort: a dead link is ignored)."""
        with contextlib.suppress(LinkError):
            self.link.send({"kind": self.ABORT, "reason": reason})

    @property
    def aborted(self) -> str | None:
        return self._abort

    def get(
        self, kind: str, *, timeout: float | None = None, match: Mapping[str, Any] | None = None
    ) -> tuple[dict[str, Any], memoryview]:
        """The oldest frame of `kind` whose header has every `match` item. Raises RemoteAbort, the link's
        error (PeerClosed, FrameError, AuthError) or LinkTimeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._abort is not None:
                    raise RemoteAbort(f"peer {self.name} aborted: {self._abort}")
                for i, (h, p) in enumerate(self._frames):
                    if h.get("kind") == kind and all(h.get(k) == v for k, v in (match or {}).items()):
                        del self._frames[i]
                        return h, p
                if self._error is not None:
                    err = self._error
                    raise type(err)(f"{err} (while waiting for {kind!r} from {self.name})")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise LinkTimeout(f"no {kind!r} frame from {self.name} within {timeout:.1f}s")
                self._cond.wait(remaining)

    def close(self) -> None:
        self.link.close()
        self._thread.join(timeout=2)
