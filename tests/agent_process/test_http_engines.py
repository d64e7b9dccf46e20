"""A real agent process driving an SGLang engine over HTTP: the engine is the SGLang 0.5.23 stand-in
(SGLang's own FastAPI app, run by the engine venv's python, in front of SGLang's own session rules and
receive code), started as another process in its own mount and PID namespaces with its own /dev/shm, as
the engine container is. Per version the engine is paused, a
session is opened, the buckets arrive over SGLang's weight-update group, the session is closed, the
version set and the engine resumed; an unsupported engine release is refused without any load."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import requests
from podprocs import Cluster, wait_for

from weightsync.agent.engines.base import LABEL_DIGEST_CHARS, parse_version
from weightsync.crds import contract
from weightsync.e2e.engine_venv import engine_python
from weightsync.e2e.procs import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engines"))
from recording_server import RecordingServer

NAMESPACES = ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child", "sh", "-c"]


def _trainer_and_sglang(tmp_path: Path, clusters: list[Cluster], **agent_env: str) -> tuple[Cluster, Any, str]:
    """A trainer pod publishing 2 versions and an inference pod whose engine is the SGLang stand-in, in its own
    mount / PID namespaces and /dev/shm; returns (cluster, trainer pod, engine URL)."""
    c = Cluster(tmp_path, mode="NCCL", bucket_mb=1)
    clusters.append(c)
    t = c.add_pod("demo-trainer-0", contract.ROLE_TRAINER)
    i = c.add_pod("demo-inference-0-0", contract.ROLE_INFERENCE)
    c.write_topology()
    port = free_port(i.ip)
    url = f"http://{i.ip}:{port}"
    engine = (f"mount -t tmpfs tmpfs /dev/shm && exec {engine_python()} -m weightsync.e2e.engines.sglang_standin "
              f"--host {i.ip} --port {port}")
    c.spawn(i, "engine", [*NAMESPACES, engine])
    c.start_agent(t)
    c.start_agent(i, **{contract.ENV_ENGINE_TYPE: "SGLang", contract.ENV_ENGINE_URL: url, **agent_env})

    def engine_up() -> bool:
        try:
            return requests.get(f"{url}/standin/state", timeout=2).ok
        except requests.RequestException:
            return False

    # SGLang's app takes ~20 s to import and resolve its ServerArgs: the versions are published once it
    # answers, so that every one of them is loaded (not only the newest)
    wait_for(engine_up, 180, "the SGLang stand-in answers", c)
    c.start_trainer(t, "--versions", "2", "--interval", "1.0")
    return c, t, url


def _after_generation_continued(url: str) -> list[dict[str, Any]] | None:
    """The stand-in's events once the last pause_generation has its continue_generation (None before): the
    agent resumes after the version is in, so a read right when the version shows can be a step early. A
    pause never resumed never gets here."""
    events: list[dict[str, Any]] = requests.get(f"{url}/standin/events", timeout=5).json()["events"]
    ops = [e["op"] for e in events]
    if "pause_generation" not in ops or ops.count("pause_generation") != ops.count("continue_generation"):
        return None
    return events


def test_agent_drives_an_sglang_engine_over_http(tmp_path: Path, clusters: list[Cluster]) -> None:
    c, _, url = _trainer_and_sglang(tmp_path, clusters)

    def state() -> dict[str, object] | None:
        try:
            return dict(requests.get(f"{url}/standin/state", timeout=2).json())
        except requests.RequestException:
            return None

    wait_for(lambda: parse_version((state() or {}).get("weight_version")) == 2, 240, "SGLang serves version 2", c)
    # the version is set inside update_weight_version; the agent's flush_cache and continue_generation follow
    events: list[dict[str, Any]] = wait_for(lambda: _after_generation_continued(url), 30,
                                            "generation continued after version 2", c)
    ops = [e["op"] for e in events]
    assert "refused" not in ops, events
    for v in (1, 2):
        k = next(n for n, e in enumerate(events)
                 if e["op"] == "update_weight_version" and parse_version(e["version"]) == v)
        # the label names the content: `N-<digest prefix>` (agent/transfer/digest.py)
        assert re.fullmatch(rf"{v}-[0-9a-f]{{{LABEL_DIGEST_CHARS}}}", events[k]["version"]), events[k]
        before = ops[:k]
        last_pause = len(before) - 1 - before[::-1].index("pause_generation")
        window = [op for op in before[last_pause:] if op != "init_weights_update_group"]  # the group: once
        assert window[:2] == ["pause_generation", "begin_weight_update"], window
        assert window[-1] == "end_weight_update" and "update_weights_from_distributed" in window, window
        assert "continue_generation" not in window, window
        assert ops[k + 1 : k + 4] == ["weights", "flush_cache", "continue_generation"], ops[k:]
    assert ops.count("pause_generation") == ops.count("continue_generation") >= 2
    assert ops.count("init_weights_update_group") == 1
    st = state()
    assert st is not None and st["session_open"] is False and st["paused"] is False


def _refused_by_agent(tmp_path: Path, clusters: list[Cluster], server_info: dict[str, object], needle: str,
                      what: str) -> str:
    """A trainer and an inference pod whose engine answers `server_info`: the agent's log once it says `needle`;
    the agent made no weight-update call to an engine it cannot drive."""
    server = RecordingServer()
    server.replies["/server_info"] = [(200, server_info)]
    try:
        c = Cluster(tmp_path, mode="NCCL", bucket_mb=1)
        clusters.append(c)
        t = c.add_pod("demo-trainer-0", contract.ROLE_TRAINER)
        i = c.add_pod("demo-inference-0-0", contract.ROLE_INFERENCE)
        c.write_topology()
        c.start_agent(t)
        c.start_agent(i, **{contract.ENV_ENGINE_TYPE: "SGLang", contract.ENV_ENGINE_URL: server.url})
        c.start_trainer(t, "--versions", "2", "--interval", "1.0")
        log = i.logs["agent"]
        wait_for(lambda: needle in log.read_text(), 60, what, c)
        assert [p for p in server.paths() if p not in ("/server_info",)] == []
        return log.read_text()
    finally:
        server.close()


def test_agent_refuses_an_unsupported_sglang_release(tmp_path: Path, clusters: list[Cluster]) -> None:
    log = _refused_by_agent(tmp_path, clusters, {"version": "0.5.5"}, "SGLang 0.5.5 is not supported",
                            "the agent refuses SGLang 0.5.5")
    assert "0.5.23" in log


def test_agent_refuses_an_sglang_server_of_another_tp_size(tmp_path: Path, clusters: list[Cluster]) -> None:
    """The job's inference TP is 1, the server reports tp_size 2 (/server_info): the weight-update group could
    never complete its rendezvous, so the agent refuses the engine once, naming both sizes, and calls no
    weight-update route."""
    log = _refused_by_agent(tmp_path, clusters, {"version": "0.5.23", "tp_size": 2, "dp_size": 1, "pp_size": 1},
                            "SGLang configuration not supported", "the agent refuses tp_size 2")
    assert "tp_size=2" in log and "parallelism.tensor is 1" in log


def test_agent_loads_each_version_as_a_lora_adapter(tmp_path: Path, clusters: list[Cluster]) -> None:
    """spec.inference.engine.lora (WEIGHTSYNC_LORA): the agent receives every bucket as for base weights and
    hands the version to SGLang whole, as the adapter `policy` (unload, load from tensors by value with
    SGLang's own checksum check), never inside a weight-update session; bit-exact with the trainer."""
    import json

    spec = {"adapterName": "policy", "config": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]},
            "pinned": False}
    c, t, url = _trainer_and_sglang(tmp_path, clusters, **{contract.ENV_LORA: json.dumps(spec)})

    def lora() -> dict[str, object]:
        try:
            return dict(requests.get(f"{url}/standin/lora", timeout=2).json())
        except requests.RequestException:
            return {}

    wait_for(lambda: parse_version(lora().get("version")) == 2, 240, "SGLang serves adapter version 2", c)
    published = json.loads((c.root / t.name / "sock" / "demo-trainer-checksums.json").read_text())
    assert lora()["adapters"] == {"policy": published["2"]}
    ops = [e["op"] for e in wait_for(lambda: _after_generation_continued(url), 30,
                                     "generation continued after adapter version 2", c)]
    assert "refused" not in ops and "begin_weight_update" not in ops, ops
    assert ops.count("load_lora_adapter_from_tensors") == 2 and ops.count("unload_lora_adapter") == 2, ops
    assert ops.count("pause_generation") == ops.count("continue_generation") >= 2
