"""A coalescing per-job work queue: at most one reconcile per job at a time, bursts collapse into one.

Watch events arrive in bursts (creating ten pods yields dozens of pod events); each only says "look at
job X again". A request while X is being reconciled sets a flag so X runs once more afterwards, never
concurrently. With a batch window, a reconcile starts that long after the first request, so the pod
events of one version (every replica commits at about the same time) become one pass and one status
write. Failures are retried with exponential backoff. The reconcile itself is synchronous (the
kubernetes client) and runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from weightsync.operator import metrics as m

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)

#: a pass that took longer than this from its first request to its end is logged with where the time went
SLOW_PASS_S = 0.5


class WorkQueue:
    def __init__(
        self,
        work: Callable[[str, str], Any],
        backoff_initial: float = 1.0,
        backoff_max: float = 60.0,
        batch_seconds: float = 0.0,
    ) -> None:
        self.work = work
        self.batch_seconds = batch_seconds
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self._running: dict[Key, asyncio.Task[None]] = {}
        self._again: dict[Key, float] = {}  # key -> how long to gather requests before its next pass
        self._failures: dict[Key, int] = {}
        self._retry: dict[Key, asyncio.TimerHandle] = {}
        self._asked: dict[Key, float] = {}  # key -> when its next pass was first asked for (time.monotonic)
        self.known: set[Key] = set()

    def request(self, key: Key, batch_seconds: float | None = None) -> None:
        """Ask for a reconcile of `key` soon; cheap and safe to call from any handler. BATCH_SECONDS (default
        the queue's): how long the pass waits for more requests to join it (agents' reports of one version
        arrive over a few hundred milliseconds: one pass and one status write for all, not one for each)."""
        self.known.add(key)
        self._asked.setdefault(key, time.monotonic())
        batch = self.batch_seconds if batch_seconds is None else batch_seconds
        if key in self._running:
            self._again[key] = max(self._again.get(key, 0.0), batch)
            return
        handle = self._retry.pop(key, None)
        if handle is not None:
            handle.cancel()
        self._running[key] = asyncio.get_running_loop().create_task(self._run(key, batch),
                                                                    name=f"reconcile:{key[0]}/{key[1]}")

    def forget(self, key: Key) -> None:
        self.known.discard(key)
        self._failures.pop(key, None)
        self._asked.pop(key, None)
        handle = self._retry.pop(key, None)
        if handle is not None:
            handle.cancel()

    async def _run(self, key: Key, batch: float) -> None:
        try:
            if batch > 0:
                await asyncio.sleep(batch)  # requests meanwhile join this pass
            while True:
                self._again.pop(key, None)
                asked = self._asked.pop(key, time.monotonic())
                try:
                    result = await asyncio.to_thread(self._timed, key, asked)
                except Exception as err:
                    n = self._failures.get(key, 0) + 1
                    self._failures[key] = n
                    delay = min(self.backoff_max, self.backoff_initial * 2 ** (n - 1))
                    log.error("reconcile failed job=%s/%s attempt=%d retry_in=%.1fs error=%r", key[0], key[1], n, delay,
                              err, extra={"job": f"{key[0]}/{key[1]}", "attempt": n})
                    loop = asyncio.get_running_loop()
                    self._retry[key] = loop.call_later(delay, self._retry_fire, key)
                    return
                self._failures.pop(key, None)
                if result is None:
                    self.known.discard(key)  # the job is gone
                if key not in self._again:
                    recheck = getattr(result, "recheck_after", None)
                    if recheck is not None and key in self.known:
                        # nothing will change on its own to say so (an Atomic drain waiting for gates to
                        # settle): pass again then; any request before that replaces this one
                        loop = asyncio.get_running_loop()
                        self._retry[key] = loop.call_later(max(0.05, float(recheck)), self._retry_fire, key)
                    return
                # requests made during the pass, and those right after, join; the window runs from the first
                # of them (as for a first pass), so time spent waiting for the pass to end is not added to it
                left = self._again[key] - (time.monotonic() - self._asked.get(key, time.monotonic()))
                if left > 0:
                    await asyncio.sleep(left)
        finally:
            self._running.pop(key, None)

    def _timed(self, key: Key, asked: float) -> Any:
        """The pass, in its worker thread: how long it waited (batch window, a free worker, the event loop)
        and ran go to a histogram, and a slow one to the log with the status write's share."""
        started = time.monotonic()
        m.RECONCILE_WAIT.observe(started - asked)
        result = self.work(*key)
        ended = time.monotonic()
        if ended - asked > SLOW_PASS_S:
            log.info("reconcile.slow job=%s/%s wait_s=%.3f run_s=%.3f status_write_s=%.3f", key[0], key[1],
                     started - asked, ended - started, float(getattr(result, "status_write_s", 0.0)),
                     extra={"job": f"{key[0]}/{key[1]}"})
        return result

    def _retry_fire(self, key: Key) -> None:
        self._retry.pop(key, None)
        if key in self.known:
            self.request(key)

    async def drain(self) -> None:
        """Wait for in-flight reconciles (used at shutdown and in tests)."""
        while self._running:
            await asyncio.gather(*list(self._running.values()), return_exceptions=True)

    def cancel_all(self) -> None:
        for handle in self._retry.values():
            handle.cancel()
        self._retry.clear()
        for task in self._running.values():
            task.cancel()
