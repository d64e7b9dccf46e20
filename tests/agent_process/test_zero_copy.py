"""One copy per byte: the trainer stages in its plan's arena (buckets are sent from staging without a pack), a
Custom engine loads received buckets where the transport put them (no copy into the engine segment), and the
agents count every copy they still make (weightsync_agent_copied_bytes_total{stage})."""

from __future__ import annotations

import gc
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from podprocs import Cluster, get_text, metric_value, wait_for
from staging_agent import serve_staging
from test_agent_inprocess import _Engine, engine_registry_server
from test_demo_processes import engine_sums, trainer_sums

from weightsync.agent.client import InferenceSession, PlacedShard, TrainerSession
from weightsync.agent.engines.base import EngineError, load_version
from weightsync.agent.engines.custom import CustomEngineAdapter
from weightsync.agent.layout.rules import TensorMeta, inference_layout, trainer_layout
from weightsync.agent.layout.shards import checksums, local_shards
from weightsync.agent.plan import Box, build_plan, shards_of
from weightsync.agent.staging import segments
from weightsync.agent.staging.index import ShardPieces
from weightsync.agent.staging.places import arena_offsets
from weightsync.agent.staging.versions import StagedVersions
from weightsync.agent.transfer.send import source_region
from weightsync.agent.transfer.sync import PlacedTensors, in_place
from weightsync.crds import contract


def _bucket_in(buf: torch.Tensor, tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Views of `tensors` written back to back into `buf` (as a transport's receive slot holds them)."""
    out, off = [], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        view = buf[off:off + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append((name, view))
        off += (n + 255) // 256 * 256
    return out


def test_custom_engine_loads_shared_slots_in_place_and_packs_the_rest(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    registry, server = engine_registry_server(tmp_path / "agent.sock")
    eng = _Engine()
    sess = InferenceSession(eng.on_bucket, eng.on_commit, socket_path=tmp_path / "agent.sock", rank=0).start()
    adapter = CustomEngineAdapter(registry, [0], prefix="wstest", connect_timeout=10)
    try:
        tensors = {"a": torch.randn(64, 8), "b": torch.arange(100, dtype=torch.int32),
                   "c": torch.randn(16).to(torch.bfloat16)}
        slot = adapter.receive_allocator(1 << 16, torch.device("cpu"))  # what a transport's slot is
        assert len(list(tmp_path.glob("wstest-recv-*"))) == 1
        bucket = _bucket_in(slot, tensors)
        load_version(adapter, 1, [bucket], pause_generation=False)
        assert checksums(eng.loaded.items()) == checksums(tensors.items())
        assert adapter.copied_bytes == 0 and adapter.shared_bytes == sum(t.numel() * t.element_size()
                                                                        for t in tensors.values())
        # an alias (one tensor under two names) overlaps itself, a private tensor is in no shared segment:
        # both are packed into the engine segment, still bit-exact
        aliased = [*bucket, ("a_alias", bucket[0][1])]
        private = [("p", torch.randn(5))]
        load_version(adapter, 2, [aliased, private], pause_generation=False)
        assert torch.equal(eng.loaded["a_alias"], tensors["a"]) and torch.equal(eng.loaded["p"], private[0][1])
        assert adapter.copied_bytes == 2 * tensors["a"].numel() * 4 + tensors["b"].numel() * 4 + \
            tensors["c"].numel() * 2 + 5 * 4
        # a bucket mixing both (whole tensors in the slot, one assembled elsewhere): only the latter is copied
        copied, shared = adapter.copied_bytes, adapter.shared_bytes
        assembled = torch.randn(7)
        load_version(adapter, 3, [[*bucket, ("asm", assembled)]], pause_generation=False)
        assert torch.equal(eng.loaded["asm"], assembled) and torch.equal(eng.loaded["b"], tensors["b"])
        assert adapter.copied_bytes - copied == 7 * 4
        assert adapter.shared_bytes - shared == sum(t.numel() * t.element_size() for t in tensors.values())
        # the transport drops its slot: the engine unmaps it and the agent unlinks it at the next load
        del slot, bucket, aliased
        gc.collect()
        load_version(adapter, 4, [private], pause_generation=False)
        assert not list(tmp_path.glob("wstest-recv-*")), "a dropped receive segment must be unlinked"
        assert not any(n.startswith("wstest-recv-") for n in sess._segments), "the engine still maps it"
    finally:
        adapter.close()
        sess.close()
        server.close()


def test_an_app_that_connects_after_the_fetch_began_still_gets_pieces(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The fetch asks whether the engine loads pieces before its app connected (an engine that starts a moment
    after its agent): the answer waits for the app, so its first version is not assembled and packed."""
    import threading

    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    registry, server = engine_registry_server(tmp_path / "agent.sock")
    adapter = CustomEngineAdapter(registry, [0], prefix="wstest", connect_timeout=10)
    answer: list[bool] = []
    asking = threading.Thread(target=lambda: answer.append(adapter.loads_pieces()))
    asking.start()
    sess = None
    try:
        asking.join(0.5)
        assert asking.is_alive() and not answer  # waiting for the app, not answering "no"
        sess = InferenceSession(lambda v, t: None, lambda v: None, socket_path=tmp_path / "agent.sock", rank=0,
                                on_pieces=lambda v, p: None).start()
        asking.join(10)
        assert answer == [True]
        # an app that never connects fails the fetch at once with the load's own error, not a silent "no"
        with pytest.raises(EngineError, match="no Custom engine connected for rank 1"):
            CustomEngineAdapter(registry, [1], prefix="wstest3", connect_timeout=0.2).loads_pieces()
    finally:
        if sess is not None:
            sess.close()
        adapter.close()
        server.close()


def test_an_engine_that_loads_pieces_gets_them_where_they_landed(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor that arrives in pieces (two sources' halves of a row-parallel weight) is not assembled: each
    piece goes to the app where the transport put it, with its place, and the app loads it there itself."""
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    registry, server = engine_registry_server(tmp_path / "agent.sock")
    params = {"w": torch.zeros(6, 4), "n": torch.zeros(3)}
    got: list[tuple[str, tuple[slice, ...]]] = []

    def on_bucket(version: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
        for n, t in tensors:
            params[n].copy_(t)

    def on_pieces(version: int, pieces: list[tuple[str, tuple[slice, ...], torch.Tensor]]) -> None:
        for n, index, t in pieces:
            got.append((n, index))
            params[n][index].copy_(t)

    plain = InferenceSession(on_bucket, lambda v: None, socket_path=tmp_path / "agent.sock", rank=1).start()
    sess = InferenceSession(on_bucket, lambda v: None, socket_path=tmp_path / "agent.sock", rank=0,
                            on_pieces=on_pieces).start()
    adapter = CustomEngineAdapter(registry, [0], prefix="wstest", connect_timeout=10)
    try:
        wait_for(lambda: registry.ranks() == [0, 1], 10, "both engine ranks connected")
        assert adapter.loads_pieces()
        assert not CustomEngineAdapter(registry, [0, 1], prefix="wstest2", connect_timeout=10).loads_pieces()
        w, n = torch.randn(6, 4), torch.randn(3)
        slot = adapter.receive_allocator(1 << 16, torch.device("cpu"))
        top, norm, bottom = _bucket_in(slot, {"top": w[:3], "n": n, "bottom": w[3:]})
        buckets = [PlacedTensors([("w", top[1]), ("n", norm[1])], {0: ((0, 0), (6, 4))}),
                   PlacedTensors([("w", bottom[1])], {0: ((3, 0), (6, 4))})]
        load_version(adapter, 1, buckets, pause_generation=False)
        assert torch.equal(params["w"], w) and torch.equal(params["n"], n)
        assert got == [("w", (slice(0, 3), slice(0, 4))), ("w", (slice(3, 6), slice(0, 4)))]
        assert adapter.copied_bytes == 0  # handed over in place, nothing packed
    finally:
        adapter.close()
        sess.close()
        plain.close()
        server.close()


@pytest.mark.parametrize("mode", ["nccl", "ipc"])
def test_a_resharded_layout_copies_each_byte_once_through_real_agents(mode: str) -> None:
    """FSDP 2 -> TP 2 through real agent, trainer and Custom engine processes (bench/agent_pipeline.py, small;
    ipc: one colocated pod, whose agent maps each trainer rank's staging once per engine rank): after the
    first version the trainer's publish is the only copy (no pack, unpack or engine pack), and the engines
    hold the trainer's exact bytes."""
    bench = Path(__file__).resolve().parents[2] / "bench" / "agent_pipeline.py"
    out = subprocess.run([sys.executable, str(bench), "--mode", mode, "--size-mb", "16", "--fsdp", "2",
                          "--inference-tp", "2", "--bucket-mb", "2", "--versions", "3", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["bit_exact"] is True
    stages = result["copies_per_byte_by_stage"]
    assert stages["publish"] == pytest.approx(1.0, abs=0.01)
    assert stages.get("pack", 0.0) == 0.0 and stages.get("unpack", 0.0) == 0.0
    assert stages.get("engine_pack", 0.0) == 0.0
    # the content digest reads each byte once per side; over IPC the receiver's bucket is the very staging file
    # region its own agent hashed as the sender, so it takes those leaves instead of reading the bytes again
    digest = result["digest_bytes_per_byte_by_source"]
    assert digest["sent/hashed"] == pytest.approx(1.0, abs=0.02)
    hashed, reused = digest.get("received/hashed", 0.0), digest.get("received/reused", 0.0)
    assert (hashed, reused) == ((0.0, pytest.approx(1.0, abs=0.02)) if mode == "ipc" else
                                (pytest.approx(1.0, abs=0.02), 0.0)), digest
    assert result["digest_reads_per_byte"] == pytest.approx(1.0 if mode == "ipc" else 2.0, abs=0.04)


def test_trainer_stages_in_the_plan_arena_so_every_bucket_is_sent_in_place(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    store = StagedVersions([0], "wstest")
    server = serve_staging(tmp_path / "agent.sock", store)
    weights = {f"layer{i}.weight": torch.randn(32 + i, 16) for i in range(12)} | {"tiny": torch.randn(3)}
    try:
        with TrainerSession(tmp_path / "agent.sock", rank=0) as s:
            s.publish(weights, version=1)
            sv1 = store.get(1)
            assert sv1 is not None
            shards = sv1.ranks[0].shards()
            # buckets in a different order than the trainer's dict, several tensors per bucket
            plan = build_plan([shards], [sorted(shards, key=lambda x: x.name, reverse=True)], 8 << 10)
            first = sv1.ranks[0].tensors()
            assert not all(in_place(b, [first[e.piece.name] for e in b.entries]) is not None for b in plan.buckets)
            store.prefer_arena(0, plan)
            s.publish(weights, version=2)
        staged = store.get(2)
        assert staged is not None
        got = staged.ranks[0].tensors()
        assert checksums(got.items()) == checksums(weights.items())
        for b in plan.buckets:  # every bucket is one contiguous range of staging: sent without a pack
            assert in_place(b, [got[e.piece.name] for e in b.entries]) is not None, b.index
    finally:
        server.close()
        store.close()


def test_a_resharded_trainer_stages_pieces_where_their_buckets_are(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP 2 -> TP 2: row-parallel weights travel in pieces (half the columns of a rank's rows). Once a plan
    read the rank, the trainer copies each piece straight to its place in its bucket (source_arena), so every
    bucket, pieces included, is one contiguous range of staging holding the trainer's exact bytes."""
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    metas = [TensorMeta(f"l{i}.{k}_proj.weight", "float32", (24 + 8 * i, 40)) for i in range(4) for k in ("q", "o")]
    full = {m.name: torch.randn(m.shape) for m in metas}
    src = [trainer_layout(metas, fsdp_size=2, fsdp_rank=r) for r in range(2)]
    plan = build_plan(src, [inference_layout(metas, 2, r) for r in range(2)], 8 << 10)
    store = StagedVersions([0], "wstest")
    server = serve_staging(tmp_path / "agent.sock", store)
    weights = {s.name: PlacedShard(full[s.name][s.box.slices_within(Box.full(s.global_shape))].clone(),
                                   s.global_shape, s.box.offset) for s in src[0]}
    try:
        with TrainerSession(tmp_path / "agent.sock", rank=0) as s:
            s.publish(weights, version=1)
            store.prefer_arena(0, plan)
            arena = store.arena(0)
            assert arena is not None and arena.pieces and {p.name for p in arena.pieces} == {
                m.name for m in metas if ".o_proj" in m.name}
            s.publish(weights, version=2)
        staged = store.get(2)
        assert staged is not None
        got = staged.ranks[0].tensors()
        assert any(isinstance(t, ShardPieces) for t in got.values())
        for b in plan.buckets_from(0):
            regions = [source_region(got[e.piece.name], e.piece.box, e.piece.src_box) for e in b.entries]
            data = in_place(b, regions)
            assert data is not None, f"bucket {b.index} would be packed"
            for e, r in zip(b.entries, regions, strict=True):  # the trainer's bytes, where the bucket wants them
                want = full[e.piece.name][e.piece.box.slices_within(Box.full(e.piece.global_shape))]
                assert torch.equal(r, want)
        # a region that is not one staged piece (another plan) is assembled from the pieces, and counted
        pieced = next(t for t in got.values() if isinstance(t, ShardPieces))
        assert torch.equal(pieced.region((0, 0), pieced.shape)[:, :20], next(iter(pieced.pieces.values())))
        assert pieced.copied_bytes == math.prod(pieced.shape) * 4
    finally:
        server.close()
        store.close()


def test_a_layout_for_other_tensors_is_not_used() -> None:
    shards, _ = local_shards({"a": torch.zeros(4), "b": torch.zeros(2, 2)})
    plan = build_plan([shards_of([("a", torch.zeros(4)), ("b", torch.zeros(2, 2))])],
                      [shards_of([("a", torch.zeros(4)), ("b", torch.zeros(2, 2))])], 1 << 20)
    layout = plan.arena("src", 0).to_dict()
    assert arena_offsets(shards, layout, 1 << 20) is not None
    assert arena_offsets(shards, layout, 16) is None  # does not fit the segment
    other, _ = local_shards({"a": torch.zeros(4), "b": torch.zeros(2, 3)})
    assert arena_offsets(other, layout, 1 << 20) is None  # a shape changed
    fewer, _ = local_shards({"a": torch.zeros(4)})
    assert arena_offsets(fewer, layout, 1 << 20) is None
    assert arena_offsets(shards, {"entries": "junk"}, 1 << 20) is None
    assert arena_offsets(shards, None, 1 << 20) is None


def _metrics(url: str) -> str:
    _, text = get_text(f"{url}/metrics")
    return text


@pytest.mark.parametrize("mode", ["NCCL", "IPC"])
def test_steady_versions_copy_each_byte_once(mode: str, tmp_path: Path, clusters: list[Cluster]) -> None:
    """Real agents, demo trainer and engine processes: after the first version (which teaches the trainer
    the plan's layout) nothing is packed on the way, and the engine serves the trainer's bytes exactly."""
    versions = 4
    c = Cluster(tmp_path, mode=mode, placement="Colocated" if mode == "IPC" else "Separated", bucket_mb=1)
    clusters.append(c)
    if mode == "IPC":
        t = c.add_pod("demo-colocated-0", contract.ROLE_COLOCATED)
        c.write_topology()
        c.start_agent(t)
        c.start_engine(t, "--port", "8001")
        c.start_trainer(t, "--versions", str(versions), "--interval", "0.5")
        engines = [(t, f"http://{t.ip}:8001")]
    else:
        t, infs = c.start_separated(1, "--versions", str(versions), "--interval", "0.5")
        engines = [(p, p.demo_url) for p in infs]
    for p, url in engines:
        wait_for(lambda url=url: engine_sums(url)[0] == versions, 120, f"{p.name} serving {versions}", c)
        assert engine_sums(url)[1] == trainer_sums(t, versions)
    tm = _metrics(t.metrics_url)
    staged = metric_value(tm, "weightsync_agent_copied_bytes_total", 'stage="publish"') or 0.0
    assert staged == metric_value(tm, "weightsync_agent_staged_bytes_total") and staged > 0
    packed = metric_value(tm, "weightsync_agent_copied_bytes_total", 'stage="pack"') or 0.0
    assert packed <= staged / versions, f"{packed} bytes packed: more than the first version ({staged / versions})"
    for p, _ in engines:
        im = _metrics(p.metrics_url)
        assert metric_value(im, "weightsync_agent_copied_bytes_total", 'stage="engine_pack"') == 0.0
        assert metric_value(im, "weightsync_agent_copied_bytes_total", 'stage="unpack"') == 0.0
        assert (metric_value(im, "weightsync_agent_staging_peak_bytes") or 0.0) > 0


def test_host_staging_pins_only_where_cuda_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU side of pinned staging (the `gpu` test checks the CUDA call): without CUDA nothing is pinned
    and the segment works as before; the staging account follows create and unlink."""
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    before = segments.STAGING.current
    seg = segments.create_segment(1 << 20, "wspin")
    assert isinstance(seg, segments.ShmSegment)
    assert seg.pinned == torch.cuda.is_available()
    assert segments.STAGING.current == before + (1 << 20) and segments.STAGING.peak >= before + (1 << 20)
    seg.tensor.fill_(7)
    seg.unlink()
    assert segments.STAGING.current == before and not list(tmp_path.iterdir())


def test_staging_pool_gives_each_rank_back_its_own_slots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks publishing through one agent: once warm, each gets back the slot it wrote two versions ago
    (mapped and faulted in by its process), never the other rank's, and no segment is made any more."""
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    pool = segments.SegmentPool("wspool")
    try:
        held: dict[int, list[segments.Slot]] = {0: [], 1: []}
        for version in range(1, 7):
            for rank, size in ((0, 5000), (1, 4000)):
                slot = pool.acquire(size, user=rank)
                pool.fill(slot, version)
                held[rank].append(slot)
                if len(held[rank]) > 1:  # keep=1: the version before the newest is released
                    pool.release(held[rank][-2])
        made = len(list(tmp_path.iterdir()))
        for rank in (0, 1):
            names = [s.segment.name for s in held[rank]]
            assert len(set(names[2:])) == 2 and names[4:] == names[2:-2], names  # alternates from version 3 on
        assert not {s.segment.name for s in held[0][2:]} & {s.segment.name for s in held[1][2:]}
        assert made <= 5  # two per rank, plus at most one made while the other rank held a borrowed one
    finally:
        pool.close()
