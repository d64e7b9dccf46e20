"""The Custom engine adapter: forwards every engine operation to the app's InferenceSession.

The app connects to the agent's Unix socket (agent/wire/local.py) and says hello as `inference`; the agent
registers that connection in an `AppRegistry`. Only a bucket's index travels over the socket (one round
trip per bucket); its bytes are in shared memory the app maps:
* zero copy: the agent's transports receive into shared segments (`receive_allocator`), so tensors that
  arrived whole are handed over where they landed, as (segment, offsets), one request per segment;
* the rest (tensors assembled from pieces, aliases) is packed into one reusable segment: one copy,
  counted in `copied_bytes`;
* an app that loads pieces itself (`InferenceSession(on_pieces=...)`, said in its replies) gets the pieces of a
  tensor that arrives in pieces where they landed, with their place in the tensor (`places` of the bucket
  request): the agent then assembles nothing (fetcher.loads_pieces) and packs nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.agent.engines.base import EngineError, NamedTensors
from weightsync.agent.plan import buckets
from weightsync.agent.staging import segments
from weightsync.agent.staging.slots import SharedSlotAllocator
from weightsync.agent.wire import local
from weightsync.agent.wire.protocol import LAYOUT_UNKNOWN

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _WholeLayout:
    """A bucket handed on whole, where it lies in a shared segment: made once per bucket and receive slot."""

    source: buckets.BucketLayout  # the plan bucket's own layout (offsets from the bucket's start)
    layout: buckets.BucketLayout  # at the bucket's offset in the segment
    as_dict: dict[str, Any]
    nbytes: int
    id: str  # what the app knows it by once it got it (InferenceSession takes layouts by id)


class AppRegistry:
    """The inference app connections of this pod, by rank; the local socket handler fills it."""

    def __init__(self) -> None:
        self._conns: dict[int, local.LocalConn] = {}
        self._served: dict[int, int | None] = {}
        self._cond = threading.Condition()

    def add(self, rank: int, conn: local.LocalConn, served_version: int | None) -> None:
        with self._cond:
            old = self._conns.get(rank)
            if old is not None and old is not conn:
                old.close()
            self._conns[rank] = conn
            self._served[rank] = served_version
            self._cond.notify_all()

    def remove(self, conn: local.LocalConn) -> None:
        with self._cond:
            for rank, c in list(self._conns.items()):
                if c is conn:
                    del self._conns[rank]

    def ranks(self) -> list[int]:
        """The ranks connected now."""
        with self._cond:
            return sorted(self._conns)

    def holds(self, rank: int, conn: local.LocalConn) -> bool:
        with self._cond:
            return self._conns.get(rank) is conn

    def wait(self, rank: int, timeout: float) -> local.LocalConn:
        with self._cond:
            if not self._cond.wait_for(lambda: rank in self._conns, timeout):
                raise EngineError(f"no Custom engine connected for rank {rank} within {timeout:.0f}s: the app must "
                                  "create an InferenceSession on the agent socket")
            return self._conns[rank]

    def connected(self) -> list[int]:
        with self._cond:
            return sorted(self._conns)

    def hello_served(self, rank: int) -> int | None:
        with self._cond:
            return self._served.get(rank)


class CustomEngineAdapter:
    """EngineAdapter for apps using weightsync.agent.client.InferenceSession."""

    def __init__(self, registry: AppRegistry, ranks: list[int], *, prefix: str, connect_timeout: float = 120.0,
                 device: str = "cpu", request_timeout: float = 600.0) -> None:
        self.registry = registry
        self.ranks = ranks
        self.rank = ranks[0]  # which rank's session receives the next buckets
        self.prefix = prefix
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout  # spec.transfer.timeoutSeconds: a hung engine fails the load
        self.device = device
        self._segment: segments.Segment | None = None
        #: (bucket layout, segment, offset) -> that bucket's layout where it lies in the segment (_whole_bucket)
        self._whole: dict[tuple[int, str, int], _WholeLayout] = {}
        self._last_whole = _WholeLayout(buckets.BucketLayout((), 0), buckets.BucketLayout((), 0), {}, 0, "")
        self._layout_seq = 0
        self._ids: dict[int, tuple[local.LocalConn, set[str] | None]] = {}  # rank -> (session, layout ids it holds)
        self._version: int | None = None
        #: transports of this agent receive into these shared segments (see fetcher.fetch_version)
        self.receive_allocator = SharedSlotAllocator(f"{prefix}-recv")
        self.copied_bytes = 0  # bytes packed into the engine segment (not handed over in place)
        self.shared_bytes = 0  # bytes handed over where the transport received them
        self._pieces: dict[int, tuple[local.LocalConn, bool]] = {}  # rank -> (its session, loads pieces)

    def _request(self, rank: int, header: dict[str, Any]) -> dict[str, Any]:
        conn = self.registry.wait(rank, self.connect_timeout)
        try:
            return conn.request(header, timeout=self.request_timeout)
        except TimeoutError:
            self.registry.remove(conn)
            conn.close()
            raise EngineError(f"Custom engine rank {rank} did not answer {header['op']} within "
                              f"{self.request_timeout:.0f}s (spec.transfer.timeoutSeconds); dropped its session") from None
        except local.LocalProtocolError as exc:
            raise EngineError(f"Custom engine rank {rank}: {exc}") from None
        except (ConnectionError, OSError) as exc:
            self.registry.remove(conn)
            raise EngineError(f"Custom engine rank {rank} disconnected during {header['op']}: {exc}") from None

    def loads_pieces(self) -> bool:
        """Whether every rank's app loads pieces into place itself (asked once per app session).

        Waits for a rank's app to connect, as the load itself would: answering "no" for an app that connects
        a moment later would assemble and pack its first version for nothing (a second copy of every split
        tensor, and engine staging the size of the largest)."""
        for r in self.ranks:
            conn = self.registry.wait(r, self.connect_timeout)
            known = self._pieces.get(r)
            if known is None or known[0] is not conn:
                reply = self._request(r, {"op": "served"})
                known = self._pieces[r] = (conn, reply.get("pieces") is True)
            if not known[1]:
                return False
        return True

    def _all(self, header: dict[str, Any]) -> None:
        for r in self.ranks:
            self._request(r, header)

    def pause(self) -> None:
        self._all({"op": "pause"})

    def resume(self) -> None:
        self._all({"op": "resume"})

    def begin_update(self, version: int) -> None:
        self._version = version
        self._all({"op": "begin", "version": version})

    def _ensure_segment(self, nbytes: int) -> segments.Segment:
        seg = self._segment
        if seg is not None and seg.size >= nbytes:
            return seg
        if seg is not None:
            for r in self.registry.connected():
                self._request(r, {"op": "release", "name": seg.name})
            seg.unlink()
        self._segment = segments.create_segment(nbytes, f"{self.prefix}-engine", self.device)
        return self._segment

    def _release_dead_segments(self) -> None:
        """Shared memory that went away (receive segments a transport dropped, files an IPC reader unmapped):
        the app unmaps it first, then owned segments are unlinked."""
        dead = self.receive_allocator.reap()
        names = {seg.name for seg in dead} | set(segments.SHARED.take_gone())
        for name in sorted(names):
            for r in self.registry.connected():
                try:
                    self._request(r, {"op": "release", "name": name})
                except EngineError as exc:
                    log.info("release of segment %s by rank %s failed: %s", name, r, exc)
        for seg in dead:
            seg.unlink()

    @staticmethod
    def in_place(tensors: NamedTensors) -> tuple[list[tuple[segments.Segment | segments.MappedFile, buckets.BucketLayout]],
                                                  NamedTensors]:
        """Split a bucket into what already lies in shared segments the app can map, as (segment, index at
        the tensors' own offsets) per segment, and the rest (private memory, such as tensors assembled
        from pieces, and aliases that overlap another entry), which is packed."""
        shared, rest = CustomEngineAdapter._split(tensors)
        return [(seg, layout) for seg, layout, _ in shared], [tensors[i] for i in rest]

    @staticmethod
    def _split(tensors: NamedTensors) -> tuple[list[tuple[segments.Segment | segments.MappedFile, buckets.BucketLayout,
                                                           list[int]]], list[int]]:
        """in_place, by index into `tensors`: (segment, layout, the pair each entry is) per segment, and the
        indices of the pairs to pack."""
        groups: dict[str, tuple[segments.Segment | segments.MappedFile, list[tuple[buckets.BucketEntry, int]]]] = {}
        rest: list[int] = []
        for i, (name, t) in enumerate(tensors):
            found = segments.SHARED.locate(t)
            if found is None:
                rest.append(i)
                continue
            seg, off = found
            groups.setdefault(seg.name, (seg, []))[1].append(
                (buckets.BucketEntry(name, buckets.dtype_name(t.dtype), tuple(t.shape), off), i))
        shared = []
        for seg, items in groups.values():
            items.sort(key=lambda x: x[0].offset)
            entries = tuple(e for e, _ in items)
            layout = buckets.BucketLayout(entries, max(e.offset + e.nbytes for e in entries), 1)
            try:
                layout.validate()
            except buckets.BucketError:  # one tensor under two names overlaps itself: pack this group
                rest.extend(i for _, i in items)
                continue
            shared.append((seg, layout, [i for _, i in items]))
        return shared, sorted(rest)

    #: (bucket layout, segment name, offset) -> the layout of that bucket where it lies in the segment
    _WHOLE_MAX = 256

    def _whole_bucket(self, tensors: NamedTensors) -> tuple[segments.Segment | segments.MappedFile,
                                                            buckets.BucketLayout, list[int]] | None:
        """A bucket the receiver handed on whole where it landed (PlacedTensors.flat) and that lies in shared
        memory the app can map: (segment, its layout at the bucket's offset there, every index). One lookup
        for the bucket instead of one per tensor, and the layout made once per bucket and receive slot."""
        flat = getattr(tensors, "flat", None)
        if flat is None:
            return None
        data, layout = flat
        if len(layout.entries) != len(tensors):
            return None
        found = segments.SHARED.locate(data)
        if found is None:
            return None
        seg, base = found
        key = (id(layout), seg.name, base)
        hit = self._whole.get(key)
        if hit is None or hit.source is not layout:
            shifted = buckets.BucketLayout(tuple(buckets.BucketEntry(e.name, e.dtype, e.shape, e.offset + base)
                                                 for e in layout.entries), base + layout.nbytes, 1)
            shifted.validate()
            if len(self._whole) >= self._WHOLE_MAX:
                self._whole.clear()
            self._layout_seq += 1
            hit = self._whole[key] = _WholeLayout(layout, shifted, shifted.to_dict(),
                                                  sum(e.nbytes for e in shifted.entries),
                                                  f"{seg.name}@{base}#{self._layout_seq}")
        self._last_whole = hit
        return seg, hit.layout, list(range(len(tensors)))

    def _layout_ids(self, rank: int) -> set[str] | None:
        """The layout ids rank's app holds, when its InferenceSession takes a layout by id (this release: it
        answers `served` with layout_ids); None for an app of an earlier release (it gets every layout)."""
        conn = self.registry.wait(rank, self.connect_timeout)
        known = self._ids.get(rank)
        if known is None or known[0] is not conn:
            reply = self._request(rank, {"op": "served"})
            known = self._ids[rank] = (conn, set() if reply.get("layout_ids") is True else None)
        return known[1]

    def load_bucket(self, tensors: NamedTensors) -> None:
        if self._version is None:
            raise EngineError("load_bucket called before begin_update")
        self._release_dead_segments()
        places = getattr(tensors, "places", None) or {}
        whole = self._whole_bucket(tensors)
        shared, rest = ([whole], []) if whole is not None else self._split(tensors)
        parts = list(shared)
        self.shared_bytes += self._last_whole.nbytes if whole is not None else \
            sum(e.nbytes for _, layout, _ in shared for e in layout.entries)
        if rest:
            layout = buckets.BucketLayout.build((tensors[i][0], tensors[i][1].dtype, tensors[i][1].shape) for i in rest)
            staged = self._ensure_segment(layout.nbytes)
            with torch.no_grad():
                buckets.pack(staged.tensor, layout, [tensors[i][1] for i in rest])
            self.copied_bytes += sum(e.nbytes for e in layout.entries)
            parts.append((staged, layout, rest))
        for seg, layout, index in parts:
            if seg.tensor.is_cuda:
                torch.cuda.synchronize(seg.tensor.device)
            header: dict[str, Any] = {"op": "bucket", "version": self._version, "segment": seg.handle()}
            if any(i in places for i in index):  # pieces: where each goes in its tensor (the app loads them there)
                header["places"] = [None if i not in places else {"offset": list(places[i][0]),
                                                                  "shape": list(places[i][1])} for i in index]
            ids = self._layout_ids(self.rank) if whole is not None else None
            if ids is None:
                self._request(self.rank, {**header, "layout": self._last_whole.as_dict if whole is not None
                                          else layout.to_dict()})
                continue
            # a layout the app already holds is named, not sent (an MoE bucket's is a megabyte of JSON each way)
            lid = self._last_whole.id
            if lid in ids:
                try:
                    self._request(self.rank, {**header, "layout_id": lid})
                    continue
                except EngineError as exc:
                    if LAYOUT_UNKNOWN not in str(exc):
                        raise
                    ids.discard(lid)
            self._request(self.rank, {**header, "layout_id": lid, "layout": self._last_whole.as_dict})
            ids.add(lid)

    def commit(self, version: int) -> None:
        self._all({"op": "commit", "version": version})
        self._version = None

    def abort(self, version: int, reason: str) -> None:
        self._version = None
        self._all({"op": "abort", "version": version, "reason": reason})

    def served_version(self) -> int | None:
        versions: list[int] = []
        for r in self.ranks:
            v = self._request(r, {"op": "served"}).get("version")
            if v is None:
                return None
            versions.append(int(v))
        return min(versions)

    def wait_connected(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for r in self.ranks:
            try:
                self.registry.wait(r, max(0.0, deadline - time.monotonic()))
            except EngineError:
                return False
        return True

    def close(self) -> None:
        for seg in self.receive_allocator.reap():
            seg.unlink()
        if self._segment is not None:
            self._segment.unlink()
            self._segment = None
