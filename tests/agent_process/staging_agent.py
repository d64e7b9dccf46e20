"""A minimal trainer agent for client tests: answers a TrainerSession's hello, stage and publish on a real
Unix socket straight from a real StagedVersions (no control plane, no peers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from weightsync.agent.staging.index import StagingError
from weightsync.agent.staging.versions import StagedVersions
from weightsync.agent.wire.local import LocalServer


def serve_staging(path: Path, store: StagedVersions) -> LocalServer:
    def handler(conn: Any) -> None:
        conn.recv()
        conn.reply_ok()
        while True:
            h, _ = conn.recv()
            try:
                if h["op"] == "stage":
                    conn.reply_ok(**store.stage_request(h["rank"], h["version"], h["nbytes"], h["device"],
                                                        skip_unsent=h.get("skip_unsent") is True))
                else:
                    store.publish(h["rank"], h["version"], h["segment"], h["tensors"], h["aliases"])
                    conn.reply_ok()
            except StagingError as exc:
                conn.reply_error(str(exc))

    return LocalServer(path, handler).start()
