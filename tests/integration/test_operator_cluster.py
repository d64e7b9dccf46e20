"""The real operator against the real control plane (kube-apiserver, scheduler, controller-manager) with
simulated GPU nodes: owned objects, placement by the real scheduler, self-healing, garbage collection,
restarts, refusals."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from op_helpers import (
    AGENT_IMAGE,
    POOL,
    POOL_LABEL,
    colocated_spec,
    condition,
    container,
    create_job,
    events_for,
    get_job,
    live_pods,
    pods_of,
    raw,
    separated_spec,
    token_of,
)

from weightsync.crds import contract
from weightsync.crds.topology import Topology
from weightsync.e2e.pytest_plugin import wait_until

pytestmark = pytest.mark.cluster

GPU = contract.RESOURCE_GPU


def _gpus(container_: dict[str, Any]) -> int:
    return int(((container_.get("resources") or {}).get("limits") or {}).get(GPU, 0))


def _pod_gpus(pod: dict[str, Any]) -> int:
    return sum(_gpus(c) for c in pod["spec"]["containers"])


def _node_labels(kube: Any) -> dict[str, dict[str, str]]:
    return {n.metadata.name: n.metadata.labels or {} for n in kube.core.list_node().items}


def _wait_scheduled(kube: Any, ns: str, job: str, count: int, timeout: float = 90) -> dict[str, dict[str, Any]]:
    def ready() -> dict[str, dict[str, Any]] | None:
        pods = live_pods(kube, ns, job)
        if len(pods) == count and all(p["spec"].get("nodeName") for p in pods.values()):
            return pods
        return None
    return wait_until(ready, timeout=timeout, what=f"{count} pods of {job} scheduled")


def _owned_objects(kube: Any, ns: str, job: str) -> dict[str, str]:
    """kind/name -> resourceVersion of the job and every object it owns."""
    out = {f"{contract.KIND}/{job}": get_job(kube, ns, job)["metadata"]["resourceVersion"]}
    paths = {
        "Pod": f"/api/v1/namespaces/{ns}/pods", "Service": f"/api/v1/namespaces/{ns}/services",
        "ConfigMap": f"/api/v1/namespaces/{ns}/configmaps", "Secret": f"/api/v1/namespaces/{ns}/secrets",
        "ServiceAccount": f"/api/v1/namespaces/{ns}/serviceaccounts",
        "Role": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
        "RoleBinding": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
        "NetworkPolicy": f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    }
    for kind, path in paths.items():
        for item in raw(kube, path)["items"]:
            refs = item["metadata"].get("ownerReferences") or []
            if any(r.get("kind") == contract.KIND and r.get("name") == job for r in refs):
                out[f"{kind}/{item['metadata']['name']}"] = item["metadata"]["resourceVersion"]
    return out


def _stable(kube: Any, ns: str, job: str, quiet: float = 5.0, timeout: float = 90) -> dict[str, str]:
    """Wait until nothing the job owns changes for `quiet` seconds (longer than two resync periods)."""
    deadline = time.monotonic() + timeout
    last = _owned_objects(kube, ns, job)
    since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = _owned_objects(kube, ns, job)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return now
    pytest.fail(f"job {job} never settled: objects kept changing")


SCRAPER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def test_separated_job_builds_every_object_and_the_scheduler_places_the_pods(cluster, kube, namespace, operator,
                                                                             monkeypatch):
    # The chart's agentMetrics.allowFrom, as the Deployment passes it: scrapers may reach the metrics port.
    monkeypatch.setenv("WEIGHTSYNC_AGENT_METRICS_ALLOW_FROM", json.dumps([SCRAPER]))
    op = operator()
    create_job(kube, namespace, "sep", separated_spec())
    pods = _wait_scheduled(kube, namespace, "sep", 4)
    assert sorted(pods) == ["sep-inference-0-0", "sep-inference-1-0", "sep-trainer-0", "sep-trainer-1"]

    # Every pod: agent as a native sidecar, GPUs requested by the app container, owned by the job.
    job = get_job(kube, namespace, "sep")
    for name, pod in pods.items():
        agent = pod["spec"]["initContainers"][0]
        assert agent["name"] == contract.AGENT_CONTAINER and agent["restartPolicy"] == "Always"
        assert agent["image"] == AGENT_IMAGE
        assert pod["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
        assert pod["spec"]["serviceAccountName"] == "sep-agent"
        gated = {"conditionType": contract.POD_CONDITION_SYNCED} in (pod["spec"].get("readinessGates") or [])
        assert gated == ("inference" in name)
        assert _pod_gpus(pod) == (4 if "trainer" in name else 2)

    # Disjoint GPUs: the scheduler never gives a node more GPUs than it has.
    labels = _node_labels(kube)
    per_node: dict[str, int] = defaultdict(int)
    for pod in pods.values():
        per_node[pod["spec"]["nodeName"]] += _pod_gpus(pod)
    for node, used in per_node.items():
        assert labels[node].get("nvidia.com/gpu.present") == "true" and labels[node].get(POOL_LABEL) == POOL
        assert used <= int(labels[node][contract.LABEL_GPU_COUNT])

    # Supporting objects.
    secret = kube.core.read_namespaced_secret("sep-token", namespace).to_dict()
    assert len(token_of({"data": secret["data"]})) == 64
    svc = kube.core.read_namespaced_service("sep", namespace)
    assert svc.spec.cluster_ip == "None" and svc.spec.publish_not_ready_addresses is True
    routing = kube.core.read_namespaced_service("sep-inference", namespace)
    assert routing.spec.cluster_ip not in (None, "None") and not routing.spec.publish_not_ready_addresses
    assert routing.spec.selector[contract.LABEL_ROLE] == contract.ROLE_INFERENCE
    assert routing.spec.selector[contract.LABEL_RANK] == "0"
    np = raw(kube, f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies/sep-agents")
    assert np["spec"]["podSelector"]["matchLabels"][contract.LABEL_JOB] == "sep"
    scrape = [r for r in np["spec"]["ingress"] if r.get("from") == [SCRAPER]]
    assert len(scrape) == 1 and scrape[0]["ports"] == [{"protocol": "TCP", "port": contract.METRICS_PORT}]
    role = raw(kube, f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles/sep-agent")
    assert role["rules"][0]["resourceNames"] == sorted(pods)
    want_nodes = {pods[n]["spec"]["nodeName"] for n in ("sep-trainer-0", "sep-trainer-1")}

    def topology() -> Topology:
        cm = kube.core.read_namespaced_config_map("sep-topology", namespace)
        return Topology.from_json(cm.data[contract.TOPOLOGY_FILE])

    # The operator records the scheduler's choice in the topology on the pod events that follow binding.
    topo = wait_until(lambda: (t := topology()) and {m.node for m in t.trainer.pods} == want_nodes and t,
                      what="topology with the trainer nodes")
    assert topo.mode == "NCCL" and topo.trainer.world_size == 8 and len(topo.inference) == 2

    # The per-job ServiceAccount can do exactly what an agent needs, as the real authorizer sees it.
    sa = f"system:serviceaccount:{namespace}:sep-agent"

    def can(*args: str) -> bool:
        r = cluster.kubectl("auth", "can-i", *args, f"--as={sa}", "-n", namespace, check=False)
        return r.stdout.strip() == "yes"

    assert can("patch", "pods/sep-inference-0-0") and can("patch", "pods/sep-inference-0-0", "--subresource=status")
    assert can("watch", "pods/sep-trainer-1") and can("get", "configmaps/sep-topology")
    assert not can("patch", "pods/someone-else") and not can("get", "secrets/sep-token")
    assert not can("patch", "configmaps/sep-topology") and not can("create", "pods")

    # Status from the first reconcile, through the status subresource; `kubectl get wsj` columns.
    job = wait_until(lambda: (j := get_job(kube, namespace, "sep")).get("status", {}).get("observedGeneration") and j,
                     what="status")
    st = job["status"]
    assert st["mode"] == "NCCL" and st["observedGeneration"] == job["metadata"]["generation"]
    assert {c["type"] for c in st["conditions"]} == set(contract.JOB_CONDITION_TYPES)
    assert condition(job, "Ready")["status"] == "False"  # nothing runs the pods: they never become Ready
    out = cluster.kubectl("get", "wsj", "-n", namespace).stdout
    header = out.splitlines()[0].split()
    assert header == ["NAME", "PLACEMENT", "MODE", "TRAINER", "SERVED", "SYNCED", "READY", "PAUSED", "DEGRADED", "AGE"]
    assert out.splitlines()[1].split()[:3] == ["sep", "Separated", "NCCL"]
    assert op.alive()


def test_topology_key_packs_every_pod_into_one_rack(kube, namespace, operator):
    operator()
    # 12 GPUs do not fit on one 8-GPU node: the job needs two nodes, and both must be in one rack.
    create_job(kube, namespace, "rack", separated_spec(topologyKey=contract.LABEL_RACK))
    pods = _wait_scheduled(kube, namespace, "rack", 4)
    labels = _node_labels(kube)
    nodes = {p["spec"]["nodeName"] for p in pods.values()}
    racks = {labels[n][contract.LABEL_RACK] for n in nodes}
    assert len(nodes) == 2 and len(racks) == 1, (nodes, racks)


def test_colocated_whole_node_pod_holds_trainer_inference_and_agent(kube, namespace, operator):
    operator()
    create_job(kube, namespace, "colo", colocated_spec())
    pods = _wait_scheduled(kube, namespace, "colo", 1)
    pod = pods["colo-colocated-0"]
    assert [c["name"] for c in pod["spec"]["containers"]] == ["trainer", "engine"]
    assert pod["spec"]["initContainers"][0]["name"] == contract.AGENT_CONTAINER
    trainer, engine = pod["spec"]["containers"]
    assert _gpus(trainer) == 8 and _gpus(engine) == 0
    for c in (engine, pod["spec"]["initContainers"][0]):
        assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in c["env"]
    assert pod["spec"]["readinessGates"] == [{"conditionType": contract.POD_CONDITION_SYNCED}]
    node = kube.core.read_node(pod["spec"]["nodeName"])
    assert node.status.allocatable[GPU] == "8"
    topo = Topology.from_json(kube.core.read_namespaced_config_map("colo-topology", namespace).data[contract.TOPOLOGY_FILE])
    assert topo.mode == "IPC" and [g.members for g in topo.groups] == [["colo-colocated-0"]]


def test_partial_node_colocated_without_dra_is_refused_with_a_condition(kube, namespace, operator):
    op = operator()
    create_job(kube, namespace, "half", colocated_spec(pods=2, gpus_per_pod=4, replicas=4))

    def refused() -> dict[str, Any] | None:
        job = get_job(kube, namespace, "half")
        c = condition(job, "Ready")
        return job if c and c["reason"] == "ColocatedNeedsWholeNodeOrDRA" else None

    job = wait_until(refused, what="refusal condition")
    ready = condition(job, "Ready")
    assert ready["status"] == "False" and "gpusPerPod is 4" in ready["message"]
    assert ready["observedGeneration"] == job["metadata"]["generation"]
    wait_until(lambda: any(e.reason == "ColocatedNeedsWholeNodeOrDRA" for e in events_for(kube, namespace, "half")),
               what="warning event")
    time.sleep(3)
    assert pods_of(kube, namespace, "half") == {} and op.alive()


def test_invalid_template_is_a_condition_and_an_event_not_a_crash_loop(kube, namespace, operator):
    op = operator()
    spec = separated_spec()
    # What the CRD's core/v1 template schema already refuses never reaches the operator ...
    spec["inference"]["template"]["spec"]["restartPolicy"] = "Sometimes"
    with pytest.raises(ApiException) as refused:
        create_job(kube, namespace, "bad", spec)
    assert refused.value.status == 422 and "spec.inference.template.spec.restartPolicy" in str(refused.value.body)
    # ... the rest of pod validation is the operator's server-side dry-run: a container name that is no DNS label.
    del spec["inference"]["template"]["spec"]["restartPolicy"]
    spec["inference"]["template"]["spec"]["containers"] = [container("Engine_1")]
    create_job(kube, namespace, "bad", spec)

    def invalid() -> dict[str, Any] | None:
        job = get_job(kube, namespace, "bad")
        c = condition(job, "Ready")
        return job if c and c["reason"] == "InvalidTemplate" else None

    job = wait_until(invalid, what="InvalidTemplate condition")
    assert "Engine_1" in condition(job, "Ready")["message"]
    wait_until(lambda: any(e.reason == "InvalidTemplate" and e.type == "Warning"
                           for e in events_for(kube, namespace, "bad")), what="InvalidTemplate event")
    # The dry-run refused the template before any pod was created (none of the trainer pods either).
    time.sleep(5)  # > two resync periods
    assert pods_of(kube, namespace, "bad") == {}
    assert op.alive()
    assert len([e for e in events_for(kube, namespace, "bad") if e.reason == "InvalidTemplate"]) == 1
    assert "Traceback" not in op.log()


def test_deleted_pod_is_recreated_and_scaling_is_applied(kube, namespace, operator):
    operator()
    create_job(kube, namespace, "heal", separated_spec(trainer_pods=1, trainer_gpus=2, replicas=2, gpus_per_replica=1))
    pods = _wait_scheduled(kube, namespace, "heal", 3)
    old_uid = pods["heal-inference-1-0"]["metadata"]["uid"]
    kube.core.delete_namespaced_pod("heal-inference-1-0", namespace, grace_period_seconds=0)
    wait_until(lambda: (p := live_pods(kube, namespace, "heal").get("heal-inference-1-0"))
               and p["metadata"]["uid"] != old_uid, timeout=60, what="recreated pod")

    # An allowed spec change (inference.replicas) is applied: a new replica and the Role follows.
    kube.custom.patch_namespaced_custom_object(contract.GROUP, contract.VERSION, namespace, contract.PLURAL, "heal",
                                               {"spec": {"inference": {"replicas": 3}}})
    pods = _wait_scheduled(kube, namespace, "heal", 4)
    assert "heal-inference-2-0" in pods
    wait_until(lambda: "heal-inference-2-0" in raw(
        kube, f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles/heal-agent")["rules"][0]["resourceNames"],
        what="role updated")
    kube.custom.patch_namespaced_custom_object(contract.GROUP, contract.VERSION, namespace, contract.PLURAL, "heal",
                                               {"spec": {"inference": {"replicas": 1}}})
    wait_until(lambda: sorted(live_pods(kube, namespace, "heal")) == ["heal-inference-0-0", "heal-trainer-0"],
               what="scale down")
    # A disallowed change is refused by the API server itself.
    with pytest.raises(ApiException) as err:
        kube.custom.patch_namespaced_custom_object(contract.GROUP, contract.VERSION, namespace, contract.PLURAL,
                                                   "heal", {"spec": {"trainer": {"replicas": 2}}})
    assert err.value.status == 422 and "immutable" in str(err.value.body)


def test_restarting_the_operator_changes_nothing(kube, namespace, operator):
    op = operator()
    create_job(kube, namespace, "calm", separated_spec(trainer_pods=1, trainer_gpus=2, replicas=1, gpus_per_replica=2))
    _wait_scheduled(kube, namespace, "calm", 2)
    before = _stable(kube, namespace, "calm")
    # job, 2 pods, 2 services (peer, routing), 2 configmaps (topology, desired state), secret, SA, role, binding, netpol
    assert len(before) == 12
    secret_before = token_of(kube.core.read_namespaced_secret("calm-token", namespace).to_dict())
    assert op.stop() == 0
    op2 = operator()
    wait_until(lambda: "operator started" in op2.log(), what="second operator started")
    time.sleep(6)  # three resync periods of the new operator
    assert _owned_objects(kube, namespace, "calm") == before
    assert token_of(kube.core.read_namespaced_secret("calm-token", namespace).to_dict()) == secret_before
    assert secret_before not in op2.log() and secret_before not in op.log()


def test_deleting_the_job_garbage_collects_everything(kube, namespace, operator):
    operator()
    create_job(kube, namespace, "gone", separated_spec(trainer_pods=1, trainer_gpus=1, replicas=1, gpus_per_replica=1))
    _wait_scheduled(kube, namespace, "gone", 2)
    wait_until(lambda: len(_owned_objects(kube, namespace, "gone")) == 12, what="all owned objects")
    kube.custom.delete_namespaced_custom_object(contract.GROUP, contract.VERSION, namespace, contract.PLURAL, "gone")

    def collected() -> bool:
        try:
            get_job(kube, namespace, "gone")
            return False
        except ApiException as exc:
            if exc.status != 404:
                raise
        left = {k for k in _owned_objects_after_delete(kube, namespace, "gone")}
        return not left

    wait_until(collected, timeout=90, what="garbage collection")
    # Pods bound to a node get a deletionTimestamp from the garbage collector (no kubelet here to finish it).
    assert all(p["metadata"].get("deletionTimestamp") for p in pods_of(kube, namespace, "gone").values())


def _owned_objects_after_delete(kube: Any, ns: str, job: str) -> set[str]:
    left = set()
    for kind, path in {
        "Service": f"/api/v1/namespaces/{ns}/services/{job}",
        "RoutingService": f"/api/v1/namespaces/{ns}/services/{job}-inference",
        "ConfigMap": f"/api/v1/namespaces/{ns}/configmaps/{job}-topology",
        "DesiredConfigMap": f"/api/v1/namespaces/{ns}/configmaps/{job}-desired",
        "Secret": f"/api/v1/namespaces/{ns}/secrets/{job}-token",
        "ServiceAccount": f"/api/v1/namespaces/{ns}/serviceaccounts/{job}-agent",
        "Role": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles/{job}-agent",
        "RoleBinding": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings/{job}-agent",
        "NetworkPolicy": f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies/{job}-agents",
    }.items():
        try:
            raw(kube, path)
            left.add(kind)
        except ApiException as exc:
            if exc.status != 404:
                raise
    return left


def test_status_is_json_the_api_stores_verbatim(kube, namespace, operator):
    """The status written equals what the API returns (no drift that would cause endless patches)."""
    operator()
    create_job(kube, namespace, "st", separated_spec(trainer_pods=1, trainer_gpus=1, replicas=1, gpus_per_replica=1))
    _wait_scheduled(kube, namespace, "st", 2)
    before = _stable(kube, namespace, "st")
    job = get_job(kube, namespace, "st")
    assert before[f"{contract.KIND}/st"] == job["metadata"]["resourceVersion"]
    for c in job["status"]["conditions"]:
        assert c["lastTransitionTime"].endswith("Z") and c["reason"]
    json.dumps(job["status"])


def test_mutable_spec_change_updates_topology_and_reports_outdated_pods(kube, namespace, operator):
    operator()
    create_job(kube, namespace, "edit", separated_spec(trainer_pods=1, trainer_gpus=1, replicas=1, gpus_per_replica=1))
    pods = _wait_scheduled(kube, namespace, "edit", 2)
    uids = {n: p["metadata"]["uid"] for n, p in pods.items()}

    def topology() -> Topology:
        cm = kube.core.read_namespaced_config_map("edit-topology", namespace)
        return Topology.from_json(cm.data[contract.TOPOLOGY_FILE])

    # Wait until the topology records where the scheduler put the pods (that is a membership change).
    wait_until(lambda: all(m.node for m in topology().trainer.pods + topology().inference[0].pods),
               what="topology with nodes")
    gen_before = topology().generation
    kube.custom.patch_namespaced_custom_object(contract.GROUP, contract.VERSION, namespace, contract.PLURAL, "edit",
                                               {"spec": {"transfer": {"bucketSizeMB": 256}}})

    def outdated() -> dict[str, Any] | None:
        job = get_job(kube, namespace, "edit")
        c = condition(job, "Progressing") or {}
        return job if c.get("reason") == "PodsOutdated" else None

    job = wait_until(outdated, what="PodsOutdated")
    assert job["status"]["observedGeneration"] == job["metadata"]["generation"] == 2
    topo = topology()
    assert topo.bucket_size_mb == 256 and topo.generation == gen_before  # not a membership change
    assert {n: p["metadata"]["uid"] for n, p in live_pods(kube, namespace, "edit").items()} == uids
