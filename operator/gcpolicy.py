"""Garbage collection of a process whose heap is mostly its watch caches.

Why: the caches hold every owned object (at 2,257 pods some 300,000 container objects). CPython's full
(generation 2) collection walks all of them and stops every thread meanwhile, the event loop and the pass
that writes a job's status included; it runs whenever a quarter of the heap is new since the last one.
Measured with bench/operator_scale.py (1,000 nodes, 2,257 pods): two full collections of 0.31 s each during
the 20 versions of the 256-pod job, each inside a version's publish -> status.

The cached objects are plain JSON (dicts, lists, strings: no reference cycles), so reference counting frees
them and the cycle collector need not look at them. Once the caches are synced, and then every
FREEZE_EVERY_S, every live object moves to the permanent generation (`gc.freeze`, a list splice), so a full
collection walks only what was allocated since. Every COLLECT_EVERY_S everything is unfrozen and collected
once: a cycle that was alive at a freeze and died since is reclaimed then, so nothing is held longer.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any

from weightsync.operator import metrics as m

log = logging.getLogger(__name__)

FREEZE_EVERY_S = 30.0
COLLECT_EVERY_S = 600.0


_gc_started: list[float] = []


def _time_full_collections(phase: str, info: dict[str, Any]) -> None:
    """gc.callbacks hook: times generation-2 collections (the cheap, frequent younger ones are skipped)."""
    if info.get("generation") != 2:
        return
    if phase == "start":
        _gc_started[:] = [time.perf_counter()]
    elif _gc_started:
        m.GC_PAUSE.observe(time.perf_counter() - _gc_started.pop())  # (no logging here: it may hold its lock)


def time_gc() -> None:
    """Measure the process's full garbage collections from now on (once per process)."""
    if _time_full_collections not in gc.callbacks:
        gc.callbacks.append(_time_full_collections)


def freeze() -> int:
    """Move every live object out of the collector's reach; returns how many are frozen now."""
    gc.freeze()
    return gc.get_freeze_count()


def collect_all() -> float:
    """Unfreeze, collect everything once, freeze again; returns the pause in seconds."""
    t0 = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - t0


def due(now: float, last_collect: float) -> str:
    """What the next tick does: "collect" once COLLECT_EVERY_S passed since the last full collection, else
    "freeze"."""
    return "collect" if now - last_collect >= COLLECT_EVERY_S else "freeze"


async def run(first_freeze: asyncio.Event) -> None:
    """Freeze once `first_freeze` is set (the caches hold the whole picture), then on schedule."""
    await first_freeze.wait()
    log.info("gc.freeze objects=%d (the synced watch caches)", freeze())
    last_collect = time.monotonic()
    while True:
        await asyncio.sleep(FREEZE_EVERY_S)
        if due(time.monotonic(), last_collect) == "collect":
            pause = collect_all()
            last_collect = time.monotonic()
            log.info("gc.collect_all pause_s=%.3f frozen=%d", pause, gc.get_freeze_count())
        else:
            freeze()
