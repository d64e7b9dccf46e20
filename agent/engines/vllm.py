"""vLLM adapter: vLLM's native weight-transfer API with the `ipc` backend, over HTTP.

Request types follow vLLM 0.33.0: routes in `vllm/entrypoints/rl/online/api_router.py`, bodies from
`vllm/distributed/weight_transfer/base.py` (WeightTransferInitRequest, WeightTransferUpdateRequest) and
`vllm/distributed/weight_transfer/ipc_engine.py` (IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo);
tests/engines/fixtures/vllm-0.33.0.json holds the copied field lists for the contract test. The server
runs with `--weight-transfer-config '{"backend":"ipc"}'`, VLLM_SERVER_DEV_MODE=1 (the RL routes are
dev-gated) and VLLM_ALLOW_INSECURE_SERIALIZATION=1 (IPC handles travel pickled over HTTP, exactly as
vLLM's own HTTPVLLMWeightSyncClient sends them).

Life cycle per version: POST /init_weight_transfer_engine (once: {"init_info": {"packed": true}}),
POST /start_weight_update, POST /update_weights per bucket, POST /finish_weight_update with
weight_version (vLLM publishes the version only when finish succeeds). Pause: POST /pause?mode=...,
POST /resume.

Packed mode (default): each bucket is one contiguous buffer with `tensor_sizes` (vLLM splits it by
those sizes, so there is no padding between tensors) and ONE IPC handle per GPU, keyed by the GPU's
UUID so it resolves whatever CUDA_VISIBLE_DEVICES the workers have. With `devices`, each TP worker's
GPU gets its own copy (vLLM loaders shard checkpoint tensors themselves, so every worker needs the
whole bucket). On CPU the same code exports torch's CPU shared-memory handle (key "cpu"): vLLM itself
only accepts CUDA handles; CPU exists so the payload path runs in CI.
"""

from __future__ import annotations

import base64
import logging
import pickle
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch.multiprocessing.reductions import reduce_tensor

from .base import EngineError, NamedTensors
from .http import HttpClient

log = logging.getLogger(__name__)

VLLM_VERSION = "0.33.0"
PauseMode = Literal["abort", "wait", "keep"]


def device_key(device: torch.device) -> str:
    """The key vLLM looks a handle up by: the physical GPU UUID (str(props.uuid))."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_properties(device.index or 0).uuid)
    return device.type


def export_handle(t: torch.Tensor) -> tuple[Any, ...]:
    """rebuild args for `t` (torch.multiprocessing.reductions.reduce_tensor), as vLLM's trainer does."""
    _fn, args = reduce_tensor(t)
    return tuple(args)


def pack(tensors: NamedTensors, out: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
    """Concatenate the tensors' bytes without padding (vLLM's packed layout); returns (buffer, sizes)."""
    sizes = [t.numel() * t.element_size() for _, t in tensors]
    total = sum(sizes)
    device = tensors[0][1].device
    buf = out[:total] if out is not None and out.numel() >= total and out.device == device else torch.empty(
        total, dtype=torch.uint8, device=device)
    pos = 0
    for (_, t), n in zip(tensors, sizes, strict=True):
        if n:
            buf[pos : pos + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))
        pos += n
    return buf, sizes


def unpack(buf: torch.Tensor, names: list[str], shapes: list[list[int]], dtype_names: list[str],
           sizes: list[int]) -> list[tuple[str, torch.Tensor]]:
    """vLLM's unpack_tensor (packed_tensor.py), for tests."""
    parts = buf[: sum(sizes)].split(sizes)
    return [(n, p.contiguous().view(getattr(torch, d)).view(s))
            for n, s, d, p in zip(names, shapes, dtype_names, parts, strict=True)]


def init_body(packed: bool) -> dict[str, Any]:
    """POST /init_weight_transfer_engine: WeightTransferInitRequest(init_info=IPCWeightTransferInitInfo)."""
    return {"init_info": {"packed": packed}}


def update_info(
    names: list[str],
    dtype_names: list[str],
    shapes: list[list[int]],
    ipc_handles: dict[str, tuple[Any, ...]] | list[dict[str, tuple[Any, ...]]],
    tensor_sizes: list[int] | None,
) -> dict[str, Any]:
    """IPCWeightTransferUpdateInfo made JSON-safe the way vLLM's HTTP client does it: the handles are
    pickled and base64-encoded into `ipc_handles_pickled`."""
    info: dict[str, Any] = {
        "names": names,
        "dtype_names": dtype_names,
        "shapes": shapes,
        "ipc_handles_pickled": base64.b64encode(pickle.dumps(ipc_handles)).decode("ascii"),
    }
    if tensor_sizes is not None:
        info["tensor_sizes"] = tensor_sizes
    return info


def update_body(info: dict[str, Any]) -> dict[str, Any]:
    """POST /update_weights: WeightTransferUpdateRequest."""
    return {"update_info": info}


def finish_body(version: str | None) -> dict[str, Any] | None:
    """POST /finish_weight_update: the embedded `weight_version` body field."""
    return {"weight_version": version} if version is not None else None


def pause_params(mode: PauseMode) -> dict[str, Any]:
    """POST /pause query parameters (clear_cache is deprecated and not sent)."""
    return {"mode": mode}


def weight_checker_body(action: str = "checksum", baseline: dict[str, str] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"action": action}
    if baseline is not None:
        body["baseline"] = baseline
    return body


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).split(".")[-1]


class VLLMAdapter:
    """EngineAdapter for a vLLM server with the native `ipc` weight-transfer backend."""

    def __init__(
        self,
        url: str,
        *,
        devices: Sequence[torch.device | str] | None = None,
        packed: bool = True,
        pause_mode: PauseMode = "keep",
        client: HttpClient | None = None,
        timeout: float = 300.0,
    ) -> None:
        self.client = client or HttpClient(url, "vLLM", timeout=timeout)
        self.devices = [torch.device(d) for d in devices] if devices is not None else None
        self.packed = packed
        self.pause_mode: PauseMode = pause_mode
        self.initialized = False
        self.partial: int | None = None
        self._bufs: dict[str, torch.Tensor] = {}
        self._keep: list[torch.Tensor] = []

    def _ensure_init(self) -> None:
        if not self.initialized:
            self.client.post("/init_weight_transfer_engine", init_body(self.packed))
            self.initialized = True

    # -- EngineAdapter --

    def pause(self) -> None:
        self.client.post("/pause", None, params=pause_params(self.pause_mode))

    def resume(self) -> None:
        self.client.post("/resume")

    def begin_update(self, version: int) -> None:
        self._ensure_init()
        self.client.post("/start_weight_update")

    def _copies(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The buffer to export on each engine device (one D2D copy per extra GPU)."""
        if self.devices is None:
            return {device_key(flat.device): flat}
        out = {}
        for dev in self.devices:
            key = device_key(dev)
            if dev == flat.device:
                out[key] = flat
                continue
            buf = self._bufs.get(key)
            if buf is None or buf.numel() < flat.numel():
                buf = torch.empty(flat.numel(), dtype=torch.uint8, device=dev)
                self._bufs[key] = buf
            out[key] = buf[: flat.numel()]
            out[key].copy_(flat)
        return out

    def load_bucket(self, tensors: NamedTensors) -> None:
        if not tensors:
            raise EngineError("vLLM: cannot load an empty bucket")
        names = [n for n, _ in tensors]
        shapes = [list(t.shape) for _, t in tensors]
        dtypes = [dtype_name(t.dtype) for _, t in tensors]
        handles: dict[str, tuple[Any, ...]] | list[dict[str, tuple[Any, ...]]]
        if self.packed:
            flat, sizes = pack(tensors, self._bufs.get("flat"))
            if self._bufs.get("flat") is None or flat.numel() > self._bufs["flat"].numel():
                self._bufs["flat"] = flat
            copies = self._copies(flat)
            handles = {k: export_handle(t) for k, t in copies.items()}
            self._keep = list(copies.values())
            info = update_info(names, dtypes, shapes, handles, sizes)
        else:
            self._keep = [t.contiguous() for _, t in tensors]
            handles = [{device_key(t.device): export_handle(t)} for t in self._keep]
            info = update_info(names, dtypes, shapes, handles, None)
        if self._keep and self._keep[0].is_cuda:
            torch.cuda.synchronize()
        self.client.post("/update_weights", update_body(info))

    def commit(self, version: int) -> None:
        self.client.post("/finish_weight_update", finish_body(str(version)))
        self.partial = None
        self._keep = []

    def abort(self, version: int, reason: str) -> None:
        # vLLM publishes a version only in finish_weight_update, which is not called: the served
        # version stays the old one, but the weights may be partially replaced -> report unknown.
        self.partial = version
        self._keep = []
        log.warning("vllm.abort version=%s reason=%s: weights may be partially updated", version, reason)

    def served_version(self) -> int | None:
        if self.partial is not None:
            return None
        info = self.client.get("/weight_info")
        try:
            return int(str(info.get("weight_version"))) if isinstance(info, dict) else None
        except (TypeError, ValueError):
            return None

    # -- extras --

    def check_weights(self, baseline: dict[str, str] | None = None) -> Any:
        action = "compare" if baseline is not None else "checksum"
        return self.client.post("/weight_checker", weight_checker_body(action, baseline))

    def shutdown(self) -> None:
        self.client.post("/shutdown_weight_transfer_engine")
        self.initialized = False
