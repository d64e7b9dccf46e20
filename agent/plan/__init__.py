"""The reshard plan: which bytes go from which source rank to which destination ranks, in which bucket.

Every source rank describes the tensors it holds as boxes in the global tensor (name, dtype, global
shape, global offset, local shape): FSDP Shard(0) chunks, TP shards, or whole replicated tensors. Every
destination rank declares the boxes it needs (its inference TP layout). The plan is the N-d
intersections of those boxes, ordered deterministically and grouped into flattened buckets of at most
`bucket_bytes`. Every agent computes the same plan from the same inputs and compares `plan.hash` before
any byte moves (anchor: Awex transfer plan), so a disagreement is an error, not silent corruption.

Rules:
* A (name, rank) pair has at most one box, on both sides.
* Distinct source boxes of one tensor must be disjoint; identical boxes on several ranks are replicas
  (data parallelism): each box gets one owner, rotated over the replicas to spread the load.
* A piece that several destinations need byte-identically (same source box intersection) is sent once
  to all of them: a bucket has one source and one or more destinations (broadcast when more).
* Pieces bigger than a bucket are split along their leading dimensions.
* Pieces are ordered by (source, destinations, tensor name, offset); each (source, destinations) stream
  is packed into buckets in that order, and the buckets of all streams are interleaved round-robin.

Scale: a 70,000-tensor model on 256 FSDP ranks is 18M source shards and, to 2 TP ranks, 36M pieces.
So both sides are columnar (`ShardTable`: numpy arrays, not objects), the planner is vectorized (the
intersection of every source box with every destination box, chunked over source ranks), and the plan
stays columnar: `BucketPlan.entries` become objects only when an agent looks at a bucket of a rank it
serves. Lists of `TensorShard` still work everywhere (they are converted).

Layout: the value types live in types.py, the columnar table in table.py and its binary encoding in
encoding.py, the computed plan in result.py, the vectorized planner in build.py and the layout of its
streams in buckets in bucketing.py; this module is the entry point (`build_plan`, `PlanInputs`) and
re-exports the public names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from functools import cached_property

import torch

from weightsync.agent.plan.buckets import DEFAULT_ALIGNMENT
from weightsync.agent.plan.build import _plan
from weightsync.agent.plan.encoding import pack_arrays, unpack_arrays
from weightsync.agent.plan.result import ArenaPiece, BucketColumns, BucketPlan, SourceArena, TransferPlan
from weightsync.agent.plan.table import RankShards, ShardTable, coord_dtype
from weightsync.agent.plan.types import (
    PLAN_FORMAT,
    Box,
    Piece,
    PlanError,
    PlannedEntry,
    TensorShard,
    _streamed,
)

__all__ = ["DEFAULT_ALIGNMENT", "PLAN_FORMAT", "ArenaPiece", "Box", "BucketColumns", "BucketPlan", "Piece", "PlanError",
           "PlanInputs", "PlannedEntry", "RankShards", "ShardTable", "SourceArena", "TensorShard", "TransferPlan",
           "build_plan", "coord_dtype", "pack_arrays", "shards_of", "unpack_arrays"]


class PlanInputs:
    """What a plan is computed from: both sides' tables, the bucket size and alignment. The destination
    sends `payload` to every source it reads from; `key` (SHA-256 of the payload) names the plan in the
    plan caches of both sides. Both are computed once per object."""

    def __init__(self, sources: ShardTable, needs: ShardTable, bucket_bytes: int,
                 alignment: int = DEFAULT_ALIGNMENT, *, payload: bytes | memoryview | None = None) -> None:
        self.sources = sources
        self.needs = needs
        self.bucket_bytes = int(bucket_bytes)
        self.alignment = int(alignment)
        if payload is not None:
            self.__dict__["payload"] = bytes(payload)

    @cached_property
    @_streamed
    def payload(self) -> bytes:
        ms, a_s = self.sources.sections()
        mn, a_n = self.needs.sections()
        arrays = {**{f"s.{k}": v for k, v in a_s.items()}, **{f"n.{k}": v for k, v in a_n.items()}}
        meta = {"plan_inputs": PLAN_FORMAT, "bucket_bytes": self.bucket_bytes, "alignment": self.alignment,
                "sources": ms, "needs": mn}
        return pack_arrays(meta, arrays)

    @cached_property
    def key(self) -> str:
        return hashlib.sha256(self.payload).hexdigest()

    @classmethod
    def decode(cls, payload: bytes | memoryview) -> PlanInputs:
        """Raises ValueError (PlanError for inputs that are well-formed but break the rules)."""
        meta, arrays = unpack_arrays(payload)
        if meta.get("plan_inputs") != PLAN_FORMAT:
            raise ValueError(f"plan inputs of format {meta.get('plan_inputs')!r}, this agent reads {PLAN_FORMAT}")
        bb, al = meta.get("bucket_bytes"), meta.get("alignment")
        if not isinstance(bb, int) or not isinstance(al, int):
            raise ValueError("bucket_bytes and alignment must be integers")
        s = ShardTable.from_sections(meta["sources"], {k[2:]: v for k, v in arrays.items() if k.startswith("s.")})
        n = ShardTable.from_sections(meta["needs"], {k[2:]: v for k, v in arrays.items() if k.startswith("n.")},
                                     "destination")
        return cls(s, n, bb, al, payload=payload)

    def build(self) -> TransferPlan:
        return build_plan(self.sources, self.needs, self.bucket_bytes, alignment=self.alignment)


@_streamed
def build_plan(
    sources: Sequence[Sequence[TensorShard]] | ShardTable,
    needs: Sequence[Sequence[TensorShard]] | ShardTable,
    bucket_bytes: int,
    *,
    alignment: int = DEFAULT_ALIGNMENT,
) -> TransferPlan:
    """Compute the plan for moving the tensors described by `sources[src_rank]` to `needs[dst_rank]`.

    Pure and deterministic: the same inputs give the same buckets and the same hash on every agent.
    Source tensors nobody needs are ignored; a needed region no source holds is a PlanError.
    """
    if bucket_bytes < 1:
        raise PlanError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if alignment < 1:
        raise PlanError(f"alignment must be positive, got {alignment}")
    src = sources if isinstance(sources, ShardTable) else ShardTable.from_lists(sources, "source")
    dst = needs if isinstance(needs, ShardTable) else ShardTable.from_lists(needs, "destination")
    return _plan(src, dst, int(bucket_bytes), int(alignment))


def shards_of(named: Iterable[tuple[str, torch.Tensor]]) -> list[TensorShard]:
    """Whole-tensor shards for plain (unsharded) named tensors: a replicated source or destination."""
    return [TensorShard.full(n, t.dtype, tuple(t.shape)) for n, t in named]
