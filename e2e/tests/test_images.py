"""`make e2e-images`: the chart installed with the images `make image` built, and the demo job run with the
operator, every agent and the demo trainer / engines started from those images (the process runtime's
image mode, WEIGHTSYNC_RUNTIME_IMAGES=buildah): each container's root is an overlay over its image and it
runs as the image's non-root user. The demo reaches its last version, bit for bit.

Not part of `make test` (marker `images`): it needs both images built, 7 GB of them."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import pytest

from weightsync.crds import contract
from weightsync.e2e import chart, demo
from weightsync.e2e.environment import Environment

pytestmark = [pytest.mark.images, pytest.mark.e2e, pytest.mark.cluster]

IMAGE_MARK = "usr/share/weightsync/pip-freeze.txt"  # only our images carry it (Dockerfile)
IMAGE_UID = 65532


def _container_processes(pod: dict[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    st = pod.get("status") or {}
    for cs in (st.get("containerStatuses") or []) + (st.get("initContainerStatuses") or []):
        pid = (cs.get("containerID") or "").removeprefix("process://")
        if pid.isdigit() and "running" in (cs.get("state") or {}):
            out[cs["name"]] = int(pid)
    return out


def _uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid in /proc/{pid}/status")


def _runs_from_image(pid: int) -> bool:
    return Path(f"/proc/{pid}/root/{IMAGE_MARK}").is_file()


def test_chart_and_demo_run_from_the_built_images(cluster: Environment, kube: Any, namespace: str,
                                                  process_runtime: Any) -> None:
    if os.environ.get("WEIGHTSYNC_RUNTIME_IMAGES") != "buildah" or process_runtime is None:
        pytest.fail("run with `make e2e-images` (WEIGHTSYNC_RUNTIME_IMAGES=buildah, images built by `make image`)")
    release_name = f"wsi-{secrets.token_hex(2)}"
    release = chart.install_chart(cluster, namespace, release_name, resync_seconds=2, timeout=300)
    lines: list[str] = []
    try:
        pod = release.operator_pod()
        pid = release.operator_pid()
        assert _runs_from_image(pid), f"the operator pod {pod['metadata']['name']} did not start from its image"
        assert _uid(pid) == IMAGE_UID
        assert not Path(f"/proc/{pid}/root/usr/local/lib/python3.11/dist-packages/torch").exists()

        body = demo.load_example("separated", name_override=f"img-{secrets.token_hex(2)}")
        demo.set_trainer_args(body, versions=3, interval=1.5)
        report = demo.run_demo(cluster, "separated", namespace, 420, lines.append,
                               operator_log=lambda: release.logs(tail=60), body=body)
        assert report.ok and report.version == 3 and len(report.engines) == 2, (report, lines[-20:])

        pods = demo.job_pods(kube.api, namespace, body["metadata"]["name"])
        seen: dict[str, tuple[bool, int]] = {}
        for name, p in pods.items():
            for container, cpid in _container_processes(p).items():
                seen[f"{name}/{container}"] = (_runs_from_image(cpid), _uid(cpid))
        agents = [k for k in seen if k.endswith(f"/{contract.AGENT_CONTAINER}")]
        assert len(agents) == len(pods) >= 3, seen
        assert all(v == (True, IMAGE_UID) for v in seen.values()), seen
    finally:
        release.uninstall()
