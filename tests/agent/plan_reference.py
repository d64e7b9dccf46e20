"""The object-per-piece reshard planner as it was before the columnar one (agent/plan/__init__.py format 1), kept
as the oracle the vectorized planner is checked against: same pieces, same buckets, same order."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from weightsync.agent.plan import Box, BucketPlan, Piece, PlanError, PlannedEntry, TensorShard
from weightsync.agent.plan.buckets import DEFAULT_ALIGNMENT, entry_offset, itemsize


def _check_ranks(kind: str, ranks: Sequence[Sequence[TensorShard]]) -> list[dict[str, TensorShard]]:
    out: list[dict[str, TensorShard]] = []
    for r, shards in enumerate(ranks):
        by_name: dict[str, TensorShard] = {}
        for s in shards:
            if s.name in by_name:
                raise PlanError(f"{kind} rank {r} lists tensor {s.name!r} twice; one box per tensor and rank")
            by_name[s.name] = s
        out.append(by_name)
    return out


def _check_metadata(src: list[dict[str, TensorShard]], dst: list[dict[str, TensorShard]]) -> None:
    seen: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for kind, ranks in (("source", src), ("destination", dst)):
        for r, by_name in enumerate(ranks):
            for name, s in by_name.items():
                where = f"{kind} rank {r}"
                if name not in seen:
                    seen[name] = (s.dtype, s.global_shape, where)
                    continue
                dt, gs, first = seen[name]
                if (dt, gs) != (s.dtype, s.global_shape):
                    raise PlanError(
                        f"tensor {name!r}: {first} says {dt}{list(gs)} but {where} says "
                        f"{s.dtype}{list(s.global_shape)}; trainer and inference must describe the same model"
                    )


def reference_buckets(
    sources: Sequence[Sequence[TensorShard]],
    needs: Sequence[Sequence[TensorShard]],
    bucket_bytes: int,
    *,
    alignment: int = DEFAULT_ALIGNMENT,
) -> list[BucketPlan]:
    """Compute the plan for moving the tensors described by `sources[src_rank]` to `needs[dst_rank]`.

    Pure and deterministic: the same inputs give the same buckets and the same hash on every agent.
    Source tensors nobody needs are ignored; a needed region no source holds is a PlanError.
    """
    if bucket_bytes < 1:
        raise PlanError(f"bucket_bytes must be positive, got {bucket_bytes}")
    src_by = _check_ranks("source", sources)
    dst_by = _check_ranks("destination", needs)
    _check_metadata(src_by, dst_by)

    # Distinct source boxes per tensor and the ranks holding each (replicas).
    holders: dict[str, dict[Box, list[int]]] = defaultdict(lambda: defaultdict(list))
    for r, by_name in enumerate(src_by):
        for name, s in by_name.items():
            if s.box.numel:
                holders[name][s.box].append(r)
    owners: dict[str, list[tuple[Box, int]]] = {}
    counter = 0
    for name in sorted(holders):
        boxes = sorted(holders[name])
        for i, a in enumerate(boxes):
            for b in boxes[i + 1 :]:
                if a.intersect(b) is not None:
                    raise PlanError(
                        f"tensor {name!r}: source boxes {a} (ranks {holders[name][a]}) and {b} (ranks "
                        f"{holders[name][b]}) overlap without being identical; shards must be disjoint or replicas"
                    )
        owned = []
        for box in boxes:
            ranks = sorted(holders[name][box])
            owned.append((box, ranks[counter % len(ranks)]))
            counter += 1
        owners[name] = owned

    # Intersections, merged across destinations that need identical bytes from the same owner.
    piece_dsts: dict[tuple[str, Box, int, Box], list[int]] = defaultdict(list)
    missing: list[str] = []
    for d, by_name in enumerate(dst_by):
        for name in sorted(by_name):
            need = by_name[name]
            if not need.box.numel:
                continue
            if name not in owners:
                missing.append(f"{name!r} (destination rank {d})")
                continue
            covered = 0
            for box, owner in owners[name]:
                inter = need.box.intersect(box)
                if inter is None:
                    continue
                piece_dsts[(name, inter, owner, box)].append(d)
                covered += inter.numel
            if covered != need.box.numel:
                raise PlanError(
                    f"tensor {name!r}: destination rank {d} needs offset={need.box.offset} shape={need.box.shape} "
                    f"but the sources hold only {covered} of its {need.box.numel} elements"
                )
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise PlanError(f"no source rank holds {', '.join(missing[:5])}{more}; check names and tied embeddings")

    meta = {name: s for by_name in dst_by for name, s in by_name.items()}
    pieces: list[Piece] = []
    for (name, inter, owner, src_box), dl in piece_dsts.items():
        m = meta[name]
        max_numel = bucket_bytes // itemsize(m.dtype)
        if max_numel < 1:
            raise PlanError(f"bucket_bytes={bucket_bytes} is smaller than one element of {name!r} ({m.dtype})")
        for sub in inter.split(max_numel):
            pieces.append(Piece(name, m.dtype, m.global_shape, sub, owner, src_box, tuple(sorted(dl))))
    # A piece that is its source's whole shard goes first, in buckets of its own (a sub-stream).
    pieces.sort(key=lambda p: (p.src, p.dsts, p.box != p.src_box, p.name, p.box.offset))

    # Pack each (src, dsts, part) stream into buckets, then interleave streams round-robin so that
    # consecutive buckets involve different pairs and can move concurrently.
    streams: dict[tuple[int, tuple[int, ...], bool], list[list[PlannedEntry]]] = defaultdict(list)
    cursors: dict[tuple[int, tuple[int, ...], bool], int] = {}
    for p in pieces:
        key = (p.src, p.dsts, p.box != p.src_box)
        cur = cursors.get(key)
        off = entry_offset(cur, p.nbytes, alignment) if cur is not None else 0
        if cur is None or off + p.nbytes > bucket_bytes:
            streams[key].append([])
            off = 0
        streams[key][-1].append(PlannedEntry(p, off))
        cursors[key] = off + p.nbytes
    order = sorted(((seq, key) for key, bl in streams.items() for seq in range(len(bl))))
    buckets: list[BucketPlan] = []
    for index, (seq, key) in enumerate(order):
        entries = tuple(streams[key][seq])
        nbytes = entries[-1].offset + entries[-1].piece.nbytes
        buckets.append(BucketPlan(index, key[0], key[1], entries, nbytes))

    return buckets
