"""A real HTTP server on a loopback port (http.server in a thread) that records every call and answers
from a per-path script: tests check what an adapter sent and in which order."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

Reply = tuple[int, Any]


@dataclass
class Call:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any


@dataclass
class RecordingServer:
    """`replies[path]` is a list consumed one reply per call (the last one repeats) or a callable."""

    replies: dict[str, list[Reply] | Callable[[Call], Reply]] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)

    def __post_init__(self) -> None:
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                u = urlparse(self.path)
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else None
                call = Call(self.command, u.path, parse_qs(u.query), body)
                rec.calls.append(call)
                status, payload = rec.reply(call)
                data = json.dumps(payload).encode() if payload is not None else b""
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = _handle
            do_POST = _handle

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def reply(self, call: Call) -> Reply:
        script = self.replies.get(call.path)
        if script is None:
            return 200, {"success": True, "message": "ok"}
        if callable(script):
            return script(call)
        return script.pop(0) if len(script) > 1 else script[0]

    def paths(self) -> list[str]:
        return [c.path for c in self.calls]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
