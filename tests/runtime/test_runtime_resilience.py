"""The process runtime rides out an apiserver restart: its watch relists, status patches resume, running
containers are left alone. Uses its own LocalCluster (the apiserver is killed and started again)."""

from __future__ import annotations

import signal
import socket
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from weightsync.crds.contract import LABEL_PROCESS_NODE
from weightsync.e2e.cluster import LocalCluster
from weightsync.e2e.procs import Proc
from weightsync.e2e.pytest_plugin import wait_until
from weightsync.e2e.runtime import ProcessRuntime
from weightsync.e2e.runtime.kube import ApiError, KubeClient, endpoint_from_kubeconfig, pod_path

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow]
NODE = "resilience-node"
JSON = dict[str, Any]


@pytest.fixture
def private_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    cluster = LocalCluster(kubeconfig=tmp_path / "kubeconfig").start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _pod(name: str) -> JSON:
    code = textwrap.dedent("""
        import time
        print("up", flush=True)
        time.sleep(3600)
    """)
    return {"metadata": {"name": name}, "spec": {
        "nodeName": NODE, "terminationGracePeriodSeconds": 2,
        "containers": [{"name": "main", "image": "x", "command": ["python3", "-c", code]}],
    }}


def _phase(api: KubeClient, name: str) -> str | None:
    try:
        return str(api.get(pod_path("default", name)).get("status", {}).get("phase"))
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


def test_runtime_survives_apiserver_restart(private_cluster: LocalCluster, tmp_path: Path) -> None:
    api = KubeClient(endpoint_from_kubeconfig(str(private_cluster.kubeconfig)))
    api.post("/api/v1/nodes", {"metadata": {"name": NODE, "labels": {LABEL_PROCESS_NODE: "true"}}})
    runtime = ProcessRuntime(str(private_cluster.kubeconfig), [NODE], tmp_path / "state", watch_timeout_s=300)
    threads_before = set(threading.enumerate())
    runtime.start()
    try:
        api.post("/api/v1/namespaces/default/pods", _pod("before"))
        wait_until(lambda: _phase(api, "before") == "Running", timeout=60, what="pod 'before' Running")
        pid = int(api.get(pod_path("default", "before"))["status"]["containerStatuses"][0]["containerID"].split("//")[1])

        old = private_cluster.procs["kube-apiserver"]
        old.signal_group(signal.SIGKILL)
        assert old.wait(10)
        time.sleep(2)  # the runtime's watches and patches fail meanwhile
        private_cluster.procs["kube-apiserver"] = Proc(old.name, old.argv, old.log_path, env=old.env).start()

        def answers() -> bool:
            try:
                api.get("/readyz")
                return True
            except ApiError:
                return False

        wait_until(answers, timeout=90, interval=0.5, what="the restarted apiserver")
        api.post("/api/v1/namespaces/default/pods", _pod("after"))
        wait_until(lambda: _phase(api, "after") == "Running", timeout=60, what="pod 'after' Running (watch recovered)")
        api.post("/api/v1/namespaces/default/services",
                 {"metadata": {"name": "after"}, "spec": {"ports": [{"name": "http", "port": 8080}]}})
        assert runtime.services is not None
        address = wait_until(lambda: runtime.services.address("default", "after"), timeout=30,
                             what="the Service proxy listening for a Service made after the restart")
        port = runtime.services.port("default", "after", 8080)
        assert port is not None
        status = api.get(pod_path("default", "before"))["status"]["containerStatuses"][0]
        assert status["restartCount"] == 0 and status["containerID"] == f"process://{pid}"
        api.delete(pod_path("default", "before"))
        wait_until(lambda: _phase(api, "before") is None, timeout=30, what="pod 'before' deleted by the runtime")
    finally:
        runtime.stop()
    # the Service proxy's watches, listeners and connections are gone with the runtime, its address released
    assert not [t.name for t in threading.enumerate() if t not in threads_before and t.name.startswith("svc-")]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((address, port), timeout=2).close()
