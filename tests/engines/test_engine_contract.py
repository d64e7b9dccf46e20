"""Adapter contract: every request body the SGLang and vLLM adapters send (captured from a real HTTP
server) validates against the engine's request types, copied with version and source path into
fixtures/ (the engines' own classes need their whole serving stack to import), and the flattened
buckets decode back to the exact bytes on the engine side."""

from __future__ import annotations

import base64
import io
import pickle
from typing import Any

import pydantic
import pytest
import torch
from conftest import load_fixture
from engine_schema import validate
from recording_server import RecordingServer
from weightsync.agent.engines import sglang, vllm
from weightsync.agent.engines.base import load_version
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


def test_vllm_fixture_names_its_source() -> None:
    assert VL["version"] == vllm.VLLM_VERSION
    assert VL["copied_from"]["routes"] == "vllm/entrypoints/rl/online/api_router.py"


@pytest.mark.parametrize("packed", [True, False])
def test_vllm_bodies_validate(server: RecordingServer, packed: bool) -> None:
    server.replies["/weight_info"] = [(200, {"weight_version": "3"})]
    a = vllm.VLLMAdapter(server.url, packed=packed)
    bucket = _bucket(5)
    load_version(a, 3, [bucket], pause_generation=True)
    assert a.served_version() == 3
    a.check_weights()
    assert server.paths() == ["/pause", "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                              "/finish_weight_update", "/resume", "/weight_info", "/weight_checker"]
    by_path = {c.path: c for c in server.calls}
    assert by_path["/pause"].query == {"mode": ["keep"]}
    assert by_path["/pause"].body is None and by_path["/resume"].body is None
    init = validate(VL, "WeightTransferInitRequest", by_path["/init_weight_transfer_engine"].body)
    validate(VL, "IPCWeightTransferInitInfo", init.init_info)  # type: ignore[attr-defined]
    upd = validate(VL, "WeightTransferUpdateRequest", by_path["/update_weights"].body)
    info: dict[str, Any] = upd.update_info  # type: ignore[attr-defined]
    validate(VL, "IPCWeightTransferUpdateInfo", info)
    assert info["names"] == [n for n, _ in bucket]
    assert len(info["dtype_names"]) == len(info["shapes"]) == len(info["names"])
    assert all(hasattr(torch, d) for d in info["dtype_names"])
    assert "ipc_handles" not in info, "over HTTP the handles travel pickled (exactly one of the two)"
    handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
    if packed:
        assert isinstance(handles, dict) and list(handles) == ["cpu"]
        assert info["tensor_sizes"] == [t.numel() * t.element_size() for _, t in bucket]
    else:
        assert isinstance(handles, list) and len(handles) == len(bucket) and "tensor_sizes" not in info
    validate(VL, "FinishWeightUpdateBody", by_path["/finish_weight_update"].body)
    assert by_path["/finish_weight_update"].body == {"weight_version": "3"}
    validate(VL, "WeightCheckerBody", by_path["/weight_checker"].body)


def test_vllm_packed_layout_matches_vllm_unpack() -> None:
    bucket = _bucket(9)
    flat, sizes = vllm.pack(bucket)
    got = vllm.unpack(flat, [n for n, _ in bucket], [list(t.shape) for _, t in bucket],
                      [vllm.dtype_name(t.dtype) for _, t in bucket], sizes)
    assert all(_same(x, y) for (_, x), (_, y) in zip(got, bucket, strict=True))


def test_vllm_schema_rejects_bad_update_info() -> None:
    good = vllm.update_info(["a"], ["bfloat16"], [[2, 2]], {"cpu": (1,)}, [8])
    validate(VL, "IPCWeightTransferUpdateInfo", good)
    with pytest.raises(pydantic.ValidationError):
        validate(VL, "IPCWeightTransferUpdateInfo", {**good, "dtypes": ["bfloat16"]})
    with pytest.raises(pydantic.ValidationError):
        validate(VL, "IPCWeightTransferUpdateInfo", {**good, "shapes": [["2", 2]]})


# ---------------- factory ----------------


def test_factory_picks_adapters(server: RecordingServer) -> None:
    assert isinstance(make_adapter("SGLang", url=server.url), sglang.SGLangAdapter)
    assert isinstance(make_adapter("vllm", url=server.url), vllm.VLLMAdapter)
    assert normalize_engine_type("VLLM") == "VLLM"
    with pytest.raises(Exception, match="unknown engine type"):
        make_adapter("TensorRT", url=server.url)
    with pytest.raises(Exception, match="needs its URL"):
        make_adapter("SGLang")


def test_factory_custom_is_lazy() -> None:
    from weightsync.agent.engines.custom import AppRegistry, CustomEngineAdapter

    a = make_adapter("Custom", registry=AppRegistry(), ranks=[0], prefix="x")
    assert isinstance(a, CustomEngineAdapter)
