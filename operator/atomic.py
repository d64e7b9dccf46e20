"""spec.updatePolicy.strategy Atomic: the operator's side of the two-phase update (pure decisions).

A round moves every serving replica from the committed version C to N (the trainer's newest) together:

1. prepare: the commit set (replicas Ready and serving C when the round starts) get target N; their agents
   fetch and verify N into host memory without touching the engine and report `prepared-version` N (with
   the version proof: a container cannot forge it). Replicas outside the commit set (new, scaled up,
   restarted, not Ready) are not waited for: their target is C, which they load directly (they are out of
   the Service, so loading costs nothing), and they join the next round.
2. drain: once every replica of the commit set prepared N, `commit-version` N goes on every inference pod.
   Agents turn their readiness gate False (every replica leaves the routing Service) and load nothing yet.
3. switch: once the operator sees no inference pod Ready, `committed-version` N: agents load their prepared
   copy into the engine (pause, load, commit, resume) and are Ready again when they serve N. A replica
   whose gate says Ready serves `committed-version`, so two Ready replicas never serve different versions.

With no replica Ready on C (just switched, or all starting) a newer version skips the prepare and goes
straight to the drain, but only once no replica is about to serve C (`ready_wait`: switching to the copy of
C it holds prepared, or serving C with the kubelet not caught up yet): otherwise a trainer publishing faster
than a switch takes would start each drain before the last switch made anybody Ready, and no replica would
ever be Ready.

The drain makes the switch safe although pods are patched one by one: no replica can be Ready at N before
every replica stopped being Ready at C. "Stopped" means the kubelet evaluated the pod's readiness gate after
the gate turned False: a kubelet computes Ready from its own (possibly older) copy of the pod, so a replica
whose gate turned True just before the drain (it had just loaded C) can still be made Ready at C once, after
the gate is False again. A NotReady pod counts as drained when its Ready condition last changed at or after
its gate did, or when the gate has been False for DRAIN_SETTLE_S (any kubelet has seen it by then); the
operator checks again when that time is up (`AtomicRound.recheck_after`). The price is a short gap with no
Ready replica (the load from host memory), which on-policy RL accepts (it waits for the new version anyway).

A round whose prepare failed on a replica (its agent reports `sync-error`, e.g. a fetch, a checksum or the
timeout of spec.transfer.timeoutSeconds) does not commit: every replica keeps serving C. The agents retry
with back-off; once the trainer publishes a newer version the round moves to it (retry with the next
version). Once the drain started a round is never aborted (it only waits for pods to leave the Service).

A replica whose agent says nothing (hung, or cut off from the API server) would hold a round in prepare
for ever: the operator also keeps a clock (`PrepareClock`). A round that has prepared the same version
for longer than spec.transfer.timeoutSeconds + PREPARE_GRACE_S (the agent's own deadline fires first
when the agent works) fails like any other prepare, naming the first replica that did not report.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from weightsync.crds import contract
from weightsync.operator import podstate
from weightsync.operator.replicas import ReplicaState, VersionKey

REASON_PREPARE_FAILED = "AtomicPrepareFailed"
REASON_PREPARING = "AtomicPreparing"
REASON_SWITCHING = "AtomicSwitching"
PREPARE_GRACE_S = 60.0  # beyond the agents' own transfer deadline, before the operator calls a prepare overdue
#: how long after a readiness gate turned False every kubelet has computed Ready from it (a kubelet reacts to a
#: pod update within a watch event and one pod sync: well under a second; twice that here)
DRAIN_SETTLE_S = 2.0
#: conditions' lastTransitionTime has second precision: a gate that turned False at 12:00:00.9 reads 12:00:00
TIME_PRECISION_S = 1.0


@dataclass(frozen=True)
class PrepareFailure:
    version: VersionKey
    replica: int
    pod: str
    error: str

    def message(self, committed: VersionKey | None) -> str:
        stay = f"; every replica stays on version {committed[1]}" if committed is not None else ""
        return (f"replica {self.replica} (pod {self.pod}) failed to prepare version {self.version[1]}: "
                f"{self.error}{stay}")[:2000]


@dataclass(frozen=True)
class AtomicRound:
    """What the operator asks of the inference pods of an Atomic job, and why."""

    committed: VersionKey | None          # the version Ready replicas serve
    commit: VersionKey | None             # above `committed`: the drain / switch to it is under way
    targets: dict[int, VersionKey | None] = field(default_factory=dict)
    commit_set: frozenset[int] = frozenset()
    preparing: VersionKey | None = None   # the version the commit set prepares
    failure: PrepareFailure | None = None
    #: the drain waits only for gates to settle (drain_wait): pass again after this many seconds
    recheck_after: float | None = None
    settling: tuple[str, ...] = ()  # the pods it waits for
    #: no replica Ready on `committed` yet: the pods about to serve it that the next round waits for
    awaiting: tuple[str, ...] = ()

    @property
    def switching(self) -> bool:
        return self.commit is not None and self.committed is not None and self.commit > self.committed


def annotation_key(pod: Mapping[str, Any], version_key: str, epoch_key: str) -> VersionKey | None:
    v = podstate.int_annotation(pod, version_key)
    return None if v is None else (podstate.int_annotation(pod, epoch_key) or 0, v)


def prepared_key(pod: Mapping[str, Any]) -> VersionKey | None:
    """The version the pod's agent holds prepared (believe only pods whose proofs were checked)."""
    return annotation_key(pod, contract.ANN_PREPARED_VERSION, contract.ANN_PREPARED_EPOCH)


def _max(keys: Iterable[VersionKey | None]) -> VersionKey | None:
    known = [k for k in keys if k is not None]
    return max(known) if known else None


def drain_wait(pod: Mapping[str, Any], now: datetime) -> float | None:
    """0.0 once the pod left the Service for the switch; the seconds until it counts as gone when only its
    gate's settling is missing; None while it is Ready or its agent has not acknowledged the drain.

    Gone: NotReady, its agent acknowledged (its synced condition says AtomicSwitching, written after it saw
    commit-version, False until the committed version moves; or it has no synced condition yet: a new pod's
    agent reads commit-version before it writes one), and the kubelet has computed Ready from the gate as it
    is now: Ready changed at or after the gate did, or the gate has been False for DRAIN_SETTLE_S. A NotReady
    pod whose kubelet still holds an older, True gate could turn Ready on the old version."""
    if podstate.is_ready(pod):
        return None
    detail = podstate.condition_detail(pod, contract.POD_CONDITION_SYNCED)
    if detail is None:
        return 0.0
    if detail[0] != contract.REASON_ATOMIC_SWITCHING:
        return None
    gate_since = podstate.condition_since(pod, contract.POD_CONDITION_SYNCED)
    if gate_since is None:
        return 0.0  # a condition without a transition time (not written by an agent): nothing to compare
    ready_since = podstate.condition_since(pod, "Ready")
    if ready_since is not None and ready_since >= gate_since:
        return 0.0
    return max(0.0, _settle_left(gate_since, now))


def _settle_left(gate_since: datetime, now: datetime) -> float:
    """Seconds until every kubelet has computed Ready from a gate that changed at GATE_SINCE (negative: past)."""
    return DRAIN_SETTLE_S + TIME_PRECISION_S - (now - gate_since).total_seconds()


def ready_wait(s: ReplicaState, pods: Mapping[str, Mapping[str, Any]], committed: VersionKey,
               now: datetime) -> float | None:
    """How long a replica that is not Ready may still be waited for before a newer version's drain: it is
    about to serve COMMITTED. 0.0 (no timer: its own pod update brings the operator back) while it switches
    to the copy of COMMITTED it holds prepared (a load from host memory); the seconds left while it serves
    COMMITTED, its gate True and the kubelet not caught up yet (DRAIN_SETTLE_S after the gate turned True, as
    for the drain); None when it is not worth waiting for: Ready already, incomplete, failing, reporting a
    sync error, NotReady for another reason, or fetching COMMITTED from the trainer (a joining replica, which
    must not hold the others back, or one that may find the trainer has moved past COMMITTED)."""
    if s.ready or not s.complete:
        return None
    live = [pods[n] for n in s.pod_names if podstate.is_live(pods.get(n))]
    if any(podstate.sync_error(p) or podstate.failure(p, now) for p in live):
        return None
    if s.served_key != committed and _replica_prepared(s, pods) == committed:
        return 0.0
    if s.served_key != committed or not s.synced_condition:
        return None
    since = [podstate.condition_since(p, contract.POD_CONDITION_SYNCED) for p in live]
    if any(t is None for t in since):
        return None
    left = _settle_left(max(t for t in since if t is not None), now)
    return left if left > 0.0 else None


def _replica_prepared(s: ReplicaState, pods: Mapping[str, Mapping[str, Any]]) -> VersionKey | None:
    keys = [prepared_key(pods[n]) for n in s.pod_names if podstate.is_live(pods.get(n))]
    if not keys or any(k is None for k in keys):
        return None
    return min(k for k in keys if k is not None)


def _failure(s: ReplicaState, pods: Mapping[str, Mapping[str, Any]], version: VersionKey) -> PrepareFailure | None:
    for n in s.pod_names:
        pod = pods.get(n)
        if podstate.is_live(pod) and pod is not None and (err := podstate.sync_error(pod)):
            return PrepareFailure(version, s.replica, n, err)
    return None


def decide(states: list[ReplicaState], pods: Mapping[str, Mapping[str, Any]],
           trainer: VersionKey | None, overdue: OverduePrepare | None = None,
           now: datetime | None = None) -> AtomicRound:
    """The round's state from the observed pods (level-triggered: the operator's own commit annotations on
    the pods are its memory, so a restarted operator carries on). OVERDUE: the version whose prepare the
    operator's clock says took too long (see PrepareClock). NOW: wall-clock time (the drain compares it with
    the pods' condition times)."""
    now = now or datetime.now(timezone.utc)
    live = [pods[n] for s in states for n in s.pod_names if podstate.is_live(pods.get(n))]
    committed = _max(annotation_key(p, contract.ANN_COMMITTED_VERSION, contract.ANN_COMMITTED_EPOCH) for p in live)
    commit = _max(annotation_key(p, contract.ANN_COMMIT_VERSION, contract.ANN_COMMIT_EPOCH) for p in live)
    if committed is None:  # a new job, or one switched from Rolling: what the serving replicas serve
        served = [s.served_key for s in states if s.serving and s.served_key is not None]
        committed = min(served) if served else trainer
    if committed is None:  # nothing published yet
        return AtomicRound(None, None, {s.replica: s.target_key for s in states})
    if commit is None or commit < committed:
        commit = committed

    if commit > committed:  # drain, then switch: final, never aborted
        waits = {str((p.get("metadata") or {}).get("name")): drain_wait(p, now) for p in live}
        recheck: float | None = None
        settling: tuple[str, ...] = ()
        if all(w == 0.0 for w in waits.values()):
            committed = commit
        elif all(w is not None for w in waits.values()):
            # only gates settling: no pod event will say when they have
            recheck = max(w for w in waits.values() if w is not None)
            settling = tuple(sorted(n for n, w in waits.items() if w))
        serving = frozenset(s.replica for s in states if s.serving and s.served_key in (committed, commit))
        return AtomicRound(committed, commit, {s.replica: commit for s in states}, serving, commit,
                           recheck_after=recheck, settling=settling)

    commit_set = frozenset(s.replica for s in states if s.serving and s.ready and s.served_key == committed)
    newer = trainer if trainer is not None and trainer > committed else None
    if not commit_set and newer is not None:
        # nobody Ready on C: first let the replicas about to serve C do so (loading their prepared copy, or
        # Ready in a moment), else a trainer publishing faster than a switch keeps every replica out of the
        # Service for good: each drain would start before the last switch made anybody Ready
        about: dict[str, float] = {}
        for s in states:
            if (left := ready_wait(s, pods, committed, now)) is not None:
                about.update(dict.fromkeys(s.pod_names, left))
        if about:
            timed = [left for left in about.values() if left > 0.0]
            return AtomicRound(committed, commit, {s.replica: committed for s in states}, commit_set,
                               recheck_after=max(timed) if timed else None, awaiting=tuple(sorted(about)))
    if not commit_set:  # nobody to prepare: straight to the drain (a replica may be about to turn Ready)
        return AtomicRound(committed, newer or commit, {s.replica: committed for s in states}, commit_set,
                           newer)
    members = [s for s in states if s.replica in commit_set]
    version = _max(s.target_key for s in members if s.target_key is not None and s.target_key > committed)
    failure = None
    if version is not None:
        failure = next((f for s in members if _replica_prepared(s, pods) != version
                        and (f := _failure(s, pods, version)) is not None), None)
    if failure is None and version is not None and overdue is not None and overdue.version == version:
        failure = next((PrepareFailure(version, s.replica, s.pod_names[0], overdue.message)
                        for s in members if _replica_prepared(s, pods) != version), None)
    if version is None or (failure is not None and newer is not None and newer > version):
        version = newer  # a new round, or a failed one retried with the trainer's newer version
        failure = None if version is None else next(
            (f for s in members if _replica_prepared(s, pods) != version
             and (f := _failure(s, pods, version)) is not None), None)
    if version is None:
        return AtomicRound(committed, commit, {s.replica: committed for s in states}, commit_set)
    if all(_replica_prepared(s, pods) == version for s in members):
        commit = version  # every replica of the commit set holds it: the drain starts
        failure = None
    targets: dict[int, VersionKey | None] = {
        s.replica: version if s.replica in commit_set else committed for s in states
    }
    return AtomicRound(committed, commit, targets, commit_set, version, failure)


@dataclass(frozen=True)
class OverduePrepare:
    version: VersionKey
    message: str


class PrepareClock:
    """When this operator process first saw each job's round prepare its version (in memory: after a restart
    the clock starts again, which only delays the verdict)."""

    def __init__(self) -> None:
        self._since: dict[tuple[str, str], tuple[VersionKey, float]] = {}

    def overdue(self, job: tuple[str, str], preparing: VersionKey | None, now: float,
                deadline_s: float) -> OverduePrepare | None:
        """Note that JOB's round prepares PREPARING (None: no prepare under way) at NOW; the prepare if it
        has lasted longer than DEADLINE_S."""
        if preparing is None:
            self._since.pop(job, None)
            return None
        seen = self._since.get(job)
        if seen is None or seen[0] != preparing:
            self._since[job] = (preparing, now)
            return None
        if now - seen[1] <= deadline_s:
            return None
        return OverduePrepare(preparing, f"did not report version {preparing[1]} prepared within {deadline_s:.0f} s "
                                         "(spec.transfer.timeoutSeconds + 60 s): its agent is hung or cannot "
                                         "reach the API server; check its log")

    def forget(self, job: tuple[str, str]) -> None:
        self._since.pop(job, None)


def pod_annotations(r: AtomicRound) -> dict[str, str]:
    """The commit annotations every inference pod of the job carries."""
    if r.committed is None or r.commit is None:
        return {}
    return {
        contract.ANN_COMMIT_VERSION: str(r.commit[1]), contract.ANN_COMMIT_EPOCH: str(r.commit[0]),
        contract.ANN_COMMITTED_VERSION: str(r.committed[1]), contract.ANN_COMMITTED_EPOCH: str(r.committed[0]),
    }
