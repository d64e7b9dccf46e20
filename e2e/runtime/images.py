"""Containers from local OCI images: the process runtime's image mode.

By default the runtime runs a container's `command` on the host, from the project's venv. With an image
store (`ProcessRuntime(..., images=BuildahImages())`, `python -m weightsync.e2e.runtime --images buildah`)
a container whose image is in this host's buildah storage (what `make image` built) runs from that image:
its root is a per-container overlay over the image's rootfs, its argv is resolved from the image's
Entrypoint/Cmd the way the kubelet does, its environment starts from the image's, and it runs as the
image's USER unless the pod's securityContext says otherwise. The pod's volumes are bound into that root
as in host mode; the network is still the host's (pod IPs on loopback).

Pure parts (argv, env, user, the mount script) are tested without buildah; `BuildahImages` needs it.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import shlex
import shutil
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from weightsync.e2e.runtime.launch import Mount, bind_lines, sort_mounts

log = logging.getLogger(__name__)

# What a container gets of the host besides its volumes (the kubelet's runtime gives the same, with its own
# /proc and /sys per container; here they are the host's, read-only where it matters).
SYSTEM_BINDS = ("/dev", "/proc", "/sys")
HOST_FILES = ("/etc/resolv.conf", "/etc/hosts")


@dataclass(frozen=True)
class ImageConfig:
    """The runtime part of an OCI image config."""

    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    user: str = ""
    workdir: str = ""

    @staticmethod
    def from_oci(config: Mapping[str, Any] | None) -> ImageConfig:
        c = config or {}
        return ImageConfig(tuple(c.get("Entrypoint") or ()), tuple(c.get("Cmd") or ()), tuple(c.get("Env") or ()),
                           str(c.get("User") or ""), str(c.get("WorkingDir") or ""))


@dataclass(frozen=True)
class LocalImage:
    ref: str
    id: str
    rootfs: str  # the image's root filesystem, mounted read-only for every container that uses it
    config: ImageConfig = field(default_factory=ImageConfig)


class ImageStore(Protocol):
    def get(self, ref: str) -> LocalImage | None: ...
    def close(self) -> None: ...


class ImageError(Exception):
    """An image that exists but cannot be used (reason as the kubelet would give it)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def container_argv(spec: Mapping[str, Any], config: ImageConfig) -> list[str]:
    """The kubelet's rule: `command` replaces the Entrypoint (and drops Cmd); `args` alone replace Cmd."""
    command, args = list(spec.get("command") or []), list(spec.get("args") or [])
    if command:
        return command + args
    return list(config.entrypoint) + (args if args else list(config.cmd))


def image_env(config: ImageConfig) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in config.env:
        name, sep, value = item.partition("=")
        if sep:
            out[name] = value
    return out


def _passwd(rootfs: str, db: str) -> list[list[str]]:
    try:
        return [line.split(":") for line in Path(rootfs, db.lstrip("/")).read_text().splitlines()]
    except OSError:
        return []


def image_user(image: LocalImage) -> tuple[int, int]:
    """The image's USER as (uid, gid): "uid:gid", "name[:group]" (looked up in the image's /etc/passwd and
    /etc/group) or "uid" (its primary group from /etc/passwd, else 0); empty is root."""
    user, _, group = image.config.user.partition(":")
    users = _passwd(image.rootfs, "/etc/passwd")
    entry = next((u for u in users if len(u) > 3 and (u[0] == user or u[2] == user)), None)
    if not user:
        uid = 0
    elif user.isdigit():
        uid = int(user)
    elif entry is not None:
        uid = int(entry[2])
    else:
        raise ImageError("CreateContainerConfigError", f"user {user!r} is not in the image's /etc/passwd")
    if group.isdigit():
        gid = int(group)
    elif group:
        found = next((g for g in _passwd(image.rootfs, "/etc/group") if len(g) > 2 and g[0] == group), None)
        if found is None:
            raise ImageError("CreateContainerConfigError", f"group {group!r} is not in the image's /etc/group")
        gid = int(found[2])
    else:
        gid = int(entry[3]) if entry is not None and entry[3].isdigit() else 0
    return uid, gid


def container_user(pod: Mapping[str, Any], spec: Mapping[str, Any], image: LocalImage) -> tuple[int, int]:
    """(uid, gid): runAsUser/runAsGroup of the container, else of the pod, else the image's USER."""
    pod_sc = (pod.get("spec") or {}).get("securityContext") or {}
    sc = spec.get("securityContext") or {}
    uid, gid = image_user(image)
    run_uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    run_gid = sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    return (int(run_uid) if run_uid is not None else uid), (int(run_gid) if run_gid is not None else gid)


def supplementary_groups(pod: Mapping[str, Any]) -> list[int]:
    """fsGroup and supplementalGroups of the pod: the groups that may read its volumes."""
    sc = (pod.get("spec") or {}).get("securityContext") or {}
    groups = [int(g) for g in sc.get("supplementalGroups") or []]
    if sc.get("fsGroup") is not None:
        groups.insert(0, int(sc["fsGroup"]))
    return groups


def check_non_root(pod: Mapping[str, Any], spec: Mapping[str, Any], uid: int) -> None:
    """runAsNonRoot: the kubelet refuses to start a container that would run as uid 0."""
    pod_sc = (pod.get("spec") or {}).get("securityContext") or {}
    sc = spec.get("securityContext") or {}
    if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) and uid == 0:
        raise ImageError("CreateContainerConfigError", "container has runAsNonRoot and image will run as root")


def resolve_in_root(rootfs: str, path: str, max_links: int = 40) -> str:
    """PATH as the container sees it, with the image's symlinks followed inside the image (Debian's
    /var/run -> /run, say): where to mount so that the container finds it at PATH. The host must never
    resolve an absolute link of the image against its own root."""
    parts = [p for p in posixpath.normpath("/" + path).split("/") if p]
    resolved: list[str] = []
    links = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        host = os.path.join(rootfs, *resolved, part)
        if os.path.islink(host):
            links += 1
            if links > max_links:
                raise ImageError("CreateContainerError", f"too many symlinks in the image resolving {path}")
            target = os.readlink(host)
            if target.startswith("/"):
                resolved = []
            parts = [p for p in target.split("/") if p and p != "."] + parts
            continue
        resolved.append(part)
    return "/" + "/".join(resolved)


def image_mount_script(image: LocalImage, container_dir: str, mounts: Sequence[Mount], workdir: str,
                       uid: int, gid: int, groups: Sequence[int] = ()) -> str:
    """The bash run in the container's new mount namespace: an overlay root (the image's rootfs below, a
    per-container upper dir), the host's /dev, /proc and /sys, the pod's volumes bound into it, then chroot
    as uid:gid into the working directory and exec the argv ("$@")."""
    root = posixpath.join(container_dir, "root")
    upper, work = posixpath.join(container_dir, "upper"), posixpath.join(container_dir, "work")
    q = shlex.quote
    ordered = sort_mounts(mounts)
    lines = ["set -e", f"mkdir -p {q(root)} {q(upper)} {q(work)}"]
    for i, m in enumerate(ordered):  # open every source before anything is mounted over it
        lines.append(f"exec {{WS_FD{i}}}<{q(m.host_path)}")
    lines.append(f"mount -t overlay overlay -o lowerdir={q(image.rootfs)},upperdir={q(upper)},workdir={q(work)} {q(root)}")
    for path in SYSTEM_BINDS:
        dst = q(root + resolve_in_root(image.rootfs, path))
        lines.append(f"mkdir -p {dst}; mount --rbind {path} {dst}")
    for path in HOST_FILES:
        dst = q(root + resolve_in_root(image.rootfs, path))
        lines.append(f"if [ -f {path} ]; then [ -e {dst} ] || : > {dst}; mount --bind {path} {dst}; fi")
    lines += bind_lines(ordered, lambda m: root + resolve_in_root(image.rootfs, m.container_path))
    lines.append(f"mkdir -p {q(root + resolve_in_root(image.rootfs, workdir))}")
    extra = ",".join(str(g) for g in groups)
    lines.append(f"exec chroot --userspec={uid}:{gid} --groups={q(extra)} {q(root)} "
                 f"/bin/sh -c 'cd \"$0\" && exec \"$@\"' {q(workdir)} \"$@\"")
    return "\n".join(lines)


def image_wrapper_argv(image: LocalImage, container_dir: str, mounts: Sequence[Mount], workdir: str,
                       uid: int, gid: int, argv: Sequence[str], groups: Sequence[int] = ()) -> list[str]:
    return [
        "setpriv", "--pdeathsig", "KILL", "--",
        "unshare", "--mount", "--propagation", "private", "--",
        "/bin/bash", "-c", image_mount_script(image, container_dir, mounts, workdir, uid, gid, groups),
        "weightsync-container", *argv,
    ]  # fmt: skip


def find_in_image(name: str, env: Mapping[str, str], workdir: str, image: LocalImage) -> str | None:
    """execvp inside the image: the path `name` resolves to, or None."""
    def ok(path: str) -> bool:
        try:  # the image's links (/usr/local/bin/python -> /usr/bin/python3) resolve inside the image
            host = os.path.join(image.rootfs, resolve_in_root(image.rootfs, path).lstrip("/"))
        except ImageError:
            return False
        return os.path.isfile(host) and os.access(host, os.X_OK)

    if "/" in name:
        path = name if name.startswith("/") else posixpath.join(workdir, name)
        return path if ok(path) else None
    for directory in env.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(":"):
        candidate = posixpath.join(directory or workdir, name)
        if ok(candidate):
            return candidate
    return None


class BuildahImages:
    """Images in this host's buildah storage, each mounted once (a working container named
    weightsync-rt-<id>, removed by close()) and shared read-only as the lower layer of its containers."""

    def __init__(self, buildah: str = "buildah") -> None:
        found = shutil.which(buildah)
        if found is None:
            raise RuntimeError("image mode needs buildah on PATH (apt-get install buildah)")
        self.buildah = found
        self._images: dict[str, LocalImage | None] = {}
        self._containers: list[str] = []
        self._lock = threading.Lock()

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.buildah, *args], capture_output=True, text=True, check=check, timeout=300)

    def get(self, ref: str) -> LocalImage | None:
        with self._lock:
            if ref not in self._images:
                self._images[ref] = self._load(ref)
            return self._images[ref]

    def _load(self, ref: str) -> LocalImage | None:
        r = self._run("inspect", "--type", "image", ref, check=False)
        if r.returncode != 0:
            return None
        info = json.loads(r.stdout)
        image_id = str(info.get("FromImageID") or "")
        config = ImageConfig.from_oci((info.get("OCIv1") or {}).get("config"))
        name = f"weightsync-rt-{image_id[:12]}"
        if self._run("inspect", "--type", "container", name, check=False).returncode != 0:
            self._run("from", "--pull-never", "--name", name, ref)
        self._containers.append(name)  # left by a runtime that died: reused, and removed by close() all the same
        rootfs = self._run("mount", name).stdout.strip()
        log.info("image mounted ref=%s id=%s rootfs=%s", ref, image_id[:12], rootfs)
        return LocalImage(ref, image_id, rootfs, config)

    def close(self) -> None:
        with self._lock:
            for name in self._containers:
                self._run("umount", name, check=False)
                self._run("rm", name, check=False)
            self._containers.clear()
            self._images.clear()


def images_from_env(value: str | None) -> ImageStore | None:
    """WEIGHTSYNC_RUNTIME_IMAGES / --images: "buildah" turns image mode on, "" or "host" leaves it off."""
    if not value or value == "host":
        return None
    if value == "buildah":
        return BuildahImages()
    raise ValueError(f"unknown image store {value!r}: buildah or host")


RUNTIME_IMAGES_ENV = "WEIGHTSYNC_RUNTIME_IMAGES"


def images_for_tests() -> ImageStore | None:
    """The image store the test environment's runtimes use: $WEIGHTSYNC_RUNTIME_IMAGES (`make e2e-images`
    sets buildah)."""
    return images_from_env(os.environ.get(RUNTIME_IMAGES_ENV))
