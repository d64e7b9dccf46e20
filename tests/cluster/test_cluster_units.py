"""Pure parts of the local control plane: binary lookup, PKI + kubeconfig rendering, node manifests,
namespace names. No cluster needed."""

from __future__ import annotations

import base64
import os
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

from weightsync.crds import contract
from weightsync.e2e import binaries
from weightsync.e2e.binaries import Binaries, BinaryNotFound, cache_root, find_binary, read_versions
from weightsync.e2e.cluster import server_of
from weightsync.e2e.nodes import gpu_fleet, lease_manifest, node_labels, node_manifest
from weightsync.e2e.pki import generate_pki, render_kubeconfig, san_line
from weightsync.e2e.pytest_plugin import namespace_name


def _exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\necho fake\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def versions() -> dict[str, str]:
    return read_versions()


def test_versions_env_pins_every_component(versions: dict[str, str]) -> None:
    for _, key in binaries.COMPONENTS.values():
        assert versions[key].startswith("v"), key
    assert versions["KUBERNETES_VERSION"] >= "v1.34"


def test_cache_root_rules(tmp_path: Path) -> None:
    assert cache_root({"WEIGHTSYNC_CACHE": str(tmp_path)}) == tmp_path
    assert cache_root({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "weightsync"
    assert cache_root({"HOME": str(tmp_path)}) == tmp_path / ".cache" / "weightsync"


def test_lookup_order_explicit_then_assets_then_cache(tmp_path: Path, versions: dict[str, str]) -> None:
    cache = tmp_path / "cache"
    cached = _exe(cache / "bin" / f"kubernetes-{versions['KUBERNETES_VERSION']}" / "kube-apiserver")
    (cached.parent / ".complete").touch()
    assets = _exe(tmp_path / "assets" / "kube-apiserver")
    explicit = _exe(tmp_path / "explicit" / "kube-apiserver")
    env = {"WEIGHTSYNC_CACHE": str(cache)}
    assert find_binary("kube-apiserver", env, versions) == cached
    env["KUBEBUILDER_ASSETS"] = str(assets.parent)
    assert find_binary("kube-apiserver", env, versions) == assets
    env["TEST_ASSET_KUBE_APISERVER"] = str(explicit)
    assert find_binary("kube-apiserver", env, versions) == explicit
    other = _exe(tmp_path / "other" / "kube-apiserver")
    env["WEIGHTSYNC_KUBE_APISERVER"] = str(other)
    assert find_binary("kube-apiserver", env, versions) == other


def test_missing_binary_is_one_line_saying_what_to_run(tmp_path: Path, versions: dict[str, str]) -> None:
    with pytest.raises(BinaryNotFound) as info:
        find_binary("kube-scheduler", {"WEIGHTSYNC_CACHE": str(tmp_path)}, versions)
    message = str(info.value)
    assert "\n" not in message
    assert "make binaries" in message and "build-binaries.sh kubernetes" in message


def test_broken_and_unfinished_cache_and_bad_explicit_path(tmp_path: Path, versions: dict[str, str]) -> None:
    env = {"WEIGHTSYNC_CACHE": str(tmp_path)}
    etcd_dir = tmp_path / "bin" / f"etcd-{versions['ETCD_VERSION']}"
    _exe(etcd_dir / "etcd")  # no .complete marker: an interrupted build
    with pytest.raises(BinaryNotFound, match="broken cache"):
        find_binary("etcd", env, versions)
    _exe(tmp_path / "bin" / f"kwok-{versions['KWOK_VERSION']}.tmp" / "kwok")
    with pytest.raises(BinaryNotFound, match="unfinished"):
        find_binary("kwok", env, versions)
    with pytest.raises(BinaryNotFound, match=r"\$WEIGHTSYNC_ETCD=.*not an executable"):
        find_binary("etcd", {**env, "WEIGHTSYNC_ETCD": str(tmp_path / "nope")}, versions)


def test_binaries_resolve_reports_the_first_missing(tmp_path: Path) -> None:
    with pytest.raises(BinaryNotFound, match=r"^etcd not found"):
        Binaries.resolve({"WEIGHTSYNC_CACHE": str(tmp_path)})


def test_build_script_uses_provided_binaries_without_building(tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    for name in binaries.CONTROL_PLANE:
        _exe(assets / name)
    script = Path(binaries.E2E_DIR) / "scripts" / "build-binaries.sh"
    env = {**os.environ, "WEIGHTSYNC_CACHE": str(tmp_path / "cache"), "KUBEBUILDER_ASSETS": str(assets),
           "PATH": "/usr/bin:/bin"}  # no `go`: anything that tried to build would fail
    proc = subprocess.run(["bash", str(script), "kubernetes", "etcd"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [f"kubernetes={assets}", f"etcd={assets}"]
    bad = subprocess.run(["bash", str(script), "nonsense"], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown component: nonsense" in bad.stderr


def test_pki_and_kubeconfig(tmp_path: Path) -> None:
    pki = generate_pki(tmp_path / "pki")
    for pair in (pki.apiserver, pki.admin, pki.controller_manager, pki.scheduler):
        verify = subprocess.run(["openssl", "verify", "-CAfile", str(pki.ca.cert), str(pair.cert)],
                                capture_output=True, text=True)
        assert verify.returncode == 0, verify.stderr
    text = subprocess.run(["openssl", "x509", "-in", str(pki.apiserver.cert), "-noout", "-text"],
                          capture_output=True, text=True, check=True).stdout
    assert "IP Address:127.0.0.1" in text and "DNS:kubernetes.default.svc" in text
    subject = subprocess.run(["openssl", "x509", "-in", str(pki.admin.cert), "-noout", "-subject"],
                             capture_output=True, text=True, check=True).stdout
    assert "system:masters" in subject

    kubeconfig = tmp_path / "kc"
    kubeconfig.write_text(render_kubeconfig("https://127.0.0.1:6443", pki.ca.cert, pki.admin))
    doc = yaml.safe_load(kubeconfig.read_text())
    assert base64.b64decode(doc["clusters"][0]["cluster"]["certificate-authority-data"]) == pki.ca.cert.read_bytes()
    assert base64.b64decode(doc["users"][0]["user"]["client-key-data"]) == pki.admin.key.read_bytes()
    assert server_of(kubeconfig) == "https://127.0.0.1:6443"


def test_san_line_rejects_bad_ip() -> None:
    assert san_line(["a"], ["127.0.0.1"]) == "DNS:a,IP:127.0.0.1"
    with pytest.raises(ValueError):
        san_line([], ["not-an-ip"])


def test_gpu_fleet_topology_and_labels() -> None:
    fleet = gpu_fleet(6, gpus=4, nodes_per_rack=2, racks_per_zone=2, process=2)
    assert [s.name for s in fleet] == [f"gpu-node-{i}" for i in range(6)]
    assert [s.rack for s in fleet] == ["rack-0", "rack-0", "rack-1", "rack-1", "rack-2", "rack-2"]
    assert [s.zone for s in fleet] == ["zone-a"] * 4 + ["zone-b"] * 2
    assert [s.process for s in fleet] == [True, True, False, False, False, False]
    labels = node_labels(fleet[0])
    assert labels[contract.LABEL_GPU_COUNT] == "4"
    assert labels[contract.LABEL_NVLINK_DOMAIN] == "nvl-0"
    assert labels[contract.LABEL_HOSTNAME] == "gpu-node-0"
    assert labels[contract.LABEL_PROCESS_NODE] == "true"
    assert contract.LABEL_PROCESS_NODE not in node_labels(fleet[3])


def test_node_manifest_status() -> None:
    now = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)
    node = node_manifest(gpu_fleet(1)[0], now)
    assert node["status"]["allocatable"][contract.RESOURCE_GPU] == "8"
    ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True" and ready["lastHeartbeatTime"] == "2026-01-02T03:04:05Z"
    lease = lease_manifest("n", "uid-1", now, 40)
    assert lease["spec"]["renewTime"] == "2026-01-02T03:04:05.678901Z"
    assert lease["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_namespace_names_are_valid_and_unique() -> None:
    a = namespace_name("test_Something[param-1/x]" * 5)
    b = namespace_name("test_Something[param-1/x]" * 5)
    assert a != b and len(a) <= 63
    assert all(ch.isalnum() or ch == "-" for ch in a) and a == a.lower() and a[0].isalpha() and a[-1].isalnum()
