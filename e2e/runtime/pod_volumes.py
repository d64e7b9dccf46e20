"""A pod's volumes on the host: per-pod directories, tmpfs for memory emptyDirs, atomically refreshed
configMap / secret / downwardAPI / projected files, and the mounts each container gets.

Layout: <pod_dir>/volumes/<volume name>/ (hostPath volumes are the host path itself; memory emptyDirs
are a tmpfs when they have a sizeLimit, else a directory under the host's /dev/shm).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path
from typing import Any

from weightsync.e2e.runtime.atomic_writer import write_atomic
from weightsync.e2e.runtime.envvars import Lookup
from weightsync.e2e.runtime.launch import Mount
from weightsync.e2e.runtime.volumes import (
    SA_MOUNT_PATH,
    TokenSource,
    VolumeError,
    configmap_payload,
    downward_payload,
    kube_api_access_volume,
    projected_payload,
    secret_payload,
)

log = logging.getLogger(__name__)
JSON = dict[str, Any]
SHM_PATH = "/dev/shm"
FILE_KINDS = ("configMap", "secret", "downwardAPI", "projected")


def _covered(mounts: list[JSON], path: str) -> bool:
    return any(m.get("mountPath", "").rstrip("/") == path for m in mounts)


def effective_volumes(pod: JSON) -> tuple[list[JSON], bool]:
    """The pod's volumes plus a kube-api-access volume when the ServiceAccount admission did not add one.

    Returns (volumes, synthesized).
    """
    spec = pod.get("spec", {})
    volumes = list(spec.get("volumes") or [])
    if spec.get("automountServiceAccountToken") is False:
        return volumes, False
    containers = (spec.get("containers") or []) + (spec.get("initContainers") or [])
    if all(_covered(c.get("volumeMounts") or [], SA_MOUNT_PATH) for c in containers):
        return volumes, False
    return [*volumes, kube_api_access_volume()], True


class PodVolumes:
    def __init__(self, pod_dir: Path, shm_dir: Path, claims_dir: Path) -> None:
        self.root = pod_dir / "volumes"
        self.shm_dir = shm_dir
        self.claims_dir = claims_dir
        self._tmpfs: list[Path] = []
        self._prepared: set[str] = set()

    def host_dir(self, volume: JSON, namespace: str) -> Path:
        name = volume["name"]
        if "hostPath" in volume:
            return Path(volume["hostPath"]["path"])
        if "persistentVolumeClaim" in volume:
            return self.claims_dir / namespace / volume["persistentVolumeClaim"]["claimName"]
        if "emptyDir" in volume and (volume["emptyDir"] or {}).get("medium") == "Memory":
            if (volume["emptyDir"] or {}).get("sizeLimit"):
                return self.root / name
            return self.shm_dir / name
        return self.root / name

    def _prepare_dir(self, volume: JSON, namespace: str) -> None:
        name = volume["name"]
        if name in self._prepared:
            return
        path = self.host_dir(volume, namespace)
        if "hostPath" in volume:
            kind = volume["hostPath"].get("type", "")
            if kind in ("DirectoryOrCreate", ""):
                path.mkdir(parents=True, exist_ok=True)
            elif kind == "FileOrCreate":
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch(exist_ok=True)
            elif not path.exists():
                raise VolumeError(f"hostPath {path} of volume {name} does not exist (type {kind})")
        elif "emptyDir" in volume or "persistentVolumeClaim" in volume:
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o777)
            size = (volume.get("emptyDir") or {}).get("sizeLimit")
            if (volume.get("emptyDir") or {}).get("medium") == "Memory" and size:
                self._mount_tmpfs(path, str(size))
        elif not any(k in volume for k in FILE_KINDS):
            kinds = sorted(k for k in volume if k != "name")
            raise VolumeError(
                f"volume {name}: type {kinds} is not supported by the process runtime "
                "(use emptyDir, hostPath, persistentVolumeClaim, configMap, secret, downwardAPI, projected)"
            )
        self._prepared.add(name)

    def _mount_tmpfs(self, path: Path, size: str) -> None:
        from kubernetes.utils import parse_quantity

        size_bytes = int(parse_quantity(size))
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=1777", "tmpfs", str(path)],
            capture_output=True, text=True, check=False,
        )
        if done.returncode == 0:
            self._tmpfs.append(path)
        else:  # still a working (unlimited) directory: sizeLimit is best effort
            log.warning("tmpfs mount failed path=%s error=%s", path, done.stderr.strip())

    def sync(
        self, pod: JSON, pod_ip: str, host_ip: str, lookup: Lookup, token: TokenSource
    ) -> None:
        """Create every volume and (re)write the file-backed ones; raise VolumeError for the first failure."""
        namespace = pod.get("metadata", {}).get("namespace", "default")
        volumes, _ = effective_volumes(pod)
        errors = []
        for volume in volumes:
            try:
                self._prepare_dir(volume, namespace)
                if "configMap" in volume:
                    payload = configmap_payload(volume["configMap"], namespace, lookup)
                elif "secret" in volume:
                    payload = secret_payload(volume["secret"], namespace, lookup)
                elif "downwardAPI" in volume:
                    payload = downward_payload(volume["downwardAPI"], pod, pod_ip, host_ip)
                elif "projected" in volume:
                    payload = projected_payload(volume["projected"], pod, pod_ip, host_ip, lookup, token)
                else:
                    continue
                fs_group = ((pod.get("spec") or {}).get("securityContext") or {}).get("fsGroup")
                if write_atomic(self.host_dir(volume, namespace), payload,
                                int(fs_group) if fs_group is not None else None):
                    log.debug("volume updated pod=%s volume=%s", pod["metadata"].get("name"), volume["name"])
            except VolumeError as exc:
                errors.append(f"volume {volume['name']}: {exc}")
            except Exception as exc:  # an apiserver error while fetching a source
                errors.append(f"volume {volume['name']}: {type(exc).__name__}: {exc}")
        if errors:
            raise VolumeError("MountVolume.SetUp failed: " + "; ".join(errors))

    def mounts_for(self, pod: JSON, container: JSON) -> list[Mount]:
        """The container's volumeMounts as host->container binds, plus its SA token and a per-pod /dev/shm."""
        namespace = pod.get("metadata", {}).get("namespace", "default")
        volumes, synthesized = effective_volumes(pod)
        by_name = {v["name"]: v for v in volumes}
        specs = list(container.get("volumeMounts") or [])
        if synthesized and not _covered(specs, SA_MOUNT_PATH):
            specs.append({"name": volumes[-1]["name"], "mountPath": SA_MOUNT_PATH, "readOnly": True})
        mounts = []
        for spec in specs:
            volume = by_name.get(spec["name"])
            if volume is None:
                raise VolumeError(f"volumeMount {spec['name']} of container {container['name']} has no volume")
            host = self.host_dir(volume, namespace)
            sub = spec.get("subPath") or ""
            if sub:
                host = (host / sub).resolve() if any(k in volume for k in FILE_KINDS) else host / sub
                if not host.exists():
                    host.mkdir(parents=True, exist_ok=True)
            mounts.append(
                Mount(str(host), spec["mountPath"], bool(spec.get("readOnly")), is_file=bool(sub) and host.is_file())
            )
        if not _covered(specs, SHM_PATH):
            self.shm_dir.mkdir(parents=True, exist_ok=True)
            (self.shm_dir / "_shm").mkdir(exist_ok=True)
            (self.shm_dir / "_shm").chmod(0o1777)
            mounts.append(Mount(str(self.shm_dir / "_shm"), SHM_PATH))
        return mounts

    def cleanup(self) -> None:
        for path in self._tmpfs:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)
        self._tmpfs.clear()
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.shm_dir, ignore_errors=True)


def unmount_under(root: Path, mounts_file: Path = Path("/proc/mounts")) -> list[str]:
    """Lazily unmount every mount point below `root` (tmpfs volumes left by a crashed runtime)."""
    prefix = str(root.resolve()).rstrip("/") + "/"
    points = []
    for line in mounts_file.read_text().splitlines():
        fields = line.split()
        if len(fields) > 1:
            point = fields[1].replace("\\040", " ")
            if point.startswith(prefix):
                points.append(point)
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)
    if points:
        log.warning("unmounted leftover volume mounts root=%s count=%d", root, len(points))
    return points

