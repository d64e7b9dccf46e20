"""The RL demo trainer's rollouts (agent/demo/rl_trainer.py): an answer cut short is asked again.

A replica stopped mid-request (its pod deleted) can answer with the tokens it had: with ignore_eos every whole
answer has max_tokens tokens, and a shorter one crashed the trainer's reward tensor ("expected sequence of
length 5 at dim 1 (got 4)", seen in the RL e2e run). Served here over HTTP in the shape of vLLM's
/inference/v1/generate answer that `generate` parses; the first answer is cut short."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from weightsync.agent.demo.rl_trainer import rollouts_for_step


def _serve(answers: list[int]) -> tuple[ThreadingHTTPServer, list[dict[str, Any]]]:
    """A server answering each request with `answers.pop(0)` tokens per choice (version 3's label)."""
    seen: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            n = answers.pop(0) if answers else body["sampling_params"]["max_tokens"]
            reply = {"choices": [{"token_ids": [7] * n, "weight_versions": [{"version": "3-0123456789ab"}]}
                                 for _ in range(body["sampling_params"]["n"])]}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


def test_an_answer_cut_short_is_asked_again() -> None:
    server, seen = _serve([4])  # the first answer is cut short: 4 of 5 tokens
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        rollouts, versions, dropped = rollouts_for_step(url, 2, oldest=1, requests=2, per_request=3, max_tokens=5,
                                                        seed=0)
    finally:
        server.shutdown()
    assert len(seen) == 3  # request 0 twice (cut short, then whole), request 1 once
    assert len(rollouts) == 6 and all(len(r.tokens) == 5 for r in rollouts)
    assert versions == [3, 3] and dropped == 0
    assert seen[0]["sampling_params"]["seed"] != seen[1]["sampling_params"]["seed"]  # asked again, new seed
