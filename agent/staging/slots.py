"""Transport slot buffers of a destination rank: the receive buffers its sources land buckets in, kept across
versions (`ReceiveSlots`), and, when a local engine process loads from them in place, made in shared segments
(`SharedSlotAllocator`). Staged versions on the trainer side are segments.SegmentPool's."""

from __future__ import annotations

import threading
import weakref

import torch

from weightsync.agent.staging.segments import SHARED, STAGING, Segment, create_segment


class SharedSlotAllocator:
    """Transport slot buffers in shared segments, for an adapter that hands them to a local engine process.

    A transport calls it like `buckets.allocate(nbytes, device)`. When a slot buffer is dropped (the
    transport rebinds or closes), its segment is queued; `reap()` hands the queued segments back so the
    owner can tell the engine to unmap them before unlinking (never while a view is alive)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self._dead: list[Segment] = []
        self.segments = 0

    def __call__(self, nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
        seg = create_segment(nbytes, self.prefix, str(torch.device(device)))
        SHARED.add(seg)
        view = seg.tensor[:nbytes]
        weakref.finalize(view, self._died, seg)
        with self._lock:
            self.segments += 1
        return view

    def _died(self, seg: Segment) -> None:
        with self._lock:
            self._dead.append(seg)
            self.segments -= 1

    def reap(self) -> list[Segment]:
        with self._lock:
            dead, self._dead = self._dead, []
        return dead


class ReceiveSlots:
    """The receive buffers of one destination rank: `n` slots shared by all its sources and kept across
    versions, so receive memory is buckets in flight x bucket size, not peers x buckets.

    From `alloc` (a SharedSlotAllocator: the engine loads from them in place) or private memory."""

    def __init__(self, alloc: SharedSlotAllocator | None = None) -> None:
        self.alloc = alloc
        self._bufs: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def ensure(self, n: int, nbytes: int, device: torch.device) -> None:
        """At least `n` slots of `nbytes` on `device` (reallocated only when they do not fit)."""
        with self._lock:
            if len(self._bufs) >= n and all(b.numel() >= nbytes and b.device == device for b in self._bufs[:n]):
                return
            self._drop()
            for _ in range(n):
                if self.alloc is not None:
                    self._bufs.append(self.alloc(nbytes, device))
                else:
                    self._bufs.append(torch.empty(nbytes, dtype=torch.uint8, device=device))
                    STAGING.add(nbytes)

    def get(self, slot: int) -> torch.Tensor:
        with self._lock:
            return self._bufs[slot]

    def _drop(self) -> None:
        if self.alloc is None:
            for b in self._bufs:
                STAGING.sub(b.numel())
        self._bufs = []  # a SharedSlotAllocator learns it through its finalizers

    def close(self) -> None:
        with self._lock:
            self._drop()
