"""Start + stop of a LocalCluster leaves no process and no bound port; bad input fails with a clear error.

These tests spawn their own LocalCluster (besides the session one), so they need the binaries."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from weightsync.e2e.binaries import Binaries
from weightsync.e2e.cluster import ClusterError, ComponentExited, LocalCluster
from weightsync.e2e.procs import group_members, listening_ports, pid_alive

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def bins() -> Binaries:
    return Binaries.resolve()


def test_start_then_stop_leaves_no_process_and_no_port(tmp_path: Path, bins: Binaries) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    cluster = LocalCluster(kubeconfig=kubeconfig, binaries=bins)
    with cluster:
        pids = dict(cluster.pids)
        ports = dict(cluster.ports)
        work_dir = cluster.work_dir
        assert set(pids) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"}
        assert all(pid_alive(p) for p in pids.values())
        listening = listening_ports()
        for name in ("etcd-client", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
            assert ports[name] in listening, name
        assert cluster.start_seconds is not None
        assert kubeconfig.is_file() and cluster.server.startswith("https://127.0.0.1:")
        nodes = cluster.kubectl("get", "namespaces", "-o", "name").stdout.split()
        assert "namespace/default" in nodes and "namespace/kube-system" in nodes
        assert "Server Version: v1.34" in cluster.kubectl("version").stdout
    assert not [p for p in pids.values() if pid_alive(p)]
    assert not [p for p in pids.values() if group_members(p)]
    assert not set(ports.values()) & listening_ports()
    assert not work_dir.exists()


def test_busy_apiserver_port_is_a_clear_error(tmp_path: Path, bins: Binaries) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        cluster = LocalCluster(kubeconfig=tmp_path / "kc", binaries=bins, apiserver_port=port)
        with pytest.raises(ClusterError, match=f"port {port} on 127.0.0.1 is already in use"):
            cluster.start()
    assert not cluster.pids


def test_component_exiting_early_shows_its_log_and_stops_the_rest(tmp_path: Path, bins: Binaries) -> None:
    cluster = LocalCluster(kubeconfig=tmp_path / "kc", binaries=bins,
                           extra_apiserver_args=["--no-such-flag=1"])
    with pytest.raises(ComponentExited) as info:
        cluster.start()
    assert info.value.name == "kube-apiserver"
    assert "unknown flag: --no-such-flag" in str(info.value)
    assert not cluster.pids
    assert "etcd" in cluster.stopped_pids
    assert not [p for p in cluster.stopped_pids.values() if pid_alive(p)]
    cluster.stop()
