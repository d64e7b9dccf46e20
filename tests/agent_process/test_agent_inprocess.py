"""Agent pieces in one process (fast): config, topology reload, client metadata, staging, the Custom
engine path over the real Unix socket and shared memory, and the pure pod-status rules."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from staging_agent import serve_staging

from weightsync.agent.client import InferenceSession, PlacedShard, TrainerSession
from weightsync.agent.config import AgentConfig, ConfigError, TopologyWatcher
from weightsync.agent.engines.base import EngineError, load_version
from weightsync.agent.engines.custom import AppRegistry, CustomEngineAdapter
from weightsync.agent.layout.shards import checksums, local_shards
from weightsync.agent.podstate import (
    Observed,
    annotation_patch,
    annotations_for,
    condition_for,
    desired_from_annotations,
    synced_state,
)
from weightsync.agent.staging import segments
from weightsync.agent.staging.index import StagingError
from weightsync.agent.staging.versions import StagedVersions
from weightsync.agent.wire.local import LocalServer
from weightsync.crds import contract
from weightsync.crds.topology import InferenceReplicaTopology, PodMember, Topology, TrainerTopology


def _env(tmp: Path, **kw: str) -> dict[str, str]:
    env = {contract.ENV_JOB: "j", contract.ENV_POD_NAME: "j-trainer-0", contract.ENV_ROLE: "trainer",
           contract.ENV_TOPOLOGY_PATH: str(tmp / "topo.json"), contract.ENV_TOKEN_PATH: str(tmp / "token"),
           contract.ENV_SOCKET_DIR: str(tmp)}
    env.update(kw)
    return env


def _topo(generation: int = 1) -> Topology:
    return Topology(job="j", namespace="default", generation=generation, placement="Separated", mode="NCCL",
                    bucket_size_mb=1, trainer=TrainerTopology(world_size=1, tensor=1, pipeline=1, data=1, pods=[
                        PodMember(name="j-trainer-0", index=0, ranks=[0], ip="127.0.0.1")]),
                    inference=[InferenceReplicaTopology(replica=0, tensor=1, world_size=1, pods=[
                        PodMember(name="j-inference-0-0", index=0, ranks=[0])])])


def test_config_from_env_and_clear_errors(tmp_path: Path) -> None:
    cfg = AgentConfig.from_env(_env(tmp_path, **{contract.ENV_BUCKET_SIZE_MB: "64", contract.ENV_KUBE_ENABLED: "false"}))
    assert cfg.pod_ip == "127.0.0.1" and cfg.bucket_size_mb == 64 and not cfg.kube_enabled
    assert cfg.socket_path == tmp_path / contract.AGENT_SOCKET_NAME and cfg.is_trainer and not cfg.is_inference
    with pytest.raises(ConfigError, match=contract.ENV_ROLE):
        AgentConfig.from_env(_env(tmp_path, **{contract.ENV_ROLE: "chef"}))
    with pytest.raises(ConfigError, match=contract.ENV_RANK):
        AgentConfig.from_env(_env(tmp_path, **{contract.ENV_RANK: "3", contract.ENV_WORLD_SIZE: "2"}))
    with pytest.raises(ConfigError, match="not an integer"):
        AgentConfig.from_env(_env(tmp_path, **{contract.ENV_CONTROL_PORT: "http"}))
    with pytest.raises(ConfigError, match="token file"):
        cfg.read_token()
    (tmp_path / "token").write_text("  \n")
    with pytest.raises(ConfigError, match="empty"):
        cfg.read_token()


def test_config_delta_sync_env(tmp_path: Path) -> None:
    """spec.transfer.deltaSync as the operator passes it: absent means off; bad values are clear errors."""
    off = AgentConfig.from_env(_env(tmp_path))
    assert off.delta_sync is False and off.delta_max_changed_fraction == 0.1
    on = AgentConfig.from_env(_env(tmp_path, **{contract.ENV_DELTA_SYNC: "true",
                                               contract.ENV_DELTA_MAX_CHANGED_FRACTION: "0.2"}))
    assert on.delta_sync is True and on.delta_max_changed_fraction == 0.2
    assert AgentConfig.from_env(_env(tmp_path, **{contract.ENV_DELTA_SYNC: "false"})).delta_sync is False
    with pytest.raises(ConfigError, match=f"{contract.ENV_DELTA_SYNC}='maybe' is not a boolean"):
        AgentConfig.from_env(_env(tmp_path, **{contract.ENV_DELTA_SYNC: "maybe"}))
    for bad, why in (("lots", "not a number"), ("1.5", "from 0 to 1"), ("-0.1", "from 0 to 1"), ("nan", "from 0 to 1")):
        with pytest.raises(ConfigError, match=f"{contract.ENV_DELTA_MAX_CHANGED_FRACTION}='{bad}'.*{why}"):
            AgentConfig.from_env(_env(tmp_path, **{contract.ENV_DELTA_SYNC: "true",
                                                   contract.ENV_DELTA_MAX_CHANGED_FRACTION: bad}))


def test_topology_watcher_reports_generation_changes(tmp_path: Path) -> None:
    path = tmp_path / "topo.json"
    path.write_text(_topo(1).to_json())
    w = TopologyWatcher(path)
    assert w.poll() is None
    tmp = tmp_path / "t.tmp"
    tmp.write_text(_topo(2).to_json())
    os.replace(tmp, path)  # the kubelet's atomic swap
    new = w.poll()
    assert new is not None and new.generation == 2
    path.write_text("{broken")
    assert w.poll() is None and w.current.generation == 2  # a bad file keeps the last good topology


def test_local_shards_plain_tied_and_explicit() -> None:
    emb = torch.nn.Embedding(10, 4)
    model = torch.nn.Module()
    model.embed = emb
    model.head = torch.nn.Linear(4, 10, bias=False)
    model.head.weight = emb.weight  # tied
    shards, aliases = local_shards(model)
    assert [s.name for s in shards] == ["embed.weight"] and aliases == {"head.weight": "embed.weight"}
    full = torch.arange(12.0).reshape(4, 3)
    shards, _ = local_shards({"w": PlacedShard(full[2:], (4, 3), (2, 0))})
    assert shards[0].global_shape == (4, 3) and shards[0].global_offset == (2, 0)
    with pytest.raises(ValueError, match="outside"):
        local_shards({"w": PlacedShard(full, (4, 3), (1, 0))})


def test_local_shards_dtensor_uses_truthful_global_metadata() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    t = distribute_tensor(torch.arange(10.0).reshape(5, 2), mesh, [Shard(0)])
    shards, _ = local_shards({"w": t})
    assert shards[0].global_shape == (5, 2) and shards[0].global_offset == (0, 0)
    assert torch.equal(shards[0].tensor, torch.arange(10.0).reshape(5, 2))


def test_staging_store_keeps_latest_and_readers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    completed: list[int] = []
    store = StagedVersions([0], "wstest", keep=1, on_complete=lambda sv: completed.append(sv.version))
    meta = [{"name": "w", "dtype": "float32", "shape": [4], "global_shape": [4], "global_offset": [0],
             "offset": 0, "nbytes": 16}]
    try:
        for v in (1, 2):
            seg = store.stage(0, v, 16, "cpu")
            seg.view(0, torch.float32, (4,)).copy_(torch.full((4,), float(v)))
            store.publish(0, v, seg.name, meta, {})
        assert completed == [1, 2] and store.latest() == 2 and store.get(1) is None
        with store.reading(2) as sv:
            seg3 = store.stage(0, 3, 16, "cpu")
            store.publish(0, 3, seg3.name, meta, {})
            assert store.get(2) is not None  # still read: not evicted, its slot not reused
            assert torch.equal(sv.ranks[0].tensors()["w"], torch.full((4,), 2.0))
        assert store.get(2) is None
        with pytest.raises(StagingError, match="must increase"):
            store.stage(0, 3, 16, "cpu")
    finally:
        store.close()


class _Engine:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.loaded: dict[str, torch.Tensor] = {}
        self.events: list[str] = []

    def on_bucket(self, version: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
        if self.fail:
            raise RuntimeError("engine exploded")
        for n, t in tensors:
            self.loaded[n] = t.clone()

    def on_commit(self, version: int) -> None:
        self.events.append(f"commit{version}")


def engine_registry_server(path: Path) -> tuple[AppRegistry, LocalServer]:
    """The agent's side of the app socket, as the agent runs it: each engine rank that says hello is
    registered (what the agent's loader drives) and held until the registry drops it."""
    registry = AppRegistry()

    def handler(conn: Any) -> None:
        h, _ = conn.recv()
        conn.reply_ok()
        registry.add(int(h["rank"]), conn, h.get("served_version"))
        while registry.holds(int(h["rank"]), conn):
            time.sleep(0.05)

    return registry, LocalServer(path, handler).start()


def test_custom_engine_over_socket_and_shm_always_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    registry, server = engine_registry_server(tmp_path / "agent.sock")
    eng = _Engine()
    sess = InferenceSession(eng.on_bucket, eng.on_commit, socket_path=tmp_path / "agent.sock", rank=0,
                            on_pause=lambda: eng.events.append("pause"), on_resume=lambda: eng.events.append("resume"))
    sess.start()
    adapter = CustomEngineAdapter(registry, [0], prefix="wstest", connect_timeout=10)
    try:
        tensors = {"a": torch.randn(3, 5), "b": torch.randint(-128, 127, (7,), dtype=torch.int8),
                   "c": torch.randn(2, 2).to(torch.bfloat16)}
        load_version(adapter, 1, [list(tensors.items())[:2], list(tensors.items())[2:]], pause_generation=True)
        assert checksums(eng.loaded.items()) == checksums(tensors.items())
        assert eng.events == ["pause", "commit1", "resume"] and adapter.served_version() == 1
        eng.fail = True
        with pytest.raises(EngineError, match="engine exploded"):
            load_version(adapter, 2, [list(tensors.items())], pause_generation=True)
        assert eng.events[-1] == "resume" and "commit2" not in eng.events and adapter.served_version() == 1
    finally:
        adapter.close()
        sess.close()
        server.close()


def test_trainer_session_publish_is_bit_exact_in_staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    store = StagedVersions([0], "wstest")
    server = serve_staging(tmp_path / "agent.sock", store)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    weights = {**{k: v.detach().clone() for k, v in model.state_dict().items()},
               "mask": torch.tensor([True, False]), "scale": torch.tensor(3, dtype=torch.int64),
               "tiny": torch.zeros(0), **{f"t{i}": torch.full((3,), float(i)) for i in range(500)}}
    try:
        with TrainerSession(tmp_path / "agent.sock", rank=0) as s:
            res = s.publish(weights, version=7)
            assert res.tensors == len(weights)
            for p in model.parameters():  # the trainer may reuse its memory at once
                p.data.zero_()
            s.publish(model, version=8)
        sv = store.get(7)
        assert sv is None  # evicted by 8 (keep=1)
        got = store.get(8)
        assert got is not None
        assert checksums(got.ranks[0].tensors().items()) == checksums(model.state_dict().items())
        with pytest.raises(Exception, match="must increase"), TrainerSession(tmp_path / "agent.sock", rank=0) as s:
            s.publish(model, version=8)
    finally:
        server.close()
        store.close()


def test_pod_status_rules() -> None:
    assert synced_state(None, None, 1)[0] is True
    assert synced_state(5, 4, 1) == (True, "UpToDate", "serving 4, newest 5, maxStaleness 1")
    ok, reason, msg = synced_state(5, 3, 1)
    assert not ok and reason == "Stale" and "2 versions behind" in msg
    assert synced_state(2, None, 1)[0] is False
    assert desired_from_annotations({contract.ANN_TARGET_VERSION: "7", contract.ANN_PAUSED: "true"}).paused
    assert desired_from_annotations({contract.ANN_TARGET_VERSION: "x"}).target_version is None
    ann = annotations_for(Observed(served_version=3, last_sync={"version": 3, "bytes": 1}))
    assert ann[contract.ANN_SERVED_VERSION] == "3" and ann[contract.ANN_SYNC_ERROR] is None
    assert annotation_patch(ann, dict(ann)) == {}
    assert condition_for(Observed(), __import__("datetime").datetime.now()) is None


def test_agent_dying_mid_load_aborts_the_partial_version(tmp_path: Path) -> None:
    """The agent that began a load dies: the engine drops the partial version and tells the next agent
    it is still paused (so that agent resumes it)."""
    import queue



    hellos: queue.Queue[dict[str, Any]] = queue.Queue()
    first = threading.Event()

    def handler(conn: Any) -> None:
        h, _ = conn.recv()
        hellos.put(h)
        conn.reply_ok()
        if not first.is_set():
            first.set()
            conn.request({"op": "pause"})
            conn.request({"op": "begin", "version": 5})
            return  # the LocalServer closes the connection: the agent "died" mid-load
        time.sleep(5)

    server = LocalServer(tmp_path / "agent.sock", handler).start()
    aborted: list[tuple[int, str]] = []
    sess = InferenceSession(lambda v, t: None, lambda v: None, on_abort=lambda v, r: aborted.append((v, r)),
                            socket_path=tmp_path / "agent.sock", rank=0, served_version=4)
    sess.start()
    try:
        assert hellos.get(timeout=10)["paused"] is False
        second = hellos.get(timeout=10)
        assert second["paused"] is True and second["served_version"] == 4
        assert aborted and aborted[0][0] == 5 and "disconnected" in aborted[0][1]
        assert sess.loading is None
    finally:
        sess.close()
        server.close()



def test_agent_waits_until_the_topology_lists_its_pod(tmp_path: Path) -> None:

    from weightsync.agent.membership import wait_for_membership

    path = tmp_path / "topo.json"
    topo = _topo(1)
    topo.inference[0].pods[0].name = "someone-else"
    path.write_text(topo.to_json())
    cfg = AgentConfig.from_env(_env(tmp_path, **{contract.ENV_ROLE: "inference",
                                                 contract.ENV_POD_NAME: "j-inference-0-0"}))
    with pytest.raises(ConfigError, match="not listed as inference"):
        wait_for_membership(cfg, 0.1)

    def later() -> None:
        time.sleep(1.0)
        tmp = tmp_path / "t.tmp"
        tmp.write_text(_topo(2).to_json())
        os.replace(tmp, path)

    threading.Thread(target=later, daemon=True).start()
    watcher = wait_for_membership(cfg, 30)
    assert watcher.current.generation == 2


def test_custom_engine_that_hangs_fails_the_load_after_the_timeout(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A hung engine must not hold the agent forever: the request times out (spec.transfer.timeoutSeconds),
    the load fails without a commit, and the stuck session is dropped."""
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    registry, server = engine_registry_server(tmp_path / "agent.sock")
    eng = _Engine()
    release = threading.Event()  # set once the load failed: the engine hangs however long the set-up took

    def hang(version: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
        release.wait(30)

    sess = InferenceSession(hang, eng.on_commit, socket_path=tmp_path / "agent.sock", rank=0)
    sess.start()
    adapter = CustomEngineAdapter(registry, [0], prefix="wstest", connect_timeout=10, request_timeout=1.0)
    try:
        with pytest.raises(EngineError, match=r"did not answer bucket within 1s"):
            load_version(adapter, 1, [[("a", torch.randn(4))]], pause_generation=False)
        release.set()  # the engine comes back: its session, dropped by the agent, connects again
        assert "commit1" not in eng.events and adapter.served_version() is None
    finally:
        release.set()
        adapter.close()
        sess.close()
        server.close()
