"""The token Secret is created once; later passes only read it (no refused POST per pass)."""

from __future__ import annotations

from typing import Any, cast

from fakekube import FakeKube
from weightsync.operator.kube import Kube
from weightsync.operator.reconcile import Outcome, Reconciler


def test_secret_is_created_once_and_then_only_read(job, cfg):
    kube = FakeKube()
    rec = Reconciler(cast(Kube, kube), cfg, events=cast(Any, object()))
    first = Outcome()
    rec._ensure_secret(job, first)
    assert first.created == ["Secret/demo-token"]
    token = kube.objects[("Secret", "ns1", "demo-token")]["data"]

    kube.calls.clear()
    for _ in range(3):
        again = Outcome()
        rec._ensure_secret(job, again)
        assert again.created == []
    assert kube.writes() == []  # steady state: zero API writes
    assert kube.objects[("Secret", "ns1", "demo-token")]["data"] == token  # never rotated
