"""LoRA sync against the engines' own released code (the `engines` tier): each version is the adapter's
tensors, loaded whole through SGLang 0.5.23's /load_lora_adapter_from_tensors (bodies validated by SGLang's
request types, the payload rebuilt by SGLang's own deserializer in a stand-in with its own mount, PID and
/dev/shm namespaces) or vLLM 0.33's /v1/load_lora_adapter (bodies validated by vLLM's request model, the
route in its route table, the adapter files read back as vLLM's loader reads them)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from recording_server import RecordingServer
from test_sglang_released import Standin

from weightsync.agent.config import AgentConfig, ConfigError, LoraSpec
from weightsync.agent.engines import lora, sglang, vllm
from weightsync.agent.engines.base import EngineError, load_version
from weightsync.agent.engines.http import HttpClient
from weightsync.agent.layout.shards import checksums
from weightsync.crds import contract
from weightsync.e2e.engines import released

pytestmark = pytest.mark.engines

SPEC = LoraSpec(adapter_name="policy", config={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                                               "peft_type": "LORA"})


def adapter_tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    """A PEFT adapter of a 2-layer model: lora_A (r x in) and lora_B (out x r) per target module."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(2):
        for mod in ("q_proj", "v_proj"):
            base = f"base_model.model.model.layers.{layer}.self_attn.{mod}"
            out.append((f"{base}.lora_A.weight", torch.randn(4, 16, generator=g).to(torch.bfloat16)))
            out.append((f"{base}.lora_B.weight", torch.randn(16, 4, generator=g).to(torch.bfloat16)))
    return out


def buckets(items: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    return [items[:3], items[3:]]


@pytest.fixture
def sglang_engine(tmp_path: Path) -> Iterator[Standin]:
    s = Standin(tmp_path)
    yield s
    s.close()


def sglang_lora(url: str) -> lora.LoraAdapter:
    client = HttpClient(url, "SGLang", timeout=30)
    return lora.LoraAdapter(inner=sglang.SGLangAdapter(url, client=client), loader=lora.SGLangLoraLoader(client),
                            spec=SPEC)


def test_sglang_versions_replace_the_adapter_bit_exact_through_sglangs_deserializer(sglang_engine: Standin) -> None:
    a = sglang_lora(sglang_engine.url)
    for v in (1, 2):
        items = adapter_tensors(v)
        load_version(a, v, buckets(items), pause_generation=True)
        got = sglang_engine.get("/standin/lora")
        assert got["version"] == str(v) and got["adapters"] == {"policy": checksums(items)}
        assert a.served_version() == v
    ops = sglang_engine.ops()
    assert "refused" not in ops  # every body was one of SGLang's request types, no unknown field
    # no weight-update session for an adapter; unload (not loaded the first time: 400) then load, per version
    assert "begin_weight_update" not in ops
    lora_ops = [o for o in ops if "lora" in o]
    assert lora_ops == ["unload_lora_adapter", "load_lora_adapter_from_tensors"] * 2
    assert ops[-1] == "continue_generation"


def test_sglang_checks_the_adapter_itself_and_a_mismatch_is_never_served(sglang_engine: Standin,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """expected_checksums: SGLang compares each tensor's sha256 before it loads the adapter; a payload that
    differs is refused, the version is not served and the agent is told to restore the last good one."""
    a = sglang_lora(sglang_engine.url)
    load_version(a, 1, buckets(adapter_tensors(1)), pause_generation=False)
    real = lora.sglang_load_body

    def corrupt(spec: LoraSpec, tensors: Any, tp_size: int) -> dict[str, Any]:
        body = real(spec, tensors, tp_size)
        name = next(iter(body["expected_checksums"]))
        body["expected_checksums"][name] = "0" * 64
        return body

    monkeypatch.setattr(lora, "sglang_load_body", corrupt)
    with pytest.raises(EngineError, match="MISMATCH"):
        load_version(a, 2, buckets(adapter_tensors(2)), pause_generation=True)
    assert a.needs_restore and a.served_version() is None
    assert sglang_engine.get("/standin/lora")["version"] == "1"
    assert sglang_engine.get("/standin/state")["paused"] is False


def test_an_abort_before_commit_never_touches_the_engines_adapter(sglang_engine: Standin) -> None:
    a = sglang_lora(sglang_engine.url)
    load_version(a, 1, buckets(adapter_tensors(1)), pause_generation=False)

    def failing() -> Iterator[list[tuple[str, torch.Tensor]]]:
        yield adapter_tensors(2)[:2]
        raise RuntimeError("source died")

    with pytest.raises(RuntimeError, match="source died"):
        load_version(a, 2, failing(), pause_generation=False)
    assert not a.needs_restore and a.served_version() == 1
    assert sglang_engine.get("/standin/lora")["adapters"] == {"policy": checksums(adapter_tensors(1))}


def test_the_payload_is_by_value_so_it_crosses_into_another_container() -> None:
    """Plain pickles of the bytes (torch.storage._load_from_bytes, which SGLang's SafeUnpickler admits), not
    the fd / shared-memory handles of a ForkingPickler (the stand-in above rebuilt them in its namespaces)."""
    blob = lora.pickle_by_value(dict(adapter_tensors(3)))
    assert b"_load_from_bytes" in blob and b"rebuild_storage" not in blob
    body = lora.sglang_load_body(SPEC, dict(adapter_tensors(3)), tp_size=2)
    assert len(body["serialized_named_tensors"]) == 2  # one copy per TP rank, each reads its own


# ---------------- vLLM ----------------
VLLM_LORA_ROUTER = "entrypoints/serve/lora/api_router.py"
VLLM_LORA_PROTOCOL = "entrypoints/serve/lora/protocol.py"


def test_vllm_writes_the_adapter_and_loads_it_in_place(server: RecordingServer, tmp_path: Path) -> None:
    server.replies["/weight_info"] = [(200, {"weight_version": "2"})]
    client = HttpClient(server.url, "vLLM", timeout=10, retries=0)
    a = lora.LoraAdapter(inner=vllm.VLLMAdapter(server.url, backend="nccl", client=client),
                         loader=lora.VLLMLoraLoader(client, tmp_path / "lora"), spec=SPEC)
    for v in (1, 2):
        load_version(a, v, buckets(adapter_tensors(v)), pause_generation=False)
    assert server.paths() == ["/v1/load_lora_adapter", "/update_weight_version"] * 2
    routes = released.routes("vllm", VLLM_LORA_ROUTER) | released.routes("vllm", "entrypoints/rl/online/api_router.py")
    assert {(c.method, c.path) for c in server.calls} <= routes
    request = released.load_file("vllm", VLLM_LORA_PROTOCOL).LoadLoRAAdapterRequest
    bodies = [c.body for c in server.calls if c.path == "/v1/load_lora_adapter"]
    for v, body in zip((1, 2), bodies, strict=True):
        req = request.model_validate(body)
        assert (req.lora_name, req.load_inplace) == ("policy", True)
        assert Path(req.lora_path) == tmp_path / "lora" / "policy" / f"v{v}"
    # what vLLM's LoRAModel.from_local_checkpoint reads: adapter_config.json and torch.load(weights_only=True)
    path = Path(bodies[-1]["lora_path"])
    assert json.loads((path / "adapter_config.json").read_text()) == dict(SPEC.config)
    tensors = torch.load(path / "adapter_model.bin", map_location="cpu", weights_only=True)
    assert checksums(sorted(tensors.items())) == checksums(adapter_tensors(2))
    assert sorted(p.name for p in (tmp_path / "lora" / "policy").iterdir()) == ["v2"]  # v1's files removed
    assert a.served_version() == 2


def test_a_refused_vllm_load_marks_the_adapter_for_restore(server: RecordingServer, tmp_path: Path) -> None:
    server.replies["/v1/load_lora_adapter"] = [(400, {"message": "max_lora_rank 2 < 4"})]
    client = HttpClient(server.url, "vLLM", timeout=10, retries=0)
    a = lora.LoraAdapter(inner=vllm.VLLMAdapter(server.url, backend="nccl", client=client),
                         loader=lora.VLLMLoraLoader(client, tmp_path / "lora"), spec=SPEC)
    with pytest.raises(EngineError, match="max_lora_rank"):
        load_version(a, 1, buckets(adapter_tensors(1)), pause_generation=True)
    assert a.needs_restore and a.served_version() is None
    assert server.paths()[-1] == "/resume"


# ---------------- configuration ----------------


def test_the_agent_reads_the_lora_spec_the_operator_writes() -> None:
    from weightsync.crds.models import LoraSpec as CrdLoraSpec

    crd = CrdLoraSpec.model_validate({"adapterName": "policy", "config": dict(SPEC.config)})
    env = {contract.ENV_ROLE: contract.ROLE_INFERENCE, contract.ENV_JOB: "j", contract.ENV_POD_NAME: "p",
           contract.ENV_ENGINE_TYPE: "SGLang",
           contract.ENV_LORA: json.dumps(crd.model_dump(by_alias=True))}
    assert AgentConfig.from_env(env).lora == SPEC
    with pytest.raises(ConfigError, match=contract.ENV_LORA):
        AgentConfig.from_env({**env, contract.ENV_LORA: '{"adapterName": "x"}'})
