"""The process runtime against the real local control plane (issue 2, item 4 "Must show").

Each test creates real objects through the real apiserver; the scheduler binds the pods to a process
node, the runtime runs them as host processes, and the assertions read back the API and the files the
processes wrote.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from weightsync.crds.contract import LABEL_PROCESS_NODE, POD_CONDITION_SYNCED
from weightsync.e2e.pytest_plugin import wait_until
from weightsync.e2e.runtime.kube import ApiError, KubeClient, endpoint_from_kubeconfig, pod_path

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]
JSON = dict[str, Any]
ON_PROCESS_NODE = {LABEL_PROCESS_NODE: "true"}


@pytest.fixture(scope="module")
def api(cluster: Any, process_runtime: Any) -> KubeClient:
    if process_runtime is None:
        pytest.skip("no process runtime on this cluster (WEIGHTSYNC_E2E_RUNTIME=0 or an existing cluster)")
    return KubeClient(endpoint_from_kubeconfig(str(cluster.kubeconfig)))


def py(code: str) -> list[str]:
    return ["python3", "-c", textwrap.dedent(code)]


def pod_manifest(name: str, containers: list[JSON], **spec: Any) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"nodeSelector": ON_PROCESS_NODE, "terminationGracePeriodSeconds": 5, "containers": containers, **spec},
    }


def create_pod(api: KubeClient, namespace: str, manifest: JSON) -> JSON:
    return api.post(f"/api/v1/namespaces/{namespace}/pods", manifest)


def get_pod(api: KubeClient, namespace: str, name: str) -> JSON | None:
    try:
        return api.get(pod_path(namespace, name))
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


def condition(pod: JSON, ctype: str) -> str | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond["type"] == ctype:
            return str(cond["status"])
    return None


def wait_pod(api: KubeClient, namespace: str, name: str, check: Any, what: str, timeout: float = 60) -> JSON:
    def probe() -> JSON | None:
        pod = get_pod(api, namespace, name)
        return pod if pod is not None and check(pod) else None

    return wait_until(probe, timeout=timeout, what=f"pod {namespace}/{name}: {what}")


def running(pod: JSON) -> bool:
    return (pod.get("status") or {}).get("phase") == "Running"


def finished(pod: JSON) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def pid_of(pod: JSON, container: str) -> int:
    for cs in pod["status"]["containerStatuses"] + pod["status"].get("initContainerStatuses", []):
        if cs["name"] == container:
            return int(cs["containerID"].removeprefix("process://"))
    raise AssertionError(f"no status for container {container}")


def events_of(api: KubeClient, namespace: str, pod: str, reason: str) -> list[JSON]:
    items = api.get(f"/api/v1/namespaces/{namespace}/events", fieldSelector=f"involvedObject.name={pod}")["items"]
    return [e for e in items if e["reason"] == reason]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


# --- (a) Deployment -> ReplicaSet -> Running pod with a 127/8 IP and its output in the log; GC on delete --
def test_deployment_runs_as_process_and_is_garbage_collected(api: KubeClient, namespace: str, process_runtime: Any) -> None:
    labels = {"app": "hello"}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "hello"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": ON_PROCESS_NODE,
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{
                        "name": "main",
                        "image": "python:3.11",
                        "command": py("""
                            import os, sys, time
                            print("hello from", os.environ["POD_NAME"], "ip", os.environ["POD_IP"], "python", sys.executable, flush=True)
                            time.sleep(3600)
                        """),
                        "env": [
                            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        ],
                    }],
                },
            },
        },
    }
    api.post(f"/apis/apps/v1/namespaces/{namespace}/deployments", deployment)
    rs = wait_until(
        lambda: api.get(f"/apis/apps/v1/namespaces/{namespace}/replicasets")["items"], what="a ReplicaSet"
    )[0]
    assert rs["metadata"]["ownerReferences"][0]["name"] == "hello"
    pods = wait_until(
        lambda: [p for p in api.get(f"/api/v1/namespaces/{namespace}/pods", labelSelector="app=hello")["items"] if running(p)],
        what="a Running pod of the Deployment",
    )
    pod = pods[0]
    name, ip = pod["metadata"]["name"], pod["status"]["podIP"]
    assert ip.startswith("127.") and ip != "127.0.0.1" and pod["status"]["podIPs"] == [{"ip": ip}]
    node = api.get(f"/api/v1/nodes/{pod['spec']['nodeName']}")
    assert node["metadata"]["labels"][LABEL_PROCESS_NODE] == "true"
    log_path = process_runtime.log_path(namespace, name, "main")
    line = wait_until(lambda: log_path.exists() and log_path.read_text().endswith("\n") and log_path.read_text(),
                      what=f"output in {log_path}")
    assert f"hello from {name} ip {ip} python {Path(sys.executable).parent}" in line
    pid = pid_of(pod, "main")
    assert alive(pid)

    api.delete(f"/apis/apps/v1/namespaces/{namespace}/deployments/hello", {"propagationPolicy": "Background"})
    wait_until(
        lambda: not api.get(f"/api/v1/namespaces/{namespace}/pods", labelSelector="app=hello")["items"],
        timeout=60, what="the Deployment's pods to be garbage-collected",
    )
    wait_until(lambda: not alive(pid), timeout=10, what=f"process {pid} to be gone")
    assert not api.get(f"/apis/apps/v1/namespaces/{namespace}/replicasets")["items"]


# --- (b) the projected token carries the pod's real RBAC ------------------------------------------------
LIST_PODS = py("""
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException
    config.load_incluster_config()
    ns = open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()
    try:
        pods = client.CoreV1Api().list_namespaced_pod(ns)
        print("LIST_OK", len(pods.items), flush=True)
    except ApiException as exc:
        print("LIST_STATUS", exc.status, flush=True)
""")


def test_projected_token_has_the_pods_rbac(api: KubeClient, namespace: str, process_runtime: Any) -> None:
    for sa in ("reader", "nobody"):
        api.post(f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": sa}})
    api.post(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles", {
        "metadata": {"name": "pod-reader"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
    })
    api.post(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings", {
        "metadata": {"name": "reader-reads"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
    })
    for sa in ("reader", "nobody"):
        create_pod(api, namespace, pod_manifest(
            f"as-{sa}", [{"name": "main", "image": "x", "command": LIST_PODS}],
            serviceAccountName=sa, restartPolicy="Never",
        ))
    for sa in ("reader", "nobody"):
        pod = wait_pod(api, namespace, f"as-{sa}", finished, "finished", timeout=90)
        assert pod["status"]["phase"] == "Succeeded", pod["status"]
    allowed = process_runtime.log_path(namespace, "as-reader", "main").read_text()
    denied = process_runtime.log_path(namespace, "as-nobody", "main").read_text()
    assert "LIST_OK 2" in allowed, allowed
    assert "LIST_STATUS 403" in denied, denied


# --- (c) native sidecar first, readiness probes, readiness gates -------------------------------------------
def test_native_sidecar_starts_before_main_container(api: KubeClient, namespace: str, process_runtime: Any) -> None:
    shared = {"name": "shared", "mountPath": "/var/run/weightsync"}
    sidecar = {
        "name": "agent", "image": "x", "restartPolicy": "Always", "volumeMounts": [shared],
        "command": py("""
            import time
            open("/var/run/weightsync/agent.started", "w").write(repr(time.time()))
            time.sleep(3600)
        """),
        "startupProbe": {"exec": {"command": ["test", "-f", "/var/run/weightsync/agent.started"]}, "periodSeconds": 1},
    }
    main = {
        "name": "main", "image": "x", "volumeMounts": [shared],
        "command": py("""
            import os, time
            now = time.time()
            agent = float(open("/var/run/weightsync/agent.started").read())
            print("AGENT", agent, "MAIN", now, flush=True)
            time.sleep(3600)
        """),
    }
    create_pod(api, namespace, pod_manifest(
        "sidecar", [main], initContainers=[sidecar], volumes=[{"name": "shared", "emptyDir": {}}],
    ))
    pod = wait_pod(api, namespace, "sidecar", lambda p: condition(p, "Ready") == "True", "Ready")
    log_path = process_runtime.log_path(namespace, "sidecar", "main")
    line = wait_until(lambda: log_path.exists() and log_path.read_text().endswith("\n") and log_path.read_text(),
                      what="main's output")
    fields = line.split()
    agent_ts, main_ts = float(fields[1]), float(fields[3])
    assert agent_ts < main_ts
    (agent_status,) = pod["status"]["initContainerStatuses"]
    assert agent_status["started"] is True and "running" in agent_status["state"]
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0  # main never crashed on a missing file


def test_failing_readiness_probe_keeps_pod_not_ready(api: KubeClient, namespace: str) -> None:
    serve = py("""
        import http.server, os
        http.server.HTTPServer((os.environ["POD_IP"], 8080), http.server.SimpleHTTPRequestHandler).serve_forever()
    """)
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    create_pod(api, namespace, pod_manifest("probes", [
        {"name": "web", "image": "x", "command": serve, "env": env, "ports": [{"name": "http", "containerPort": 8080}],
         "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}},
        {"name": "never-ready", "image": "x", "command": py("import time; time.sleep(3600)"),
         "readinessProbe": {"tcpSocket": {"port": 9}, "periodSeconds": 1, "failureThreshold": 1}},
    ]))
    pod = wait_pod(
        api, namespace, "probes",
        lambda p: running(p) and any(c["ready"] for c in p["status"].get("containerStatuses", [])),
        "web ready",
    )
    time.sleep(3)  # several probe periods
    now = get_pod(api, namespace, "probes")
    assert now is not None
    pod = now
    ready = {c["name"]: c["ready"] for c in pod["status"]["containerStatuses"]}
    assert ready == {"web": True, "never-ready": False}
    assert condition(pod, "Ready") == "False" and condition(pod, "ContainersReady") == "False"
    assert all("running" in c["state"] for c in pod["status"]["containerStatuses"])


def test_readiness_gate_false_keeps_pod_not_ready_until_true(api: KubeClient, namespace: str) -> None:
    create_pod(api, namespace, pod_manifest(
        "gated", [{"name": "main", "image": "x", "command": py("import time; time.sleep(3600)")}],
        readinessGates=[{"conditionType": POD_CONDITION_SYNCED}],
    ))
    pod = wait_pod(api, namespace, "gated", lambda p: condition(p, "ContainersReady") == "True", "containers ready")
    assert condition(pod, "Ready") == "False"

    def set_gate(status: str) -> None:
        api.patch(pod_path(namespace, "gated", "status"), {"status": {"conditions": [
            {"type": POD_CONDITION_SYNCED, "status": status, "reason": "Test"}]}})

    set_gate("False")
    time.sleep(2)
    gated = get_pod(api, namespace, "gated")
    assert gated is not None and condition(gated, "Ready") == "False"
    assert condition(gated, POD_CONDITION_SYNCED) == "False"
    set_gate("True")
    pod = wait_pod(api, namespace, "gated", lambda p: condition(p, "Ready") == "True", "Ready after the gate")
    time.sleep(2)  # later runtime status updates keep the foreign condition
    gated = get_pod(api, namespace, "gated")
    assert gated is not None and condition(gated, POD_CONDITION_SYNCED) == "True" and condition(gated, "Ready") == "True"


# --- (d) unknown executable: Waiting with a clear reason, the runtime keeps working ------------------------
def test_unknown_executable_waits_with_a_clear_reason(api: KubeClient, namespace: str) -> None:
    create_pod(api, namespace, pod_manifest("bad-exec", [
        {"name": "main", "image": "x", "command": ["definitely-not-installed-xyz", "--flag"]}]))
    pod = wait_pod(
        api, namespace, "bad-exec",
        lambda p: (p.get("status") or {}).get("containerStatuses"), "a container status",
    )
    waiting = pod["status"]["containerStatuses"][0]["state"]["waiting"]
    assert waiting["reason"] == "ExecutableNotFound"
    assert "definitely-not-installed-xyz" in waiting["message"] and "PATH" in waiting["message"]
    assert pod["status"]["phase"] == "Pending"
    failed = wait_until(lambda: events_of(api, namespace, "bad-exec", "Failed"), what="a Failed event")
    assert failed[0]["type"] == "Warning" and "definitely-not-installed-xyz" in failed[0]["message"]
    create_pod(api, namespace, pod_manifest("good", [
        {"name": "main", "image": "x", "command": py("import time; time.sleep(3600)")}]))
    wait_pod(api, namespace, "good", running, "Running (the runtime still works)")


# --- (e) deletion: SIGTERM reaches the process, grace period, then SIGKILL ----------------------------------
def test_delete_sends_sigterm_then_sigkill_after_grace(api: KubeClient, namespace: str, tmp_path: Path) -> None:
    out = {"name": "out", "hostPath": {"path": str(tmp_path), "type": "Directory"}}
    handles = py("""
        import os, signal, sys, time
        def on_term(signum, frame):
            open(f"/out/{os.environ['HOSTNAME']}.sigterm", "w").write(repr(time.time()))
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        open(f"/out/{os.environ['HOSTNAME']}.started", "w").write("")
        time.sleep(3600)
    """)
    ignores = py("""
        import os, signal, time
        signal.signal(signal.SIGTERM, lambda *a: open(f"/out/{os.environ['HOSTNAME']}.sigterm", "w").write("ignored"))
        open(f"/out/{os.environ['HOSTNAME']}.started", "w").write("")
        time.sleep(3600)
    """)
    mounts = [{"name": "out", "mountPath": "/out"}]
    pre_stop = {"preStop": {"exec": {"command": py("import time; open('/out/graceful.prestop', 'w').write(repr(time.time()))")}}}
    for name, command, grace, lifecycle in (("graceful", handles, 30, pre_stop), ("stubborn", ignores, 2, {})):
        create_pod(api, namespace, pod_manifest(
            name, [{"name": "main", "image": "x", "command": command, "volumeMounts": mounts, "lifecycle": lifecycle}],
            volumes=[out], terminationGracePeriodSeconds=grace,
        ))
    pids = {}
    for name in ("graceful", "stubborn"):
        pod = wait_pod(api, namespace, name, running, "Running")
        wait_until(lambda n=name: (tmp_path / f"{n}.started").exists(), what=f"{name} started")
        pids[name] = pid_of(pod, "main")
    took = {}
    for name in ("graceful", "stubborn"):
        start = time.monotonic()
        api.delete(pod_path(namespace, name))
        wait_until(lambda n=name: get_pod(api, namespace, n) is None, timeout=40, what=f"{name} deleted")
        took[name] = time.monotonic() - start
        assert not alive(pids[name])
        assert (tmp_path / f"{name}.sigterm").exists()
    # the preStop hook ran (inside the container's mounts) before SIGTERM
    assert float((tmp_path / "graceful.prestop").read_text()) < float((tmp_path / "graceful.sigterm").read_text())
    assert took["graceful"] < 10, took  # exited on SIGTERM, well within its 30 s grace
    assert took["stubborn"] >= 2, took  # ignored SIGTERM: killed when its 2 s grace ran out


# --- volumes refresh, downward API, env, mounts are per pod ----------------------------------------------
def test_volumes_env_and_refresh(api: KubeClient, namespace: str, process_runtime: Any) -> None:
    api.post(f"/api/v1/namespaces/{namespace}/configmaps", {"metadata": {"name": "cfg"}, "data": {"v": "one"}})
    api.post(f"/api/v1/namespaces/{namespace}/secrets", {"metadata": {"name": "sec"}, "stringData": {"k": "s3cret"}})
    reader = py("""
        import json, os, time
        last = None
        while True:
            state = {
                "cfg": open("/etc/cfg/v").read(),
                "sec": open("/etc/sec/k").read(),
                "ann": open("/etc/info/annotations").read(),
                "env": {k: os.environ[k] for k in ("FROM_SECRET", "CM_v", "NODE", "SA", "KUBERNETES_SERVICE_HOST")},
                "shm": os.path.ismount("/dev/shm") or os.path.exists("/dev/shm"),
            }
            if state != last:
                print(json.dumps(state), flush=True)
                last = state
            time.sleep(0.2)
    """)
    create_pod(api, namespace, pod_manifest("vols", [{
        "name": "main", "image": "x", "command": reader,
        "env": [
            {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "k"}}},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "SA", "valueFrom": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}},
        ],
        "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CM_"}],
        "volumeMounts": [
            {"name": "cfg", "mountPath": "/etc/cfg"}, {"name": "sec", "mountPath": "/etc/sec", "readOnly": True},
            {"name": "info", "mountPath": "/etc/info"},
        ],
    }], volumes=[
        {"name": "cfg", "configMap": {"name": "cfg"}},
        {"name": "sec", "secret": {"secretName": "sec"}},
        {"name": "info", "downwardAPI": {"items": [{"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}}]}},
    ]))
    pod = wait_pod(api, namespace, "vols", running, "Running")
    log_path = process_runtime.log_path(namespace, "vols", "main")

    def last_state() -> JSON | None:
        lines = log_path.read_text().splitlines(keepends=True) if log_path.exists() else []
        complete = [line for line in lines if line.endswith("\n")]
        return json.loads(complete[-1]) if complete else None

    first = wait_until(last_state, what="first state line")
    assert first["cfg"] == "one" and first["sec"] == "s3cret" and first["ann"] == ""
    assert first["env"]["FROM_SECRET"] == "s3cret" and first["env"]["CM_v"] == "one"
    assert first["env"]["NODE"] == pod["spec"]["nodeName"] and first["env"]["SA"] == "default"
    assert first["env"]["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
    api.patch(f"/api/v1/namespaces/{namespace}/configmaps/cfg", {"data": {"v": "two"}})
    api.patch(pod_path(namespace, "vols"), {"metadata": {"annotations": {"weightsync.io/target-version": "3"}}})
    wait_until(
        lambda: (s := last_state()) and s["cfg"] == "two" and s["ann"] == 'weightsync.io/target-version="3"',
        timeout=15, what="the configMap and downwardAPI files to be refreshed",
    )


# --- init containers in order, restart policy with backoff, liveness restarts -----------------------------
def test_init_containers_run_in_order_before_app(api: KubeClient, namespace: str, process_runtime: Any) -> None:
    step = {"name": "work", "mountPath": "/work"}

    def init(name: str) -> JSON:
        code = f"import time; open('/work/order', 'a').write('{name} '); time.sleep(0.3)"
        return {"name": name, "image": "x", "command": py(code), "volumeMounts": [step]}

    create_pod(api, namespace, pod_manifest(
        "inits",
        [{"name": "main", "image": "x", "volumeMounts": [step],
          "command": py("print(open('/work/order').read() + 'main', flush=True); import time; time.sleep(3600)")}],
        initContainers=[init("first"), init("second")], volumes=[{"name": "work", "emptyDir": {}}],
    ))
    pod = wait_pod(api, namespace, "inits", running, "Running")
    assert condition(pod, "Initialized") == "True"
    states = [c["state"]["terminated"] for c in pod["status"]["initContainerStatuses"]]
    assert [s["exitCode"] for s in states] == [0, 0] and all(s["reason"] == "Completed" for s in states)
    log_path = process_runtime.log_path(namespace, "inits", "main")
    line = wait_until(lambda: log_path.exists() and log_path.read_text().endswith("\n") and log_path.read_text(),
                      what="main's output")
    assert line.strip() == "first second main"


def test_restart_policy_backoff_and_liveness(api: KubeClient, namespace: str) -> None:
    create_pod(api, namespace, pod_manifest("crashy", [
        {"name": "main", "image": "x", "command": py("import sys; sys.exit(3)")}]))
    create_pod(api, namespace, pod_manifest("once", [
        {"name": "main", "image": "x", "command": py("import sys; sys.exit(3)")}], restartPolicy="Never"))
    create_pod(api, namespace, pod_manifest("unhealthy", [
        {"name": "main", "image": "x", "command": py("import time; time.sleep(3600)"),
         "livenessProbe": {"exec": {"command": ["false"]}, "periodSeconds": 1, "failureThreshold": 2}}],
        terminationGracePeriodSeconds=1))

    def restarted(times: int) -> Any:
        return lambda p: any(c["restartCount"] >= times for c in (p.get("status") or {}).get("containerStatuses", []))

    pod = wait_pod(api, namespace, "crashy", restarted(2), "restarted twice", timeout=60)
    status = pod["status"]["containerStatuses"][0]
    assert status["lastState"]["terminated"]["exitCode"] == 3
    assert pod["status"]["phase"] == "Running"  # restartPolicy Always: a crashing pod stays Running
    wait_pod(api, namespace, "crashy",
             lambda p: p["status"]["containerStatuses"][0]["state"].get("waiting", {}).get("reason") == "CrashLoopBackOff",
             "CrashLoopBackOff", timeout=30)
    once = wait_pod(api, namespace, "once", finished, "finished")
    assert once["status"]["phase"] == "Failed"
    assert once["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3
    assert once["status"]["containerStatuses"][0]["restartCount"] == 0
    wait_pod(api, namespace, "unhealthy", restarted(1), "restarted by its liveness probe", timeout=60)
    assert wait_until(lambda: events_of(api, namespace, "unhealthy", "Unhealthy"), what="an Unhealthy event")
    assert wait_until(lambda: events_of(api, namespace, "crashy", "BackOff"), what="a BackOff event")


# --- the runtime as a process (what `make dev-up` runs): stop leaves no process and no bound port ------------
def test_cli_runtime_stop_leaves_no_processes(cluster: Any, namespace: str, tmp_path: Path) -> None:
    import secrets
    import signal
    import socket
    import subprocess

    api = KubeClient(endpoint_from_kubeconfig(str(cluster.kubeconfig)))
    node = f"h2-cli-node-{secrets.token_hex(3)}"
    api.post("/api/v1/nodes", {"metadata": {"name": node, "labels": {LABEL_PROCESS_NODE: "true"}}})
    cli = None
    try:
        with open(tmp_path / "runtime.log", "w") as runtime_log:
            cli = subprocess.Popen(
                [sys.executable, "-m", "weightsync.e2e.runtime", "--kubeconfig", str(cluster.kubeconfig),
                 "--nodes", node, "--state-dir", str(tmp_path)],
                stdout=subprocess.PIPE, stderr=runtime_log, text=True,
            )
        assert cli.stdout is not None
        ready = cli.stdout.readline()
        assert "process runtime ready" in ready, ready
        serve = py("""
            import http.server, os, subprocess
            child = subprocess.Popen(["sleep", "3600"])
            shm = os.statvfs("/dev/shm")
            print("CHILD", child.pid, "SHM", shm.f_blocks * shm.f_frsize, flush=True)
            http.server.HTTPServer((os.environ["POD_IP"], 8080), http.server.SimpleHTTPRequestHandler).serve_forever()
        """)
        env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        create_pod(api, namespace, {
            "metadata": {"name": "served"},
            "spec": {
                "nodeName": node,
                "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Mi"}}],
                "containers": [{"name": "main", "image": "x", "command": serve, "env": env,
                                "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
                                "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}}],
            },
        })
        pod = wait_pod(api, namespace, "served", lambda p: condition(p, "Ready") == "True", "Ready")
        ip, pid = pod["status"]["podIP"], pid_of(pod, "main")
        logs = list(tmp_path.glob(f"pods/{namespace}_served_*/main.log"))
        assert len(logs) == 1
        fields = wait_until(lambda: "\n" in logs[0].read_text() and logs[0].read_text(), what="CHILD line").split()
        child = int(fields[1])
        assert int(fields[3]) == 32 * 1024 * 1024  # the memory emptyDir is a tmpfs of its sizeLimit
        assert alive(pid) and alive(child)
        assert str(tmp_path) in Path("/proc/mounts").read_text()

        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=30) == 0
        assert not alive(pid) and not alive(child)
        assert str(tmp_path) not in Path("/proc/mounts").read_text()  # no tmpfs left mounted
        with pytest.raises(OSError), socket.create_connection((ip, 8080), timeout=1):
            pass
    finally:
        if cli is not None and cli.poll() is None:
            cli.kill()
        for path, body in ((pod_path(namespace, "served"), {"gracePeriodSeconds": 0}), (f"/api/v1/nodes/{node}", None)):
            try:
                api.delete(path, body)
            except ApiError as exc:
                if exc.status != 404:
                    raise


# --- a script from a ConfigMap as the command; a projected token with its own audience, bound to the pod ----
def test_configmap_script_and_audience_bound_token(api: KubeClient, namespace: str, process_runtime: Any) -> None:
    script = textwrap.dedent("""\
        #!/bin/sh
        exec python3 - <<'PY'
        import base64, json
        token = open("/var/run/tokens/agent").read()
        body = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        print(json.dumps({"aud": claims["aud"], "pod": claims["kubernetes.io"]["pod"]["name"],
                          "sa": claims["kubernetes.io"]["serviceaccount"]["name"],
                          "ttl": claims["exp"] - claims["iat"]}), flush=True)
        PY
    """)
    api.post(f"/api/v1/namespaces/{namespace}/configmaps", {"metadata": {"name": "scripts"}, "data": {"run.sh": script}})
    create_pod(api, namespace, pod_manifest(
        "scripted",
        [{"name": "main", "image": "x", "command": ["/opt/scripts/run.sh"],
          "volumeMounts": [{"name": "scripts", "mountPath": "/opt/scripts"}, {"name": "tokens", "mountPath": "/var/run/tokens"}]}],
        restartPolicy="Never",
        volumes=[
            {"name": "scripts", "configMap": {"name": "scripts", "defaultMode": 0o755}},
            {"name": "tokens", "projected": {"sources": [
                {"serviceAccountToken": {"audience": "weightsync-agent", "expirationSeconds": 600, "path": "agent"}}]}},
        ],
    ))
    pod = wait_pod(api, namespace, "scripted", finished, "finished")
    assert pod["status"]["phase"] == "Succeeded", pod["status"]
    claims = json.loads(process_runtime.log_path(namespace, "scripted", "main").read_text())
    assert claims == {"aud": ["weightsync-agent"], "pod": "scripted", "sa": "default", "ttl": 600}


# --- Services: a ClusterIP Service through the runtime's proxy, spread over Ready endpoints only ------------
ECHO_SERVER = """
    import http.server, os
    name, ready = os.environ["POD_NAME"], [True]
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/fail":
                ready[0] = False
            body = name.encode()
            self.send_response(503 if self.path == "/ready" and not ready[0] else 200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    http.server.ThreadingHTTPServer((os.environ["POD_IP"], 18080), Handler).serve_forever()
"""
ECHO_CLIENT = """
    import json, os, sys, urllib.request
    seen = [urllib.request.urlopen(sys.argv[1], timeout=5).read().decode() for _ in range(30)]
    print(json.dumps({"url": sys.argv[1], "seen": seen, "port": os.environ.get("ECHO_SERVICE_PORT")}), flush=True)
"""


def _service_get(address: str) -> str | None:
    """One request on a new connection; None when the proxy resets it (no ready endpoint)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{address}/", timeout=5) as resp:
            return str(resp.read().decode())
    except (urllib.error.URLError, ConnectionError):
        return None


def _ready(api: KubeClient, namespace: str, names: tuple[str, ...]) -> dict[str, bool]:
    pods = {name: get_pod(api, namespace, name) for name in names}
    return {name: pod is not None and condition(pod, "Ready") == "True" for name, pod in pods.items()}


def test_cluster_ip_service_reaches_ready_endpoints_only(api: KubeClient, namespace: str, process_runtime: Any) -> None:
    started = time.monotonic()
    api.post(f"/api/v1/namespaces/{namespace}/services", {
        "metadata": {"name": "echo"},
        "spec": {"selector": {"app": "echo"},
                 "ports": [{"name": "http", "port": 8080, "targetPort": "web", "protocol": "TCP"}]},
    })
    address = wait_until(lambda: process_runtime.services.address(namespace, "echo"), timeout=10,
                         what="the proxy's address for the Service")
    assert address.startswith("127.") and address != "127.0.0.1"
    env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    for name in ("echo-a", "echo-b"):
        manifest = pod_manifest(name, [{
            "name": "web", "image": "x", "command": py(ECHO_SERVER), "env": env,
            "ports": [{"name": "web", "containerPort": 18080}],
            "readinessProbe": {"httpGet": {"path": "/ready", "port": "web"}, "periodSeconds": 1, "failureThreshold": 1},
        }])
        manifest["metadata"]["labels"] = {"app": "echo"}
        create_pod(api, namespace, manifest)
    create_pod(api, namespace, pod_manifest(
        "no-links",
        [{"name": "main", "image": "x",
          "command": py("import os; print(sorted(k for k in os.environ if k.endswith('_SERVICE_HOST')))")}],
        restartPolicy="Never", enableServiceLinks=False,
    ))
    pods = {name: wait_pod(api, namespace, name, lambda p: condition(p, "Ready") == "True", "Ready")
            for name in ("echo-a", "echo-b")}
    # the client pod reaches the Service through its service links, $(VAR)-expanded in args; its own env wins
    create_pod(api, namespace, pod_manifest(
        "client",
        [{"name": "main", "image": "x", "command": py(ECHO_CLIENT),
          "args": ["http://$(ECHO_SERVICE_HOST):$(ECHO_SERVICE_PORT_HTTP)/"],
          "env": [{"name": "ECHO_SERVICE_PORT", "value": "pod-wins"}]}],
        restartPolicy="Never",
    ))
    client = wait_pod(api, namespace, "client", finished, "finished", timeout=30)
    assert client["status"]["phase"] == "Succeeded", process_runtime.log_path(namespace, "client", "main").read_text()
    lines = process_runtime.log_path(namespace, "client", "main").read_text().splitlines()
    result = json.loads(lines[-1])
    port = process_runtime.services.port(namespace, "echo", 8080)
    assert result["url"] == f"http://{address}:{port}/"
    assert result["port"] == "pod-wins"
    assert set(result["seen"]) == {"echo-a", "echo-b"}, result["seen"]
    wait_pod(api, namespace, "no-links", finished, "finished")
    assert process_runtime.log_path(namespace, "no-links", "main").read_text().strip() == "['KUBERNETES_SERVICE_HOST']"

    # the test itself through the same address: 30 requests reach both
    target = f"{address}:{port}"
    assert set(_service_get(target) for _ in range(30)) == {"echo-a", "echo-b"}

    # echo-a turns not Ready (its readiness probe fails): from then on new connections all go to echo-b
    import urllib.request

    urllib.request.urlopen(f"http://{pods['echo-a']['status']['podIP']}:18080/fail", timeout=5).read()
    flipped = time.monotonic()
    wait_until(lambda: _ready(api, namespace, ("echo-a", "echo-b")) == {"echo-a": False, "echo-b": True}, timeout=15,
               interval=0.1, what="echo-a not Ready")
    not_ready_s = time.monotonic() - flipped
    wait_until(lambda: all(_service_get(target) == "echo-b" for _ in range(20)), timeout=15, interval=0.05,
               what="the proxy sending new connections to echo-b only")
    switch_s = time.monotonic() - flipped
    assert [_service_get(target) for _ in range(30)] == ["echo-b"] * 30

    # no ready endpoint left: the proxy resets new connections at once
    urllib.request.urlopen(f"http://{pods['echo-b']['status']['podIP']}:18080/fail", timeout=5).read()
    wait_until(lambda: not any(_ready(api, namespace, ("echo-a", "echo-b")).values()), timeout=15,
               interval=0.1, what="no pod Ready")
    wait_until(lambda: _service_get(target) is None, timeout=15, interval=0.05, what="connections reset")
    t0 = time.monotonic()
    assert _service_get(target) is None and time.monotonic() - t0 < 1.0
    print(f"service test: echo-a not Ready after {not_ready_s:.2f} s, proxy switched after {switch_s:.2f} s, "
          f"total {time.monotonic() - started:.1f} s")
