"""The agent's pod link against a real kube-apiserver: desired state in through a field-selector watch,
observed state out through at most one annotation patch per version and a status patch only when the
synced condition flips, other conditions preserved."""

from __future__ import annotations

import threading
import time
from typing import Any

from weightsync.agent.metrics import AgentMetrics
from weightsync.agent.podstate import Desired, Observed, synced_state
from weightsync.agent.podstatus import PodLink
from weightsync.crds import contract


def _pod(name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "annotations": {contract.ANN_TARGET_VERSION: "3", contract.ANN_PAUSED: "false"}},
        # never scheduled: no kubelet (or kwok) touches its status while the test owns it
        "spec": {"schedulingGates": [{"name": "weightsync.io/test-hold"}],
                 "containers": [{"name": "app", "image": "example.invalid/app:1"}]},
    }


def _wait(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_pod_link_round_trip(kube: Any, namespace: str) -> None:
    name = "demo-inference-0-0"
    kube.core.create_namespaced_pod(namespace, _pod(name))
    other = {"type": "example.com/Other", "status": "True", "reason": "Test", "message": "keep me"}
    kube.core.patch_namespaced_pod_status(name, namespace, {"status": {"conditions": [other]}},
                                          _content_type="application/strategic-merge-patch+json")
    seen: list[Desired] = []
    changed = threading.Event()

    def on_desired(d: Desired) -> None:
        seen.append(d)
        changed.set()

    link = PodLink(namespace, name, on_desired, AgentMetrics(), api=kube.core).start()
    try:
        assert link.desired == Desired(3, False)
        # desired state in: the operator moves the target and pauses
        changed.clear()
        kube.core.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": {
            contract.ANN_TARGET_VERSION: "4", contract.ANN_PAUSED: "true"}}},
            _content_type="application/merge-patch+json")
        assert changed.wait(10), "the watch did not deliver the new annotations"
        assert seen[-1] == Desired(4, True)

        # observed state out: ten versions, synced stays True
        for v in range(4, 14):
            ok, reason, msg = synced_state(v, v, 1)
            link.report(Observed(served_version=v, engine_paused=True, synced=ok, synced_reason=reason,
                                 synced_message=msg,
                                 last_sync={"version": v, "durationSeconds": 0.1, "bytes": 1000, "mode": "NCCL"}))
            assert link.flush(10)
        pod = kube.core.read_namespaced_pod(name, namespace)
        ann = pod.metadata.annotations
        assert ann[contract.ANN_SERVED_VERSION] == "13"
        assert ann[contract.ANN_ENGINE_PAUSED] == "true"
        assert '"version":13' in ann[contract.ANN_LAST_SYNC]
        assert ann[contract.ANN_TARGET_VERSION] == "4"  # the operator's annotations are untouched
        conds = {c.type: c for c in pod.status.conditions}
        assert conds[contract.POD_CONDITION_SYNCED].status == "True"
        assert conds["example.com/Other"].message == "keep me"
        versions = 10
        assert link.stats.counts["status"] == 1, link.stats.counts
        assert link.stats.counts["annotations"] <= versions, link.stats.counts

        # a stale replica reports synced=False (one more status write), with the reason
        ok, reason, msg = synced_state(20, 13, 1)
        link.report(Observed(served_version=13, synced=ok, synced_reason=reason, synced_message=msg,
                             sync_error="fetch failed: trainer gone"))
        assert link.flush(10)
        _wait(lambda: link.stats.counts["status"] == 2, 10, "the status patch")
        pod = kube.core.read_namespaced_pod(name, namespace)
        conds = {c.type: c for c in pod.status.conditions}
        assert conds[contract.POD_CONDITION_SYNCED].status == "False"
        assert conds[contract.POD_CONDITION_SYNCED].reason == "Stale"
        assert "7 versions behind" in conds[contract.POD_CONDITION_SYNCED].message
        assert conds["example.com/Other"].status == "True"
        assert pod.metadata.annotations[contract.ANN_SYNC_ERROR] == "fetch failed: trainer gone"
        # the error annotation is removed again on success
        link.report(Observed(served_version=20, synced=True, synced_reason="UpToDate", synced_message="ok"))
        assert link.flush(10)
        pod = kube.core.read_namespaced_pod(name, namespace)
        assert contract.ANN_SYNC_ERROR not in (pod.metadata.annotations or {})
    finally:
        link.close()


def test_synced_condition_transition_time_moves_only_when_its_status_does(kube: Any, namespace: str) -> None:
    """Kubernetes' convention, which the operator's Atomic drain relies on (it compares the gate's
    lastTransitionTime with Ready's): a new reason with the same status keeps the time of the last flip."""
    name = "demo-inference-1-0"
    kube.core.create_namespaced_pod(namespace, _pod(name))
    link = PodLink(namespace, name, lambda d: None, AgentMetrics(), api=kube.core).start()

    def synced() -> Any:
        pod = kube.core.read_namespaced_pod(name, namespace)
        return next(c for c in pod.status.conditions or [] if c.type == contract.POD_CONDITION_SYNCED)

    try:
        link.report(Observed(served_version=1, synced=False, synced_reason="NotCommittedVersion", synced_message="a"))
        assert link.flush(10)
        _wait(lambda: link.stats.counts["status"] == 1, 10, "the first status patch")
        first = synced().last_transition_time
        # never True on this pod: False since the pod exists
        assert first == kube.core.read_namespaced_pod(name, namespace).metadata.creation_timestamp
        time.sleep(1.1)  # the API server keeps whole seconds
        link.report(Observed(served_version=1, synced=False, synced_reason=contract.REASON_ATOMIC_SWITCHING,
                             synced_message="b"))
        assert link.flush(10)
        _wait(lambda: link.stats.counts["status"] == 2, 10, "the reason's status patch")
        c = synced()
        assert c.reason == contract.REASON_ATOMIC_SWITCHING and c.message == "b"
        assert c.last_transition_time == first
        time.sleep(1.1)
        link.report(Observed(served_version=2, synced=True, synced_reason="CommittedVersion", synced_message="c"))
        assert link.flush(10)
        _wait(lambda: link.stats.counts["status"] == 3, 10, "the flip's status patch")
        c = synced()
        assert c.status == "True" and c.last_transition_time > first
    finally:
        link.close()


def test_pod_link_proves_its_versions_and_rewrites_forged_ones(kube: Any, namespace: str) -> None:
    """With the job's token every version written carries a proof; a version someone else writes on the pod
    (before the agent starts or while it runs) is never signed: the agent removes or overwrites it."""
    from weightsync.crds import version_proof

    token = b"t" * 64
    name = "demo-trainer-0"
    body = _pod(name)
    body["metadata"]["annotations"][contract.ANN_PUBLISHED_VERSION] = "99999"  # forged before the agent starts
    kube.core.create_namespaced_pod(namespace, body)
    link = PodLink(namespace, name, lambda d: None, AgentMetrics(), api=kube.core, token=token).start()

    def annotations() -> tuple[dict[str, str], str]:
        pod = kube.core.read_namespaced_pod(name, namespace)
        return dict(pod.metadata.annotations or {}), str(pod.metadata.uid)

    try:
        _wait(lambda: contract.ANN_PUBLISHED_VERSION not in annotations()[0], 10, "the forged version removed")
        link.report(Observed(published_version=5))
        assert link.flush(10)
        ann, uid = annotations()
        assert ann[contract.ANN_PUBLISHED_VERSION] == "5"
        assert version_proof.verify(token, uid, ann)
        assert not version_proof.verify(b"x" * 64, uid, ann), "a proof under another token must not verify"
        assert not version_proof.verify(token, "another-uid", ann), "a proof must be bound to the pod's uid"

        # forged while running: written again from the agent's own value, with a valid proof
        kube.core.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": {
            contract.ANN_PUBLISHED_VERSION: "100000"}}}, _content_type="application/merge-patch+json")
        _wait(lambda: annotations()[0].get(contract.ANN_PUBLISHED_VERSION) == "5", 10, "the forged version rewritten")
        ann, uid = annotations()
        assert version_proof.verify(token, uid, ann)
    finally:
        link.close()
