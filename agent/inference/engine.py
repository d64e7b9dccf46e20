"""What an inference agent knows of its engine: the version it serves (and that version's trainer epoch and
digest), whether spec.paused holds it paused, whether it is reachable or refused, and the layout a Custom
engine sent in its hello. The engine's side of the local socket (its hello and connection) comes in here; the
inference loop (agent/inference/loop.py) reads and updates this state around each load."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from weightsync.agent.config import AgentConfig
from weightsync.agent.engines.base import EngineAdapter, EngineError
from weightsync.agent.engines.custom import AppRegistry
from weightsync.agent.layout.engine import EngineLayout
from weightsync.agent.layout.rules import LayoutError
from weightsync.agent.metrics import AgentMetrics
from weightsync.agent.plan import TensorShard
from weightsync.agent.podstatus import PodLink
from weightsync.agent.transfer.fetch import FetchError
from weightsync.agent.wire import local
from weightsync.crds import contract

log = logging.getLogger("weightsync.agent")

# An engine not reachable for this long is reported (pod condition reason EngineUnreachable, the job's
# Degraded reason): long enough for a small engine to start, short enough that a wrong engine.port shows
# within a minute. A large model may take longer to start; the message says so.
ENGINE_UNREACHABLE_AFTER = float(os.environ.get("WEIGHTSYNC_ENGINE_UNREACHABLE_SECONDS", "30"))

NeedsFn = Callable[[dict[str, TensorShard], int, int], list[list[TensorShard]]]


class EngineState:
    """The agent's view of its engine. `report` writes the agent's pod report; `pod` is the pod link once the
    agent started (None without Kubernetes), for the conditions written at once."""

    def __init__(self, cfg: AgentConfig, adapter: EngineAdapter, registry: AppRegistry, *, metrics: AgentMetrics,
                 stop: threading.Event, wake: threading.Event, pod: Callable[[], PodLink | None],
                 report: Callable[[], None]) -> None:
        self.cfg = cfg
        self.adapter = adapter
        self.registry = registry
        self.metrics = metrics
        self.stop = stop
        self.wake = wake  # wakes the agent loop
        self.pod = pod
        self.report = report
        self.served: int | None = None
        self.served_epoch: int | None = None  # trainer epoch of `served` (None: unknown, e.g. an adopted version)
        self.served_digest: str | None = None  # content digest of `served` (agent/transfer/digest.py; None: unknown)
        self.reported_served: tuple[int | None, int | None] = (None, None)  # (served, epoch) on the pod at start
        self.user_paused = False
        self.known = False  # the engine reported its served version (hello or served_version())
        # a Custom engine's layout from its hello (agent/layout/engine.py), and the needs function made of it
        self.layout: EngineLayout | None = None
        self.layout_fn: NeedsFn | None = None
        self.restore_version: int | None = None  # the last good version while a load is in flight
        self.held_paused = False  # a failed load left the engine's weights mixed: paused until restored
        self.stall_started: float | None = None  # when a load paused generation (pauseGeneration)
        self.last_stall: float | None = None  # the last load's pause to resume, seconds
        self.refused: str | None = None  # an unsupported engine release: no load is attempted
        self.unreachable_since: float | None = None  # first failed attempt to reach the engine (monotonic)
        self.unreachable_reported = False
        self.unreachable_message: str | None = None

    # --- the engine's local connection ----------------------------------------------------------------
    def attach(self, conn: local.LocalConn, hello: dict[str, Any], rank: int) -> None:
        """An engine rank's connection (its hello read): take its layout and served version, then hold the
        connection until it closes or the agent stops."""
        served = hello.get("served_version")
        refused = self.take_layout(hello.get("layout"), rank)
        if refused:
            conn.reply_error(refused)
            return
        conn.reply_ok(pod=self.cfg.pod_name, role=self.cfg.role, job=self.cfg.job)
        # The engine is the truth about what it serves: a restarted agent adopts its version, a restarted
        # engine (None) is loaded again; a new engine process is not paused yet, so pause is re-applied.
        engine_served = served if isinstance(served, int) else None
        if engine_served != self.served:
            log.info("engine reports served=%s (agent had %s)", engine_served, self.served)
        self.adopt_served(engine_served if self.served is None or engine_served is None
                          else min(self.served, engine_served))
        # An engine left paused by a dead agent (killed mid-load) counts as paused; the loop then resumes
        # it unless spec.paused wants it paused.
        self.user_paused = hello.get("paused") is True
        self.registry.add(rank, conn, served if isinstance(served, int) else None)
        log.info("engine connected rank=%s served=%s", rank, served)
        self.wake.set()
        while not self.stop.is_set() and self.registry.holds(rank, conn):
            if local.peer_closed(conn.sock, 1.0):
                log.warning("engine disconnected rank=%s", rank)
                self.registry.remove(conn)
                break
        # the LocalServer closes the connection when this returns

    def take_layout(self, spec: Any, rank: int) -> str:
        """Take a Custom engine's layout from its hello (agent/layout/engine.py); the reason when refused. While
        ranks are connected, another rank must send the same layout (a replica has one); an engine whose ranks
        all left may come back with another."""
        others = [r for r in self.registry.ranks() if r != rank]
        if spec is None:
            if self.layout is not None and others:
                return (f"engine rank {rank} sends no layout, connected ranks {others} sent {self.layout.to_dict()}: "
                        "every rank of a replica must use the same layout")
            if self.layout is not None:
                log.warning("engine layout %s dropped: the default row split applies", self.layout.to_dict())
            self.layout, self.layout_fn = None, None
            return ""
        try:
            got = EngineLayout.from_dict(spec) if isinstance(spec, dict) else None
        except LayoutError as exc:
            return f"engine rank {rank}: bad layout: {exc}"
        if got is None:
            return f"engine rank {rank}: layout must be an object, got {type(spec).__name__}"
        if self.layout is not None and self.layout != got and others:
            return (f"engine rank {rank} sends layout {got.to_dict()}, connected ranks {others} sent "
                    f"{self.layout.to_dict()}: every rank of a replica must use the same layout")
        if self.layout != got:  # the first rank, or an engine restarted with another layout
            if self.layout is not None:
                log.warning("engine layout changes from %s", self.layout.to_dict())
            self.layout = got
            log.info("engine layout %s", got.to_dict())

            def needs(names: dict[str, TensorShard], world: int, tp: int) -> list[list[TensorShard]]:
                try:
                    return got.needs(names, world, tp)
                except LayoutError as exc:
                    raise FetchError(f"the engine's layout cannot lay out the model: {exc}") from None

            self.layout_fn = needs  # one object per layout: the fetcher caches needs and plans by it
        return ""

    # --- the served version ---------------------------------------------------------------------------
    def adopt_served(self, served: int | None) -> None:
        """Take the version the engine says it serves. Its trainer epoch is known only when it is the version
        this agent (or its predecessor, per its proven pod annotation) loaded; else it stays unknown."""
        if served == self.served and self.served_epoch is not None:
            return
        self.served = served
        before, epoch = self.reported_served
        self.served_epoch = epoch if served is not None and served == before else None
        self.served_digest = None  # not loaded by this agent: its content is not known

    def served_key(self, epoch_if_unknown: int) -> tuple[int, int] | None:
        """(trainer epoch, version) served; an unknown epoch counts as `epoch_if_unknown`."""
        if self.served is None:
            return None
        return (self.served_epoch if self.served_epoch is not None else epoch_if_unknown, self.served)

    # --- reachability -----------------------------------------------------------------------------------
    def unreachable(self, error: str) -> None:
        """Report (once) an engine that stayed unreachable for ENGINE_UNREACHABLE_AFTER seconds: the pod's
        synced condition False with reason EngineUnreachable and the error, which the operator passes on."""
        now = time.monotonic()
        if self.unreachable_since is None:
            self.unreachable_since = now
        waited = now - self.unreachable_since
        if self.unreachable_reported or waited < ENGINE_UNREACHABLE_AFTER:
            return
        self.unreachable_reported = True
        message = (f"the {self.cfg.engine_type} engine has not been reachable for {waited:.0f}s: {error}. "
                   "Check spec.inference.engine.port / url and the engine container's log (a large model can "
                   "take minutes to start)")[:1024]
        self.unreachable_message = message
        log.error("engine unreachable: %s", message)
        pod = self.pod()
        if pod is not None:  # the condition only: a sync-error annotation would read as SyncFailed first
            pod.update(synced=False, synced_reason=contract.REASON_ENGINE_UNREACHABLE, synced_message=message)

    def lost(self, error: str) -> None:
        """The engine process died under a load: it is checked afresh when it answers again, and reported
        unreachable at once."""
        self.known = False
        self.unreachable_since = time.monotonic() - ENGINE_UNREACHABLE_AFTER
        self.unreachable_reported = False
        self.unreachable(error)

    def reached(self) -> None:
        if self.unreachable_reported:
            log.info("engine reachable again")
        self.unreachable_since = None
        self.unreachable_reported = False
        self.unreachable_message = None

    # --- pause ----------------------------------------------------------------------------------------
    def apply_pause(self, want: bool) -> None:
        """Pause or resume the engine as spec.paused wants (`want`)."""
        if want == self.user_paused:
            return
        try:
            if want:
                self.adapter.pause()
            else:
                self.adapter.resume()
        except EngineError as exc:
            log.warning("engine %s failed: %s", "pause" if want else "resume", exc)
            return
        self.user_paused = want
        self.metrics.engine_paused.set(1 if want else 0)
        log.info("engine %s by spec.paused", "paused" if want else "resumed")
        self.report()

    def guarded(self) -> UserPauseGuard:
        """The adapter as a load drives it: pause and resume respect spec.paused and a pending restore."""
        return UserPauseGuard(self.adapter, self)

    def stall_ended(self) -> None:
        """Generation resumed after a load: how long it was paused (what a user's rollouts waited)."""
        if self.stall_started is not None:
            self.last_stall = time.perf_counter() - self.stall_started
            self.stall_started = None
            self.metrics.engine_stall_seconds.observe(self.last_stall)


class UserPauseGuard:
    """Wraps the adapter so a load during spec.paused neither pauses twice nor resumes the engine."""

    def __init__(self, inner: EngineAdapter, engine: EngineState) -> None:
        self.inner = inner
        self.engine = engine

    def pause(self) -> None:
        if not self.engine.user_paused:
            self.inner.pause()
            self.engine.stall_started = time.perf_counter()

    def resume(self) -> None:
        if getattr(self.inner, "needs_restore", False) and self.engine.restore_version is not None:
            # The engine holds a mix of two versions: it stays paused until the last good one is reloaded
            # (InferenceLoop.restore resumes it, also when that fails).
            self.engine.held_paused = True
            return
        if not self.engine.user_paused:
            self.inner.resume()
            self.engine.stall_ended()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("inner", "engine"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)  # e.g. the destination rank of the next bucket
