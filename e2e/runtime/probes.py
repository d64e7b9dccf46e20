"""Readiness, liveness and startup probes: exec (inside the container's mount namespace), httpGet,
tcpSocket; against the pod IP. ProbeState holds the kubelet's threshold bookkeeping (pure)."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import requests

JSON = dict[str, Any]


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    message: str = ""


@dataclass
class ProbeState:
    """Consecutive success / failure counting for one probe of one container instance."""

    spec: JSON
    started_at: float
    initial: bool | None  # result before the first verdict (readiness False, liveness True, startup None)
    result: bool | None = field(init=False)
    successes: int = 0
    failures: int = 0
    next_due: float = field(init=False)
    last_message: str = ""

    def __post_init__(self) -> None:
        self.result = self.initial
        self.next_due = self.started_at + float(self.spec.get("initialDelaySeconds", 0))

    @property
    def period(self) -> float:
        return float(self.spec.get("periodSeconds", 10))

    @property
    def timeout(self) -> float:
        return float(self.spec.get("timeoutSeconds", 1))

    def due(self, now: float) -> bool:
        return now >= self.next_due

    def record(self, result: ProbeResult, now: float) -> None:
        """Apply one probe outcome; `result` flips only after successThreshold / failureThreshold in a row."""
        self.next_due = now + self.period
        self.last_message = result.message
        if result.ok:
            self.successes += 1
            self.failures = 0
            if self.successes >= int(self.spec.get("successThreshold", 1)):
                self.result = True
        else:
            self.failures += 1
            self.successes = 0
            if self.failures >= int(self.spec.get("failureThreshold", 3)):
                self.result = False


def resolve_port(port: int | str, ports: Sequence[JSON]) -> int:
    """A probe port: a number or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in ports:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"probe port {port!r} is not a named port of the container")


def run_probe(probe: JSON, pod_ip: str, pid: int | None, env: Mapping[str, str], ports: Sequence[JSON]) -> ProbeResult:
    """Run one probe once; never raises."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "exec" in probe:
            if pid is None:
                return ProbeResult(False, "container is not running")
            command = list(probe["exec"].get("command") or [])
            argv = ["nsenter", "-t", str(pid), "-m", "-r", "--", *command]  # -r: its root too (image mode)
            done = subprocess.run(argv, env=dict(env), capture_output=True, timeout=timeout, check=False)
            output = (done.stdout + done.stderr).decode(errors="replace").strip()[-500:]
            return ProbeResult(done.returncode == 0, f"exit code {done.returncode}: {output}")
        if "httpGet" in probe:
            get = probe["httpGet"]
            scheme = str(get.get("scheme", "HTTP")).lower()
            host = get.get("host") or pod_ip
            port = resolve_port(get["port"], ports)
            path = get.get("path", "/")
            headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
            resp = requests.get(
                f"{scheme}://{host}:{port}{path}", headers=headers, timeout=timeout, verify=False,
                allow_redirects=False,
            )
            ok = 200 <= resp.status_code < 400
            return ProbeResult(ok, f"HTTP {resp.status_code}" if ok else f"HTTP probe failed with statuscode: {resp.status_code}")
        if "tcpSocket" in probe:
            tcp = probe["tcpSocket"]
            host = tcp.get("host") or pod_ip
            port = resolve_port(tcp["port"], ports)
            with socket.create_connection((host, port), timeout=timeout):
                return ProbeResult(True, "")
        return ProbeResult(False, f"unsupported probe handler {sorted(k for k in probe if k.endswith(('exec', 'Get', 'Socket', 'grpc')))}")
    except subprocess.TimeoutExpired:
        return ProbeResult(False, f"command timed out after {timeout:g}s")
    except (OSError, requests.RequestException, ValueError) as exc:
        return ProbeResult(False, str(exc))
