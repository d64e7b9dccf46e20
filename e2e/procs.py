"""Child processes and loopback ports for the local control plane: start in a process group, stop with
SIGTERM then SIGKILL, and check that nothing is left behind."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("weightsync.e2e.procs")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask the kernel to SIGTERM the child when the thread that spawned it exits (no orphans if the test
    runner is killed). Linux only; a no-op elsewhere."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now, for a process that binds it a moment later.

    Picked at random outside the kernel's ephemeral range: a port the kernel picked (bind to 0) could be
    handed out again as the source port of any outgoing connection before its user bound it ("address
    already in use" for an operator's health port under CI load). Bindable both on HOST and on every
    address (servers such as kopf's health endpoint listen on 0.0.0.0)."""
    lo, hi = _ephemeral_range()
    pool = range(20000, lo) if lo > 21000 else range(hi + 1, 65535)
    rng = random.SystemRandom()
    for _ in range(500):
        port = rng.choice(pool)
        if port in _handed_out:
            continue
        try:
            for addr in dict.fromkeys((host, "0.0.0.0")):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((addr, port))
        except OSError:
            continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded machine: the kernel's pick
        s.bind((host, 0))
        return int(s.getsockname()[1])


def listening_ports() -> set[int]:
    """TCP ports in LISTEN state on this machine (from /proc/net/tcp{,6})."""
    ports: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "0A":  # TCP_LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def pid_alive(pid: int) -> bool:
    """True while PID exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is PGID."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            after = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(after[2]) == pgid and after[0] != "Z":
            members.append(int(entry.name))
    return members


def tail(path: Path, lines: int = 25) -> str:
    """The last LINES lines of a log file ('' if it does not exist)."""
    try:
        data = path.read_bytes()[-64 * 1024:]
    except OSError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


@dataclass
class Proc:
    """One long-running child in its own process group, its output in LOG_PATH."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str] | None = None
    die_with_parent: bool = True
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> Proc:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.popen = subprocess.Popen(
                list(self.argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=dict(self.env) if self.env is not None else None, start_new_session=True,
                preexec_fn=_die_with_parent if self.die_with_parent else None, close_fds=True,
            )
        log.info("started name=%s pid=%s log=%s", self.name, self.popen.pid, self.log_path)
        return self

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self, lines: int = 25) -> str:
        return tail(self.log_path, lines)

    def signal_group(self, sig: int) -> None:
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def wait(self, timeout: float) -> bool:
        """Wait until the process has exited; True if it did within TIMEOUT."""
        if self.popen is None:
            return True
        try:
            self.popen.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False


def stop_all(procs: Iterable[Proc], grace: float = 10.0) -> None:
    """SIGTERM every group at once, wait up to GRACE seconds, SIGKILL what is left, reap everything."""
    procs = [p for p in procs if p.popen is not None]
    for p in procs:
        p.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        if not p.wait(max(0.0, deadline - time.monotonic())):
            log.warning("no exit after SIGTERM name=%s pid=%s grace_s=%s; sending SIGKILL", p.name, p.pid, grace)
            p.signal_group(signal.SIGKILL)
            p.wait(10.0)
        # Anything else that joined the group (none expected) goes too.
        if p.pid is not None and group_members(p.pid):
            p.signal_group(signal.SIGKILL)
        log.info("stopped name=%s pid=%s rc=%s", p.name, p.pid, p.popen.returncode if p.popen else None)
