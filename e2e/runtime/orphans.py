"""Leftover container processes: every container gets WEIGHTSYNC_PROCESS_RUNTIME_ID=<id of the state
dir> in its environment, so a runtime can find and kill what a crashed predecessor (or a child that left
its process group) left running. Scans /proc/*/environ; cheap at the scale of a dev machine."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

log = logging.getLogger(__name__)
RUNTIME_ID_ENV = "WEIGHTSYNC_PROCESS_RUNTIME_ID"


def marked_pids(runtime_id: str, proc: Path = Path("/proc")) -> list[int]:
    """PIDs of live processes whose environment carries this runtime id."""
    needle = f"{RUNTIME_ID_ENV}={runtime_id}".encode()
    found = []
    me = os.getpid()
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def kill_marked(runtime_id: str) -> list[int]:
    """SIGKILL every process carrying the runtime id; returns their pids."""
    pids = marked_pids(runtime_id)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
    if pids:
        log.warning("killed leftover container processes runtime_id=%s pids=%s", runtime_id, pids)
    return pids
