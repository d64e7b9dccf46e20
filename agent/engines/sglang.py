"""SGLang adapter: weights go in through `/update_weights_from_tensor` with flattened buckets.

Request types follow SGLang 0.5.23 (`sglang/srt/managers/io_struct.py`; endpoints in
`sglang/srt/entrypoints/http_server.py`); tests/engines/fixtures/sglang-0.5.23.json holds the copied
field lists and the contract test checks every body built here against them. SGLang ignores unknown
JSON fields, so a misspelt field would silently do nothing: hence the contract test.

One bucket = one request. The bucket's tensors are concatenated as bytes into one contiguous tensor with
`FlattenedTensorBucket` metadata (name, shape, dtype, start_idx, end_idx, numel), so a CUDA bucket costs
one IPC handle (slime measured 81% of the time in per-tensor handle open/close). `serialized_named_tensors`
has one entry per engine TP rank (each rank deserializes only its own): `{"flattened_tensor", "metadata"}`
pickled with torch's ForkingPickler, CUDA device indices replaced by GPU UUIDs as SGLang's own
`monkey_patch_torch_reductions` does, base64 over HTTP. Only globals on SGLang's SafeUnpickler allowlist
appear in the pickle (metadata entries are `types.SimpleNamespace`, read by attribute on the engine).

SGLang's model loaders take checkpoint (HF) tensors and shard them per TP rank themselves, so the
destination layout for an SGLang replica is the full tensors; with `devices`, each TP rank gets its
copy on its own GPU (a device-to-device copy per rank).

Versions: buckets carry no weight_version; `commit` sets it with `/update_weight_version` once every
bucket loaded. SGLang cannot roll weights back: `abort` marks the version "partial-<v>" so that neither
the engine nor this adapter claims a version it does not fully hold (the agent reloads a full version).
"""

from __future__ import annotations

import base64
import io
import logging
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any, Literal

import torch
from torch.multiprocessing import reductions

from .base import EngineError, NamedTensors
from .http import HttpClient

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
PauseMode = Literal["abort", "retract", "in_place"]
LOAD_FORMAT = "flattened_bucket"
_DEVICE_ARG = 6  # index of the device in torch's rebuild_cuda_tensor args (SGLang patches the same slot)


def flatten(tensors: NamedTensors, out: torch.Tensor | None = None) -> tuple[torch.Tensor, list[SimpleNamespace]]:
    """Concatenate the tensors' bytes into one uint8 tensor (reusing `out` when it is large enough) and
    return it with FlattenedTensorBucket metadata."""
    if not tensors:
        raise EngineError("SGLang: cannot load an empty bucket")
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    device = tensors[0][1].device
    buf = out[:total] if out is not None and out.numel() >= total and out.device == device else torch.empty(
        total, dtype=torch.uint8, device=device)
    meta: list[SimpleNamespace] = []
    pos = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        if n:
            buf[pos : pos + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))
        meta.append(SimpleNamespace(name=name, shape=torch.Size(t.shape), dtype=t.dtype, start_idx=pos,
                                    end_idx=pos + n, numel=n))
        pos += n
    return buf, meta


def reconstruct(flat: torch.Tensor, meta: Sequence[Any]) -> list[tuple[str, torch.Tensor]]:
    """The engine side of `flatten` (FlattenedTensorBucket.reconstruct_tensors), for tests and checks."""
    return [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in meta]


def _gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


class _UuidPickler(ForkingPickler):
    """ForkingPickler that names CUDA devices by UUID (robust to CUDA_VISIBLE_DEVICES differences)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            fn, args = reductions.reduce_tensor(obj)
            args = (*args[:_DEVICE_ARG], _gpu_uuid(int(args[_DEVICE_ARG])), *args[_DEVICE_ARG + 1 :])
            return fn, args
        return NotImplemented


def serialize(obj: Any) -> str:
    """MultiprocessingSerializer.serialize(obj, output_str=True) equivalent."""
    buf = io.BytesIO()
    _UuidPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def update_weights_from_tensor_body(
    serialized_named_tensors: list[str],
    *,
    flush_cache: bool = True,
    abort_all_requests: bool = False,
    weight_version: str | None = None,
    load_format: str | None = LOAD_FORMAT,
) -> dict[str, Any]:
    """The JSON body of POST /update_weights_from_tensor (UpdateWeightsFromTensorReqInput)."""
    return {
        "serialized_named_tensors": serialized_named_tensors,
        "load_format": load_format,
        "flush_cache": flush_cache,
        "abort_all_requests": abort_all_requests,
        "weight_version": weight_version,
    }


def pause_body(mode: PauseMode) -> dict[str, Any]:
    """PauseGenerationReqInput."""
    return {"mode": mode}


def continue_body(torch_empty_cache: bool = True) -> dict[str, Any]:
    """ContinueGenerationReqInput."""
    return {"torch_empty_cache": torch_empty_cache}


def memory_body(tags: Sequence[str] | None) -> dict[str, Any]:
    """ReleaseMemoryOccupationReqInput / ResumeMemoryOccupationReqInput."""
    return {"tags": list(tags) if tags is not None else None}


def weight_version_body(version: str, abort_all_requests: bool = False) -> dict[str, Any]:
    """UpdateWeightVersionReqInput."""
    return {"new_version": version, "abort_all_requests": abort_all_requests}


def check_weights_body(action: str = "checksum") -> dict[str, Any]:
    """CheckWeightsReqInput."""
    return {"action": action}


def parse_version(value: Any) -> int | None:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None


class SGLangAdapter:
    """EngineAdapter for an SGLang server (one replica: `tp_size` ranks behind one HTTP endpoint).

    `devices`: the GPUs of the engine's TP ranks, in rank order; each rank's copy of a bucket is placed
    there. Without it every rank gets a handle to the same tensor (one GPU, or CPU in tests).
    """

    def __init__(
        self,
        url: str,
        *,
        tp_size: int = 1,
        devices: Sequence[torch.device | str] | None = None,
        pause_mode: PauseMode = "retract",
        flush_cache: bool = True,
        client: HttpClient | None = None,
        timeout: float = 300.0,
    ) -> None:
        if devices is not None and len(devices) != tp_size:
            raise EngineError(f"SGLang: {len(devices)} devices given for tp_size={tp_size}; give one per TP rank")
        self.client = client or HttpClient(url, "SGLang", timeout=timeout)
        self.tp_size = tp_size
        self.devices = [torch.device(d) for d in devices] if devices is not None else None
        self.pause_mode: PauseMode = pause_mode
        self.flush_cache = flush_cache
        self.partial: int | None = None
        self._flat: torch.Tensor | None = None
        self._bufs: dict[int, torch.Tensor] = {}

    # -- EngineAdapter --

    def pause(self) -> None:
        self.client.post("/pause_generation", pause_body(self.pause_mode))

    def resume(self) -> None:
        self.client.post("/continue_generation", continue_body())

    def begin_update(self, version: int) -> None:
        log.info("sglang.begin_update version=%s url=%s", version, self.client.base_url)

    def load_bucket(self, tensors: NamedTensors) -> None:
        flat, meta = flatten(tensors, self._flat)
        if self._flat is None or flat.numel() > self._flat.numel():
            self._flat = flat  # reused for the next bucket: the request returns only after the load
        per_rank = []
        for r in range(self.tp_size):
            t = flat
            if self.devices is not None and self.devices[r] != flat.device:
                buf = self._bufs.get(r)
                if buf is None or buf.numel() < flat.numel():
                    buf = torch.empty(flat.numel(), dtype=torch.uint8, device=self.devices[r])
                    self._bufs[r] = buf
                t = buf[: flat.numel()]
                t.copy_(flat)
            per_rank.append(serialize({"flattened_tensor": t, "metadata": meta}))
        if flat.is_cuda:
            torch.cuda.synchronize(flat.device)
        body = update_weights_from_tensor_body(per_rank, flush_cache=self.flush_cache)
        self.client.post("/update_weights_from_tensor", body)

    def commit(self, version: int) -> None:
        self.client.post("/update_weight_version", weight_version_body(str(version)))
        self.partial = None

    def abort(self, version: int, reason: str) -> None:
        self.partial = version
        log.warning("sglang.abort version=%s reason=%s: weights may be partially updated", version, reason)
        self.client.post("/update_weight_version", weight_version_body(f"partial-{version}"), retry=False)

    def served_version(self) -> int | None:
        if self.partial is not None:
            return None
        info = self.client.get("/model_info")
        return parse_version(info.get("weight_version")) if isinstance(info, dict) else None

    # -- extras --

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free GPU memory (weights / kv_cache) while the trainer runs (colocated; needs
        --enable-memory-saver on the server)."""
        self.client.post("/release_memory_occupation", memory_body(tags))

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        self.client.post("/resume_memory_occupation", memory_body(tags))

    def check_weights(self) -> Any:
        """The engine's own per-rank weight checksums (POST /weights_checker)."""
        return self.client.post("/weights_checker", check_weights_body())
