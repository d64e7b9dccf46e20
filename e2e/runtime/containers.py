"""One container of one pod as a host process: start, reap, signal, restart backoff, probe state.

The process runs in its own session (process group = pid), so signals reach everything it spawned;
when the main process exits, stragglers in its group are killed, as a container runtime would.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightsync.e2e.runtime.probes import ProbeState
from weightsync.e2e.runtime.status import KIND_SIDECAR, ContainerView

log = logging.getLogger(__name__)
JSON = dict[str, Any]


def rfc3339(ts: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if ts is None else ts))


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@dataclass
class Backoff:
    """Restart delay: immediate first restart, then base * 2^n up to max; reset after a long run."""

    base_s: float
    max_s: float
    reset_after_s: float = 60.0
    current_s: float = 0.0

    def next_delay(self, ran_for_s: float) -> float:
        if ran_for_s >= self.reset_after_s:
            self.current_s = 0.0
        delay = self.current_s
        self.current_s = self.base_s if self.current_s == 0 else min(self.max_s, self.current_s * 2)
        return delay


@dataclass
class ContainerRunner:
    spec: JSON
    kind: str
    log_path: Path
    backoff: Backoff
    proc: subprocess.Popen[bytes] | None = None
    state: JSON = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: JSON = field(default_factory=dict)
    restart_count: int = 0
    started: bool = False
    ready: bool = False
    completed: bool = False  # regular init container finished with exit 0 (sticky)
    next_start_at: float = 0.0
    started_mono: float = 0.0
    env: dict[str, str] = field(default_factory=dict)
    readiness: ProbeState | None = None
    liveness: ProbeState | None = None
    startup: ProbeState | None = None

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.running and self.proc is not None else None

    def view(self) -> ContainerView:
        return ContainerView(
            name=self.name,
            kind=self.kind,
            image=str(self.spec.get("image", "")),
            state=self.state,
            last_state=self.last_state,
            restart_count=self.restart_count,
            ready=self.ready,
            started=self.started,
            container_id=f"process://{self.proc.pid}" if self.proc is not None else "",
        )

    def set_waiting(self, reason: str, message: str = "") -> None:
        if "terminated" in self.state:
            self.last_state = {"terminated": self.state["terminated"]}
        waiting: JSON = {"reason": reason}
        if message:
            waiting["message"] = message
        self.state = {"waiting": waiting}
        self.started = self.ready = False

    def launch(self, argv: list[str], env: dict[str, str], now: float) -> None:
        """Start the process (stdout+stderr appended to the container's log file)."""
        if self.proc is not None:  # a restart: restartCount = instances started - 1
            self.restart_count += 1
        if "terminated" in self.state:
            self.last_state = {"terminated": self.state["terminated"]}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, close_fds=True, cwd="/",
            )
        self.env = env
        self.started_mono = now
        self.state = {"running": {"startedAt": rfc3339()}}
        self.started = False
        self.ready = False
        self.readiness = self._probe("readinessProbe", now, False)
        self.liveness = self._probe("livenessProbe", now, True)
        self.startup = self._probe("startupProbe", now, None)
        if self.startup is None:
            self.started = True

    def _probe(self, key: str, now: float, initial: bool | None) -> ProbeState | None:
        spec = self.spec.get(key)
        return ProbeState(spec, now, initial) if spec else None

    def reap(self) -> bool:
        """True when the process just exited (state becomes terminated)."""
        if self.proc is None or self.proc.returncode is not None:
            return False
        code = self.proc.poll()
        if code is None:
            return False
        _kill_group(self.proc.pid, signal.SIGKILL)
        self._record_exit(code)
        return True

    def _record_exit(self, code: int, reason: str | None = None) -> None:
        exit_code = 128 - code if code < 0 else code
        term: JSON = {
            "exitCode": exit_code,
            "reason": reason or ("Completed" if exit_code == 0 else "Error"),
            "startedAt": (self.state.get("running") or {}).get("startedAt", rfc3339()),
            "finishedAt": rfc3339(),
            "containerID": f"process://{self.proc.pid}" if self.proc else "",
        }
        if code < 0:
            term["signal"] = -code
        self.state = {"terminated": term}
        self.started = self.ready = False

    def signal(self, sig: int) -> None:
        if self.running and self.proc is not None:
            _kill_group(self.proc.pid, sig)

    def kill(self, grace_s: float) -> None:
        """SIGTERM the process group, wait up to `grace_s`, then SIGKILL; the state becomes terminated."""
        if not self.running or self.proc is None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=max(grace_s, 0.0))
        except subprocess.TimeoutExpired:
            log.info("grace period over, killing container=%s pid=%d", self.name, self.proc.pid)
            _kill_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        _kill_group(self.proc.pid, signal.SIGKILL)
        self._record_exit(self.proc.returncode)

    def wants_restart(self, restart_policy: str) -> bool:
        """Whether an exited container is started again (sidecars always are)."""
        term = self.state.get("terminated")
        if term is None:
            return False
        if self.kind == KIND_SIDECAR or restart_policy == "Always":
            return True
        return restart_policy == "OnFailure" and term.get("exitCode") != 0

    def schedule_restart(self, now: float) -> float:
        ran_for = now - self.started_mono if self.started_mono else 0.0
        delay = self.backoff.next_delay(ran_for)
        self.next_start_at = now + delay
        return delay
