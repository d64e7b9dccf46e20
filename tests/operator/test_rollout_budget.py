"""maxUnavailable budget: a stuck replica (NotReady, or its load failed) does not block the others."""

from __future__ import annotations

from test_status import pod

from weightsync.crds import contract
from weightsync.operator.placement import plan
from weightsync.operator.replicas import replica_states
from weightsync.operator.rollout import desired_annotations, replica_targets


def _spec(separated):
    return separated(inference={"replicas": 3, "gpusPerReplica": 1, "parallelism": {"tensor": 1}},
                     updatePolicy={"maxUnavailable": 1, "maxStaleness": 1})


def _pods(p, **inference):
    pods = {n: pod(n, published=2) for n in p.trainer_pods}
    for r in range(3):
        pods[f"demo-inference-{r}-0"] = inference.get(f"r{r}") or pod(f"demo-inference-{r}-0", synced=True,
                                                                       served=1, target=1)
    return pods


def target(ann, r):
    return ann[f"demo-inference-{r}-0"][contract.ANN_TARGET_VERSION]


def test_a_healthy_load_holds_the_budget(separated):
    spec = _spec(separated)
    p = plan("demo", spec)
    pods = _pods(p, r0=pod("demo-inference-0-0", synced=True, served=1, target=2))
    ann = desired_annotations(spec, p, replica_states(p, pods), (0, 2), 1, pods)
    assert [target(ann, r) for r in range(3)] == ["2", "1", "1"]


def test_a_failed_load_releases_the_budget(separated):
    spec = _spec(separated)
    p = plan("demo", spec)
    stuck = pod("demo-inference-0-0", synced=True, served=1, target=2,
                **{contract.ANN_SYNC_ERROR: "engine /update_weights timed out after 600s"})
    pods = _pods(p, r0=stuck)
    ann = desired_annotations(spec, p, replica_states(p, pods), (0, 2), 1, pods)
    assert [target(ann, r) for r in range(3)] == ["2", "2", "1"]  # one more may load; the budget is still 1
    # Without the pods (no sync-error view) the stuck replica keeps holding it.
    assert replica_targets(spec, replica_states(p, pods), (0, 2)) == {0: (0, 2), 1: (0, 1), 2: (0, 1)}


def test_a_not_ready_replica_neither_holds_nor_waits_for_the_budget(separated):
    spec = _spec(separated)
    p = plan("demo", spec)
    hung = pod("demo-inference-0-0", ready=False, synced=False, served=1, target=2)    # fell beyond maxStaleness
    stale = pod("demo-inference-2-0", ready=False, synced=False, served=1, target=1)   # out of endpoints already
    pods = _pods(p, r0=hung, r2=stale)
    states = replica_states(p, pods)
    assert replica_targets(spec, states, (0, 2)) == {0: (0, 2), 1: (0, 2), 2: (0, 2)}
