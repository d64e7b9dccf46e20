"""Ring staging: the trainer agent's staging bounded by bucket size x pipeline depth, whatever the model size.

Why: whole-version staging (agent/staging/versions.py `StagedVersions`, segments from agent/staging/segments.py) holds the
newest complete version and the one being published: 2 x the trainer's shard bytes. In ring mode
(`WEIGHTSYNC_STAGING=ring` on the trainer pod's agent) the trainer copies nothing at publish time; a
transfer streams the version through a ring of `depth` bucket-sized slots instead:

    publish(v)     the trainer announces its shards' metadata and keeps the source (below); the agent
                   announces v to the inference agents as usual
    transfer of v  for bucket k of the plan (plan order): wait until slot k % depth is free (the send of
                   bucket k - depth completed), ask the trainer process to copy bucket k into it (`fill`:
                   each piece straight from its tensor to its place in the slot, one strided copy), send it
                   from the slot (no pack: every transport sends from shared staging), and go on with bucket
                   k + 1 while bucket k is on the wire and bucket k - 1 is loading on the other side

So the agent's staging is `depth` x the rank's largest bucket per transfer in flight (one per inference
replica that loads at the same time), and the trainer's copy is still the only one per byte and transfer.

What the trainer keeps as the source of a streamed version (`TrainerSession(ring_snapshot=...)`):

* CUDA tensors (`auto`, `copy`): a device-side snapshot (a clone on the GPU): training is held for that D2D
  copy only; the fills then copy device -> ring (pinned host memory when the agent's device is the CPU, so
  D2H runs at DMA speed). The snapshot costs device memory = the shard (reported as `snapshot_bytes`) and
  one device copy per byte (counted as `snapshot`).
* CPU tensors, `auto` / `none` ("hold"): no snapshot: `publish` returns only once every inference replica
  serves the version (`wait_served`, bounded by `hold_timeout`), because the fills read the trainer's own
  tensors. Memory stays bounded and each byte is copied once, but training is held for the whole transfer;
  a replica that does not load the version while it is held catches up with a later version.
* CPU tensors, `copy`: a host snapshot (a private clone in the trainer process): training is held for one
  memcpy, but host memory grows by the shard (reported as `snapshot_bytes`, copies counted as `snapshot`).

The snapshot (or held tensors) of a version stays until the agent drops the version (keep / eviction, as
for whole-version staging: a version a transfer reads stays until the transfer ends).

Local protocol. The trainer's main connection: `stage` with `stream: true` (a client that can stream) gets
`ring: {depth}` in ring mode; then `publish_stream {version, rank, tensors, aliases, snapshot_bytes, hold}`;
a held publish ends with `release {version, rank}`. A second connection per trainer rank (hello kind
`trainer_stream`) carries the agent's requests to the trainer process: `layout {key, buckets}` (the plan's
buckets of this rank: [name, offset in the shard, shape, byte offset in the bucket] per entry, once per
plan), `fill {version, key, bucket, segment, at}` (copy bucket `bucket` into the segment at byte `at`)
and `drop {version}` (forget the version's source).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from weightsync.agent.plan import BucketPlan, TransferPlan
from weightsync.agent.staging import segments
from weightsync.agent.wire import local
from weightsync.crds import contract

log = logging.getLogger(__name__)

ENV_STAGING = contract.ENV_STAGING  # version (default) | ring: the operator sets it from spec.transfer.staging
ENV_DEPTH = contract.ENV_STAGING_DEPTH  # ring slots per transfer (default 2)
STAGING_MODES = ("version", "ring")
DEFAULT_DEPTH = 2
SNAPSHOT_MODES = ("auto", "copy", "none")


class RingError(RuntimeError):
    """A streamed bucket could not be filled (the trainer process is gone, or dropped the version)."""


def staging_mode_from_env(env: Mapping[str, str] | None = None) -> tuple[str, int]:
    """(mode, depth) from the agent's environment; ValueError names the variable and what it accepts."""
    env = os.environ if env is None else env
    mode = (env.get(ENV_STAGING) or "version").strip().lower()
    if mode not in STAGING_MODES:
        raise ValueError(f"{ENV_STAGING}={mode!r}: expected one of {', '.join(STAGING_MODES)}")
    raw = (env.get(ENV_DEPTH) or str(DEFAULT_DEPTH)).strip()
    try:
        depth = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_DEPTH}={raw!r}: expected an integer >= 1") from None
    if depth < 1:
        raise ValueError(f"{ENV_DEPTH}={depth}: expected an integer >= 1")
    return mode, depth


def bucket_layout(plan: TransferPlan, src: int) -> list[list[list[Any]]]:
    """The buckets source rank `src` sends, as the trainer fills them: per bucket, per entry
    [name, offset of the piece in the rank's shard, shape, byte offset in the bucket]."""
    out = []
    for b in plan.buckets_from(src):
        out.append([[e.piece.name, [o - so for o, so in zip(e.piece.box.offset, e.piece.src_box.offset, strict=True)],
                     list(e.piece.box.shape), int(e.offset)] for e in b.entries])
    return out


class _Filler:
    """The agent's end of a trainer rank's `trainer_stream` connection."""

    def __init__(self, rank: int, conn: local.LocalConn) -> None:
        self.rank = rank
        self.conn = conn
        self.layouts: set[str] = set()
        self.lock = threading.Lock()
        self.dead = False

    def request(self, header: dict[str, Any], timeout: float) -> dict[str, Any]:
        try:
            return self.conn.request(header, timeout=timeout)
        except (OSError, local.LocalProtocolError) as exc:
            if not isinstance(exc, local.PeerAnswer):
                self.dead = True  # a timeout or a lost connection: a late reply would answer the next request
            raise RingError(f"trainer rank {self.rank} could not {header.get('op')}: {exc}") from exc


class RingSource:
    """One transfer's ring: `depth` slots of the rank's largest bucket in one staging segment; `fill(k, i)`
    has the trainer process copy bucket k into slot i and returns its bytes (a uint8 view)."""

    def __init__(self, ring: BucketRing, filler: _Filler, plan: TransferPlan, src: int, version: int,
                 segment: segments.Segment, slot_bytes: int, timeout: float) -> None:
        self.ring = ring
        self.filler = filler
        self.plan = plan
        self.src = src
        self.version = version
        self.segment = segment
        self.slot_bytes = slot_bytes
        self.depth = ring.depth
        self.timeout = timeout
        self.filled_bytes = 0
        self.fill_seconds = 0.0

    def fill(self, k: int, bucket: BucketPlan, slot: int) -> torch.Tensor:
        t0 = time.perf_counter()
        key = self.plan.hash
        with self.filler.lock:
            if key not in self.filler.layouts:
                self.filler.request({"op": "layout", "key": key, "buckets": bucket_layout(self.plan, self.src)},
                                    self.timeout)
                self.filler.layouts.add(key)
            at = slot * self.slot_bytes
            self.filler.request({"op": "fill", "version": self.version, "key": key, "bucket": k,
                                 "segment": self.segment.handle(), "at": at}, self.timeout)
        self.filled_bytes += bucket.data_nbytes
        self.fill_seconds += time.perf_counter() - t0
        return self.segment.tensor[at:at + bucket.nbytes]


class BucketRing:
    """The trainer agent's ring mode: each trainer rank's `trainer_stream` connection and a pool of ring
    segments (reused across versions and transfers: no fresh shared memory per version). Thread-safe."""

    def __init__(self, prefix: str, depth: int = DEFAULT_DEPTH, device: str = "cpu") -> None:
        if depth < 1:
            raise ValueError(f"ring depth must be >= 1, got {depth}")
        self.depth = depth
        self.device = device
        self._pool = segments.SegmentPool(f"{prefix}-ring", device)
        self._fillers: dict[int, _Filler] = {}
        self._cond = threading.Condition()
        self.rings_in_use = 0

    # --- trainer connections -------------------------------------------------------------------------
    def attach(self, rank: int, conn: local.LocalConn) -> None:
        with self._cond:
            self._fillers[rank] = _Filler(rank, conn)
            self._cond.notify_all()

    def holds(self, rank: int, conn: local.LocalConn) -> bool:
        with self._cond:
            f = self._fillers.get(rank)
            return f is not None and f.conn is conn and not f.dead

    def detach(self, rank: int, conn: local.LocalConn) -> None:
        with self._cond:
            f = self._fillers.get(rank)
            if f is not None and f.conn is conn:
                del self._fillers[rank]

    def filler(self, rank: int, timeout: float = 10.0) -> _Filler:
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                f = self._fillers.get(rank)
                if f is not None and not f.dead:
                    return f
                left = end - time.monotonic()
                if left <= 0:
                    raise RingError(f"trainer rank {rank} has no stream connection to this agent (its process "
                                    "exited or restarted): the version cannot be streamed")
                self._cond.wait(min(left, 0.5))

    def drop(self, version: int, ranks: list[int]) -> None:
        """Tell the ranks' trainer processes to forget `version`'s source (snapshot or held tensors)."""
        for r in ranks:
            with self._cond:
                f = self._fillers.get(r)
            if f is None or f.dead:
                continue
            with f.lock, contextlib.suppress(RingError):
                f.request({"op": "drop", "version": version}, 30.0)

    # --- rings -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def source(self, plan: TransferPlan, src: int, version: int, timeout: float) -> Iterator[RingSource]:
        """A ring for one transfer of `version` from source rank `src`, back in the pool when it ends (also
        when it fails: a dead receiver or trainer frees it)."""
        filler = self.filler(src)
        slot_bytes = segments.align(max(plan.max_bucket_nbytes(src=src), 1))
        slot = self._pool.acquire(slot_bytes * self.depth, user=src)
        with self._cond:
            self.rings_in_use += 1
        try:
            yield RingSource(self, filler, plan, src, version, slot.segment, slot_bytes, timeout)
        finally:
            self._pool.release(slot)
            with self._cond:
                self.rings_in_use -= 1

    def close(self) -> None:
        self._pool.close()


# --- the trainer process's side -------------------------------------------------------------------------
def snapshot_of(tensors: Mapping[str, torch.Tensor], mode: str) -> tuple[dict[str, torch.Tensor], int, bool]:
    """What a streamed version is filled from: (tensors, snapshot bytes, hold). See the module docstring:
    `auto` clones CUDA tensors on their device and holds CPU ones; `copy` clones all; `none` holds all."""
    if mode not in SNAPSHOT_MODES:
        raise ValueError(f"ring_snapshot must be one of {', '.join(SNAPSHOT_MODES)}, got {mode!r}")
    out: dict[str, torch.Tensor] = {}
    nbytes = 0
    hold = False
    cuda: set[torch.device] = set()
    with torch.no_grad():
        for name, t in tensors.items():
            clone = mode == "copy" or (mode == "auto" and t.is_cuda)
            if clone:
                out[name] = t.clone(memory_format=torch.contiguous_format)
                nbytes += t.numel() * t.element_size()
                if t.is_cuda:
                    cuda.add(t.device)
            else:
                out[name] = t
                hold = True
    for d in cuda:
        torch.cuda.synchronize(d)
    return out, nbytes, hold


def fill_slot(tensors: Mapping[str, torch.Tensor], entries: list[list[Any]], seg: segments.Segment, at: int,
              cuda: bool) -> int:
    """Copy one bucket's entries ([name, offset in the shard, shape, byte offset in the bucket]) from
    `tensors` into `seg` at byte `at`: each piece straight to its place (a strided copy; device -> pinned
    host memory is asynchronous, hence the synchronize before the agent may send). Returns the bytes."""
    n = 0
    with torch.no_grad():
        for name, offset, shape, off in entries:
            t = tensors[name]
            region = t[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]
            seg.view(at + int(off), t.dtype, shape).copy_(region, non_blocking=t.is_cuda)
            n += math.prod(shape) * t.element_size()
        if cuda or seg.tensor.is_cuda:
            torch.cuda.synchronize()
    return n


class Streamer:
    """The trainer process's `trainer_stream` connection: a daemon thread that serves the agent's fills from
    the sources of the versions this rank published in ring mode."""

    def __init__(self, socket_path: Any, rank: int, session: str, timeout: float) -> None:
        self.rank = rank
        self._sources: dict[int, tuple[dict[str, torch.Tensor], bool]] = {}  # version -> (tensors, any on CUDA)
        self._layouts: dict[str, list[list[list[Any]]]] = {}
        self._segments: dict[str, segments.Segment] = {}
        self._lock = threading.Lock()
        self.conn = local.connect(socket_path, timeout)
        self.conn.request({"op": "hello", "kind": "trainer_stream", "rank": rank, "pid": os.getpid(),
                           "session": session})
        self.filled_bytes = 0
        self.alive = True
        self._thread = threading.Thread(target=self._serve, name=f"weightsync-stream-{rank}", daemon=True)
        self._thread.start()

    def add(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        cuda = any(t.is_cuda for t in tensors.values())
        with self._lock:
            self._sources[version] = (tensors, cuda)

    def drop(self, version: int) -> None:
        with self._lock:
            self._sources.pop(version, None)

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._sources)

    def _serve(self) -> None:
        try:
            while self.alive:
                h, _ = self.conn.recv()
                try:
                    fields = self._handle(h)
                except Exception as exc:  # the agent aborts the transfer with this message
                    log.warning("stream request op=%s failed: %s", h.get("op"), exc)
                    self.conn.reply_error(f"{type(exc).__name__}: {exc}")
                else:
                    self.conn.reply_ok(**fields)
        except (OSError, local.LocalProtocolError) as exc:
            if self.alive:
                log.info("stream connection to the agent closed: %s", exc)
        finally:
            self.alive = False

    def _handle(self, h: dict[str, Any]) -> dict[str, Any]:
        op = h.get("op")
        if op == "layout":
            self._layouts[str(h["key"])] = h["buckets"]
            if len(self._layouts) > 8:  # plans of older layouts
                self._layouts.pop(next(iter(self._layouts)))
        elif op == "fill":
            self._fill(int(h["version"]), str(h["key"]), int(h["bucket"]), h["segment"], int(h["at"]))
        elif op == "drop":
            self.drop(int(h["version"]))
        else:
            raise ValueError(f"unknown stream op {op!r}")
        return {}

    def _segment(self, handle: dict[str, Any]) -> segments.Segment:
        name = str(handle["name"])
        seg = self._segments.get(name)
        if seg is None or seg.size != int(handle["size"]):
            seg = segments.attach_segment(handle)
            self._segments[name] = seg
        return seg

    def _fill(self, version: int, key: str, k: int, handle: dict[str, Any], at: int) -> None:
        with self._lock:
            held = self._sources.get(version)
        if held is None:
            raise KeyError(f"version {version} is no longer held by trainer rank {self.rank}")
        src, cuda = held
        layout = self._layouts.get(key)
        if layout is None:
            raise KeyError(f"unknown plan {key}")
        self.filled_bytes += fill_slot(src, layout[k], self._segment(handle), at, cuda)

    def close(self) -> None:
        self.alive = False
        self.conn.close()
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()
        with self._lock:
            self._sources.clear()
