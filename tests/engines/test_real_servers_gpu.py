"""Real SGLang 0.5.23 and vLLM 0.33.0 servers take weights through the agent's engine adapters (GPU tier).

Unlike the stand-ins of the other engine tests, here the engine is the released server itself
(`python -m sglang.launch_server`, `vllm serve`) on a CUDA GPU, serving a tiny Llama written locally
(config only, random weights by the engine's `--load-format dummy`: no download, no tokenizer). The agent's
last hop (`load_version` + the adapter: the code an inference agent runs per version) loads version 1,
then 2, then 1 again, colocated (CUDA IPC handles by GPU UUID) and separated (SGLang's weight-update
group; vLLM's nccl backend, which needs a second GPU for the agent's rank 0). The engine's own checker
(SGLang `/weights_checker`, vLLM `/weight_checker`) proves what was served:

* every parameter's checksum changes from 1 to 2 (nothing was left from the dummy load or version 1);
* version 1 loaded again reads back exactly the checksums of the first load of 1 (the weights are a
  function of what the agent sent, nothing else);
* the engine reports the version the agent set (SGLang `weight_version`, vLLM `/weight_info`).

SGLang's `/get_weights_by_name` also reads the embedding back bit-exact against what was sent.

Needs a CUDA GPU and a Python with the full engine installed (the engine's image): set
`WEIGHTSYNC_SGLANG_PYTHON` / `WEIGHTSYNC_VLLM_PYTHON`, or run where `sglang` / `vllm` import with their
dependencies. Without them a test fails and says so (never a silent skip).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from weightsync.agent.engines import sglang, vllm
from weightsync.agent.engines.base import EngineAdapter, load_version
from weightsync.e2e.procs import free_port

pytestmark = [pytest.mark.gpu]  # not `engines`: that tier runs without a GPU, with no skips

START_TIMEOUT = 900.0  # first start compiles kernels / CUDA graphs
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def tiny_llama_weights(seed: int, device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """Every parameter of TINY_LLAMA under its Hugging Face name, bf16, a function of SEED."""
    c = TINY_LLAMA
    h, inter, v = int(c["hidden_size"]), int(c["intermediate_size"]), int(c["vocab_size"])  # type: ignore[call-overload]
    kv = int(c["num_key_value_heads"]) * int(c["head_dim"])  # type: ignore[call-overload]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                                          "lm_head.weight": (v, h)}
    for i in range(int(c["num_hidden_layers"])):  # type: ignore[call-overload]
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}
    g = torch.Generator().manual_seed(seed)
    return [(n, (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16).to(device)) for n, s in sorted(shapes.items())]


def _buckets(items: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    return [items[k:k + 5] for k in range(0, len(items), 5)]


def engine_python(engine: str) -> str:
    """The interpreter that runs ENGINE's server: WEIGHTSYNC_<ENGINE>_PYTHON, else this one if it imports."""
    env = f"WEIGHTSYNC_{engine.upper()}_PYTHON"
    py = os.environ.get(env) or sys.executable
    probe = "sglang.srt.entrypoints.http_server" if engine == "sglang" else "vllm.entrypoints.openai.api_server"
    r = subprocess.run([py, "-c", f"import {probe}"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        pytest.fail(f"the real {engine} server cannot start with {py}: {r.stderr.strip()[-400:]}. Run this tier "
                    f"in the engine's image or set {env} to a Python with the full {engine} installed")
    return py


class Server:
    """One real engine server process on GPU 0, logging into the test's tmp dir."""

    def __init__(self, tmp: Path, argv: list[str], port: int, env: dict[str, str]) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = tmp / "server.log"
        self.proc = subprocess.Popen(argv, stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "CUDA_VISIBLE_DEVICES": "0", **env}, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"{shlex.join(argv)} exited {self.proc.returncode}:\n{self.tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        self.close()
        pytest.fail(f"{shlex.join(argv)} not healthy after {START_TIMEOUT}s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def post(self, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        r = requests.post(f"{self.url}{route}", json=body or {}, timeout=120)
        assert r.status_code == 200, (route, r.status_code, r.text[:1000])
        return dict(r.json())

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)


def _model_dir(tmp: Path) -> Path:
    d = tmp / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return d


@pytest.fixture
def sglang_server(tmp_path: Path) -> Iterator[Server]:
    if not _gpus():
        pytest.fail("the gpu tier needs a CUDA GPU")
    py, port = engine_python("sglang"), free_port("127.0.0.1")
    s = Server(tmp_path, [py, "-m", "sglang.launch_server", "--model-path", str(_model_dir(tmp_path)),
                          "--load-format", "dummy", "--skip-tokenizer-init", "--host", "127.0.0.1",
                          "--port", str(port), "--mem-fraction-static", "0.3", "--disable-cuda-graph"],
               port, {})
    yield s
    s.close()


@pytest.fixture
def vllm_server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Server]:
    backend = request.param
    if _gpus() < (2 if backend == "nccl" else 1):
        pytest.fail(f"vLLM's {backend} backend with the agent needs {2 if backend == 'nccl' else 1} GPU(s): "
                    "NCCL refuses two ranks of one group on one GPU")
    py, port = engine_python("vllm"), free_port("127.0.0.1")
    s = Server(tmp_path, [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(_model_dir(tmp_path)),
                          "--load-format", "dummy", "--skip-tokenizer-init", "--host", "127.0.0.1",
                          "--port", str(port), "--gpu-memory-utilization", "0.3", "--enforce-eager",
                          "--weight-transfer-config", json.dumps({"backend": backend})],
               port, {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
    yield s
    s.close()


def per_param_checksums(body: Any) -> dict[str, str]:
    """Every {name: checksum} map in a checker reply merged (SGLang nests one per engine rank)."""
    out: dict[str, str] = {}
    if isinstance(body, dict):
        for k, v in body.items():
            if k == "checksums" and isinstance(v, dict) and all(isinstance(x, str) for x in v.values()):
                out |= v
            else:
                out |= per_param_checksums(v)
    elif isinstance(body, list):
        for v in body:
            out |= per_param_checksums(v)
    return out


def load_one_two_one(adapter: EngineAdapter, checksum: Any, device: str) -> None:
    """Versions 1, 2, 1 through the adapter; the engine's checker shows each load replaced every parameter."""
    seen: list[dict[str, str]] = []
    for v, seed in ((1, 1), (2, 2), (3, 1)):
        load_version(adapter, v, _buckets(tiny_llama_weights(seed, device)), pause_generation=True)
        assert adapter.served_version() == v
        sums = checksum()
        assert sums, "the engine's checker returned no parameter"
        seen.append(sums)
    first, second, again = seen
    assert first == again, "the same weights loaded twice read back differently"
    unchanged = sorted(k for k in first if first[k] == second.get(k))
    assert not unchanged, f"parameters the load of version 2 did not reach: {unchanged}"


@pytest.mark.parametrize("path", ["tensor", "distributed"])
def test_real_sglang_server_serves_what_the_agent_loaded(sglang_server: Server, path: str) -> None:
    s = sglang_server
    a = sglang.SGLangAdapter(s.url, path=path, devices=["cuda:0"] if path == "tensor" else None, timeout=300,
                             group_host="127.0.0.1")  # type: ignore[arg-type]
    try:
        load_one_two_one(a, lambda: per_param_checksums(s.post("/weights_checker", {"action": "checksum"})),
                         "cuda:0" if path == "tensor" else "cpu")
        # SGLang's own read-back: the first rows of the parameter, as float32 lists
        r = requests.post(f"{s.url}/get_weights_by_name", timeout=60,
                          json={"name": "model.embed_tokens.weight", "truncate_size": 8})
        assert r.status_code == 200, r.text[:500]
        want = dict(tiny_llama_weights(1))["model.embed_tokens.weight"][:8].float()
        assert torch.equal(torch.tensor(r.json(), dtype=torch.float32), want)
    finally:
        a.close()


@pytest.mark.parametrize("vllm_server", ["ipc", "nccl"], indirect=True)
def test_real_vllm_server_serves_what_the_agent_loaded(vllm_server: Server) -> None:
    s = vllm_server
    backend = "ipc" if "ipc" in " ".join(s.proc.args) else "nccl"  # type: ignore[arg-type]
    kw: dict[str, Any] = {"devices": ["cuda:0"]} if backend == "ipc" else {"device": "cuda:1"}
    a = vllm.VLLMAdapter(s.url, backend=backend, timeout=300, **kw)  # type: ignore[arg-type]
    try:
        load_one_two_one(a, lambda: dict(s.post("/weight_checker", {"action": "checksum"})["checksums"]),
                         "cuda:0" if backend == "ipc" else "cuda:1")
        info = requests.get(f"{s.url}/weight_info", timeout=10).json()
        assert str(info["weight_version"]) == "3", info
    finally:
        a.close()
