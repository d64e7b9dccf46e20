"""Ring staging (WEIGHTSYNC_STAGING=ring, agent/staging/ring.py): the trainer agent's staging is depth x bucket whatever
the model size, the engines get the trainer's exact bytes in every mode, and a transfer that fails mid-stream
gives its ring back and commits nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from podprocs import Cluster, get_text, metric_value, wait_for

from weightsync.agent.staging import ring, segments
from weightsync.agent.staging.index import StagingError
from weightsync.agent.staging.versions import StagedVersions
from weightsync.crds import contract

MiB = 1 << 20
BENCH = Path(__file__).resolve().parents[2] / "bench" / "agent_pipeline.py"
APPS = Path(__file__).with_name("ring_apps.py")


def _bench(*args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, str(BENCH), *args, "--bucket-mb", "1", "--versions", "3", "--no-raw",
                          "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout))


def _trainer_peak(result: dict[str, Any]) -> int:
    return int(next(v for k, v in result["peak_staging_bytes_by_pod"].items() if "trainer" in k or "colocated" in k))


def test_ring_staging_stays_flat_when_the_model_grows_4x() -> None:
    """NCCL, 4 MiB then 16 MiB model, 1 MiB buckets, depth 2: the trainer agent's own staging peak is the ring
    (2 x 1 MiB) both times; whole-version staging would hold 2 x the model (8 MiB, then 32 MiB)."""
    small = _bench("--mode", "nccl", "--size-mb", "4", "--staging", "ring", "--depth", "2")
    big = _bench("--mode", "nccl", "--size-mb", "16", "--staging", "ring", "--depth", "2")
    for r in (small, big):
        assert r["bit_exact"] is True and r["staging"] == "ring"
        assert _trainer_peak(r) <= 2 * MiB + 64 * 1024, r["peak_staging_bytes_by_pod"]
        assert r["copies_per_byte_by_stage"]["publish"] == pytest.approx(1.0, abs=0.01)
        assert r["copies_per_byte"] == pytest.approx(1.0, abs=0.01)  # CPU, held: no snapshot copy
        assert r["snapshot_bytes"] == 0 and r["trainer_held_for"] == ["held"]
    assert _trainer_peak(big) == _trainer_peak(small)
    assert big["peak_staging_bytes"] <= small["peak_staging_bytes"] * 1.1


@pytest.mark.parametrize("mode,layout", [("gdr", []), ("ipc", []), ("nccl", ["--fsdp", "2", "--inference-tp", "2"]),
                                         ("gdr", ["--fsdp", "2", "--inference-tp", "2"])])
def test_ring_staging_is_bit_exact_and_bounded(mode: str, layout: list[str]) -> None:
    """Every transport sends from the ring slots (no pack), resharded layouts too, and the bound is per
    trainer rank: depth x bucket each (ipc: the colocated agent also holds its engine rank's receive slots)."""
    r = _bench("--mode", mode, "--size-mb", "16", "--staging", "ring", "--depth", "3", *layout)
    assert r["bit_exact"] is True
    ranks = r["fsdp"]
    bound = ranks * 3 * MiB + (2 * MiB * r["inference_tp"] if mode == "ipc" else 0) + 64 * 1024
    assert _trainer_peak(r) <= bound, r["peak_staging_bytes_by_pod"]
    stages = r["copies_per_byte_by_stage"]
    assert stages["publish"] == pytest.approx(1.0, abs=0.01) and stages.get("pack", 0.0) == 0.0


def _inference_peak(result: dict[str, Any]) -> int:
    return int(next(v for k, v in result["peak_staging_bytes_by_pod"].items() if "inference" in k))


def test_gdr_receive_memory_is_the_shared_slots_whatever_the_sources() -> None:
    """GDR, FSDP 2 -> TP 2 (each engine rank reads from both trainer ranks), 1 MiB buckets: the inference agent
    holds its ranks' shared receive slots only (2 ranks x 2 slots x 1 MiB), not slots of its own per
    (destination, source) pair besides them, so with the ring the whole job's staging stays flat when the
    model grows 4x."""
    small = _bench("--mode", "gdr", "--size-mb", "4", "--fsdp", "2", "--inference-tp", "2", "--staging", "ring",
                   "--depth", "2")
    big = _bench("--mode", "gdr", "--size-mb", "16", "--fsdp", "2", "--inference-tp", "2", "--staging", "ring",
                 "--depth", "2")
    for r in (small, big):
        assert r["bit_exact"] is True
        # (a bucket is a little over 1 MiB where a tensor's piece does not split at the bucket's end)
        assert _inference_peak(r) <= 2 * 2 * MiB * 1.1, r["peak_staging_bytes_by_pod"]
        assert _trainer_peak(r) <= 2 * 2 * MiB + 64 * 1024, r["peak_staging_bytes_by_pod"]
    assert big["peak_staging_bytes"] <= small["peak_staging_bytes"] * 1.1, (small["peak_staging_bytes_by_pod"],
                                                                          big["peak_staging_bytes_by_pod"])


def test_a_cpu_snapshot_releases_the_trainer_and_is_counted() -> None:
    """--snapshot copy on CPU tensors: publish returns after a host clone (not after the transfer), and the
    clone is reported (snapshot_bytes = the model, one more copy per byte)."""
    r = _bench("--mode", "nccl", "--size-mb", "8", "--staging", "ring", "--snapshot", "copy")
    assert r["bit_exact"] is True and r["trainer_held_for"] == ["snapshot"]
    assert r["snapshot_bytes"] == r["bytes"]
    assert r["copies_per_byte_by_stage"]["snapshot"] == pytest.approx(1.0, abs=0.01)
    assert _trainer_peak(r) <= 2 * MiB + 64 * 1024


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _trainer_metrics(pod: Any) -> str:
    return get_text(f"{pod.metrics_url}/metrics")[1]


def test_a_receiver_dying_mid_stream_frees_the_ring_and_commits_nothing(tmp_path: Path,
                                                                         clusters: list[Cluster]) -> None:
    """The inference agent is killed while version 2 streams (its engine loads slowly): the trainer agent's
    ring goes back to the pool, the held publish returns unserved and withdraws the version, the engine
    never commits it; a restarted agent then gets version 3 bit-exact through the same bounded ring."""
    c = Cluster(tmp_path, mode="NCCL", bucket_mb=1)
    clusters.append(c)
    c.extra_env.update({"WEIGHTSYNC_STAGING": "ring", "WEIGHTSYNC_STAGING_DEPTH": "2"})
    t = c.add_pod("ring-trainer-0", contract.ROLE_TRAINER)
    i = c.add_pod("ring-inference-0-0", contract.ROLE_INFERENCE)
    c.write_topology()
    c.start_agent(t)
    c.start_agent(i)
    c.spawn(i, "engine", [sys.executable, str(APPS), "engine", "--run", str(tmp_path), "--slow", "2"])
    c.spawn(t, "trainer", [sys.executable, str(APPS), "trainer", "--run", str(tmp_path), "--hold-timeout", "15"])
    published = tmp_path / "published.jsonl"
    commits = tmp_path / "commits.jsonl"

    (tmp_path / "go-1").touch()
    wait_for(lambda: any(r["version"] == 1 for r in _rows(published)), 90, "version 1 published and served", c)
    assert _rows(published)[0]["served"] is True and _rows(published)[0]["streamed"] == "held"
    assert _rows(commits) == [{"version": 1, "bit_exact": True}]

    (tmp_path / "go-2").touch()
    wait_for(lambda: (tmp_path / "loading-2").exists(), 60, "version 2 streaming into the engine", c)
    c.kill(i, "agent")  # the receiver dies mid-stream
    wait_for(lambda: any(r["version"] == 2 for r in _rows(published)), 60, "the held publish of version 2 ended", c)
    assert [r["served"] for r in _rows(published) if r["version"] == 2] == [False]
    tm = _trainer_metrics(t)
    assert metric_value(tm, "weightsync_agent_ring_transfers") == 0.0  # the ring is back in the pool
    assert (metric_value(tm, "weightsync_agent_staging_peak_bytes") or 0.0) <= 2 * MiB + 64 * 1024
    assert "staging.withdraw version=2" in c.log_text(t, "agent")
    assert all(r["version"] != 2 for r in _rows(commits))

    c.start_agent(i)  # a new receiver: it must not find version 2 any more, and gets version 3 whole
    wait_for(lambda: c.log_text(i, "agent").count("engine connected") >= 2, 60, "the new agent and the engine", c)
    (tmp_path / "go-3").touch()
    wait_for(lambda: any(r["version"] == 3 for r in _rows(published)), 120, "version 3 published", c)
    assert [r["served"] for r in _rows(published) if r["version"] == 3] == [True]
    wait_for(lambda: any(r["version"] == 3 for r in _rows(commits)), 30, "version 3 committed", c)
    assert [r for r in _rows(commits) if r["version"] >= 2] == [{"version": 3, "bit_exact": True}]
    tm = _trainer_metrics(t)
    assert metric_value(tm, "weightsync_agent_ring_transfers") == 0.0
    assert (metric_value(tm, "weightsync_agent_staging_peak_bytes") or 0.0) <= 2 * MiB + 64 * 1024


# --- in-process pieces ---------------------------------------------------------------------------------------
def test_staging_mode_comes_from_the_agent_env() -> None:
    assert ring.staging_mode_from_env({}) == ("version", ring.DEFAULT_DEPTH)
    assert ring.staging_mode_from_env({ring.ENV_STAGING: "Ring", ring.ENV_DEPTH: "4"}) == ("ring", 4)
    for bad in ({ring.ENV_STAGING: "stream"}, {ring.ENV_STAGING: "ring", ring.ENV_DEPTH: "0"},
                {ring.ENV_STAGING: "ring", ring.ENV_DEPTH: "two"}):
        with pytest.raises(ValueError, match="WEIGHTSYNC_STAGING"):
            ring.staging_mode_from_env(bad)


def test_snapshot_modes_on_cpu_tensors() -> None:
    w = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    held, n, hold = ring.snapshot_of(w, "auto")  # CPU tensors: held, nothing copied
    assert hold and n == 0 and all(held[k] is w[k] for k in w)
    copied, n, hold = ring.snapshot_of(w, "copy")
    assert not hold and n == 6 * 4 + 4 * 2
    assert all(copied[k] is not w[k] and torch.equal(copied[k], w[k]) for k in w)
    w["a"].add_(1)  # training goes on: the snapshot keeps the published bytes
    assert torch.equal(copied["a"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    with pytest.raises(ValueError, match="ring_snapshot"):
        ring.snapshot_of(w, "device")


def test_fill_slot_places_pieces_where_the_bucket_wants_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's fill: each entry (a whole shard or a strided piece of one) lands at its byte offset."""
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    seg = segments.create_segment(4096, "wstest")
    try:
        w = {"row": torch.arange(32, dtype=torch.float32).reshape(4, 8), "v": torch.arange(5, dtype=torch.int64)}
        entries = [["row", [1, 4], [2, 4], 0], ["v", [0], [5], 256]]
        n = ring.fill_slot(w, entries, seg, 1024, cuda=False)
        assert n == 2 * 4 * 4 + 5 * 8
        assert torch.equal(seg.view(1024, torch.float32, (2, 4)), w["row"][1:3, 4:8])
        assert torch.equal(seg.view(1024 + 256, torch.int64, (5,)), w["v"])
    finally:
        seg.unlink()


def test_ring_store_streams_metadata_only_and_tells_trainers_what_it_drops(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    rs = ring.BucketRing("wstest", depth=2)
    dropped: list[tuple[int, list[int]]] = []
    monkeypatch.setattr(rs, "drop", lambda v, ranks: dropped.append((v, ranks)))
    store = StagedVersions([0], "wstest", ring=rs)
    meta = [{"name": "w", "dtype": "float32", "shape": [4, 8], "global_shape": [4, 8], "global_offset": [0, 0],
             "nbytes": 128}]
    before = segments.STAGING.current
    assert store.stage_request(0, 1, 128, "cpu", stream=True) == {"ring": {"depth": 2}}
    assert segments.STAGING.current == before  # nothing staged for a streamed version
    assert "segment" in store.stage_request(0, 2, 128, "cpu")  # a client that cannot stream: staged whole
    with pytest.raises(StagingError, match="without a matching stage request"):
        store.publish_stream(0, 3, meta, {})
    sv = store.publish_stream(0, 1, meta, {}, snapshot_bytes=128)
    assert sv.complete and sv.streamed and store.snapshot_bytes() == 128 and store.latest() == 1
    store.stage_request(0, 4, 128, "cpu", stream=True)
    store.publish_stream(0, 4, meta, {})
    for _ in range(100):  # the drop is sent from a thread
        if dropped:
            break
        time.sleep(0.02)
    assert dropped == [(1, [0])] and store.latest() == 4 and store.snapshot_bytes() == 0
    assert store.withdraw(4) and store.latest() is None and not store.withdraw(4)
    with pytest.raises(StagingError, match="not newer"):  # a withdrawn version is not published again
        store.stage_request(0, 4, 128, "cpu", stream=True)
    store.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensors_are_snapshot_on_the_device_and_streamed_into_pinned_host_slots(
        memory_staging_dir: Path) -> None:
    """The CUDA path of the two functions the CPU tests run: `auto` clones CUDA tensors on their GPU (the
    trainer is held for that only), and a fill copies device -> pinned host ring slot, synchronised."""
    w = {"row": torch.arange(32, dtype=torch.float32, device="cuda").reshape(4, 8),
         "b": torch.ones(1000, dtype=torch.bfloat16, device="cuda")}
    snap, n, hold = ring.snapshot_of(w, "auto")
    assert not hold and n == 32 * 4 + 1000 * 2
    assert all(snap[k].is_cuda and snap[k].data_ptr() != w[k].data_ptr() for k in w)
    w["row"].add_(1)  # training goes on on the GPU
    seg = segments.create_segment(8192, "wstest")
    try:
        assert isinstance(seg, segments.ShmSegment) and seg.pinned  # the ring is pinned host memory
        got = ring.fill_slot(snap, [["row", [1, 4], [2, 4], 0], ["b", [0], [1000], 256]], seg, 4096, cuda=True)
        assert got == 2 * 4 * 4 + 1000 * 2
        want = torch.arange(32, dtype=torch.float32).reshape(4, 8)[1:3, 4:8]
        assert torch.equal(seg.view(4096, torch.float32, (2, 4)), want)
        assert torch.equal(seg.view(4096 + 256, torch.bfloat16, (1000,)), torch.ones(1000, dtype=torch.bfloat16))
    finally:
        seg.unlink()
