"""The vLLM adapter's `nccl` backend over real NCCL, against vLLM 0.33's own engine-side code (GPU tier).

A second process plays the vLLM server: behind the adapter's routes it runs vLLM's
`NCCLWeightTransferEngine` (from the installed wheel, weightsync.e2e.engines.released) on CUDA, one worker
per engine GPU, each joining the group through vLLM's own `worker_init_process_group` ->
`PyNcclCommunicator.from_unique_id_bytes` (unique-id rendezvous, warm-up all_reduce) and receiving with
`packed_nccl_broadcast_consumer`. The adapter is rank 0 on a GPU of its own (NCCL refuses two ranks of one
communicator on one GPU), so a test needs 1 + engine workers GPUs. What the engine stand-in does not run:
the model (a recorder of load_weights) and the layerwise reload of start / finish.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from test_vllm_released import _buckets, _same, _weights, vllm_code

from weightsync.agent.engines import vllm
from weightsync.agent.engines.base import load_version
from weightsync.e2e.engines import released
from weightsync.e2e.procs import free_port

pytestmark = [pytest.mark.gpu]  # not `engines`: that tier runs without a GPU, with no skips

HERE = Path(__file__).resolve().parent
WT = "distributed/weight_transfer/"


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# ---------------- the engine process ----------------


class _Model:
    def __init__(self) -> None:
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights: Any) -> None:
        self.loaded.extend((n, t.detach().to("cpu", copy=True)) for n, t in weights)


def ipc_engine_class(code: Any) -> Any:
    """vLLM 0.33's IPCWeightTransferEngine, executed from the installed wheel: its receive_weights rebuilds the
    adapter's CUDA IPC handles (torch's rebuild_cuda_tensor, keyed by the GPU's UUID) or unpacks a packed buffer
    with vLLM's own PackedBufferImporter / packed_ipc_consumer."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    pt = code.packed
    return released.extract("vllm", WT + "ipc_engine.py", ["IPCWeightTransferEngine"], {
        "torch": torch, "Any": Any, "WeightTransferConfig": object, "rebuild_cuda_tensor": rebuild_cuda_tensor,
        "WeightTransferEngine": code.base.WeightTransferEngine,
        "IPCWeightTransferInitInfo": code.ipc.IPCWeightTransferInitInfo,
        "IPCWeightTransferUpdateInfo": code.ipc.IPCWeightTransferUpdateInfo,
        "PackedBufferImporter": pt.PackedBufferImporter, "packed_ipc_consumer": pt.packed_ipc_consumer,
    }, module_suffix="gpu").IPCWeightTransferEngine


def engine_main(port: int, workers: int, out: str, backend: str = "nccl") -> None:
    """vLLM's engine side on GPUs 0..workers-1 behind the routes the adapter calls (`backend`: nccl or ipc)."""
    sys.modules["vllm.model_executor.model_loader.mtp_validation"] = released.load_file(
        "vllm", "model_executor/model_loader/mtp_validation.py")
    code = vllm_code()
    models = [_Model() for _ in range(workers)]
    if backend == "ipc":
        engines = [ipc_engine_class(code)(None, _vllm_config(workers, r), torch.device("cuda", r), models[r])
                   for r in range(workers)]
    else:
        engines = _nccl_engines(code, workers, models)
    _serve(port, workers, out, models, engines)


def _vllm_config(workers: int, rank: int) -> Any:
    return types.SimpleNamespace(parallel_config=types.SimpleNamespace(data_parallel_index=0, world_size=workers,
                                                                       rank=rank), model_config=None)


def _nccl_engines(code: Any, workers: int, models: list[_Model]) -> list[Any]:
    from vllm.utils.nccl import unpinned_nccl_env

    wrap = code.wrap
    common = released.extract("vllm", WT + "nccl_common.py", [
        "decode_nccl_unique_id", "NCCLWeightTransferInitInfo", "_worker_group_rank", "stateless_init_process_group",
        "uid_init_process_group", "worker_init_process_group"],
        {**code.common.__dict__, "NCCL_UNIQUE_ID_BYTES": wrap.NCCL_UNIQUE_ID_BYTES, "unpinned_nccl_env": unpinned_nccl_env,
         "torch": torch}, module_suffix="gpu")
    code.nccl.worker_init_process_group = common.worker_init_process_group
    return [code.nccl.NCCLWeightTransferEngine(None, _vllm_config(workers, r), torch.device("cuda", r), models[r])
            for r in range(workers)]


def _serve(port: int, workers: int, out: str, models: list[_Model], engines: list[Any]) -> None:
    state: dict[str, Any] = {"version": "default", "active": False, "versions": {}}

    def on_workers(fn: Callable[[Any], None]) -> None:
        """collective_rpc: every worker, concurrently, on its own GPU."""
        errors: list[BaseException] = []

        def run(r: int) -> None:
            try:
                torch.cuda.set_device(r)
                fn(engines[r])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(r,)) for r in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def handle(method: str, path: str, body: Any) -> Any:
        if path == "/version":
            return {"version": released.installed_version("vllm")}
        if path == "/get_world_size":
            return {"world_size": workers}
        if path == "/weight_info":
            return {"weight_version": state["version"]}
        if path in ("/pause", "/resume"):
            return {"status": path[1:]}
        if path == "/init_weight_transfer_engine":
            on_workers(lambda e: e.init_transfer_engine(e.parse_init_info(body["init_info"])))
            return {"message": "Weight transfer initialized"}
        if path == "/start_weight_update":
            if state["active"]:
                raise RuntimeError("start_weight_update called while a weight update is already active.")
            state["active"] = True
            for m in models:
                m.loaded.clear()
            return {"message": "Weight update started"}
        if path == "/update_weights":
            on_workers(lambda e: e.update_weights(body["update_info"]))
            return {"message": "Weights updated"}
        if path == "/finish_weight_update":
            state["active"] = False
            v = (body or {}).get("weight_version")
            if v is not None:
                state["version"] = v
                state["versions"][v] = [list(m.loaded) for m in models]
                torch.save(state["versions"], out)
            return {"message": "Weight update finished"}
        if path == "/shutdown_weight_transfer_engine":
            on_workers(lambda e: e.shutdown())
            return {"message": "Weight transfer shut down"}
        raise KeyError(path)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _do(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n)) if n else None
            try:
                status, payload = 200, handle(self.command, self.path.split("?")[0], body)
            except Exception as exc:
                status, payload = 500, {"error": {"message": f"{type(exc).__name__}: {exc}", "code": 500}}
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = _do
        do_POST = _do

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


class Engine:
    def __init__(self, tmp: Path, workers: int, backend: str = "nccl") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out = tmp / "engine-loaded.pt"
        self.log = tmp / "engine.log"
        code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_vllm_gpu as t; "
                f"t.engine_main({self.port}, {workers}, {str(self.out)!r}, {backend!r})")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                requests.get(f"{self.url}/version", timeout=1)
                return
            except requests.RequestException:
                time.sleep(0.2)
        self.close()  # the caller never got this object: it would outlive the test
        raise AssertionError(f"engine stand-in did not start: {self.log.read_text()}")

    def loaded(self) -> dict[str, list[list[tuple[str, torch.Tensor]]]]:
        return dict(torch.load(self.out, weights_only=False))

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("packed, limit", [(True, 1 << 30), (True, 64), (False, 0)])
def test_nccl_backend_loads_bit_exact_into_vllms_receiver(tmp_path: Path, workers: int, packed: bool,
                                                          limit: int) -> None:
    if _gpus() < workers + 1:
        pytest.skip(f"needs {workers + 1} GPUs: {workers} engine worker(s) and one for the agent (rank 0)")
    eng = Engine(tmp_path, workers)
    a = vllm.VLLMAdapter(eng.url, backend="nccl", device=f"cuda:{workers}", packed=packed,
                         packed_buffer_size_bytes=limit, timeout=120)
    _two_versions_bit_exact(a, eng, f"cuda:{workers}", workers)


def _two_versions_bit_exact(a: vllm.VLLMAdapter, eng: Engine, device: str, workers: int) -> None:
    """Versions 1 (CPU sources) and 2 (sources on `device`) through the adapter: every engine worker loaded
    the tensors in order, bit for bit; then the adapter shuts the transfer down."""
    try:
        assert a.check_engine_version() == released.installed_version("vllm")
        for v in (1, 2):
            items = [(n, t.to(device) if v == 2 else t) for n, t in _weights(v)]
            load_version(a, v, _buckets(items), pause_generation=True)
            assert a.served_version() == v
            got = eng.loaded()[str(v)]
            assert len(got) == workers
            for rank in got:
                assert [n for n, _ in rank] == [n for n, _ in items]
                assert all(_same(x, y.cpu()) for (_, x), (_, y) in zip(rank, items, strict=True))
        a.shutdown()
    finally:
        a.close()
        eng.close()


@pytest.mark.parametrize("packed", [True, False])
def test_ipc_backend_loads_bit_exact_into_vllms_receiver(tmp_path: Path, packed: bool) -> None:
    """One GPU: the adapter exports CUDA IPC handles keyed by the GPU's UUID (packed: one buffer per bucket),
    and vLLM's IPCWeightTransferEngine in another process rebuilds and loads them, bit for bit."""
    if _gpus() < 1:
        pytest.fail("the gpu tier needs a CUDA GPU")
    eng = Engine(tmp_path, 1, backend="ipc")
    a = vllm.VLLMAdapter(eng.url, backend="ipc", devices=["cuda:0"], packed=packed, timeout=120)
    _two_versions_bit_exact(a, eng, "cuda:0", 1)
