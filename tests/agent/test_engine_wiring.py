"""Which last hop the agent picks per engine and placement (agent/main.py make_adapter), and the
configurations it refuses at start instead of failing every load."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from weightsync.agent import main
from weightsync.agent.config import LoraSpec
from weightsync.agent.engines import lora
from weightsync.agent.engines.custom import AppRegistry
from weightsync.agent.engines.sglang import SGLangAdapter
from weightsync.agent.engines.vllm import VLLMAdapter
from weightsync.crds import contract


def _cfg(engine: str, device: str, role: str = contract.ROLE_INFERENCE, lora: LoraSpec | None = None) -> Any:
    return SimpleNamespace(engine_type=engine, device=device, role=role, timeout_seconds=30,
                           engine_url="http://127.0.0.1:30000", lora=lora, engine_fault="")


LORA = LoraSpec(adapter_name="policy", config={"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]})


@pytest.mark.parametrize("engine, loader", [("SGLang", lora.SGLangLoraLoader), ("VLLM", lora.VLLMLoraLoader)])
def test_a_lora_job_loads_through_the_adapter_endpoint_even_from_a_cpu_agent(engine: str, loader: type) -> None:
    a = main.make_adapter(_cfg(engine, "cpu", lora=LORA), AppRegistry(), [0], 2)
    assert isinstance(a, lora.LoraAdapter) and isinstance(a.loader, loader) and a.spec == LORA
    if isinstance(a.inner, VLLMAdapter):
        assert a.inner.lora  # its start check is VLLM_ALLOW_RUNTIME_LORA_UPDATING, not a weight-transfer backend
    if isinstance(a.loader, lora.SGLangLoraLoader):
        assert a.loader.tp_size == 2  # one serialized copy per TP rank


def test_sglang_cpu_agent_uses_the_weight_update_group_and_cuda_agents_ipc() -> None:
    a = main.make_adapter(_cfg("SGLang", "cpu"), AppRegistry(), [0], 2)
    assert isinstance(a, SGLangAdapter) and a.path == "distributed" and a.tp_size == 2
    b = main.make_adapter(_cfg("SGLang", "cuda", contract.ROLE_COLOCATED), AppRegistry(), [0], 2)
    assert isinstance(b, SGLangAdapter) and b.path == "tensor"
    assert [str(d) for d in b.devices or []] == ["cuda:0", "cuda:1"]


def test_vllm_backend_is_the_one_the_server_announces() -> None:
    """The agent builds no backend of its own choice: VLLMAdapter.resolve_backend reads the server's
    --weight-transfer-config at first contact (tests/engines/test_vllm_released.py covers the refusals)."""
    for device, role in (("cuda:1", contract.ROLE_INFERENCE), ("cpu", contract.ROLE_INFERENCE),
                         ("cuda", contract.ROLE_COLOCATED)):
        a = main.make_adapter(_cfg("VLLM", device, role), AppRegistry(), [0], 2)
        assert isinstance(a, VLLMAdapter) and a.backend is None and a.device is not None
        assert a.device.type == device.split(":")[0]


def test_the_previous_version_stays_staged_only_for_engines_that_cannot_roll_back() -> None:
    assert main.staged_versions_to_keep("SGLang") == main.staged_versions_to_keep("VLLM") == 2
    assert main.staged_versions_to_keep("Custom") == 1
