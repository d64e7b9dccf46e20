"""Agents' reports pushed to the active operator (crds/report_push.py): taken, held, laid over the pods.

Why: the job's status used to wait for every agent's pod write, and at 256 inference pods those writes
queue on the API server for seconds. A pushed report reaches the operator in milliseconds; the operator
holds it and lays it over the cached pod (`ReportBox.overlay`, as desiredstate.overlay does for the desired
annotations), so the rollout, Atomic and status logic read it exactly as if the pod carried it, version
proof included (the reconciler's proof check runs on the overlaid pod). The agent's own pod write follows
and stays the durable record: a held report is dropped once the pod shows the same annotations, once the
pod is a new incarnation, or after HOLD_SECONDS, and a restarted operator starts from the pods.

The listener (`ReportServer`) takes one POST per connection, with limits everywhere: a head of at most
MAX_HEAD_BYTES, a body of at most report_push.MAX_BODY_BYTES, DEADLINE_SECONDS for the whole request, and
at most MAX_CONNECTIONS at once and MAX_CONNECTIONS_PER_ADDRESS from one client address (more are
answered 503 at once). Only the active replica takes reports
(a standby answers 503: the agent writes its pod instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from weightsync.crds import contract, report_push
from weightsync.crds.report_push import BadReport, PushedReport
from weightsync.operator import metrics as m

log = logging.getLogger(__name__)
Obj = dict[str, Any]

HOLD_SECONDS = 30.0  # a held report stands this long at most without its pod catching up
MAX_HEAD_BYTES = 8 * 1024
DEADLINE_SECONDS = 5.0
MAX_CONNECTIONS = 512
MAX_CONNECTIONS_PER_ADDRESS = 64  # one client address (a pod) cannot take the others' slots
# A report asks for its job's pass this much later: the reports of one version (every agent loads it at
# about the same moment, and they arrive over a few hundred milliseconds) become one or two passes.
REPORT_BATCH_SECONDS = 0.15


@dataclass(frozen=True)
class _Held:
    report: PushedReport
    received: float


def _reported(annotations: Mapping[str, Any]) -> dict[str, str]:
    """The reported keys of a pod's (or a report's) annotations; absent and null alike left out."""
    return {k: str(v) for k in contract.REPORTED_POD_ANNOTATIONS if (v := annotations.get(k)) not in (None, "")}


class ReportBox:
    """The reports the operator holds, per job and pod (thread-safe: filled on the event loop, read by
    the reconciler)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, hold_seconds: float = HOLD_SECONDS) -> None:
        self.clock = clock
        self.hold_seconds = hold_seconds
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], dict[str, _Held]] = {}  # (namespace, job) -> pod name -> report
        # (namespace, job, pod) -> (uid, newest seq taken): a report is taken only when newer than the last
        self._newest: dict[tuple[str, str, str], tuple[str, int]] = {}

    def record(self, report: PushedReport) -> bool:
        """Hold REPORT (already verified); False when it is not newer than one already taken for its pod."""
        key = (report.namespace, report.job, report.pod)
        with self._lock:
            uid, seq = self._newest.get(key, ("", -1))
            if uid == report.uid and report.seq <= seq:
                return False
            self._newest[key] = (report.uid, report.seq)
            self._held.setdefault((report.namespace, report.job), {})[report.pod] = _Held(report, self.clock())
        return True

    def held(self, namespace: str, job: str) -> int:
        with self._lock:
            return len(self._held.get((namespace, job), {}))

    def forget(self, namespace: str, job: str) -> None:
        with self._lock:
            self._held.pop((namespace, job), None)
            for key in [k for k in self._newest if k[:2] == (namespace, job)]:
                del self._newest[key]

    def overlay(self, namespace: str, job: str, pods: Mapping[str, Obj]) -> dict[str, Obj]:
        """PODS with the reported annotations of each pod that has a held report replaced by the report's
        (copies; the given objects are not changed). Drops what no longer stands: the pod is gone or a new
        incarnation, it shows the report already, or the report is older than HOLD_SECONDS."""
        out = dict(pods)
        now = self.clock()
        with self._lock:
            held = self._held.get((namespace, job))
            if not held:
                return out
            for name, h in list(held.items()):
                pod = pods.get(name)
                meta = (pod or {}).get("metadata") or {}
                ann = meta.get("annotations") or {}
                if (pod is None or str(meta.get("uid") or "") != h.report.uid
                        or now - h.received > self.hold_seconds or _reported(ann) == _reported(h.report.annotations)):
                    del held[name]
                    if pod is None or str(meta.get("uid") or "") != h.report.uid:
                        self._newest.pop((namespace, job, name), None)
                    continue
                merged = {k: v for k, v in ann.items() if k not in contract.REPORTED_POD_ANNOTATIONS}
                merged.update(_reported(h.report.annotations))
                out[name] = {**pod, "metadata": {**meta, "annotations": merged}}
            if not held:
                del self._held[(namespace, job)]
            m.REPORTS_HELD.set(sum(len(h) for h in self._held.values()))
        return out


class ReportIntake:
    """What the operator does with one pushed report: check it against its caches and the job's token,
    hold it, and ask for the job's reconcile. Returns (HTTP status, message)."""

    def __init__(self, box: ReportBox, lookup: Callable[[str, str, str], Obj | None],
                 token_for: Callable[[Obj], str | None], is_active: Callable[[], bool],
                 request: Callable[[tuple[str, str]], None]) -> None:
        self.box = box
        self.lookup = lookup  # (kind, namespace, name) -> cached object
        self.token_for = token_for  # job body -> its token (None: versions are not checked, nothing is taken)
        self.is_active = is_active
        self.request = request

    def take(self, raw: bytes) -> tuple[int, str]:
        code, result, msg = self._take(raw)
        m.REPORTS.labels(result).inc()
        return code, msg

    def _take(self, raw: bytes) -> tuple[int, str, str]:
        if not self.is_active():
            return 503, "standby", "not the active operator: write the pod"
        try:
            report = report_push.parse(raw)
        except BadReport as err:
            return 400, "bad_request", str(err)
        job = self.lookup(contract.KIND, report.namespace, report.job)
        pod = self.lookup("Pod", report.namespace, report.pod)
        job_uid = str(((job or {}).get("metadata") or {}).get("uid") or "")
        pod_meta = (pod or {}).get("metadata") or {}
        owners = {str(r.get("uid")) for r in pod_meta.get("ownerReferences") or [] if r.get("controller")}
        if job is None or pod is None or job_uid not in owners or str(pod_meta.get("uid") or "") != report.uid:
            return 404, "unknown_pod", f"no pod {report.namespace}/{report.pod} of job {report.job} with that uid"
        token = self.token_for(job)
        if token is None:
            return 503, "unchecked", "this job's reports cannot be checked by this operator: write the pod"
        if not report_push.verify(token, report):
            log.warning("pushed report refused: bad signature namespace=%s job=%s pod=%s", report.namespace,
                        report.job, report.pod, extra={"job": f"{report.namespace}/{report.job}", "pod": report.pod})
            return 403, "bad_signature", "the report is not signed with this job's token"
        if not self.box.record(report):
            return 409, "stale", "older than a report already taken for this pod"
        self.request((report.namespace, report.job))
        return 200, "taken", "taken"


_REASONS = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 409: "Conflict", 411: "Length Required", 413: "Payload Too Large",
            503: "Service Unavailable"}


class ReportServer:
    """A minimal HTTP/1.1 listener on the operator's event loop: one POST contract.REPORT_PATH per
    connection, answered and closed."""

    def __init__(self, take: Callable[[bytes], tuple[int, str]], host: str = "0.0.0.0", port: int = 0,
                 max_connections: int = MAX_CONNECTIONS, deadline_seconds: float = DEADLINE_SECONDS,
                 max_per_address: int = MAX_CONNECTIONS_PER_ADDRESS) -> None:
        self.take = take
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.max_per_address = max_per_address
        self.deadline_seconds = deadline_seconds
        self._open = 0
        self._by_address: dict[str, int] = {}
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=MAX_HEAD_BYTES)
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.info("report listener started port=%d", self.port, extra={"port": self.port})
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if self._open >= self.max_connections or self._by_address.get(address, 0) >= self.max_per_address:
            m.REPORTS.labels("busy").inc()
            await self._answer(writer, 503, "busy")
            writer.close()
            return
        self._open += 1
        self._by_address[address] = self._by_address.get(address, 0) + 1
        try:
            try:
                code, msg = await asyncio.wait_for(self._request(reader), self.deadline_seconds)
            except asyncio.TimeoutError:
                m.REPORTS.labels("timeout").inc()
                code, msg = 408, f"request not complete within {self.deadline_seconds:g} s"
            except (asyncio.LimitOverrunError, ValueError):
                m.REPORTS.labels("bad_request").inc()
                code, msg = 400, f"request head over {MAX_HEAD_BYTES} bytes"
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            await self._answer(writer, code, msg)
        finally:
            self._open -= 1
            self._by_address[address] -= 1
            if not self._by_address[address]:
                del self._by_address[address]
            writer.close()

    async def _request(self, reader: asyncio.StreamReader) -> tuple[int, str]:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            return 400, "malformed request line"
        method, path = parts[0], parts[1].split("?", 1)[0]
        if path != contract.REPORT_PATH:
            return 404, f"only {contract.REPORT_PATH} is served here"
        if method != "POST":
            return 405, "POST only"
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        try:
            length = int(headers["content-length"])
        except (KeyError, ValueError):
            return 411, "Content-Length required"
        if length < 0 or length > report_push.MAX_BODY_BYTES:
            m.REPORTS.labels("too_large").inc()
            return 413, f"body over {report_push.MAX_BODY_BYTES} bytes"
        body = await reader.readexactly(length)
        return self.take(body)

    async def _answer(self, writer: asyncio.StreamWriter, code: int, msg: str) -> None:
        body = json.dumps({"taken": code == 200, "message": msg}).encode()
        head = (f"HTTP/1.1 {code} {_REASONS.get(code, 'Error')}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
            writer.write(head + body)
            await asyncio.wait_for(writer.drain(), self.deadline_seconds)
