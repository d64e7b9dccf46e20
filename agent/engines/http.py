"""A small JSON-over-HTTP client for engine control endpoints.

Why its own module: every HTTP adapter (SGLang, vLLM) needs the same behaviour, and getting it wrong is
how weight sync hangs or silently half-applies: a timeout on every call, retries with exponential
backoff on connection errors and 5xx (engines restart, load balancers flap), never on 4xx (the request
is wrong and will stay wrong), and errors that name the engine, the endpoint and the status so an
operator knows where to look.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import requests

from weightsync.agent.engines.base import EngineError

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({500, 502, 503, 504})


class EngineHTTPError(EngineError):
    """An engine endpoint failed; `status` is None when the engine could not be reached at all."""

    def __init__(self, engine: str, method: str, url: str, status: int | None, detail: str, attempts: int) -> None:
        self.engine = engine
        self.method = method
        self.url = url
        self.status = status
        self.detail = detail
        self.attempts = attempts
        what = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"{engine} engine: {method} {url} failed ({what}) after {attempts} attempt(s): {detail}")


def backoff_delays(retries: int, base: float, cap: float) -> list[float]:
    """Sleep before each retry: base, 2*base, 4*base, ... capped at `cap` (pure, for tests and docs)."""
    return [min(cap, base * (2**i)) for i in range(max(0, retries))]


def _detail(resp: requests.Response, limit: int = 500) -> str:
    try:
        body = resp.json()
    except ValueError:
        text = resp.text.strip()
        return text[:limit] or resp.reason or "no body"
    if isinstance(body, dict):
        for key in ("message", "error", "detail"):
            if body.get(key):
                return str(body[key])[:limit]
    return json.dumps(body)[:limit]


@dataclass
class HttpClient:
    """JSON requests to one engine. `engine` names it in errors and logs ("SGLang", "vLLM")."""

    base_url: str
    engine: str
    timeout: float = 60.0
    retries: int = 3
    backoff: float = 0.2
    max_backoff: float = 5.0
    headers: Mapping[str, str] = field(default_factory=dict)
    sleep: Callable[[float], None] = time.sleep
    session: requests.Session = field(default_factory=requests.Session)

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"{self.engine} engine URL must start with http:// or https://, got {self.base_url!r}")

    def url(self, path: str) -> str:
        return f"{self.base_url}/{path.lstrip('/')}"

    def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        retry: bool = True,
    ) -> Any:
        """Send one request; returns the decoded JSON body (None when empty). Raises EngineHTTPError
        for 4xx at once, for connection errors and 5xx after the retries."""
        url = self.url(path)
        delays = backoff_delays(self.retries if retry else 0, self.backoff, self.max_backoff)
        attempt = 0
        while True:
            attempt += 1
            t0 = time.perf_counter()
            try:
                resp = self.session.request(method, url, json=json_body, params=params,
                                            timeout=timeout or self.timeout, headers=dict(self.headers))
            except requests.RequestException as exc:
                status: int | None = None
                detail = f"{type(exc).__name__}: {exc}"
            else:
                status = resp.status_code
                log.debug("engine.http engine=%s method=%s url=%s status=%s seconds=%.3f", self.engine, method, url,
                          status, time.perf_counter() - t0)
                if status < 400:
                    return self._decode(resp, method, url, attempt)
                detail = _detail(resp)
                if status not in RETRY_STATUSES:
                    raise EngineHTTPError(self.engine, method, url, status, detail, attempt)
            if attempt > len(delays):
                raise EngineHTTPError(self.engine, method, url, status, detail, attempt)
            delay = delays[attempt - 1]
            log.warning("engine.http_retry engine=%s method=%s url=%s status=%s attempt=%s delay=%.2f detail=%s",
                        self.engine, method, url, status, attempt, delay, detail)
            self.sleep(delay)

    def _decode(self, resp: requests.Response, method: str, url: str, attempt: int) -> Any:
        if not resp.content:
            return None
        try:
            body = resp.json()
        except ValueError:
            return resp.text
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineHTTPError(self.engine, method, url, resp.status_code,
                                  str(body.get("message") or "the engine reported success=false"), attempt)
        return body

    def post(self, path: str, json_body: Any = None, **kw: Any) -> Any:
        return self.request("POST", path, json_body=json_body, **kw)

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)

    def close(self) -> None:
        self.session.close()
