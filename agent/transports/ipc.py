"""IPC transport: same node, zero-copy. POSIX shared memory on CPU, CUDA IPC handles on GPU; one code
path, so CI exercises the protocol the GPU path uses.

The sender owns `num_slots` segments (reused across buckets and versions). For bucket k it packs slot
k % num_slots and sends ONE handle for the whole flattened bucket over the control link; each
destination opens the handle, reads the bucket in place (views, no copy), drops every view and only
then sends `ipc.release`. The sender repacks a slot only after every destination released it, so an
owner never rewrites memory a reader still reads.

Handle life: a reader keeps a segment mapped while the owner keeps reusing it (mapping 64 MiB costs
about as much as copying it: measured 18 ms populate + 15-20 ms unmap vs 10-30 ms copy on the CI
machine; torch caches CUDA IPC opens for the same reason). It closes the mapping before the owner
frees or replaces the segment (the owner announces a new segment for that slot, or the transport is
closed / aborted), which is the case that breaks (Awex: an illegal memory access follows the trainer's
re-allocation). A release with a view still alive is refused, so a leaked view can never dangle.

Messages (over the Mailbox of each src<->dst pair):
    src -> dst  ipc.bucket  {index, version, handle}
    dst -> src  ipc.release {index, version}
"""

from __future__ import annotations

import base64
import contextlib
import logging
import mmap
import os
import re
import secrets
import weakref
from typing import Any

import torch

from weightsync.agent.plan import BucketPlan
from weightsync.agent.staging.segments import SHARED, CudaSegment, MappedFile
from weightsync.agent.transports.base import (
    Endpoint,
    Pending,
    Transport,
    TransportContext,
    TransportError,
    dst,
    register,
    src,
)

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


def cleanup_stale(shm_dir: str = SHM_DIR, prefix: str = "weightsync") -> int:
    """Unlink segments `<prefix>-<pid>-*` whose owner process is gone (an owner that crashed never
    unlinked them). Returns how many were removed. Best effort: a pid reused by a live process keeps
    its files."""
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-[0-9a-f]+-s\d+$")
    removed = 0
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return 0
    for name in names:
        m = pattern.match(name)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # the owner is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, owned by someone else
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(shm_dir, name))
            removed += 1
    if removed:
        log.info("ipc.cleanup_stale removed=%s dir=%s prefix=%s", removed, shm_dir, prefix)
    return removed


class _ShmSegment:
    """A named POSIX shared-memory file mapped into this process, viewed as a uint8 tensor."""

    def __init__(self, path: str, nbytes: int, *, create: bool, offset: int = 0) -> None:
        """Create (owner) or open (reader) `path`; a reader may map only bytes [offset, offset+nbytes)."""
        self.path = path
        self.nbytes = nbytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise TransportError(f"cannot {'create' if create else 'open'} shared memory {path}: {exc}") from exc
        delta = offset % mmap.ALLOCATIONGRANULARITY
        try:
            if create:
                os.ftruncate(fd, max(nbytes, 1))
            elif os.fstat(fd).st_size < offset + nbytes:
                raise TransportError(f"shared memory {path} holds {os.fstat(fd).st_size} bytes, "
                                     f"need {offset + nbytes}")
            # Readers prefault the mapping in one call (MAP_POPULATE): cheaper than a fault per page.
            mflags = mmap.MAP_SHARED | (0 if create else getattr(mmap, "MAP_POPULATE", 0))
            self._mm: mmap.mmap | None = mmap.mmap(fd, max(delta + nbytes, 1), flags=mflags, offset=offset - delta)
        finally:
            os.close(fd)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8, count=max(nbytes, 1),
                                                            offset=delta)

    def close(self) -> None:
        """Unmap. Refuses (TransportError) while any view of the mapping is alive: torch.frombuffer does
        not pin the mapping, so unmapping under a live view would leave it dangling."""
        if self._mm is None:
            return
        if self.tensor is not None:
            storage = self.tensor.untyped_storage()
            users = torch._C._storage_Use_Count(storage._cdata)  # our tensor + `storage` itself
            del storage
            if users > 2:
                raise TransportError(
                    f"cannot close shared memory {self.path}: {users - 2} tensor view(s) of it are still alive "
                    "after on_bucket returned; copy (load) tensors inside the callback instead of keeping them"
                )
        self.tensor = None
        self._mm.close()
        self._mm = None

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


#: Who exported a CUDA handle: a colocated agent is both the trainer's stager and the engine's receiver, and CUDA
#: refuses to open a process's own IPC handle ("invalid device context", seen on an H100), so such a handle is
#: resolved here, to the exported tensor (held by its sender until the bucket is released), instead.
_PROCESS = secrets.token_hex(8)
_OWN_EXPORTS: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()


def _cuda_storage_key(h: dict[str, Any]) -> str:
    """A CUDA IPC handle names the allocator's whole block, which holds many tensors: a storage is the block's
    bytes [storage_offset, storage_offset + size)."""
    return f"{h.get('handle')}@{h.get('storage_offset')}+{h.get('size')}"


def _cuda_handle(t: torch.Tensor) -> dict[str, Any]:
    """A JSON-able CUDA IPC handle for the whole storage of `t` (no pickle on the wire)."""
    storage = t.untyped_storage()
    (device, handle, size, st_offset, ref_handle, ref_offset, event_handle, event_sync) = storage._share_cuda_()
    b64 = base64.b64encode
    h = {"type": "cuda", "device": int(device), "handle": b64(handle).decode(), "size": int(size),
         "storage_offset": int(st_offset), "offset": t.data_ptr() - storage.data_ptr(),
         "ref_handle": b64(ref_handle).decode(), "ref_offset": int(ref_offset),
         "event_handle": b64(event_handle).decode() if event_handle else "", "event_sync": bool(event_sync),
         "process": _PROCESS}
    _OWN_EXPORTS[_cuda_storage_key(h)] = t
    return h


def _open_cuda(h: dict[str, Any], nbytes: int, device: torch.device) -> torch.Tensor:
    """The whole storage a handle names, as `nbytes` uint8 on `device`: mapped from the exporting process, or
    this process's own tensor when it exported the handle itself."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    b64 = base64.b64decode
    dev = device.index if device.index is not None else int(h["device"])
    if h.get("process") == _PROCESS:
        own = _OWN_EXPORTS.get(_cuda_storage_key(h))
        if own is None:
            raise TransportError("this process's own CUDA export is gone (its sender released it)")
        if own.untyped_storage().nbytes() != nbytes:
            raise TransportError(f"own CUDA export has {own.untyped_storage().nbytes()} bytes, the handle says {nbytes}")
        # the export bumped the storage's IPC ref counter, which a mapping in another process would take over
        torch.UntypedStorage._release_ipc_counter(b64(h["ref_handle"]), int(h["ref_offset"]), device=dev)
        whole = torch.empty(0, dtype=torch.uint8, device=own.device)
        return whole.set_(own.untyped_storage(), 0, (nbytes,), (1,))
    t: torch.Tensor = rebuild_cuda_tensor(
        torch.Tensor, (nbytes,), (1,), 0, torch.storage.UntypedStorage, torch.uint8, dev,
        b64(h["handle"]), int(h["size"]), int(h["storage_offset"]), False, b64(h["ref_handle"]), int(h["ref_offset"]),
        b64(h["event_handle"]) if h["event_handle"] else b"", bool(h["event_sync"]),
    )
    if t.untyped_storage().nbytes() != int(h["size"]):  # torch's per-process cache held another storage there
        raise TransportError(f"CUDA IPC storage has {t.untyped_storage().nbytes()} bytes, the handle says {h['size']}")
    return t


class _ReleasePending(Pending[None]):
    def __init__(self, transport: IpcTransport, bucket: BucketPlan, keep: torch.Tensor | None = None) -> None:
        self._t = transport
        self._bucket = bucket
        self._left = list(bucket.dsts)
        self._keep = keep  # the exported tensor stays alive until every reader released it

    def wait(self, timeout: float | None = None) -> None:
        while self._left:
            d = self._left[0]
            try:
                self._t._peer(dst(d)).get("ipc.release", timeout=timeout,
                                          match={"index": self._bucket.index, "version": self._t._version})
            except Exception as exc:
                raise TransportError(f"destination rank {d} did not release bucket {self._bucket.index}: {exc}") from exc
            self._left.pop(0)
        self._keep = None


class _OpenPending(Pending[torch.Tensor]):
    def __init__(self, transport: IpcTransport, bucket: BucketPlan, slot: int) -> None:
        self._t = transport
        self._bucket = bucket
        self._slot = slot
        self._result: torch.Tensor | None = None

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        if self._result is None:
            b = self._bucket
            try:
                h, _ = self._t._peer(src(b.src)).get("ipc.bucket", timeout=timeout,
                                                     match={"index": b.index, "version": self._t._version})
            except Exception as exc:
                raise TransportError(f"no handle for bucket {b.index} from source rank {b.src}: {exc}") from exc
            self._result = self._t._open(h["handle"], b, self._slot)
        return self._result


@register("ipc")
class IpcTransport(Transport):
    """Flattened buckets through shared memory (CPU) or CUDA IPC (GPU) on one node."""

    name = "ipc"

    def __init__(self, *, shm_dir: str = SHM_DIR, prefix: str = "weightsync",
                 accept_prefixes: tuple[str, ...] = (), close_each_bucket: bool = False) -> None:
        """`prefix`: name prefix of the segments this owner creates. A reader maps only files in `shm_dir`
        whose names start with `prefix` or one of `accept_prefixes` (e.g. the agent's staging segments).
        `close_each_bucket`: a reader unmaps every handle before releasing its bucket (strict, slower on
        CPU) instead of keeping it mapped until the owner replaces or frees the segment."""
        self.close_each_bucket = close_each_bucket
        self.shm_dir = shm_dir
        self.prefix = prefix
        self.accept_prefixes = (prefix, *accept_prefixes)
        self._ctx: TransportContext | None = None
        self._send: list[_ShmSegment | torch.Tensor | None] = [None] * self.num_slots
        self._shared: list[tuple[str, torch.Tensor]] = []  # owner: registered segments (path, mapping)
        # reader: mappings by identity; which identity an owner slot currently uses; my slot -> identity
        self._maps: dict[str, _ShmSegment | torch.Tensor] = {}
        self._slot_ident: dict[tuple[int, int], str] = {}
        self._lent: dict[int, str] = {}
        # reader: this process's own CUDA exports it resolved (a colocated agent), lent in place to a Custom
        # engine through SHARED, by id of the mapping in _maps
        self._own_lent: dict[int, CudaSegment] = {}
        self.handles_opened = 0
        self._cleaned = False

    @property
    def _version(self) -> int:
        return self._ctx.version if self._ctx is not None else -1

    def _peer(self, ep: Endpoint) -> Any:
        assert self._ctx is not None
        try:
            return self._ctx.peers[ep]
        except KeyError:
            raise TransportError(f"no control link to {ep}") from None

    # -- owner side ----------------------------------------------------------------------------------
    def bind(self, ctx: TransportContext) -> None:
        self._ctx = ctx
        if ctx.me.role != "src":
            return
        if not self._cleaned and ctx.device.type == "cpu":
            cleanup_stale(self.shm_dir, self.prefix)  # segments of owners that crashed before unlinking
            self._cleaned = True
        need = max(ctx.plan.max_bucket_nbytes(src=ctx.me.rank), 1)
        for i, seg in enumerate(self._send):
            if isinstance(seg, _ShmSegment) and seg.nbytes >= need and ctx.device.type == "cpu":
                continue
            if isinstance(seg, torch.Tensor) and seg.numel() >= need and seg.device == ctx.device:
                continue
            self._free_send(i)
            if ctx.device.type == "cuda":
                self._send[i] = torch.empty(need, dtype=torch.uint8, device=ctx.device)
            else:
                path = os.path.join(self.shm_dir, f"{self.prefix}-{os.getpid()}-{secrets.token_hex(6)}-s{i}")
                self._send[i] = _ShmSegment(path, need, create=True)

    def register_shared(self, path: str, mapping: torch.Tensor) -> None:
        """Declare that `mapping` (1-d uint8) is the whole of shared-memory file `path` (e.g. a staging
        segment the trainer wrote into), so buckets laid out inside it are handed out without a pack.
        Registering a path again replaces its mapping; segments whose file is gone are forgotten (their
        memory is not kept alive here)."""
        self._shared = [(p, m) for p, m in self._shared if p != path and os.path.exists(p)]
        self._shared.append((path, mapping))

    def _free_send(self, i: int) -> None:
        seg = self._send[i]
        if isinstance(seg, _ShmSegment):
            seg.close()
            seg.unlink()
        self._send[i] = None

    def send_buffer(self, slot: int) -> torch.Tensor:
        seg = self._send[slot]
        if seg is None:
            raise TransportError("transport used before bind()")
        t = seg.tensor if isinstance(seg, _ShmSegment) else seg
        assert t is not None
        return t

    def _announce(self, bucket: BucketPlan, handle: dict[str, Any], keep: torch.Tensor | None = None) -> Pending[None]:
        for d in bucket.dsts:
            self._peer(dst(d)).send("ipc.bucket", index=bucket.index, version=self._version, handle=handle)
        return _ReleasePending(self, bucket, keep)

    def start_send(self, bucket: BucketPlan, slot: int) -> Pending[None]:
        seg = self._send[slot]
        if isinstance(seg, _ShmSegment):
            handle: dict[str, Any] = {"type": "shm", "path": seg.path, "size": seg.nbytes, "offset": 0}
        elif isinstance(seg, torch.Tensor):
            torch.cuda.current_stream(seg.device).synchronize()  # the pack must land before readers look
            handle = _cuda_handle(seg)
        else:
            raise TransportError("transport used before bind()")
        handle["slot"] = slot
        return self._announce(bucket, handle)

    def supports_direct_send(self, data: torch.Tensor) -> bool:
        """CUDA: any device memory can be exported. CPU: only memory inside a registered segment."""
        if data.device.type == "cuda":
            return True
        lo, n = data.data_ptr(), data.numel()
        return any(m.data_ptr() <= lo and lo + n <= m.data_ptr() + m.numel() for _, m in self._shared)

    def start_send_from(self, bucket: BucketPlan, data: torch.Tensor) -> Pending[None] | None:
        if data.device.type == "cuda":
            torch.cuda.current_stream(data.device).synchronize()
            return self._announce(bucket, _cuda_handle(data), keep=data)
        lo = data.data_ptr()
        for path, mapping in self._shared:
            base = mapping.data_ptr()
            if base <= lo and lo + bucket.nbytes <= base + mapping.numel():
                return self._announce(bucket, {"type": "shm", "path": path, "size": mapping.numel(),
                                               "offset": lo - base})
        return None

    # -- reader side -----------------------------------------------------------------------------------
    def _open(self, handle: dict[str, Any], bucket: BucketPlan, slot: int) -> torch.Tensor:
        assert self._ctx is not None
        kind = handle.get("type")
        ident = f"{kind}:{_cuda_storage_key(handle) if kind == 'cuda' else handle.get('path')}"
        if "slot" in handle:  # an owner slot now backed by another segment: unmap the one it replaced
            key = (bucket.src, int(handle["slot"]))
            old = self._slot_ident.get(key)
            if old is not None and old != ident and old in self._maps:
                self._close_map(self._maps.pop(old))
            self._slot_ident[key] = ident
        size = int(handle.get("size", bucket.nbytes))
        offset = int(handle.get("offset", 0))
        if offset < 0 or offset + bucket.nbytes > size:
            raise TransportError(f"handle of bucket {bucket.index} does not cover its {bucket.nbytes} bytes")
        if self.close_each_bucket and kind == "shm":
            # strict: map just this bucket's bytes, unmapped again at release
            ident = f"{ident}@{offset}+{bucket.nbytes}"
            size, map_offset, offset = bucket.nbytes, offset, 0
        else:
            map_offset = 0
        mapped = self._maps.get(ident)
        if mapped is not None and kind == "cuda":
            # Every export bumped a ref counter on the owner's side; release it as torch's own cache
            # hit does, or the owner can never free the block.
            torch.UntypedStorage._release_ipc_counter(
                base64.b64decode(handle["ref_handle"]), int(handle["ref_offset"]), device=self._ctx.device)
        if mapped is None:
            self._forget_unlinked()
            if kind == "shm":
                path = str(handle.get("path", ""))
                name = os.path.basename(path)
                if os.path.dirname(path) != self.shm_dir or not name.startswith(self.accept_prefixes):
                    raise TransportError(f"refusing shared memory path {path!r}: not {self.shm_dir}/"
                                         f"{{{','.join(self.accept_prefixes)}}}-*")
                mapped = _ShmSegment(path, size, create=False, offset=map_offset)
                if map_offset == 0:
                    SHARED.add(MappedFile(path, mapped))  # a Custom engine can load from it in place
            elif kind == "cuda":
                if self._ctx.device.type != "cuda":
                    raise TransportError("got a CUDA IPC handle but this receiver's device is CPU")
                try:
                    mapped = _open_cuda(handle, size, self._ctx.device)
                except Exception as exc:
                    raise TransportError(f"cannot open the CUDA IPC handle of bucket {bucket.index}: {exc}") from exc
                if handle.get("process") == _PROCESS:
                    self._lend_own(mapped)
            else:
                raise TransportError(f"unknown IPC handle type {kind!r}")
            self.handles_opened += 1
            self._maps[ident] = mapped
        self._lent[slot] = ident
        full = mapped.tensor if isinstance(mapped, _ShmSegment) else mapped
        assert full is not None
        return full[offset : offset + bucket.nbytes]

    def start_recv(self, bucket: BucketPlan, slot: int) -> Pending[torch.Tensor]:
        return _OpenPending(self, bucket, slot)

    def release_recv(self, bucket: BucketPlan, slot: int) -> None:
        ident = self._lent.pop(slot, None)
        mapped = self._maps.get(ident) if ident is not None else None
        if isinstance(mapped, _ShmSegment) and mapped.tensor is not None:
            storage = mapped.tensor.untyped_storage()
            users = torch._C._storage_Use_Count(storage._cdata)  # the mapping's tensor + `storage`
            del storage
            if users > 2:
                raise TransportError(
                    f"bucket {bucket.index}: {users - 2} view(s) of the shared memory are still alive after "
                    "on_bucket returned; copy (load) tensors inside the callback instead of keeping them"
                )
        elif isinstance(mapped, torch.Tensor):
            torch.cuda.current_stream(mapped.device).synchronize()  # consumers' copies must be done
        if self.close_each_bucket and ident is not None and ident not in self._lent.values():
            gone = self._maps.pop(ident, None)
            if gone is not None:
                self._close_map(gone)
                if isinstance(gone, torch.Tensor):
                    del gone
                    torch.cuda.ipc_collect()
        self._peer(src(bucket.src)).send("ipc.release", index=bucket.index, version=self._version)

    def _forget_unlinked(self) -> None:
        """Unmap shared-memory files their owner unlinked (e.g. a staging segment it replaced), unless lent:
        a mapping kept for reuse must not keep freed memory alive."""
        lent = set(self._lent.values())
        for ident, mapped in list(self._maps.items()):
            if ident not in lent and isinstance(mapped, _ShmSegment) and not os.path.exists(mapped.path):
                self._close_map(self._maps.pop(ident))

    def _lend_own(self, mapped: torch.Tensor) -> None:
        """A CUDA export of this very process (a colocated agent's staging), resolved in place: registered as
        shared memory so that a Custom engine maps the staged bytes themselves instead of a packed copy (only
        an own export can be shared on: torch refuses to re-export CUDA memory it received over IPC)."""
        lend = CudaSegment(mapped, f"{self.prefix}-own-{secrets.token_hex(6)}")
        self._own_lent[id(mapped)] = lend
        SHARED.add(lend)

    def _close_map(self, mapped: _ShmSegment | torch.Tensor) -> None:
        lent = self._own_lent.pop(id(mapped), None)
        if lent is not None:
            SHARED.forget(lent)  # the engine unmaps it (take_gone) before the staging memory can be freed
        if isinstance(mapped, _ShmSegment):
            SHARED.forget(os.path.basename(mapped.path), holder=mapped)  # this mapping only
            with contextlib.suppress(TransportError):
                mapped.close()

    def _close_maps(self) -> None:
        cuda = any(isinstance(m, torch.Tensor) for m in self._maps.values())
        for mapped in self._maps.values():
            self._close_map(mapped)
        self._maps.clear()
        self._slot_ident.clear()
        self._lent.clear()
        if cuda:
            torch.cuda.ipc_collect()

    def abort(self, reason: str) -> None:
        self._close_maps()

    def close(self) -> None:
        """Unmap everything this reader mapped and unlink the segments this owner created."""
        self._close_maps()
        for i in range(len(self._send)):
            self._free_send(i)

    def describe(self) -> dict[str, object]:
        dev = self._ctx.device.type if self._ctx else "unbound"
        return {"transport": self.name, "mechanism": "cuda-ipc" if dev == "cuda" else "posix-shm",
                "handles_opened": self.handles_opened}
