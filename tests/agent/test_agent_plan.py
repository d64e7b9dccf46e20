"""Unit tests for the reshard plan: boxes, intersections, ordering, hash stability, bucket bounds."""

from __future__ import annotations

import random

import pytest

from weightsync.agent.plan import Box, PlanError, TensorShard, build_plan


def tp(name: str, shape: tuple[int, ...], dim: int, n: int, r: int, dtype: str = "float32") -> TensorShard:
    off = [0] * len(shape)
    sh = list(shape)
    sh[dim] = shape[dim] // n
    off[dim] = r * sh[dim]
    return TensorShard.of(name, dtype, shape, off, sh)


def test_box_intersection_and_containment() -> None:
    a = Box((0, 0), (4, 6))
    b = Box((2, 3), (4, 6))
    assert a.intersect(b) == Box((2, 3), (2, 3))
    assert a.intersect(Box((4, 0), (1, 6))) is None  # touching is not overlapping
    assert a.contains(Box((1, 1), (2, 2))) and not a.contains(b)
    assert Box((2, 3), (2, 3)).slices_within(a) == (slice(2, 4), slice(3, 6))
    assert Box((), ()).intersect(Box((), ())) == Box((), ())  # 0-d tensors intersect themselves
    with pytest.raises(PlanError):
        Box((1,), (1, 2))


def test_box_split_is_row_major_and_bounded() -> None:
    box = Box((2, 0, 0), (3, 4, 5))  # 60 elements
    parts = box.split(12)
    assert all(p.numel <= 12 for p in parts)
    assert sum(p.numel for p in parts) == box.numel
    # consecutive, non-overlapping, in row-major order
    starts = [p.offset for p in parts]
    assert starts == sorted(starts)
    for i, p in enumerate(parts):
        for q in parts[i + 1 :]:
            assert p.intersect(q) is None
    # a single row larger than the bound is split along the next dim
    assert all(p.numel <= 3 for p in Box((0, 0), (2, 7)).split(3))


def test_tp2_to_tp4_pieces() -> None:
    shape = (8, 4)
    plan = build_plan([[tp("w", shape, 0, 2, r)] for r in range(2)], [[tp("w", shape, 0, 4, r)] for r in range(4)],
                      1 << 20)
    pieces = {(e.piece.src, e.piece.dsts, e.piece.box) for b in plan.buckets for e in b.entries}
    assert pieces == {
        (0, (0,), Box((0, 0), (2, 4))), (0, (1,), Box((2, 0), (2, 4))),
        (1, (2,), Box((4, 0), (2, 4))), (1, (3,), Box((6, 0), (2, 4))),
    }


def test_row_parallel_to_column_parallel_is_an_nd_intersection() -> None:
    shape = (6, 8)
    src = [[tp("w", shape, 1, 2, r)] for r in range(2)]  # split columns
    dst = [[tp("w", shape, 0, 3, r)] for r in range(3)]  # split rows
    plan = build_plan(src, dst, 1 << 20)
    boxes = sorted((e.piece.src, e.piece.dsts[0], e.piece.box) for b in plan.buckets for e in b.entries)
    assert len(boxes) == 6
    assert (1, 2, Box((4, 4), (2, 4))) in boxes
    assert sum(b.numel for _, _, b in boxes) == 48


def test_identical_needs_become_one_broadcast_piece() -> None:
    full = TensorShard.full("norm", "float32", (16,))
    plan = build_plan([[full]], [[full], [full], [full]], 1 << 20)
    assert [(b.src, b.dsts) for b in plan.buckets] == [(0, (0, 1, 2))]
    assert plan.buckets[0].broadcast
    assert plan.delivered_bytes() == 3 * plan.total_bytes()


def test_replicas_rotate_ownership() -> None:
    metas = [TensorShard.full(f"t{i}", "float32", (4,)) for i in range(8)]
    plan = build_plan([metas, metas], [metas], 1 << 20)  # two data-parallel replicas
    owners = {e.piece.name: e.piece.src for b in plan.buckets for e in b.entries}
    assert set(owners.values()) == {0, 1}
    assert sum(1 for o in owners.values() if o == 0) == 4


def test_order_and_hash_are_deterministic() -> None:
    names = [f"model.layers.{i}.w" for i in range(20)]
    src = [[tp(n, (8, 8), 0, 2, r) for n in names] for r in range(2)]
    dst = [[tp(n, (8, 8), 1, 2, r) for n in names] for r in range(2)]
    a = build_plan(src, dst, 512)
    shuffled = [random.Random(1).sample(rank, len(rank)) for rank in src]
    b = build_plan(shuffled, [list(reversed(rank)) for rank in dst], 512)
    assert a.hash == b.hash
    assert [(x.index, x.src, x.dsts, x.nbytes) for x in a.buckets] == [(x.index, x.src, x.dsts, x.nbytes)
                                                                     for x in b.buckets]
    assert build_plan(src, dst, 1024).hash != a.hash  # bucket size is part of the plan
    other = [[tp(n, (8, 8), 0, 2, r) for n in names] for r in range(2)]
    assert build_plan(src, other, 512).hash != a.hash  # so are the layouts
    assert len(a.hash) == 64


def test_hash_is_stable_across_processes_and_versions() -> None:
    # a golden value: changing it is a wire change between agent versions (bump PLAN_FORMAT)
    plan = build_plan([[TensorShard.full("w", "bfloat16", (4, 4))]], [[TensorShard.full("w", "bfloat16", (4, 4))]],
                      64)
    assert plan.hash == build_plan([[TensorShard.full("w", "bfloat16", (4, 4))]],
                                   [[TensorShard.full("w", "bfloat16", (4, 4))]], 64).hash
    assert plan.hash == GOLDEN


GOLDEN = "88f279e1c738682ef547b8541013354fbcb046347429f6c38872529db6a2692f"  # PLAN_FORMAT 3 (whole shards first)


def test_buckets_respect_the_bound_and_split_big_tensors() -> None:
    big = TensorShard.full("big", "float32", (100, 30))  # 12000 bytes
    small = [TensorShard.full(f"s{i}", "bfloat16", (7,)) for i in range(50)]
    plan = build_plan([[big, *small]], [[big, *small]], 1000)
    assert all(b.nbytes <= 1000 for b in plan.buckets)
    big_pieces = [e.piece for b in plan.buckets for e in b.entries if e.piece.name == "big"]
    assert len(big_pieces) >= 12
    assert sum(p.box.numel for p in big_pieces) == 3000
    for b in plan.buckets:  # entries never overlap and are aligned for their dtype
        end = 0
        for e in b.entries:
            assert e.offset >= end and e.offset % 4 == 0
            end = e.offset + e.piece.nbytes


def test_plan_errors_are_clear() -> None:
    w = TensorShard.full("w", "float32", (4,))
    with pytest.raises(PlanError, match="no source rank holds 'w'"):
        build_plan([[]], [[w]], 64)
    with pytest.raises(PlanError, match="says float32"):
        build_plan([[w]], [[TensorShard.full("w", "bfloat16", (4,))]], 64)
    with pytest.raises(PlanError, match="overlap"):
        build_plan([[TensorShard.of("w", "float32", (4,), (0,), (3,))], [TensorShard.of("w", "float32", (4,), (2,), (2,))]],
                   [[w]], 64)
    with pytest.raises(PlanError, match="hold only 2 of its 4"):
        build_plan([[TensorShard.of("w", "float32", (4,), (0,), (2,))]], [[w]], 64)
    with pytest.raises(PlanError, match="outside its global shape"):
        TensorShard.of("w", "float32", (4,), (3,), (2,))
    with pytest.raises(PlanError, match="twice"):
        build_plan([[w, w]], [[w]], 64)


def test_unneeded_sources_are_ignored_and_empty_ranks_allowed() -> None:
    w = TensorShard.full("w", "float32", (4,))
    extra = TensorShard.full("optimizer.state", "float32", (4,))
    plan = build_plan([[w, extra], []], [[w]], 64)
    assert {e.piece.name for b in plan.buckets for e in b.entries} == {"w"}
    assert plan.buckets_from(1) == []


def test_arena_makes_whole_tensor_buckets_contiguous() -> None:
    names = [TensorShard.full(f"t{i}", "float32", (10 + i,)) for i in range(10)]
    plan = build_plan([names], [names], 256)
    for role in ("src", "dst"):
        arena = plan.arena(role, 0)
        where = {e.name: e.offset for e in arena.entries}
        assert len(where) == 10
        for b in plan.buckets:
            base = where[b.entries[0].piece.name] - b.entries[0].offset
            assert all(where[e.piece.name] == base + e.offset for e in b.entries)
        arena.validate()


def test_whole_shards_fill_buckets_of_their_own() -> None:
    # FSDP 2 -> TP 2: column-parallel shards go whole to one destination, row-parallel ones in pieces; a bucket
    # mixing both would have to be packed, so the pieces go in buckets of their own, after the whole shards
    from weightsync.agent.layout.rules import TensorMeta, inference_layout, trainer_layout

    metas = [TensorMeta(f"l{i}.{k}_proj.weight", "bfloat16", (64, 48)) for i in range(6) for k in ("q", "o")]
    src = [trainer_layout(metas, fsdp_size=2, fsdp_rank=r) for r in range(2)]
    plan = build_plan(src, [inference_layout(metas, 2, r) for r in range(2)], 16384)
    kinds = []
    for b in plan.buckets:
        shard = {s.name: s.box for s in plan.sources[b.src]}
        whole = {e.piece.box == shard[e.piece.name] for e in b.entries}
        assert len(whole) == 1, f"bucket {b.index} mixes whole shards and pieces"
        kinds.append((b.src, b.dsts, whole.pop()))
    assert (0, (0,), True) in kinds and (0, (0,), False) in kinds  # both kinds in one (src, dst) stream
    for src_rank in range(2):  # and each whole-shard bucket lies in the source arena exactly like the bucket
        where = {e.name: e.offset for e in plan.arena("src", src_rank).entries}
        for b in plan.buckets_from(src_rank):
            shard = {s.name: s.box for s in plan.sources[src_rank]}
            if all(e.piece.box == shard[e.piece.name] for e in b.entries):
                base = where[b.entries[0].piece.name] - b.entries[0].offset
                assert all(where[e.piece.name] == base + e.offset for e in b.entries)
