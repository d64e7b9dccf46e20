"""Which last hop the agent picks per engine and placement (agent/engines/factory.py make_adapter), and the
configurations it refuses at start instead of failing every load."""

from __future__ import annotations

from typing import Any

import pytest

from weightsync.agent.config import LoraSpec
from weightsync.agent.engines import factory, lora
from weightsync.agent.engines.custom import AppRegistry, CustomEngineAdapter
from weightsync.agent.engines.sglang import SGLangAdapter
from weightsync.agent.engines.vllm import VLLMAdapter


def _adapter(engine: str, device: str, lora: LoraSpec | None = None) -> Any:
    """The adapter an inference agent on `device` builds for a 2-way TP replica (agent/main.py's call)."""
    return factory.make_adapter(engine, url="http://127.0.0.1:30000", device=device, tp_size=2, timeout=30,
                                lora=lora, registry=AppRegistry(), ranks=[0], prefix="weightsync-job-pod")


LORA = LoraSpec(adapter_name="policy", config={"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]})


@pytest.mark.parametrize("engine, loader", [("SGLang", lora.SGLangLoraLoader), ("VLLM", lora.VLLMLoraLoader)])
def test_a_lora_job_loads_through_the_adapter_endpoint_even_from_a_cpu_agent(engine: str, loader: type) -> None:
    a = _adapter(engine, "cpu", lora=LORA)
    assert isinstance(a, lora.LoraAdapter) and isinstance(a.loader, loader) and a.spec == LORA
    if isinstance(a.inner, VLLMAdapter):
        assert a.inner.lora  # its start check is VLLM_ALLOW_RUNTIME_LORA_UPDATING, not a weight-transfer backend
    if isinstance(a.loader, lora.SGLangLoraLoader):
        assert a.loader.tp_size == 2  # one serialized copy per TP rank


def test_sglang_cpu_agent_uses_the_weight_update_group_and_cuda_agents_ipc() -> None:
    a = _adapter("SGLang", "cpu")
    assert isinstance(a, SGLangAdapter) and a.path == "distributed" and a.tp_size == 2
    b = _adapter("SGLang", "cuda")
    assert isinstance(b, SGLangAdapter) and b.path == "tensor"
    assert [str(d) for d in b.devices or []] == ["cuda:0", "cuda:1"]


def test_vllm_backend_is_the_one_the_server_announces() -> None:
    """The agent builds no backend of its own choice: VLLMAdapter.resolve_backend reads the server's
    --weight-transfer-config at first contact (tests/engines/test_vllm_released.py covers the refusals)."""
    for device in ("cuda:1", "cpu", "cuda"):  # a pinned GPU, a CPU agent, a colocated agent on the engine's GPUs
        a = _adapter("VLLM", device)
        assert isinstance(a, VLLMAdapter) and a.backend is None and a.device is not None
        assert a.device.type == device.split(":")[0]


def test_a_custom_engine_gets_the_agent_registry_ranks_and_timeout() -> None:
    a = _adapter("Custom", "cpu", lora=LORA)  # LoRA is an HTTP engine's endpoint: a Custom engine takes buckets
    assert isinstance(a, CustomEngineAdapter) and a.ranks == [0] and a.request_timeout == 30.0
    assert a.prefix == "weightsync-job-pod"


def test_the_previous_version_stays_staged_only_for_engines_that_cannot_roll_back() -> None:
    assert factory.staged_versions_to_keep("SGLang") == factory.staged_versions_to_keep("VLLM") == 2
    assert factory.staged_versions_to_keep("Custom") == 1
