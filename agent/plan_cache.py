"""Plans computed once per layout, not once per version.

The reshard plan depends only on its inputs (every source rank's shards, every destination's needs, the
bucket size and alignment), which change when membership or layouts change, not when a new version is
published. Both sides of a transfer key it by the SHA-256 of the encoded inputs (the bytes the
destination sends the source), so a version with the same layout reuses the plan both sides agreed on
(plan.hash still travels with every transfer and is still checked).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from weightsync.agent.plan import TransferPlan

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 8  # layouts kept: a few concurrent groups / replicas with different TP, and the last change


class PlanCache:
    """An LRU of plans by input digest; thread-safe, one build per digest at a time."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("a plan cache holds at least one plan")
        self.capacity = capacity
        self._plans: OrderedDict[str, TransferPlan] = OrderedDict()
        self._lock = threading.Lock()
        self._building: dict[str, threading.Lock] = {}
        self.hits = 0
        self.misses = 0
        self.build_seconds = 0.0

    @staticmethod
    def key(inputs: bytes | memoryview) -> str:
        return hashlib.sha256(inputs).hexdigest()

    def get_or_build(self, inputs: bytes | memoryview, build: Callable[[], TransferPlan]) -> TransferPlan:
        """The plan for these encoded inputs: cached, or `build()` once (concurrent callers wait for it)."""
        digest = self.key(inputs)
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
            plan = build()  # a PlanError propagates and nothing is cached
            took = time.perf_counter() - t0
            with self._lock:
                self.misses += 1
                self.build_seconds += took
                self._plans[digest] = plan
                while len(self._plans) > self.capacity:
                    self._plans.popitem(last=False)
                self._building.pop(digest, None)
            log.info("plan.built hash=%s buckets=%d seconds=%.3f cached=%d", plan.hash[:12], len(plan.buckets),
                     took, len(self._plans))
            return plan

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
