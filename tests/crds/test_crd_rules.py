"""The pydantic models refuse the same invalid objects as the API server (tests/api runs the same table
against a real kube-apiserver), so the operator and unit tests see the API server's rules."""

from __future__ import annotations

import pytest
from invalid_cases import ALLOWED_UPDATES, CASES, CREATE_CASES, colocated, separated
from pydantic import ValidationError

from weightsync.crds.models import WeightSyncJob, validation_messages


def test_table_is_large_and_varied() -> None:
    assert len(CASES) >= 20
    assert {c.kind for c in CASES} >= {"enum", "bound", "required", "pattern", "CEL", "immutable"}
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("base", [separated, colocated], ids=["separated", "colocated"])
def test_bases_are_valid(base) -> None:
    WeightSyncJob.from_k8s(base("ok"))


@pytest.mark.parametrize("case", CREATE_CASES, ids=lambda c: c.id)
def test_invalid_object_refused_by_pydantic(case) -> None:
    with pytest.raises(ValidationError) as err:
        WeightSyncJob.from_k8s(case.build("wsj-case"))
    text = "\n".join(validation_messages(err.value))
    leaf = case.field.rsplit(".", 1)[-1].split("[")[0]
    assert leaf in text, f"{case.id}: {text}"


@pytest.mark.parametrize("case", [c for c in CASES if c.op == "update"], ids=lambda c: c.id)
def test_immutable_update_is_itself_a_valid_object(case) -> None:
    """Only the transition rule may refuse these updates; the new object alone must be valid."""
    WeightSyncJob.from_k8s(case.updated(case.build("wsj-case")))


@pytest.mark.parametrize(("name", "mutate"), ALLOWED_UPDATES, ids=[n for n, _ in ALLOWED_UPDATES])
def test_allowed_updates_are_valid(name, mutate) -> None:
    obj = separated()
    mutate(obj)
    WeightSyncJob.from_k8s(obj)


@pytest.mark.parametrize("mode", ["GDR", "Auto", None])
def test_delta_sync_is_valid_with_gdr_or_auto(mode) -> None:
    """Only an explicit IPC or NCCL refuses deltaSync (tests/crds/invalid_cases.py): GDR, Auto and the
    default (Auto) are accepted, and so is a disabled deltaSync with any mode."""
    obj = separated()
    obj["spec"]["transfer"] = {"deltaSync": {"enabled": True, "maxChangedFraction": 0.2}}
    if mode is not None:
        obj["spec"]["transfer"]["mode"] = mode
    job = WeightSyncJob.from_k8s(obj)
    assert job.spec.transfer.delta_sync is not None and job.spec.transfer.delta_sync.enabled
    for off_mode in ("IPC", "NCCL"):
        off = colocated() if off_mode == "IPC" else separated()
        off["spec"]["transfer"] = {"mode": off_mode, "deltaSync": {"enabled": False}}
        WeightSyncJob.from_k8s(off)
