"""Plans computed once per layout, not once per version.

The reshard plan depends only on its inputs (every source rank's shards, every destination's needs, the
bucket size and alignment), which change when membership or layouts change, not when a new version is
published. Both sides of a transfer key it by the SHA-256 of the encoded inputs (the bytes the
destination sends the source), so a version with the same layout reuses the plan both sides agreed on
(plan.hash still travels with every transfer and is still checked). A transfer link may carry only the
key: the serving side then waits for the plan another link's inputs are building (`wait_for`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from weightsync.agent.plan import PlanError, PlanInputs, TransferPlan

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 8  # layouts kept: a few concurrent groups / replicas with different TP, and the last change
DEFAULT_MAX_BYTES = 4 << 30  # and at most this much plan memory (a 70k-tensor x 256-rank plan is ~1 GB)
REMEMBERED = 1024     # keys of plans built (or failed) that are remembered after eviction, to fail fast


class PlanCache:
    """An LRU of plans by input digest, bounded in count and in bytes (the newest plan always stays);
    thread-safe, one build per digest at a time."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if capacity < 1:
            raise ValueError("a plan cache holds at least one plan")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._plans: OrderedDict[str, TransferPlan] = OrderedDict()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._building: dict[str, threading.Lock] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()  # evicted or failed keys -> why
        self.hits = 0
        self.misses = 0
        self.build_seconds = 0.0

    @staticmethod
    def key(inputs: bytes | memoryview | PlanInputs) -> str:
        if isinstance(inputs, PlanInputs):
            return inputs.key  # computed once per inputs object
        return hashlib.sha256(inputs).hexdigest()

    def get_or_build(self, inputs: bytes | memoryview | PlanInputs, build: Callable[[], TransferPlan]) -> TransferPlan:
        """The plan for these encoded inputs: cached, or `build()` once (concurrent callers wait for it)."""
        return self.get_or_build_key(self.key(inputs), build)

    def get_or_build_key(self, digest: str, build: Callable[[], TransferPlan]) -> TransferPlan:
        with self._lock:
            plan = self._hit(digest)
            if plan is not None:
                return plan
            gate = self._building.setdefault(digest, threading.Lock())
        with gate:
            with self._lock:
                plan = self._hit(digest)
                if plan is not None:
                    return plan
            t0 = time.perf_counter()
            try:
                plan = build()  # a PlanError propagates and nothing is cached
            except Exception as exc:
                with self._lock:
                    self._building.pop(digest, None)
                    if isinstance(exc, PlanError):
                        self._remember(digest, f"its plan failed: {exc}")
                    self._changed.notify_all()
                raise
            took = time.perf_counter() - t0
            with self._lock:
                self.misses += 1
                self.build_seconds += took
                self._plans[digest] = plan
                self._gone.pop(digest, None)
                while len(self._plans) > self.capacity or (
                        len(self._plans) > 1 and sum(p.nbytes for p in self._plans.values()) > self.max_bytes):
                    old, _ = self._plans.popitem(last=False)
                    self._remember(old, "its plan was evicted from the cache")
                self._building.pop(digest, None)
                self._changed.notify_all()
            log.info("plan.built hash=%s buckets=%d seconds=%.3f cached=%d", plan.hash[:12], len(plan.buckets),
                     took, len(self._plans))
            return plan

    def wait_for(self, digest: str, timeout: float) -> TransferPlan:
        """The plan of `digest`, waiting up to `timeout` seconds for another caller to build it. Raises
        KeyError (saying why) when it does not appear, or was evicted or failed, so the caller can ask
        for the inputs again."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                plan = self._hit(digest)
                if plan is not None:
                    return plan
                why = self._gone.get(digest)
                if why is not None and digest not in self._building:
                    raise KeyError(why)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KeyError(f"no inputs for it arrived within {timeout:.0f}s")
                self._changed.wait(left)

    def _remember(self, digest: str, why: str) -> None:
        self._gone[digest] = why
        self._gone.move_to_end(digest)
        while len(self._gone) > REMEMBERED:
            self._gone.popitem(last=False)

    def _hit(self, digest: str) -> TransferPlan | None:
        plan = self._plans.get(digest)
        if plan is not None:
            self._plans.move_to_end(digest)
            self.hits += 1
        return plan

    def __len__(self) -> int:
        with self._lock:
            return len(self._plans)


PLANS = PlanCache()  # the agent process's cache (both the fetching and the serving side)
