"""A trainer rank's published tensor index: checked before anything trusts it, and read as views of its segment.

The trainer is local but may be buggy, so every publish's index is validated (names unique, sizes matching
dtype and shape, byte ranges aligned, inside the segment and not overlapping, pieces tiling their shard)
before the agent sends a byte of it; a bad publish raises StagingError with what to fix in the trainer.
A trainer publishes the same index every version, so a validated one is kept (PublishedIndex) and reused
by every later version that publishes it again (agent/staging/versions.py).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from weightsync.agent.plan import Box, TensorShard
from weightsync.agent.plan.buckets import SMALL_ALIGNMENT, itemsize
from weightsync.agent.staging import segments


class StagingError(ValueError):
    """A publish from the local trainer is inconsistent; the message says what to fix in the trainer."""


class PublishedIndex:
    """A rank's validated tensor index (what its publish said about each shard), shared by every version that
    publishes the same one into a segment of the same size.

    Why: a trainer publishes the same index every version; an MoE model's has tens of thousands of entries, and
    checking it, turning it into shards, comparing those with a plan and encoding them for the metadata reply
    cost tens of microseconds per tensor per version. The checks run once per distinct index, the rest is kept
    here."""

    def __init__(self, metas: list[dict[str, Any]], segment_size: int) -> None:
        self.metas = metas
        self.segment_size = segment_size
        #: what a trainer of this release names this index by in its next publish instead of sending it again
        self.id = uuid.uuid4().hex[:16]
        self.nbytes = sum(int(m["nbytes"]) for m in metas)
        self.staged_nbytes = sum(int(m["nbytes"]) for m in metas if m.get("unstaged") is not True)
        self._shards: list[TensorShard] | None = None
        #: plan hashes whose sources for this rank were found equal to these shards (WeightServer._send)
        self.plans_checked: set[str] = set()

    def shards(self) -> list[TensorShard]:
        if self._shards is None:
            self._shards = [TensorShard.of(m["name"], m["dtype"], m["global_shape"], m["global_offset"], m["shape"])
                            for m in self.metas]
        return self._shards


#: A staged shard: a view of its segment, or (dtype, shape, its pieces' views by (offset, shape)) when staged
#: in pieces (RankStage.tensors makes ShardPieces of those).
StagedView = torch.Tensor | tuple[torch.dtype, list[int], dict[tuple[tuple[int, ...], tuple[int, ...]], torch.Tensor]]


def staged_views(seg: segments.Segment, metas: list[dict[str, Any]]) -> dict[str, StagedView]:
    """Each staged shard of `metas` as a view of `seg`, or (dtype, shape, its pieces' views): slices of one typed
    view of the segment per dtype (Segment.view per tensor made four tensor ops each; tens of thousands per MoE
    version)."""
    typed: dict[str, Callable[[int, list[int]], torch.Tensor]] = {}

    def view_of(dtype: str) -> Callable[[int, list[int]], torch.Tensor]:
        got = typed.get(dtype)
        if got is None:
            dt = segments.dtype_from_name(dtype)
            isz = itemsize(dtype)
            flat = seg.tensor[: seg.size // isz * isz].view(dt)

            def got(at: int, shape: list[int]) -> torch.Tensor:
                n = math.prod(shape)
                if at % isz or at < 0 or at + n * isz > seg.size:
                    return seg.view(at, dt, shape)  # unaligned or outside: its checks say so
                return flat[at // isz: at // isz + n].view(shape)

            typed[dtype] = got
        return got

    out: dict[str, StagedView] = {}
    for m in metas:
        if m.get("unstaged") is True:
            continue
        view = view_of(m["dtype"])
        if m.get("pieces"):
            out[m["name"]] = (segments.dtype_from_name(m["dtype"]), m["shape"],
                              {(tuple(p["offset"]), tuple(p["shape"])): view(int(p["at"]), p["shape"])
                               for p in m["pieces"]})
        else:
            out[m["name"]] = view(int(m["offset"]), m["shape"])
    return out


def validate_stream_metas(metas: Any) -> list[dict[str, Any]]:
    """Check a streamed publish's tensor index (no offsets: nothing is staged at publish time)."""
    if not isinstance(metas, list):
        raise StagingError("publish_stream needs a 'tensors' list")
    names: set[str] = set()
    for m in metas:
        try:
            shard = TensorShard.of(m["name"], m["dtype"], m["global_shape"], m["global_offset"], m["shape"])
            n = int(m["nbytes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise StagingError(f"bad tensor entry {m!r}: {exc}") from None
        if shard.name in names:
            raise StagingError(f"tensor {shard.name!r} published twice in one version")
        names.add(shard.name)
        if n != shard.nbytes:
            raise StagingError(f"tensor {shard.name!r}: nbytes={n} but its dtype/shape need {shard.nbytes}")
    return list(metas)


def validate_metas(metas: Any, segment_size: int) -> list[dict[str, Any]]:
    """Check a publish's tensor index before anything trusts it (the trainer is local but may be buggy)."""
    if not isinstance(metas, list):
        raise StagingError("publish needs a 'tensors' list")
    names: set[str] = set()
    regions: list[tuple[int, int, str]] = []  # (offset, nbytes, tensor) of every staged byte range
    for m in metas:
        try:
            shard = TensorShard.of(m["name"], m["dtype"], m["global_shape"], m["global_offset"], m["shape"])
            unstaged = m.get("unstaged") is True  # metadata only: another rank sends this shard's bytes
            off, n = (-1, int(m["nbytes"])) if unstaged else (int(m["offset"]), int(m["nbytes"]))
            pieces = None if unstaged else _pieces_of(shard, m.get("pieces"))
        except (KeyError, TypeError, ValueError) as exc:
            raise StagingError(f"bad tensor entry {m!r}: {exc}") from None
        if shard.name in names:
            raise StagingError(f"tensor {shard.name!r} published twice in one version")
        names.add(shard.name)
        if n != shard.nbytes:
            raise StagingError(f"tensor {shard.name!r}: nbytes={n} but its dtype/shape need {shard.nbytes}")
        if not unstaged:
            regions.extend(pieces if pieces is not None else [(off, n, shard.name)])
    end = 0
    for off, n, name in sorted(regions):
        if off < end or off + n > segment_size or off % (segments.ALIGN if n >= segments.ALIGN else SMALL_ALIGNMENT):
            raise StagingError(f"tensor {name!r}: bytes [{off}, {off + n}) overlap, are unaligned or "
                               f"leave the {segment_size}-byte segment")
        end = off + n
    return list(metas)


def _pieces_of(shard: TensorShard, pieces: Any) -> list[tuple[int, int, str]] | None:
    """The byte ranges of a shard staged in pieces (TransferPlan.source_arena), after checking that the
    pieces' boxes tile the shard exactly; None for a shard staged whole. Raises ValueError."""
    if pieces is None:
        return None
    if not isinstance(pieces, list) or not pieces:
        raise ValueError("'pieces' must be a non-empty list")
    full = Box.full(shard.box.shape)
    boxes = []
    out = []
    for p in pieces:
        box = Box(tuple(int(x) for x in p["offset"]), tuple(int(x) for x in p["shape"]))
        if box.ndim != full.ndim or not full.contains(box) or not box.numel:
            raise ValueError(f"piece {box} is not a non-empty part of the shard {full}")
        boxes.append(box)
        out.append((int(p["at"]), box.numel * itemsize(shard.dtype), shard.name))
    if sum(b.numel for b in boxes) != full.numel or any(
            a.intersect(c) is not None for i, a in enumerate(boxes) for c in boxes[i + 1:]):
        raise ValueError("the pieces do not tile the shard")
    return out


class StagedTensors(Mapping[str, "torch.Tensor | ShardPieces"]):
    """A staged rank's tensors by name, views of its staging slot, made when first read; with `memo`, what a
    sender works out from them once (where each bucket sits in the slot, that they match a plan), kept with the
    slot for the next version staged there with the same index.

    Why: an MoE version has tens of thousands of tensors. A sender whose memo knows every bucket sits in place
    sends straight from `segment` and never reads a view, so none is made: over IPC (whose views cannot be kept,
    see RankStage.tensors) they cost a few microseconds each per version. The memo holds offsets and flags, no
    view, so it keeps no memory mapped."""

    def __init__(self, make: Callable[[], dict[str, torch.Tensor | ShardPieces]], segment: torch.Tensor,
                 memo: dict[Any, Any] | None = None) -> None:
        self._make = make
        self._views: dict[str, torch.Tensor | ShardPieces] | None = None
        self.segment = segment  #: the slot's bytes (1-d uint8)
        self.memo = memo

    @property
    def materialized(self) -> bool:
        """Whether the views were made (read)."""
        return self._views is not None

    def _all(self) -> dict[str, torch.Tensor | ShardPieces]:
        if self._views is None:
            self._views = self._make()
        return self._views

    def __getitem__(self, name: str) -> torch.Tensor | ShardPieces:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


class ShardPieces:
    """A source shard staged as separate pieces, each where its bucket wants it (TransferPlan.source_arena),
    instead of as one tensor: the sender reads a piece where it lies. `pieces` maps a box in the shard's
    own coordinates (offset, shape) to its view."""

    def __init__(self, dtype: torch.dtype, shape: Sequence[int],
                 pieces: Mapping[tuple[tuple[int, ...], tuple[int, ...]], torch.Tensor]) -> None:
        self.dtype = dtype
        self.shape = tuple(int(d) for d in shape)
        self.pieces = dict(pieces)
        self._whole: torch.Tensor | None = None
        self.copied_bytes = 0  # bytes assembled for a region that is not one staged piece

    def region(self, offset: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
        """The box (shard coordinates) as a tensor: the staged piece itself when the box is one, else a
        slice of the pieces assembled once (a plan other than the one the staging was laid out for)."""
        key = (tuple(int(o) for o in offset), tuple(int(n) for n in shape))
        view = self.pieces.get(key)
        if view is not None:
            return view
        whole = self._whole
        if whole is None:
            first = next(iter(self.pieces.values()))
            whole = self._whole = torch.empty(self.shape, dtype=self.dtype, device=first.device)
            for (o, n), v in self.pieces.items():
                whole[tuple(slice(a, a + b) for a, b in zip(o, n, strict=True))].copy_(v)
                self.copied_bytes += v.numel() * v.element_size()
        return whole[tuple(slice(a, a + b) for a, b in zip(key[0], key[1], strict=True))]
