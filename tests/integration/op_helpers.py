"""Helpers for the operator integration tests (a uniquely named module: several test folders have a
conftest.py, which cannot be imported by name reliably)."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from weightsync.crds import contract, desired
from weightsync.e2e.demo import operator_key_file
from weightsync.e2e.procs import free_port

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / f"{contract.GROUP}_{contract.PLURAL}.yaml"
OPERATOR_BIN = Path(sys.executable).parent / "weightsync-operator"
AGENT_IMAGE = "weightsync-agent:integration"
# The operator tests get their own simulated GPU nodes (see conftest.op_nodes): not process nodes, so
# their pods are only placed, never run, whether or not the session's process runtime is up; tainted, so
# no other test's pods use their GPUs.
POOL_LABEL = "weightsync.io/test-pool"
POOL = "operator"
POOL_SELECTOR = {POOL_LABEL: POOL}
POOL_TOLERATION = {"key": POOL_LABEL, "operator": "Equal", "value": POOL, "effect": "NoSchedule"}


def pin_to_pool(template: dict[str, Any]) -> dict[str, Any]:
    """Add the pool's nodeSelector and toleration to a pod template (in place; returned for chaining)."""
    spec = template.setdefault("spec", {})
    spec.setdefault("nodeSelector", {}).update(POOL_SELECTOR)
    spec["tolerations"] = [*(spec.get("tolerations") or []), POOL_TOLERATION]
    return template


def pin_job(spec: dict[str, Any]) -> dict[str, Any]:
    pin_to_pool(spec["trainer"]["template"])
    pin_to_pool(spec["inference"]["template"])
    return spec


@dataclass
class OperatorProcess:
    """The real operator (`weightsync-operator --namespace NS`) as a child process."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    health_port: int

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        return self.proc.returncode


def start_operator(kubeconfig: Path, namespace: str | None, log_dir: Path, *extra: str, resync: float = 2.0,
                   metrics_port: int = 0) -> OperatorProcess:
    """namespace None: cluster-wide (`--all-namespaces`)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"operator-{namespace or 'all'}-{int(time.time() * 1000)}.log"
    scope = ["--namespace", namespace] if namespace else ["--all-namespaces"]
    health = free_port()
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "WEIGHTSYNC_AGENT_IMAGE": AGENT_IMAGE,
        "WEIGHTSYNC_RESYNC_SECONDS": str(resync),
        "WEIGHTSYNC_OPERATOR_KEY_FILE": str(operator_key_file(kubeconfig)),
    }
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            [str(OPERATOR_BIN), *scope, "--metrics-port", str(metrics_port), "--health-port", str(health),
             "--verbose", *extra],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
        )
    return OperatorProcess(proc, log_path, health)


def container(name: str, image: str = "busybox:1.36", **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": image, "command": ["sleep", "3600"], **extra}


def job_body(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": contract.API_VERSION, "kind": contract.KIND, "metadata": {"name": name}, "spec": spec}


def separated_spec(trainer_pods: int = 2, trainer_gpus: int = 4, replicas: int = 2, gpus_per_replica: int = 2,
                   **placement: Any) -> dict[str, Any]:
    return {
        "placement": {"mode": "Separated", **placement},
        "transfer": {"mode": "NCCL", "bucketSizeMB": 64},
        "trainer": {
            "replicas": trainer_pods, "gpusPerPod": trainer_gpus,
            "parallelism": {"tensor": 1, "pipeline": 1, "data": trainer_pods * trainer_gpus},
            "template": {"spec": {"containers": [container("trainer")]}},
        },
        "inference": {
            "replicas": replicas, "gpusPerReplica": gpus_per_replica, "parallelism": {"tensor": gpus_per_replica},
            "engine": {"type": "SGLang", "port": 30000},
            "template": {"spec": {"containers": [container("engine")]}},
        },
    }


def colocated_spec(pods: int = 1, gpus_per_pod: int = 8, replicas: int = 4, gpus_per_replica: int = 2) -> dict[str, Any]:
    return {
        "placement": {"mode": "Colocated"},
        "transfer": {"mode": "IPC", "bucketSizeMB": 64},
        "trainer": {
            "replicas": pods, "gpusPerPod": gpus_per_pod,
            "parallelism": {"tensor": 1, "pipeline": 1, "data": pods * gpus_per_pod},
            "template": {"spec": {"containers": [container("trainer")]}},
        },
        "inference": {
            "replicas": replicas, "gpusPerReplica": gpus_per_replica, "parallelism": {"tensor": gpus_per_replica},
            "engine": {"type": "VLLM", "port": 8000},
            "template": {"spec": {"containers": [container("engine")]}},
        },
    }


def create_job(kube: Any, namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Create a job whose pods go to the operator tests' node pool."""
    return kube.custom.create_namespaced_custom_object(
        contract.GROUP, contract.VERSION, namespace, contract.PLURAL, job_body(name, pin_job(spec))
    )


def get_job(kube: Any, namespace: str, name: str) -> dict[str, Any]:
    return kube.custom.get_namespaced_custom_object(contract.GROUP, contract.VERSION, namespace, contract.PLURAL, name)


def raw(kube: Any, path: str) -> dict[str, Any]:
    """GET a path as plain JSON (no typed-model round trip)."""
    resp = kube.api.call_api(*kube.api.param_serialize("GET", path, auth_settings=["BearerToken"]))
    resp.read()
    if not 200 <= resp.status <= 299:
        raise ApiException(status=resp.status, reason=resp.reason, body=resp.data)
    return json.loads(resp.data)


def pods_of(kube: Any, namespace: str, job: str) -> dict[str, dict[str, Any]]:
    sel = f"{contract.LABEL_JOB}={job}"
    items = raw(kube, f"/api/v1/namespaces/{namespace}/pods?labelSelector={sel}")["items"]
    return {p["metadata"]["name"]: p for p in items}


def desired_of(kube: Any, namespace: str, job: str, pod: str) -> dict[str, str] | None:
    """What the operator asks of POD: its entry in the job's desired-state ConfigMap (None: not named)."""
    cm = raw(kube, f"/api/v1/namespaces/{namespace}/configmaps/{contract.desired_configmap_name(job)}")
    return desired.decode_pod(cm.get("data"), pod)


def live_pods(kube: Any, namespace: str, job: str) -> dict[str, dict[str, Any]]:
    return {n: p for n, p in pods_of(kube, namespace, job).items() if not p["metadata"].get("deletionTimestamp")}


def condition(job: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in (job.get("status") or {}).get("conditions") or [] if c["type"] == type_), None)


def token_of(secret: dict[str, Any]) -> str:
    return base64.b64decode(secret["data"][contract.TOKEN_FILE]).decode()


def token_kubeconfig(admin: Path, token: str, out: Path) -> Path:
    """A kubeconfig for the same cluster that authenticates with a bearer token only."""
    import yaml

    cfg = yaml.safe_load(admin.read_text())
    ctx = next(c for c in cfg["contexts"] if c["name"] == cfg["current-context"])
    cluster = next(c for c in cfg["clusters"] if c["name"] == ctx["context"]["cluster"])
    out.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [cluster],
        "users": [{"name": "token", "user": {"token": token}}],
        "contexts": [{"name": "token", "context": {"cluster": cluster["name"], "user": "token"}}],
        "current-context": "token",
    }))
    return out


def force_delete_pods(kube: Any, namespace: str) -> None:
    """Without a kubelet a deleted pod stays Terminating and holds its GPUs: remove them for good."""
    try:
        pods = kube.core.list_namespaced_pod(namespace).items
    except ApiException:
        return
    for p in pods:
        try:
            kube.core.delete_namespaced_pod(p.metadata.name, namespace, grace_period_seconds=0)
        except ApiException as exc:
            if exc.status != 404:
                raise


def events_for(kube: Any, namespace: str, name: str) -> list[Any]:
    return [e for e in kube.core.list_namespaced_event(namespace).items
            if e.involved_object.kind == contract.KIND and e.involved_object.name == name]
