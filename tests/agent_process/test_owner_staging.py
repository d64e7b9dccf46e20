"""Data-parallel trainers stage a version once per shard owner, not once per replica: the plan sends each
distinct shard from one of the ranks that hold it, and a rank stages only what the plan sends from it (the
others it publishes by metadata only). Real shared-memory staging and a real TrainerSession in one process,
then real agent, trainer and engine processes (bench/agent_pipeline.py --dp)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from staging_agent import serve_staging

from weightsync.agent.client import TrainerSession
from weightsync.agent.layout.rules import TensorMeta, inference_layout, trainer_layout
from weightsync.agent.layout.shards import local_shards
from weightsync.agent.plan import TensorShard, TransferPlan, build_plan
from weightsync.agent.staging import segments
from weightsync.agent.staging.places import TrainerStaging, arena_offsets
from weightsync.agent.staging.versions import StagedVersions

BENCH = Path(__file__).resolve().parents[2] / "bench" / "agent_pipeline.py"
METAS = [TensorMeta(f"l{i}.{k}_proj.weight", "float32", (16 + 8 * i, 32)) for i in range(3) for k in ("q", "o")]


def _hsdp_plan(dp: int, fsdp: int, tp: int) -> tuple[list[list[TensorShard]], TransferPlan]:
    src = [trainer_layout(METAS, fsdp_size=fsdp, fsdp_rank=r % fsdp) for r in range(fsdp * dp)]
    return src, build_plan(src, [inference_layout(METAS, tp, r) for r in range(tp)], 4 << 10)


def test_the_plan_arena_names_the_shards_a_replica_sends_nothing_of() -> None:
    _, plan = _hsdp_plan(dp=2, fsdp=1, tp=1)
    a0, a1 = plan.source_arena(0), plan.source_arena(1)
    # every tensor is sent from exactly one of the two replicas
    assert set(a0.unsent) | set(a1.unsent) == {m.name for m in METAS} and not set(a0.unsent) & set(a1.unsent)
    assert a0.unsent and a1.unsent
    for arena in (a0, a1):
        compact = arena.to_dict(skip_unsent=True)
        assert set(compact["unsent"]) == set(arena.unsent)
        assert not {e["name"] for e in compact["entries"]} & set(arena.unsent)
        assert compact["nbytes"] == arena.staged_nbytes < arena.nbytes
        assert "unsent" not in arena.to_dict()  # an older client gets the full layout
        shards, _ = local_shards({m.name: torch.zeros(m.shape) for m in METAS})
        places = arena_offsets(shards, compact, compact["nbytes"])
        assert places is not None
        assert {s.name for s, p in zip(shards, places, strict=True) if p is None} == set(arena.unsent)
    # no replicas: nothing is unsent
    _, single = _hsdp_plan(dp=1, fsdp=2, tp=2)
    assert not single.source_arena(0).unsent and not single.source_arena(1).unsent


def test_a_replica_stages_only_what_it_sends_and_a_second_plan_stages_everything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    src, plan = _hsdp_plan(dp=2, fsdp=1, tp=1)
    store = StagedVersions([1], "wsowner")  # the agent of trainer rank 1, a replica of rank 0
    server = serve_staging(tmp_path / "agent.sock", store)
    weights = {m.name: torch.randn(m.shape) for m in METAS}
    try:
        with TrainerSession(tmp_path / "agent.sock", rank=1) as s:
            s.publish(weights, version=1)  # no plan yet: everything staged, in order
            store.prefer_arena(1, plan)
            s.publish(weights, version=2)
            sv = store.get(2)
            assert sv is not None
            rs = sv.ranks[1]
            arena = plan.source_arena(1)
            assert rs.unstaged == set(arena.unsent) and rs.unstaged
            assert sv.staged_nbytes == sum(weights[n].numel() * 4 for n in weights if n not in rs.unstaged)
            assert rs.slot is not None and rs.slot.segment.size == arena.staged_nbytes
            got = rs.tensors()
            assert set(got) == set(weights) - rs.unstaged  # what it sends, bit for bit
            assert all(isinstance(t, torch.Tensor) and torch.equal(t, weights[n]) for n, t in got.items())
            assert {s.name for s in rs.shards()} == set(weights)  # the metadata of every shard, for the plan
            assert store.missing_for(rs, plan) == set()

            # a second plan reads the rank (here: rank 1 alone holds everything, as when an IPC group reaches
            # only this pod): the staged version lacks what it needs, which is refused by name ...
            other = build_plan([[], src[1]], [inference_layout(METAS, 1, 0)], 4 << 10)
            assert store.missing_for(rs, other) == rs.unstaged
            # ... and from the next version on this rank stages everything
            store.prefer_arena(1, other)
            s.publish(weights, version=3)
            sv3 = store.get(3)
            assert sv3 is not None
            rs3 = sv3.ranks[1]
            assert rs3.unstaged == set() and store.missing_for(rs3, plan) == set()
            assert set(rs3.tensors()) == set(weights)
    finally:
        server.close()
        store.close()


def test_a_replaced_plan_stops_holding_the_staging_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bucketSizeMB changes (a new plan, same owners): for a few versions the rank is read by two plans and
    stages everything; once the old plan has read none of the last PLAN_MEMORY_VERSIONS versions, the rank
    stages only its own shards again, in the new plan's arena."""
    from weightsync.agent.staging.versions import PLAN_MEMORY_VERSIONS

    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    src, old = _hsdp_plan(dp=2, fsdp=1, tp=1)
    new = build_plan(src, [inference_layout(METAS, 1, 0)], 8 << 10)
    assert new.hash != old.hash and set(new.source_arena(1).unsent) == set(old.source_arena(1).unsent)
    store = StagedVersions([1], "wsowner")
    server = serve_staging(tmp_path / "agent.sock", store)
    weights = {m.name: torch.randn(m.shape) for m in METAS}
    unstaged: dict[int, set[str]] = {}
    try:
        with TrainerSession(tmp_path / "agent.sock", rank=1) as s:
            for v in range(1, 4 + PLAN_MEMORY_VERSIONS + 1):
                s.publish(weights, version=v)
                sv = store.get(v)
                assert sv is not None
                unstaged[v] = set(sv.ranks[1].unstaged)
                store.prefer_arena(1, old if v <= 2 else new, v)  # the new plan reads from version 3 on
    finally:
        server.close()
        store.close()
    owned_elsewhere = set(new.source_arena(1).unsent)
    assert unstaged[1] == set()  # no plan yet
    assert unstaged[2] == unstaged[3] == owned_elsewhere  # one plan: only its own shards
    # versions 4 .. 3 + N: the old plan (last read version 2) still counts
    assert all(unstaged[v] == set() for v in range(4, 3 + PLAN_MEMORY_VERSIONS))
    assert unstaged[3 + PLAN_MEMORY_VERSIONS] == owned_elsewhere == unstaged[4 + PLAN_MEMORY_VERSIONS]


@pytest.mark.parametrize("mode,layout", [("nccl", ["--dp", "2"]),
                                         ("gdr", ["--fsdp", "2", "--dp", "2", "--inference-tp", "2"])])
def test_data_parallel_replicas_copy_each_byte_once_through_real_agents(mode: str, layout: list[str]) -> None:
    """HSDP (DP 2 replicas of an FSDP group) through real agent, trainer and engine processes: the trainers'
    publish copies each model byte once in all (2 before: every replica staged its whole shard), and the
    engines hold the trainer's exact bytes."""
    out = subprocess.run([sys.executable, str(BENCH), "--mode", mode, "--size-mb", "16", *layout, "--bucket-mb",
                          "1", "--versions", "3", "--no-raw", "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert r["bit_exact"] is True and r["dp"] == 2
    stages = r["copies_per_byte_by_stage"]
    assert stages["publish"] == pytest.approx(1.0, abs=0.01), stages
    assert stages.get("pack", 0.0) == 0.0 and stages.get("unpack", 0.0) == 0.0


def test_a_slot_far_larger_than_needed_is_replaced_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a replica stages only its share, the pool's slots of the whole shard are replaced by right-sized
    ones instead of being reused (their written pages would stay allocated); a little larger is reused."""
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    pool = segments.SegmentPool("wspool")
    try:
        big = pool.acquire(8 << 20, user=0)
        pool.fill(big, 1)
        pool.release(big)
        assert pool.acquire(7 << 20, user=0) is big  # within 1.5 x: reused, no fresh pages
        pool.fill(big, 2)
        pool.release(big)
        small = pool.acquire(2 << 20, user=0)
        assert small is not big and small.segment.size == 2 << 20
        assert not Path(str(big.segment.handle()["dir"]), big.segment.name).exists()  # unlinked: memory freed
        assert [s.segment.size for s in pool._slots] == [2 << 20]
    finally:
        pool.close()


def test_a_ranks_second_segment_is_made_and_faulted_in_before_its_second_version(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Version 2 needs a second segment (version 1 is still served from the first). It is made and faulted
    in once version 1 was served (the agent's server asks for it), so the trainer's copy of version 2 does
    not allocate its pages; later versions alternate between the two, and no third segment is made."""
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    pool = segments.SegmentPool("wspool")
    try:
        first = pool.acquire(4 << 20, user=0)
        pool.fill(first, 1)
        assert len(list(tmp_path.iterdir())) == 1  # nothing more while version 1 is copied
        assert pool.make_spare(first.segment.size, user=0)
        assert not pool.make_spare(first.segment.size, user=0)  # one at a time
        assert pool.wait_spares(10)
        assert not pool.make_spare(first.segment.size, user=0)  # the rank has two segments now
        files = sorted(p.name for p in tmp_path.iterdir())
        assert len(files) == 2
        spare = next(s for s in pool._slots if s is not first)
        assert spare.user == 0 and spare.segment.size == first.segment.size
        # resident: the kernel allocated every page (st_blocks counts 512-byte blocks actually held)
        assert os.stat(tmp_path / spare.segment.name).st_blocks * 512 >= spare.segment.size
        assert pool.acquire(4 << 20, user=0) is spare  # version 2: the spare, not a new segment
        pool.fill(spare, 2)
        pool.release(first)
        assert pool.acquire(4 << 20, user=0) is first  # version 3: back to the first
        assert sorted(p.name for p in tmp_path.iterdir()) == files
    finally:
        pool.close()
    assert not list(tmp_path.iterdir())


def test_a_spare_still_being_made_when_the_pool_closes_is_removed(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    pool = segments.SegmentPool("wspool")
    pool.acquire(64 << 20, user=0)
    assert pool.make_spare(64 << 20, user=0)
    pool.close()
    assert pool.wait_spares(30)
    assert not list(tmp_path.iterdir())


def test_a_spare_that_comes_after_the_next_versions_own_segment_is_dropped(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Version 2's stage request can come while the spare is still being made by the time it asks; if it made
    its own segment, the spare would be a third one held for nothing."""
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    pool = segments.SegmentPool("wspool")
    try:
        first = pool.acquire(1 << 20, user=0)
        pool.fill(first, 1)
        second = segments.Slot(segments.create_segment(1 << 20, "wspool"), user=0)
        pool._slots.append(second)  # as if version 2 had made its own while the spare thread started
        pool._make_spare(1 << 20, user=0)
        assert [s.segment.name for s in pool._slots] == [first.segment.name, second.segment.name]
        assert len(list(tmp_path.iterdir())) == 2
    finally:
        pool.close()


def test_the_trainer_unmaps_staging_segments_the_agent_stopped_offering(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    store = StagedVersions([0], "wslru", keep=1)
    server = serve_staging(tmp_path / "agent.sock", store)
    try:
        with TrainerSession(tmp_path / "agent.sock", rank=0) as s:
            for v in range(1, 9):  # a growing model: every version needs a new, larger segment
                s.publish({"w": torch.zeros(1024 * v)}, version=v)
                assert len(s._staging.segments) <= TrainerStaging.KEEP_SEGMENTS
            sv = store.get(8)
            assert sv is not None and sv.ranks[0].slot is not None
            assert sv.ranks[0].slot.segment.name in s._staging.segments  # the newest is still mapped
    finally:
        server.close()
        store.close()


def test_a_compact_layout_for_another_model_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent answers with a layout without the unsent shards, in a segment of that size, but the trainer's
    model changed (other tensors): the client asks again for a segment that holds every shard and stages them
    all, in order; nothing is lost."""
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    _, plan = _hsdp_plan(dp=2, fsdp=1, tp=1)
    store = StagedVersions([1], "wsother")
    server = serve_staging(tmp_path / "agent.sock", store)
    other = {f"new{i}.weight": torch.randn(64, 32) for i in range(3)}  # 24 KiB, more than the compact arena
    try:
        with TrainerSession(tmp_path / "agent.sock", rank=1) as s:
            store.prefer_arena(1, plan)
            assert plan.source_arena(1).staged_nbytes < sum(t.numel() * 4 for t in other.values())
            s.publish(other, version=1)
        sv = store.get(1)
        assert sv is not None
        rs = sv.ranks[1]
        assert rs.unstaged == set() and sv.staged_nbytes == sum(t.numel() * 4 for t in other.values())
        got = rs.tensors()
        assert all(isinstance(got[n], torch.Tensor) and torch.equal(got[n], t) for n, t in other.items())
    finally:
        server.close()
        store.close()
