"""One HTTP request overlapped with the collective it starts on the engine.

Why: SGLang's `/init_weights_update_group` and `/update_weights_from_distributed`, and vLLM's
`/init_weight_transfer_engine` and `/update_weights`, block on the engine inside a collective (rendezvous,
broadcast) that the agent must join meanwhile. Whichever side fails first is reported at once: a refused
request never waits out the collective's timeout (an abandoned collective thread ends with its own).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weightsync.agent.engines.base import EngineError
from weightsync.agent.engines.http import HttpClient

ERROR_GRACE_SECONDS = 2.0


@dataclass
class Overlap:
    """How the request and the collective ended."""

    http_error: BaseException | None
    collective_error: BaseException | None
    http_done: bool
    collective_done: bool
    timeout: float

    @property
    def ok(self) -> bool:
        return self.http_done and self.collective_done and self.http_error is None and self.collective_error is None

    def raise_error(self, what: str) -> None:
        """Raise the failure: the engine's own error as it is, anything else as an EngineError."""
        if isinstance(self.http_error, EngineError):
            raise self.http_error
        if isinstance(self.collective_error, EngineError):
            raise self.collective_error
        cause = self.http_error or self.collective_error
        raise EngineError(f"{what}: {cause or f'no completion within {self.timeout:.0f}s'}") from cause


def post_during(client: HttpClient, route: str, body: dict[str, Any], collective: Callable[[], Any], *,
                timeout: float, name: str) -> Overlap:
    """POST `route` (never retried: it is not idempotent) in a thread while `collective` runs in another;
    return as soon as both finished, either failed, or `timeout` passed."""
    done = threading.Event()
    errors: dict[str, BaseException] = {}
    finished: set[str] = set()

    def run(part: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the caller through Overlap
            errors[part] = exc
        finally:
            finished.add(part)
            done.set()

    for part, fn in (("http", lambda: client.post(route, body, retry=False)), ("collective", collective)):
        threading.Thread(target=run, args=(part, fn), name=f"{name}-{part}", daemon=True).start()
    expired = threading.Event()
    timer = threading.Timer(timeout, expired.set)
    timer.daemon = True
    timer.start()
    grace_until: float | None = None
    try:
        while len(finished) < 2 and not expired.is_set():
            if errors:
                # An engine that refuses after receiving answers right after the collective ends: give the
                # other side a moment so a finished collective is not taken for a broken one.
                grace_until = grace_until or time.monotonic() + ERROR_GRACE_SECONDS
                if time.monotonic() >= grace_until:
                    break
            done.wait(0.05)
            done.clear()
    finally:
        timer.cancel()
    return Overlap(http_error=errors.get("http"), collective_error=errors.get("collective"),
                   http_done="http" in finished, collective_done="collective" in finished, timeout=timeout)
