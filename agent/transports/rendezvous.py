"""The NCCL-mode rendezvous store, behind the job token.

torch's TCPStore has no credentials: anyone who reached the trainer agent's transport port could read,
overwrite or delete the keys every process group of the job rendezvouses through, and fill its memory.
This store speaks the agent link protocol instead (challenge-response with the job token, HMAC on every
frame; agent/wire/link.py), so a client without the token never gets to a key. The client is a
`torch.distributed.Store` subclass: gloo and NCCL process groups (through `PrefixStore`) use it like any
c10d store.

Server limits: handshakes bounded per address (LinkListener), at most MAX_KEYS keys and MAX_BYTES of
values in all, keys up to MAX_KEY_BYTES, every blocking call bounded by the caller's timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from typing import Any

import torch.distributed as dist

from weightsync.agent.wire.link import Link, LinkError, LinkListener, LinkTimeout, connect

log = logging.getLogger(__name__)

MAX_KEYS = 100_000
MAX_BYTES = 256 << 20  # 256 MiB of values (rendezvous data is tiny: addresses, NCCL unique ids)
MAX_KEY_BYTES = 1024


class StoreError(RuntimeError):
    """A refused store request (limits, a bad request, or the server's own timeout)."""


class _Table:
    """The key-value table with blocking waits; one lock, one condition."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.nbytes = 0
        self.cv = threading.Condition()

    def _put(self, key: str, value: bytes) -> None:
        old = self.data.get(key)
        grow = len(value) - (len(old) if old is not None else 0)
        if old is None and len(self.data) >= MAX_KEYS:
            raise StoreError(f"store full: {MAX_KEYS} keys")
        if self.nbytes + grow > MAX_BYTES:
            raise StoreError(f"store full: {MAX_BYTES} bytes of values")
        self.data[key] = value
        self.nbytes += grow
        self.cv.notify_all()

    def set(self, key: str, value: bytes) -> None:
        with self.cv:
            self._put(key, value)

    def wait(self, keys: list[str], timeout: float) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: all(k in self.data for k in keys), timeout=timeout)

    def get(self, key: str, timeout: float) -> bytes:
        with self.cv:
            if not self.cv.wait_for(lambda: key in self.data, timeout=timeout):
                raise StoreError(f"timed out after {timeout:g}s waiting for key {key!r}")
            return self.data[key]

    def add(self, key: str, n: int) -> int:
        with self.cv:
            value = int(self.data.get(key, b"0")) + n
            self._put(key, str(value).encode())
            return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self.cv:
            cur = self.data.get(key)
            if (cur is None and expected == b"") or cur == expected:
                self._put(key, desired)
                return desired
            return cur if cur is not None else expected

    def delete(self, key: str) -> bool:
        with self.cv:
            old = self.data.pop(key, None)
            if old is not None:
                self.nbytes -= len(old)
            return old is not None


def _key(header: dict[str, Any], name: str = "key") -> str:
    key = header.get(name)
    if not isinstance(key, str) or not key or len(key.encode()) > MAX_KEY_BYTES:
        raise StoreError(f"'{name}' must be a non-empty string of at most {MAX_KEY_BYTES} bytes")
    return key


def _keys(header: dict[str, Any]) -> list[str]:
    keys = header.get("keys")
    if not isinstance(keys, list) or len(keys) > 1024:
        raise StoreError("'keys' must be a list of at most 1024 keys")
    return [_key({"key": k}) for k in keys]


def _timeout(header: dict[str, Any], cap: float) -> float:
    t = header.get("timeout")
    return min(float(t), cap) if isinstance(t, (int, float)) and t >= 0 else cap


class StoreServer:
    """Serves the table to authenticated clients on `port` (the trainer agent's transport port)."""

    def __init__(self, host: str, port: int, token: str | bytes, *, timeout: float = 600.0) -> None:
        self.timeout = timeout
        self.table = _Table()
        self.listener = LinkListener(host, port, token)
        self.port = self.listener.port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name=f"store-{self.port}", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        self.listener.serve(self._serve, self._stop, "store-peer")

    def _serve(self, link: Link) -> None:
        with contextlib.closing(link):
            while not self._stop.is_set():
                try:
                    header, payload = link.recv(timeout=1.0)
                except LinkTimeout:
                    continue
                except LinkError:
                    return
                try:
                    reply, data = self._handle(header, bytes(payload))
                except StoreError as exc:
                    reply, data = {"ok": False, "error": str(exc)}, b""
                except (TypeError, ValueError) as exc:
                    reply, data = {"ok": False, "error": f"bad request: {exc}"}, b""
                try:
                    link.send(reply, data)
                except LinkError:
                    return

    def _handle(self, h: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        op, t = h.get("op"), self.table
        if op == "set":
            t.set(_key(h), payload)
            return {"ok": True}, b""
        if op == "get":
            return {"ok": True}, t.get(_key(h), _timeout(h, self.timeout))
        if op == "add":
            return {"ok": True, "value": t.add(_key(h), int(h["n"]))}, b""
        if op == "wait":
            return {"ok": True, "done": t.wait(_keys(h), _timeout(h, self.timeout))}, b""
        if op == "check":
            with t.cv:
                return {"ok": True, "done": all(k in t.data for k in _keys(h))}, b""
        if op == "compare_set":
            n = int(h["expected_len"])
            if not 0 <= n <= len(payload):
                raise StoreError("expected_len out of range")
            return {"ok": True}, t.compare_set(_key(h), payload[:n], payload[n:])
        if op == "delete":
            return {"ok": True, "deleted": t.delete(_key(h))}, b""
        if op == "num_keys":
            with t.cv:
                return {"ok": True, "value": len(t.data)}, b""
        raise StoreError(f"unknown op {op!r}")

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        self._thread.join(timeout=2)


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _seconds(timeout: Any, default: float) -> float:
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return default if timeout is None else float(timeout)


class LinkStore(dist.Store):
    """A c10d Store whose every request goes over an authenticated link to a StoreServer.

    Keep a reference to the Python object for as long as a process group may use it: c10d holds only the
    C++ side, and once the Python object is collected every call fails with "Not implemented"."""

    def __init__(self, host: str, port: int, token: str | bytes, *, timeout: float = 600.0) -> None:
        super().__init__()
        self.host, self.port, self._token = host, port, token
        self.timeout_s = timeout
        self._link: Link | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _request(self, header: dict[str, Any], payload: bytes = b"", wait: float = 0.0) -> tuple[dict[str, Any], bytes]:
        with self._lock:
            deadline = time.monotonic() + min(self.timeout_s, 60.0)
            while True:
                if self._closed:
                    raise StoreError(f"rendezvous store {self.host}:{self.port}: the client is closed")
                try:
                    if self._link is None or self._link.closed:
                        self._link = connect(self.host, self.port, self._token, timeout=10.0)
                        if self._closed:  # closed while connecting: close() did not see this link
                            self._link.close()
                    self._link.send(header, payload)
                    reply, data = self._link.recv(timeout=wait + 30.0)
                    break
                except LinkError as exc:
                    if self._link is not None:
                        self._link.close()
                        self._link = None
                    # connecting may race the server's start; a request in flight is not repeated blindly
                    # unless it is idempotent (everything but add)
                    if header.get("op") == "add" or time.monotonic() >= deadline:
                        raise StoreError(f"rendezvous store {self.host}:{self.port}: {exc}") from exc
                    time.sleep(0.2)
        if not reply.get("ok"):
            raise StoreError(f"rendezvous store {self.host}:{self.port}: {reply.get('error')}")
        return reply, bytes(data)

    # --- the c10d Store interface --------------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        self._request({"op": "set", "key": key}, _as_bytes(value))

    def get(self, key: str) -> bytes:
        return self._request({"op": "get", "key": key, "timeout": self.timeout_s}, wait=self.timeout_s)[1]

    def add(self, key: str, value: int) -> int:
        return int(self._request({"op": "add", "key": key, "n": int(value)})[0]["value"])

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        exp, des = _as_bytes(expected), _as_bytes(desired)
        return self._request({"op": "compare_set", "key": key, "expected_len": len(exp)}, exp + des)[1]

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        t = _seconds(timeout, self.timeout_s)
        if not self._request({"op": "wait", "keys": list(keys), "timeout": t}, wait=t)[0]["done"]:
            raise StoreError(f"timed out after {t:g}s waiting for keys {list(keys)[:4]}")

    def check(self, keys: list[str]) -> bool:
        return bool(self._request({"op": "check", "keys": list(keys)})[0]["done"])

    def delete_key(self, key: str) -> bool:
        return bool(self._request({"op": "delete", "key": key})[0]["deleted"])

    def num_keys(self) -> int:
        return int(self._request({"op": "num_keys"})[0]["value"])

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.timeout_s = timeout.total_seconds()

    def close(self) -> None:
        """Close at once, without the request lock: a request blocked in a wait holds it for up to the
        store's timeout (minutes), and an agent closing on SIGTERM would sit out its grace period and be
        killed. Shutting the link down wakes that request, which then fails; no request reconnects after."""
        self._closed = True
        link = self._link
        if link is not None:
            link.close()


