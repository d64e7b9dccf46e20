"""Pod IPs for process pods: one unique loopback address per pod, so pods can bind the same port.

Linux routes all of 127.0.0.0/8 to the loopback device, so any 127.x.y.z is bindable without setup.
127.0.0.1 is never handed out (host processes use it); neither are network/broadcast-looking addresses.
"""

from __future__ import annotations

import ipaddress
import threading

DEFAULT_POD_CIDR = "127.100.0.0/16"


class PodIPExhausted(RuntimeError):
    """Every address of the pod CIDR is in use."""


class PodIPAllocator:
    """Thread-safe uid -> IP map over a loopback CIDR; allocation is idempotent per pod uid."""

    def __init__(self, cidr: str = DEFAULT_POD_CIDR) -> None:
        net = ipaddress.ip_network(cidr)
        if not isinstance(net, ipaddress.IPv4Network) or not net.subnet_of(ipaddress.IPv4Network("127.0.0.0/8")):
            raise ValueError(f"pod CIDR {cidr!r} must be inside 127.0.0.0/8 (loopback)")
        self._net = net
        self._by_uid: dict[str, str] = {}
        self._used: set[str] = set()
        self._next = 0
        self._lock = threading.Lock()

    def _usable(self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        last = int(ip) & 0xFF
        return str(ip) != "127.0.0.1" and last not in (0, 255)

    def allocate(self, uid: str) -> str:
        """The pod's IP: its existing one, or the next free address of the CIDR."""
        with self._lock:
            if uid in self._by_uid:
                return self._by_uid[uid]
            size = self._net.num_addresses
            for step in range(size):
                ip = self._net[(self._next + step) % size]
                text = str(ip)
                if self._usable(ip) and text not in self._used:
                    self._next = (self._next + step + 1) % size
                    self._by_uid[uid] = text
                    self._used.add(text)
                    return text
            raise PodIPExhausted(f"no free pod IP left in {self._net}; delete pods or widen the pod CIDR")

    def reserve(self, uid: str, ip: str) -> bool:
        """Adopt an IP a pod already reports (runtime restart); False when it is taken or out of range."""
        with self._lock:
            if self._by_uid.get(uid) == ip:
                return True
            addr = ipaddress.ip_address(ip)
            if addr not in self._net or not self._usable(addr) or ip in self._used or uid in self._by_uid:
                return False
            self._by_uid[uid] = ip
            self._used.add(ip)
            return True

    def release(self, uid: str) -> None:
        with self._lock:
            ip = self._by_uid.pop(uid, None)
            if ip is not None:
                self._used.discard(ip)

    def get(self, uid: str) -> str | None:
        with self._lock:
            return self._by_uid.get(uid)
