"""A real vLLM server takes every version from real agents (marker `engine_servers`, in `make test`).

The engine is vLLM's own OpenAI server (the CPU build 0.32.0, in the engine venv: e2e/engine_venv.py), with
weightsync's weight-transfer backend (the `vllm.general_plugins` plugin, agent/engines/vllm_plugin.py), serving
the tiny Llama (agent/demo/tiny_llama.py) from `--load-format dummy`. It runs as the engine container of an
inference pod would: in its own mount and PID namespaces with its own /dev/shm, at the pod's address. A real
trainer agent and a real inference agent (weightsync.agent.main) move the versions; the trainer process is
agent/demo/llama_trainer.py, gated so that every version is checked before the next one replaces it.

Per version: vLLM's /weight_info names it, and the server's greedy tokens, their logprobs and the prompt
logprobs equal transformers' LlamaForCausalLM over the very state dict the trainer published (tokens identical,
logprobs within bf16 tolerance), and differ from the previous version's. Then the last hop fails on purpose
(contract.ENV_ENGINE_FAULT): a bucket corrupted after its digest leaves were computed is refused inside the
engine and the agent restores the last good version (outputs and /weight_info back at N-1, the server alive);
an agent killed inside an open update leaves the engine paused, never dead, and its restart loads the next
version whole.

One server for the module (it takes 30-60 s to start on 2 cores); the tests run in file order on it.
"""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

from weightsync.agent.demo import tiny_llama
from weightsync.agent.engines.base import parse_version
from weightsync.crds import contract
from weightsync.e2e.engines import vllm_server
from weightsync.e2e.procs import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "agent_process"))
from podprocs import PY, Cluster, Pod, wait_for

pytestmark = [pytest.mark.engine_servers, pytest.mark.timeout(900)]

# The engine container's own mount and PID namespaces, with its own /proc as a container has (vLLM's CPU worker
# reads /proc/<its pid>/status: the host's /proc has no such pid, or another process's).
NAMESPACES = ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child", "--mount-proc",
              "sh", "-c"]
READY_TIMEOUT = 300.0
LOAD_TIMEOUT = 180.0


@dataclass
class Fleet:
    cluster: Cluster
    trainer: Pod
    inference: Pod
    url: str
    gate: Path
    saved: Path
    outputs: dict[int, list[dict[str, Any]]] = field(default_factory=dict)

    def weight_info(self) -> str | None:
        try:
            return str(requests.get(f"{self.url}/weight_info", timeout=5).json()["weight_version"])
        except (requests.RequestException, ValueError, KeyError):
            return None

    def served(self) -> int | None:
        return parse_version(self.weight_info())

    def publish(self, version: int) -> None:
        (self.gate / f"go-{version}").touch()

    def wait_served(self, version: int, timeout: float = LOAD_TIMEOUT) -> None:
        wait_for(lambda: self.served() == version, timeout, f"vLLM serves version {version}", self.cluster)

    def check_reference(self, version: int) -> list[dict[str, Any]]:
        got, diffs = vllm_server.check(self.url, self.saved / f"v{version}.pt")
        assert diffs == [], (version, got)
        self.outputs[version] = got
        return got

    def start_agent(self, **env: str) -> None:
        self.cluster.start_agent(self.inference, **{contract.ENV_ENGINE_TYPE: "VLLM",
                                                    contract.ENV_ENGINE_URL: self.url, **env})

    def restart_agent(self, fault: str = "") -> None:
        """SIGKILL the inference agent and start it again (as its pod's kubelet would), with a last-hop drill."""
        self.cluster.kill(self.inference, "agent")
        self.start_agent(**({contract.ENV_ENGINE_FAULT: fault} if fault else {}))

    def healthy(self) -> bool:
        try:
            return requests.get(f"{self.url}/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("vllm-fleet")
    c = Cluster(root, mode="NCCL", bucket_mb=1)
    t = c.add_pod("demo-trainer-0", contract.ROLE_TRAINER)
    i = c.add_pod("demo-inference-0-0", contract.ROLE_INFERENCE)
    c.write_topology()
    port = free_port(i.ip)
    url = f"http://{i.ip}:{port}"
    model = tiny_llama.write_model_dir(root / "model")
    server = shlex.join(vllm_server.server_command(model, i.ip, port))
    # the engine container: its own mount namespace and /dev/shm, its own PID namespace
    c.spawn(i, "engine", [*NAMESPACES, f"mount -t tmpfs tmpfs /dev/shm && exec {server}"],
            **vllm_server.server_env({}))
    gate, saved = root / "gate", root / "versions"
    gate.mkdir()
    f = Fleet(c, t, i, url, gate, saved)
    try:
        vllm_server.wait_ready(url, READY_TIMEOUT, i.procs["engine"])
        assert f.weight_info() is not None and f.served() is None  # dummy weights: vLLM's own initial label
        c.start_agent(t, **{contract.ENV_ENGINE_TYPE: "VLLM"})  # keeps the previous version staged (restores)
        f.start_agent()
        c.spawn(t, "trainer", [PY, "-m", "weightsync.agent.demo.llama_trainer", "--versions", "6", "--gate-dir",
                               str(gate), "--save-dir", str(saved)])
        yield f
    finally:
        failed = any(getattr(item, "rep_call", None) is not None and item.rep_call.failed
                     for item in request.session.items if item.module is request.module)
        c.stop_all()
        if failed:
            print(c.dump_logs())


def test_versions_1_to_3_serve_the_reference_outputs(fleet: Fleet) -> None:
    for v in (1, 2, 3):
        if v > 1:
            fleet.publish(v)
        fleet.wait_served(v)
        got = fleet.check_reference(v)
        if v > 1:
            assert [o["tokens"] for o in got] != [o["tokens"] for o in fleet.outputs[v - 1]], "a new version"
    # the agent drove vLLM's own session through the weightsync backend, announced by the server
    log = fleet.inference.logs["agent"].read_text()
    assert "vllm.backend weightsync (announced by the server)" in log
    engine_log = fleet.inference.logs["engine"].read_text()
    assert "weightsync group ready" in engine_log and "POST /finish_weight_update" in engine_log


def test_a_bucket_corrupted_on_the_last_hop_is_refused_inside_the_engine_and_the_last_version_restored(
        fleet: Fleet) -> None:
    """Version 4's second bucket is corrupted after its leaves were computed (the agent's last hop): vLLM's
    worker refuses it before loading, the agent never finishes the update with 4, reloads 3 and serves it;
    the next version loads whole."""
    if fleet.served() != 3:
        pytest.fail("needs the first test's version 3")
    fleet.restart_agent("engine-corrupt:4:1")
    fleet.publish(4)
    agent_log = fleet.inference.logs["agent"]
    wait_for(lambda: "restored version=3" in agent_log.read_text(), LOAD_TIMEOUT, "the agent restores 3",
             fleet.cluster)
    text = agent_log.read_text()
    assert "engine fault: corrupt at version=4 bucket=1" in text
    assert "refused bucket 1 of this version inside the engine: digest mismatch" in text
    engine_log = fleet.inference.logs["engine"].read_text()
    assert "digest mismatch in 1 tensor(s), first 'model." in engine_log  # the worker named the tensor
    assert "the agent gave up this update" in engine_log and "engine abort failed" not in text
    assert fleet.healthy()
    fleet.wait_served(3, 30)
    assert fleet.check_reference(3) == fleet.outputs[3]
    assert not fleet.weight_info().startswith("partial")  # type: ignore[union-attr]
    # the agent retries 4 (its fault was one-shot) and serves it
    fleet.wait_served(4)
    fleet.check_reference(4)


def test_an_agent_killed_inside_an_open_update_leaves_the_engine_alive_and_the_next_agent_loads_whole(
        fleet: Fleet) -> None:
    if fleet.served() != 4:
        pytest.fail("needs the previous test's version 4")
    fleet.restart_agent("engine-hang:5:1")
    fleet.publish(5)
    agent_log = fleet.inference.logs["agent"]
    wait_for(lambda: "hanging inside the open update" in agent_log.read_text(), LOAD_TIMEOUT,
             "the agent stops inside version 5's update", fleet.cluster)
    fleet.cluster.kill(fleet.inference, "agent")  # SIGKILL: no abort, no finish, no resume
    assert requests.get(f"{fleet.url}/is_paused", timeout=5).json()["is_paused"] is True  # never generating on meta
    assert fleet.served() == 4 and fleet.healthy()
    time.sleep(2)
    assert fleet.healthy(), "the engine survived the agent"
    fleet.start_agent()  # the restarted sidecar: closes the update left open, loads 5 whole, resumes
    fleet.wait_served(5)
    assert requests.get(f"{fleet.url}/is_paused", timeout=5).json()["is_paused"] is False
    fleet.check_reference(5)
    fleet.publish(6)
    fleet.wait_served(6)
    fleet.check_reference(6)
    assert "vllm.update_left_open" in agent_log.read_text()
