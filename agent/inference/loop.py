"""The inference loop: each step picks the version to load (the pod's target when Kubernetes is on, else the
newest every trainer agent announced), fetches its slices from the trainer agents and loads them into the
engine (agent/transfer/fetch.py), commits only after everything arrived, and restores the last good version
into an engine a failed load left with mixed weights. Strategy Atomic (agent/atomic.py) prepares into host
memory and commits when the operator says so. Progress and results go to the pod and the metrics."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weightsync.agent import atomic
from weightsync.agent.config import AgentConfig, TopologyWatcher
from weightsync.agent.engines.base import EngineError, EngineUnsupported
from weightsync.agent.engines.factory import engine_takes_full_tensors
from weightsync.agent.inference.engine import EngineState
from weightsync.agent.membership import InferenceSlot, inference_slot
from weightsync.agent.metrics import AgentMetrics
from weightsync.agent.plan import TensorShard, TransferPlan
from weightsync.agent.podstate import Desired, synced_state
from weightsync.agent.podstatus import PodLink
from weightsync.agent.staging.index import StagingError
from weightsync.agent.transfer.fetch import FetchError, TrainerPeers, fetch_version
from weightsync.agent.transfer.groups import TransportCache, group_for, proposal_of
from weightsync.agent.transfer.relay import RelayServer
from weightsync.crds import contract
from weightsync.crds.topology import Topology

log = logging.getLogger("weightsync.agent")

PROGRESS_INTERVAL = 1.0  # seconds between two progress writes on the pod (API load)
# A load shows progress on the pod only once it has lasted this long: a load done sooner costs one pod write
# per version (its report), not three (first bucket, last bucket, report), which at hundreds of pods is
# most of the API server's work per version.
PROGRESS_AFTER = float(os.environ.get("WEIGHTSYNC_PROGRESS_AFTER_SECONDS", str(PROGRESS_INTERVAL)))


def checked_digest(res: Any) -> str | None:
    """A fetch's content digest when every piece was checked against its sender's hash (agent/transfer/digest.py)."""
    digest = getattr(res, "digest", "")
    return str(digest) if digest and getattr(res, "digest_checked", False) else None


def full_layout(names: dict[str, TensorShard], world: int, tp: int) -> list[list[TensorShard]]:
    """The needs of an engine that takes full tensors (SGLang, vLLM): every tensor whole, on one rank."""
    return [[TensorShard.full(n, s.dtype, s.global_shape) for n, s in sorted(names.items())]]


@dataclass
class _WireCount:
    """A transport's byte counters when a version's fetch took it (GDR's `stats`), to account the version."""

    transport: Any
    full_bytes: int
    wire_bytes: int
    delta_buckets: int


def _wire_of(used: dict[int, _WireCount]) -> tuple[int, int]:
    """(bytes saved on the wire, buckets received as deltas) by the transports since they were taken."""
    saved = buckets = 0
    for w in used.values():
        st = w.transport.stats
        saved += (st.full_bytes - w.full_bytes) - (st.wire_bytes - w.wire_bytes)
        buckets += st.delta_buckets - w.delta_buckets
    return saved, buckets


class InferenceLoop:
    """One inference agent's loads. The agent's loop thread calls `step` (and `on_topology` when the topology
    changed); `desired` is the operator's current wish, `pod` the pod link once started (None without
    Kubernetes), `report` writes the agent's pod report, of which `pod_fields` is the inference part."""

    def __init__(self, cfg: AgentConfig, engine: EngineState, *, peers: TrainerPeers, slot: InferenceSlot,
                 cache: TransportCache, relay: RelayServer | None, watcher: TopologyWatcher, metrics: AgentMetrics,
                 token: bytes, session: str, mode: str, verify: bool, wake: threading.Event,
                 desired: Callable[[], Desired], pod: Callable[[], PodLink | None],
                 report: Callable[[], None]) -> None:
        self.cfg = cfg
        self.engine = engine
        self.peers = peers
        self.islot = slot
        self.cache = cache
        # fanOut Relay (agent/transfer/relay.py): what this agent receives is forwarded to the next replica
        self.relay = relay
        self.watcher = watcher
        self.metrics = metrics
        self.token = token
        self.session = session
        self.mode = mode
        self.verify = verify
        self.wake = wake
        self.desired = desired
        self.pod = pod
        self.report = report
        self.last_error: str | None = None
        self.last_sync: dict[str, Any] | None = None
        self.held: atomic.Held | None = None  # strategy Atomic: the prepared version (agent/atomic.py)
        self._attempt = 0
        self._loading = False  # a version is being fetched and loaded (progress is reported)
        self._engine_copied = 0  # the Custom adapter's copied_bytes already counted in the metrics
        self._prepare_failed: int | None = None  # the version whose last Atomic prepare failed
        self._relay_next = True  # offer to relay on the next fetch (not right after a failed one: direct then)

    def on_topology(self, topo: Topology) -> None:
        """A new topology: the trainer agents to fetch from, and this pod's replica slot."""
        self.peers.update(topo)
        slot = inference_slot(topo, self.cfg.pod_name)
        if slot is not None:
            self.islot = slot

    def pod_fields(self, latest: int | None) -> dict[str, Any]:
        """The inference side of the pod report (nothing until the engine said what it serves: a restarted
        agent knows nothing yet, and reporting "stale" now would flap readiness for an engine that is in fact
        up to date; the pod keeps its last report)."""
        e = self.engine
        desired = self.desired()
        state = atomic.CommitState(desired.commit, desired.committed)
        if not (e.known or state.draining):
            return {}
        fields: dict[str, Any] = {}
        ok, reason, msg = synced_state(latest, e.served, self.cfg.max_staleness)
        if e.unreachable_message is not None:  # held until the engine answers again
            ok, reason, msg = False, contract.REASON_ENGINE_UNREACHABLE, e.unreachable_message
        if state.committed is not None and (state.draining or e.unreachable_message is None):
            # Atomic: Ready only on the committed version; a drain is acknowledged whatever else holds
            ok, reason, msg = atomic.ready(e.served_key(state.committed[0]), state)
        if not self._loading:  # the load under way reports its own progress
            fields["sync_progress"] = None
            self.metrics.sync_progress_buckets.set(0)
            self.metrics.sync_progress_bytes.set(0)
        fields.update(prepared_version=self.held.version if self.held else None,
                      prepared_epoch=self.held.epoch if self.held else None)
        self.metrics.prepared_version.set(self.held.version if self.held else 0)
        self.metrics.prepared_bytes.set(self.held.nbytes if self.held else 0)
        fields.update(served_version=e.served, served_epoch=e.served_epoch, served_digest=e.served_digest,
                      engine_paused=e.user_paused, last_sync=self.last_sync,
                      sync_error=self.last_error, synced=ok, synced_reason=reason, synced_message=msg)
        return fields

    # --- one step -------------------------------------------------------------------------------------
    def step(self) -> None:
        e = self.engine
        if self.cfg.engine_type == "Custom" and not e.registry.connected():
            e.unreachable(f"no engine connected to the agent socket {self.cfg.socket_path} "
                          "(the engine process opens an InferenceSession)")
            self.report()
            return
        if self.cfg.engine_type == "Custom" and e.unreachable_since is not None:
            e.reached()
        if e.refused is not None:
            return
        if not e.known:
            if self.cfg.engine_type != "Custom":
                try:  # an HTTP engine that outlived a restarted agent already serves some version
                    check = getattr(e.adapter, "check_engine_version", None)
                    if check is not None:
                        release = check()
                        log.info("engine release %s %s is supported", self.cfg.engine_type, release)
                    e.adopt_served(e.adapter.served_version())
                except EngineUnsupported as exc:
                    self._refuse_engine(str(exc), exc.reason)
                    return
                except EngineError as exc:
                    log.info("engine not reachable yet: %s", exc)
                    e.unreachable(str(exc))
                    return
            e.known = True
            e.reached()
        e.apply_pause(self.desired().paused)
        if self._atomic_step():
            return
        target = self.target()
        self.metrics.target_version.set(target[1] if target else e.served or 0)
        if target is None:
            self.report()
            return
        self._fetch(target[1], target[0])

    def target(self) -> tuple[int, int] | None:
        """(trainer epoch, version) to load next, None when nothing newer is wanted or available."""
        available = self.peers.latest_available()
        desired = self.desired()
        if self.cfg.kube_enabled and desired.target_version is not None:
            target = (desired.target_epoch, desired.target_version)
            served = self.engine.served_key(target[0])
            if served is not None and served >= target:
                return None
            # allowed to load: take the newest staged version at least as new (an older one may be evicted)
            if available is not None and available >= target:
                return available
            return None
        if available is None:
            return None
        served = self.engine.served_key(available[0])
        if served is not None and served >= available:
            return None
        return available

    def _refuse_engine(self, message: str, reason: str) -> None:
        """An engine this agent cannot drive (an unsupported release, a configuration that cannot work):
        reported once on the pod (Synced=False with `reason`) and in the log; no load is attempted (it
        could not succeed)."""
        self.engine.refused = message
        self.last_error = message
        self.engine.known = True
        log.error("engine refused: %s", message)
        pod = self.pod()
        if pod is not None:
            pod.update(served_version=self.engine.served, sync_error=message, synced=False,
                       synced_reason=reason, synced_message=message)

    def _engine_died(self, error: str) -> None:
        """The engine process died under the load (SGLang's tensor path: a loader error kills its scheduler):
        nothing is restored into it, nothing is served until a restarted engine loads a whole version. Reported
        at once (reason EngineUnreachable); the engine is checked afresh when it answers again."""
        e = self.engine
        e.served = None
        e.served_digest = None
        e.held_paused = False
        self.peers.report_served(0)
        e.lost(error)

    def _back_off(self) -> None:
        """After a failed attempt: wait (exponentially longer, at most 5 s), then step again."""
        time.sleep(min(0.2 * 2 ** min(self._attempt, 5), 5.0))
        self.wake.set()

    # --- strategy Atomic ------------------------------------------------------------------------------
    def _atomic_step(self) -> bool:
        """strategy Atomic (agent/atomic.py): prepare, wait or commit; False leaves the step to the ordinary
        path (Rolling, or loading the committed version directly)."""
        d = self.desired()
        state = atomic.CommitState(d.commit, d.committed)
        target = (d.target_epoch, d.target_version) if d.target_version is not None else None
        served = self.engine.served_key(d.committed[0] if d.committed else 0)
        if self.held is not None and (state.committed is None or self.held.key not in (target, state.commit,
                                                                                        state.committed)):
            log.info("dropping the prepared version=%s (superseded)", self.held.version)
            self.held = None
        action = atomic.decide(served, self.held.key if self.held else None, target, state)
        if action in (atomic.ROLLING, atomic.LOAD):
            return False
        if action == atomic.PREPARE and target is not None:
            self._fetch(target[1], target[0], hold=atomic.HoldingAdapter(
                target[0], fault=d.inject_fault if d.inject_fault == "prepare" else None,
                timeout=float(self.cfg.timeout_seconds)))
        elif action == atomic.COMMIT_HELD and self.held is not None:
            self._commit_held(self.held)
        else:
            self.report()
        return True

    def _commit_held(self, held: atomic.Held) -> None:
        e = self.engine
        t0 = time.perf_counter()
        try:
            if held.buckets:  # none: the engine takes full tensors from replica rank 0's agent, not this one
                atomic.commit_held(held, e.guarded(), pause_generation=self.cfg.pause_generation)
        except EngineError as exc:
            self.last_error = f"loading the prepared version {held.version}: {exc}"
            self.metrics.versions.labels("failed").inc()
            if getattr(e.adapter, "needs_restore", False):
                e.served = None  # mixed weights; the engine stays out of the Service until it loads the version
                e.served_digest = None
            log.warning("atomic commit failed version=%s error=%s", held.version, exc)
            self.report()
            self._attempt += 1
            self._back_off()
            return
        took = time.perf_counter() - t0
        self.held = None
        e.served, e.served_epoch, e.served_digest = held.version, held.epoch, held.digest
        self.last_error = None
        self.last_sync = {"version": held.version, "durationSeconds": round(took, 4), "bytes": held.nbytes,
                          "mode": self.mode, **({"relayedFrom": held.relayed_from[0]} if held.relayed_from else {})}
        self.metrics.served_version.set(held.version)
        self.metrics.versions.labels("committed").inc()
        log.info("version committed (atomic) version=%s bytes=%s seconds=%.3f", held.version, held.nbytes, took)
        self.report()
        self.peers.report_served(held.version, held.epoch)
        self.wake.set()

    # --- fetch and load -------------------------------------------------------------------------------
    def _fetch(self, version: int, trainer_epoch: int = 0, hold: atomic.HoldingAdapter | None = None) -> None:
        """Fetch `version` and load it into the engine; with `hold` (Atomic prepare) into host memory only."""
        e = self.engine
        topo = self.watcher.current
        rep = self.islot.replica
        g = group_for(topo, rep.replica, self.cfg.pod_name)
        store_host = next((p.ip for p in topo.trainer.pods if p.name == g.members[0]), None)
        group = {"name": g.name, "generation": topo.generation,
                 "store": [store_host or self.cfg.pod_ip, self.cfg.transport_port]}

        used: dict[int, _WireCount] = {}

        def transport_for(gr: dict[str, Any], plan: TransferPlan, role: str) -> Any:
            got = self.cache.get(gr, plan, role=role)
            st = getattr(got[0], "stats", None)
            if id(got[0]) not in used and all(hasattr(st, k) for k in ("full_bytes", "wire_bytes", "delta_buckets")):
                assert st is not None
                used[id(got[0])] = _WireCount(got[0], st.full_bytes, st.wire_bytes, st.delta_buckets)
            return got

        full = engine_takes_full_tensors(self.cfg.engine_type)
        my_ranks = ([0] if 0 in self.islot.member.ranks else []) if full else self.islot.member.ranks
        if not my_ranks:
            if hold is not None:  # nothing to hold: replica rank 0's agent holds the full tensors
                self.held = atomic.Held(version, trainer_epoch)
                self.report()
            return  # the engine's HTTP endpoint (replica rank 0's pod) loads the full tensors for all ranks
        t0 = time.perf_counter()

        def fetch(v: int, pause: bool) -> Any:
            return fetch_version(
                v, peers=self.peers, topo=topo, replica=rep.replica, my_ranks=my_ranks,
                layout_fn=full_layout if full else e.layout_fn,
                adapter=e.guarded() if hold is None else hold,
                transport_for=transport_for, group=group, bucket_bytes=self.cfg.bucket_size_mb << 20,
                proposal=proposal_of(self.session, self._attempt, self.peers.trainer_sessions(),
                                     self.cache.relay_evictions),
                pause_generation=pause, port=self.cfg.control_port, token=self.token,
                expand_aliases=self.cfg.engine_type == "Custom", verify=self.verify, device=self.cfg.device,
                timeout=self.cfg.timeout_seconds, progress=self._progress_reporter(v),
                relay=self.relay.hub if self.relay is not None and self._relay_next else None, pod=self.cfg.pod_name,
            )

        if hold is not None:
            self._hold(version, lambda v: fetch(v, False), hold)
            self._relay_next = self._prepare_failed is None  # after a failed prepare: directly from the trainer
            return
        prev, prev_epoch = e.served, e.served_epoch
        e.restore_version = prev
        self._loading = True
        try:
            res = fetch(version, self.cfg.pause_generation)
        except (FetchError, EngineError, StagingError) as exc:
            self._relay_next = False  # the next attempt asks the trainer agents directly
            self._loading = False
            e.restore_version = None
            if getattr(exc, "reason", None) == contract.REASON_ENGINE_UNREACHABLE:
                self._engine_died(str(exc))
            elif getattr(e.adapter, "needs_restore", False):
                e.served = None  # mixed weights: not served until a complete version is loaded
                e.served_digest = None
                if prev is None:
                    self.peers.report_served(0)
                if e.held_paused and prev is not None:
                    self._attempt += 1  # a new proposal: the failed version's plan agreement is spent
                    self.cache.drop(g.name, role_prefix="dst")
                    self._restore(prev, lambda v: fetch(v, False))
                    if e.served is not None:
                        e.served_epoch = prev_epoch
            self._attempt += 1
            self.cache.drop(g.name, role_prefix="dst")
            self.last_error = str(exc)
            self.metrics.versions.labels("failed").inc()
            log.warning("sync failed version=%s attempt=%s error=%s", version, self._attempt, exc)
            self.report()
            self._back_off()
            return
        self._loading = False
        self._relay_next = True
        took = time.perf_counter() - t0
        e.served = version
        e.served_epoch = trainer_epoch
        e.served_digest = checked_digest(res)
        self.last_error = None
        self.last_sync = {"version": version, "durationSeconds": round(took, 4), "bytes": res.bytes, "mode": self.mode,
                          **({"relayedFrom": res.relayed_from[0]} if res.relayed_from else {})}
        self._account(version, res, took, used)
        self.report()
        self.peers.report_served(version, trainer_epoch)  # trainer agents answer wait_served from these reports
        self.wake.set()

    def _account(self, version: int, res: Any, took: float, used: dict[int, _WireCount]) -> None:
        """Count a committed version in the metrics and log it (tests and docs read the `version committed`
        line, its `stall=` included)."""
        e = self.engine
        self.metrics.served_version.set(version)
        self.metrics.versions.labels("committed").inc()
        self.metrics.transfer_bytes.labels("received", self.mode).inc(res.bytes)
        self.metrics.digest_bytes.labels("received", "hashed").inc(res.digest_bytes)
        self.metrics.digest_bytes.labels("received", "reused").inc(res.digest_reused_bytes)
        saved, delta_buckets = _wire_of(used)
        wire = max(0, res.bytes - saved)
        self.metrics.wire_bytes.labels(self.mode).inc(wire)
        self.metrics.delta_buckets.inc(delta_buckets)
        self.metrics.received_buckets.inc(sum(x.buckets for x in res.stats))
        self.metrics.verified_bytes.inc(res.verified_bytes)
        self.metrics.sync_seconds.labels(self.mode).observe(took)
        st = res.stats
        self.metrics.copied_bytes.labels("unpack").inc(sum(x.copied_bytes for x in st))
        engine_copied = getattr(e.adapter, "copied_bytes", None)
        if isinstance(engine_copied, int):
            self.metrics.copied_bytes.labels("engine_pack").inc(max(0, engine_copied - self._engine_copied))
            self._engine_copied = engine_copied
        stall = f" stall={e.last_stall:.3f}" if self.cfg.pause_generation and e.last_stall is not None else ""
        e.last_stall = None
        log.info("version committed version=%s bytes=%s wire_bytes=%s delta_buckets=%s seconds=%.3f handshake=%.3f "
                 "wait=%.3f engine_load=%.3f%s", version, res.bytes, wire, delta_buckets, took,
                 sum(x.handshake_seconds for x in st), sum(x.wait_seconds for x in st), sum(x.load_seconds for x in st),
                 stall)

    def _restore(self, version: int, fetch: Callable[[int], Any]) -> None:
        """Reload `version` (the last good one) into an engine a failed load left with mixed weights, while
        it is still paused; resume it afterwards whatever happens (never left paused)."""
        e = self.engine
        try:
            log.warning("restoring version=%s into the engine after a failed load", version)
            res = fetch(version)
            e.served = version
            e.served_digest = checked_digest(res)
            log.info("restored version=%s", version)
        except (FetchError, EngineError, StagingError) as exc:
            e.served = None  # the engine's weights are mixed: not served until a full version loads
            e.served_digest = None
            self.peers.report_served(0)  # wait_served must not count this replica any more
            log.error("restore of version=%s failed: %s; the engine serves no complete version", version, exc)
        finally:
            e.held_paused = False
            if not e.user_paused:
                try:
                    e.adapter.resume()
                except EngineError as exc:
                    log.error("engine resume after restore failed: %s", exc)

    def _hold(self, version: int, fetch: Callable[[int], Any], hold: atomic.HoldingAdapter) -> None:
        """Atomic prepare: fetch and verify `version` into host memory; the engine is not touched."""
        if self._prepare_failed is not None and self._prepare_failed != version:
            self.last_error = None  # a new round: the last one's error is not this one's
        self._loading = True
        try:
            res = fetch(version)
            if res is not None:  # what came over the wire, as for a load (the commit later moves nothing)
                self.metrics.transfer_bytes.labels("received", self.mode).inc(res.bytes)
            if hold.complete is None:
                raise FetchError(f"version {version} was not complete")
        except (FetchError, EngineError, StagingError) as exc:
            self._loading = False
            self._prepare_failed = version
            self._attempt += 1
            g = group_for(self.watcher.current, self.islot.replica.replica, self.cfg.pod_name)
            self.cache.drop(g.name, role_prefix="dst")
            self.last_error = f"atomic prepare: {exc.__cause__ or exc}"  # not "was not committed"
            self.metrics.versions.labels("failed").inc()
            log.warning("atomic prepare failed version=%s attempt=%s error=%s", version, self._attempt, exc)
            self.report()
            self._back_off()
            return
        self._loading = False
        self._prepare_failed = None
        self.held = hold.complete
        if res is not None:
            self.held.relayed_from = list(res.relayed_from)
        self.last_error = None
        log.info("version prepared (held, not served) version=%s bytes=%s", version, self.held.nbytes)
        self.report()
        self.wake.set()

    def _progress_reporter(self, version: int) -> Callable[[int, int, int, int], None]:
        """Report a load's progress on the pod (annotation weightsync.io/sync-progress, then
        status.inferenceReplicas[].progress) once it has lasted PROGRESS_AFTER, then at most once a second
        (the version's report follows the last bucket at once), and count it in the metrics."""
        start = time.monotonic()
        last = [start - PROGRESS_INTERVAL]

        def report(bucket: int, buckets: int, nbytes: int, total: int) -> None:
            self.metrics.sync_progress_buckets.set(bucket)
            self.metrics.sync_progress_bytes.set(nbytes)
            now = time.monotonic()
            pod = self.pod()
            if pod is None or bucket >= buckets or now - start < PROGRESS_AFTER or now - last[0] < PROGRESS_INTERVAL:
                return
            last[0] = now
            pod.update(sync_progress={"version": version, "bucket": bucket, "buckets": buckets,
                                      "bytes": nbytes, "totalBytes": total})

        return report
