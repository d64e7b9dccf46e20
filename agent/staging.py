"""Staging segments: memory shared between an app process and its agent, one interface for CPU and GPU.

Why: `publish()` must return as soon as the trainer may reuse its memory, so the trainer copies its local
shards once into a segment the agent owns; the agent then serves the version from that segment while
training continues. On CPU a segment is POSIX shared memory (a file in /dev/shm, mapped MAP_SHARED by
both processes); on GPU it is one CUDA allocation shared by a CUDA IPC handle (one handle per segment,
never per tensor). The agent creates segments and unlinks them; the app only attaches.

The same segments carry buckets the other way, from an inference agent to a Custom engine.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import pickle
import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from weightsync.agent import buckets
from weightsync.crds import contract

log = logging.getLogger(__name__)

ALIGN = 256  # every tensor starts on a 256-byte boundary: any dtype view is aligned, and so is DMA
SHM_DIR_ENV = "WEIGHTSYNC_SHM_DIR"


def shm_dir() -> Path:
    return Path(os.environ.get(SHM_DIR_ENV) or contract.SHM_DIR)


def dtype_name(dtype: torch.dtype) -> str:
    return buckets.dtype_name(dtype)


def dtype_from_name(name: str) -> torch.dtype:
    return buckets.to_dtype(name)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def pack_offsets(sizes: Iterable[int]) -> tuple[list[int], int]:
    """Aligned byte offsets for tensors of the given sizes, and the total size."""
    offsets = []
    pos = 0
    for n in sizes:
        offsets.append(pos)
        pos += align(n)
    return offsets, max(pos, ALIGN)


class Segment:
    """A flat uint8 buffer visible to two processes. `handle()` is what the other side passes to `attach`."""

    name: str
    size: int
    tensor: torch.Tensor

    def handle(self) -> dict[str, Any]:
        raise NotImplementedError

    def view(self, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A tensor of `dtype`/`shape` aliasing the segment's bytes at `offset` (no copy)."""
        n = 1
        for d in shape:
            n *= int(d)
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"view [{offset}, {offset + nbytes}) outside segment {self.name} of {self.size} B")
        return self.tensor[offset : offset + nbytes].view(dtype).view(tuple(int(d) for d in shape))

    def close(self) -> None:
        """Drop this process's mapping (the memory lives on while another process maps it)."""
        self.tensor = torch.empty(0, dtype=torch.uint8)

    def unlink(self) -> None:
        """Owner only: free the memory once every process closed it."""


class ShmSegment(Segment):
    """POSIX shared memory: a /dev/shm file mapped MAP_SHARED (torch.from_file), so no resource tracker."""

    def __init__(self, path: Path, size: int, *, owner: bool) -> None:
        self.path = path
        self.name = path.name
        self.size = size
        self.owner = owner
        self.tensor = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)

    @classmethod
    def create(cls, size: int, prefix: str) -> ShmSegment:
        path = shm_dir() / f"{prefix}-{uuid.uuid4().hex[:12]}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        return cls(path, size, owner=True)

    def handle(self) -> dict[str, Any]:
        return {"kind": "shm", "name": self.name, "size": self.size, "dir": str(self.path.parent)}

    def unlink(self) -> None:
        self.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class CudaSegment(Segment):
    """One CUDA allocation shared through a CUDA IPC handle (torch.multiprocessing reductions)."""

    def __init__(self, tensor: torch.Tensor, name: str) -> None:
        self.tensor = tensor
        self.name = name
        self.size = tensor.numel()

    @classmethod
    def create(cls, size: int, prefix: str, device: str) -> CudaSegment:
        if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            log.warning("expandable_segments is on: CUDA IPC may fail with pidfd_getfd errors (NeMo-RL #3782)")
        t = torch.empty(size, dtype=torch.uint8, device=device)
        return cls(t, f"{prefix}-{uuid.uuid4().hex[:12]}")

    def handle(self) -> dict[str, Any]:
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(self.tensor)
        blob = base64.b64encode(pickle.dumps((rebuild, args))).decode()
        return {"kind": "cuda", "name": self.name, "size": self.size, "ipc": blob}

    def unlink(self) -> None:
        self.close()
        torch.cuda.ipc_collect()


def create_segment(size: int, prefix: str, device: str = "cpu") -> Segment:
    """A new segment of at least `size` bytes owned by the caller (the agent)."""
    size = max(align(size), ALIGN)
    if device == "cpu":
        return ShmSegment.create(size, prefix)
    return CudaSegment.create(size, prefix, device)


def attach_segment(handle: dict[str, Any]) -> Segment:
    """Map a segment another local process created. The handle comes over the trusted pod-local socket."""
    kind = handle.get("kind")
    if kind == "shm":
        name = str(handle["name"])
        if "/" in name or name.startswith("."):
            raise ValueError(f"bad shared-memory segment name {name!r}")
        return ShmSegment(Path(handle.get("dir") or shm_dir()) / name, int(handle["size"]), owner=False)
    if kind == "cuda":
        rebuild, args = pickle.loads(base64.b64decode(handle["ipc"]))  # pod-local socket: same trust domain
        return CudaSegment(rebuild(*args), str(handle["name"]))
    raise ValueError(f"unknown segment kind {kind!r}")


def cleanup_stale(prefix: str) -> int:
    """Remove /dev/shm files a previous agent of this pod left behind (it crashed before unlinking)."""
    removed = 0
    d = shm_dir()
    if not d.is_dir():
        return 0
    for p in d.glob(f"{prefix}-*"):
        with contextlib.suppress(OSError):
            p.unlink()
            removed += 1
    if removed:
        log.info("removed stale staging segments prefix=%s count=%d", prefix, removed)
    return removed


@dataclass
class Slot:
    segment: Segment
    version: int | None = None  # the version whose bytes the slot holds (None while free or being written)
    readers: int = 0            # transfers currently reading it


class SegmentPool:
    """Reusable segments, so fresh shared memory is not page-faulted for every version.

    A slot is busy while it is being written, while it holds a version that is still kept staged, or while a
    transfer reads it; everything else is reused for the next version (largest-fit first).
    """

    def __init__(self, prefix: str, device: str = "cpu") -> None:
        self.prefix = prefix
        self.device = device
        self._slots: list[Slot] = []
        self._writing: set[int] = set()
        self._lock = threading.Lock()

    def acquire(self, size: int) -> Slot:
        with self._lock:
            free = [s for s in self._slots if s.version is None and s.readers == 0 and id(s) not in self._writing]
            fit = [s for s in free if s.segment.size >= size]
            if fit:
                slot = min(fit, key=lambda s: s.segment.size)
            else:
                for s in free:  # too small: replace it rather than keep both
                    s.segment.unlink()
                    self._slots.remove(s)
                slot = Slot(create_segment(size, self.prefix, self.device))
                self._slots.append(slot)
            self._writing.add(id(slot))
            return slot

    def find(self, name: str) -> Slot | None:
        with self._lock:
            return next((s for s in self._slots if s.segment.name == name), None)

    def fill(self, slot: Slot, version: int) -> None:
        with self._lock:
            self._writing.discard(id(slot))
            slot.version = version

    def release(self, slot: Slot) -> None:
        """The slot's version is no longer kept; it becomes reusable once no transfer reads it."""
        with self._lock:
            self._writing.discard(id(slot))
            slot.version = None

    def close(self) -> None:
        with self._lock:
            for s in self._slots:
                s.segment.unlink()
            self._slots.clear()
