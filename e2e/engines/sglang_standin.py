"""A stand-in SGLang 0.5.23 server: the engine's own weight-update code behind its own routes.

It runs as the engine container of a local-cluster job (`python -m weightsync.e2e.engines.sglang_standin`)
and in the `engines` test tier. Every request on a weight-update route is validated with SGLang's own
request type, refused when SGLang's route table does not have it, and handled by SGLang's own
`SchedulerWeightUpdaterManager` (session rules: loads only between begin and end, one session at a time)
and `WeightUpdater` (the rendezvous and `PrefixStore(group_name)` of init_custom_process_group, the
flattened-bucket broadcast receive, SafeUnpickler deserialization of tensor payloads). Only the model is
a stand-in: a named set of tensors (the demo model's unless told otherwise) whose loader refuses unknown
names, shapes and dtypes the way a real model's `load_weights` would fail.

Observability for tests (not SGLang routes, under /standin/): `state` (weight version, paused, session,
loads), `events` (every call in order), `checksums` (sha256 of every weight, as the demo trainer's).
Fault injection: `--fail-load SESSION:BUCKET` (1-based) makes the BUCKET-th bucket load of the
SESSION-th weight-update session write half of its tensors and then fail, once, as a real loader that
raises mid-bucket does (SGLang then answers 400 "... partially updated").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
import types
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from weightsync.agent.client import checksums
from weightsync.agent.demo.jsonhttp import JsonHandler
from weightsync.agent.engines.base import parse_version

from . import sglang_code

log = logging.getLogger("weightsync.sglang_standin")


class StandinModel:
    """The model behind the loader: name -> tensor. load_weights copies like SGLang's default loader
    (`param.data.copy_(loaded)`), refusing what a real model would refuse."""

    def __init__(self, params: dict[str, torch.Tensor], faults: Faults, *, skip_unknown: bool = False) -> None:
        self.params = params
        self.faults = faults
        self.skip_unknown = skip_unknown  # a draft model's loader skips names it has not (llama_eagle3.py)
        self.lock = threading.Lock()

    def modules(self) -> list[Any]:
        return []

    def load_weights(self, named: Any) -> None:
        named = list(named)
        fail = self.faults.should_fail()
        for i, (name, t) in enumerate(named):
            if fail and i >= max(1, len(named) // 2):
                raise RuntimeError(f"injected load failure in bucket after {i} of {len(named)} tensors")
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
    """SGLang's weight-update managers wired to the stand-in model (one TP rank: tp_size 1)."""

    def __init__(self, params: dict[str, torch.Tensor], faults: Faults, device: str = "cpu",
                 draft_params: dict[str, torch.Tensor] | None = None) -> None:
        if not dist.is_initialized():  # SGLang's scheduler barriers on its TP CPU group
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.model = StandinModel(params, faults)
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
        # An EAGLE3-style draft runner (its own weights) when draft_params are given: SGLang's manager then
        # fans "all" out to both runners and "draft" to this one only.
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
        self.events: list[dict[str, Any]] = []
        self.manager = sglang_code.scheduler_updater().SchedulerWeightUpdaterManager(
            tp_worker=self.worker, draft_worker=draft_worker, memory_saver_adapter=None, flush_cache=self._flush,
            is_fully_idle=lambda **_: True, scheduler=types.SimpleNamespace(record_weight_version_change=self._record))
        self.lock = threading.Lock()  # the scheduler handles one control request at a time

    def _lora(self, route: str, req: Any) -> tuple[int, dict[str, Any]]:
        """SGLang's adapter registry rules (tokenizer_control_mixin / lora_manager): a name loads once until
        unloaded; the payload is rebuilt by SGLang's own deserializer and, with expected_checksums, each
        tensor's sha256 is checked before anything loads (tp_worker.load_lora_adapter_from_tensors)."""
        name = req.lora_name
        if route == "/unload_lora_adapter":
            if self.loras.pop(name, None) is None:
                return 400, {"success": False, "error_message": f"LoRA adapter {name} is not loaded"}
            return 200, {"success": True}
        if name in self.loras:
            return 400, {"success": False, "error_message":
                         f"Failed to load LoRA adapter {name} because it is already loaded"}
        data = sglang_code.deserialize_own_rank(req.serialized_named_tensors, 0)
        tensors = dict(data)
        if req.expected_checksums is not None:
            got = checksums(tensors.items())
            bad = sorted(n for n, want in req.expected_checksums.items() if got.get(n) != want)
            extra = sorted(set(tensors) - set(req.expected_checksums))
            if bad or extra:
                return 400, {"success": False, "error_message": f"[LORA-CHECK] adapter sync MISMATCH: {bad[:5]} "
                                                                  f"differ or are missing, {extra[:5]} extra"}
        self.loras[name] = {n: t.clone() for n, t in tensors.items()}
        return 200, {"success": True, "loaded_adapters": {n: "__tensor__" for n in self.loras}}

    def _init_group(self, req: Any) -> tuple[bool, str]:
        return self.runner.init_weights_update_group(req.master_address, req.master_port, req.rank_offset,
                                                     req.world_size, req.group_name, backend=req.backend)

    def _destroy_group(self, req: Any) -> tuple[bool, str]:
        return self.runner.destroy_weights_update_group(req.group_name)

    def _flush(self, empty_cache: bool = False) -> bool:
        self.event("flush_cache")
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
                "sglang": sglang_code.version(), "sessions": self.faults.sessions}

    def handle(self, route: str, req: Any) -> tuple[int, dict[str, Any]]:
        m = self.manager
        if route == "/pause_generation":
            self.paused = True
            return 200, {"message": "Generation paused successfully."}
        if route == "/continue_generation":
            self.paused = False
            return 200, {"message": "Generation continued successfully."}
        if route == "/begin_weight_update":
            out = m.begin_weight_update(req)
            if out.success:
                self.faults.begin()
        elif route == "/end_weight_update":
            out = m.end_weight_update(req)
        elif route == "/init_weights_update_group":
            out = m.init_weights_update_group(req)
        elif route == "/destroy_weights_update_group":
            out = m.destroy_weights_update_group(req)
        elif route == "/update_weights_from_distributed":
            out = m.update_weights_from_distributed(req)
        elif route == "/update_weights_from_tensor":
            out = m.update_weights_from_tensor(req)
        elif route in ("/load_lora_adapter_from_tensors", "/unload_lora_adapter"):
            return self._lora(route, req)
        elif route == "/update_weight_version":
            self.version = req.new_version
            return 200, {"success": True, "message": f"Weight version updated to {req.new_version}",
                         "new_version": req.new_version}
        else:
            return 404, {"detail": "Not Found"}
        return (200 if out.success else 400), {"success": out.success, "message": out.message}


def lora_checksums(engine: Engine) -> dict[str, Any]:
    with engine.model.lock:
        return {"version": engine.version,
                "adapters": {name: checksums(sorted(t.items())) for name, t in engine.loras.items()}}


def checksums_of(engine: Engine) -> dict[str, Any]:
    with engine.model.lock:
        sums = checksums(sorted(engine.model.params.items()))
    if engine.draft is not None:
        with engine.draft.lock:
            sums.update(checksums((f"draft.{n}", t) for n, t in sorted(engine.draft.params.items())))
    v = engine.version
    n = parse_version(v)  # the agent labels a version `N-<digest prefix>`
    return {"version": v if n is None else n, "label": v, "checksums": sums}


def make_handler(engine: Engine, max_body: int) -> type[BaseHTTPRequestHandler]:
    sg_routes = sglang_code.routes()

    class Handler(JsonHandler):
        def _body(self) -> Any:
            n = int(self.headers.get("Content-Length") or 0)
            if n > max_body:
                raise ValueError(f"body of {n} bytes exceeds {max_body}")
            raw = self.rfile.read(n) if n else b""
            return json.loads(raw) if raw else None

        def do_GET(self) -> None:
            path = urlparse(self.path).path
            if path == "/standin/state":
                self._json(200, engine.state())
            elif path == "/standin/events":
                self._json(200, {"events": engine.events})
            elif path in ("/standin/checksums", "/checksums"):  # /checksums: as the demo engine's
                self._json(200, checksums_of(engine))
            elif path == "/standin/lora":
                self._json(200, lora_checksums(engine))
            elif ("GET", path) not in sg_routes:
                self._json(404, {"detail": "Not Found"})
            elif path == "/health":
                self._json(200, {})
            elif path == "/model_info":
                self._json(200, {"weight_version": engine.version, "model_path": "standin", "is_generation": True})
            elif path == "/server_info":
                self._json(200, {"version": sglang_code.version(), "tp_size": 1,
                                 "speculative_algorithm": "EAGLE3" if engine.draft is not None else None})
            else:
                self._json(501, {"detail": f"the stand-in does not implement GET {path}"})

        def do_POST(self) -> None:
            path = urlparse(self.path).path
            if ("POST", path) not in sg_routes:
                self._json(404, {"detail": "Not Found"})
                return
            try:
                body = self._body()
                if path == "/flush_cache":
                    engine.event("flush_cache")
                    self._json(200, {})
                    return
                req = sglang_code.validate(path, body)
            except Exception as exc:  # FastAPI answers 422 for a body its type refuses
                engine.event("refused", route=path, error=str(exc)[:300])
                self._json(HTTPStatus.UNPROCESSABLE_ENTITY, {"detail": str(exc)[:1000]})
                return
            with engine.lock:
                code, out = engine.handle(path, req)
                engine.event(path.lstrip("/"), status=code, version=engine.version,
                             message=str(out.get("message", ""))[:300])
                if path == "/update_weight_version" and code == 200:
                    # what the engine holds when it labels a version (tests compare it with the trainer's)
                    engine.event("weights", version=engine.version, checksums=checksums_of(engine)["checksums"])
            self._json(code, out)

    return Handler


def serve(engine: Engine, host: str, port: int, max_body: int = 1 << 30) -> ThreadingHTTPServer:
    srv = ThreadingHTTPServer((host, port), make_handler(engine, max_body))
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, name="sglang-standin-http", daemon=True).start()
    return srv


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="sglang_standin", description=__doc__.splitlines()[0])
    p.add_argument("--host", default=os.environ.get("WEIGHTSYNC_POD_IP", "127.0.0.1"))
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--hidden", type=int, default=int(os.environ.get("WEIGHTSYNC_DEMO_HIDDEN", "64")),
                   help="the demo model's hidden size (WEIGHTSYNC_DEMO_HIDDEN, as the demo trainer)")
    p.add_argument("--device", default="cpu", help="where the weights live and buckets are received (cuda on GPUs)")
    p.add_argument("--draft-hidden", type=int, default=0,
                   help="also run a draft model (EAGLE3-style, weights of its own) with this hidden size")
    p.add_argument("--fail-load", default="", help="SESSION:BUCKET (1-based): that bucket load fails half-way, once")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    session, bucket = (int(x) for x in args.fail_load.split(":")) if args.fail_load else (None, None)
    params = {n: t.to(args.device) for n, t in demo_params(args.hidden).items()}
    draft = ({n: t.to(args.device) for n, t in demo_params(args.draft_hidden).items()}
             if args.draft_hidden else None)
    engine = Engine(params, Faults(session, bucket), device=args.device, draft_params=draft)
    srv = serve(engine, args.host, args.port)
    log.info("SGLang %s stand-in on http://%s:%s (pid %s)", sglang_code.version(), args.host, args.port, os.getpid())
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        srv.shutdown()


if __name__ == "__main__":
    main()
