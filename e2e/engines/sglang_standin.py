"""A stand-in SGLang 0.5.23 server: SGLang's own HTTP app in front of SGLang's own weight-update code.

It runs as the engine container of a local-cluster job (`python -m weightsync.e2e.engines.sglang_standin`)
and in the `engines` test tier, under the engine venv's python (e2e/engine_venv.py: SGLang's wheel with
the torch, FastAPI and uvicorn it runs on). Started with another python, it re-executes itself with that
one (`main`), so a container command `python -m weightsync.e2e.engines.sglang_standin` works unchanged.

What answers HTTP is SGLang's own FastAPI app, `sglang.srt.entrypoints.http_server.app`, served by uvicorn
(lifespan off: the app's lifespan wants the multi-tokenizer shared memory of a full launch). Its routes,
request parsing and validation (a weight-update route without a JSON body is refused 400 "Field
required"), error handlers, status codes and response bodies are SGLang's. /server_info and /model_info
report a real, resolved `ServerArgs` (`--tp-size`, `--dp-size`, `--pp-size`, `--speculative-algorithm`:
SGLang resolves NEXTN to EAGLE itself) over a tiny model config written at start.

Only the tokenizer manager behind the app is a substitute (`StandinTokenizerManager`): where SGLang's
sends a request to its scheduler processes, this one hands it to SGLang's own scheduler-side code run
in-process: `SchedulerWeightUpdaterManager` (session rules: loads only between begin and end, one session
at a time), `WeightUpdater` (the rendezvous and `PrefixStore(group_name)` of init_custom_process_group,
the flattened-bucket broadcast receive, SafeUnpickler deserialization of tensor payloads) and
`SchedulerFlushWrapper` (/flush_cache refused while requests run; with `timeout` it waits for idle).
An exception escaping that code kills the server, as an uncaught error kills SGLang's scheduler and its
watchdog the server (SGLang's tensor path does not catch a loader error; its distributed path answers
400 "partially updated"). The model is a stand-in too: a named set of tensors (the demo model's unless told
otherwise) whose loader refuses unknown names, shapes and dtypes the way a real model's `load_weights` does.

Observability for tests (not SGLang routes, under /standin/): `state` (weight version, paused, session,
loads), `events` (every POST in order, with its status), `checksums` (sha256 of every weight, as the demo
trainer's), `lora`; `POST /standin/requests {"running": N}` makes N requests run (until paused), so that
SGLang's flush rules can be exercised. Fault injection: `--fail-load SESSION:BUCKET` (1-based) makes the
BUCKET-th bucket load of the SESSION-th weight-update session write half of its tensors and then fail,
once, as a real loader that raises mid-bucket does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import logging
import os
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import sglang_code

log = logging.getLogger("weightsync.sglang_standin")

#: Set in the environment to run under the current python (no re-exec into the engine venv).
ENV_HERE = "WEIGHTSYNC_STANDIN_HERE"
#: The exit status of a server whose scheduler died (SGLang's watchdog kills the process tree).
SCHEDULER_DIED = 70
#: The MTP layers' names in the stand-in (a DeepSeek-style checkpoint carries them beside the target's).
MTP_PREFIX = "mtp."


def checksums(named: Any) -> dict[str, str]:
    from weightsync.agent.layout.shards import checksums as sums

    return sums(named)


class StandinModel:
    """The model behind the loader: name -> tensor. load_weights copies like SGLang's default loader
    (`param.data.copy_(loaded)`), refusing what a real model would refuse."""

    def __init__(self, params: dict[str, torch.Tensor], faults: Faults, *, skip_unknown: bool = False,
                 skip: Callable[[str], bool] = lambda name: False) -> None:
        self.params = params
        self.faults = faults
        self.skip_unknown = skip_unknown  # a draft model's loader skips names it has not (llama_eagle3.py)
        self.skip = skip  # names a target loader passes over (a DeepSeek target: its MTP layers)
        self.lock = threading.Lock()

    def modules(self) -> list[Any]:
        return []

    def load_weights(self, named: Any) -> None:
        named = list(named)
        fail = self.faults.should_fail()
        for i, (name, t) in enumerate(named):
            if fail and i >= max(1, len(named) // 2):
                raise RuntimeError(f"injected load failure in bucket after {i} of {len(named)} tensors")
            if self.skip(name):
                continue
            p = self.params.get(name)
            if p is None and self.skip_unknown:
                continue
            if p is None:
                raise KeyError(f"{name} is not a parameter of this model")
            if tuple(p.shape) != tuple(t.shape) or p.dtype != t.dtype:
                raise ValueError(f"{name}: got {tuple(t.shape)} {t.dtype}, the model has {tuple(p.shape)} {p.dtype}")
            with self.lock:
                p.copy_(t.to(p.device))


class Faults:
    def __init__(self, session: int | None, bucket: int | None) -> None:
        self.session, self.bucket = session, bucket
        self.sessions = 0
        self.loads = 0
        self.fired = False

    def begin(self) -> None:
        self.sessions += 1
        self.loads = 0

    def should_fail(self) -> bool:
        self.loads += 1
        if self.fired or self.session is None:
            return False
        if self.sessions == self.session and self.loads == self.bucket:
            self.fired = True
            return True
        return False


def demo_params(hidden: int) -> dict[str, torch.Tensor]:
    from weightsync.agent.demo.model import DemoModel

    return {n: torch.zeros_like(t) for n, t in DemoModel(hidden).state_dict().items()}


class Engine:
    """SGLang's scheduler-side weight-update code wired to the stand-in model (one TP rank).

    `draft`: "eagle3" (a draft model with weights of its own: SGLang's manager fans "all" out to both
    runners and sends "draft" to the draft only) or "mtp" (MTP layers named as in the target's checkpoint,
    `mtp.*`: the target's loader passes over them and the draft runner takes them from "all")."""

    def __init__(self, params: dict[str, torch.Tensor], faults: Faults, device: str = "cpu",
                 draft_params: dict[str, torch.Tensor] | None = None, draft: str | None = None) -> None:
        if not dist.is_initialized():  # SGLang's scheduler barriers on its TP CPU group
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.draft_kind = draft if draft_params is not None else None
        skip = (lambda n: n.startswith(MTP_PREFIX)) if self.draft_kind == "mtp" else (lambda n: False)
        self.model = StandinModel(params, faults, skip=skip)
        self.faults = faults
        ru = sglang_code.runner_updater()
        self.runner = ru.WeightUpdater(
            tp_rank=0, device=device, gpu_id=0, model_config=None, custom_weight_loaders={},
            get_model=lambda: self.model, update_model_fields=lambda **_: None, recapture_cuda_graph=lambda: None,
            get_model_runner=lambda: None)
        runner = types.SimpleNamespace(weight_updater=self.runner)
        self.worker = types.SimpleNamespace(
            model_runner=runner, weight_update_runners=lambda: [("target", runner)],
            deserialize_own_rank=lambda s: sglang_code.deserialize_own_rank(s, 0),
            init_weights_update_group=self._init_group, destroy_weights_update_group=self._destroy_group)
        self.draft: StandinModel | None = None
        draft_worker = None
        if draft_params is not None:
            self.draft = StandinModel(draft_params, Faults(None, None), skip_unknown=True)
            draft_model = self.draft
            draft_updater = ru.WeightUpdater(
                tp_rank=0, device=device, gpu_id=0, model_config=None, custom_weight_loaders={},
                get_model=lambda: draft_model, update_model_fields=lambda **_: None,
                recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)
            draft_runner = types.SimpleNamespace(weight_updater=draft_updater)
            draft_worker = types.SimpleNamespace(weight_update_runners=lambda: [("draft", draft_runner)])
        self.version: str | None = None
        self.loras: dict[str, dict[str, torch.Tensor]] = {}
        self.paused = False
        self.pause_mode = "abort"
        self.running = 0  # requests running (POST /standin/requests): SGLang flushes only when idle
        self.flushes = 0
        self.events: list[dict[str, Any]] = []
        self.manager = sglang_code.scheduler_updater().SchedulerWeightUpdaterManager(
            tp_worker=self.worker, draft_worker=draft_worker, memory_saver_adapter=None, flush_cache=self._flush,
            is_fully_idle=lambda **_: self.idle(), scheduler=types.SimpleNamespace(
                record_weight_version_change=self._record))
        self.lock = threading.Lock()  # the scheduler handles one control request at a time

    def idle(self) -> bool:
        """The scheduler's is_fully_idle(ignore_waiting=paused): a pause that retracts or aborts leaves nothing
        running; one in place keeps its requests."""
        return self.running == 0 or (self.paused and self.pause_mode != "in_place")

    def lora(self, route: str, req: Any) -> tuple[bool, str | None]:
        """SGLang's adapter registry rules (tokenizer_control_mixin / lora_manager): a name loads once until
        unloaded; the payload is rebuilt by SGLang's own deserializer and, with expected_checksums, each
        tensor's sha256 is checked before anything loads (tp_worker.load_lora_adapter_from_tensors)."""
        name = req.lora_name
        if route == "/unload_lora_adapter":
            if self.loras.pop(name, None) is None:
                return False, f"LoRA adapter {name} is not loaded"
            return True, None
        if name in self.loras:
            return False, f"Failed to load LoRA adapter {name} because it is already loaded"
        data = sglang_code.deserialize_own_rank(req.serialized_named_tensors, 0)
        tensors = dict(data)
        if req.expected_checksums is not None:
            got = checksums(tensors.items())
            bad = sorted(n for n, want in req.expected_checksums.items() if got.get(n) != want)
            extra = sorted(set(tensors) - set(req.expected_checksums))
            if bad or extra:
                return False, f"[LORA-CHECK] adapter sync MISMATCH: {bad[:5]} differ or are missing, {extra[:5]} extra"
        self.loras[name] = {n: t.clone() for n, t in tensors.items()}
        return True, None

    def _init_group(self, req: Any) -> tuple[bool, str]:
        return self.runner.init_weights_update_group(req.master_address, req.master_port, req.rank_offset,
                                                     req.world_size, req.group_name, backend=req.backend)

    def _destroy_group(self, req: Any) -> tuple[bool, str]:
        return self.runner.destroy_weights_update_group(req.group_name)

    def _flush(self, empty_cache: bool = False) -> bool:
        if not self.idle():
            return False
        self.flushes += 1
        return True

    def _record(self, new_version: str | None) -> None:
        if new_version is not None:
            self.version = new_version

    def event(self, op: str, **detail: Any) -> None:
        self.events.append({"op": op, "t": time.time(), **detail})

    def session_open(self) -> bool:
        return self.manager._session is not None

    def state(self) -> dict[str, Any]:
        return {"weight_version": self.version, "paused": self.paused, "session_open": self.session_open(),
                "sglang": sglang_code.version(), "sessions": self.faults.sessions, "running": self.running,
                "flushes": self.flushes}


def lora_checksums(engine: Engine) -> dict[str, Any]:
    with engine.model.lock:
        return {"version": engine.version,
                "adapters": {name: checksums(sorted(t.items())) for name, t in engine.loras.items()}}


def checksums_of(engine: Engine) -> dict[str, Any]:
    from weightsync.agent.engines.base import parse_version

    with engine.model.lock:
        sums = checksums(sorted(engine.model.params.items()))
    if engine.draft is not None:
        prefix = "draft." if engine.draft_kind == "eagle3" else ""  # MTP layers: the checkpoint's own names
        with engine.draft.lock:
            sums.update(checksums((f"{prefix}{n}", t) for n, t in sorted(engine.draft.params.items())))
    v = engine.version
    n = parse_version(v)  # the agent labels a version `N-<digest prefix>`
    return {"version": v if n is None else n, "label": v, "checksums": sums}


# ---------------- SGLang's HTTP app, with a substitute tokenizer manager ----------------

#: What the route being served learnt from the scheduler side (the event the middleware records).
_CALL: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("standin_call", default=None)


def _note(**detail: Any) -> None:
    call = _CALL.get()
    if call is not None:
        call.update(handled=True, **detail)


def _scheduler_died(what: str, exc: BaseException) -> None:
    """An exception escaped SGLang's scheduler-side code: SGLang's scheduler process would exit and its
    watchdog take the server down (kill_process_tree). So does the stand-in."""
    log.error("scheduler died in %s: %s: %s; the server exits (as SGLang's watchdog kills it)", what,
              type(exc).__name__, exc)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(SCHEDULER_DIED)


class StandinTokenizerManager:
    """What SGLang's HTTP routes call on `_global_state.tokenizer_manager`, for the weight-update path.

    SGLang's TokenizerManager sends each request to its scheduler processes; this one runs SGLang's
    scheduler-side code (Engine) in a worker thread, one request at a time. The config plumbing is
    SGLang's own (`config_value`, `record_config_updates`, `_update_weight_version_if_provided`), so
    /model_info reports the weight version the way SGLang does."""

    def __init__(self, engine: Engine, server_args: Any, model_config: Any) -> None:
        from sglang.srt.managers.io_struct import FlushCacheReqInput
        from sglang.srt.managers.scheduler_components.flush_wrapper import SchedulerFlushWrapper
        from sglang.srt.managers.tokenizer_manager import ServerStatus
        from sglang.srt.runtime_context import get_model, get_serving

        self.engine = engine
        self.server_args = server_args
        self.model_config = model_config
        self.model_path = get_model().model_path
        self.served_model_name = get_serving().served_model_name
        self.is_generation = model_config.is_generation
        self.gracefully_exit = False
        self.server_status = ServerStatus.Up
        self.startup_time = time.time()
        self.last_receive_tstamp = time.time()
        self.rid_to_state: dict[str, Any] = {}
        self.is_pause = False
        self.initial_weights_loaded = True
        self._flush_req = FlushCacheReqInput
        self._flushed: list[Any] = []
        self._flush_wrapper = SchedulerFlushWrapper(
            flush_cache=lambda: engine._flush(), is_fully_idle=engine.idle,
            send_output=lambda out, req: self._flushed.append(out))

    # SGLang's own config plumbing, called as methods of this manager
    def config_value(self, name: str) -> Any:
        from sglang.srt.managers.tokenizer_manager import TokenizerManager

        return TokenizerManager.config_value(self, name)

    def record_config_updates(self, source: str, **fields: Any) -> None:
        from sglang.srt.managers.tokenizer_manager import TokenizerManager

        TokenizerManager.record_config_updates(self, source, **fields)

    def _update_weight_version_if_provided(self, weight_version: str | None) -> None:
        from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin

        TokenizerControlMixin._update_weight_version_if_provided(self, weight_version)

    def is_healthy(self) -> bool:
        return True

    def is_ready(self) -> bool:
        return not self.is_pause

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        if abort_all:
            self.engine.running = 0

    def auto_create_handle_loop(self) -> None:
        return None

    async def _run(self, what: str, fn: Callable[[], Any]) -> Any:
        def call() -> Any:
            with self.engine.lock:
                try:
                    return fn()
                except BaseException as exc:
                    _scheduler_died(what, exc)
                    raise

        return await asyncio.to_thread(call)

    async def _session_call(self, what: str, method: Callable[[Any], Any], obj: Any) -> tuple[bool, str]:
        out = await self._run(what, lambda: method(obj))
        _note(message=out.message)
        return bool(out.success), str(out.message)

    async def get_internal_state(self) -> list[dict[str, Any]]:
        return [{"weight_version": self.engine.version, "paused": self.is_pause}]

    async def pause_generation(self, obj: Any) -> None:
        self.is_pause = self.engine.paused = True
        self.engine.pause_mode = obj.mode
        _note()

    async def continue_generation(self, obj: Any) -> None:
        self.is_pause = self.engine.paused = False
        _note()

    async def begin_weight_update(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        ok, msg = await self._session_call("begin_weight_update", self.engine.manager.begin_weight_update, obj)
        if ok:
            self.engine.faults.begin()
        return ok, msg

    async def end_weight_update(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        return await self._session_call("end_weight_update", self.engine.manager.end_weight_update, obj)

    async def init_weights_update_group(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        return await self._session_call("init_weights_update_group", self.engine.manager.init_weights_update_group,
                                        obj)

    async def destroy_weights_update_group(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        return await self._session_call("destroy_weights_update_group",
                                        self.engine.manager.destroy_weights_update_group, obj)

    async def update_weights_from_distributed(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        ok, msg = await self._session_call("update_weights_from_distributed",
                                           self.engine.manager.update_weights_from_distributed, obj)
        if ok and obj.weight_version is not None:
            self._update_weight_version_if_provided(obj.weight_version)
        return ok, msg

    async def update_weights_from_tensor(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        ok, msg = await self._session_call("update_weights_from_tensor",
                                           self.engine.manager.update_weights_from_tensor, obj)
        if ok and obj.weight_version is not None:
            self._update_weight_version_if_provided(obj.weight_version)
        return ok, msg

    async def update_weight_version(self, obj: Any) -> None:
        await self._run("update_weight_version", lambda: self.engine._record(obj.new_version))
        self._update_weight_version_if_provided(obj.new_version)
        _note(message=f"Weight version updated to {obj.new_version}")

    async def flush_cache(self, timeout_s: float | None = None) -> Any:
        """SGLang's SchedulerFlushWrapper, its pending flush checked as the scheduler's loop does."""
        out = self._flush_wrapper.handle(self._flush_req(timeout_s=timeout_s))
        while out is None:
            await asyncio.sleep(0.05)
            self._flush_wrapper.check_pending()
            out = self._flushed.pop() if self._flushed else None
        _note(message=out.message or ("Cache flushed." if out.success else "Cache not flushed."))
        return out

    async def load_lora_adapter_from_tensors(self, obj: Any, request: Any = None) -> Any:
        return await self._lora("/load_lora_adapter_from_tensors", obj)

    async def unload_lora_adapter(self, obj: Any, request: Any = None) -> Any:
        return await self._lora("/unload_lora_adapter", obj)

    async def _lora(self, route: str, obj: Any) -> Any:
        from sglang.srt.managers.io_struct import LoRAUpdateOutput

        ok, error = await self._run(route, lambda: self.engine.lora(route, obj))
        _note(message=error or "")
        return LoRAUpdateOutput(success=ok, error_message=error,
                                loaded_adapters={n: "__tensor__" for n in self.engine.loras} if ok else None)

    async def release_memory_occupation(self, obj: Any, request: Any = None) -> None:
        _note()

    async def resume_memory_occupation(self, obj: Any, request: Any = None) -> None:
        _note()

    async def check_weights(self, obj: Any, request: Any = None) -> tuple[bool, str, Any, Any]:
        _note()
        return True, "Success", None, None


TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
               "head_dim": 32, "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
               "torch_dtype": "float32"}


def model_dir(root: Path, name: str) -> str:
    """A config-only model directory SGLang's ServerArgs / ModelConfig accept (no weights, no tokenizer)."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return str(path)


def server_args(root: Path, *, tp_size: int = 1, dp_size: int = 1, pp_size: int = 1,
                speculative_algorithm: str | None = None, draft_path: str | None = None) -> Any:
    """SGLang's ServerArgs, resolved by SGLang (e.g. NEXTN -> EAGLE), and published for the process."""
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    kw: dict[str, Any] = {}
    if speculative_algorithm:
        kw.update(speculative_algorithm=speculative_algorithm)
    if draft_path:
        kw.update(speculative_draft_model_path=draft_path)
    args = ServerArgs(model_path=model_dir(root, "standin-model"), device="cpu", skip_tokenizer_init=True,
                      load_format="dummy", tp_size=tp_size, dp_size=dp_size, pp_size=pp_size, **kw)
    args.resolve_once()
    publish(args, role="tokenizer")
    return args


def build_app(engine: Engine, args: Any) -> Any:
    """SGLang's FastAPI app with the substitute tokenizer manager installed, an event log of every POST, and
    the /standin/* routes."""
    from fastapi import APIRouter, Request
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.entrypoints import http_server as hs
    from starlette.middleware.base import BaseHTTPMiddleware

    tm = StandinTokenizerManager(engine, args, ModelConfig.from_server_args(args))
    hs.set_global_state(hs._GlobalState(tokenizer_manager=tm, template_manager=None, scheduler_info={}))
    app = hs.app

    async def record(request: Request, call_next: Any) -> Any:
        path = request.url.path
        if request.method != "POST" or path.startswith("/standin/"):
            return await call_next(request)
        call: dict[str, Any] = {}
        token = _CALL.set(call)
        try:
            resp = await call_next(request)
        finally:
            _CALL.reset(token)
        if not call.get("handled") and resp.status_code == 400:
            engine.event("refused", route=path, status=resp.status_code)  # SGLang's validation refused it
        else:
            engine.event(path.lstrip("/"), status=resp.status_code, version=engine.version,
                         message=str(call.get("message", ""))[:300])
        if path == "/update_weight_version" and resp.status_code == 200:
            # what the engine holds when it labels a version (tests compare it with the trainer's)
            engine.event("weights", version=engine.version, checksums=checksums_of(engine)["checksums"])
        return resp

    app.add_middleware(BaseHTTPMiddleware, dispatch=record)
    side = APIRouter()

    @side.get("/standin/state")
    async def state() -> dict[str, Any]:
        return engine.state()

    @side.get("/standin/events")
    async def events() -> dict[str, Any]:
        return {"events": engine.events}

    @side.get("/standin/checksums")
    @side.get("/checksums")  # as the demo engine's
    async def sums() -> dict[str, Any]:
        return checksums_of(engine)

    @side.get("/standin/lora")
    async def lora() -> dict[str, Any]:
        return lora_checksums(engine)

    @side.post("/standin/requests")
    async def requests_running(body: dict[str, int]) -> dict[str, Any]:
        engine.running = int(body.get("running", 0))
        return engine.state()

    app.include_router(side)
    return app


def body_required_routes() -> dict[str, list[str]]:
    """{path: methods} of every route of SGLang's app whose JSON body FastAPI requires: read from the app's own
    route table (a `Body()` parameter without a default), not typed here. Engine venv only."""
    from fastapi.routing import APIRoute
    from sglang.srt.entrypoints import http_server as hs

    out: dict[str, list[str]] = {}
    for route in hs.app.routes:
        if isinstance(route, APIRoute) and route.body_field is not None and route.body_field.field_info.is_required():
            out[route.path] = sorted(route.methods)
    return out


def _engine_interpreter() -> str | None:
    """The engine venv's python when this is not it; None to run here."""
    if os.environ.get(ENV_HERE):
        return None
    from weightsync.e2e.engine_venv import EngineVenvMissing, engine_python

    try:
        py = engine_python()
    except EngineVenvMissing as exc:
        log.warning("%s; trying this python (%s)", exc, sys.executable)
        return None
    if Path(sys.prefix).resolve() == py.parent.parent.resolve():
        return None
    return str(py)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if (py := _engine_interpreter()) is not None:
        log.info("re-executing under the engine venv's python %s", py)
        os.execv(py, [py, "-m", "weightsync.e2e.engines.sglang_standin", *argv])
    p = argparse.ArgumentParser(prog="sglang_standin", description=__doc__.splitlines()[0])
    p.add_argument("--host", default=os.environ.get("WEIGHTSYNC_POD_IP", "127.0.0.1"))
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--hidden", type=int, default=int(os.environ.get("WEIGHTSYNC_DEMO_HIDDEN", "64")),
                   help="the demo model's hidden size (WEIGHTSYNC_DEMO_HIDDEN, as the demo trainer)")
    p.add_argument("--device", default="cpu", help="where the weights live and buckets are received (cuda on GPUs)")
    p.add_argument("--draft-hidden", type=int, default=0,
                   help="also run a draft model (EAGLE3, weights of its own) with this hidden size")
    p.add_argument("--speculative-algorithm", default=None,
                   help="NEXTN: MTP layers (mtp.*) beside the target's, for the draft runner (SGLang reports EAGLE)")
    p.add_argument("--tp-size", type=int, default=1, help="what the server reports (it runs one rank)")
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--pp-size", type=int, default=1)
    p.add_argument("--fail-load", default="", help="SESSION:BUCKET (1-based): that bucket load fails half-way, once")
    args = p.parse_args(argv)
    # SGLang's /health runs a one-token generation unless told not to; the stand-in generates nothing, so it
    # answers /health as SGLang does with this switch off (200 while the server runs).
    os.environ.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
    try:
        import uvicorn
        from sglang.srt.entrypoints import http_server  # noqa: F401  (SGLang's app: its imports fail here first)
    except ImportError as exc:
        raise SystemExit(f"the SGLang stand-in serves SGLang's own HTTP app and needs the engine venv "
                         f"(make setup, or bash e2e/scripts/engine-venv.sh): {exc}") from exc
    session, bucket = (int(x) for x in args.fail_load.split(":")) if args.fail_load else (None, None)
    params = {n: t.to(args.device) for n, t in demo_params(args.hidden).items()}
    root = Path(tempfile.mkdtemp(prefix="sglang-standin-"))
    draft: dict[str, torch.Tensor] | None = None
    kind: str | None = None
    draft_path = None
    if args.draft_hidden:
        kind, draft_path = "eagle3", model_dir(root, "standin-draft")
        draft = {n: t.to(args.device) for n, t in demo_params(args.draft_hidden).items()}
    elif (args.speculative_algorithm or "").upper() == "NEXTN":
        kind = "mtp"
        draft = {f"{MTP_PREFIX}{n}": t.to(args.device) for n, t in demo_params(args.hidden).items()}
    algo = "EAGLE3" if kind == "eagle3" else args.speculative_algorithm
    sargs = server_args(root, tp_size=args.tp_size, dp_size=args.dp_size, pp_size=args.pp_size,
                        speculative_algorithm=algo, draft_path=draft_path)
    engine = Engine(params, Faults(session, bucket), device=args.device, draft_params=draft, draft=kind)
    app = build_app(engine, sargs)
    log.info("SGLang %s stand-in (SGLang's HTTP app) on http://%s:%s (pid %s, python %s)", sglang_code.version(),
             args.host, args.port, os.getpid(), sys.executable)
    uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, lifespan="off", log_level="warning")).run()


if __name__ == "__main__":
    main()
