"""Events derived from status transitions: posted once per change, never on a steady-state pass."""

from __future__ import annotations

from typing import Any

from weightsync.crds import contract
from weightsync.operator.events import version_events


def _status(tv: int | None, sv: int | None, degraded: tuple[str, str] = ("False", "AsExpected"),
            last: dict[str, Any] | None = None) -> dict[str, Any]:
    st: dict[str, Any] = {
        "trainerVersion": tv,
        "servedVersion": sv,
        "conditions": [{"type": contract.COND_SYNCED, "status": "True", "reason": "AllReplicasSynced"},
                       {"type": contract.COND_DEGRADED, "status": degraded[0], "reason": degraded[1],
                        "message": f"{degraded[1]} message"}],
    }
    if last is not None:
        st["lastSync"] = last
    return st


def test_no_events_when_nothing_changed():
    s = _status(3, 3, ("True", "SyncFailed"))
    assert version_events(s, dict(s)) == []


def test_trainer_version_published():
    assert version_events(_status(None, None), _status(1, None)) == [
        ("Normal", "VersionPublished", "trainer published version 1")
    ]
    (ev,) = version_events(_status(1, 1), _status(2, 1))
    assert ev[:2] == ("Normal", "VersionPublished") and "version 2" in ev[2] and "was 1" in ev[2]


def test_served_version_carries_duration_and_bytes():
    last = {"version": 4, "durationSeconds": 1.25, "bytes": 4096, "mode": "NCCL"}
    evs = version_events(_status(4, 3), _status(4, 4, last=last))
    assert len(evs) == 1
    type_, reason, msg = evs[0]
    assert (type_, reason) == ("Normal", "VersionServed")
    assert "version 4" in msg and "1.250s" in msg and "4096 bytes" in msg and "NCCL" in msg


def test_sync_failure_and_staleness_are_warnings_on_transition_only():
    ok = _status(5, 5)
    failed = _status(5, 5, ("True", "SyncFailed"))
    stale = _status(9, 5, ("True", "ReplicasStale"))
    assert version_events(ok, failed) == [("Warning", "SyncFailed", "SyncFailed message")]
    assert version_events(failed, failed) == []
    evs = version_events(failed, stale)
    assert ("Warning", "ReplicasStale", "ReplicasStale message") in evs
    assert ("Normal", "VersionPublished", "trainer published version 9 (was 5)") in evs
    (rec,) = version_events(stale, _status(9, 9))[1:]
    assert rec[:2] == ("Normal", "Recovered") and "ReplicasStale" in rec[2]


def test_first_status_without_previous():
    assert version_events(None, _status(None, None)) == []
