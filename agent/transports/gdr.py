"""GDR transport: one-sided NIXL READs of packed buckets straight from the trainer agent's registered
staging slots into the inference agent's memory.

Why one-sided reads: the trainer never tracks who reads, so inference replicas join and leave without a
collective group being rebuilt (a late replica simply binds and reads), and with GPUDirect RDMA the bytes
go NIC -> GPU without a host bounce. NIXL picks the fabric (UCX: InfiniBand/RoCE, cuda_ipc, or tcp/cma
on a CPU-only machine, which is how CI runs this same code).

Protocol on the authenticated control link (H5's Mailbox), per bind (= per version):

    src -> dst  gdr.hello {agent, gen, md_gen, mem, slots, dslots} + payload: NIXL agent metadata
    per bucket k (packed into a slot, or in place in the trainer's staged arena: zero-copy):
    src -> dst  gdr.md    {gen, md_gen} + payload: new metadata (only after a new registration)
    src -> dst  gdr.ready {gen, index, md_gen, src: [addr, len, dev], nbytes, id,
                           delta: {base, nbytes, src} | null}
    dst         NIXL READ of those bytes (or of the encoded delta), verified by the sync hooks
    dst -> src  gdr.done  {gen, index}         (the bytes may change once every dst said done)

Zero-copy (H5's direct hooks): when the trainer's staged tensors already sit like a bucket (a plan
arena), `start_send_from` registers that staging memory with NIXL once and receivers READ straight from
it, no pack; `start_recv_into` READs straight into the destination tensors, no unpack copy.

Descriptors travel as plain JSON (address, length, device) and are rebuilt locally, so nothing from the
network is unpickled. The receiver runs a prefetch worker: up to `num_slots` (K) buckets are read ahead
while earlier ones are unpacked and loaded. `refetch(bucket)` reads a bucket again (used by
verify: Checksum to retry a mismatch): the sender's slot still holds it until `gdr.done`.

Delta sync (optional, `delta=DeltaConfig(...)`): the sender keeps each bucket's previous bytes, encodes
the change into a second registered slot, and offers both; a receiver whose stored base carries the id
the delta was computed against reads the small encoding and applies it, any other receiver (new, late,
or one that failed a version) reads the full bucket. Either way it ends with identical bytes.

Memory: slots live on `ctx.device`. CUDA device -> VRAM registration (GPUDirect RDMA when the NIC and
driver support it); CPU -> pinned host memory when CUDA exists, plain DRAM otherwise. The NIXL agent under
it (registrations, remote metadata, the READ itself) is agent/transports/nixl_endpoint.py.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.agent.plan import BucketPlan, TransferPlan
from weightsync.agent.plan.buckets import allocate
from weightsync.agent.transports import delta as deltamod
from weightsync.agent.transports.base import (
    Endpoint,
    Pending,
    Transport,
    TransportContext,
    TransportError,
    register,
)
from weightsync.agent.transports.nixl_endpoint import NixlEndpoint, desc_of, mem_of
from weightsync.agent.wire.link import LinkTimeout, Mailbox

log = logging.getLogger(__name__)

_POLL_SLICE = 0.25  # seconds: how often blocking waits look at the abort flag


def _triple(v: Any, nbytes: int, what: str) -> tuple[int, int, int]:
    """A remote (address, length, device) from a control frame, checked to cover `nbytes`."""
    try:
        a, n, d = (int(x) for x in v)
    except (TypeError, ValueError):
        raise TransportError(f"{what}: malformed source descriptor {v!r}") from None
    if n < nbytes or a <= 0:
        raise TransportError(f"{what}: source descriptor {v!r} does not cover {nbytes} bytes")
    return a, n, d


@dataclass
class GdrStats:
    """What the transport moved (for describe(), the bench and delta accounting)."""

    buckets: int = 0
    full_bytes: int = 0  # bytes of the buckets as planned
    wire_bytes: int = 0  # bytes actually read (receiver) or offered as the smallest read (sender)
    delta_buckets: int = 0
    refetches: int = 0
    read_seconds: float = 0.0
    encode_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["wire_fraction"] = self.wire_bytes / self.full_bytes if self.full_bytes else 0.0
        return d


@dataclass
class _Remote:
    """What a receiver knows about one source agent for the current bind."""

    agent: str
    gen: int
    md_gen: int
    mem: str
    slots: list[tuple[int, int, int]]
    dslots: list[tuple[int, int, int]]


@dataclass
class _RecvJob:
    bucket: BucketPlan
    slot: int
    out: torch.Tensor | None = None  # zero-copy destination
    future: Future[torch.Tensor] = field(default_factory=Future)


class _FuturePending(Pending[Any]):
    def __init__(self, fut: Future[Any], what: str) -> None:
        self._fut = fut
        self._what = what

    def wait(self, timeout: float | None = None) -> Any:
        try:
            return self._fut.result(timeout)
        except TimeoutError:
            raise TransportError(f"{self._what}: not complete within {timeout}s") from None


class _SendPending(Pending[None]):
    """Completes when every destination of the bucket said gdr.done (the slot may be reused)."""

    def __init__(self, mailboxes: list[tuple[int, Mailbox]], gen: int, index: int, aborted: threading.Event) -> None:
        self._mailboxes = mailboxes
        self._gen = gen
        self._index = index
        self._aborted = aborted
        self._done = False

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        for d, mb in self._mailboxes:
            while True:
                if self._aborted.is_set():
                    raise TransportError(f"bucket {self._index}: transport aborted while waiting for dst{d}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransportError(f"bucket {self._index}: destination rank {d} did not finish reading "
                                         f"within {timeout}s")
                try:
                    mb.get("gdr.done", timeout=min(_POLL_SLICE, left) if left is not None else _POLL_SLICE,
                           match={"gen": self._gen, "index": self._index})
                    break
                except LinkTimeout:
                    continue
        self._done = True


@register("gdr")
class GdrTransport(Transport):
    """NIXL one-sided READ transport. See the module docstring for the protocol.

    `num_slots` is the prefetch depth K (buckets in flight per endpoint). `delta` enables delta sync.
    `endpoint` lets several transports of one process share a NIXL agent (default: one each).
    """

    name = "gdr"

    def __init__(
        self,
        *,
        num_slots: int = 2,
        delta: deltamod.DeltaConfig | None = None,
        endpoint: NixlEndpoint | None = None,
        agent_name: str | None = None,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.delta = delta
        self._own_endpoint = endpoint is None
        self._agent_name = agent_name
        self._nx: NixlEndpoint | None = endpoint
        self.stats = GdrStats()
        self._ctx: TransportContext | None = None
        self._plan: TransferPlan | None = None
        self._aborted = threading.Event()
        self._gen = 0
        # sender
        self._slots: list[torch.Tensor] = []
        self._dslots: list[torch.Tensor] = []
        self._slot_reg: Any = None
        self._base = deltamod.DeltaBase()
        # receiver
        self._remotes: dict[int, _Remote] = {}
        self._rslots: list[torch.Tensor] = []
        self._rsize = 1
        self._rdslots: list[torch.Tensor] = []
        self._store: torch.Tensor | None = None
        self._store_views: dict[int, torch.Tensor] = {}
        self._rreg: Any = None
        self._rkey: tuple[str, str] | None = None
        self._alloc: Callable[[int, torch.device], torch.Tensor] | None = None  # receive buffers (use_allocator)
        self._pending_ids: dict[int, int | None] = {}
        self._targets: dict[int, tuple[torch.Tensor, tuple[int, int, int]]] = {}  # index -> (target, remote)
        self._remote_mem: dict[int, tuple[str, str]] = {}  # index -> (remote agent, remote mem type)
        self._md_known: dict[int, int] = {}  # dst rank -> the endpoint's md_gen it has
        self._jobs: queue.Queue[_RecvJob | None] = queue.Queue()
        self._worker: threading.Thread | None = None

    # ---- common ----

    @property
    def nixl(self) -> NixlEndpoint:
        if self._nx is None:
            self._nx = NixlEndpoint(self._agent_name)
        return self._nx

    def _mailbox(self, ep: Endpoint) -> Mailbox:
        assert self._ctx is not None
        mb = self._ctx.peers.get(ep)
        if mb is None:
            raise TransportError(f"{self._ctx.me}: no control link to {ep}")
        return mb

    def bind(self, ctx: TransportContext) -> None:
        self._aborted.clear()
        plan_changed = self._plan is None or self._plan.hash != ctx.plan.hash
        self._ctx = ctx
        self._plan = ctx.plan
        if ctx.me.role == "src":
            self._bind_src(ctx, plan_changed)
        else:
            self._bind_dst(ctx, plan_changed)

    def describe(self) -> dict[str, object]:
        mem = "VRAM" if self._ctx is not None and self._ctx.device.type == "cuda" else "DRAM"
        return {"transport": self.name, "backend": "nixl/UCX", "ucx_tls": os.environ.get("UCX_TLS"),
                "mem": mem, "prefetch": self.num_slots, "delta": self.delta is not None,
                "agent": self._nx.name if self._nx else None, **self.stats.to_dict()}

    def abort(self, reason: str) -> None:
        self._aborted.set()
        # A half-received bucket must never serve as a delta base.
        for index in list(self._pending_ids):
            self._base.invalidate(index)
        self._pending_ids.clear()
        self._drain_jobs(TransportError(f"GDR transport aborted: {reason}"))

    def close(self) -> None:
        self._aborted.set()
        self._drain_jobs(TransportError("GDR transport closed"))
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join(timeout=5)
            self._worker = None
        if self._nx is not None:
            self._nx.deregister(self._slot_reg)
            self._nx.deregister(self._rreg)
            self._nx.release(self)  # the in-place memory it held (staging arena, shared receive slots)
            if self._own_endpoint:
                self._nx.close()
        self._slot_reg = self._rreg = None
        self._slots, self._dslots, self._rslots, self._rdslots = [], [], [], []
        self._store = None

    # ---- sender ----

    def _bind_src(self, ctx: TransportContext, plan_changed: bool) -> None:
        size = ctx.plan.max_bucket_nbytes(src=ctx.me.rank)
        if not self._slots or self._slots[0].numel() < size or self._slots[0].device != ctx.device:
            self.nixl.deregister(self._slot_reg)
            pin = ctx.device.type == "cpu"
            self._slots = [allocate(max(size, 1), ctx.device, pin_memory=pin) for _ in range(self.num_slots)]
            self._dslots = (
                [allocate(deltamod.max_encoded_bytes(size), ctx.device, pin_memory=pin)
                 for _ in range(self.num_slots)] if self.delta else []
            )
            self._slot_reg = self.nixl.register(self._slots + self._dslots)
        if plan_changed:
            self._base = deltamod.DeltaBase()
        self._gen += 1
        md_gen, md = self.nixl.snapshot()
        mem, _ = mem_of(self._slots[0])
        for ep in sorted(ctx.peers):
            self._mailbox(ep).send(
                "gdr.hello", md, agent=self.nixl.name, gen=self._gen, md_gen=md_gen, mem=mem,
                slots=[list(desc_of(t)) for t in self._slots], dslots=[list(desc_of(t)) for t in self._dslots],
            )
            self._md_known[ep.rank] = md_gen

    def send_buffer(self, slot: int) -> torch.Tensor:
        return self._slots[slot]

    def start_send(self, bucket: BucketPlan, slot: int) -> Pending[None]:
        return self._offer(bucket, self._slots[slot][: bucket.nbytes], self._dslots[slot] if self.delta else None)

    def supports_direct_send(self, data: torch.Tensor) -> bool:
        """Zero-copy send from the staged tensors: possible for any memory NIXL can register (the whole
        storage is registered once and kept registered)."""
        return self._ctx is not None and self._ctx.me.role == "src" and self.delta is None and \
            self._register_storage(data)

    def start_send_from(self, bucket: BucketPlan, data: torch.Tensor) -> Pending[None] | None:
        if not self.supports_direct_send(data):
            return None
        return self._offer(bucket, data[: bucket.nbytes], None)

    def _register_storage(self, data: torch.Tensor) -> bool:
        """Make sure the memory of `data` is registered with NIXL (its whole storage, once per endpoint),
        held for this transport until it closes."""
        return self.nixl.hold(data, self)

    def _offer(self, bucket: BucketPlan, buf: torch.Tensor, dslot: torch.Tensor | None) -> Pending[None]:
        """Tell the bucket's destinations where its bytes (and, with delta sync, its encoding) are."""
        assert self._ctx is not None
        dinfo: dict[str, Any] | None = None
        new_id: int | None = None
        offered = bucket.nbytes
        if self.delta is not None and dslot is not None:
            t0 = time.perf_counter()
            prev = self._base.buffer(bucket.index, bucket.nbytes, buf.device)
            base_id = self._base.id_of(bucket.index)
            if base_id is not None:
                unit = deltamod.unit_for_dtypes(e.piece.dtype for e in bucket.entries)
                enc = deltamod.encode(prev, buf, dslot, self.delta, unit=unit)
                if enc.nbytes is not None:
                    dinfo = {"base": base_id, "nbytes": enc.nbytes, "src": list(desc_of(dslot, enc.nbytes))}
                    offered = enc.nbytes
                    self.stats.delta_buckets += 1
            prev.copy_(buf)
            new_id = deltamod.new_base_id()
            self._base.ids[bucket.index] = new_id
            self.stats.encode_seconds += time.perf_counter() - t0
        self.stats.buckets += 1
        self.stats.full_bytes += bucket.nbytes
        self.stats.wire_bytes += offered
        mem, _ = mem_of(buf)
        snap: tuple[int, bytes] | None = None
        mbs = []
        for d in bucket.dsts:
            mb = self._mailbox(Endpoint("dst", d))
            if self._md_known.get(d, -1) != self.nixl.md_gen:
                # `buf` is registered by now, so any snapshot from here on describes it; the ready names the
                # generation the destination then has (another transport of this endpoint may register more
                # memory meanwhile: that bumps md_gen again, and a later bucket sends it)
                snap = snap if snap is not None else self.nixl.snapshot()
                mb.send("gdr.md", snap[1], gen=self._gen, md_gen=snap[0])
                self._md_known[d] = snap[0]
            mb.send("gdr.ready", gen=self._gen, index=bucket.index, md_gen=self._md_known[d], mem=mem,
                    src=list(desc_of(buf, bucket.nbytes)), nbytes=bucket.nbytes, id=new_id, delta=dinfo)
            mbs.append((d, mb))
        return _SendPending(mbs, self._gen, bucket.index, self._aborted)

    # ---- receiver ----

    def _bind_dst(self, ctx: TransportContext, plan_changed: bool) -> None:
        mine = ctx.plan.buckets_to(ctx.me.rank)
        size = max((b.nbytes for b in mine), default=0)
        key = (ctx.plan.hash, str(ctx.device))
        if plan_changed or self._rkey != key:
            self._rkey = key
            self.nixl.deregister(self._rreg)
            pin = ctx.device.type == "cpu"
            self._base = deltamod.DeltaBase()
            self._store_views = {}
            regs: list[torch.Tensor] = []
            if self.delta is not None:
                # Full buckets land in a per-bucket store that doubles as the next version's delta base.
                offsets, total = {}, 0
                for b in mine:
                    offsets[b.index] = total
                    total += (b.nbytes + 255) // 256 * 256
                self._store = self._recv_buffer(max(total, 1), ctx.device, pin)
                for b in mine:
                    view = self._store[offsets[b.index] : offsets[b.index] + b.nbytes]
                    self._store_views[b.index] = view
                    self._base.bytes_by_index[b.index] = view
                    self._base.ids[b.index] = None
                self._rdslots = [allocate(deltamod.max_encoded_bytes(size), ctx.device, pin_memory=pin)
                                 for _ in range(self.num_slots)]
                self._rslots = []
                regs = [self._store, *self._rdslots]
            else:
                # Receive slots of its own only once a bucket is received without given memory
                # (`_slot_buffer`): behind a RoutingTransport every bucket lands in the destination's shared
                # receive slots, so buffers per (destination, source) pair would only hold memory.
                self._rslots = []
                self._store = None
            self._rsize = max(size, 1)
            self._rreg = self.nixl.register(regs)
        self._remotes = {}
        for ep in sorted(ctx.peers):
            header, payload = self._get(self._mailbox(ep), "gdr.hello", None, ctx.timeout, f"hello from {ep}")
            name = self.nixl.load_remote(str(header["agent"]), bytes(payload), int(header["md_gen"]))
            self._remotes[ep.rank] = _Remote(
                name, int(header["gen"]), int(header["md_gen"]), str(header["mem"]),
                [(int(a), int(n), int(d)) for a, n, d in header["slots"]],
                [(int(a), int(n), int(d)) for a, n, d in header["dslots"]],
            )
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._work, name=f"gdr-prefetch-{ctx.me}", daemon=True)
            self._worker.start()

    def _slot_buffer(self, slot: int) -> torch.Tensor:
        """Receive slot `slot` of this transport's own, allocated and registered on first use."""
        assert self._ctx is not None
        if not self._rslots:
            pin = self._ctx.device.type == "cpu"
            self._rslots = [self._recv_buffer(self._rsize, self._ctx.device, pin) for _ in range(self.num_slots)]
            self.nixl.deregister(self._rreg)
            self._rreg = self.nixl.register(self._rslots)
        return self._rslots[slot]

    def _recv_buffer(self, nbytes: int, device: torch.device, pin: bool) -> torch.Tensor:
        """A buffer buckets are READ into and handed on from: the allocator's (shared with the engine), or
        private (pinned host memory when CUDA exists)."""
        if self._alloc is not None:
            return self._alloc(nbytes, device)
        return allocate(nbytes, device, pin_memory=pin)

    def use_allocator(self, alloc: Callable[[int, torch.device], torch.Tensor]) -> bool:
        """Receive buffers from `alloc` from the next bind on (they are registered with NIXL as usual)."""
        if alloc is not self._alloc:
            self._alloc = alloc
            self._rkey = None  # re-register at the next bind
        return True

    def _get(
        self, mb: Mailbox, kind: str, match: dict[str, Any] | None, timeout: float, what: str
    ) -> tuple[dict[str, Any], memoryview]:
        deadline = time.monotonic() + timeout
        while True:
            if self._aborted.is_set():
                raise TransportError(f"aborted while waiting for {what}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(f"no {what} within {timeout:.0f}s (is the trainer agent alive?)")
            try:
                return mb.get(kind, timeout=min(_POLL_SLICE, left), match=match)
            except LinkTimeout:
                continue

    def start_recv(self, bucket: BucketPlan, slot: int) -> Pending[torch.Tensor]:
        return self._post(_RecvJob(bucket, slot))

    def start_recv_into(self, bucket: BucketPlan, slot: int, out: torch.Tensor) -> Pending[torch.Tensor] | None:
        """Zero-copy receive: READ straight into the destination tensors (registered once). Not with
        delta sync, whose base store must hold the previous bytes."""
        if self.delta is not None or not self._register_storage(out):
            return None
        return self._post(_RecvJob(bucket, slot, out[: bucket.nbytes]))

    def _post(self, job: _RecvJob) -> Pending[torch.Tensor]:
        bucket = job.bucket
        if self._aborted.is_set():
            job.future.set_exception(TransportError(f"bucket {bucket.index}: transport aborted"))
        else:
            self._jobs.put(job)
        return _FuturePending(job.future, f"GDR read of bucket {bucket.index} from source rank {bucket.src}")

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.future.done():
                continue
            try:
                job.future.set_result(self._receive(job.bucket, job.slot, job.out))
            except BaseException as exc:
                err = exc if isinstance(exc, TransportError) else TransportError(
                    f"bucket {job.bucket.index} from source rank {job.bucket.src}: {type(exc).__name__}: {exc}")
                if not job.future.done():
                    job.future.set_exception(err)

    def _receive(self, bucket: BucketPlan, slot: int, out: torch.Tensor | None) -> torch.Tensor:
        assert self._ctx is not None
        remote = self._remotes.get(bucket.src)
        if remote is None:
            raise TransportError(f"bucket {bucket.index}: no GDR hello from source rank {bucket.src}")
        mb = self._mailbox(Endpoint("src", bucket.src))
        what = f"bucket {bucket.index} from source rank {bucket.src}"
        header, _ = self._get(mb, "gdr.ready", {"gen": remote.gen, "index": bucket.index}, self._ctx.timeout, what)
        nbytes = int(header["nbytes"])
        if nbytes != bucket.nbytes:
            raise TransportError(f"{what}: the source offers {nbytes} bytes, the plan says {bucket.nbytes}")
        md_gen = int(header["md_gen"])
        if md_gen != remote.md_gen:  # the source registered more memory (zero-copy staging)
            _h, payload = self._get(mb, "gdr.md", {"gen": remote.gen, "md_gen": md_gen}, self._ctx.timeout,
                                   f"NIXL metadata {md_gen} of source rank {bucket.src}")
            self.nixl.load_remote(remote.agent, bytes(payload), md_gen)
            remote.md_gen = md_gen
        src = _triple(header["src"], nbytes, what)
        mem = str(header.get("mem", remote.mem))
        t0 = time.perf_counter()
        self.stats.buckets += 1
        self.stats.full_bytes += nbytes
        if self.delta is None:
            target = out if out is not None else self._slot_buffer(slot)[:nbytes]
            self._read(target, remote.agent, src, mem)
            self.stats.wire_bytes += nbytes
        else:
            target = self._store_views[bucket.index]
            dinfo = header.get("delta")
            have = self._base.id_of(bucket.index)
            self._base.invalidate(bucket.index)
            if dinfo is not None and have is not None and int(dinfo["base"]) == have:
                enc_n = int(dinfo["nbytes"])
                if enc_n > self._rdslots[slot].numel():
                    raise TransportError(f"{what}: a delta of {enc_n} bytes does not fit a slot")
                landing = self._rdslots[slot][:enc_n]
                self._read(landing, remote.agent, _triple(dinfo["src"], enc_n, what), mem)
                deltamod.apply(target, landing)
                self.stats.wire_bytes += enc_n
                self.stats.delta_buckets += 1
            else:
                self._read(target, remote.agent, src, mem)
                self.stats.wire_bytes += nbytes
            new_id = header.get("id")
            self._pending_ids[bucket.index] = int(new_id) if new_id is not None else None
        self._targets[bucket.index] = (target, src)
        self._remote_mem[bucket.index] = (remote.agent, mem)
        self.stats.read_seconds += time.perf_counter() - t0
        return target

    def _read(self, local: torch.Tensor, agent: str, src: tuple[int, int, int], mem: str) -> None:
        assert self._ctx is not None
        self.nixl.read(local, src, mem, agent, timeout=self._ctx.timeout, aborted=self._aborted)

    def refetch(self, bucket: BucketPlan) -> torch.Tensor:
        """Read bucket `bucket` again, in full, into the same memory (after a checksum mismatch). Valid
        until `release_recv`; the source keeps the bytes unchanged until then."""
        got = self._targets.get(bucket.index)
        where = self._remote_mem.get(bucket.index)
        if got is None or where is None:
            raise TransportError(f"bucket {bucket.index} was not received, nothing to fetch again")
        target, src = got
        self._base.invalidate(bucket.index)
        self._read(target, where[0], src, where[1])
        self.stats.refetches += 1
        self.stats.wire_bytes += target.numel()
        return target

    def release_recv(self, bucket: BucketPlan, slot: int) -> None:
        self._targets.pop(bucket.index, None)
        self._remote_mem.pop(bucket.index, None)
        if self.delta is not None and bucket.index in self._pending_ids:
            self._base.ids[bucket.index] = self._pending_ids.pop(bucket.index)
        remote = self._remotes.get(bucket.src)
        gen = remote.gen if remote is not None else -1
        self._mailbox(Endpoint("src", bucket.src)).send("gdr.done", gen=gen, index=bucket.index)

    def _drain_jobs(self, err: TransportError) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:
                self._jobs.put(None)
                return
            if not job.future.done():
                job.future.set_exception(err)
