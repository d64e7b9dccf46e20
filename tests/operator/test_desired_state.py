"""The job's desired-state ConfigMap: the operator's encoding, its read-back, and the agent's reading of it."""

from __future__ import annotations

import pytest

from weightsync.agent.podstate import desired_for
from weightsync.crds import contract, desired
from weightsync.operator.common import JobRef
from weightsync.operator.desiredstate import build_desired_configmap, overlay

ANN = {contract.ANN_TARGET_VERSION: "7", contract.ANN_TARGET_EPOCH: "1", contract.ANN_PAUSED: "false",
       contract.ANN_MEMBERSHIP_GENERATION: "3", contract.ANN_COMMIT_VERSION: ""}


def _pod(name: str, **ann: str) -> dict:
    return {"metadata": {"name": name, "annotations": dict(ann)}, "status": {"phase": "Running"}}


def test_round_trip_drops_empty_values_and_foreign_keys():
    data = desired.encode({"j-inference-0-0": {**ANN, "other/key": "x"}, "j-trainer-0": {}})
    assert data["j-inference-0-0"] == ('{"membership-generation":"3","paused":"false",'
                                       '"target-epoch":"1","target-version":"7"}')
    assert desired.decode_pod(data, "j-inference-0-0") == {k: v for k, v in ANN.items() if v}
    assert desired.decode_pod(data, "j-trainer-0") == {}
    assert desired.decode_pod(data, "j-missing") is None


def test_a_malformed_entry_is_ignored_whole():
    assert desired.decode_pod({"p": "not json"}, "p") == {}
    assert desired.decode_pod({"p": '["7"]'}, "p") == {}
    assert desired.decode_pod({"p": '{"target-version": 7, "paused": "true", "served-version": "9"}'}, "p") == {
        contract.ANN_PAUSED: "true"}  # a non-string and a key that is not desired state are dropped


def test_a_new_version_patches_only_the_pods_it_retargets():
    have = desired.encode({f"p{i}": {**ANN, contract.ANN_TARGET_VERSION: "7"} for i in range(4)})
    want = desired.encode({**{f"p{i}": {**ANN, contract.ANN_TARGET_VERSION: "8"} for i in range(2)},
                           "p2": {**ANN, contract.ANN_TARGET_VERSION: "7"}})
    patch = desired.patch_for(want, have)
    assert sorted(patch) == ["p0", "p1", "p3"] and patch["p3"] is None
    assert desired.patch_for(want, want) == {}


def test_too_many_pods_is_refused_with_a_reason():
    with pytest.raises(desired.DesiredTooLarge, match="split the job"):
        desired.encode({f"job-inference-{i}-0": ANN for i in range(20000)})


def test_overlay_replaces_the_pods_own_desired_annotations_without_touching_them():
    pods = {"a": _pod("a", **{contract.ANN_TARGET_VERSION: "1", contract.ANN_SERVED_VERSION: "1"}),
            "b": _pod("b", **{contract.ANN_TARGET_VERSION: "1"})}
    cm = build_desired_configmap(JobRef("j", "ns", "uid", 1), {"a": ANN})
    assert cm["metadata"]["name"] == contract.desired_configmap_name("j") == "j-desired"
    view = overlay(pods, cm)
    assert view["a"]["metadata"]["annotations"][contract.ANN_TARGET_VERSION] == "7"
    assert view["a"]["metadata"]["annotations"][contract.ANN_SERVED_VERSION] == "1"  # the agent's own: kept
    assert contract.ANN_TARGET_VERSION not in view["b"]["metadata"]["annotations"]  # not named: nothing asked
    assert pods["a"]["metadata"]["annotations"][contract.ANN_TARGET_VERSION] == "1"  # the cache is unchanged
    assert overlay(pods, None) == pods  # no ConfigMap yet (an older operator): the pods' own annotations


def test_the_agent_reads_its_entry_and_keeps_what_is_set_on_its_pod():
    data = desired.encode({"p": {**ANN, contract.ANN_COMMITTED_VERSION: "6"}})
    pod_ann = {contract.ANN_TARGET_VERSION: "99", contract.ANN_INJECT_FAULT: "prepare"}
    d = desired_for("p", pod_ann, data)
    assert (d.target_version, d.target_epoch, d.paused, d.committed, d.inject_fault) == (7, 1, False, (0, 6), "prepare")
    assert desired_for("q", pod_ann, data).target_version is None  # a pod the operator does not name
    assert desired_for("p", pod_ann, None).target_version == 99  # no ConfigMap seen: the pod's annotations
