"""Pod IPs for process pods: one unique loopback address per pod, so pods can bind the same port.

Linux routes all of 127.0.0.0/8 to the loopback device, so any 127.x.y.z is bindable without setup.
127.0.0.1 is never handed out (host processes use it); neither are network/broadcast-looking addresses.

Several runtimes may run on one machine (parallel test sessions, `make dev-up` next to pytest), each with
its own cluster but the same loopback: an address is therefore also leased machine-wide with a lock file
`<lease_dir>/<ip>` (created O_EXCL, holding the owner's pid); a lease whose owner died is taken over.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import threading
from pathlib import Path

DEFAULT_POD_CIDR = "127.100.0.0/16"
DEFAULT_LEASE_DIR = Path("/tmp/weightsync-pod-ips")


class PodIPExhausted(RuntimeError):
    """Every address of the pod CIDR is in use."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class HostLeases:
    """Machine-wide IP leases shared by every runtime on this host (lock files with the owner's pid)."""

    def __init__(self, lease_dir: Path, owner_pid: int | None = None) -> None:
        self.dir = lease_dir
        self.pid = owner_pid if owner_pid is not None else os.getpid()
        self.token = f"{self.pid}:{id(self):x}"  # several runtimes can live in one process (tests)
        self.dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(PermissionError):
            self.dir.chmod(0o1777)

    def acquire(self, ip: str) -> bool:
        path = self.dir / ip
        for _ in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    token = path.read_text().strip()
                    owner = int(token.split(":")[0])
                except (OSError, ValueError, IndexError):
                    return False  # being written right now, or unreadable: not ours to take
                if token == self.token:
                    return True
                if owner == self.pid or _pid_alive(owner):
                    return False
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()  # its runtime died: take the address over
                continue
            with os.fdopen(fd, "w") as f:
                f.write(f"{self.token}\n")
            return True
        return False

    def release(self, ip: str) -> None:
        path = self.dir / ip
        try:
            if path.read_text().strip() == self.token:
                path.unlink()
        except OSError:
            pass


class PodIPAllocator:
    """Thread-safe uid -> IP map over a loopback CIDR; allocation is idempotent per pod uid.

    `leases` (optional) makes the addresses unique across the runtimes of this machine.
    """

    def __init__(self, cidr: str = DEFAULT_POD_CIDR, leases: HostLeases | None = None) -> None:
        net = ipaddress.ip_network(cidr)
        if not isinstance(net, ipaddress.IPv4Network) or not net.subnet_of(ipaddress.IPv4Network("127.0.0.0/8")):
            raise ValueError(f"pod CIDR {cidr!r} must be inside 127.0.0.0/8 (loopback)")
        self._net = net
        self._leases = leases
        self._by_uid: dict[str, str] = {}
        self._used: set[str] = set()
        self._next = 0
        self._lock = threading.Lock()

    def _usable(self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        last = int(ip) & 0xFF
        return str(ip) != "127.0.0.1" and last not in (0, 255)

    def _take(self, uid: str, ip: str) -> bool:
        if ip in self._used or (self._leases is not None and not self._leases.acquire(ip)):
            return False
        self._by_uid[uid] = ip
        self._used.add(ip)
        return True

    def allocate(self, uid: str) -> str:
        """The pod's IP: its existing one, or the next free address of the CIDR."""
        with self._lock:
            if uid in self._by_uid:
                return self._by_uid[uid]
            size = self._net.num_addresses
            for step in range(size):
                ip = self._net[(self._next + step) % size]
                if self._usable(ip) and self._take(uid, str(ip)):
                    self._next = (self._next + step + 1) % size
                    return str(ip)
            raise PodIPExhausted(f"no free pod IP left in {self._net}; delete pods or widen the pod CIDR")

    def reserve(self, uid: str, ip: str) -> bool:
        """Adopt an IP a pod already reports (runtime restart); False when it is taken or out of range."""
        with self._lock:
            if self._by_uid.get(uid) == ip:
                return True
            addr = ipaddress.ip_address(ip)
            if addr not in self._net or not self._usable(addr) or uid in self._by_uid:
                return False
            return self._take(uid, ip)

    def release(self, uid: str) -> None:
        with self._lock:
            ip = self._by_uid.pop(uid, None)
            if ip is not None:
                self._used.discard(ip)
                if self._leases is not None:
                    self._leases.release(ip)

    def release_all(self) -> None:
        with self._lock:
            uids = list(self._by_uid)
        for uid in uids:
            self.release(uid)

    def get(self, uid: str) -> str | None:
        with self._lock:
            return self._by_uid.get(uid)
