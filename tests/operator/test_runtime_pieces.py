"""The operator process pieces: work queue, peering leadership, configuration, CLI scope."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest

from weightsync.operator.config import OperatorConfig
from weightsync.operator.handlers import owner_job
from weightsync.operator.leadership import is_leader
from weightsync.operator.main import main as operator_main
from weightsync.operator.workqueue import WorkQueue


def test_work_queue_coalesces_and_never_runs_a_key_concurrently():
    calls: list[tuple[str, str]] = []
    active = set()
    overlap = []
    gate = threading.Event()

    def work(ns: str, name: str) -> object:
        if (ns, name) in active:
            overlap.append(name)
        active.add((ns, name))
        calls.append((ns, name))
        gate.wait(2)
        time.sleep(0.01)
        active.discard((ns, name))
        return object()

    async def scenario() -> None:
        q = WorkQueue(work)
        q.request(("ns", "a"))
        await asyncio.sleep(0.05)
        for _ in range(20):  # a burst while "a" runs collapses into one more pass
            q.request(("ns", "a"))
        q.request(("ns", "b"))
        gate.set()
        await q.drain()

    asyncio.run(scenario())
    assert calls.count(("ns", "a")) == 2 and calls.count(("ns", "b")) == 1
    assert overlap == []


def test_work_queue_times_the_wait_before_a_pass_and_logs_a_slow_one(caplog: pytest.LogCaptureFixture,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait from the first request to the pass (batch window, worker, event loop) is measured from the
    first request, not the last one that joined the pass; a pass slower than SLOW_PASS_S end to end is
    logged with its wait, run and status-write share."""
    from types import SimpleNamespace

    from weightsync.operator import metrics as m
    from weightsync.operator import workqueue

    # well above the quick pass (0.25 s nominal), which a loaded machine must not stretch into a slow one
    monkeypatch.setattr(workqueue, "SLOW_PASS_S", 2.0)

    def work(ns: str, name: str) -> object:
        time.sleep(0.05 if name == "quick" else workqueue.SLOW_PASS_S)
        return SimpleNamespace(status_write_s=0.25)

    def wait_sum() -> float:
        return float(m.RECONCILE_WAIT._sum.get())

    async def scenario() -> None:
        q = WorkQueue(work, batch_seconds=0.2)
        q.request(("ns", "quick"))
        await asyncio.sleep(0.1)
        q.request(("ns", "quick"))  # joins the pass the first request asked for
        await q.drain()
        q.request(("ns", "slow"))
        await q.drain()

    before = wait_sum()
    with caplog.at_level(logging.INFO, logger="weightsync.operator.workqueue"):
        asyncio.run(scenario())
    assert 0.38 <= wait_sum() - before < 3.0  # 0.2 s + 0.2 s of batch windows, counted from each first request
    slow = [r.getMessage() for r in caplog.records if "reconcile.slow" in r.getMessage()]
    assert len(slow) == 1 and "job=ns/slow" in slow[0] and "status_write_s=0.250" in slow[0], slow


def test_work_queue_passes_again_when_a_pass_asks_for_a_recheck():
    """An Atomic drain waiting only for readiness gates to settle gets no pod event when they have: the pass
    says when to look again (Outcome.recheck_after), and a request before that replaces the timer."""
    from types import SimpleNamespace

    passes: list[float] = []

    def work(ns: str, name: str) -> object:
        passes.append(time.monotonic())
        return SimpleNamespace(recheck_after=0.2 if len(passes) == 1 else None)

    async def scenario() -> None:
        q = WorkQueue(work)
        q.request(("ns", "a"))
        deadline = time.monotonic() + 5
        while len(passes) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.4)  # the second pass asked for nothing more
        await q.drain()

    asyncio.run(scenario())
    assert len(passes) == 2 and 0.18 <= passes[1] - passes[0] < 2.0


def test_work_queue_retries_failures_with_backoff_and_forgets_deleted_jobs():
    attempts = []

    def work(ns: str, name: str) -> object | None:
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise RuntimeError("api down")
        return None  # job gone

    async def scenario() -> WorkQueue:
        q = WorkQueue(work, backoff_initial=0.05, backoff_max=0.1)
        q.request(("ns", "a"))
        deadline = time.monotonic() + 5
        while len(attempts) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await q.drain()
        return q

    q = asyncio.run(scenario())
    assert len(attempts) == 3
    assert attempts[1] - attempts[0] >= 0.04 and attempts[2] - attempts[1] >= 0.08
    assert ("ns", "a") not in q.known


def test_peering_leadership_rule():
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    fresh = (now - timedelta(seconds=5)).isoformat()
    dead = (now - timedelta(seconds=500)).isoformat()
    assert is_leader({}, "me", 10, now)
    assert is_leader({"me": {"priority": 10, "lastseen": fresh, "lifetime": 60}}, "me", 10, now)
    assert not is_leader({"other": {"priority": 20, "lastseen": fresh, "lifetime": 60}}, "me", 10, now)
    assert not is_leader({"other": {"priority": 10, "lastseen": fresh, "lifetime": 60}}, "me", 10, now)
    assert is_leader({"other": {"priority": 5, "lastseen": fresh, "lifetime": 60}}, "me", 10, now)
    assert is_leader({"other": {"priority": 50, "lastseen": dead, "lifetime": 60}}, "me", 10, now)


def test_config_from_env():
    cfg = OperatorConfig.from_env({
        "WEIGHTSYNC_AGENT_IMAGE": "reg/agent:2", "WEIGHTSYNC_NODE_GPU_COUNT": "4",
        "WEIGHTSYNC_GPU_NODE_SELECTOR": "a=b, c=d", "WEIGHTSYNC_RDMA_AVAILABLE": "true",
        "WEIGHTSYNC_RESYNC_SECONDS": "5",
    })
    assert (cfg.agent_image, cfg.node_gpu_count, cfg.rdma_available, cfg.resync_seconds) == ("reg/agent:2", 4, True, 5.0)
    assert cfg.gpu_node_selector == {"a": "b", "c": "d"}
    assert OperatorConfig.from_env({"WEIGHTSYNC_GPU_NODE_SELECTOR": ""}).gpu_node_selector == {}
    with pytest.raises(ValueError, match="WEIGHTSYNC_NODE_GPU_COUNT"):
        OperatorConfig.from_env({"WEIGHTSYNC_NODE_GPU_COUNT": "eight"})
    with pytest.raises(ValueError, match="key=value"):
        OperatorConfig.from_env({"WEIGHTSYNC_GPU_NODE_SELECTOR": "novalue"})


def test_config_rdma_resource_and_dra_device_class_from_env():
    default = OperatorConfig.from_env({})
    assert (default.rdma_resource_name, default.dra_device_class_name) == ("rdma/hca_shared_devices_a", "")
    cfg = OperatorConfig.from_env({"WEIGHTSYNC_RDMA_RESOURCE": "example.com/roce",
                                   "WEIGHTSYNC_DRA_DEVICE_CLASS": "gpu.nvidia.com"})
    assert (cfg.rdma_resource_name, cfg.dra_device_class_name) == ("example.com/roce", "gpu.nvidia.com")
    with pytest.raises(ValueError, match=r"cluster\.rdmaResourceName"):
        OperatorConfig.from_env({"WEIGHTSYNC_RDMA_RESOURCE": "not a resource"})


PROMETHEUS_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                   "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


def test_config_agent_metrics_allow_from():
    assert OperatorConfig.from_env({}).agent_metrics_allow_from == ()
    assert OperatorConfig.from_env({"WEIGHTSYNC_AGENT_METRICS_ALLOW_FROM": "[]"}).agent_metrics_allow_from == ()
    raw = json.dumps([PROMETHEUS_PEER, {"namespaceSelector": {"matchExpressions": [
        {"key": "team", "operator": "In", "values": ["obs"]}]}}])
    cfg = OperatorConfig.from_env({"WEIGHTSYNC_AGENT_METRICS_ALLOW_FROM": raw})
    assert cfg.agent_metrics_allow_from == tuple(json.loads(raw))


@pytest.mark.parametrize(("raw", "match"), [
    ("[{", "not valid JSON"),
    ('{"podSelector": {}}', "JSON list"),
    ("[{}]", "namespaceSelector and/or podSelector"),
    ('[{"ipBlock": {"cidr": "0.0.0.0/0"}}]', "namespaceSelector and/or podSelector"),
    ('["monitoring"]', "namespaceSelector and/or podSelector"),
    ('[{"podSelector": {"app": "prometheus"}}]', "unknown keys"),
    ('[{"podSelector": {"matchLabels": {"app": 1}}}]', "matchLabels"),
    ('[{"namespaceSelector": {"matchExpressions": [{"key": "a", "operator": "Is"}]}}]', "operator"),
])
def test_config_agent_metrics_allow_from_refuses_bad_values(raw, match):
    with pytest.raises(ValueError, match=match) as err:
        OperatorConfig.from_env({"WEIGHTSYNC_AGENT_METRICS_ALLOW_FROM": raw})
    assert "WEIGHTSYNC_AGENT_METRICS_ALLOW_FROM" in str(err.value) and "agentMetrics.allowFrom" in str(err.value)


def test_cli_requires_a_scope(monkeypatch, capsys):
    monkeypatch.delenv("WEIGHTSYNC_WATCH_NAMESPACES", raising=False)
    assert operator_main([]) == 2
    assert "--all-namespaces" in capsys.readouterr().err


def test_owner_job_reads_the_controller_reference():
    body = {"metadata": {"ownerReferences": [
        {"apiVersion": "v1", "kind": "Node", "name": "x", "controller": False},
        {"apiVersion": "weightsync.io/v1alpha1", "kind": "WeightSyncJob", "name": "j1", "controller": True},
    ]}}
    assert owner_job(body) == "j1"
    assert owner_job({"metadata": {}}) is None


def test_change_log_lines_carry_json_fields(caplog):
    """The write log is emitted (no reserved LogRecord keys in `extra`) with its fields."""
    import logging

    from weightsync.operator.common import JobRef
    from weightsync.operator.reconcile import _log_change

    with caplog.at_level(logging.INFO, logger="weightsync.operator.reconcile"):
        _log_change("created", "Pod", JobRef("j", "ns", "u"), "j-trainer-0")
    (rec,) = caplog.records
    assert rec.getMessage() == "created kind=Pod name=ns/j-trainer-0"
    assert (rec.action, rec.kind, rec.job, rec.object_name) == ("created", "Pod", "ns/j", "j-trainer-0")


def test_full_garbage_collections_are_timed() -> None:
    """A full collection stops every thread of the operator (its passes, the event loop): each one is counted
    in weightsync_operator_gc_pause_seconds; the younger generations are not."""
    import gc

    from weightsync.operator import gcpolicy
    from weightsync.operator import metrics as m

    gcpolicy.time_gc()
    gcpolicy.time_gc()  # once per process
    assert gc.callbacks.count(gcpolicy._time_full_collections) == 1
    before = m.GC_PAUSE._sum.get(), sum(b.get() for b in m.GC_PAUSE._buckets)
    gc.collect(0)
    assert sum(b.get() for b in m.GC_PAUSE._buckets) == before[1]
    gc.collect()
    assert sum(b.get() for b in m.GC_PAUSE._buckets) == before[1] + 1 and m.GC_PAUSE._sum.get() > before[0]


def test_frozen_caches_are_not_walked_by_a_full_collection_and_cycles_are_reclaimed_later() -> None:
    """After a freeze, a full collection walks only what was allocated since (the cache's objects are out of
    its reach, and reference counting still frees them); a cycle frozen while alive is reclaimed at the next
    collect_all, not held for ever."""
    import gc
    import weakref

    from weightsync.operator import gcpolicy

    class Node:
        pass

    cache = [{"metadata": {"name": f"pod-{i}", "labels": {"a": "b"}}, "spec": {"containers": [{}]}}
             for i in range(50_000)]
    cyclic = Node()
    cyclic.me = cyclic  # type: ignore[attr-defined]
    gone = weakref.ref(cyclic)
    try:
        assert gcpolicy.freeze() >= 4 * len(cache)
        assert len(gc.get_objects()) < len(cache)  # the collector no longer sees them
        del cyclic
        gc.collect()
        assert gone() is not None  # frozen: not collected by an ordinary full collection
        gcpolicy.collect_all()
        assert gone() is None and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    assert gcpolicy.due(1000.0, 1000.0 - gcpolicy.COLLECT_EVERY_S) == "collect"
    assert gcpolicy.due(1000.0, 1000.0 - gcpolicy.FREEZE_EVERY_S) == "freeze"


def test_a_request_during_a_pass_waits_its_window_from_when_it_was_made() -> None:
    """A report asks for a pass (1 s window) while a 1.5 s pass runs: the next pass starts right after the
    running one (the window has passed meanwhile), not a whole window later."""
    starts: list[float] = []
    ends: list[float] = []

    def work(ns: str, name: str) -> object:
        starts.append(time.monotonic())
        time.sleep(1.5 if len(starts) == 1 else 0.0)
        ends.append(time.monotonic())
        return object()

    async def scenario() -> None:
        q = WorkQueue(work)
        q.request(("ns", "a"))
        await asyncio.sleep(0.05)
        q.request(("ns", "a"), batch_seconds=1.0)
        await q.drain()

    asyncio.run(scenario())
    assert len(starts) == 2
    # before: a whole 1 s window after the running pass ended; the hand-off alone is far below that
    assert starts[1] - ends[0] < 0.7, starts[1] - ends[0]
