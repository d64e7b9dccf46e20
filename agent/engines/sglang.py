"""SGLang adapter: SGLang 0.5.23's weight-update protocol over HTTP.

Protocol (SGLang 0.5.23: routes in `sglang/srt/entrypoints/http_server.py`, request types in
`sglang/srt/managers/io_struct.py`, session rules in `sglang/srt/managers/scheduler_components/
weight_updater.py`): every load runs inside a session. Per version:

    POST /pause_generation {"mode": "retract"}          (when updatePolicy.pauseGeneration)
    POST /begin_weight_update {"selector": "all"}       (400 while another session is open)
    POST /update_weights_from_distributed | /update_weights_from_tensor   per bucket, flush_cache false
    POST /end_weight_update {}                           (also when a load failed: never left open)
    POST /update_weight_version {"new_version": "<N>"}  (only after end succeeded)
    POST /flush_cache?timeout=<s>                        (once per version; a refusal is only logged)
    POST /continue_generation                            (always, also after a failure)

Every route of that list but /flush_cache declares its body `obj: Annotated[...ReqInput, Body()]`: FastAPI
refuses a request without a JSON body (SGLang answers 400 "Field required"), so a body is always sent,
`{}` where no field is needed (as SGLang's own client does). /flush_cache takes only the `timeout` query
(seconds): SGLang refuses to flush while requests run or wait, and with a timeout waits for idle first; a
refused flush does not make the loaded version fail (the radix cache may then serve prefixes computed with
the previous weights until the next flush: logged as a warning).

Engine facts (GET /server_info, read once): the release (0.5.23 and its post releases, SUPPORTED_RELEASE),
`tp_size` (must equal the job's inference TP: the weight-update group's world is 1 + tp_size, and a wrong
size would wait in the rendezvous until the timeout), `dp_size` and `pp_size` (must be 1: SGLang's
weight-update routes assert dp_size 1, and a pipeline stage holds only its layers). A mismatch is refused
before any load (EngineUnsupported, pod condition reason EngineConfigUnsupported, naming both values).

Draft weights (`draft.` tensors, base.DRAFT_PREFIX) load in the same session with `selector: draft`; the
target's with `target` when the server runs a draft model of its own, else SGLang's default `all`
(`draft_model`, docs/placement-and-transfer.md#draft-speculative--mtp-weights). SGLang resolves NEXTN to
EAGLE and /server_info reports the resolved algorithm, so MTP is told from a separate draft by the draft
path: an MTP server has none, or the target's own (`speculative_draft_model_path == model_path`).

An agent that restarts into a session a dead agent left open gets 400 "already open" from begin: it
closes that session (end) and begins again. Loads outside a session are refused by SGLang (400).

Two last hops, because a CPU tensor pickled for another container cannot be rebuilt there (its fd or
/dev/shm file does not exist in the engine's namespaces):

* `path="distributed"` (Separated placement, and any agent without a GPU): the agent is rank 0 of
  SGLang's weight-update group (`/init_weights_update_group`, world = 1 + engine TP ranks, c10d
  rendezvous on a TCPStore the agent hosts, `PrefixStore(group_name)`); per bucket it posts
  `/update_weights_from_distributed` (load_format `flattened_bucket`: names, dtypes, shapes) and
  broadcasts the bucket's bytes from rank 0; every engine TP rank receives them straight into the buffer
  it loads from (`FlattenedTensorBucket.empty`). The group's backend is gloo: NCCL refuses two ranks on
  one GPU and the agent shares the engine's GPUs; gloo receives into the engine's CUDA memory too.
* `path="tensor"` (Colocated, CUDA): the flattened bucket's CUDA IPC handle, device named by GPU UUID
  as SGLang's `monkey_patch_torch_reductions` does, one entry per engine TP rank (each rank
  deserializes only its own with SGLang's SafeUnpickler), base64 over HTTP.

Flattened buckets have no padding and SGLang refuses a tensor whose byte offset is not a multiple of its
dtype size, so a bucket is ordered by descending element size (SGLang loads by name; order is free).

SGLang cannot roll weights back: after a failed load the weights are mixed. On the distributed path SGLang
answers 400 ("partially updated"): `abort` closes the session, marks the engine's version `partial-<N>` and
sets `needs_restore`; the agent then reloads the last good version while the engine stays paused, and only
then resumes it (agent/inference/loop.py). `served_version` is None while the weights are partial.

On the tensor path SGLang does not catch a loader error: the scheduler process dies and the server with it
(its watchdog kills the process tree). There is nothing to restore into: the load raises EngineUnreachable
(reason `EngineUnreachable`), the adapter makes no further call to that engine process, and every later
call first checks the engine answers again (a restarted container: fresh weights from its checkpoint, no
session, no weight-update group), then loads into it as into a new engine.
"""

from __future__ import annotations

import base64
import datetime
import io
import itertools
import logging
import os
import re
import socket
import time
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any, Literal
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.multiprocessing import reductions

from weightsync.agent.engines.base import (
    DRAFT_PREFIX,
    EngineError,
    EngineUnsupported,
    NamedTensors,
    parse_version,
    split_draft,
    version_label,
)
from weightsync.agent.engines.http import EngineHTTPError, HttpClient
from weightsync.agent.engines.overlap import post_during
from weightsync.crds import contract

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
#: The releases whose weight-update protocol this adapter speaks: SGLang 0.5.23 and its post releases
#: (0.5.23.post1, ...), which change no route or request type. The engines tier runs 0.5.23 itself.
SUPPORTED_RELEASE = re.compile(r"0\.5\.23(\.post\d+)?")
SUPPORTED_VERSIONS = ("0.5.23", "0.5.23.postN")  # what the refusal names
#: Seconds SGLang may wait for running requests to finish before it flushes the radix cache (its
#: /flush_cache `timeout` query); past it SGLang refuses the flush, which is logged, not failed.
FLUSH_TIMEOUT = 10.0
#: The pod condition reason of a server whose parallelism the agent cannot feed.
REASON_CONFIG_UNSUPPORTED = "EngineConfigUnsupported"
#: How long a tensor-path load failure with no HTTP answer is confirmed by probing /health.
DEATH_PROBE_SECONDS = 3.0
GROUP_NAME = "weightsync"
_GROUP_SEQ = itertools.count()
SessionPath = Literal["tensor", "distributed"]
PauseMode = Literal["abort", "retract", "in_place"]
#: Which of SGLang's runners a load goes to. "all" (SGLang's default) hands the tensors to the target and,
#: if the server runs one, the draft runner, each picking the names it knows (how MTP layers and shared
#: embeddings reach a draft); "draft" reaches only the draft model (the job's `draft.` tensors).
Selector = Literal["target", "draft", "all"]
LOAD_FORMAT = "flattened_bucket"
_DEVICE_ARG = 6  # index of the device in torch's rebuild_cuda_tensor args (SGLang patches the same slot)


def aligned_order(tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    """The bucket ordered by descending element size (stable), so that every tensor's byte offset in an
    unpadded flattened bucket is a multiple of its element size (SGLang's FlattenedTensorBucket rule)."""
    return sorted(tensors, key=lambda nt: -nt[1].element_size())


def flatten(tensors: NamedTensors, out: torch.Tensor | None = None) -> tuple[torch.Tensor, list[SimpleNamespace]]:
    """Concatenate the tensors' bytes (in `aligned_order`) into one uint8 tensor, reusing `out` when it is
    large enough, and return it with FlattenedTensorBucket metadata."""
    if not tensors:
        raise EngineError("SGLang: cannot load an empty bucket")
    tensors = aligned_order(tensors)
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
    flush_cache: bool = False,
    abort_all_requests: bool = False,
    weight_version: str | None = None,
    load_format: str | None = LOAD_FORMAT,
    selector: Selector = "all",
) -> dict[str, Any]:
    """The JSON body of POST /update_weights_from_tensor (UpdateWeightsFromTensorReqInput)."""
    return {
        "serialized_named_tensors": serialized_named_tensors,
        "load_format": load_format,
        "flush_cache": flush_cache,
        "abort_all_requests": abort_all_requests,
        "weight_version": weight_version,
        "selector": selector,
    }


def update_weights_from_distributed_body(
    meta: Sequence[SimpleNamespace],
    *,
    group_name: str = GROUP_NAME,
    flush_cache: bool = False,
    weight_version: str | None = None,
    selector: Selector = "all",
) -> dict[str, Any]:
    """UpdateWeightsFromDistributedReqInput for one flattened bucket (load_format flattened_bucket)."""
    return {
        "names": [m.name for m in meta],
        "dtypes": [str(m.dtype).removeprefix("torch.") for m in meta],
        "shapes": [list(m.shape) for m in meta],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "abort_all_requests": False,
        "weight_version": weight_version,
        "load_format": LOAD_FORMAT,
        "selector": selector,
    }


def init_group_body(master_address: str, master_port: int, world_size: int, *, group_name: str = GROUP_NAME,
                    backend: str = "gloo") -> dict[str, Any]:
    """InitWeightsUpdateGroupReqInput: the engine's TP rank r joins as rank rank_offset + r."""
    return {"master_address": master_address, "master_port": master_port, "rank_offset": 1,
            "world_size": world_size, "group_name": group_name, "backend": backend}


def begin_body(selector: str = "all") -> dict[str, Any]:
    """BeginWeightUpdateReqInput."""
    return {"selector": selector}


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


def end_body() -> dict[str, Any]:
    """EndWeightUpdateReqInput: no field needed, but the route requires a JSON body."""
    return {}


def destroy_group_body(group_name: str) -> dict[str, Any]:
    """DestroyWeightsUpdateGroupReqInput."""
    return {"group_name": group_name}


class EngineUnreachable(EngineError):
    """The engine process is gone (SGLang's tensor path: a loader error kills the scheduler and the server).
    Nothing was restored; the engine must restart before anything loads again."""

    reason = contract.REASON_ENGINE_UNREACHABLE


def supported(version: str) -> bool:
    return SUPPORTED_RELEASE.fullmatch(version.strip()) is not None


def check_version(version: str) -> str:
    """Refuse an SGLang release whose weight-update protocol this adapter does not speak."""
    if not supported(version):
        raise EngineUnsupported(f"SGLang {version or '(unknown version)'} is not supported: weightsync speaks the weight-"
                                f"update protocol of SGLang {' and '.join(SUPPORTED_VERSIONS)}; run a supported "
                                f"image (e.g. lmsysorg/sglang:v{SGLANG_VERSION})")
    return version


def check_topology(info: dict[str, Any], tp_size: int) -> None:
    """Refuse a server whose parallelism the agent cannot feed (GET /server_info's resolved values): its TP
    size must be the job's (the weight-update group is 1 + tp_size ranks; another size never completes
    the rendezvous), and it must run one data-parallel replica and one pipeline stage. Fields a server does
    not report are not checked."""
    problems = []
    got = info.get("tp_size")
    if got is not None and int(got) != tp_size:
        problems.append(f"the server runs tp_size={got} but the job's inference parallelism.tensor is {tp_size}; "
                        f"set spec.inference.parallelism.tensor to {got} or start SGLang with --tp-size {tp_size}")
    for key, flag in (("dp_size", "--dp-size"), ("pp_size", "--pp-size")):
        got = info.get(key)
        if got is not None and int(got) > 1:
            problems.append(f"the server runs {key}={got} but weightsync loads one TP group per server "
                            f"({key} must be 1); run one SGLang server per replica without {flag}")
    if problems:
        err = EngineUnsupported("SGLang configuration not supported: " + "; ".join(problems))
        err.reason = REASON_CONFIG_UNSUPPORTED  # the pod condition's reason (the release itself is supported)
        raise err


def separate_draft(info: dict[str, Any]) -> bool:
    """Whether the server runs a draft model with weights of its own (GET /server_info, resolved values).
    SGLang resolves NEXTN to EAGLE before it reports, so the algorithm alone does not tell MTP (the draft
    layers are in the target's checkpoint, picked up by the draft runner from selector "all") from a
    separate draft: the draft path does. MTP has none or the target's own path."""
    algo = info.get("speculative_algorithm")
    if not algo or str(algo).upper() in ("NEXTN", "NGRAM"):
        return False
    draft = info.get("speculative_draft_model_path")
    return bool(draft) and draft != info.get("model_path")


class _SenderGroup:
    """Rank 0 of SGLang's weight-update group, formed exactly as the engine forms its side
    (`init_custom_process_group`): the c10d store the engine's tcp:// rendezvous reaches, `PrefixStore(
    group_name)`, then torch's process-group helper with the same group name, so every store key matches.

    The store listens only on `host` (the engine URL's host: 127.0.0.1 in a real pod, so nothing outside
    the pod reaches it; SGLang's rendezvous carries no credentials). The socket is bound here and handed
    to the store, which also avoids a free-port race."""

    def __init__(self, host: str, world_size: int, group_name: str, timeout: float) -> None:
        self.host, self.world_size = host, world_size
        self.group_name = group_name
        self.timeout = datetime.timedelta(seconds=timeout)
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.bind((host, 0))
        self._sock.listen(max(16, world_size))
        self.port = int(self._sock.getsockname()[1])
        self._handed = False
        self.pg: Any = None

    def join(self) -> None:
        """Blocks until every engine rank joined (they do inside /init_weights_update_group)."""
        from torch.distributed import distributed_c10d as c10d

        self._handed = True  # the store owns the listening socket from here on
        store = dist.TCPStore(self.host, self.port, self.world_size, True, timeout=self.timeout,
                              wait_for_workers=True, master_listen_fd=self._sock.fileno())
        pg, _ = c10d._new_process_group_helper(
            self.world_size, 0, [], c10d.Backend("gloo"), c10d.PrefixStore(self.group_name, store),
            group_name=c10d.GroupName(self.group_name), backend_options=None, timeout=self.timeout)
        c10d._world.pg_group_ranks[pg] = {i: i for i in range(self.world_size)}
        self.pg = pg

    def broadcast(self, flat: torch.Tensor) -> None:
        dist.broadcast(flat, src=0, group=self.pg)

    def close(self) -> None:
        if self.pg is not None:
            try:
                dist.destroy_process_group(self.pg)
            except Exception as exc:  # already broken: nothing left to free
                log.debug("sglang.group_destroy error=%s", exc)
        self.pg = None
        if not self._handed:
            self._sock.close()


class SGLangAdapter:
    """EngineAdapter for an SGLang server (one replica: `tp_size` ranks behind one HTTP endpoint).

    `path`: "distributed" (the agent broadcasts each bucket into the engine's ranks) or "tensor" (CUDA IPC
    handles; `devices` are the GPUs of the engine's TP ranks in rank order, each rank's copy goes there).
    """

    def __init__(
        self,
        url: str,
        *,
        tp_size: int = 1,
        path: SessionPath = "distributed",
        devices: Sequence[torch.device | str] | None = None,
        pause_mode: PauseMode = "retract",
        client: HttpClient | None = None,
        timeout: float = 300.0,
        group_host: str | None = None,
    ) -> None:
        if devices is not None and len(devices) != tp_size:
            raise EngineError(f"SGLang: {len(devices)} devices given for tp_size={tp_size}; give one per TP rank")
        self.client = client or HttpClient(url, "SGLang", timeout=timeout)
        self.tp_size = tp_size
        self.path: SessionPath = path
        self.devices = [torch.device(d) for d in devices] if devices is not None else None
        if path == "tensor" and not all(d.type == "cuda" for d in self.devices or []):
            raise EngineError("SGLang path 'tensor' needs the engine's GPUs (CUDA IPC): a CPU tensor cannot be "
                              "rebuilt in the engine's container; use path 'distributed'")
        self.pause_mode: PauseMode = pause_mode
        self.timeout = timeout
        self.group_host = group_host or urlparse(self.client.base_url).hostname or "127.0.0.1"
        self.partial: int | None = None
        self.needs_restore = False
        self.session_open = False
        self.loaded_buckets = 0
        self._group: _SenderGroup | None = None
        self._flat: torch.Tensor | None = None
        self._bufs: dict[int, torch.Tensor] = {}
        self._info: dict[str, Any] | None = None  # GET /server_info, read once per engine process
        #: the engine process died under a load (tensor path): no call reaches it until it answers again
        self.engine_lost = False
        self._version: int | None = None
        #: the content digest of the version being committed (set by the fetch once every piece was checked):
        #: the engine's label becomes `<N>-<digest prefix>`
        self.label_digest: str | None = None

    # -- engine facts --

    def server_info(self) -> dict[str, Any]:
        """GET /server_info, read once per engine process (its values are the resolved startup ones)."""
        if self._info is None:
            info = self.client.get("/server_info")
            self._info = info if isinstance(info, dict) else {}
        return self._info

    def engine_version(self) -> str:
        """The engine's release (GET /server_info `version`)."""
        return str(self.server_info().get("version", ""))

    def check_engine_version(self) -> str:
        """The release and the parallelism this adapter can drive, else EngineUnsupported (reported on the pod,
        no load attempted)."""
        version = check_version(self.engine_version())
        check_topology(self.server_info(), self.tp_size)
        return version

    def draft_model(self) -> bool:
        """Whether the server runs a draft model with weights of its own (EAGLE, EAGLE3, STANDALONE with a
        draft path other than the model's): then the target's tensors go with selector "target" (SGLang's
        draft loaders map a target name they also have, such as layer 0, onto the draft) and `draft.` tensors
        with "draft". Without one, or with MTP (NEXTN, reported resolved as EAGLE; its layers are named as in
        the target's checkpoint and picked up by the draft runner from "all"), every tensor goes with "all",
        SGLang's default (`separate_draft`)."""
        return separate_draft(self.server_info())

    def _speculative(self) -> str:
        info = self.server_info()
        return (f"speculative_algorithm={info.get('speculative_algorithm')!r}, "
                f"speculative_draft_model_path={info.get('speculative_draft_model_path')!r}")

    # -- a dead engine (tensor path) --

    def _answers(self) -> bool:
        """Does an engine process answer HTTP at all? (GET /model_info: answered by SGLang's HTTP process alone;
        its /health may run a generation and take up to its 20 s timeout.)"""
        try:
            self.client.get("/model_info", retry=False, timeout=2.0)
            return True
        except EngineHTTPError as exc:
            return exc.status is not None

    def _lost(self, route: str, exc: EngineHTTPError) -> bool:
        """After a call that got no HTTP answer: is the engine process gone? (probed for DEATH_PROBE_SECONDS)"""
        if exc.status is not None:
            return False
        deadline = time.monotonic() + DEATH_PROBE_SECONDS
        while time.monotonic() < deadline:
            if self._answers():
                return False
            time.sleep(0.2)
        return True

    def _engine_died(self, route: str, exc: EngineHTTPError) -> EngineUnreachable:
        self.engine_lost = True
        self.session_open = False
        self._info = None  # a restarted engine is asked again
        group, self._group = self._group, None
        if group is not None:
            group.close()  # the engine's half died with it
        msg = (f"SGLang engine at {self.client.base_url} died during {route} of version {self._version} "
               f"({exc.detail}): SGLang's tensor path does not catch a loader error, its scheduler exits and the "
               "server with it. Nothing was restored: the engine container must restart (e.g. a liveness probe "
               "on /health), then the newest version is loaded into it")
        log.error("sglang.engine_died %s", msg)
        return EngineUnreachable(msg)

    def _check_alive(self) -> None:
        """Before touching an engine that died: it must answer again (a restarted process)."""
        if not self.engine_lost:
            return
        if not self._answers():
            raise EngineUnreachable(f"SGLang engine at {self.client.base_url} is gone (it died under a load of "
                                    f"version {self.partial}) and does not answer yet; nothing was restored")
        log.warning("sglang.engine_back url=%s: a new engine process (no session, no weight-update group)",
                    self.client.base_url)
        self.engine_lost = False

    # -- EngineAdapter --

    def pause(self) -> None:
        self._check_alive()
        self.client.post("/pause_generation", pause_body(self.pause_mode))

    def resume(self) -> None:
        if self.engine_lost and not self._answers():
            # nothing to resume: the paused process is gone, and a restarted one starts unpaused
            log.warning("sglang.resume_skipped url=%s: the engine process died", self.client.base_url)
            return
        self._check_alive()
        self.client.post("/continue_generation", continue_body())

    def begin_update(self, version: int) -> None:
        self._check_alive()
        self._version = version
        # learnt once, before the first session: which selector the target's tensors take, and whether the
        # engine's TP size is the one the group is formed for (else the rendezvous could never complete)
        check_topology(self.server_info(), self.tp_size)
        if self.path == "distributed":
            self._ensure_group()
        try:
            self.client.post("/begin_weight_update", begin_body(), retry=False)
        except EngineHTTPError as exc:
            if exc.status != 400 or "already open" not in exc.detail:
                raise
            # A dead agent left its session open: close it (its partial load is superseded) and begin again.
            log.warning("sglang.session_left_open version=%s: closing it first", version)
            self.needs_restore = True
            self.client.post("/end_weight_update", end_body(), retry=False)
            self.client.post("/begin_weight_update", begin_body(), retry=False)
        self.session_open = True
        self.loaded_buckets = 0
        log.info("sglang.begin_update version=%s path=%s url=%s", version, self.path, self.client.base_url)

    def load_bucket(self, tensors: NamedTensors) -> None:
        if not self.session_open:
            raise EngineError("SGLang: load_bucket outside a weight-update session (begin_update first)")
        target, draft = split_draft(tensors)
        if draft and not self.draft_model():
            raise EngineError(f"SGLang: {len(draft)} draft tensors ({DRAFT_PREFIX}{draft[0][0]}, ...) but the server runs "
                              f"no separate draft model (server_info {self._speculative()}); they would be "
                              "dropped: start SGLang with a draft model or publish no draft.* tensors")
        self.loaded_buckets += 1  # from here on the engine's weights may be touched
        parts: tuple[tuple[list[tuple[str, torch.Tensor]], Selector], ...] = (
            (target, "target" if self.draft_model() else "all"), (draft, "draft"))
        for part, selector in parts:
            if not part:
                continue
            flat, meta = flatten(part, self._flat)
            if self._flat is None or flat.numel() > self._flat.numel():
                self._flat = flat  # reused for the next part: the request returns only after the load
            if self.path == "distributed":
                self._broadcast_bucket(flat, meta, selector)
            else:
                self._ipc_bucket(flat, meta, selector)

    def _ipc_bucket(self, flat: torch.Tensor, meta: list[SimpleNamespace], selector: Selector) -> None:
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
        route = "/update_weights_from_tensor"
        try:
            self.client.post(route, update_weights_from_tensor_body(per_rank, selector=selector), retry=False)
        except EngineHTTPError as exc:
            if self._lost(route, exc):
                raise self._engine_died(route, exc) from exc
            raise

    def _ensure_group(self) -> None:
        if self._group is not None:
            return
        # A fresh name per group: torch refuses a second group of the same name in a process (engine and agent)
        name = f"{GROUP_NAME}-{os.getpid()}-{next(_GROUP_SEQ)}"
        group = _SenderGroup(self.group_host, 1 + self.tp_size, name, self.timeout)
        body = init_group_body(group.host, group.port, group.world_size, group_name=name)
        self._call_while(lambda: group.join(), "/init_weights_update_group", body)
        self._group = group
        log.info("sglang.group_ready host=%s port=%s world_size=%s backend=gloo", group.host, group.port,
                 group.world_size)

    def _broadcast_bucket(self, flat: torch.Tensor, meta: list[SimpleNamespace], selector: Selector) -> None:
        assert self._group is not None
        group = self._group
        cpu = flat if flat.device.type == "cpu" else flat.cpu()
        self._call_while(lambda: group.broadcast(cpu), "/update_weights_from_distributed",
                         update_weights_from_distributed_body(meta, group_name=group.group_name, selector=selector))

    def _call_while(self, collective: Any, route: str, body: dict[str, Any]) -> None:
        """POST `route` (the engine then blocks in the collective) while this side runs `collective`."""
        res = post_during(self.client, route, body, collective, timeout=self.timeout, name=f"sglang{route}")
        if res.ok:
            return
        if res.collective_error is not None or not res.collective_done or route == "/init_weights_update_group":
            self._drop_group()  # the group is out of step with the engine: form a new one next time
        res.raise_error(f"SGLang {route}")

    def _drop_group(self) -> None:
        """Forget the group on both sides (the engine's half is destroyed best-effort)."""
        group, self._group = self._group, None
        if group is None:
            return
        group.close()
        try:
            self.client.post("/destroy_weights_update_group", destroy_group_body(group.group_name), retry=False,
                             timeout=10.0)
        except EngineError as exc:
            log.info("sglang.destroy_group group=%s error=%s", group.group_name, exc)

    def _end_session(self) -> None:
        if self.session_open:
            self.session_open = False
            self.client.post("/end_weight_update", end_body(), retry=False)

    def flush_cache(self, version: int | str) -> bool:
        """Flush SGLang's radix cache, waiting up to FLUSH_TIMEOUT for running requests to finish. A refusal
        (requests still running, another flush under way) or no answer is logged, never raised: the version is
        loaded and labelled whatever the flush does."""
        try:
            self.client.post("/flush_cache", None, params={"timeout": FLUSH_TIMEOUT}, retry=False,
                             timeout=FLUSH_TIMEOUT + self.timeout)
            return True
        except EngineError as exc:
            log.warning("sglang.flush_cache_refused version=%s error=%s: the version is loaded; the radix cache may "
                        "serve prefixes computed with the previous weights until SGLang flushes it", version, exc)
            return False

    def commit(self, version: int) -> None:
        self._end_session()
        label, self.label_digest = version_label(version, self.label_digest), None
        self.client.post("/update_weight_version", weight_version_body(label), retry=False)
        self.partial = None
        self.needs_restore = False
        self.flush_cache(label)

    def abort(self, version: int, reason: str) -> None:
        touched = self.loaded_buckets > 0
        log.warning("sglang.abort version=%s buckets_loaded=%s reason=%s", version, self.loaded_buckets, reason)
        if self.engine_lost:  # the session, the weights and the version label died with the engine process
            self.partial = version
            self.needs_restore = True
            return
        try:
            self._end_session()
        finally:
            if touched:
                self.partial = version
                self.needs_restore = True
                self.client.post("/update_weight_version", weight_version_body(f"partial-{version}"), retry=False)

    def served_version(self) -> int | None:
        if self.partial is not None or self.engine_lost:
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

    def close(self) -> None:
        if self.engine_lost:
            group, self._group = self._group, None
            if group is not None:
                group.close()
            return
        self._drop_group()
