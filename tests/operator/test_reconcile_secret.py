"""The token Secret is created once; later passes make no API call for it (the operator may not read
Secrets), and a new operator process makes one refused POST per job at most."""

from __future__ import annotations

from typing import Any, cast

from fakekube import FakeKube

from weightsync.operator.kube import Kube
from weightsync.operator.reconcile import Outcome, Reconciler


def test_secret_is_created_once_and_then_left_alone(job, cfg):
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
    assert kube.writes() == [] and kube.calls == []  # steady state: no API call at all, no Secret read
    assert kube.objects[("Secret", "ns1", "demo-token")]["data"] == token  # never rotated


def test_a_new_operator_process_never_reads_or_rotates_an_existing_token(job, cfg):
    kube = FakeKube()
    Reconciler(cast(Kube, kube), cfg, events=cast(Any, object()))._ensure_secret(job, Outcome())
    token = kube.objects[("Secret", "ns1", "demo-token")]["data"]
    kube.calls.clear()
    restarted = Reconciler(cast(Kube, kube), cfg, events=cast(Any, object()))
    out = Outcome()
    restarted._ensure_secret(job, out)
    restarted._ensure_secret(job, Outcome())
    assert out.created == []  # 409: made by the earlier process
    assert kube.calls == [("create", "Secret", "demo-token")]  # one POST, never a read (RBAC: create only)
    assert kube.objects[("Secret", "ns1", "demo-token")]["data"] == token
