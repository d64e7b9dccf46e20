"""The vLLM adapter against vLLM 0.33's own released code (the `engines` tier).

Nothing about vLLM is typed here: the route table, the FastAPI body rules, the request and init / update
info types, the NCCL receive path (`NCCLWeightTransferEngine.receive_weights` with
`packed_nccl_broadcast_consumer` and `unpack_tensor`) and the packing rule are executed from the installed
wheel (weightsync.e2e.engines.released). Bodies are captured from a real HTTP server; the engine side runs
in another process. What is faked is only what needs a GPU: the NCCL communicator (the stand-in group
hands the receiver exactly the buffers the adapter broadcast, in order), CUDA streams / events, and CUDA
IPC (a fake exporter whose buffers the server snapshots when /update_weights arrives). The same receive
path over real NCCL is tests/engines/test_vllm_gpu.py.
"""

from __future__ import annotations

import abc
import ast
import contextlib
import ctypes
import dataclasses
import functools
import pickle
import subprocess
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pybase64
import pytest
import torch
from recording_server import Call, RecordingServer

from weightsync.agent.engines import vllm, vllm_native
from weightsync.agent.engines.base import EngineError, EngineUnsupported, load_version
from weightsync.agent.engines.http import HttpClient
from weightsync.e2e.engines import released

pytestmark = pytest.mark.engines

PKG = "vllm"
ROUTER = "entrypoints/rl/online/api_router.py"
BASIC = "entrypoints/serve/instrumentator/basic.py"
# the dev-mode routes the adapter uses besides the RL ones: the server's config (its weight-transfer backend,
# its VLLM_* environment) and the prefix-cache reset after an update
DEV_ROUTERS = ("entrypoints/serve/dev/server_info/api_router.py", "entrypoints/serve/dev/cache/api_router.py")
WT = "distributed/weight_transfer/"
HERE = Path(__file__).resolve().parent


# ---------------- vLLM's own code, from the installed wheel ----------------


class _Stream:
    def synchronize(self) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass


class _Event:
    def record(self, stream: Any = None) -> None:
        pass


class _RecvBuf(torch.Tensor):
    """A CPU receive buffer that accepts record_stream (a CUDA allocator hint)."""

    def record_stream(self, stream: Any) -> None:
        pass


class _CpuTorch:
    """torch for vLLM's receive code on CPU: the CUDA stream / event plumbing is a no-op, all else is torch."""

    accelerator = types.SimpleNamespace(current_device_index=lambda: 0, current_stream=lambda: _Stream(),
                                        synchronize=lambda *a: None)
    cuda = types.SimpleNamespace(stream=lambda s: contextlib.nullcontext(), current_stream=lambda *a: _Stream(),
                                 Stream=lambda *a, **k: _Stream())
    Event = _Event

    @staticmethod
    def empty(*a: Any, **k: Any) -> torch.Tensor:
        return torch.empty(*a, **k).as_subclass(_RecvBuf)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _ns(**extra: Any) -> dict[str, Any]:
    ns: dict[str, Any] = {n: getattr(typing, n) for n in typing.__all__ if hasattr(typing, n)}
    ns.update(ABC=abc.ABC, abstractmethod=abc.abstractmethod, dataclass=dataclasses.dataclass,
              field=dataclasses.field, asdict=dataclasses.asdict, torch=torch, Iterator=Iterator,
              WeightTransferConfig=object, ParallelConfig=object)
    ns.update(extra)
    return ns


@functools.lru_cache(maxsize=2)
def vllm_code(cpu_receive: bool = False) -> types.SimpleNamespace:
    """vLLM 0.33's weight-transfer definitions. `cpu_receive`: the receive path with `_CpuTorch` (only in
    the engine stand-in process: it patches the loaded packed_tensor module)."""
    tmod: Any = _CpuTorch() if cpu_receive else torch
    sfx = "cpu" if cpu_receive else "ref"
    pt = released.load_file(PKG, WT + "packed_tensor.py")
    if cpu_receive:
        pt.torch = tmod
        pt._get_streams = lambda device_idx, n: tuple(_Stream() for _ in range(n))
    wrap = released.extract(PKG, "distributed/device_communicators/pynccl_wrapper.py",
                            ["ncclUniqueId", "NCCL_UNIQUE_ID_BYTES"], {"ctypes": ctypes})
    base = released.extract(PKG, WT + "base.py", [
        "TInitInfo", "TUpdateInfo", "WeightTransferUpdatePayload", "WeightTransferInitInfo",
        "WeightTransferUpdateInfo", "WeightTransferInitRequest", "WeightTransferUpdateRequest",
        "WeightTransferEngine"], _ns(torch=tmod), module_suffix=sfx)
    common = released.extract(PKG, WT + "nccl_common.py", [
        "decode_nccl_unique_id", "NCCLWeightTransferInitInfo", "worker_init_payload", "_worker_group_rank"],
        _ns(base64=pybase64, NCCL_UNIQUE_ID_BYTES=wrap.NCCL_UNIQUE_ID_BYTES,
            WeightTransferInitInfo=base.WeightTransferInitInfo,
            DEFAULT_PACKED_BUFFER_SIZE_BYTES=pt.DEFAULT_PACKED_BUFFER_SIZE_BYTES,
            DEFAULT_PACKED_NUM_BUFFERS=pt.DEFAULT_PACKED_NUM_BUFFERS), module_suffix=sfx)
    nccl = released.extract(PKG, WT + "nccl_engine.py", ["NCCLWeightTransferUpdateInfo", "NCCLWeightTransferEngine"],
                            _ns(torch=tmod, WeightTransferEngine=base.WeightTransferEngine,
                                WeightTransferUpdateInfo=base.WeightTransferUpdateInfo,
                                NCCLWeightTransferInitInfo=common.NCCLWeightTransferInitInfo,
                                packed_nccl_broadcast_consumer=pt.packed_nccl_broadcast_consumer,
                                worker_init_process_group=None,  # the stand-in installs its group
                                DEFAULT_PACKED_BUFFER_SIZE_BYTES=pt.DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                                DEFAULT_PACKED_NUM_BUFFERS=pt.DEFAULT_PACKED_NUM_BUFFERS), module_suffix=sfx)
    ipc = released.extract(PKG, WT + "ipc_engine.py", ["IPCWeightTransferInitInfo", "IPCWeightTransferUpdateInfo"],
                           _ns(WeightTransferInitInfo=base.WeightTransferInitInfo,
                               WeightTransferUpdateInfo=base.WeightTransferUpdateInfo, pickle=pickle,
                               base64=pybase64, envs=types.SimpleNamespace(VLLM_ALLOW_INSECURE_SERIALIZATION=True)),
                           module_suffix=sfx)
    return types.SimpleNamespace(packed=pt, base=base, common=common, nccl=nccl, ipc=ipc, wrap=wrap)


def route_table() -> set[tuple[str, str]]:
    out = released.routes(PKG, ROUTER) | released.routes(PKG, BASIC)
    for router in DEV_ROUTERS:
        out |= released.routes(PKG, router)
    return out


@functools.lru_cache(maxsize=1)
def route_params() -> dict[str, dict[str, Any]]:
    """Per route of api_router.py: its JSON body keys (FastAPI `Body(embed=True)` parameters: the body is
    {name: value}), which of them are required, and its `Query()` parameters."""
    out: dict[str, dict[str, Any]] = {}
    fns = [fn for router in (ROUTER, *DEV_ROUTERS) for fn in ast.walk(ast.parse(released.source_path(PKG, router).read_text()))]
    for fn in fns:
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        path = next((str(d.args[0].value) for d in fn.decorator_list if isinstance(d, ast.Call) and d.args
                     and isinstance(d.args[0], ast.Constant)), None)
        if path is None:
            continue
        args = fn.args.args
        defaults = dict(zip([a.arg for a in args[len(args) - len(fn.args.defaults):]], fn.args.defaults, strict=True))
        body, required, query = set(), set(), set()
        for a in args:
            src = ast.unparse(a.annotation) if a.annotation is not None else ""
            if "Body(embed=True)" in src:
                body.add(a.arg)
                if a.arg not in defaults:
                    required.add(a.arg)
            elif "Query(" in src or (a.arg in defaults and "Query(" in ast.unparse(defaults[a.arg])):
                query.add(a.arg)
            elif "Body(" in src:
                raise AssertionError(f"{path}: a Body parameter that is not embedded: {src}")
        out[path] = {"body": body, "required": required, "query": query}
    return out


def vllm_error_message(function: str, starts: str) -> str:
    """The text of a RuntimeError vLLM's GPU worker raises in `function` (parsed from the wheel)."""
    tree = ast.parse(released.source_path(PKG, "v1/worker/gpu_worker.py").read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    for n in ast.walk(fn):
        if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call) and n.exc.args:
            arg = n.exc.args[0]
            if isinstance(arg, ast.Constant) and str(arg.value).startswith(starts):
                return str(arg.value)
    raise AssertionError(f"vLLM's {function} raises no {starts!r}")


def vllm_error(message: str, code: int = 500) -> tuple[int, Any]:
    """vLLM's ErrorResponse JSON for an exception (create_error_response)."""
    return code, {"error": {"message": message, "type": "InternalServerError", "code": code, "param": None}}


# ---------------- the engine side, in its own process ----------------


class _Model:
    def __init__(self) -> None:
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights: Any) -> None:
        self.loaded.extend((n, t.clone().as_subclass(torch.Tensor)) for n, t in weights)


class _Group:
    """The receive side of the NCCL group: hands vLLM's consumer the adapter's broadcasts, in order."""

    def __init__(self, sent: list[torch.Tensor]) -> None:
        self.sent = list(sent)

    def broadcast(self, t: torch.Tensor, src: int, stream: Any = None) -> None:
        assert src == 0, src
        assert self.sent, "the receiver expects a broadcast the sender never made"
        got = self.sent.pop(0)
        assert got.dtype == t.dtype and got.numel() == t.numel(), (got.dtype, got.numel(), t.dtype, t.numel())
        t.copy_(got.view(t.shape))


def engine_side(inp: str, out: str) -> None:
    """What vLLM's workers do with the captured bodies: NCCL backend through NCCLWeightTransferEngine
    (parse_init_info / init_transfer_engine / update_weights), IPC through IPCWeightTransferUpdateInfo and
    unpack_tensor of each GPU's buffer as it was when /update_weights arrived."""
    data = torch.load(inp, weights_only=False)
    mtp = released.load_file(PKG, "model_executor/model_loader/mtp_validation.py")
    sys.modules["vllm.model_executor.model_loader.mtp_validation"] = mtp  # imported inside receive_weights
    code = vllm_code(cpu_receive=True)
    result: dict[str, Any] = {"ranks": []}
    if data["backend"] == "nccl":
        for rank in range(data["workers"]):
            group_ranks: list[tuple[int, int]] = []

            def join(info: Any, parallel_config: Any, rank_log: list[tuple[int, int]] = group_ranks) -> _Group:
                rank_log.append((code.common._worker_group_rank(info.rank_offset, parallel_config), info.world_size))
                return _Group(data["broadcasts"])

            code.nccl.worker_init_process_group = join
            model = _Model()
            cfg = types.SimpleNamespace(parallel_config=types.SimpleNamespace(data_parallel_index=0,
                                                                              world_size=data["workers"], rank=rank),
                                        model_config=None)
            eng = code.nccl.NCCLWeightTransferEngine(None, cfg, torch.device("cpu"), model)
            eng.init_transfer_engine(eng.parse_init_info(data["init"]["init_info"]))
            for body in data["updates"]:
                eng.update_weights(body["update_info"])
            assert not eng.model_update_group.sent, "the sender broadcast more than the receiver took"
            result["ranks"].append({"loaded": model.loaded, "group_rank": group_ranks})
    else:
        for uuid in data["uuids"]:
            loaded: list[tuple[str, torch.Tensor]] = []
            for body, snap in zip(data["updates"], data["snapshots"], strict=True):
                info = code.ipc.IPCWeightTransferUpdateInfo(**body["update_info"])
                packed = snap[uuid][: sum(info.tensor_sizes)]
                dtypes = [getattr(torch, d) for d in info.dtype_names]
                loaded += [(n, t.clone()) for n, t in code.packed.unpack_tensor(
                    packed, info.names, info.shapes, dtypes, info.tensor_sizes)]
            result["ranks"].append({"loaded": loaded})
    torch.save(result, out)


def run_engine_side(tmp: Path, data: dict[str, Any]) -> dict[str, Any]:
    inp, out = tmp / "engine-in.pt", tmp / "engine-out.pt"
    torch.save(data, inp)
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_vllm_released as t; "
            f"t.engine_side({str(inp)!r}, {str(out)!r})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return dict(torch.load(out, weights_only=False))


# ---------------- the agent side: CPU stand-ins for the CUDA calls ----------------


class FakeComm:
    device = torch.device("cpu")

    def __init__(self, unique_id: bytes, world_size: int) -> None:
        self.unique_id, self.world_size = unique_id, world_size
        self.sent: list[torch.Tensor] = []
        self.aborted = False

    def broadcast(self, t: torch.Tensor) -> None:
        assert t.device == self.device
        self.sent.append(t.clone())

    def abort(self) -> None:
        self.aborted = True


class FakeNccl(vllm_native.NcclLib):
    """The real libnccl for the unique id (no GPU needed); the communicator is CPU-side."""

    def __init__(self) -> None:
        super().__init__()
        self.comms: list[FakeComm] = []

    def prepare(self, device: torch.device | None) -> torch.device:
        return torch.device("cpu")

    def connect(self, unique_id: bytes, rank: int, world_size: int, device: torch.device) -> FakeComm:
        assert rank == 0
        c = FakeComm(unique_id, world_size)
        self.comms.append(c)
        return c

    def sent(self) -> list[torch.Tensor]:
        return [t for c in self.comms for t in c.sent]


class FakeIpc(vllm_native.CudaIpc):
    """CUDA IPC on CPU: buffers are CPU tensors named by a token in the exported args (slot 6 holds the
    device index, as in reduce_tensor's args); `snapshot` reads them as an engine rank would."""

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}
        self.collected = 0

    def check(self, devices: Any) -> None:
        pass

    def uuid(self, device: torch.device) -> str:
        return f"GPU-{device.index:08x}-0000-0000-0000-fake"

    def empty(self, shape: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        t = torch.empty(list(shape), dtype=dtype)
        t.fake_device = device  # type: ignore[attr-defined]
        return t

    def export(self, t: torch.Tensor) -> tuple[Any, ...]:
        token = len(self.tensors)
        self.tensors[token] = t
        dev = t.fake_device  # type: ignore[attr-defined]
        return ("fake-cuda-ipc", token, t.numel(), str(t.dtype), 0, 0, dev.index, 0)

    def synchronize(self, devices: Any) -> None:
        pass

    def collect(self) -> None:
        self.collected += 1

    def snapshot(self, body: dict[str, Any]) -> dict[str, torch.Tensor]:
        handles = pickle.loads(pybase64.b64decode(body["update_info"]["ipc_handles_pickled"]))
        return {uuid: self.tensors[args[1]].clone() for uuid, args in handles.items()}


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 4, generator=g).to(torch.bfloat16)
    w[0, 0], w[0, 1] = float("nan"), -0.0
    return [("model.layers.0.mlp.up_proj.weight", w),
            ("model.layers.0.scale", torch.tensor([1, -2, 3], dtype=torch.int8)),
            ("model.layers.1.self_attn.qkv_proj.weight", torch.randn(6, 5, generator=g)),
            ("model.layers.1.empty", torch.empty(0, 3, dtype=torch.float16)),
            ("model.norm.weight", torch.randn(4, generator=g).half()),
            ("lm_head.weight", torch.randn(3, 4, generator=g, dtype=torch.float64))]


def _buckets(items: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    return [items[:2], items[2:4], items[4:]]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _client(url: str) -> HttpClient:
    return HttpClient(url, "vLLM", timeout=30, retries=3, backoff=0.01, sleep=lambda s: None)


def _engine(server: RecordingServer, workers: int = 1, version: str | None = None) -> None:
    server.replies["/version"] = [(200, {"version": version or released.installed_version(PKG)})]
    server.replies["/get_world_size"] = [(200, {"world_size": workers})]


def _nccl_adapter(server: RecordingServer, **kw: Any) -> tuple[vllm.VLLMAdapter, FakeNccl]:
    nccl = FakeNccl()
    return vllm.VLLMAdapter(server.url, backend="nccl", client=_client(server.url), nccl=nccl, **kw), nccl


def _body_of(server: RecordingServer, path: str) -> list[Any]:
    return [c.body for c in server.calls if c.path == path]


# ---------------- the engine's own contract ----------------


def test_vllm_pinned_release_is_installed_and_supported() -> None:
    v = released.installed_version(PKG)
    assert v == vllm.VLLM_VERSION == released.PINNED["vllm"]
    assert vllm.check_version(v) == v
    assert vllm.supported("0.33.4") and not vllm.supported("0.34.0") and not vllm.supported("0.3.3")


def test_every_call_the_adapter_makes_is_a_vllm_route_with_vllms_body_rules(server: RecordingServer) -> None:
    """Capture every request of a good version, a failed one and the extras; each (method, path) is in
    vLLM's route table and each body / query follows the route's FastAPI parameters (embed=True: the
    body is {param: value}; required params present; a route without Body params gets no body)."""
    _engine(server, workers=2)
    server.replies["/weight_info"] = [(200, {"weight_version": "1"})]
    a, _ = _nccl_adapter(server)
    a.check_engine_version()
    load_version(a, 1, _buckets(_weights(1)), pause_generation=True)
    a.served_version()
    a.check_weights()
    a.check_weights({"w": "x"})
    server.replies["/update_weights"] = [(200, None), vllm_error("worker died"), (200, None)]
    with pytest.raises(EngineError):
        load_version(a, 2, _buckets(_weights(2)), pause_generation=True)
    a.shutdown()
    ipc = vllm.VLLMAdapter(server.url, backend="ipc", devices=["cuda:0"], client=_client(server.url), ipc=FakeIpc())
    load_version(ipc, 3, _buckets(_weights(3)), pause_generation=False)

    table = route_table()
    params = route_params()
    used = {(c.method, c.path) for c in server.calls}
    assert used <= table, sorted(used - table)
    assert {("POST", "/init_weight_transfer_engine"), ("POST", "/start_weight_update"), ("POST", "/update_weights"),
            ("POST", "/finish_weight_update"), ("POST", "/update_weight_version"), ("GET", "/version"),
            ("POST", "/shutdown_weight_transfer_engine"), ("GET", "/get_world_size")} <= used
    pause_modes = typing.get_args(released.extract(PKG, "v1/engine/__init__.py", ["PauseMode"],
                                                   {"Literal": typing.Literal}).PauseMode)
    for c in server.calls:
        if c.path == "/version":
            continue  # basic.py's GET without parameters
        p = params[c.path]
        if c.body is None:
            assert not p["required"], f"{c.path} needs {p['required']}"
        else:
            assert isinstance(c.body, dict) and set(c.body) <= p["body"] and p["required"] <= set(c.body), (
                c.path, c.body, p)
        assert set(c.query) <= p["query"], (c.path, c.query, p)
        if c.path == "/pause":
            assert c.query["mode"][0] in pause_modes


def test_nccl_bodies_are_vllms_request_types_and_match_its_trainer_payload(server: RecordingServer) -> None:
    _engine(server, workers=2)
    a, nccl = _nccl_adapter(server, packed_buffer_size_bytes=1 << 20, packed_num_buffers=3)
    load_version(a, 7, _buckets(_weights(7)), pause_generation=False)
    code = vllm_code()
    (init,) = _body_of(server, "/init_weight_transfer_engine")
    req = code.base.WeightTransferInitRequest(**init)
    info = code.common.NCCLWeightTransferInitInfo(**req.init_info)  # unknown / missing fields raise TypeError
    # the rendezvous the agent minted: a real ncclUniqueId, decoded by vLLM; rank 0 + 2 workers
    assert info.nccl_unique_id_bytes == nccl.comms[0].unique_id and len(info.nccl_unique_id_bytes) == 128
    assert (info.rank_offset, info.world_size) == (1, 3) == (1, nccl.comms[0].world_size)
    assert (info.packed, info.packed_buffer_size_bytes, info.packed_num_buffers) == (True, 1 << 20, 3)
    # exactly the payload vLLM's own worker_init_payload makes from these fields (None fields dropped)
    assert req.init_info == code.common.worker_init_payload(info)
    items = _weights(7)
    updates = _body_of(server, "/update_weights")
    assert len(updates) == 3
    for body, unordered in zip(updates, _buckets(items), strict=True):
        bucket = vllm_native.aligned_order(unordered)
        upd = code.nccl.NCCLWeightTransferUpdateInfo(**code.base.WeightTransferUpdateRequest(**body).update_info)
        assert upd.names == [n for n, _ in bucket]
        assert [getattr(torch, d) for d in upd.dtype_names] == [t.dtype for _, t in bucket]
        assert upd.shapes == [list(t.shape) for _, t in bucket]
    assert _body_of(server, "/finish_weight_update") == [{"weight_version": "7"}]
    with pytest.raises(TypeError):
        code.common.NCCLWeightTransferInitInfo(**{**req.init_info, "rank": 0})
    with pytest.raises(ValueError, match="128 bytes"):
        code.common.NCCLWeightTransferInitInfo(**{**req.init_info, "nccl_unique_id_b64": "AAAA"})


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")  # vLLM's own warning, limits below a tensor
def test_packed_chunks_follow_vllms_pack_tensors() -> None:
    """The chunk boundaries and bytes of the packed broadcast are those of vLLM's own producer
    (pack_tensors, called until the iterator is spent), for limits below, between and above the sizes."""
    pt = vllm_code().packed
    items = _weights(11)
    sizes = [vllm_native.nbytes(t) for _, t in items]
    for limit in (0, 1, 16, 64, 100, 10_000):
        it = iter(items)
        theirs = []
        while (chunk := pt.pack_tensors(it, lambda item: item[1], limit)) is not None:
            theirs.append(chunk)
        ours = vllm_native.chunk_ranges(sizes, limit)
        assert [[n for n, _ in items[s:e]] for s, e in ours] == [c.names for c in theirs], limit
        for (s, e), c in zip(ours, theirs, strict=True):
            buf, tsizes = vllm_native.pack(items[s:e])
            assert tsizes == c.tensor_sizes and torch.equal(buf, c.packed_tensor), limit


@pytest.mark.parametrize("packed, limit, workers", [(True, 1 << 30, 1), (True, 64, 2), (False, 0, 2)])
def test_nccl_versions_load_bit_exact_through_vllms_receive_code(
        server: RecordingServer, tmp_path: Path, packed: bool, limit: int, workers: int) -> None:
    """Every engine worker, running vLLM's NCCLWeightTransferEngine on the captured bodies and the
    adapter's broadcasts (another process), loads every tensor bit for bit (NaN, -0.0, empty tensors)."""
    _engine(server, workers=workers)
    a, nccl = _nccl_adapter(server, packed=packed, packed_buffer_size_bytes=limit)
    items = _weights(3)
    load_version(a, 3, _buckets(items), pause_generation=True)
    assert len(nccl.comms) == 1
    if packed:
        assert all(t.dtype == torch.uint8 and t.dim() == 1 for t in nccl.sent())
    got = run_engine_side(tmp_path, {"backend": "nccl", "workers": workers,
                                     "init": _body_of(server, "/init_weight_transfer_engine")[0],
                                     "updates": _body_of(server, "/update_weights"), "broadcasts": nccl.sent()})
    assert len(got["ranks"]) == workers
    for r, rank in enumerate(got["ranks"]):
        assert rank["group_rank"] == [(1 + r, 1 + workers)]  # vLLM's _worker_group_rank: after the agent
        sent = [t for b in _buckets(items) for t in vllm_native.aligned_order(b)]  # widest dtypes first, per bucket
        assert [n for n, _ in rank["loaded"]] == [n for n, _ in sent]
        assert all(_same(x, y) for (_, x), (_, y) in zip(rank["loaded"], sent, strict=True))
    assert server.paths() == ["/pause", "/get_world_size", "/init_weight_transfer_engine", "/start_weight_update",
                              "/update_weights", "/update_weights", "/update_weights", "/finish_weight_update",
                              "/reset_prefix_cache", "/resume"]


@pytest.mark.parametrize("packed", [True, False])
def test_ipc_handles_are_keyed_by_each_tp_ranks_gpu_uuid(server: RecordingServer, tmp_path: Path,
                                                         packed: bool) -> None:
    """TP=2 colocated: one copy per engine GPU, keyed by its UUID, validated by vLLM's
    IPCWeightTransferUpdateInfo (which unpickles the handles); each rank's buffer, read when the request
    arrived, unpacks bit-exactly with vLLM's unpack_tensor in another process."""
    ipc = FakeIpc()
    snaps: list[dict[str, torch.Tensor]] = []

    def update(call: Call) -> tuple[int, Any]:
        if packed:
            snaps.append(ipc.snapshot(call.body))
        return 200, {"message": "Weights updated"}

    server.replies["/update_weights"] = update
    devs = ["cuda:0", "cuda:1"]
    a = vllm.VLLMAdapter(server.url, backend="ipc", devices=devs, packed=packed, client=_client(server.url), ipc=ipc)
    items = _weights(5)
    for v in (5, 6):  # a second version re-exports (vLLM's importer released the mappings at finish)
        load_version(a, v, _buckets(items), pause_generation=False)
    code = vllm_code()
    uuids = [ipc.uuid(torch.device(d)) for d in devs]
    init = _body_of(server, "/init_weight_transfer_engine")
    assert len(init) == 1
    assert code.ipc.IPCWeightTransferInitInfo(**code.base.WeightTransferInitRequest(**init[0]).init_info).packed is packed
    updates = _body_of(server, "/update_weights")
    for body, unordered in zip(updates, _buckets(items) * 2, strict=True):
        bucket = vllm_native.aligned_order(unordered)
        info = code.ipc.IPCWeightTransferUpdateInfo(**code.base.WeightTransferUpdateRequest(**body).update_info)
        assert info.names == [n for n, _ in bucket]
        if packed:
            assert isinstance(info.ipc_handles, dict) and sorted(info.ipc_handles) == sorted(uuids)
            assert info.tensor_sizes == [vllm_native.nbytes(t) for _, t in bucket]
            for d, u in zip(devs, uuids, strict=True):
                assert info.ipc_handles[u][6] == torch.device(d).index
        else:
            assert isinstance(info.ipc_handles, list) and len(info.ipc_handles) == len(bucket)
            assert all(sorted(h) == sorted(uuids) for h in info.ipc_handles) and info.tensor_sizes is None
    if packed:
        # one export per buffer and GPU while the buffer fits (bucket 2 grows it, bucket 3 reuses it), fresh
        # for the next version (vLLM's importer released its mappings at finish)
        exports = [sorted(pickle.loads(pybase64.b64decode(b["update_info"]["ipc_handles_pickled"]))[u][1]
                          for u in uuids) for b in updates]
        assert exports[0] != exports[1] == exports[2] != exports[3] == exports[4] == exports[5]
        assert len({t for e in exports for t in e}) == 3 * len(uuids)
        got = run_engine_side(tmp_path, {"backend": "ipc", "uuids": uuids, "updates": updates[:3],
                                         "snapshots": snaps[:3]})
        sent = [t for b in _buckets(items) for t in vllm_native.aligned_order(b)]  # widest dtypes first, per bucket
        for rank in got["ranks"]:
            assert [n for n, _ in rank["loaded"]] == [n for n, _ in sent]
            assert all(_same(x, y) for (_, x), (_, y) in zip(rank["loaded"], sent, strict=True))
    with pytest.raises(EngineError, match="ipc backend needs `devices`"):
        vllm.VLLMAdapter(server.url, backend="ipc", devices=["cpu"])
    with pytest.raises(EngineError, match="ipc backend needs `devices`"):
        vllm.VLLMAdapter(server.url, backend="ipc")


# ---------------- failure: never stuck inside an update, never reported as served ----------------


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_a_load_failing_at_bucket_k_finishes_marks_partial_and_resumes(server: RecordingServer,
                                                                       backend: str) -> None:
    _engine(server)
    server.replies["/weight_info"] = [(200, {"weight_version": "1"})]
    if backend == "nccl":
        a, nccl = _nccl_adapter(server)
    else:
        a = vllm.VLLMAdapter(server.url, backend="ipc", devices=["cuda:0"], client=_client(server.url),
                             ipc=FakeIpc())
    load_version(a, 1, _buckets(_weights(1)), pause_generation=True)
    assert a.served_version() == 1 and not a.needs_restore
    server.calls.clear()
    # vLLM answers 500 for the worker's RuntimeError: bucket 2 fails
    server.replies["/update_weights"] = [(200, None), vllm_error("CUDA error: out of memory"), (200, None)]
    with pytest.raises(EngineError, match="out of memory"):
        load_version(a, 2, _buckets(_weights(2)), pause_generation=True)
    paths = server.paths()
    assert paths.count("/update_weights") == 2, "a failed /update_weights is never retried, bucket 3 never sent"
    k = paths.index("/finish_weight_update")
    assert paths[0] == "/pause" and paths[-1] == "/resume" and k > paths.index("/update_weights")
    assert server.calls[k].body is None, "finish without a version: vLLM keeps its version string"
    assert _body_of(server, "/update_weight_version") == [{"new_version": "partial-2"}]
    assert not a.update_open and a.partial == 2 and a.needs_restore
    assert a.served_version() is None and "/weight_info" not in server.paths()
    if backend == "nccl":
        # the broadcast that met a failed request broke the group: aborted here, shut down there, re-formed
        assert nccl.comms[0].aborted and "/shutdown_weight_transfer_engine" in paths
        assert paths.index("/shutdown_weight_transfer_engine") > k
    server.replies["/update_weights"] = [(200, None)]
    load_version(a, 1, _buckets(_weights(1)), pause_generation=True)  # the agent restores the last good one
    assert a.partial is None and not a.needs_restore and a.served_version() == 1
    if backend == "nccl":
        assert len(nccl.comms) == 2 and _body_of(server, "/init_weight_transfer_engine")


def test_an_agent_side_failure_before_any_bucket_leaves_the_previous_version_whole(server: RecordingServer) -> None:
    _engine(server)
    a, _ = _nccl_adapter(server)

    def broken() -> Iterator[list[tuple[str, torch.Tensor]]]:
        raise RuntimeError("fetch failed")
        yield []

    with pytest.raises(RuntimeError, match="fetch failed"):
        load_version(a, 4, broken(), pause_generation=True)
    assert server.paths()[-3:] == ["/start_weight_update", "/finish_weight_update", "/resume"]
    assert "/update_weight_version" not in server.paths() and "/update_weights" not in server.paths()
    assert a.partial is None and not a.needs_restore and not a.update_open


def test_non_idempotent_posts_are_not_retried_and_idempotent_ones_are(server: RecordingServer) -> None:
    _engine(server)
    server.replies["/pause"] = [vllm_error("busy", 503), (200, {"status": "paused"})]
    server.replies["/start_weight_update"] = [vllm_error("boom")]
    a, _ = _nccl_adapter(server)
    with pytest.raises(EngineError, match="boom"):
        load_version(a, 1, [_weights(1)], pause_generation=True)
    assert server.paths().count("/pause") == 2 and server.paths().count("/start_weight_update") == 1
    assert server.paths()[-1] == "/resume"
    server.calls.clear()
    server.replies["/start_weight_update"] = [(200, None)]
    server.replies["/finish_weight_update"] = [vllm_error("finalize failed")]
    with pytest.raises(EngineError, match="finalize failed"):
        load_version(a, 1, [_weights(1)], pause_generation=False)
    assert server.paths().count("/finish_weight_update") == 1
    assert a.partial == 1 and a.needs_restore and a.served_version() is None
    server.calls.clear()
    server.replies["/init_weight_transfer_engine"] = [vllm_error("rendezvous failed")]
    b, nccl = _nccl_adapter(server)
    with pytest.raises(EngineError, match="rendezvous failed"):
        b.begin_update(1)
    assert server.paths().count("/init_weight_transfer_engine") == 1 and nccl.comms[0].aborted


def test_an_update_left_open_by_a_dead_agent_is_finished_first(server: RecordingServer) -> None:
    """vLLM refuses a second start (its GPU worker's own message, read from the wheel, in its
    ErrorResponse); the adapter closes the stale update, starts again and knows the weights are mixed
    until this version is committed."""
    msg = vllm_error_message("_start_weight_update", "start_weight_update called while")
    assert "already active" in msg
    _engine(server)
    server.replies["/start_weight_update"] = [vllm_error(msg), (200, None)]
    a, _ = _nccl_adapter(server)
    a.begin_update(3)
    assert server.paths()[-3:] == ["/start_weight_update", "/finish_weight_update", "/start_weight_update"]
    assert server.calls[-2].body is None and a.needs_restore
    for bucket in _buckets(_weights(3)):
        a.load_bucket(bucket)
    a.commit(3)
    assert not a.needs_restore and a.partial is None


def test_without_a_cuda_device_of_its_own_the_agent_never_asks_the_engine_to_join(server: RecordingServer) -> None:
    """The real NCCL library mints the rendezvous id (no GPU needed); the CUDA check comes before the
    engine is asked to join (it would block in ncclCommInitRank for a rank that never comes)."""
    _engine(server)
    lib = vllm_native.NcclLib()
    ids = {lib.unique_id() for _ in range(2)}
    assert len(ids) == 2 and all(len(i) == vllm_native.NCCL_UNIQUE_ID_BYTES == vllm_code().wrap.NCCL_UNIQUE_ID_BYTES
                                 for i in ids)
    a = vllm.VLLMAdapter(server.url, backend="nccl", client=_client(server.url),
                         device="cpu" if torch.cuda.is_available() else None)
    with pytest.raises(EngineError, match="CUDA device"):
        load_version(a, 1, [_weights(1)], pause_generation=True)
    assert server.paths() == ["/pause", "/resume"]


def test_unsupported_release_is_refused_with_the_versions_that_work(server: RecordingServer) -> None:
    _engine(server)
    a, _ = _nccl_adapter(server)
    assert a.check_engine_version() == released.installed_version(PKG)
    assert ("GET", "/version") in route_table()
    for bad in ("0.31.1", "0.34.0", "0.10.2", "", "1.0.0"):
        server.replies["/version"] = [(200, {"version": bad})]
        with pytest.raises(EngineUnsupported, match=r"vLLM .* is not supported.*vLLM 0\.32\.x, 0\.33\.x"):
            a.check_engine_version()
    for good in ("0.33.2+cu129", "0.32.0", "0.32.1+cpu"):  # the CPU build the real-server tier runs is 0.32.0
        server.replies["/version"] = [(200, {"version": good})]
        assert a.check_engine_version() == good
    assert not [c for c in server.calls if c.path != "/version"], "a version check sends nothing else"


def test_draft_tensors_load_in_a_draft_session_after_the_targets(server: RecordingServer, tmp_path: Path) -> None:
    """`draft.`-prefixed tensors (mixed into the buckets in any order) are loaded into the draft model in a
    /start_draft_weight_update session opened after the target's update finished without a version; the
    version is published by the draft session's finish. vLLM's receive code gets every byte."""
    _engine(server, workers=1)
    a, nccl = _nccl_adapter(server)
    items = _weights(5)
    g = torch.Generator().manual_seed(11)
    draft = [("draft.model.layers.0.eh_proj.weight", torch.randn(4, 8, generator=g).to(torch.bfloat16)),
             ("draft.model.layers.0.enorm.weight", torch.randn(8, generator=g))]
    buckets = [[draft[0], *items[:2]], items[2:4], [*items[4:], draft[1]]]
    load_version(a, 5, buckets, pause_generation=False)
    # pauseGeneration off: the adapter still pauses for the session (vLLM's reload puts layers on meta)
    assert server.paths() == ["/pause", "/get_world_size", "/init_weight_transfer_engine", "/start_weight_update",
                              "/update_weights", "/update_weights", "/update_weights", "/finish_weight_update",
                              "/start_draft_weight_update", "/update_weights", "/finish_weight_update",
                              "/reset_prefix_cache", "/resume"]
    assert ("POST", "/start_draft_weight_update") in route_table()
    assert _body_of(server, "/finish_weight_update") == [None, {"weight_version": "5"}]  # no version, then 5
    code = vllm_code()
    updates = _body_of(server, "/update_weights")
    last = code.nccl.NCCLWeightTransferUpdateInfo(**code.base.WeightTransferUpdateRequest(**updates[-1]).update_info)
    assert sorted(last.names) == ["model.layers.0.eh_proj.weight", "model.layers.0.enorm.weight"]  # the draft's names
    got = run_engine_side(tmp_path, {"backend": "nccl", "workers": 1,
                                     "init": _body_of(server, "/init_weight_transfer_engine")[0],
                                     "updates": updates, "broadcasts": nccl.sent()})
    (rank,) = got["ranks"]
    target = [t for b in ([*items[:2]], items[2:4], [*items[4:]]) for t in vllm_native.aligned_order(b)]
    want = [*target, *vllm_native.aligned_order([(n.removeprefix("draft."), t) for n, t in draft])]
    assert [n for n, _ in rank["loaded"]] == [n for n, _ in want]
    assert all(_same(x, y) for (_, x), (_, y) in zip(rank["loaded"], want, strict=True))
    assert a.partial is None and not a.needs_restore and a.draft_bytes_held == 0


def test_a_failed_draft_session_is_closed_and_marks_the_weights_partial(server: RecordingServer) -> None:
    """A draft load vLLM refuses (e.g. the server runs no draft model) leaves no update open and the weights
    marked partial (the target is new, the draft is not): the agent restores the last good version."""
    _engine(server, workers=1)
    a, _ = _nccl_adapter(server)
    server.replies["/start_draft_weight_update"] = [vllm_error("no draft model is configured")]
    items = _weights(6)
    with pytest.raises(EngineError, match="no draft model"):
        load_version(a, 6, [[*items[:2], ("draft.w", torch.ones(2))]], pause_generation=False)
    paths = server.paths()
    assert paths[-2:] == ["/finish_weight_update", "/start_draft_weight_update"]
    assert a.partial == 6 and a.needs_restore and not a.update_open and a.served_version() is None


# ---------------- the backend the server announces (GET /server_info; the real server: tests/engine_servers) ----


def _announces(server: RecordingServer, backend: str | None, env: dict[str, Any] | None = None) -> None:
    config = {"weight_transfer_config": {"backend": backend} if backend else None}
    server.replies["/server_info"] = [(200, {"vllm_config": config, "vllm_env": env or {}})]


@pytest.mark.parametrize("backend, device, refused", [
    ("weightsync", "cpu", None), ("weightsync", "cuda:0", None), ("nccl", "cuda:1", None),
    ("nccl", "cpu", "needs CUDA"), ("ipc", "cpu", "needs CUDA"), (None, "cpu", "no --weight-transfer-config"),
    ("nccl_m2n", "cpu", "not one weightsync drives")])
def test_the_backend_is_the_one_the_server_announces(server: RecordingServer, backend: str | None, device: str,
                                                     refused: str | None) -> None:
    _engine(server)
    _announces(server, backend)
    a = vllm.VLLMAdapter(server.url, device=device, client=_client(server.url))
    assert a.backend is None
    if refused is None:
        a.check_engine_version()
        assert a.backend == backend
        assert ("GET", "/server_info") in route_table()
        (call,) = [c for c in server.calls if c.path == "/server_info"]
        assert call.query == {"config_format": ["json"]}
        return
    with pytest.raises(EngineUnsupported, match=refused) as ei:
        a.check_engine_version()
    assert ei.value.reason == "EngineConfigUnsupported" and "weightsync" in str(ei.value)
    assert not [c for c in server.calls if c.path not in ("/version", "/server_info")], "nothing is loaded"


def test_a_server_without_dev_mode_is_refused_with_the_fix(server: RecordingServer) -> None:
    _engine(server)
    server.replies["/server_info"] = [(404, {"detail": "Not Found"})]
    with pytest.raises(EngineUnsupported, match="VLLM_SERVER_DEV_MODE=1"):
        vllm.VLLMAdapter(server.url, client=_client(server.url)).check_engine_version()


@pytest.mark.parametrize("value, ok", [("1", True), (True, True), ("0", False), (None, False)])
def test_runtime_lora_needs_vllms_switch_checked_at_start(server: RecordingServer, value: Any, ok: bool) -> None:
    _engine(server)
    _announces(server, None, {} if value is None else {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value})
    a = vllm.VLLMAdapter(server.url, client=_client(server.url), lora=True)
    if ok:
        a.check_engine_version()  # a LoRA job needs no weight-transfer backend
    else:
        with pytest.raises(EngineUnsupported, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"):
            a.check_engine_version()


def test_a_refused_prefix_cache_reset_never_fails_a_loaded_version(server: RecordingServer) -> None:
    _engine(server)
    server.replies["/reset_prefix_cache"] = [(200, {"success": False})]
    a, _ = _nccl_adapter(server)
    load_version(a, 1, _buckets(_weights(1)), pause_generation=True)
    assert a.partial is None and not a.needs_restore and not a.update_open
    assert server.paths()[-3:] == ["/finish_weight_update", "/reset_prefix_cache", "/resume"]


def test_a_mixed_dtype_bucket_unpacks_with_vllms_own_unpack_tensor() -> None:
    """vLLM's packed format has no padding and `unpack_tensor` views each range as its dtype: an int8 tensor
    of 3 bytes before a float32 one left it at an odd offset and the engine failed. The adapter sends the
    widest dtypes first, so every range starts aligned; vLLM's own function unpacks it bit for bit."""
    pt = released.load_file(PKG, WT + "packed_tensor.py")
    items = _weights(3)
    bad_offsets = [sum(vllm_native.nbytes(t) for _, t in items[:i]) % t.element_size() for i, (_, t) in enumerate(items)]
    assert any(bad_offsets), "the bucket in its own order would be misaligned"
    ordered = vllm_native.aligned_order(items)
    buf, sizes = vllm_native.pack(ordered)
    got = pt.unpack_tensor(buf, [n for n, _ in ordered], [list(t.shape) for _, t in ordered],
                           [t.dtype for _, t in ordered], sizes)
    assert [n for n, _ in got] == [n for n, _ in ordered] and sorted(n for n, _ in got) == sorted(n for n, _ in items)
    assert all(_same(x, y) for (_, x), (_, y) in zip(got, ordered, strict=True))
    with pytest.raises(RuntimeError):  # what vLLM did with the bucket in its own order
        b2, s2 = vllm_native.pack(items)
        pt.unpack_tensor(b2, [n for n, _ in items], [list(t.shape) for _, t in items], [t.dtype for _, t in items], s2)
