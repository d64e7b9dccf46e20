"""Unit tests of the process runtime's pure parts (no cluster, no processes)."""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import pytest

from weightsync.e2e.runtime.atomic_writer import read_current, write_atomic
from weightsync.e2e.runtime.containers import Backoff
from weightsync.e2e.runtime.envvars import EnvError, container_env, expand, field_ref_value
from weightsync.e2e.runtime.ips import HostLeases, PodIPAllocator, PodIPExhausted
from weightsync.e2e.runtime.launch import Mount, find_executable, mount_script, sort_mounts, to_host_path
from weightsync.e2e.runtime.probes import ProbeResult, ProbeState, resolve_port
from weightsync.e2e.runtime.status import (
    KIND_APP,
    KIND_INIT,
    KIND_SIDECAR,
    ContainerView,
    comparable,
    pod_phase,
    status_patch,
)
from weightsync.e2e.runtime.volumes import (
    FileEntry,
    VolumeError,
    configmap_payload,
    downward_payload,
    projected_payload,
    secret_payload,
)

POD = {
    "metadata": {
        "name": "p", "namespace": "ns", "uid": "u-1",
        "labels": {"app": "x"}, "annotations": {"weightsync.io/target-version": "7"},
    },
    "spec": {"nodeName": "proc-0", "serviceAccountName": "sa", "containers": [{"name": "main"}]},
}


def _lookup(objects: dict[tuple[str, str, str], dict]):
    return lambda kind, ns, name: objects.get((kind, ns, name))


# --- IPs ----------------------------------------------------------------------------------------------
def test_ip_allocator_unique_idempotent_and_never_localhost() -> None:
    alloc = PodIPAllocator("127.0.0.0/24")
    ips = {alloc.allocate(f"u{i}") for i in range(200)}
    assert len(ips) == 200
    assert "127.0.0.1" not in ips and "127.0.0.0" not in ips and "127.0.0.255" not in ips
    assert alloc.allocate("u5") == alloc.get("u5")
    ip = alloc.get("u5")
    alloc.release("u5")
    assert alloc.reserve("other", ip)
    assert not alloc.reserve("again", ip)


def test_host_leases_keep_runtimes_on_one_machine_apart(tmp_path: Path) -> None:
    import subprocess
    import sys

    first = PodIPAllocator("127.0.0.0/29", HostLeases(tmp_path))
    second = PodIPAllocator("127.0.0.0/29", HostLeases(tmp_path))  # another runtime, same process
    a = {first.allocate(f"a{i}") for i in range(3)}
    b = {second.allocate(f"b{i}") for i in range(3)}
    assert len(a) == 3 and len(b) == 3 and not a & b
    with pytest.raises(PodIPExhausted):
        second.allocate("b-too-many")  # 127.0.0.2-7: six usable addresses, all leased
    freed = first.get("a0")
    first.release("a0")
    assert second.allocate("b-again") == freed  # the only address left, once its lease is released
    # a lease whose owner process died is taken over
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "127.9.0.1").write_text(f"{int(dead.stdout)}:dead\n")
    third = PodIPAllocator("127.9.0.0/30", HostLeases(tmp_path))
    assert third.allocate("c") == "127.9.0.1"
    third.release_all()
    assert not (tmp_path / "127.9.0.1").exists()


def test_ip_allocator_exhaustion_and_bad_cidr() -> None:
    alloc = PodIPAllocator("127.9.9.0/30")  # .1 .2 usable (.0 excluded, .3 fine): 3 addresses
    got = [alloc.allocate(f"u{i}") for i in range(3)]
    assert len(set(got)) == 3
    with pytest.raises(PodIPExhausted):
        alloc.allocate("one-too-many")
    with pytest.raises(ValueError, match="loopback"):
        PodIPAllocator("10.0.0.0/24")


# --- env ----------------------------------------------------------------------------------------------
def test_field_refs() -> None:
    assert field_ref_value(POD, "metadata.name", "127.100.0.5", "127.0.0.1") == "p"
    assert field_ref_value(POD, "metadata.uid", "", "") == "u-1"
    assert field_ref_value(POD, "metadata.labels['app']", "", "") == "x"
    assert field_ref_value(POD, "metadata.annotations['weightsync.io/target-version']", "", "") == "7"
    assert field_ref_value(POD, "spec.nodeName", "", "") == "proc-0"
    assert field_ref_value(POD, "spec.serviceAccountName", "", "") == "sa"
    assert field_ref_value(POD, "status.podIP", "127.100.0.5", "") == "127.100.0.5"
    assert field_ref_value(POD, "status.hostIP", "", "127.0.0.9") == "127.0.0.9"
    with pytest.raises(EnvError):
        field_ref_value(POD, "spec.bogus", "", "")


def test_expand() -> None:
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)-$(C)-$$(A)", env) == "1-two-$(C)-$(A)"


def test_container_env_order_refs_and_errors() -> None:
    objects = {
        ("secrets", "ns", "s"): {"data": {"k": base64.b64encode(b"secret!").decode()}},
        ("configmaps", "ns", "c"): {"data": {"X": "from-cm", "Y": "y"}},
    }
    container = {
        "name": "main",
        "envFrom": [{"configMapRef": {"name": "c"}, "prefix": "CM_"}],
        "env": [
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "S", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
            {"name": "C", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "X"}}},
            {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "missing", "key": "k", "optional": True}}},
            {"name": "DERIVED", "value": "$(POD)@$(IP)"},
            {"name": "CM_Y", "value": "override"},
        ],
    }
    env = container_env(POD, container, "127.100.0.5", "127.0.0.1", _lookup(objects), {"BASE": "b"})
    assert env["BASE"] == "b" and env["POD"] == "p" and env["IP"] == "127.100.0.5"
    assert env["S"] == "secret!" and env["C"] == "from-cm" and env["CM_X"] == "from-cm"
    assert env["DERIVED"] == "p@127.100.0.5" and env["CM_Y"] == "override" and "OPT" not in env
    bad = {"name": "m", "env": [{"name": "S", "valueFrom": {"secretKeyRef": {"name": "s", "key": "nope"}}}]}
    with pytest.raises(EnvError) as info:
        container_env(POD, bad, "", "", _lookup(objects))
    assert info.value.reason == "CreateContainerConfigError" and "nope" in info.value.message


# --- volume payloads ------------------------------------------------------------------------------------
def test_configmap_secret_downward_projected_payloads() -> None:
    objects = {
        ("configmaps", "ns", "c"): {"data": {"a": "A", "b": "B"}, "binaryData": {"bin": base64.b64encode(b"\0\1").decode()}},
        ("secrets", "ns", "s"): {"data": {"t": base64.b64encode(b"T").decode()}},
    }
    lookup = _lookup(objects)
    assert configmap_payload({"name": "c"}, "ns", lookup) == {
        "a": FileEntry(b"A"), "b": FileEntry(b"B"), "bin": FileEntry(b"\0\1"),
    }
    items = {"name": "c", "items": [{"key": "a", "path": "sub/file", "mode": 0o600}], "defaultMode": 0o640}
    assert configmap_payload(items, "ns", lookup) == {"sub/file": FileEntry(b"A", 0o600)}
    assert secret_payload({"secretName": "s"}, "ns", lookup) == {"t": FileEntry(b"T")}
    with pytest.raises(VolumeError, match="not found"):
        secret_payload({"secretName": "gone"}, "ns", lookup)
    assert secret_payload({"secretName": "gone", "optional": True}, "ns", lookup) == {}
    with pytest.raises(VolumeError, match="invalid volume item path"):
        configmap_payload({"name": "c", "items": [{"key": "a", "path": "../escape"}]}, "ns", lookup)
    down = downward_payload(
        {"items": [
            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
            {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}},
            {"path": "target", "fieldRef": {"fieldPath": "metadata.annotations['weightsync.io/target-version']"}},
        ]},
        POD, "127.100.0.2", "127.0.0.1",
    )
    assert down["labels"].data == b'app="x"'
    assert down["annotations"].data == b'weightsync.io/target-version="7"'
    assert down["target"].data == b"7"
    calls = []

    def token(audience, expiration):
        calls.append((audience, expiration))
        return "tok"

    proj = projected_payload(
        {"sources": [
            {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
            {"configMap": {"name": "c", "items": [{"key": "a", "path": "ca.crt"}]}},
            {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
        ]},
        POD, "127.100.0.2", "127.0.0.1", lookup, token,
    )
    assert {k: v.data for k, v in proj.items()} == {"token": b"tok", "ca.crt": b"A", "namespace": b"ns"}
    assert calls == [(None, 3607)]


def test_atomic_writer_publishes_swaps_and_prunes(tmp_path: Path) -> None:
    target = tmp_path / "vol"
    assert write_atomic(target, {"a": FileEntry(b"1"), "d/b": FileEntry(b"2", 0o600)})
    assert (target / "a").read_bytes() == b"1" and (target / "d" / "b").read_bytes() == b"2"
    assert os.readlink(target / "a") == "..data/a" and (target / "..data").is_symlink()
    assert ((target / "d" / "b").stat().st_mode & 0o777) == 0o600
    first = os.readlink(target / "..data")
    assert not write_atomic(target, {"a": FileEntry(b"1"), "d/b": FileEntry(b"2", 0o600)})  # unchanged
    assert write_atomic(target, {"a": FileEntry(b"new")})
    assert (target / "a").read_bytes() == b"new"
    assert not (target / "d").exists() and not (target / first).exists()
    assert read_current(target) == {"a": FileEntry(b"new", 0o644)}


# --- launch ---------------------------------------------------------------------------------------------
def test_mount_order_script_and_host_paths(tmp_path: Path) -> None:
    mounts = [Mount("/h/child", "/etc/a/b"), Mount("/h/parent", "/etc/a", read_only=True)]
    assert [m.container_path for m in sort_mounts(mounts)] == ["/etc/a", "/etc/a/b"]
    script = mount_script(mounts, "/w d")
    # Sources are opened before any mount (a mount may hide a later source's host path), parents first.
    assert script.index("exec {WS_FD1}</h/child") < script.index("mount --bind")
    assert script.index("$WS_FD0 /etc/a  # /h/parent") < script.index("$WS_FD1 /etc/a/b  # /h/child")
    assert "mount -o remount,bind,ro /etc/a" in script and "cd '/w d'" in script
    assert to_host_path("/etc/a/b/x", mounts) == "/h/child/x"
    assert to_host_path("/etc/a/y", mounts) == "/h/parent/y"
    assert to_host_path("/usr/bin/env", mounts) == "/usr/bin/env"
    script_dir = tmp_path / "scripts"
    script_dir.mkdir()
    (script_dir / "run.sh").write_text("#!/bin/sh\n")
    (script_dir / "run.sh").chmod(0o755)
    vol = [Mount(str(script_dir), "/opt/scripts")]
    assert find_executable("/opt/scripts/run.sh", {}, "/", vol) == "/opt/scripts/run.sh"
    assert find_executable("run.sh", {"PATH": "/nowhere:/opt/scripts"}, "/", vol) == "/opt/scripts/run.sh"
    assert find_executable("definitely-not-a-binary-xyz", {"PATH": "/usr/bin"}, "/", []) is None
    assert find_executable("sh", {"PATH": "/usr/bin:/bin"}, "/", []) is not None


# --- probes / backoff -----------------------------------------------------------------------------------
def test_probe_thresholds() -> None:
    state = ProbeState({"periodSeconds": 1, "failureThreshold": 2, "successThreshold": 2, "initialDelaySeconds": 5}, 100.0, False)
    assert not state.due(104.0) and state.due(105.0)
    state.record(ProbeResult(True), 105.0)
    assert state.result is False  # one success is not enough
    state.record(ProbeResult(True), 106.0)
    assert state.result is True and state.next_due == 107.0
    state.record(ProbeResult(False, "boom"), 107.0)
    assert state.result is True
    state.record(ProbeResult(False, "boom"), 108.0)
    assert state.result is False and state.last_message == "boom"
    assert resolve_port("http", [{"name": "http", "containerPort": 8080}]) == 8080
    assert resolve_port(9000, []) == 9000
    with pytest.raises(ValueError):
        resolve_port("nope", [])


def test_backoff() -> None:
    b = Backoff(base_s=1.0, max_s=4.0, reset_after_s=60.0)
    assert [b.next_delay(1.0) for _ in range(5)] == [0.0, 1.0, 2.0, 4.0, 4.0]
    assert b.next_delay(120.0) == 0.0


# --- status ---------------------------------------------------------------------------------------------
def _view(name: str, kind: str, state: dict, ready: bool = False, last: dict | None = None) -> ContainerView:
    return ContainerView(name, kind, "img", state, last or {}, 0, ready, "running" in state)


RUNNING = {"running": {"startedAt": "t"}}


def test_pod_phase() -> None:
    ok = {"terminated": {"exitCode": 0}}
    bad = {"terminated": {"exitCode": 1}}
    waiting = {"waiting": {"reason": "ContainerCreating"}}
    assert pod_phase("Always", False, False, []) == "Pending"
    assert pod_phase("Never", True, True, []) == "Failed"
    assert pod_phase("Always", True, False, [_view("a", KIND_APP, RUNNING)]) == "Running"
    assert pod_phase("Always", True, False, [_view("a", KIND_APP, waiting)]) == "Pending"
    assert pod_phase("Never", True, False, [_view("a", KIND_APP, ok)]) == "Succeeded"
    assert pod_phase("Never", True, False, [_view("a", KIND_APP, bad)]) == "Failed"
    assert pod_phase("OnFailure", True, False, [_view("a", KIND_APP, bad)]) == "Running"
    crash = _view("a", KIND_APP, {"waiting": {"reason": "CrashLoopBackOff"}}, last=bad)
    assert pod_phase("Always", True, False, [crash]) == "Running"


def test_status_patch_readiness_gates_and_foreign_conditions() -> None:
    pod: dict[str, Any] = {
        "metadata": POD["metadata"],
        "spec": {"readinessGates": [{"conditionType": "weightsync.io/synced"}], "containers": [{"name": "main"}]},
        "status": {"conditions": [{"type": "weightsync.io/synced", "status": "False"}, {"type": "PodScheduled", "status": "True"}]},
    }
    views = [_view("agent", KIND_SIDECAR, RUNNING, ready=True), _view("main", KIND_APP, RUNNING, ready=True)]
    kwargs: dict[str, Any] = dict(pod_ip="127.100.0.3", host_ip="127.0.0.1", start_time="t0", sandbox_ready=True,
                  initialized=True, init_failed=False, transitions={}, now="t1")
    patch = status_patch(pod, views, **kwargs)
    conds = {c["type"]: c for c in patch["status"]["conditions"]}
    assert set(conds) == {"PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready"}  # never foreign
    assert conds["ContainersReady"]["status"] == "True"
    assert conds["Ready"]["status"] == "False" and conds["Ready"]["reason"] == "ReadinessGatesNotReady"
    assert patch["status"]["phase"] == "Running" and patch["status"]["podIPs"] == [{"ip": "127.100.0.3"}]
    assert [c["name"] for c in patch["status"]["initContainerStatuses"]] == ["agent"]
    pod["status"]["conditions"][0]["status"] = "True"
    transitions = {c["type"]: (c["status"], c["lastTransitionTime"]) for c in patch["status"]["conditions"]}
    patch2 = status_patch(pod, views, **{**kwargs, "transitions": transitions, "now": "t2"})
    conds2 = {c["type"]: c for c in patch2["status"]["conditions"]}
    assert conds2["Ready"]["status"] == "True" and conds2["Ready"]["lastTransitionTime"] == "t2"
    assert conds2["Initialized"]["lastTransitionTime"] == "t1"  # unchanged status keeps its time
    assert comparable(patch) != comparable(patch2)
    unready = [_view("main", KIND_APP, RUNNING, ready=False), _view("i", KIND_INIT, {"terminated": {"exitCode": 0}})]
    conds3 = {c["type"]: c for c in status_patch(pod, unready, **kwargs)["status"]["conditions"]}
    assert conds3["Ready"]["status"] == "False" and "main" in conds3["Ready"]["message"]


def test_unmount_under_selects_only_mounts_below_root(tmp_path: Path) -> None:
    from weightsync.e2e.runtime.pod_volumes import unmount_under

    root = tmp_path / "state"
    mounts = tmp_path / "mounts"
    mounts.write_text(
        f"tmpfs {root}/pods/a/volumes/shm tmpfs rw 0 0\n"
        f"tmpfs {root}/pods/b\\040x/volumes/shm tmpfs rw 0 0\n"
        f"tmpfs {tmp_path}/stateful tmpfs rw 0 0\n"
        "proc /proc proc rw 0 0\n"
    )
    assert sorted(unmount_under(root, mounts)) == [f"{root}/pods/a/volumes/shm", f"{root}/pods/b x/volumes/shm"]


def test_leftover_processes_are_found_by_runtime_id_and_killed() -> None:
    import subprocess
    import sys

    from weightsync.e2e.runtime.orphans import RUNTIME_ID_ENV, kill_marked, marked_pids

    runtime_id = f"test-{os.getpid()}"
    marked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env={**os.environ, RUNTIME_ID_ENV: runtime_id})
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             env={**os.environ, RUNTIME_ID_ENV: runtime_id + "-other"})
    try:
        assert marked_pids(runtime_id) == [marked.pid]
        assert kill_marked(runtime_id) == [marked.pid]
        assert marked.wait(10) == -9
        assert other.poll() is None
    finally:
        for proc in (marked, other):
            proc.kill()
            proc.wait()


def test_event_body_points_at_the_container() -> None:
    from weightsync.e2e.runtime.events import event_body

    body = event_body(POD, "Warning", "Failed", "x" * 2000, "main")
    assert body["involvedObject"] == {
        "apiVersion": "v1", "kind": "Pod", "name": "p", "namespace": "ns", "uid": "u-1", "fieldPath": "spec.containers{main}",
    }
    assert body["source"]["host"] == "proc-0" and len(body["message"]) == 1024 and body["type"] == "Warning"


def test_cli_bad_kubeconfig_gives_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from weightsync.e2e.runtime.__main__ import main

    assert main(["--kubeconfig", str(tmp_path / "missing"), "--nodes", "n", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "make dev-up" in err[0] and "missing" in err[0]


def test_runtime_env_paths_hidden_by_a_volume_are_bound_back() -> None:
    """An emptyDir at /tmp must not hide the checkout and venv the host processes run from."""
    from weightsync.e2e.runtime.launch import keep_visible

    vols = [Mount("/state/pod/tmp", "/tmp"), Mount("/state/pod/sa", "/var/run/secrets/kubernetes.io/serviceaccount")]
    out = keep_visible(vols, ["/tmp/ci/.venv", "/tmp/ci", "/work/other"])
    assert out[:2] == vols and out[2:] == [Mount("/tmp/ci", "/tmp/ci")]  # outermost only, uncovered left alone
    assert [m.container_path for m in sort_mounts(out)] == ["/tmp", "/tmp/ci", "/var/run/secrets/kubernetes.io/serviceaccount"]
    assert keep_visible(vols[1:], ["/tmp/ci"]) == vols[1:]
