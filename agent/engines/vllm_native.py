"""vLLM's own weight-transfer backends, `nccl` and `ipc`, from the agent's side: their init and update info,
vLLM's packed layout (the tensors' bytes back to back, cut into chunks as vLLM's consumer cuts them), and the
CUDA calls behind them: libnccl through ctypes (`NcclLib`, the calls vLLM's pynccl_wrapper makes) and CUDA IPC
exports (`CudaIpc`). Those two are the seams tests replace, so everything up to them runs on CPU.
agent/engines/vllm.py is the adapter that drives these backends (and weightsync's own, vllm_wire.py)."""

from __future__ import annotations

import base64
import ctypes
import importlib.util
import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from weightsync.agent.engines.base import EngineError, NamedTensors

#: vLLM's defaults (packed_tensor.py): the chunk limit of the packed NCCL broadcast and its buffer count.
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024
DEFAULT_PACKED_NUM_BUFFERS = 2
NCCL_UNIQUE_ID_BYTES = 128


# ---------------- init and update info ----------------


def ipc_init_info(packed: bool) -> dict[str, Any]:
    """IPCWeightTransferInitInfo."""
    return {"packed": packed}


def nccl_init_info(unique_id: bytes, world_size: int, *, packed: bool = True,
                   packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                   packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS) -> dict[str, Any]:
    """NCCLWeightTransferInitInfo for the workers (rank_offset 1: the agent is rank 0) with the unique-id
    rendezvous; unset fields (master_address / master_port) are left out, as worker_init_payload does."""
    if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
        raise EngineError(f"vLLM: an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
    return {"rank_offset": 1, "world_size": world_size,
            "nccl_unique_id_b64": base64.b64encode(unique_id).decode("ascii"), "packed": packed,
            "packed_buffer_size_bytes": packed_buffer_size_bytes, "packed_num_buffers": packed_num_buffers}


def nccl_update_info(names: list[str], dtype_names: list[str], shapes: list[list[int]]) -> dict[str, Any]:
    """NCCLWeightTransferUpdateInfo (never empty: empty lists mean "the previous call's metadata")."""
    return {"names": names, "dtype_names": dtype_names, "shapes": shapes}


def ipc_update_info(
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


# ---------------- packing (vLLM's packed layout: the tensors' bytes back to back, no padding) ----------------


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def pack(tensors: NamedTensors, out: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
    """Concatenate the tensors' bytes without padding into `out` (any device, reused when large enough)
    or a new buffer on the first tensor's device; returns (buffer, tensor_sizes)."""
    sizes = [nbytes(t) for _, t in tensors]
    total = sum(sizes)
    if out is not None and out.numel() >= total:
        buf = out[:total]
    else:
        buf = torch.empty(total, dtype=torch.uint8, device=tensors[0][1].device)
    pos = 0
    for (_, t), n in zip(tensors, sizes, strict=True):
        if n:
            buf[pos : pos + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        pos += n
    return buf, sizes


def aligned_order(tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    """The bucket in descending element size (stable). vLLM's packed format has no padding, and its
    `unpack_tensor` views each byte range as its dtype, which needs the range to start at a multiple of the
    element size: with the widest dtypes first every start is (a sum of sizes that are multiples of a larger
    power of two). The metadata is sent in this same order, so vLLM's consumer cuts the same ranges."""
    return sorted(tensors, key=lambda nt: -nt[1].element_size())


def chunk_ranges(sizes: Sequence[int], buffer_size_bytes: int) -> list[tuple[int, int]]:
    """[start, end) index ranges of the packed NCCL chunks: vLLM's `pack_tensors` / consumer rule, a chunk
    ends after the tensor that takes its running size past `buffer_size_bytes`."""
    out: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, n in enumerate(sizes):
        total += n
        if total > buffer_size_bytes:
            out.append((start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


# ---------------- NCCL (the calls vLLM's pynccl_wrapper makes, through ctypes) ----------------


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


#: ncclDataType_t of the dtypes vLLM's PyNcclCommunicator broadcasts.
NCCL_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
               torch.float32: 7, torch.float64: 8, torch.bfloat16: 9, torch.float8_e4m3fn: 10}
_NCCL_SUM = 0


class Comm(Protocol):
    """One rank-0 NCCL communicator. `broadcast` returns once the bytes left (stream synchronized)."""

    device: torch.device

    def broadcast(self, t: torch.Tensor) -> None: ...

    def abort(self) -> None: ...


def _find_nccl() -> str:
    for var in ("WEIGHTSYNC_NCCL_SO_PATH", "VLLM_NCCL_SO_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        so = Path(loc) / "lib" / "libnccl.so.2"
        if so.is_file():
            return str(so)
    return "libnccl.so.2"


class NcclLib:
    """libnccl through ctypes (the agent image has torch's NCCL, not vLLM)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._lib: Any = None

    @property
    def lib(self) -> Any:
        if self._lib is None:
            path = self.path or _find_nccl()
            try:
                lib = ctypes.CDLL(path)
            except OSError as exc:
                raise EngineError(f"vLLM nccl backend: cannot load the NCCL library {path} ({exc}); set "
                                  "WEIGHTSYNC_NCCL_SO_PATH") from exc
            lib.ncclGetErrorString.restype = ctypes.c_char_p
            lib.ncclGetErrorString.argtypes = [ctypes.c_int]
            lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
            lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, _UniqueId, ctypes.c_int]
            lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                          ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
            lib.ncclBroadcast.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                          ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
            lib.ncclCommAbort.argtypes = [ctypes.c_void_p]
            self._lib = lib
        return self._lib

    def check(self, result: int, what: str) -> None:
        if result != 0:
            msg = self.lib.ncclGetErrorString(result).decode(errors="replace")
            raise EngineError(f"vLLM nccl backend: {what} failed: NCCL error {result}: {msg}")

    def unique_id(self) -> bytes:
        uid = _UniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(bytearray(uid.internal))

    def prepare(self, device: torch.device | None) -> torch.device:
        """The agent's CUDA device for the group; checked before the engine is asked to join."""
        if not torch.cuda.is_available():
            raise EngineError("vLLM nccl backend: the agent needs a CUDA device of its own (NCCL refuses two "
                              "ranks on one GPU); none is visible to it")
        dev = device or torch.device("cuda", torch.cuda.current_device())
        if dev.type != "cuda":
            raise EngineError(f"vLLM nccl backend: the agent's device must be a CUDA device, got {dev}")
        return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())

    def connect(self, unique_id: bytes, rank: int, world_size: int, device: torch.device) -> Comm:
        """ncclCommInitRank (blocks until every rank joined) and vLLM's one-element warm-up all_reduce."""
        uid = _UniqueId()
        ctypes.memmove(ctypes.addressof(uid), unique_id, NCCL_UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        with torch.cuda.device(device):
            self.check(self.lib.ncclCommInitRank(ctypes.byref(comm), world_size, uid, rank), "ncclCommInitRank")
            c = _NcclComm(self, comm, device)
            try:
                warm = torch.zeros(1, device=device)
                stream = torch.cuda.current_stream(device)
                self.check(self.lib.ncclAllReduce(warm.data_ptr(), warm.data_ptr(), 1, NCCL_DTYPES[torch.float32],
                                                  _NCCL_SUM, comm, stream.cuda_stream), "warm-up ncclAllReduce")
                stream.synchronize()
            except BaseException:
                c.abort()
                raise
        return c


class _NcclComm:
    def __init__(self, nccl: NcclLib, comm: ctypes.c_void_p, device: torch.device) -> None:
        self.nccl, self.comm, self.device = nccl, comm, device

    def broadcast(self, t: torch.Tensor) -> None:
        if t.device != self.device or not t.is_contiguous():
            t = t.to(self.device).contiguous()
        dt = NCCL_DTYPES.get(t.dtype)
        if dt is None:
            raise EngineError(f"vLLM nccl backend: NCCL cannot broadcast {t.dtype}; use packed=True")
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device)
            self.nccl.check(self.nccl.lib.ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(), dt, 0, self.comm,
                                                        stream.cuda_stream), "ncclBroadcast")
            stream.synchronize()

    def abort(self) -> None:
        if self.comm:
            self.nccl.lib.ncclCommAbort(self.comm)
            self.comm = ctypes.c_void_p()


# ---------------- CUDA IPC ----------------


class CudaIpc:
    """What the ipc backend needs from CUDA."""

    def check(self, devices: Sequence[torch.device]) -> None:
        if not devices or not all(d.type == "cuda" for d in devices):
            raise EngineError("vLLM ipc backend needs `devices`: the CUDA device of every engine TP rank (CUDA "
                              f"IPC handles keyed by GPU UUID); got {list(devices)}")

    def uuid(self, device: torch.device) -> str:
        """The key vLLM looks a handle up by: str(get_device_properties().uuid) of its own GPU."""
        return str(torch.cuda.get_device_properties(device.index or 0).uuid)

    def empty(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(list(shape), dtype=dtype, device=device)

    def export(self, t: torch.Tensor) -> tuple[Any, ...]:
        """rebuild_cuda_tensor args for `t` (torch.multiprocessing.reductions.reduce_tensor), as vLLM does."""
        from torch.multiprocessing.reductions import reduce_tensor

        _fn, args = reduce_tensor(t)
        return tuple(args)

    def synchronize(self, devices: Sequence[torch.device]) -> None:
        for d in devices:
            torch.cuda.synchronize(d)

    def collect(self) -> None:
        torch.cuda.ipc_collect()
