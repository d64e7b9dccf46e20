"""SGLang 0.5.23's own code for the weight-update path, executed from the installed wheel (see released.py).

What is taken from the engine, verbatim:
* request / response types of `srt/managers/io_struct.py` (msgspec structs, validated through the same
  pydantic schema FastAPI uses: `srt/utils/msgspec_utils.py`);
* the route table of `srt/entrypoints/http_server.py`;
* the scheduler's weight-update session rules: `SchedulerWeightUpdaterManager` of
  `srt/managers/scheduler_components/weight_updater.py` (begin / end / loads only inside a session);
* the model runner's receive and load logic: `WeightUpdater` of
  `srt/model_executor/model_runner_components/weight_updater.py` (init_weights_update_group,
  receive_weights_from_distributed with the flattened bucket, update_weights_from_tensor);
* `init_custom_process_group`, `MultiprocessingSerializer` and `SafeUnpickler` of `srt/utils/common.py`,
  the UUID device patch of `srt/utils/patch_torch.py`, `FlattenedTensorBucket` of
  `srt/weight_sync/tensor_bucket.py`.

What is not (the serving stack around it): the model (a dict of tensors with the real loader's
name / shape / dtype checks), the tokenizer manager, CUDA graphs. Those are stubbed below by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import pickle
import time
import traceback
import types
import typing
from functools import lru_cache
from typing import Any

import msgspec
import pybase64
import torch
from torch.multiprocessing import reductions

from . import released

PKG = "sglang"
HTTP_SERVER = "srt/entrypoints/http_server.py"
IO_STRUCT = "srt/managers/io_struct.py"
SCHED_UPDATER = "srt/managers/scheduler_components/weight_updater.py"
RUNNER_UPDATER = "srt/model_executor/model_runner_components/weight_updater.py"

#: The request types the weight-update path uses (io_struct names).
REQUEST_TYPES = {
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/weights_checker": "CheckWeightsReqInput",
    "/load_lora_adapter_from_tensors": "LoadLoRAAdapterFromTensorsReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
}
_OUTPUT_TYPES = [
    "BeginWeightUpdateReqOutput", "EndWeightUpdateReqOutput", "InitWeightsUpdateGroupReqOutput",
    "DestroyWeightsUpdateGroupReqOutput", "UpdateWeightsFromDistributedReqOutput",
    "UpdateWeightsFromTensorReqOutput",
]


def version() -> str:
    return released.installed_version(PKG)


def routes() -> set[tuple[str, str]]:
    """(METHOD, path) registered by SGLang's HTTP server."""
    return released.routes(PKG, HTTP_SERVER, objects=("app",))


def _typing_namespace() -> dict[str, Any]:
    ns: dict[str, Any] = {n: getattr(typing, n) for n in typing.__all__ if hasattr(typing, n)}
    ns.update(msgspec=msgspec, torch=torch, dataclass=dataclasses.dataclass, field=dataclasses.field)
    return ns


@lru_cache(maxsize=1)
def io_struct() -> types.ModuleType:
    """The weight-update request and response types of io_struct.py, executed from the wheel."""
    utils = released.load_file(PKG, "srt/utils/msgspec_utils.py")
    ns = _typing_namespace()
    ns.update(Base64Bytes=utils.Base64Bytes, msgspec_struct_pydantic_core_schema=utils.msgspec_struct_pydantic_core_schema)
    names = ["BaseReq", "CheckWeightsReqOutput", *REQUEST_TYPES.values(), *_OUTPUT_TYPES]
    return released.extract(PKG, IO_STRUCT, dict.fromkeys(names), ns)


def validate(route: str, body: Any) -> Any:
    """The request object SGLang's FastAPI handler would build from this JSON body (pydantic through the
    engine's own schema hook). Raises pydantic.ValidationError like the engine's 422. Unknown fields are
    additionally refused here (SGLang ignores them, which would hide a misspelt field)."""
    import pydantic

    cls = getattr(io_struct(), REQUEST_TYPES[route])
    body = {} if body is None else body
    if isinstance(body, dict):
        known = {f.name for f in msgspec.structs.fields(cls)}
        if unknown := set(body) - known:
            raise ValueError(f"{route}: fields {sorted(unknown)} are not in SGLang's {cls.__name__} {sorted(known)}")
    return pydantic.TypeAdapter(cls).validate_python(body)


@lru_cache(maxsize=1)
def common() -> types.ModuleType:
    """MultiprocessingSerializer, SafeUnpickler (with the safe torch.load it gives by-value storages),
    init_custom_process_group from srt/utils/common.py."""
    from packaging import version as pkg_version

    ns = _typing_namespace()
    ns.update(io=io, pickle=pickle, pybase64=pybase64, logging=logging, logger=logging.getLogger("sglang.common"),
              torch_release=pkg_version.parse(torch.__version__).release)
    mod = released.extract(PKG, "srt/utils/common.py",
                           ["MultiprocessingSerializer", "_safe_load_torch_storage", "SafeUnpickler",
                            "init_custom_process_group"], ns)
    return mod


@lru_cache(maxsize=1)
def patch_torch() -> types.ModuleType:
    """SGLang's UUID-for-device-index patch of torch's CUDA tensor reductions."""
    ns = _typing_namespace()
    ns.update(reductions=reductions, _is_npu=False, _is_musa=False, torch_release=common().torch_release)
    return released.extract(PKG, "srt/utils/patch_torch.py", [
        "SGLANG_TP_RANK", "monkey_patch_torch_reductions", "_REDUCE_TENSOR_ARG_DEVICE_INDEX",
        "_reduce_tensor_modified", "_rebuild_cuda_tensor_modified", "_device_to_uuid",
        "_device_from_maybe_uuid", "_modify_tuple"], ns)


def tensor_bucket() -> types.ModuleType:
    return released.load_file(PKG, "srt/weight_sync/tensor_bucket.py")


class NetworkAddress:
    """Shim of srt/utils/network.py's NetworkAddress (that module needs zmq and psutil): only to_tcp."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port

    def to_tcp(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


class _NoDerivedCache:
    """Stands for the model-loader hooks begin/end call (weight packing of quantized models)."""

    @staticmethod
    def restore_weights_before_loading(model: Any, device: Any) -> None:
        return None

    @staticmethod
    def postprocess_weights(model: Any, device: Any) -> None:
        return None


@lru_cache(maxsize=1)
def runner_updater() -> types.ModuleType:
    """The model runner's WeightUpdater (receive and load logic)."""
    tb = tensor_bucket()
    ns = _typing_namespace()
    ns.update(
        logging=logging, logger=logging.getLogger("sglang.weight_updater"), gc=__import__("gc"),
        DefaultModelLoader=_NoDerivedCache, post_load_weights=lambda model: None,
        init_custom_process_group=common().init_custom_process_group, NetworkAddress=NetworkAddress,
        MultiprocessingSerializer=common().MultiprocessingSerializer,
        monkey_patch_torch_reductions=patch_torch().monkey_patch_torch_reductions,
        FlattenedTensorBucket=tb.FlattenedTensorBucket, FlattenedTensorMetadata=tb.FlattenedTensorMetadata,
        get_model=lambda: types.SimpleNamespace(weight_cache_mode="off"),
        get_parallel=lambda: types.SimpleNamespace(tp_rank=_TP_RANK[0]),
        _unsupported_derived_weight_cache_error=lambda model=None: None,
    )
    return released.extract(PKG, RUNNER_UPDATER, ["WeightUpdater", "LocalSerializedTensor", "_unwrap_tensor"], ns)


_TP_RANK = [0]


@lru_cache(maxsize=1)
def scheduler_updater() -> types.ModuleType:
    """The scheduler's session rules (SchedulerWeightUpdaterManager and _WeightUpdateSession)."""
    ns = _typing_namespace()
    ns.update(vars(io_struct()))
    ns.update(logging=logging, logger=logging.getLogger("sglang.scheduler_weight_updater"), time=time,
              traceback=traceback, contextmanager=contextlib.contextmanager,
              GPU_MEMORY_ALL_TYPES=["weights", "kv_cache", "cuda_graph"], GPU_MEMORY_TYPE_CUDA_GRAPH="cuda_graph",
              GPU_MEMORY_TYPE_KV_CACHE="kv_cache", GPU_MEMORY_TYPE_WEIGHTS="weights",
              get_parallel=lambda: types.SimpleNamespace(tp_group=types.SimpleNamespace(cpu_group=None),
                                                         tp_rank=_TP_RANK[0]),
              get_model=lambda: types.SimpleNamespace(weight_cache_mode="off"))
    return released.extract(PKG, SCHED_UPDATER, ["_parse_runner_selector", "_WeightUpdateSession",
                                                 "SchedulerWeightUpdaterManager"], ns)


def deserialize_own_rank(serialized: list[bytes], tp_rank: int) -> Any:
    """What each SGLang TP rank does with update_weights_from_tensor's payload (tp_worker.py). Like SGLang,
    it patches torch's tensor reductions process-wide: call it in an engine process only."""
    patch_torch().monkey_patch_torch_reductions()
    return common().MultiprocessingSerializer.deserialize(serialized[tp_rank])
