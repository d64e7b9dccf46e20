"""updatePolicy.strategy Atomic (operator/atomic.py): prepare on the commit set, drain, switch; a failed
prepare commits nothing and names the replica; a joining replica is not waited for."""

from __future__ import annotations

import datetime as dt

from test_status import T0, cond, pod

from weightsync.crds import contract
from weightsync.operator import atomic
from weightsync.operator.events import version_events
from weightsync.operator.placement import plan
from weightsync.operator.replicas import replica_states
from weightsync.operator.rollout import desired_annotations
from weightsync.operator.status import aggregate

N = 4


def _spec(separated):
    return separated(inference={"replicas": N, "gpusPerReplica": 1, "parallelism": {"tensor": 1}},
                     updatePolicy={"strategy": "Atomic"})


def _name(r):
    return f"demo-inference-{r}-0"


def _committed(v, commit=None):
    commit = v if commit is None else commit
    return {contract.ANN_COMMITTED_VERSION: str(v), contract.ANN_COMMIT_VERSION: str(commit)}


def _inf(r, served=1, target=1, prepared=None, ready=True, commit=(1, 1), acked=True, **ann):
    """An inference pod; `acked`: during a drain its agent acknowledged it (synced reason AtomicSwitching)."""
    a = dict(ann)
    if prepared is not None:
        a[contract.ANN_PREPARED_VERSION] = str(prepared)
    if commit is not None:
        a.update(_committed(commit[0], commit[1]))
    p = pod(_name(r), ready=ready, synced=ready, served=served, target=target, **a)
    if commit is not None and commit[1] > commit[0] and acked:
        p["status"]["conditions"][-1]["reason"] = contract.REASON_ATOMIC_SWITCHING
    return p


def _pods(p, trainer=2, **inference):
    pods = {n: pod(n, published=trainer) for n in p.trainer_pods}
    for r in range(N):
        pods[_name(r)] = inference.get(f"r{r}") or _inf(r)
    return pods


def _decide(spec, pods, trainer=(0, 2)):
    p = plan("demo", spec)
    return atomic.decide(replica_states(p, pods), pods, trainer), desired_annotations(
        spec, p, replica_states(p, pods), trainer, 1, pods)


def _ann(ann, key):
    return [ann[_name(r)].get(key) for r in range(N)]


def test_prepare_targets_the_commit_set_and_commits_nothing_yet(separated):
    spec = _spec(separated)
    pods = _pods(plan("demo", spec))
    r, ann = _decide(spec, pods)
    assert r.committed == (0, 1) and r.commit == (0, 1) and r.preparing == (0, 2)
    assert r.commit_set == frozenset(range(N)) and r.failure is None
    assert _ann(ann, contract.ANN_TARGET_VERSION) == ["2"] * N
    assert _ann(ann, contract.ANN_COMMIT_VERSION) == ["1"] * N
    assert _ann(ann, contract.ANN_COMMITTED_VERSION) == ["1"] * N


def test_every_replica_prepared_starts_the_drain_then_the_switch(separated):
    spec = _spec(separated)
    p = plan("demo", spec)
    pods = _pods(p, **{f"r{i}": _inf(i, target=2, prepared=2) for i in range(N)})
    r, ann = _decide(spec, pods)
    assert r.commit == (0, 2) and r.committed == (0, 1) and r.switching  # drain: commit above committed
    assert _ann(ann, contract.ANN_COMMIT_VERSION) == ["2"] * N
    assert _ann(ann, contract.ANN_COMMITTED_VERSION) == ["1"] * N
    # while one pod is still Ready (its agent has not left the Service yet) nothing is committed
    draining = {f"r{i}": _inf(i, target=2, prepared=2, commit=(1, 2), ready=i == 3) for i in range(N)}
    r, ann = _decide(spec, _pods(p, **draining))
    assert r.committed == (0, 1) and r.commit == (0, 2)
    # NotReady, but one agent has not acknowledged the drain (it could still turn Ready on version 1)
    unacked = {f"r{i}": _inf(i, target=2, prepared=2, commit=(1, 2), ready=False, acked=i != 0) for i in range(N)}
    r, ann = _decide(spec, _pods(p, **unacked))
    assert r.committed == (0, 1)
    # every pod NotReady and drained: the switch
    gone = {f"r{i}": _inf(i, target=2, prepared=2, commit=(1, 2), ready=False) for i in range(N)}
    r, ann = _decide(spec, _pods(p, **gone))
    assert r.committed == (0, 2) and r.commit == (0, 2) and not r.switching
    assert _ann(ann, contract.ANN_COMMITTED_VERSION) == ["2"] * N
    assert _ann(ann, contract.ANN_TARGET_VERSION) == ["2"] * N


def _since(p, type_, when):
    """Set a condition's lastTransitionTime as the API server stores it (whole seconds)."""
    c = next(c for c in p["status"]["conditions"] if c["type"] == type_)
    c["lastTransitionTime"] = when.strftime("%Y-%m-%dT%H:%M:%SZ")
    return p


def test_the_switch_waits_until_the_kubelet_has_seen_every_gate_turn_false(separated):
    """The race the four-replica e2e test caught: replica 0 had just loaded the committed version (its gate
    True, the kubelet not yet caught up: Ready still False) when the drain began and its gate turned False
    again. A NotReady pod whose Ready condition is older than its gate's last change may still be made Ready
    on the old version by a kubelet working from its older copy of the pod: not drained until Ready changed
    after the gate did, or the gate has been False for DRAIN_SETTLE_S."""
    spec = _spec(separated)
    p = plan("demo", spec)
    t = T0 + dt.timedelta(minutes=5)
    gone = {f"r{i}": _inf(i, target=2, prepared=2, commit=(1, 2), ready=False) for i in range(N)}
    for i in range(1, N):  # Ready left after the gate did: the kubelet saw it
        _since(_since(gone[f"r{i}"], contract.POD_CONDITION_SYNCED, t), "Ready", t + dt.timedelta(seconds=1))
    late = gone["r0"]
    _since(_since(late, contract.POD_CONDITION_SYNCED, t), "Ready", T0)  # NotReady since it started
    pods = _pods(p, **gone)
    states = replica_states(p, pods)
    settle = atomic.DRAIN_SETTLE_S + atomic.TIME_PRECISION_S
    r = atomic.decide(states, pods, (0, 2), now=t + dt.timedelta(seconds=0.5))
    assert r.committed == (0, 1) and r.commit == (0, 2)  # still draining
    assert r.recheck_after is not None and abs(r.recheck_after - (settle - 0.5)) < 1e-6
    assert r.settling == (_name(0),)
    ann = desired_annotations(spec, p, states, (0, 2), 1, pods, now=t + dt.timedelta(seconds=0.5))
    assert _ann(ann, contract.ANN_COMMITTED_VERSION) == ["1"] * N
    # the gate has been False long enough: every kubelet has computed Ready from it
    r = atomic.decide(states, pods, (0, 2), now=t + dt.timedelta(seconds=settle))
    assert r.committed == (0, 2) and r.recheck_after is None
    # or the kubelet changed Ready after the gate (it made the pod Ready once, then NotReady again)
    _since(late, "Ready", t)
    r = atomic.decide(states, pods, (0, 2), now=t + dt.timedelta(seconds=0.5))
    assert r.committed == (0, 2) and r.recheck_after is None
    # a pod still Ready: no recheck timer, its own change brings the operator back
    pods = _pods(p, **{**gone, "r0": _inf(0, target=2, prepared=2, commit=(1, 2), ready=True)})
    r = atomic.decide(replica_states(p, pods), pods, (0, 2), now=t)
    assert r.committed == (0, 1) and r.recheck_after is None


def test_a_failed_prepare_keeps_every_replica_on_the_committed_version(separated):
    spec = _spec(separated)
    p = plan("demo", spec)
    bad = _inf(2, target=2, **{contract.ANN_SYNC_ERROR: "prepare of version 2 failed: checksum mismatch"})
    pods = _pods(p, r0=_inf(0, target=2, prepared=2), r1=_inf(1, target=2, prepared=2), r2=bad,
                 r3=_inf(3, target=2, prepared=2))
    r, ann = _decide(spec, pods)
    assert r.commit == (0, 1) and r.committed == (0, 1)  # nothing committed
    assert r.failure is not None and r.failure.replica == 2 and r.failure.pod == _name(2)
    assert _ann(ann, contract.ANN_COMMITTED_VERSION) == ["1"] * N
    assert _ann(ann, contract.ANN_TARGET_VERSION) == ["2"] * N  # the agents retry with back-off
    st = aggregate(spec, 1, p, pods, None, 1, now=T0)
    synced = cond(st, contract.COND_SYNCED)
    assert synced.status == "False" and synced.reason == atomic.REASON_PREPARE_FAILED
    assert "replica 2" in synced.message and _name(2) in synced.message and "checksum mismatch" in synced.message
    assert "stays on version 1" in synced.message and st.committed_version == 1
    events = version_events({}, st.to_dict())
    assert any(e[0] == "Warning" and e[1] == atomic.REASON_PREPARE_FAILED and _name(2) in e[2] for e in events)
    # the trainer published a newer version: the round retries with it
    pods = {**pods, **{n: pod(n, published=3) for n in p.trainer_pods}}
    r, ann = _decide(spec, pods, (0, 3))
    assert r.preparing == (0, 3) and _ann(ann, contract.ANN_TARGET_VERSION) == ["3"] * N


def test_a_replica_that_never_reports_fails_the_round_once_the_operators_clock_runs_out(separated):
    spec = _spec(separated)
    p = plan("demo", spec)
    silent = _inf(2, target=2)  # targeted, no prepared-version and no sync-error: a hung agent
    pods = _pods(p, r0=_inf(0, target=2, prepared=2), r1=_inf(1, target=2, prepared=2), r2=silent,
                 r3=_inf(3, target=2, prepared=2))
    states = replica_states(p, pods)
    clock, deadline = atomic.PrepareClock(), spec.transfer.timeout_seconds + atomic.PREPARE_GRACE_S
    preparing = atomic.decide(states, pods, (0, 2)).preparing
    assert preparing == (0, 2)
    assert clock.overdue(("ns", "demo"), preparing, 100.0, deadline) is None  # first seen: the clock starts
    assert clock.overdue(("ns", "demo"), preparing, 100.0 + deadline, deadline) is None  # not yet
    assert clock.overdue(("ns", "other"), preparing, 100.0 + deadline + 1, deadline) is None  # per job
    overdue = clock.overdue(("ns", "demo"), preparing, 100.0 + deadline + 1, deadline)
    assert overdue is not None and overdue.version == (0, 2)

    r = atomic.decide(states, pods, (0, 2), overdue)
    assert r.commit == (0, 1) and r.failure is not None and r.failure.replica == 2 and r.failure.pod == _name(2)
    st = aggregate(spec, 1, p, pods, None, 1, now=T0, atomic_overdue=overdue)
    synced = cond(st, contract.COND_SYNCED)
    assert synced.reason == atomic.REASON_PREPARE_FAILED and "did not report version 2 prepared" in synced.message
    assert "stays on version 1" in synced.message and st.committed_version == 1
    ann = desired_annotations(spec, p, states, (0, 2), 1, pods, overdue)
    assert _ann(ann, contract.ANN_COMMITTED_VERSION) == ["1"] * N  # nothing committed
    # the trainer publishes 3: the round retries with it, and the clock starts again for version 3
    r = atomic.decide(states, pods, (0, 3), overdue)
    assert r.preparing == (0, 3) and r.failure is None
    assert clock.overdue(("ns", "demo"), r.preparing, 100.0 + deadline + 2, deadline) is None
    # once every replica prepared, an old overdue verdict does not stop the drain
    pods = {**pods, _name(2): _inf(2, target=2, prepared=2)}
    assert atomic.decide(replica_states(p, pods), pods, (0, 2), overdue).commit == (0, 2)


def test_a_joining_replica_is_not_waited_for(separated):
    spec = _spec(separated)
    p = plan("demo", spec)
    new = _inf(3, served=None, target=None, ready=False, commit=None)  # scaled up / restarted: serves nothing
    pods = _pods(p, **{f"r{i}": _inf(i, target=2, prepared=2) for i in range(3)}, r3=new)
    r, ann = _decide(spec, pods)
    assert r.commit_set == frozenset({0, 1, 2}) and r.commit == (0, 2)  # the drain starts without replica 3
    assert ann[_name(3)][contract.ANN_TARGET_VERSION] == "1"  # it loads the committed version directly


def test_nothing_serving_commits_the_first_version_at_once(separated):
    spec = _spec(separated)
    p = plan("demo", spec)
    pods = _pods(p, trainer=1, **{f"r{i}": _inf(i, served=None, target=None, ready=False, commit=None)
                                  for i in range(N)})
    r, ann = _decide(spec, pods, (0, 1))
    assert r.committed == (0, 1) and r.commit == (0, 1)
    assert _ann(ann, contract.ANN_TARGET_VERSION) == ["1"] * N


def test_nothing_ready_goes_through_the_drain_too(separated):
    """No replica Ready on the committed version (all restarting, loading): no prepare, but the switch to a
    newer version still waits for every pod to acknowledge the drain (one may be about to turn Ready)."""
    spec = _spec(separated)
    p = plan("demo", spec)
    pods = _pods(p, **{f"r{i}": _inf(i, ready=False) for i in range(N)})
    r, ann = _decide(spec, pods)
    assert r.commit_set == frozenset() and r.committed == (0, 1) and r.commit == (0, 2)
    assert _ann(ann, contract.ANN_COMMIT_VERSION) == ["2"] * N and _ann(ann, contract.ANN_COMMITTED_VERSION) == ["1"] * N


def test_rolling_clears_leftover_commit_annotations(separated):
    spec = separated(inference={"replicas": N, "gpusPerReplica": 1, "parallelism": {"tensor": 1}})
    p = plan("demo", spec)
    pods = _pods(p)
    ann = desired_annotations(spec, p, replica_states(p, pods), (0, 2), 1, pods)
    assert _ann(ann, contract.ANN_COMMITTED_VERSION) == [""] * N
    fresh = {**pods, _name(0): pod(_name(0), served=1)}
    ann = desired_annotations(spec, p, replica_states(p, fresh), (0, 2), 1, fresh)
    assert contract.ANN_COMMITTED_VERSION not in ann[_name(0)]


def test_after_a_switch_the_replicas_loading_their_prepared_copy_are_waited_for(separated):
    """The trainer published version 3 while every replica still loads its prepared copy of the committed
    version 2 (just switched): no drain to 3 before they serve 2 and are Ready, else a trainer publishing
    faster than a switch keeps every replica out of the Service for good (the four-replica e2e test saw no
    Ready replica in 320 of 326 samples in CI). Once they are Ready on 2, the next round prepares 3 while
    they serve. A replica fetching 2 from the trainer (joining, or without a prepared copy) is not waited
    for: the others must not wait on it, and the trainer may have moved past 2."""
    spec = _spec(separated)
    p = plan("demo", spec)
    switching = {f"r{i}": _inf(i, served=1, target=2, prepared=2, ready=False, commit=(2, 2)) for i in range(N)}
    pods = _pods(p, trainer=3, **switching)
    r, ann = _decide(spec, pods, (0, 3))
    assert r.committed == (0, 2) and r.commit == (0, 2) and r.preparing is None
    assert r.awaiting == tuple(sorted(_name(i) for i in range(N))) and r.recheck_after is None
    assert _ann(ann, contract.ANN_COMMIT_VERSION) == ["2"] * N and _ann(ann, contract.ANN_TARGET_VERSION) == ["2"] * N
    # Ready on 2: an ordinary round, 3 is prepared while they serve 2
    pods = _pods(p, trainer=3, **{f"r{i}": _inf(i, served=2, target=2, commit=(2, 2)) for i in range(N)})
    r, ann = _decide(spec, pods, (0, 3))
    assert r.commit_set == frozenset(range(N)) and r.preparing == (0, 3) and r.commit == (0, 2) and not r.awaiting
    assert _ann(ann, contract.ANN_TARGET_VERSION) == ["3"] * N
    # fetching 2 from the trainer (no prepared copy): straight to the drain to 3, as before
    fetching = {f"r{i}": _inf(i, served=1, target=2, ready=False, commit=(2, 2)) for i in range(N)}
    pods = _pods(p, trainer=3, **fetching)
    r, _ = _decide(spec, pods, (0, 3))
    assert r.commit == (0, 3) and not r.awaiting
    # a joining replica fetching 2 does not hold the drain back either, while one switching is waited for
    pods = _pods(p, trainer=3, **{**fetching, "r1": switching["r1"]})
    r, _ = _decide(spec, pods, (0, 3))
    assert r.commit == (0, 2) and r.awaiting == (_name(1),)


def test_a_replica_serving_the_committed_version_is_waited_for_only_while_its_kubelet_catches_up(separated):
    """Served 2, gate True, Ready still False: the kubelet has not caught up yet, so wait DRAIN_SETTLE_S after
    the gate turned True; past that it is NotReady for another reason, and the drain to 3 goes on."""
    spec = _spec(separated)
    p = plan("demo", spec)
    t = T0 + dt.timedelta(minutes=5)
    lagging = {f"r{i}": _since(_inf(i, served=2, target=2, ready=False, commit=(2, 2)), "Ready", T0)
               for i in range(N)}
    for i in range(N):  # the gate is True (synced), the pod not Ready yet
        c = next(c for c in lagging[f"r{i}"]["status"]["conditions"] if c["type"] == contract.POD_CONDITION_SYNCED)
        c["status"] = "True"
        _since(lagging[f"r{i}"], contract.POD_CONDITION_SYNCED, t)
    pods = _pods(p, trainer=3, **lagging)
    states = replica_states(p, pods)
    settle = atomic.DRAIN_SETTLE_S + atomic.TIME_PRECISION_S
    r = atomic.decide(states, pods, (0, 3), now=t + dt.timedelta(seconds=1))
    assert r.commit == (0, 2) and len(r.awaiting) == N
    assert r.recheck_after is not None and abs(r.recheck_after - (settle - 1)) < 1e-6
    r = atomic.decide(states, pods, (0, 3), now=t + dt.timedelta(seconds=settle + 0.1))
    assert r.commit == (0, 3) and not r.awaiting  # straight to the drain, as before


def test_a_replica_failing_to_switch_to_the_committed_version_is_not_waited_for(separated):
    spec = _spec(separated)
    p = plan("demo", spec)
    failing = {f"r{i}": _inf(i, served=1, target=2, prepared=2, ready=False, commit=(2, 2),
                             **{contract.ANN_SYNC_ERROR: "engine refused the load"}) for i in range(N)}
    pods = _pods(p, trainer=3, **failing)
    r, _ = _decide(spec, pods, (0, 3))
    assert r.commit == (0, 3) and not r.awaiting
    # one loading healthily is enough to wait for (the others' errors are theirs to retry)
    pods = _pods(p, trainer=3, **{**failing, "r2": _inf(2, served=1, target=2, prepared=2, ready=False, commit=(2, 2))})
    r, _ = _decide(spec, pods, (0, 3))
    assert r.commit == (0, 2) and r.awaiting == (_name(2),)
