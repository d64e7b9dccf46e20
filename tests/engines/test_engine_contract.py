"""The hand-copied field lists in fixtures/ are documentation only (they name the engine release and the
source file they were read from); the checks run against the engines' own released code in
test_sglang_released.py and test_vllm_released.py. Plus the adapter factory."""

from __future__ import annotations

import io
import pickle
from typing import Any

import pytest
import torch
from conftest import load_fixture
from recording_server import RecordingServer

from weightsync.agent.config import ConfigError
from weightsync.agent.engines import sglang, vllm
from weightsync.agent.engines.factory import make_adapter, normalize_engine_type

SG = load_fixture("sglang-0.5.23.json")
VL = load_fixture("vllm-0.33.0.json")


def _bucket(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 4, generator=g).to(torch.bfloat16)
    w[0, 0] = float("nan")
    w[0, 1] = -0.0
    return [("model.layers.0.mlp.up_proj.weight", w),
            ("model.norm.weight", torch.randn(4, generator=g)),
            ("model.layers.0.scale", torch.tensor([1, -2, 3], dtype=torch.int8))]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


class _AuditUnpickler(pickle.Unpickler):
    """Records every global a pickle references, executing nothing."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.globals: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.globals.add((module, name))

        class _Any:
            def __init__(self, *a: Any, **k: Any) -> None:
                pass

            def __setstate__(self, state: Any) -> None:
                pass

        return _Any


# ---------------- SGLang ----------------
# The SGLang adapter is checked against SGLang's own released code in test_sglang_released.py;
# fixtures/sglang-0.5.23.json stays as documentation of the fields.


def test_sglang_fixture_names_its_source() -> None:
    assert SG["version"] == sglang.SGLANG_VERSION
    assert SG["copied_from"]["request_types"] == "sglang/srt/managers/io_struct.py"


# ---------------- vLLM ----------------
# The vLLM adapter is checked against vLLM's own released code in test_vllm_released.py (route table,
# FastAPI body rules, request / init / update info types, NCCL receive path, packing);
# fixtures/vllm-0.33.0.json stays as documentation of the fields.


def test_vllm_fixture_names_its_source() -> None:
    assert VL["version"] == vllm.VLLM_VERSION
    assert VL["copied_from"]["routes"] == "vllm/entrypoints/rl/online/api_router.py"


# ---------------- factory ----------------


def test_factory_picks_adapters(server: RecordingServer) -> None:
    assert isinstance(make_adapter("SGLang", url=server.url), sglang.SGLangAdapter)
    assert isinstance(make_adapter("vllm", url=server.url), vllm.VLLMAdapter)
    assert normalize_engine_type("VLLM") == "VLLM"
    with pytest.raises(Exception, match="unknown engine type"):
        make_adapter("TensorRT", url=server.url)
    with pytest.raises(ConfigError, match="needs its URL"):  # the agent exits 2 with it, no traceback
        make_adapter("SGLang")


def test_factory_custom_is_lazy() -> None:
    from weightsync.agent.engines.custom import AppRegistry, CustomEngineAdapter

    a = make_adapter("Custom", registry=AppRegistry(), ranks=[0], prefix="x")
    assert isinstance(a, CustomEngineAdapter)
