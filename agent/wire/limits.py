"""Admission of unauthenticated connections on the agent's ports: a total and a per-peer-address bound.

Anyone who can reach a pod can open TCP connections to its agent before any credential is checked. With
only a total bound, 80 idle connections from one client held every slot and real peers (and the kubelet's
readiness probe) were turned away. With a per-address bound as well, one client holds at most
`per_peer` slots and everyone else still gets in; slots are held only until the handshake or request
deadline.
"""

from __future__ import annotations

import threading
from collections import Counter


class ConnectionLimiter:
    """Counts connections in progress, in total and per peer address; thread-safe."""

    def __init__(self, total: int, per_peer: int) -> None:
        if total < 1 or per_peer < 1:
            raise ValueError(f"limits must be >= 1 (total={total}, per_peer={per_peer})")
        self.total, self.per_peer = total, per_peer
        self._lock = threading.Lock()
        self._by_peer: Counter[str] = Counter()
        self._count = 0
        self.refused = 0

    def acquire(self, peer: str) -> bool:
        """Take a slot for PEER (an address, no port); False (counted in `refused`) when a bound is hit."""
        with self._lock:
            if self._count >= self.total or self._by_peer[peer] >= self.per_peer:
                self.refused += 1
                return False
            self._count += 1
            self._by_peer[peer] += 1
            return True

    def release(self, peer: str) -> None:
        with self._lock:
            self._count -= 1
            self._by_peer[peer] -= 1
            if self._by_peer[peer] <= 0:
                del self._by_peer[peer]

    @property
    def in_use(self) -> int:
        with self._lock:
            return self._count
