"""vLLM adapter: vLLM 0.32-0.33's weight-transfer API over HTTP, with the backend the server announces:
`weightsync` (weightsync's own, a vLLM plugin: agent/engines/vllm_wire.py, vllm_plugin.py), `nccl` or `ipc`.

Protocol (vLLM 0.33.x: routes in `vllm/entrypoints/rl/online/api_router.py`, request types in
`vllm/distributed/weight_transfer/base.py`, backends in `nccl_engine.py` / `nccl_common.py` /
`ipc_engine.py`, packing in `packed_tensor.py`; the server runs with VLLM_SERVER_DEV_MODE=1, the RL routes
are dev-gated, and `--weight-transfer-config '{"backend": "weightsync"|"nccl"|"ipc"}'`):

    GET  /version, GET /server_info?config_format=json   at start: another release, or a server this agent
                                                    cannot drive, is refused; the backend is the announced one
    POST /init_weight_transfer_engine {"init_info": ...}       once (again only after the group broke)
    POST /pause?mode=keep                           always (the session puts vLLM's layers on meta)
    POST /start_weight_update                       per version
    POST /update_weights {"update_info": ...}       per bucket
    POST /finish_weight_update {"weight_version": "<N>"}   vLLM publishes N only when finish succeeds
    POST /reset_prefix_cache?reset_running_requests=true   no KV of the old weights survives (logged if refused)
    POST /resume                                    always, also after a failure

A version with draft weights (`draft.` tensors, base.DRAFT_PREFIX) finishes the target's update without a
version, then loads the held draft tensors between POST /start_draft_weight_update and the finish that
publishes N (a session loads into one model, chosen at its start).

The bodies are FastAPI `Body(embed=True)` parameters, hence the one-key wrappers. Non-idempotent POSTs
(init, start, update, finish) are never retried: vLLM answers 500 for a worker-side RuntimeError, and a
second /start_weight_update or /update_weights is not the same request as the first. Pause, resume and
GETs are retried.

Backends:

* `nccl` (Separated placement: the engine receives straight from the wire). The agent is rank 0 of the
  NCCL group vLLM's `NCCLWeightTransferEngine` joins: `init_info` is the worker side of
  `NCCLWeightTransferInitInfo` (rank_offset 1, world_size 1 + the engine's workers from GET
  /get_world_size, so worker w of DP rank d joins as 1 + d * TP*PP + w), with the torch-free rendezvous
  vLLM offers for foreign trainers: `nccl_unique_id_b64` (the agent mints the ncclUniqueId; the agent image
  has no vLLM, so no StatelessProcessGroup/TCPStore). The engine blocks inside init until every rank joined
  and then issues a one-element float32 all_reduce (`PyNcclCommunicator.from_unique_id_bytes`); the agent
  posts init in a thread while it joins and answers that warm-up. Per bucket it posts /update_weights
  (names, dtype_names, shapes) in a thread and broadcasts from rank 0 meanwhile, packed exactly as
  `packed_nccl_broadcast_producer` does: uint8 chunks cut after the tensor that takes the running size
  past `packed_buffer_size_bytes` (the consumer cuts the same way from the metadata). NCCL refuses two
  ranks of one communicator on one GPU, so the agent needs a CUDA device of its own (`device`), not one
  of the engine's.
* `ipc` (Colocated: agent and engine share the GPUs). One packed buffer per bucket with `tensor_sizes`
  and, for every engine worker's GPU (`devices`, one per TP rank), a copy of it exported with
  `reduce_tensor` and keyed by that GPU's UUID (vLLM looks up `str(props.uuid)` of its own device, so
  CUDA_VISIBLE_DEVICES may differ between containers). The handles travel pickled
  (`ipc_handles_pickled`, as vLLM's HTTPVLLMWeightSyncClient sends them; the server needs
  VLLM_ALLOW_INSECURE_SERIALIZATION=1). A buffer is exported once per version (vLLM's importer caches the
  mapping and releases it at finish) and stays alive until finish.

Failure: vLLM cannot roll back. start_weight_update moves every layer to the meta device; finish
(without a version: vLLM then leaves the served version alone) puts the kernel tensors of layers that got
nothing back and processes the layers that got something, so after a bucket reached the engine its
weights are a mix of two versions. `abort` therefore always closes the update (the engine is never left
inside one, with layers on meta), marks the engine's version `partial-<N>` (/update_weight_version) and
the adapter `partial` (served_version() is None) and sets `needs_restore`: the agent reloads the last
good version while the engine stays paused (agent/inference/loop.py). An abort before any bucket reached the
engine leaves the previous version whole. A dead agent's update left open is closed at the next begin.

The `nccl` and `ipc` backends' own formats (init / update info, vLLM's packed layout) and the CUDA calls
behind them are agent/engines/vllm_native.py; the CUDA calls sit behind two small seams there, `NcclLib`
(ncclGetUniqueId / CommInitRank / Broadcast through ctypes, the calls vLLM's pynccl_wrapper makes) and
`CudaIpc` (UUIDs, device buffers, reduce_tensor), so everything up to them (bodies, packing, order, failure
handling) runs on CPU in tests.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import torch

from weightsync.agent.engines import vllm_wire
from weightsync.agent.engines.base import (
    EngineError,
    EngineUnsupported,
    NamedTensors,
    parse_version,
    split_draft,
    version_label,
)
from weightsync.agent.engines.http import EngineHTTPError, HttpClient
from weightsync.agent.engines.overlap import post_during
from weightsync.agent.engines.vllm_native import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    Comm,
    CudaIpc,
    NcclLib,
    aligned_order,
    chunk_ranges,
    ipc_init_info,
    ipc_update_info,
    nbytes,
    nccl_init_info,
    nccl_update_info,
    pack,
)
from weightsync.agent.transports.rendezvous import LinkStore, StoreServer

log = logging.getLogger(__name__)

VLLM_VERSION = "0.33.0"
#: vLLM release series whose weight-transfer API this adapter speaks ("0.33" = any 0.33.x). 0.32 has the same
#: RL routes and request types; the real-server tier runs the CPU build 0.32.0 (docs/placement-and-transfer.md).
SUPPORTED_VERSIONS = ("0.32", "0.33")
Backend = Literal["weightsync", "nccl", "ipc"]
BACKENDS: tuple[Backend, ...] = ("weightsync", "nccl", "ipc")
PauseMode = Literal["abort", "wait", "keep"]


# ---------------- version ----------------


def supported(version: str) -> bool:
    m = re.match(r"^(\d+)\.(\d+)\.\d+", version.strip())
    return m is not None and f"{m[1]}.{m[2]}" in SUPPORTED_VERSIONS


def check_version(version: str) -> str:
    """Refuse a vLLM release whose weight-transfer API this adapter does not speak."""
    if not supported(version):
        series = ", ".join(f"{s}.x" for s in SUPPORTED_VERSIONS)
        raise EngineUnsupported(f"vLLM {version or '(unknown version)'} is not supported: weightsync speaks the weight-"
                          f"transfer API of vLLM {series} (tested with {VLLM_VERSION}); run a supported image "
                          f"(e.g. vllm/vllm-openai:v{VLLM_VERSION})")
    return version


# ---------------- bodies (FastAPI Body(embed=True): one key per parameter) ----------------


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).split(".")[-1]


def init_body(init_info: dict[str, Any]) -> dict[str, Any]:
    """POST /init_weight_transfer_engine (WeightTransferInitRequest.init_info)."""
    return {"init_info": init_info}


def update_body(info: dict[str, Any]) -> dict[str, Any]:
    """POST /update_weights (WeightTransferUpdateRequest.update_info)."""
    return {"update_info": info}


def finish_body(version: str | None) -> dict[str, Any] | None:
    """POST /finish_weight_update: `weight_version`, or no body (vLLM then keeps the served version)."""
    return {"weight_version": version} if version is not None else None


def weight_version_body(version: str) -> dict[str, Any]:
    """POST /update_weight_version."""
    return {"new_version": version}


def pause_params(mode: PauseMode) -> dict[str, Any]:
    """POST /pause query parameters (clear_cache is deprecated and not sent)."""
    return {"mode": mode}


def weight_checker_body(action: str = "checksum", baseline: dict[str, str] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"action": action}
    if baseline is not None:
        body["baseline"] = baseline
    return body




# ---------------- the adapter ----------------


@dataclass
class EngineFault:
    """A one-shot chaos drill on the last hop (contract.ENV_ENGINE_FAULT), backend weightsync: `corrupt`
    flips a byte of bucket `bucket` (0-based) of `version` after its leaves were computed; `hang` stops
    after that bucket reached the engine, inside the open update, until the process is killed."""

    kind: Literal["corrupt", "hang"]
    version: int
    bucket: int
    fired: bool = False

    @classmethod
    def parse(cls, text: str) -> EngineFault:
        m = re.fullmatch(r"engine-(corrupt|hang):(\d+):(\d+)", text.strip())
        if m is None:
            raise EngineError(f"engine fault {text!r}: expected engine-corrupt:<version>:<bucket> or "
                              "engine-hang:<version>:<bucket>")
        return cls("corrupt" if m[1] == "corrupt" else "hang", int(m[2]), int(m[3]))

    def due(self, kind: str, version: int | None, bucket: int) -> bool:
        if self.fired or kind != self.kind or version != self.version or bucket != self.bucket:
            return False
        self.fired = True
        log.warning("engine fault: %s at version=%s bucket=%s (a drill, WEIGHTSYNC_ENGINE_FAULT)", kind, version,
                    bucket)
        return True


@dataclass
class _WeightsyncGroup:
    """Backend "weightsync": the agent's rendezvous store, its client and the group (rank 0)."""

    server: StoreServer
    store: LinkStore
    pg: Any
    device: torch.device
    buf: torch.Tensor | None = None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if hasattr(self.pg, "abort"):
                self.pg.abort()
        self.store.close()
        self.server.close()


@dataclass
class _Exported:
    buf: torch.Tensor
    args: tuple[Any, ...] | None = None


class VLLMAdapter:
    """EngineAdapter for a vLLM server (one replica behind one HTTP endpoint).

    backend "nccl": `device` is the agent's own GPU (rank 0 of the group); `engine_world_size` the number of
    engine workers (default: GET /get_world_size). backend "ipc": `devices` are the GPUs of the engine's
    workers in rank order. `packed` selects vLLM's packed wire format (both backends)."""

    def __init__(
        self,
        url: str,
        *,
        backend: Backend | Literal["auto"] = "auto",
        devices: Sequence[torch.device | str] | None = None,
        device: torch.device | str | None = None,
        engine_world_size: int | None = None,
        packed: bool = True,
        packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
        pause_mode: PauseMode = "keep",
        client: HttpClient | None = None,
        timeout: float = 300.0,
        nccl: NcclLib | None = None,
        ipc: CudaIpc | None = None,
        lora: bool = False,
        fault: EngineFault | None = None,
    ) -> None:
        if backend not in (*BACKENDS, "auto"):
            raise EngineError(f"vLLM: unknown weight-transfer backend {backend!r}; expected auto or one of "
                              f"{', '.join(BACKENDS)}")
        self.client = client or HttpClient(url, "vLLM", timeout=timeout)
        self.backend: Backend | None = None if backend == "auto" else backend  # auto: what the server announces
        self.lora = lora
        self.fault = fault
        self.version: int | None = None  # the version of the open update
        self.copied_bytes = 0  # bytes packed for the engine (weightsync_agent_copied_bytes_total{stage="engine_pack"})
        self.packed = packed
        self.packed_buffer_size_bytes = packed_buffer_size_bytes
        self.packed_num_buffers = packed_num_buffers
        self.pause_mode: PauseMode = pause_mode
        self.timeout = timeout
        self.device = torch.device(device) if device is not None else None
        self.engine_world_size = engine_world_size
        self.devices = [torch.device(d) for d in devices] if devices is not None else None
        self.nccl = nccl or NcclLib()
        self.ipc = ipc or CudaIpc()
        if backend == "ipc":
            self.ipc.check(self.devices or [])
        self.initialized = False
        self.update_open = False
        self.buckets_sent = 0
        self.partial: int | None = None
        self.needs_restore = False
        self._comm: Comm | None = None
        self._group_broken = False
        self._pack_buf: torch.Tensor | None = None
        self._ipc_bufs: dict[str, _Exported] = {}
        self._keep: list[torch.Tensor] = []
        self._uuids: dict[torch.device, str] = {}
        self._draft: list[tuple[str, torch.Tensor]] = []  # draft tensors held for the draft session at commit
        self.label_digest: str | None = None  # see SGLangAdapter.label_digest
        self.draft_bytes_held = 0
        self._ws: _WeightsyncGroup | None = None  # backend "weightsync": the group with the engine's workers
        self.paused = False  # by pause() (the caller's) or by begin_update (a session needs it)
        self._session_paused = False

    # -- engine facts --

    def engine_version(self) -> str:
        """The engine's release (GET /version)."""
        info = self.client.get("/version")
        return str(info.get("version", "")) if isinstance(info, dict) else ""

    def check_engine_version(self) -> str:
        """GET /version, then the server's configuration (GET /server_info): raises EngineUnsupported
        ("... is not supported ... vLLM 0.32.x, 0.33.x") for another release, and with reason
        EngineConfigUnsupported for a server this agent cannot drive (the message says how to start it)."""
        release = check_version(self.engine_version())
        if self.lora:
            self._check_runtime_lora()
        else:
            self.resolve_backend()
        return release

    def server_info(self) -> dict[str, Any]:
        """GET /server_info?config_format=json: {"vllm_config": {...}, "vllm_env": {...}} (a dev-mode route,
        like every RL route)."""
        try:
            info = self.client.get("/server_info", params={"config_format": "json"})
        except EngineHTTPError as exc:
            if exc.status == 404:
                raise EngineUnsupported(
                    "vLLM: the server has no RL routes (GET /server_info: 404): start it with "
                    "VLLM_SERVER_DEV_MODE=1 (weight updates, pause and resume are dev-mode routes)",
                    reason="EngineConfigUnsupported") from exc
            raise
        if not isinstance(info, dict) or not isinstance(info.get("vllm_config"), dict):
            raise EngineError(f"vLLM: GET /server_info answered no JSON config: {str(info)[:200]}")
        return info

    def resolve_backend(self) -> Backend:
        """The weight-transfer backend: the one the server was started with (its --weight-transfer-config),
        unless the adapter was built for one. vLLM's own nccl / ipc backends need a CUDA agent."""
        if self.backend is not None:
            return self.backend
        config = self.server_info()["vllm_config"]
        wt = (config.get("weight_transfer_config") or {}).get("backend")
        start = f"""start the server with --weight-transfer-config '{{"backend": "{vllm_wire.BACKEND_NAME}"}}'"""
        if wt is None:
            raise EngineUnsupported(f"vLLM: the server takes no weight updates (no --weight-transfer-config); {start}",
                                    reason="EngineConfigUnsupported")
        if wt not in BACKENDS:
            raise EngineUnsupported(f"vLLM: weight-transfer backend {wt!r} is not one weightsync drives "
                                    f"({', '.join(BACKENDS)}); {start}", reason="EngineConfigUnsupported")
        if wt in ("nccl", "ipc") and (self.device is None or self.device.type != "cuda"):
            raise EngineUnsupported(
                f"vLLM: the server's weight-transfer backend is {wt!r}, which needs CUDA on the agent's side "
                f"(nccl: a GPU of the agent's own; ipc: the engine's GPUs), and this agent has none ({self.device}); "
                f"{start} (the weightsync plugin receives over gloo from a CPU agent)",
                reason="EngineConfigUnsupported")
        if wt == "ipc":
            self.ipc.check(self.devices or [])
        self.backend = wt
        log.info("vllm.backend %s (announced by the server)", wt)
        return wt

    def _check_runtime_lora(self) -> None:
        env = self.server_info().get("vllm_env") or {}
        if str(env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "")).lower() not in ("1", "true"):
            raise EngineUnsupported(
                "vLLM: loading a LoRA adapter at run time needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 in the engine "
                "container's environment (the server refuses /v1/load_lora_adapter without it)",
                reason="EngineConfigUnsupported")

    def engine_workers(self) -> int:
        if self.engine_world_size is None:
            info = self.client.get("/get_world_size", params={"include_dp": "true"})
            n = info.get("world_size") if isinstance(info, dict) else None
            if not isinstance(n, int) or n < 1:
                raise EngineError(f"vLLM: GET /get_world_size answered {info!r}")
            self.engine_world_size = n
        return self.engine_world_size

    # -- init --

    def _ensure_init(self) -> None:
        if self.initialized:
            return
        self.resolve_backend()
        if self.backend == "weightsync":
            self._init_weightsync()
        elif self.backend == "ipc":
            self.client.post("/init_weight_transfer_engine", init_body(ipc_init_info(self.packed)), retry=False)
        else:
            self._init_group()
        self.initialized = True

    def _init_group(self) -> None:
        device = self.nccl.prepare(self.device)  # fail here, before the engine waits for a rank that never comes
        world = 1 + self.engine_workers()
        uid = self.nccl.unique_id()
        info = nccl_init_info(uid, world, packed=self.packed, packed_buffer_size_bytes=self.packed_buffer_size_bytes,
                              packed_num_buffers=self.packed_num_buffers)
        made: list[Comm] = []
        try:
            self._concurrently("/init_weight_transfer_engine", init_body(info),
                               lambda: made.append(self.nccl.connect(uid, 0, world, device)))
        except BaseException:
            for comm in made:  # joined, but the engine's side failed: our half is of no use
                comm.abort()
            raise
        self._comm = made[0]
        self._group_broken = False
        log.info("vllm.group_ready world_size=%s device=%s packed=%s", world, device, self.packed)

    def _init_weightsync(self) -> None:
        """Form the group with vLLM's workers: a StoreServer behind a fresh secret on the engine's address
        (pod-local), the secret handed over in init_info, the agent joining as rank 0 meanwhile."""
        host = urlsplit(self.client.base_url).hostname or "127.0.0.1"
        host = "127.0.0.1" if host == "localhost" else host
        backend = "nccl" if self.device is not None and self.device.type == "cuda" else "gloo"
        world = 1 + self.engine_workers()
        secret = vllm_wire.new_secret()
        server = StoreServer(host, 0, secret, timeout=self.timeout)
        store = LinkStore(host, server.port, secret, timeout=self.timeout)
        group = f"weightsync/{uuid.uuid4().hex}/"
        info = vllm_wire.init_info(store_host=host, store_port=server.port, store_secret=secret, group=group,
                                   world_size=world, worker_host=host, backend=backend, timeout_s=self.timeout)
        made: list[Any] = []
        device = self.device if backend == "nccl" and self.device is not None else torch.device("cpu")
        try:
            self._concurrently("/init_weight_transfer_engine", init_body(info), lambda: made.append(
                vllm_wire.make_group(store, group, 0, world, backend, host, self.timeout)))
        except BaseException:
            store.close()
            server.close()
            raise
        self._ws = _WeightsyncGroup(server, store, made[0], device)
        self._group_broken = False
        log.info("vllm.weightsync_group_ready world_size=%s backend=%s host=%s", world, backend, host)

    def _weightsync_bucket(self, tensors: NamedTensors) -> None:
        ws = self._ws
        if ws is None:
            raise EngineError("vLLM weightsync backend: no group (init failed or broke)")
        corrupt = self.fault is not None and self.fault.due("corrupt", self.version, self.buckets_sent)
        placed = None if corrupt else vllm_wire.in_place(tensors, ws.device)
        if placed is not None:
            data, info = placed  # the bucket's own bytes (the receive slot): no pack
        else:
            ws.buf, info = vllm_wire.pack(tensors, ws.buf, ws.device)
            self.copied_bytes += sum(nbytes(t) for _, t in tensors)
            data = ws.buf[: info.nbytes]
        info.bucket = self.buckets_sent
        if corrupt and info.nbytes:
            data[info.nbytes // 2] ^= 0x5A  # in our own pack, after the leaves: the engine must refuse it
        status: list[int] = []

        def send() -> None:
            vllm_wire.broadcast(ws.pg, data)
            status.append(vllm_wire.status_allreduce(ws.pg, vllm_wire.STATUS_OK, ws.device))

        self.buckets_sent += 1  # from here on the engine's weights may be touched
        self._concurrently("/update_weights", update_body(asdict(info)), send)
        if self.fault is not None and self.fault.due("hang", self.version, info.bucket):
            log.warning("engine fault: hanging inside the open update until killed")
            threading.Event().wait()
        if status and status[0] != vllm_wire.STATUS_OK:
            raise EngineError(f"vLLM refused bucket {info.bucket} of this version inside the engine: "
                              f"{vllm_wire.STATUS_NAMES.get(status[0], status[0])} (the engine's log names the "
                              "tensor); the version is not finished")

    def _flush_weightsync(self) -> None:
        """Before a finish: the workers load the bucket they checked last (they load bucket k-1 while k is on
        the wire) and report."""
        ws = self._ws
        if self.backend != "weightsync" or ws is None or not self.update_open:
            return
        status: list[int] = []
        self._concurrently("/update_weights", update_body(asdict(vllm_wire.WeightsyncUpdateInfo(flush=True))),
                           lambda: status.append(vllm_wire.status_allreduce(ws.pg, vllm_wire.STATUS_OK, ws.device)))
        if status and status[0] != vllm_wire.STATUS_OK:
            raise EngineError(f"vLLM could not load the last bucket of this version: "
                              f"{vllm_wire.STATUS_NAMES.get(status[0], status[0])} (the engine's log says why); "
                              "the version is not finished")

    def _flush_or_abort(self, version: int) -> None:
        """Flush before a finish; a flush that fails aborts the update at once (abandoned, finished without
        a version, marked partial): the engine is never left inside it."""
        try:
            self._flush_weightsync()
        except EngineError as exc:
            self.abort(version, str(exc))
            raise

    def _concurrently(self, route: str, body: dict[str, Any], collective: Callable[[], None]) -> None:
        """POST `route` in a thread (the engine blocks in the matching NCCL call) while this side runs
        `collective`, as vLLM's trainer does; whichever fails first is reported at once (a refused request
        never waits for a peer that will not come). Any failure breaks the group: it is aborted here."""
        res = post_during(self.client, route, body, collective, timeout=self.timeout, name=f"vllm{route}")
        if not res.ok:
            self._break_group()
            res.raise_error(f"vLLM {route}")

    def _break_group(self) -> None:
        """Abort our half of the group (a pending broadcast returns); the engine's half is shut down and the
        group formed again at the next begin."""
        self._close_weightsync()
        comm, self._comm = self._comm, None
        self._group_broken = True
        self.initialized = False
        if comm is not None:
            try:
                comm.abort()
            except Exception as exc:  # already broken
                log.debug("vllm.comm_abort error=%s", exc)

    # -- EngineAdapter --

    def _close_weightsync(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            ws.close()

    def pause(self) -> None:
        self.client.post("/pause", None, params=pause_params(self.pause_mode))
        self.paused = True

    def resume(self) -> None:
        self.client.post("/resume")
        self.paused = False

    def _end_session_pause(self) -> None:
        """Resume what begin_update paused for the session itself (the caller's own pause stays)."""
        if self._session_paused:
            self._session_paused = False
            try:
                self.resume()
            except EngineError as exc:
                log.error("vllm.resume after the update failed: %s", exc)

    def begin_update(self, version: int) -> None:
        if not self.paused:
            # vLLM's layer-wise reload moves every layer to the meta device at start_weight_update: a
            # generation step inside the session would kill the engine. Pause (keep) for the session.
            self.pause()
            self._session_paused = True
        self._ensure_init()
        try:
            self.client.post("/start_weight_update", None, retry=False)
        except EngineHTTPError as exc:
            if "already active" not in exc.detail:
                raise
            # A dead agent (or a failed finish) left an update open: close it, its load is superseded.
            log.warning("vllm.update_left_open version=%s: finishing it first", version)
            self.needs_restore = True
            self.client.post("/finish_weight_update", finish_body(None), retry=False)
            self.client.post("/start_weight_update", None, retry=False)
        self.update_open = True
        self.version = version
        self.buckets_sent = 0
        self._draft, self.draft_bytes_held = [], 0
        self._release_ipc()
        log.info("vllm.begin_update version=%s backend=%s url=%s", version, self.backend, self.client.base_url)

    def load_bucket(self, tensors: NamedTensors) -> None:
        if not self.update_open:
            raise EngineError("vLLM: load_bucket outside a weight update (begin_update first)")
        if not tensors:
            raise EngineError("vLLM: cannot load an empty bucket")
        tensors, draft = split_draft(tensors)
        for name, t in draft:
            # A session loads into one model, chosen at its start: the draft's tensors wait for the draft
            # session that commit opens after the target's. They are copied (the bucket's memory is reused).
            self._draft.append((name, t.detach().clone()))
            self.draft_bytes_held += nbytes(t)
        if tensors:
            self._send(tensors)

    def _send(self, tensors: NamedTensors) -> None:
        if self.backend != "weightsync":
            tensors = aligned_order(tensors)  # vLLM's own packed formats: no padding (weightsync aligns offsets)
        names = [n for n, _ in tensors]
        shapes = [list(t.shape) for _, t in tensors]
        dtypes = [dtype_name(t.dtype) for _, t in tensors]
        if self.backend == "weightsync":
            self._weightsync_bucket(tensors)
        elif self.backend == "nccl":
            self._nccl_bucket(tensors, nccl_update_info(names, dtypes, shapes))
        else:
            self._ipc_bucket(tensors, names, dtypes, shapes)

    def _nccl_bucket(self, tensors: NamedTensors, info: dict[str, Any]) -> None:
        comm = self._comm
        if comm is None:
            raise EngineError("vLLM nccl backend: no group (init failed or broke)")

        def send() -> None:
            if not self.packed:
                for _, t in tensors:
                    comm.broadcast(t.detach().contiguous())
                return
            sizes = [nbytes(t) for _, t in tensors]
            for start, end in chunk_ranges(sizes, self.packed_buffer_size_bytes):
                part = tensors[start:end]
                need = sum(sizes[start:end])
                if self._pack_buf is None or self._pack_buf.numel() < need:
                    self._pack_buf = torch.empty(need, dtype=torch.uint8, device=comm.device)
                buf, _ = pack(part, self._pack_buf)
                comm.broadcast(buf)

        self.buckets_sent += 1  # from here on the engine's weights may be touched
        self._concurrently("/update_weights", update_body(info), send)

    def _uuid(self, d: torch.device) -> str:
        if d not in self._uuids:
            self._uuids[d] = self.ipc.uuid(d)
        return self._uuids[d]

    def _ipc_bucket(self, tensors: NamedTensors, names: list[str], dtypes: list[str],
                    shapes: list[list[int]]) -> None:
        assert self.devices
        handles: dict[str, tuple[Any, ...]] | list[dict[str, tuple[Any, ...]]]
        if self.packed:
            sizes = [nbytes(t) for _, t in tensors]
            total = sum(sizes)
            first: torch.Tensor | None = None
            handles = {}
            for d in self.devices:
                key = self._uuid(d)
                ex = self._ipc_bufs.get(key)
                if ex is None or ex.buf.numel() < total:
                    ex = _Exported(self.ipc.empty([max(total, 1)], torch.uint8, d))
                    self._ipc_bufs[key] = ex  # a new buffer: exported again below
                if first is None:
                    first, _ = pack(tensors, ex.buf)
                else:
                    ex.buf[:total].copy_(first)
                if ex.args is None:
                    ex.args = self.ipc.export(ex.buf)  # once per version and buffer, as packed_ipc_producer
                handles[key] = ex.args
            info = ipc_update_info(names, dtypes, shapes, handles, sizes)
        else:
            per_tensor: list[dict[str, tuple[Any, ...]]] = []
            for _, t in tensors:
                h = {}
                for d in self.devices:
                    copy = self.ipc.empty(list(t.shape), t.dtype, d)
                    copy.copy_(t.detach())
                    self._keep.append(copy)  # vLLM's layerwise reload may read it until finish
                    h[self._uuid(d)] = self.ipc.export(copy)
                per_tensor.append(h)
            handles = per_tensor
            info = ipc_update_info(names, dtypes, shapes, handles, None)
        self.ipc.synchronize(self.devices)
        self.buckets_sent += 1  # from here on the engine's weights may be touched
        self.client.post("/update_weights", update_body(info), retry=False)

    def _release_ipc(self, collect: bool = False) -> None:
        """Forget this version's exports (the engine released its mappings at finish) and the unpacked
        copies; buffers are kept and exported afresh for the next version. `collect`: let CUDA reclaim what
        the engine no longer maps (torch.cuda.ipc_collect, as vLLM's trainer does after a send)."""
        for ex in self._ipc_bufs.values():
            ex.args = None
        self._keep = []
        if collect and self.backend == "ipc":
            self.ipc.collect()

    def _draft_session(self, version: int) -> None:
        """Close the target's update without a version, then load the held draft tensors in a
        /start_draft_weight_update session (the one commit finishes with the version)."""
        self._flush_or_abort(version)
        self.client.post("/finish_weight_update", finish_body(None), retry=False)
        self.update_open = False
        self._release_ipc()
        log.info("vllm.draft_update version=%s tensors=%s bytes=%s", version, len(self._draft), self.draft_bytes_held)
        self.client.post("/start_draft_weight_update", None, retry=False)
        self.update_open = True
        draft, self._draft, self.draft_bytes_held = self._draft, [], 0
        try:
            self._send(draft)
        except EngineError:
            self._close_quietly(version)  # never left inside the draft session
            raise

    def _close_quietly(self, version: int) -> None:
        """Finish whatever update may still be open on the engine (best effort: vLLM closes an update
        itself when a load raised, and then refuses a finish without a start)."""
        try:
            self.client.post("/finish_weight_update", finish_body(None), retry=False)
        except EngineError as exc:
            log.info("vllm.close_after_failure version=%s: %s", version, exc)

    def commit(self, version: int) -> None:
        try:
            if self._draft:
                self.buckets_sent += 1  # the target's finish below makes the weights a new target + old draft
                self._draft_session(version)
            label, self.label_digest = version_label(version, self.label_digest), None
            self._flush_or_abort(version)
            self.client.post("/finish_weight_update", finish_body(label), retry=False)
        except EngineError:
            # Unknown whether vLLM finalized: its weights are not version N for sure, maybe mixed.
            self.update_open = False
            self.partial = version
            self.needs_restore = True
            raise
        self.update_open = False
        self.partial = None
        self.needs_restore = False
        self._release_ipc(collect=True)
        self._reset_prefix_cache(version)
        self._end_session_pause()
        log.info("vllm.commit version=%s buckets=%s engine_pack_bytes_total=%s", version, self.buckets_sent,
                 self.copied_bytes)

    def _reset_prefix_cache(self, version: int) -> None:
        """Drop KV computed with the old weights: the prefix cache, and the KV of requests frozen by the
        pause (they are preempted and recomputed with the new weights). vLLM keeps both across an update.
        A refusal is logged, never a failed version: the weights are loaded."""
        try:
            res = self.client.post("/reset_prefix_cache", None, params={"reset_running_requests": "true"})
        except EngineError as exc:
            log.warning("vllm.reset_prefix_cache version=%s failed: %s", version, exc)
            return
        if isinstance(res, dict) and res.get("success") is False:
            log.warning("vllm.reset_prefix_cache version=%s: the engine could not reset its prefix cache", version)

    def abort(self, version: int, reason: str) -> None:
        """Close the open update (finish without a version: vLLM keeps its served version string but puts
        back only the layers that got nothing) and, when a bucket reached the engine, mark the weights
        partial: the engine's version becomes `partial-<N>` and `needs_restore` is set."""
        self._draft, self.draft_bytes_held = [], 0
        touched = self.buckets_sent > 0
        log.warning("vllm.abort version=%s buckets_sent=%s reason=%s", version, self.buckets_sent, reason)
        errors: list[BaseException] = []
        if touched:
            self.partial = version
            self.needs_restore = True
        if self.update_open:
            self.update_open = False
            if self.backend == "weightsync":  # the plugin's workers: this update is given up, close it quietly
                try:
                    self.client.post("/update_weights", update_body(asdict(vllm_wire.WeightsyncUpdateInfo(abandon=True))),
                                     retry=False)
                except EngineError as exc:
                    log.info("vllm.abandon version=%s: %s", version, exc)
            try:
                self.client.post("/finish_weight_update", finish_body(None), retry=False)
            except EngineError as exc:
                # e.g. vLLM closed the update itself when update_weights raised (its layers may be left on
                # meta): only a full reload (start / all buckets / finish) repairs that.
                log.error("vllm.abort finish failed version=%s: %s", version, exc)
                self.partial = version
                self.needs_restore = True
                errors.append(exc)
        if self._group_broken:
            self._close_weightsync()
            try:  # the engine's half of the broken group; formed again at the next begin
                self.client.post("/shutdown_weight_transfer_engine", None, retry=False, timeout=30.0)
            except EngineError as exc:
                log.info("vllm.shutdown_weight_transfer_engine error=%s", exc)
        self._release_ipc(collect=True)
        if touched:
            # mixed weights: the engine stays paused (a session pause is kept) until a whole version loads
            self.client.post("/update_weight_version", weight_version_body(f"partial-{version}"))
        else:
            self._end_session_pause()
        if errors:
            raise errors[0]

    def served_version(self) -> int | None:
        if self.partial is not None:
            return None
        info = self.client.get("/weight_info")
        return parse_version(info.get("weight_version")) if isinstance(info, dict) else None

    # -- extras --

    def check_weights(self, baseline: dict[str, str] | None = None) -> Any:
        action = "compare" if baseline is not None else "checksum"
        return self.client.post("/weight_checker", weight_checker_body(action, baseline))

    def shutdown(self) -> None:
        """Release the transfer group on both sides (POST /shutdown_weight_transfer_engine)."""
        self.client.post("/shutdown_weight_transfer_engine", None, retry=False)
        self.initialized = False
        self._close_weightsync()
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.abort()

    def close(self) -> None:
        self._close_weightsync()
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.abort()
