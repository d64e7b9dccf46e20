"""Content digest of a version: what lets a replica, the job's status and the engine's weight-version label
name the exact bytes served.

Why per piece, summed: a version moves as pieces (a tensor's region: name, dtype, global shape, box), and
the pieces a replica receives do not depend on which data-parallel trainer rank sent them or how they were
grouped into buckets. The digest is the sum, modulo 2^128, of one 128-bit leaf per distinct piece:

    leaf = xxh3_128(bytes of the piece in row-major order, seed = xxh3_64("name|dtype|shape|offset|size"))

so it is independent of bucket boundaries, source choice and arrival order, costs one xxh3 pass over the
bytes on each side (tens of GB/s per core; no extra copy: the piece's bytes are contiguous in the bucket,
and a bucket sent in place is the trainer's staging itself), and every replica of a job (same inference
layout) gets the same digest for the same weights. Replicas with a different layout get a different one:
the digest names the bytes as this job's engines hold them, not a checkpoint format.

Checked before commit: the sender hashes every piece of a bucket and sends the leaves with it
(`sync.bucket`); the receiver hashes the piece where it landed and refuses the version at the first leaf
that differs, naming the tensor, its box and the source rank. One exception, which reads nothing twice:
a bucket that lands in the very memory this process hashed it in (a Colocated pod's agent hands its own
staging file to the engine over IPC) takes the leaves computed there (`HashedHere`). A mismatch is never
loaded into an engine, let alone committed. CUDA buckets use the on-device weighted sum of agent/transfer/verify.py instead of xxh3 (no
device-to-host copy); the sender names the algorithm and the receiver computes the same one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.agent.hashing import (
    MASK,
    WSUM,
    XXH3_128,
    HashedLeaves,
    Leaves,
    _wsum_leaf,
    _xxhash,
    fmt,
    leaf,
    piece_key,
    wsum_total,
)
from weightsync.agent.plan import BucketPlan
from weightsync.agent.staging.segments import shm_location
from weightsync.agent.staging.versions import SentLeaves
from weightsync.agent.transfer.sync import SyncError, SyncHooks

log = logging.getLogger(__name__)

class DigestMismatch(SyncError):
    """A piece's bytes differ from the leaf its sender computed: the version is not loaded."""


def default_algorithm(data: torch.Tensor) -> str:
    return XXH3_128 if data.device.type == "cpu" else WSUM


PieceIds = tuple[list[str], list[int], list[tuple[int, int]]]


def piece_ids(bucket: BucketPlan) -> PieceIds:
    """(keys, xxh3 seeds, (offset, nbytes) spans) of the bucket's pieces, made once per plan (BucketPlan.memo):
    the key strings and their seeds cost more than hashing a small piece's bytes, and they never change."""
    ids: PieceIds | None = bucket.memo.get("piece_ids")
    if ids is None:
        keys = [piece_key(e.piece.name, e.piece.dtype, e.piece.global_shape, e.piece.box.offset, e.piece.box.shape)
                for e in bucket.entries]
        seed = _xxhash().xxh3_64_intdigest
        ids = bucket.memo["piece_ids"] = (keys, [seed(k.encode()) for k in keys],
                                          [(e.offset, e.piece.nbytes) for e in bucket.entries])
    return ids


def bucket_leaves(bucket: BucketPlan, data: torch.Tensor, algorithm: str) -> list[tuple[str, int]]:
    """(key, leaf) of every piece of `bucket`, read where it sits in `data` (the bucket's bytes).

    XXH3_128: one host buffer for the bucket, each piece hashed from a slice of it (the leaves of leaves.leaf,
    without a tensor view per piece). WSUM (GPU buckets): every piece's sum is queued on the device and all are
    read back together. A read per piece waited for the device once per tensor (hundreds per GiB), each wait
    also stalling the launches queued behind it."""
    keys, seeds, spans = piece_ids(bucket)
    if algorithm == XXH3_128 and data.dtype == torch.uint8 and data.dim() == 1:
        host = data if data.device.type == "cpu" else data.cpu()
        if not host.is_contiguous():
            host = host.contiguous()
        mem = host.numpy().data if host.numel() else memoryview(b"")
        h = _xxhash().xxh3_128_intdigest
        return [(k, int(h(mem[o:o + n], seed=sd))) for k, sd, (o, n) in zip(keys, seeds, spans, strict=True)]
    views = [data[o : o + n] for o, n in spans]
    if algorithm == WSUM and views:
        totals = torch.stack([wsum_total(s) for s in views]).tolist()  # the one device sync of this bucket
        return [(k, _wsum_leaf(k, int(v), s.numel())) for k, v, s in zip(keys, totals, views, strict=True)]
    return [(k, leaf(k, s, algorithm)) for k, s in zip(keys, views, strict=True)]


@dataclass
class Digest:
    """A version's digest as pieces arrive: distinct keys only (a region two destination ranks both hold
    counts once), thread-safe (one receiver thread per destination rank adds to it)."""

    leaves: dict[str, int] = field(default_factory=dict)
    unchecked: bool = False  # some source sent no leaves to check against (an agent of an earlier release)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, key: str, value: int) -> None:
        with self._lock:
            old = self.leaves.setdefault(key, value)
        if old != value:
            raise DigestMismatch(f"piece {key} arrived twice with different bytes ({fmt(old)} vs {fmt(value)})")

    def add_all(self, leaves: Leaves) -> None:
        """`add` for a bucket's leaves, under one lock."""
        with self._lock:
            put = self.leaves.setdefault
            clash = [(k, old, v) for k, v in leaves if (old := put(k, v)) != v]
        if clash:
            k, old, v = clash[0]
            raise DigestMismatch(f"piece {k} arrived twice with different bytes ({fmt(old)} vs {fmt(v)})")

    def value(self) -> int:
        with self._lock:
            return sum(self.leaves.values()) & MASK

    def hex(self) -> str:
        return fmt(self.value())


def combine(leaves: Mapping[str, int]) -> str:
    """The digest of a set of distinct pieces (what `Digest.hex` gives)."""
    return fmt(sum(leaves.values()))


@dataclass
class DigestStats:
    pieces: int = 0
    bytes: int = 0
    seconds: float = 0.0
    #: sender: bytes whose leaves an earlier transfer of the same staged bytes computed; receiver: bytes that
    #: landed in the memory this process's sender hashed them in (HashedHere)
    reused_bytes: int = 0


MemoryKey = tuple[Any, ...]


def memory_key(version: int, bucket: BucketPlan, data: torch.Tensor, algorithm: str) -> MemoryKey | None:
    """What `data` (a bucket's bytes) is, however this process mapped it: its shared-memory file and offset,
    with the version, bucket, source rank and algorithm. None for other memory (a wire's receive slot, a
    pack buffer, GPU memory): only a file's name says that two mappings are the same bytes."""
    where = shm_location(data)
    if where is None:
        return None
    return (version, bucket.index, bucket.src, algorithm, *where, data.numel() * data.element_size())


class HashedHere:
    """The leaves this process computed over buckets in shared-memory files, by `memory_key`.

    Why: in a Colocated pod one agent both stages the trainer's version and hands its buckets to the engine
    over IPC, so the bucket its receiver gets is the very file region its sender hashed a moment before.
    Hashing it again reads every byte a second time (about 30 ms per GiB on a CPU core) to learn nothing.
    A receiver takes these leaves only for the same file region, version, bucket and source, and only when
    the pieces' keys and leaves are the ones the bucket's metadata carries. A bucket that came over a wire
    lands in other memory and is always hashed. A receiver reads an entry moments after its sender wrote it
    (the bucket is in flight), so the table is small: bounded in leaves, oldest first out (a few MB)."""

    MAX_LEAVES = 1 << 16

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[MemoryKey, HashedLeaves] = OrderedDict()
        self._count = 0

    def put(self, key: MemoryKey | None, hashed: HashedLeaves) -> None:
        if key is None:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            self._count += len(hashed.leaves) - (len(old.leaves) if old is not None else 0)
            self._entries[key] = hashed
            while self._count > self.MAX_LEAVES and len(self._entries) > 1:
                _, gone = self._entries.popitem(last=False)
                self._count -= len(gone.leaves)

    def get(self, key: MemoryKey | None) -> HashedLeaves | None:
        if key is None:
            return None
        with self._lock:
            return self._entries.get(key)

    def __len__(self) -> int:
        return len(self._entries)


HASHED_HERE = HashedHere()


@dataclass
class DigestHooks(SyncHooks):
    """SyncHooks that carry every piece's leaf with its bucket and check it on arrival, wrapping the
    `verify: Checksum` hooks when the job asks for them (their bucket checksum and retry run first).

    Sender: `on_send_bucket` adds {"digest": {"algorithm", "leaves": [hex per entry]}} to the bucket's
    metadata. Receiver: `on_recv_bucket` recomputes each leaf, raises DigestMismatch at the first one that
    differs, and adds the leaves to `digest` (shared by the agent's destination ranks)."""

    inner: SyncHooks | None = None
    digest: Digest | None = None
    algorithm: str | None = None
    stats: DigestStats = field(default_factory=DigestStats)
    #: sender: the leaves of the buckets of one staged version and plan, by (bucket index, algorithm), kept by
    #: the trainer agent with the staged bytes, so that the transfers to the other replicas (and a retry) send
    #: the leaves the first transfer computed instead of hashing the same bytes once per replica. A receiver
    #: still hashes what landed and compares: bytes that changed in staging between two transfers fail there.
    sent_leaves: SentLeaves | None = None
    #: sender: where to record the leaves of buckets sent from a staging file, for a receiver in this process
    #: (the agent's own IPC destination ranks) to take instead of hashing the same bytes again; None (every
    #: transport but IPC): no receiver here reads them, nothing is recorded
    hashed_here: HashedHere | None = None

    def on_send_bucket(self, version: int, bucket: BucketPlan, data: torch.Tensor) -> dict[str, Any] | None:
        meta = dict(self.inner.on_send_bucket(version, bucket, data) or {}) if self.inner is not None else {}
        t0 = time.perf_counter()
        algo = self.algorithm or default_algorithm(data)

        def compute() -> HashedLeaves:
            got = HashedLeaves.of(bucket_leaves(bucket, data, algo))
            if self.hashed_here is not None:
                self.hashed_here.put(memory_key(version, bucket, data, algo), got)  # over these very bytes
            return got

        if self.sent_leaves is not None:
            hashed, reused = self.sent_leaves.get_or_compute((bucket.index, algo), compute)
        else:
            hashed, reused = compute(), False
        if reused:
            self.stats.reused_bytes += bucket.data_nbytes
        else:
            self._count(hashed.leaves, bucket, t0)
        meta["digest"] = {"algorithm": algo, "leaves": list(hashed.hexes)}  # a copy: the shared list stays as hashed
        return meta

    def on_recv_bucket(
        self, version: int, bucket: BucketPlan, data: torch.Tensor, meta: dict[str, Any] | None
    ) -> None:
        if self.inner is not None:
            self.inner.on_recv_bucket(version, bucket, data, meta)
        sent = (meta or {}).get("digest")
        where = f"bucket {bucket.index} of version {version} from trainer rank {bucket.src}"
        t0 = time.perf_counter()
        if not isinstance(sent, dict) or not isinstance(sent.get("leaves"), list):
            # A trainer agent of an earlier release (mid-upgrade) sends no leaves: nothing to check against;
            # the digest is still computed, and reported as unchecked.
            if self.digest is not None:
                self.digest.unchecked = True
            got = bucket_leaves(bucket, data, default_algorithm(data))
            self._count(got, bucket, t0)
            if self.digest is not None:
                self.digest.add_all(got)
            return
        algo = str(sent.get("algorithm") or XXH3_128)
        want = sent["leaves"]
        here = HASHED_HERE.get(memory_key(version, bucket, data, algo)) if HASHED_HERE else None
        if here is not None and here.hexes == want and [k for k, _ in here.leaves] == piece_ids(bucket)[0]:
            self.stats.reused_bytes += bucket.data_nbytes  # landed where this process hashed it: not read again
            if self.digest is not None:
                self.digest.add_all(here.leaves)
            return
        got = bucket_leaves(bucket, data, algo)
        if len(want) != len(got):
            raise DigestMismatch(f"{where}: {len(want)} piece digests for {len(got)} pieces")
        if [fmt(v) for _, v in got] != want:  # every leaf compared; the first that differs is named
            for (key, value), expected in zip(got, want, strict=True):
                if fmt(value) != expected:
                    raise DigestMismatch(
                        f"{where}: piece {key} has digest {fmt(value)}, the sender computed {expected}: the bytes "
                        "changed between the trainer's staging and this agent; the version is not loaded")
        self._count(got, bucket, t0)
        if self.digest is not None:
            self.digest.add_all(got)

    def _count(self, leaves: list[tuple[str, int]], bucket: BucketPlan, t0: float) -> None:
        self.stats.seconds += time.perf_counter() - t0
        self.stats.pieces += len(leaves)
        self.stats.bytes += bucket.data_nbytes
