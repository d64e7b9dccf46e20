"""spec.updatePolicy.strategy Atomic: the inference agent's side of the two-phase update.

The operator (operator/atomic.py) drives a round with three pod annotations: `target-version` (prepare
it), `commit-version` above `committed-version` (drain: leave the Service, load nothing), and
`committed-version` (serve it). This module holds the prepared version and decides what to do next.

Prepare fetches the version through the ordinary fetch path (plan, transports, checksums with
`verify: Checksum`, spec.transfer.timeoutSeconds) into `HoldingAdapter`, which copies every bucket into
host memory: nothing reaches the engine, which keeps serving the committed version. The commit replays the
held buckets into the engine with `load_version` (pause, begin, buckets, commit, resume). No engine holds a
staged version aside itself: SGLang and vLLM load in place, so with pauseGeneration they are paused for
the replay only (seconds from host memory, not the transfer); a Custom engine applies the version at its
own commit. Memory: one copy of this agent's share of the model (its ranks' slices; the full model on
rank 0's agent of an SGLang / vLLM replica) in host memory from prepare until the commit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from weightsync.agent.engines.base import EngineAdapter, EngineError, NamedTensors, RankRouter, load_version

log = logging.getLogger(__name__)

VersionKey = tuple[int, int]  # (trainer epoch, version)

# what the agent does next (decide)
ROLLING = "rolling"        # no commit annotations: the Rolling strategy
WAIT = "wait"              # nothing to do (prepared, up to date, or draining)
PREPARE = "prepare"        # fetch the target into host memory
COMMIT_HELD = "commit"     # load the held copy of the committed version into the engine
LOAD = "load"              # not serving the committed version and not holding it: fetch it into the engine


@dataclass(frozen=True)
class CommitState:
    commit: VersionKey | None = None
    committed: VersionKey | None = None

    @property
    def draining(self) -> bool:
        return self.commit is not None and self.committed is not None and self.commit > self.committed


def decide(served: VersionKey | None, held: VersionKey | None, target: VersionKey | None,
           state: CommitState) -> str:
    """The next step of a replica whose agent serves `served` and holds `held` prepared."""
    if state.committed is None:
        return ROLLING
    if state.draining:
        return WAIT  # every replica leaves the Service before anyone serves the new version
    if served != state.committed:
        return COMMIT_HELD if held == state.committed else LOAD
    if target is not None and target > state.committed and held != target:
        return PREPARE
    return WAIT


def ready(served: VersionKey | None, state: CommitState) -> tuple[bool, str, str]:
    """The readiness gate of an Atomic replica: True only while it serves the committed version and no
    switch is under way. (status, reason, message)"""
    assert state.committed is not None
    c = state.committed[1]
    if state.draining and state.commit is not None:
        return False, "AtomicSwitching", f"all replicas switch from version {c} to {state.commit[1]} together"
    if served == state.committed:
        return True, "CommittedVersion", f"serving the committed version {c}"
    return False, "NotCommittedVersion", (f"serving {served[1] if served else 'nothing'}, committed version {c}: "
                                          "Ready once it serves the committed version")


class _Bucket(list[tuple[str, torch.Tensor]]):
    def __init__(self, tensors: NamedTensors, rank: int | None) -> None:
        super().__init__(tensors)
        self.rank = rank


@dataclass
class Held:
    """A prepared version: every bucket this agent's ranks need, in host memory, in arrival order."""

    version: int
    epoch: int
    buckets: list[tuple[int | None, list[tuple[str, torch.Tensor]], torch.device]] = field(default_factory=list)
    nbytes: int = 0
    digest: str | None = None  # its content digest, checked piece by piece as it arrived (agent/transfer/digest.py)
    relayed_from: list[str] = field(default_factory=list)  # fanOut Relay: the upstream pods it came through

    @property
    def key(self) -> VersionKey:
        return (self.epoch, self.version)

    def replay(self) -> Iterator[NamedTensors]:
        """The buckets as the engine adapter takes them (back on the device they arrived on, one at a time)."""
        for rank, tensors, device in self.buckets:
            yield _Bucket([(n, t.to(device)) for n, t in tensors], rank)


class HoldingAdapter:
    """An EngineAdapter that keeps every bucket in host memory instead of loading it (Atomic prepare).
    `timeout`: seconds the whole prepare may take (spec.transfer.timeoutSeconds); beyond, it fails (the
    transports bound each single wait by the same timeout, so a stalled prepare ends too)."""

    def __init__(self, epoch: int, fault: str | None = None, timeout: float | None = None) -> None:
        self.epoch = epoch
        self.fault = fault
        self.timeout = timeout
        self.started = time.monotonic()
        self.rank: int | None = None
        self.held: Held | None = None
        self.complete: Held | None = None
        self.label_digest: str | None = None  # set by the fetch before commit, as for an HTTP engine's adapter

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def _in_time(self, version: int) -> None:
        if self.timeout is not None and time.monotonic() - self.started > self.timeout:
            raise EngineError(f"the prepare of version {version} took longer than spec.transfer.timeoutSeconds="
                              f"{self.timeout:g}s")

    def begin_update(self, version: int) -> None:
        self.held, self.complete = Held(version, self.epoch), None

    def load_bucket(self, tensors: NamedTensors) -> None:
        assert self.held is not None
        if self.fault:
            raise RuntimeError(f"injected prepare fault ({self.fault})")
        self._in_time(self.held.version)
        rank = getattr(tensors, "rank", self.rank)
        device = tensors[0][1].device if tensors else torch.device("cpu")
        copy = [(n, t.detach().to("cpu", copy=True)) for n, t in tensors]  # the bucket's memory is reused
        self.held.buckets.append((rank, copy, device))
        self.held.nbytes += sum(t.numel() * t.element_size() for _, t in copy)

    def commit(self, version: int) -> None:
        assert self.held is not None and self.held.version == version
        self._in_time(version)
        self.held.digest, self.label_digest = self.label_digest, None
        self.complete, self.held = self.held, None

    def abort(self, version: int, reason: str) -> None:
        self.held = self.complete = None

    def served_version(self) -> int | None:
        return None


def commit_held(held: Held, adapter: EngineAdapter, *, pause_generation: bool) -> int:
    """Load the held version into the engine (pause, buckets, commit, resume); returns tensors loaded."""
    log.info("atomic commit: loading the prepared version=%s (%s bytes held) into the engine",
             held.version, held.nbytes)
    return load_version(RankRouter(adapter, lambda: held.digest), held.version, held.replay(),
                        pause_generation=pause_generation)
