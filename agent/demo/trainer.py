"""Demo trainer: a tiny torch model, a few SGD steps per version, publishes versions 1..N, then idles.

    python -m weightsync.agent.demo.trainer --versions 5 --interval 1

Per-version sha256 checksums of every published tensor are written to a JSON file and served over HTTP
(GET /checksums?version=N, GET /version, GET /healthz) so end-to-end tests can check that every engine
is bit-exact with the trainer.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import torch

from weightsync.agent.client import TrainerSession
from weightsync.agent.demo.jsonhttp import JsonHandler, serve_in_thread
from weightsync.agent.demo.model import DemoModel, batch
from weightsync.agent.layout.shards import checksums
from weightsync.crds import contract

log = logging.getLogger("weightsync.demo.trainer")

ENV_DEMO_PORT = "WEIGHTSYNC_DEMO_PORT"
ENV_DEMO_CHECKSUMS = "WEIGHTSYNC_DEMO_CHECKSUMS"


class TrainerState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.version = 0
        self.checksums: dict[int, dict[str, str]] = {}
        self.loss: float | None = None

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"version": self.version, "loss": self.loss}


def _serve(state: TrainerState, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(JsonHandler):
        def do_GET(self) -> None:
            url = urlparse(self.path)
            q = parse_qs(url.query)
            if url.path == "/healthz":
                self._json(200, {"ok": True})
            elif url.path == "/version":
                self._json(200, state.snapshot())
            elif url.path == "/checksums":
                with state.lock:
                    v = int(q["version"][0]) if "version" in q else state.version
                    sums = state.checksums.get(v)
                self._json(200 if sums else 404, {"version": v, "checksums": sums or {}})
            else:
                self._json(404, {"error": f"unknown path {url.path}"})

    return serve_in_thread(host, port, Handler)


def _write_checksums(path: Path, sums: dict[int, dict[str, str]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({str(k): v for k, v in sums.items()}, indent=1))
    os.replace(tmp, path)


def _keep_most(model: torch.nn.Module, before: dict[str, torch.Tensor], fraction: float,
               gen: torch.Generator) -> None:
    """Keep the new value of only `fraction` of each parameter's elements; the rest go back to `before`."""
    with torch.no_grad():
        for name, t in model.named_parameters():
            keep_new = torch.rand(t.shape, generator=gen) < fraction
            t.copy_(torch.where(keep_new, t, before[name]))


def _wait_served_before_exit(session: TrainerSession, version: int, timeout: float) -> None:
    """A trainer that exits takes its pod's agent, the source of its versions, with it: wait until every
    inference replica serves the last version first, so Complete never leaves an engine a version behind."""
    log.info("all %d versions published; waiting up to %gs for every inference replica to serve version %d",
             version, timeout, version)
    try:
        served = session.wait_served(version, timeout=timeout)
    except TimeoutError as exc:  # ServedTimeout names each lagging replica
        log.warning("exiting although not every replica serves the last version: %s", exc)
        return
    log.info("every inference replica serves version %d (%s); exiting", version, served.describe())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--versions", type=int, default=int(os.environ.get("WEIGHTSYNC_DEMO_VERSIONS", "5")))
    p.add_argument("--steps-per-version", type=int, default=3)
    p.add_argument("--interval", type=float, default=float(os.environ.get("WEIGHTSYNC_DEMO_INTERVAL", "1.0")))
    p.add_argument("--hidden", type=int, default=int(os.environ.get("WEIGHTSYNC_DEMO_HIDDEN", "64")))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=int(os.environ.get(ENV_DEMO_PORT, "8000")))
    p.add_argument("--host", default=os.environ.get(contract.ENV_POD_IP, "127.0.0.1"))
    p.add_argument("--checksums", default=os.environ.get(ENV_DEMO_CHECKSUMS, ""),
                   help="JSON file for per-version checksums (default: <socket dir>/demo-trainer-checksums.json)")
    p.add_argument("--exit", action="store_true",
                   help="exit after the last version instead of idling, once every inference replica serves it")
    p.add_argument("--exit-wait-served", type=float, default=300.0, metavar="SECONDS",
                   help="with --exit: how long to wait for every inference replica to serve the last version "
                   "before exiting anyway (the pod's agent ends with the trainer, so a replica that has not "
                   "fetched the last version by then stays on the one before)")
    p.add_argument("--sparse-update", type=float, default=0.0, metavar="FRACTION",
                   help="each version changes only this fraction of each parameter's elements (chosen at random; "
                   "the others keep the previous version's values), like a sparse fine-tune: what delta sync "
                   "pays off on. 0 (default): every element takes the optimizer's update")
    args = p.parse_args(argv)
    if not 0.0 <= args.sparse_update <= 1.0:
        p.error(f"--sparse-update must be a fraction from 0 to 1, got {args.sparse_update}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")

    torch.manual_seed(args.seed)
    model = DemoModel(args.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(args.seed + 1)
    sparse_gen = torch.Generator().manual_seed(args.seed + 2)  # its own stream: the batches stay the same
    state = TrainerState()
    server = _serve(state, args.host, args.port)
    sums_path = Path(args.checksums) if args.checksums else (
        Path(os.environ.get(contract.ENV_SOCKET_DIR) or contract.SOCKET_DIR) / "demo-trainer-checksums.json")
    log.info("demo trainer http=%s:%s versions=%d checksums=%s", args.host, server.server_address[1],
             args.versions, sums_path)

    with TrainerSession() as session:
        for version in range(1, args.versions + 1):
            before = {n: t.detach().clone() for n, t in model.named_parameters()} if args.sparse_update else {}
            for _ in range(args.steps_per_version):
                x, y = batch(gen)
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                model.steps += 1
            if before:
                _keep_most(model, before, args.sparse_update, sparse_gen)
            # Checksums first: an engine may serve the version before publish() returns here, and a reader
            # who sees the version anywhere must find its checksums.
            sums = checksums(model.state_dict().items())
            with state.lock:
                state.checksums[version] = sums
                _write_checksums(sums_path, state.checksums)
            res = session.publish(model, version)
            with state.lock:
                state.version = version
                state.loss = float(loss.detach())
            log.info("published version=%d loss=%.5f bytes=%d seconds=%.4f", version, float(loss.detach()), res.bytes,
                     res.seconds)
            if version < args.versions:
                time.sleep(args.interval)
        if args.exit:
            _wait_served_before_exit(session, args.versions, args.exit_wait_served)
    if args.exit:
        server.shutdown()
        return
    log.info("all %d versions published; idling", args.versions)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
