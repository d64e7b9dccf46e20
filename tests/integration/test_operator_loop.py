"""The closed loop through the API: agents (played here by kubectl with the per-job ServiceAccount's
token, i.e. exactly the agent's permissions) report versions on their pods; the operator aggregates them
into the job status and hands out target versions under maxUnavailable. Plus metrics/health, DRA and
the shipped examples under the running operator."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from op_helpers import (
    REPO,
    condition,
    create_job,
    desired_of,
    force_delete_pods,
    free_port,
    get_job,
    live_pods,
    pin_job,
    raw,
    separated_spec,
    token_kubeconfig,
)

from weightsync.agent.podstate import Observed
from weightsync.agent.podstatus import PodLink, push_report
from weightsync.crds import contract, report_push, version_proof
from weightsync.e2e.demo import operator_key_file
from weightsync.e2e.pytest_plugin import wait_until

pytestmark = pytest.mark.cluster


class AgentKubectl:
    """kubectl authenticated as the job's agent ServiceAccount; versions carry the agent's proof, made with
    the job token the operator derived from its key (as a real agent reads it from the job's Secret)."""

    def __init__(self, cluster: Any, namespace: str, sa: str, tmp: Path) -> None:
        token = cluster.kubectl("create", "token", sa, "-n", namespace, "--duration=1h").stdout.strip()
        self.kubeconfig = token_kubeconfig(Path(cluster.kubeconfig), token, tmp / f"{sa}.kubeconfig")
        self.cluster = cluster
        self.ns = namespace

    def run(self, *args: str) -> Any:
        return self.cluster.kubectl(f"--kubeconfig={self.kubeconfig}", "-n", self.ns, *args)

    def annotate(self, pod: str, key: str, value: str) -> None:
        current = json.loads(self.run("get", "pod", pod, "-o", "json").stdout)
        meta = current["metadata"]
        ann = {**(meta.get("annotations") or {}), key: value}
        if key in contract.VERSION_PROOF_KEYS:
            job = meta["labels"][contract.LABEL_JOB]
            owner = next(o for o in meta["ownerReferences"] if o.get("controller"))
            key_file = operator_key_file(Path(self.cluster.kubeconfig))
            token = version_proof.job_token(key_file.read_bytes().strip(), self.ns, job, owner["uid"])
            patch = {key: value, contract.ANN_VERSION_PROOF: version_proof.version_proof(token, meta["uid"], ann)}
        else:
            patch = {key: value}
        self.run("patch", "pod", pod, "--type=merge", "-p", json.dumps({"metadata": {"annotations": patch}}))

    def condition(self, pod: str, type_: str, status: str) -> None:
        body = {"status": {"conditions": [{"type": type_, "status": status, "reason": "Test"}]}}
        self.run("patch", "pod", pod, "--subresource=status", "--type=strategic", "-p", json.dumps(body))


def _kubelet_ready(cluster: Any, namespace: str, pod: str) -> None:
    """What a kubelet would report once the containers run (there is none for these nodes)."""
    body = {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
    cluster.kubectl("patch", "pod", pod, "-n", namespace, "--subresource=status", "--type=strategic",
                    "-p", json.dumps(body))


def _targets(kube: Any, ns: str, job: str) -> dict[str, str | None]:
    """The target of each inference pod, from the job's desired-state ConfigMap; none is on the pods."""
    pods = {n: p for n, p in live_pods(kube, ns, job).items() if "inference" in n}
    assert not any(contract.ANN_TARGET_VERSION in (p["metadata"].get("annotations") or {}) for p in pods.values())
    return {n: (desired_of(kube, ns, job, n) or {}).get(contract.ANN_TARGET_VERSION) for n in pods}


def test_versions_flow_from_agents_to_status_and_rollout_respects_max_unavailable(cluster, kube, namespace,
                                                                                   operator, tmp_path):
    operator()
    spec = separated_spec(trainer_pods=1, trainer_gpus=1, replicas=2, gpus_per_replica=1)
    spec["updatePolicy"] = {"maxUnavailable": 1, "maxStaleness": 1}
    create_job(kube, namespace, "loop", spec)
    wait_until(lambda: len(live_pods(kube, namespace, "loop")) == 3, what="pods")
    agent = AgentKubectl(cluster, namespace, "loop-agent", tmp_path)
    inf = ["loop-inference-0-0", "loop-inference-1-0"]
    for pod in ["loop-trainer-0", *inf]:
        _kubelet_ready(cluster, namespace, pod)

    # The trainer's agent publishes version 3: both replicas serve nothing yet, so both get it at once.
    agent.annotate("loop-trainer-0", contract.ANN_PUBLISHED_VERSION, "3")
    wait_until(lambda: _targets(kube, namespace, "loop") == {inf[0]: "3", inf[1]: "3"}, what="targets 3")
    # The pods are patched before the status in a pass: wait for the status rather than read it once.
    job = wait_until(lambda: (j := get_job(kube, namespace, "loop"))["status"].get("trainerVersion") == 3 and j,
                     what="trainerVersion 3")
    assert condition(job, "Synced")["status"] == "False"

    # The inference agents load it and report: served version + the synced condition (readiness gate).
    for pod in inf:
        agent.annotate(pod, contract.ANN_SERVED_VERSION, "3")
        agent.condition(pod, contract.POD_CONDITION_SYNCED, "True")
        _kubelet_ready(cluster, namespace, pod)

    def synced() -> dict[str, Any] | None:
        j = get_job(kube, namespace, "loop")
        return j if (condition(j, "Synced") or {}).get("status") == "True" else None

    job = wait_until(synced, what="Synced=True")
    st = job["status"]
    assert st["servedVersion"] == 3 and st["replicas"] == {"inference": 2, "synced": 2, "ready": 2}
    assert condition(job, "Ready")["status"] == "True" and condition(job, "Progressing")["status"] == "False"
    row = cluster.kubectl("get", "wsj", "loop", "-n", namespace, "--no-headers").stdout.split()
    assert row[:7] == ["loop", "Separated", "NCCL", "3", "3", "True", "True"]

    # Version 4: with maxUnavailable=1 only one serving replica loads at a time.
    agent.annotate("loop-trainer-0", contract.ANN_PUBLISHED_VERSION, "4")
    first = wait_until(lambda: [n for n, t in _targets(kube, namespace, "loop").items() if t == "4"] or None,
                       what="one replica targeted")
    assert len(first) == 1
    assert sorted(str(v) for v in _targets(kube, namespace, "loop").values()) == ["3", "4"]
    agent.annotate(first[0], contract.ANN_SERVED_VERSION, "4")
    wait_until(lambda: _targets(kube, namespace, "loop") == {inf[0]: "4", inf[1]: "4"}, what="second replica")
    other = next(n for n in inf if n != first[0])
    agent.annotate(other, contract.ANN_SERVED_VERSION, "4")
    wait_until(lambda: get_job(kube, namespace, "loop")["status"].get("servedVersion") == 4, what="served 4")

    # The agent cannot touch another job's pods or the job itself.
    r = cluster.kubectl(f"--kubeconfig={agent.kubeconfig}", "-n", namespace, "patch", "wsj", "loop",
                        "--type=merge", "-p", '{"spec":{"paused":true}}', check=False)
    assert r.returncode != 0 and "forbidden" in r.stderr.lower()

    # The agent reads the job's desired-state ConfigMap (as its watch does) but cannot change it.
    cm_name = contract.desired_configmap_name("loop")
    r = cluster.kubectl(f"--kubeconfig={agent.kubeconfig}", "-n", namespace, "get", "configmap", cm_name,
                        "-o", "json", check=False)
    assert r.returncode == 0, r.stderr
    r = cluster.kubectl(f"--kubeconfig={agent.kubeconfig}", "-n", namespace, "patch", "configmap", cm_name,
                        "--type=merge", "-p", json.dumps({"data": {inf[0]: '{"target-version":"99"}'}}), check=False)
    assert r.returncode != 0 and "forbidden" in r.stderr.lower()

    # spec.paused flows to the inference pods' entries of the desired-state ConfigMap and to the Paused condition.
    kube.custom.patch_namespaced_custom_object(contract.GROUP, contract.VERSION, namespace, contract.PLURAL, "loop",
                                               {"spec": {"paused": True}})
    wait_until(lambda: all((desired_of(kube, namespace, "loop", n) or {}).get(contract.ANN_PAUSED) == "true"
                           for n in live_pods(kube, namespace, "loop") if "inference" in n),
               what="paused in the desired state")
    c = wait_until(lambda: (x := condition(get_job(kube, namespace, "loop"), "Paused")) and x["reason"] == "Pausing"
                   and x, what="Paused=False/Pausing until the engines confirm")
    assert c["status"] == "False" and "0/2" in c["message"]
    agent.annotate(inf[0], contract.ANN_ENGINE_PAUSED, "true")
    wait_until(lambda: "1/2" in condition(get_job(kube, namespace, "loop"), "Paused")["message"], what="1/2 confirmed")
    assert condition(get_job(kube, namespace, "loop"), "Paused")["status"] == "False"
    agent.annotate(inf[1], contract.ANN_ENGINE_PAUSED, "true")
    wait_until(lambda: (condition(get_job(kube, namespace, "loop"), "Paused") or {}).get("status") == "True",
               what="Paused=True once every engine confirmed")



def test_agents_push_their_reports_and_the_status_does_not_wait_for_their_pod_writes(cluster, kube, namespace,
                                                                                     operator, tmp_path):
    """The real PodLink of each agent pushes to the operator's report listener (advertised in the job's
    desired-state ConfigMap): the status moves while no pod carries the version yet, a report signed with
    another token moves nothing, and the pod write that follows is the durable record."""
    port = free_port()
    op = operator("--report-address", "127.0.0.1", "--report-port", str(port))
    create_job(kube, namespace, "push", separated_spec(trainer_pods=1, trainer_gpus=1, replicas=2, gpus_per_replica=1))
    wait_until(lambda: len(live_pods(kube, namespace, "push")) == 3, what="pods")
    trainer, inf = "push-trainer-0", ["push-inference-0-0", "push-inference-1-0"]
    for pod in [trainer, *inf]:
        _kubelet_ready(cluster, namespace, pod)
    base = f"http://127.0.0.1:{port}{contract.REPORT_PATH}"
    cm_name = contract.desired_configmap_name("push")

    def report_to() -> str:
        return str(raw(kube, f"/api/v1/namespaces/{namespace}/configmaps/{cm_name}").get("data", {}).get(
            contract.DESIRED_REPORT_TO_KEY) or "")

    url = wait_until(lambda: (u := report_to()).startswith(base + "?instance=") and u,
                     what="the report address in the desired state")
    job_uid = get_job(kube, namespace, "push")["metadata"]["uid"]
    token = version_proof.job_token(operator_key_file(Path(cluster.kubeconfig)).read_bytes().strip(), namespace,
                                    "push", job_uid).encode()
    links = {pod: PodLink(namespace, pod, lambda d: None, api=kube.core, token=token, desired_configmap=cm_name,
                          job="push", write_delay=120.0).start() for pod in [trainer, *inf]}
    try:
        wait_until(lambda: all(link.report_to == url for link in links.values()), what="agents see the address")
        links[trainer].report(Observed(published_version=3))
        wait_until(lambda: _targets(kube, namespace, "push") == {inf[0]: "3", inf[1]: "3"}, what="targets 3")
        for pod in inf:
            links[pod].report(Observed(served_version=3, synced=True, synced_reason="UpToDate",
                                       last_sync={"version": 3, "durationSeconds": 0.1, "bytes": 1, "mode": "NCCL"}))
        job = wait_until(lambda: (j := get_job(kube, namespace, "push"))["status"].get("servedVersion") == 3 and j,
                         what="served 3 from the pushed reports")
        assert job["status"]["trainerVersion"] == 3
        pods = live_pods(kube, namespace, "push")
        for pod in [trainer, *inf]:
            ann = pods[pod]["metadata"].get("annotations") or {}
            assert contract.ANN_SERVED_VERSION not in ann and contract.ANN_PUBLISHED_VERSION not in ann, (
                f"{pod} was written: the status did not come from the push")
        assert all(link.stats.counts["annotations"] == 0 for link in links.values())

        # A report signed with another token is refused and moves nothing.
        forged = report_push.build("0" * 64, namespace, "push", inf[0], pods[inf[0]]["metadata"]["uid"],
                                   time.time_ns(), {contract.ANN_SERVED_VERSION: "9"})
        code, message = push_report(url, forged)
        assert code == 403, message
        time.sleep(1.0)
        assert get_job(kube, namespace, "push")["status"]["servedVersion"] == 3

        # A restarted operator holds no report: the agents see its new instance and push theirs again, so
        # the status is right again while the pods still carry nothing.
        op.stop()
        operator("--report-address", "127.0.0.1", "--report-port", str(port))
        url = wait_until(lambda: (u := report_to()) != url and u.startswith(base) and u, what="the new instance")
        wait_until(lambda: all(link.report_to == url for link in links.values()), what="agents see it")
        kube.custom.patch_namespaced_custom_object_status(  # what a status from before the restart would not show
            contract.GROUP, contract.VERSION, namespace, contract.PLURAL, "push", {"status": {"servedVersion": 0}})
        wait_until(lambda: get_job(kube, namespace, "push")["status"].get("servedVersion") == 3,
                   what="served 3 again, from the reports pushed again")
        pods = live_pods(kube, namespace, "push")
        assert not any(contract.ANN_SERVED_VERSION in (pods[p]["metadata"].get("annotations") or {}) for p in inf)

        # The durable record: the pod writes land, the status stays.
        for link in links.values():
            assert link.flush(10)
        pods = live_pods(kube, namespace, "push")
        assert all(pods[p]["metadata"]["annotations"].get(contract.ANN_SERVED_VERSION) == "3" for p in inf)
        assert pods[trainer]["metadata"]["annotations"].get(contract.ANN_PUBLISHED_VERSION) == "3"
        time.sleep(1.0)
        assert get_job(kube, namespace, "push")["status"]["servedVersion"] == 3
    finally:
        for link in links.values():
            link.close()


def test_pods_of_an_older_operator_also_get_their_desired_state_as_annotations(cluster, kube, namespace, operator,
                                                                              tmp_path):
    """An operator upgrade strands no agent: a pod built from an older spec (its agent may read only its pod's
    annotations) gets its target on the pod too; a pod this operator built gets it only in `<job>-desired`."""
    operator()
    spec = separated_spec(trainer_pods=1, trainer_gpus=1, replicas=2, gpus_per_replica=1)
    create_job(kube, namespace, "upg", spec)
    wait_until(lambda: len(live_pods(kube, namespace, "upg")) == 3, what="pods")
    agent = AgentKubectl(cluster, namespace, "upg-agent", tmp_path)
    old, new = "upg-inference-0-0", "upg-inference-1-0"
    for pod in ["upg-trainer-0", old, new]:
        _kubelet_ready(cluster, namespace, pod)
    cluster.kubectl("annotate", "pod", old, "-n", namespace, "--overwrite", f"{contract.ANN_SPEC_HASH}=older-operator")

    agent.annotate("upg-trainer-0", contract.ANN_PUBLISHED_VERSION, "3")
    pods = wait_until(lambda: (p := live_pods(kube, namespace, "upg"))
                      and (p[old]["metadata"].get("annotations") or {}).get(contract.ANN_TARGET_VERSION) == "3" and p,
                      what="the old pod's target annotation")
    assert (desired_of(kube, namespace, "upg", old) or {}).get(contract.ANN_TARGET_VERSION) == "3"
    assert (desired_of(kube, namespace, "upg", new) or {}).get(contract.ANN_TARGET_VERSION) == "3"
    assert contract.ANN_TARGET_VERSION not in (pods[new]["metadata"].get("annotations") or {})

def test_metrics_and_health_endpoints(kube, namespace, operator):
    port = free_port()
    op = operator(metrics_port=port)
    wait_until(lambda: "operator started" in op.log(), what="startup")
    create_job(kube, namespace, "m", separated_spec(trainer_pods=1, trainer_gpus=1, replicas=1, gpus_per_replica=1))
    wait_until(lambda: len(live_pods(kube, namespace, "m")) == 2, what="pods")

    def metric(name: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#"))

    wait_until(lambda: metric("weightsync_operator_reconciles_total") >= 2, what="reconcile metric")
    assert metric("weightsync_operator_reconcile_duration_seconds_count") >= 2
    assert metric("weightsync_operator_reconcile_errors_total") == 0
    health = urllib.request.urlopen(f"http://127.0.0.1:{op.health_port}/healthz", timeout=5)
    assert health.status == 200 and "jobs" in json.loads(health.read())


@pytest.mark.parametrize("dra, operator_default", [
    ({"deviceClassName": "gpu.example.com"}, "other.example.com"),  # the job's class wins
    ({}, "gpu.example.com"),  # the chart's cluster.draDeviceClassName (operator env) fills it in
], ids=["job-class", "operator-default"])
def test_colocated_with_dra_builds_a_claim_template_and_pods_reference_it(kube, namespace, operator, monkeypatch,
                                                                         dra, operator_default):
    monkeypatch.setenv("WEIGHTSYNC_DRA_DEVICE_CLASS", operator_default)
    operator()
    spec = {
        "placement": {"mode": "Colocated", "dra": dra},
        "transfer": {"mode": "IPC", "bucketSizeMB": 64},
        "trainer": {"replicas": 2, "gpusPerPod": 2, "parallelism": {"tensor": 1, "pipeline": 1, "data": 4},
                    "template": {"spec": {"containers": [{"name": "trainer", "image": "x"}]}}},
        "inference": {"replicas": 2, "gpusPerReplica": 2, "parallelism": {"tensor": 2},
                      "engine": {"type": "VLLM"}, "template": {"spec": {"containers": [{"name": "engine", "image": "x"}]}}},
    }
    create_job(kube, namespace, "dra", spec)
    pods = wait_until(lambda: (p := live_pods(kube, namespace, "dra")) and len(p) == 2 and p, what="pods")
    rct = raw(kube, f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaimtemplates/dra-gpus")
    assert rct["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] == 2
    assert rct["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == "gpu.example.com"
    for pod in pods.values():
        assert pod["spec"]["resourceClaims"] == [{"name": "weightsync-gpus", "resourceClaimTemplateName": "dra-gpus"}]
        for c in pod["spec"]["containers"] + pod["spec"]["initContainers"][:1]:
            assert c["resources"]["claims"] == [{"name": "weightsync-gpus"}]
    # The resource-claim controller (kube-controller-manager) makes one claim per pod from the template, one
    # after the other: wait for both (a list taken between the two creates holds one)
    def claims() -> list[dict[str, Any]]:
        return list(raw(kube, f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims")["items"])

    wait_until(lambda: len(claims()) >= 2 or None, what="a ResourceClaim per pod")
    assert sorted(c["metadata"]["name"].rsplit("-weightsync-gpus-", 1)[0] for c in claims()) == sorted(pods)


@pytest.mark.parametrize("example, pods", [("separated-nccl.yaml", 4), ("colocated-ipc.yaml", 2)])
def test_examples_are_placed_by_the_scheduler(cluster, kube, namespace, operator, example, pods):
    operator()
    body = yaml.safe_load((REPO / "examples" / example).read_text())
    name = body["metadata"]["name"]
    pin_job(body["spec"])  # the example as shipped, plus the test pool's nodeSelector and toleration
    cluster.kubectl("apply", "--server-side", "-n", namespace, "-f", "-", input=yaml.safe_dump(body))
    placed = wait_until(lambda: (p := live_pods(kube, namespace, name)) and len(p) == pods
                        and all(x["spec"].get("nodeName") for x in p.values()) and p, timeout=90, what="placed")
    assert all(x["spec"]["initContainers"][0]["name"] == contract.AGENT_CONTAINER for x in placed.values())
    force_delete_pods(kube, namespace)


def test_gdr_example_without_rdma_on_the_nodes_reports_unschedulable(cluster, kube, namespace, operator):
    operator()
    body = yaml.safe_load((REPO / "examples" / "separated-gdr.yaml").read_text())
    body["spec"]["placement"].pop("topologyKey", None)  # keep the test about the RDMA resource
    pin_job(body["spec"])
    cluster.kubectl("apply", "--server-side", "-n", namespace, "-f", "-", input=yaml.safe_dump(body))
    name = body["metadata"]["name"]

    def unschedulable() -> dict[str, Any] | None:
        c = condition(get_job(kube, namespace, name), "Progressing") or {}
        return c if c.get("reason") == "PodsUnschedulable" else None

    c = wait_until(unschedulable, timeout=90, what="PodsUnschedulable")
    assert "rdma/hca_shared_devices_a" in c["message"]
    agent = live_pods(kube, namespace, name)[f"{name}-trainer-0"]["spec"]["initContainers"][0]
    assert agent["resources"]["limits"]["rdma/hca_shared_devices_a"] == "1"
    assert agent["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
