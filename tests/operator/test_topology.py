"""The topology ConfigMap: content and the membership generation."""

from __future__ import annotations

import copy

from weightsync.crds import contract
from weightsync.crds.topology import Topology
from weightsync.operator.placement import plan
from weightsync.operator.topology import build_topology_configmap, generation_of, topology_of


def _pod(name, ip=None, node=None, uid=None):
    return {"metadata": {"name": name, "uid": uid or f"uid-{name}"}, "spec": {"nodeName": node}, "status": {"podIP": ip}}


def test_topology_content(job, separated):
    spec = separated()
    p = plan(job.name, spec)
    pods = {"demo-trainer-0": _pod("demo-trainer-0", "10.0.0.1", "n1")}
    cm = build_topology_configmap(job, spec, p, pods)
    assert cm["metadata"]["name"] == "demo-topology"
    topo = topology_of(cm)
    assert isinstance(topo, Topology) and topo.generation == 1 and topo.mode == "NCCL"
    assert topo.trainer.world_size == 8 and (topo.trainer.tensor, topo.trainer.data) == (2, 4)
    t0, t1 = topo.trainer.pods
    assert (t0.ip, t0.node, t0.ranks) == ("10.0.0.1", "n1", [0, 1, 2, 3])
    assert t1.ip is None and t1.ranks == [4, 5, 6, 7]
    assert [r.replica for r in topo.inference] == [0, 1]
    assert topo.inference[1].pods[0].name == "demo-inference-1-0" and topo.inference[1].world_size == 2
    groups = {g.name: g.members for g in topo.groups}
    assert groups == {
        "replica-0": ["demo-trainer-0", "demo-trainer-1", "demo-inference-0-0"],
        "replica-1": ["demo-trainer-0", "demo-trainer-1", "demo-inference-1-0"],
    }
    # The file round-trips through the shared schema.
    assert Topology.from_json(cm["data"][contract.TOPOLOGY_FILE]) == topo


def test_generation_moves_only_with_membership(job, separated):
    spec = separated()
    p = plan(job.name, spec)
    pods = {n: _pod(n) for n in p.names}
    cm1 = build_topology_configmap(job, spec, p, pods)
    assert generation_of(cm1) == 1
    same = build_topology_configmap(job, spec, p, copy.deepcopy(pods), previous=cm1)
    assert generation_of(same) == 1
    # A spec change that is not membership (bucket size) rewrites the file, keeps the generation.
    bigger = separated(transfer={"bucketSizeMB": 256})
    cm_b = build_topology_configmap(job, bigger, plan(job.name, bigger), pods, previous=cm1)
    assert generation_of(cm_b) == 1 and topology_of(cm_b).bucket_size_mb == 256
    # An IP appears: membership changed.
    pods["demo-trainer-0"] = _pod("demo-trainer-0", ip="10.0.0.9", node="n2")
    cm2 = build_topology_configmap(job, spec, p, pods, previous=cm1)
    assert generation_of(cm2) == 2
    # A pod recreated under the same name (new uid) is a new member too.
    pods["demo-trainer-0"] = _pod("demo-trainer-0", ip="10.0.0.9", node="n2", uid="new")
    assert generation_of(build_topology_configmap(job, spec, p, pods, previous=cm2)) == 3
    # A terminating pod counts as absent.
    pods["demo-trainer-0"]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert topology_of(build_topology_configmap(job, spec, p, pods, previous=cm2)).trainer.pods[0].ip is None


def test_colocated_ipc_groups_are_per_pod(job, colocated):
    spec = colocated()
    p = plan(job.name, spec)
    topo = topology_of(build_topology_configmap(job, spec, p, {}))
    assert topo.mode == "IPC" and topo.placement == "Colocated"
    assert [g.members for g in topo.groups] == [["demo-colocated-0"], ["demo-colocated-1"]]
    # Replica 5 lives in pod 1 with replica-local ranks 0..1.
    r5 = topo.inference[5]
    assert [(m.name, m.ranks) for m in r5.pods] == [("demo-colocated-1", [0, 1])]
