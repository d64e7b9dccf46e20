"""Demo engine (Custom type): holds the demo model, loads versions from its agent, answers predictions.

    python -m weightsync.agent.demo.engine --port 8001

HTTP: GET /predict?x=0.5 -> {"y": ..., "version": v} (503 while paused), GET /version -> {"version", "paused"},
GET /checksums -> sha256 of every weight of the served version (compare with the demo trainer's), GET /events
-> the pause/begin/commit/abort/resume sequence, GET /healthz.

A version is loaded into a shadow copy and swapped in on commit, so predictions never see half a version
and an aborted load leaves the served weights untouched.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import torch

from weightsync.agent.client import InferenceSession
from weightsync.agent.demo.jsonhttp import JsonHandler, serve_in_thread
from weightsync.agent.demo.model import DemoModel
from weightsync.agent.layout.shards import checksums
from weightsync.crds import contract

log = logging.getLogger("weightsync.demo.engine")


class DemoEngine:
    """The engine's state and the InferenceSession callbacks."""

    def __init__(self, hidden: int, fail_versions: set[int] | None = None) -> None:
        self.fail_versions = set(fail_versions or ())  # tests: fail the first load of these versions
        self.events: list[list[Any]] = []  # (event, version) in order, for tests of pause/resume ordering
        torch.manual_seed(12345)  # deliberately not the trainer's init: version None until the first load
        self.model = DemoModel(hidden)
        self.lock = threading.Lock()
        self.version: int | None = None
        self.paused = False
        self.loads = 0
        self.aborts = 0
        self._shadow: dict[str, torch.Tensor] | None = None
        self._received: set[str] = set()
        self._loading: int | None = None

    def on_begin(self, version: int) -> None:
        self.events.append(["begin", version])
        with self.lock:
            self._shadow = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self._received = set()
        self._loading = version

    def on_bucket(self, version: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
        if self._shadow is None or version != self._loading:
            raise RuntimeError(f"bucket for version {version} without begin")
        if version in self.fail_versions:
            self.fail_versions.discard(version)
            raise RuntimeError(f"injected failure loading version {version}")
        for name, t in tensors:
            dst = self._shadow.get(name)
            if dst is None:
                raise KeyError(f"unknown tensor {name!r}")
            if dst.shape != t.shape or dst.dtype != t.dtype:
                raise ValueError(f"{name}: got {t.dtype}{list(t.shape)}, model has {dst.dtype}{list(dst.shape)}")
            dst.copy_(t)
            self._received.add(name)

    def on_commit(self, version: int) -> None:
        if self._shadow is None or version != self._loading:
            raise RuntimeError(f"commit of version {version} that was not loaded")
        missing = set(self._shadow) - self._received
        if missing:
            raise RuntimeError(f"commit of version {version} without {sorted(missing)[:5]}")
        with self.lock:
            self.model.load_state_dict(self._shadow)
            self.version = version
            self.loads += 1
        self._shadow = None
        self.events.append(["commit", version])
        log.info("serving version=%d", version)

    def on_abort(self, version: int, reason: str) -> None:
        self._shadow = None
        self.aborts += 1
        self.events.append(["abort", version])
        log.warning("load of version=%d aborted: %s", version, reason)

    def on_pause(self) -> None:
        self.events.append(["pause", self.version])
        self.paused = True

    def on_resume(self) -> None:
        self.events.append(["resume", self.version])
        self.paused = False

    def predict(self, x: float) -> float:
        with self.lock, torch.no_grad():
            return float(self.model(torch.tensor([[x]], dtype=torch.float32))[0, 0])

    def state(self) -> dict[str, Any]:
        with self.lock:
            return {"version": self.version, "paused": self.paused, "loads": self.loads, "aborts": self.aborts}

    def checksums(self) -> dict[str, Any]:
        with self.lock:
            return {"version": self.version, "checksums": checksums(self.model.state_dict().items())}


def serve(engine: DemoEngine, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(JsonHandler):
        def do_GET(self) -> None:
            url = urlparse(self.path)
            q = parse_qs(url.query)
            if url.path == "/healthz":
                self._json(200, {"ok": True})
            elif url.path == "/version":
                self._json(200, engine.state())
            elif url.path == "/events":
                self._json(200, {"events": engine.events})
            elif url.path == "/checksums":
                self._json(200, engine.checksums())
            elif url.path == "/predict":
                if engine.paused:
                    self._json(503, {"error": "paused", **engine.state()})
                    return
                try:
                    x = float(q.get("x", ["0"])[0])
                except ValueError:
                    self._json(400, {"error": "x must be a number"})
                    return
                self._json(200, {"x": x, "y": engine.predict(x), "version": engine.version})
            else:
                self._json(404, {"error": f"unknown path {url.path}"})

    return serve_in_thread(host, port, Handler)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=int(os.environ.get("WEIGHTSYNC_DEMO_PORT", "8001")))
    p.add_argument("--host", default=os.environ.get(contract.ENV_POD_IP, "127.0.0.1"))
    p.add_argument("--hidden", type=int, default=int(os.environ.get("WEIGHTSYNC_DEMO_HIDDEN", "64")))
    p.add_argument("--fail-versions", default=os.environ.get("WEIGHTSYNC_DEMO_FAIL_VERSIONS", ""),
                   help="comma-separated versions whose first load fails (tests)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    engine = DemoEngine(args.hidden, {int(v) for v in args.fail_versions.split(",") if v.strip()})
    server = serve(engine, args.host, args.port)
    session = InferenceSession(engine.on_bucket, engine.on_commit, on_begin=engine.on_begin,
                               on_abort=engine.on_abort, on_pause=engine.on_pause, on_resume=engine.on_resume)
    session.start()
    log.info("demo engine http=%s:%s agent socket=%s", args.host, server.server_address[1], session.socket_path)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
