"""Staging segments: memory shared between an app process and its agent, one interface for CPU and GPU.

Why: `publish()` must return as soon as the trainer may reuse its memory, so the trainer copies its local
shards once into a segment the agent owns; the agent then serves the version from that segment while
training continues. On CPU a segment is POSIX shared memory (a file in the pod's staging volume, mapped MAP_SHARED by
both processes); on GPU it is one CUDA allocation shared by a CUDA IPC handle (one handle per segment,
never per tensor). The agent creates segments and unlinks them; the app only attaches.

The same segments carry buckets the other way, from an inference agent to a Custom engine.

Page-locking a host segment goes through the CUDA driver (staging/cuda_driver.py); a destination rank's
receive buffers, in shared segments or not, are staging/slots.py.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import pickle
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weightsync.agent.plan import buckets
from weightsync.agent.staging import cuda_driver
from weightsync.crds import contract

log = logging.getLogger(__name__)

ALIGN = 256  # every tensor starts on a 256-byte boundary: any dtype view is aligned, and so is DMA
SHM_DIR_ENV = "WEIGHTSYNC_SHM_DIR"


def shm_dir() -> Path:
    return Path(os.environ.get(SHM_DIR_ENV) or contract.STAGING_DIR)


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


class StagingAccount:
    """Bytes of staging memory this process holds (segments it created, transport slots), and the peak.

    Why: `bucketSizeMB` is meant to bound the agent's memory; this is the figure that says whether it does
    (the `weightsync_agent_staging_bytes` gauges and bench/agent_pipeline.py's `peak_staging_bytes`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.current += nbytes
            self.peak = max(self.peak, self.current)

    def sub(self, nbytes: int) -> None:
        with self._lock:
            self.current = max(0, self.current - nbytes)


STAGING = StagingAccount()


class Segment:
    """A flat uint8 buffer visible to two processes. `handle()` is what the other side passes to `attach`."""

    name: str
    size: int
    tensor: torch.Tensor
    owner: bool = False

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


#: Called with (address, bytes) of a segment the agent frees (`unlink`), before its mapping goes: whoever keeps
#: the memory registered (a GDR transport's NIXL agent) lets go of it, so the memory is really freed and a later
#: segment at the same address is never taken for the old registration.
_FREED_HOOKS: list[Callable[[int, int], None]] = []
_FREED_LOCK = threading.Lock()


def on_segment_freed(hook: Callable[[int, int], None]) -> Callable[[], None]:
    """Call `hook(address, nbytes)` whenever a staging segment of this process is freed; returns the remover."""
    with _FREED_LOCK:
        _FREED_HOOKS.append(hook)

    def remove() -> None:
        with _FREED_LOCK, contextlib.suppress(ValueError):
            _FREED_HOOKS.remove(hook)
    return remove


def _freed(t: torch.Tensor) -> None:
    if not t.numel():
        return
    with _FREED_LOCK:
        hooks = list(_FREED_HOOKS)
    for hook in hooks:
        try:
            hook(int(t.data_ptr()), int(t.numel() * t.element_size()))
        except Exception:
            log.exception("staging.freed_hook_failed")


def pin_host(t: torch.Tensor) -> bool:
    """Page-lock host memory we did not allocate through torch (an mmap'ed segment), so copies between it and a
    GPU run at full DMA speed. False (nothing done) without CUDA, or where the kernel refuses: it pins
    memory-backed files (/dev/shm, an emptyDir with medium Memory) but not files on a disk."""
    if t.device.type != "cpu" or not t.numel() or not torch.cuda.is_available():
        return False
    nbytes = t.numel() * t.element_size()
    err, name = cuda_driver.host_register(t.data_ptr(), nbytes)
    if err:
        log.warning("staging.pin_failed bytes=%s error=%s dir=%s: staging stays pageable (host <-> GPU copies at "
                    "pageable speed); is the staging volume memory-backed?", nbytes, name, shm_dir())
        return False
    return True


def unpin_host(t: torch.Tensor) -> None:
    if t.numel():
        err, name = cuda_driver.host_unregister(t.data_ptr())
        if err:
            log.warning("staging.unpin_failed error=%s", name)


class ShmSegment(Segment):
    """POSIX shared memory: a file in the memory-backed staging volume mapped MAP_SHARED (torch.from_file), so
    no resource tracker."""

    def __init__(self, path: Path, size: int, *, owner: bool) -> None:
        self.path = path
        self.name = path.name
        self.size = size
        self.owner = owner
        self.tensor = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        self.pinned = False
        with _SHM_LOCK:
            _SHM_SEGMENTS.add(self)

    @classmethod
    def create(cls, size: int, prefix: str) -> ShmSegment:
        path = shm_dir() / f"{prefix}-{uuid.uuid4().hex[:12]}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        seg = cls(path, size, owner=True)
        seg.pinned = pin_host(seg.tensor)  # GPU nodes: host staging is pinned (H2D / D2H at DMA speed)
        STAGING.add(size)
        return seg

    def close(self) -> None:
        if self.pinned:
            unpin_host(self.tensor)
            self.pinned = False
        super().close()

    def handle(self) -> dict[str, Any]:
        return {"kind": "shm", "name": self.name, "size": self.size, "dir": str(self.path.parent)}

    def unlink(self) -> None:
        _freed(self.tensor)
        self.close()
        SHARED.forget(self)
        if self.owner and self.path.exists():
            STAGING.sub(self.size)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class CudaSegment(Segment):
    """One CUDA allocation shared through a CUDA IPC handle (torch.multiprocessing reductions)."""

    def __init__(self, tensor: torch.Tensor, name: str) -> None:
        self.tensor = tensor
        self.name = name
        self.size = tensor.numel()
        self.owner = False

    @classmethod
    def create(cls, size: int, prefix: str, device: str) -> CudaSegment:
        if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            log.warning("expandable_segments is on: CUDA IPC may fail with pidfd_getfd errors (NeMo-RL #3782)")
        t = torch.empty(size, dtype=torch.uint8, device=device)
        STAGING.add(size)
        seg = cls(t, f"{prefix}-{uuid.uuid4().hex[:12]}")
        seg.owner = True
        return seg

    def handle(self) -> dict[str, Any]:
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(self.tensor)
        blob = base64.b64encode(pickle.dumps((rebuild, args))).decode()
        return {"kind": "cuda", "name": self.name, "size": self.size, "ipc": blob}

    def unlink(self) -> None:
        if self.owner and self.tensor.numel():
            STAGING.sub(self.size)
        _freed(self.tensor)
        self.close()
        SHARED.forget(self)
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


class MappedFile:
    """A shared-memory file another owner created and a transport of this process mapped whole (an IPC
    reader's view of a staging segment). Holds the transport's mapping weakly: once the transport unmaps
    it, `tensor` is empty and nothing here keeps the memory alive."""

    def __init__(self, path: str, holder: Any) -> None:
        self.path = Path(path)
        self.name = self.path.name
        self._holder = weakref.ref(holder)  # an object whose `.tensor` is the mapping (None once unmapped)
        t = holder.tensor
        self.size = int(t.numel()) if t is not None else 0

    @property
    def tensor(self) -> torch.Tensor:
        holder = self._holder()
        t = getattr(holder, "tensor", None) if holder is not None else None
        return t if t is not None else torch.empty(0, dtype=torch.uint8)

    def handle(self) -> dict[str, Any]:
        return {"kind": "shm", "name": self.name, "size": self.size, "dir": str(self.path.parent)}

    def holds(self, holder: Any) -> bool:
        """Whether this is the mapping held by `holder` (or one whose holder is gone)."""
        mine = self._holder()
        return mine is None or mine is holder


class SharedSegments:
    """Memory of this process that another local process can map (segments it created, files a transport
    mapped), found by address.

    Why: a tensor that already lies in such memory (a receive slot, a staged version) can be handed to a
    Custom engine as (segment handle, offset) instead of being copied into the engine's segment. Names of
    entries that went away are kept (bounded) until `take_gone()`, so the engine can unmap them too."""

    GONE_MAX = 1024

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # one file may be mapped more than once (an IPC transport per local destination rank maps the same
        # staging file): every mapping is kept, so a tensor in any of them is found
        self._segs: dict[str, list[Segment | MappedFile]] = {}
        self._gone: list[str] = []

    def add(self, seg: Segment | MappedFile) -> None:
        with self._lock:
            maps = self._segs.setdefault(seg.name, [])
            if not any(m is seg for m in maps):
                maps.append(seg)

    def forget(self, seg: Segment | MappedFile | str, holder: Any = None) -> None:
        """Drop `seg` (every mapping of a name given as a string, or only the MappedFile whose mapping is
        `holder`); the name counts as gone once no mapping of it is left."""
        name = seg if isinstance(seg, str) else seg.name
        with self._lock:
            maps = self._segs.get(name)
            if not maps:
                return
            if not isinstance(seg, str):
                left = [m for m in maps if m is not seg]
            elif holder is not None:
                left = [m for m in maps if not (isinstance(m, MappedFile) and m.holds(holder))]
            else:
                left = []
            if left:
                self._segs[name] = left
                return
            del self._segs[name]
            self._gone = [*self._gone[-(self.GONE_MAX - 1):], name]

    def take_gone(self) -> list[str]:
        """Names that left the registry since the last call."""
        with self._lock:
            gone, self._gone = self._gone, []
        return gone

    def locate(self, t: torch.Tensor) -> tuple[Segment | MappedFile, int] | None:
        """(segment, byte offset) of a contiguous tensor lying wholly inside shared memory, else None."""
        with self._lock:
            segs = [m for maps in self._segs.values() for m in maps]
        return _locate_in(segs, t)


def _locate_in(segs: Iterable[Segment | MappedFile], t: torch.Tensor) -> tuple[Segment | MappedFile, int] | None:
    if not t.is_contiguous() or not t.numel():
        return None
    lo = t.data_ptr()
    hi = lo + t.numel() * t.element_size()
    for seg in segs:
        base = seg.tensor
        if not base.numel() or base.device != t.device:
            continue
        start = base.data_ptr()
        if start <= lo and hi <= start + seg.size:
            return seg, lo - start
    return None


SHARED = SharedSegments()

#: Every staging segment this process maps (weakly; a closed one has an empty tensor and is skipped). The lock:
#: a thread adding a segment while another lists them would change the set under its iteration.
_SHM_SEGMENTS: weakref.WeakSet[ShmSegment] = weakref.WeakSet()
_SHM_LOCK = threading.Lock()


def shm_location(t: torch.Tensor) -> tuple[str, int] | None:
    """(file name, byte offset) of a contiguous CPU tensor lying in a shared-memory file this process maps (a
    staging segment, a receive slot, an IPC reader's mapping of a staging file), else None. Two mappings of one
    file give the same answer: that is what says two tensors are the same bytes however they were mapped."""
    if t.device.type != "cpu":
        return None
    with _SHM_LOCK:
        segs = list(_SHM_SEGMENTS)
    found = SHARED.locate(t) or _locate_in(segs, t)
    return (found[0].name, found[1]) if found is not None else None


def cleanup_stale(prefix: str) -> int:
    """Remove staging files a previous agent of this pod left behind (it crashed before unlinking)."""
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
    user: int | None = None     # who wrote it last (a trainer rank): it gets it back, already mapped and faulted in


OVERSIZE_SLACK = 1 << 20  # a free slot is reused for up to 1.5 x its request + this; a larger one is replaced
PAGE = 4096
SPARE_WAIT_S = 30.0  # how long a request waits for its rank's spare segment still being made


def prefault(seg: Segment) -> None:
    """Touch every page of a host segment once, so the kernel allocates and zeroes its memory now instead of
    inside the trainer's next copy (which then takes only a minor fault per page of its own mapping). A
    pinned segment is resident already; GPU memory has no page faults."""
    if isinstance(seg, ShmSegment) and not seg.pinned:
        seg.tensor[::PAGE].zero_()


class SegmentPool:
    """Reusable segments, so fresh shared memory is not page-faulted for every version.

    A slot is busy while it is being written, while it holds a version that is still kept staged, or while a
    transfer reads it; everything else is reused for the next version (largest-fit first).

    Spare (`make_spare`): once a rank's first version was served, its second segment is made and faulted in
    by a background thread at the lowest CPU priority. The second version needs a second segment anyway
    (the first still holds the version being served), and without the spare the trainer's copy of version 2
    paid for allocating and zeroing every page (about 0.3 s per GiB, held in `publish()`). Not while the
    first version is copied: two writers faulting pages at once doubled that copy. Host segments only.
    """

    def __init__(self, prefix: str, device: str = "cpu") -> None:
        self.prefix = prefix
        self.device = device
        self._slots: list[Slot] = []
        self._writing: set[int] = set()
        self._lock = threading.Lock()
        self._spares: dict[int, threading.Thread] = {}  # user -> the thread making its spare
        self._closed = False

    def acquire(self, size: int, user: int | None = None) -> Slot:
        """A free slot of at least `size` bytes, preferring one `user` wrote before (its process has it mapped
        and its pages faulted in: handing a rank another rank's slot costs a fresh mapping per version)."""
        with self._lock:
            making = self._spares.get(user) if user is not None else None
        if making is not None:
            making.join(SPARE_WAIT_S)  # take the spare being made rather than make a third segment
        with self._lock:
            free = [s for s in self._slots if s.version is None and s.readers == 0 and id(s) not in self._writing]
            fit = [s for s in free if s.segment.size >= size]
            chosen = min(fit, key=lambda s: (s.user != user, s.segment.size)) if fit else None
            if chosen is not None and chosen.segment.size > size + size // 2 + OVERSIZE_SLACK:
                # far larger than needed now (e.g. the trainer stages less once a plan names the shards a data-
                # parallel replica sends): its written pages would stay allocated for nothing
                chosen.segment.unlink()
                self._slots.remove(chosen)
                chosen = None
            if chosen is not None:
                slot = chosen
            else:
                for s in free:  # this user's slot is too small now: replace it rather than keep both
                    if s.user == user and s in self._slots:
                        s.segment.unlink()
                        self._slots.remove(s)
                slot = Slot(create_segment(size, self.prefix, self.device))
                self._slots.append(slot)
                log.info("staging.segment_created bytes=%s slots=%s held_bytes=%s", slot.segment.size,
                         len(self._slots), sum(s.segment.size for s in self._slots))
            self._writing.add(id(slot))
            slot.user = user
            return slot

    def wait_spares(self, timeout: float = SPARE_WAIT_S) -> bool:
        """Wait until no spare is being made (tests, shutdown); False if one still is after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                making = list(self._spares.values())
            if not making:
                return True
            for t in making:
                t.join(max(0.0, deadline - time.monotonic()))
            if time.monotonic() >= deadline:
                with self._lock:
                    return not self._spares

    def _make_spare(self, size: int, user: int) -> None:
        """The user's second segment, made and faulted in now (see the class doc), at the lowest CPU priority:
        it takes only cores the trainer's next step and the transfers leave idle."""
        t0 = time.perf_counter()
        with contextlib.suppress(OSError, AttributeError):  # Linux: a thread's nice value is its own
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            seg = create_segment(size, self.prefix, self.device)
            prefault(seg)
        except (OSError, RuntimeError) as exc:  # a full staging volume: the second version makes its own
            log.warning("staging.spare_failed bytes=%s user=%s error=%s", size, user, exc)
            with self._lock:
                self._spares.pop(user, None)
            return
        with self._lock:
            self._spares.pop(user, None)
            # closed, or the next version's stage request came first and made its own segment: not a third
            if self._closed or sum(1 for s in self._slots if s.user == user) != 1:
                seg.unlink()
                return
            self._slots.append(Slot(seg, user=user))
            held = sum(s.segment.size for s in self._slots)
        log.info("staging.spare_created bytes=%s user=%s seconds=%.3f held_bytes=%s", seg.size, user,
                 time.perf_counter() - t0, held)

    def find(self, name: str) -> Slot | None:
        with self._lock:
            return next((s for s in self._slots if s.segment.name == name), None)

    def fill(self, slot: Slot, version: int) -> None:
        with self._lock:
            self._writing.discard(id(slot))
            slot.version = version

    def make_spare(self, size: int, user: int) -> bool:
        """Make `user`'s second segment of `size` bytes in the background, faulted in (see the class doc),
        if it has exactly one and none is being made. True if one is being made now."""
        with self._lock:
            if (self._closed or self.device != "cpu" or user in self._spares
                    or sum(1 for s in self._slots if s.user == user) != 1):
                return False
            spare = threading.Thread(target=self._make_spare, args=(size, user), name=f"staging-spare-{user}",
                                     daemon=True)
            self._spares[user] = spare
        spare.start()
        return True

    def release(self, slot: Slot) -> None:
        """The slot's version is no longer kept; it becomes reusable once no transfer reads it."""
        with self._lock:
            self._writing.discard(id(slot))
            slot.version = None

    def close(self) -> None:
        with self._lock:
            self._closed = True  # a spare still being made is unlinked when it is done
            for s in self._slots:
                s.segment.unlink()
            self._slots.clear()
