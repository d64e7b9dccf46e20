"""The watch caches (operator/informers.py) and what the reconciler reads through them: our own writes are
seen at once and never overwritten by an older event, deletions of a namesake keep the newer object, a
fresh LIST reports what changed while the watch was down, and the batch window makes one pass of a burst."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from weightsync.crds import contract
from weightsync.operator.informers import Store
from weightsync.operator.workqueue import WorkQueue


def pod(name: str, rv: int, uid: str = "u1", job: str = "j", **ann: str) -> dict[str, Any]:
    return {"kind": "Pod", "metadata": {
        "name": name, "namespace": "ns", "uid": uid, "resourceVersion": str(rv),
        "labels": {contract.LABEL_JOB: job}, "annotations": dict(ann),
        "managedFields": [{"manager": "kubectl"}]}}


def test_store_keeps_our_newer_write_over_an_older_watch_event():
    s = Store("Pod")
    assert s.apply("ADDED", pod("p", 10))
    s.assume(pod("p", 12, target="2"))           # the answer to our patch
    assert not s.apply("MODIFIED", pod("p", 11, target="1"))  # the watch is behind: ignored
    assert s.get("ns", "p")["metadata"]["annotations"] == {"target": "2"}
    assert s.apply("MODIFIED", pod("p", 13, target="2", served="2"))
    assert s.get("ns", "p")["metadata"]["annotations"]["served"] == "2"
    s.assume(pod("p", 12, target="9"))           # an assumed answer older than the watch: ignored
    assert s.get("ns", "p")["metadata"]["resourceVersion"] == "13"
    assert "managedFields" not in s.get("ns", "p")["metadata"]  # not kept in memory


def test_store_ignores_the_deletion_of_a_namesake_and_indexes_by_job():
    s = Store("Pod")
    s.assume(pod("p", 20, uid="new"))              # created by us after the old one was deleted
    assert not s.apply("DELETED", pod("p", 15, uid="old"))
    assert s.get("ns", "p")["metadata"]["uid"] == "new"
    s.apply("ADDED", pod("q", 21, job="other"))
    assert [p["metadata"]["name"] for p in s.of_job("ns", "j")] == ["p"]
    assert s.apply("DELETED", pod("p", 22, uid="new"))
    assert s.of_job("ns", "j") == [] and s.get("ns", "p") is None


def test_relist_reports_what_changed_while_the_watch_was_down():
    s = Store("Pod")
    s.apply("ADDED", pod("a", 1))
    s.apply("ADDED", pod("b", 2))
    events = s.replace([pod("b", 5), pod("c", 6)])
    assert sorted((t, o["metadata"]["name"]) for t, o in events) == [("ADDED", "c"), ("DELETED", "a"), ("MODIFIED", "b")]
    assert sorted(n for _, n in s.key_list()) == ["b", "c"]


def test_batch_window_makes_one_pass_of_a_burst_of_events():
    calls: list[float] = []

    def work(ns: str, name: str) -> object:
        calls.append(time.monotonic())
        return object()

    async def scenario() -> float:
        q = WorkQueue(work, batch_seconds=1.0)  # far above the burst's ~55 ms, however loaded the machine
        t0 = time.monotonic()
        for _ in range(50):  # the pod events of one version: every replica commits at about the same time
            q.request(("ns", "a"))
            await asyncio.sleep(0.001)
        await q.drain()
        return t0

    t0 = asyncio.run(scenario())
    assert len(calls) == 1
    assert calls[0] - t0 >= 1.0


def test_relist_of_one_namespace_leaves_the_others_alone():
    """One store serves the informers of every served namespace: a LIST of one must not drop the other's."""
    s = Store("Pod")
    other = pod("x", 3)
    other["metadata"]["namespace"] = "other"
    s.apply("ADDED", other)
    s.apply("ADDED", pod("a", 4))
    assert s.replace([], namespace="empty") == []
    assert sorted(s.key_list()) == [("ns", "a"), ("other", "x")]
    assert [(t, o["metadata"]["name"]) for t, o in s.replace([], namespace="ns")] == [("DELETED", "a")]
    assert s.key_list() == [("other", "x")]
