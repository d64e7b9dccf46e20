"""How a container becomes a host process (pure): mounts, the wrapper command line, executable lookup.

Each container runs in its own mount namespace: `unshare --mount --propagation private` then a tiny
bash script binds each volume's host directory at its mountPath (so /var/run/secrets/..., /dev/shm and
/var/run/weightsync are per pod) and execs the command. `setpriv --pdeathsig KILL` makes the kernel kill
the process if the runtime thread that started it dies, so a crashed runtime leaves no orphans.
"""

from __future__ import annotations

import os
import posixpath
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

WRAPPER_NAME = "weightsync-container"


@dataclass(frozen=True)
class Mount:
    host_path: str
    container_path: str
    read_only: bool = False
    is_file: bool = False


def sort_mounts(mounts: Sequence[Mount]) -> list[Mount]:
    """Parents before children, so a nested mountPath lands inside its parent's mount."""
    return sorted(mounts, key=lambda m: (posixpath.normpath(m.container_path).count("/"), m.container_path))


def keep_visible(mounts: Sequence[Mount], host_paths: Sequence[str]) -> list[Mount]:
    """Bind back the host paths the runtime's own environment needs (the Python env, the project source)
    that a pod volume would hide, e.g. an emptyDir at /tmp when the checkout lives under /tmp. Deeper
    than the volume that covers them, so `sort_mounts` puts them after it."""
    def covered(path: str) -> bool:
        return any(path == m.container_path.rstrip("/") or path.startswith(m.container_path.rstrip("/") + "/")
                   for m in mounts)

    roots = sorted({posixpath.normpath(p) for p in host_paths})
    roots = [r for r in roots if not any(r != o and r.startswith(o + "/") for o in roots)]  # outermost only
    return [*mounts, *(Mount(r, r) for r in roots if covered(r))]


def mount_script(mounts: Sequence[Mount], workdir: str) -> str:
    """The bash run inside the new mount namespace before exec.

    Every volume source is opened first and bound through /proc/self/fd: a volume mounted over a parent
    of the runtime's own volume directories (an emptyDir at /tmp, say) would otherwise hide the host
    paths of the volumes bound after it.
    """
    ordered = sort_mounts(mounts)
    lines = ["set -e"]
    for i, m in enumerate(ordered):
        lines.append(f"exec {{WS_FD{i}}}<{shlex.quote(m.host_path)}")
    lines += bind_lines(ordered, lambda m: m.container_path)
    lines.append(f"mkdir -p {shlex.quote(workdir)}; cd {shlex.quote(workdir)}")
    lines.append('exec "$@"')
    return "\n".join(lines)


def bind_lines(ordered: Sequence[Mount], target_of: Callable[[Mount], str]) -> list[str]:
    """Bind each volume (opened before as fd WS_FD<i>, in `ordered` order) at `target_of(mount)`, read-only
    where asked, then close the fds. The target is where the mount point is as this shell sees it: the
    container path in host mode, the path under the container's root in image mode."""
    lines = []
    for i, m in enumerate(ordered):
        dst = shlex.quote(target_of(m))
        if m.is_file:
            parent = shlex.quote(posixpath.dirname(target_of(m)) or "/")
            lines.append(f"mkdir -p {parent}; [ -e {dst} ] || : > {dst}")
        else:
            lines.append(f"mkdir -p {dst}")
        lines.append(f"mount --bind --no-canonicalize /proc/self/fd/$WS_FD{i} {dst}  # {shlex.quote(m.host_path)}")
        if m.read_only:
            lines.append(f"mount -o remount,bind,ro {dst}")
    lines += [f"exec {{WS_FD{i}}}<&-" for i in range(len(ordered))]
    return lines


def wrapper_argv(mounts: Sequence[Mount], workdir: str, argv: Sequence[str]) -> list[str]:
    """The full host command line for a container."""
    return [
        "setpriv", "--pdeathsig", "KILL", "--",
        "unshare", "--mount", "--propagation", "private", "--",
        "/bin/bash", "-c", mount_script(mounts, workdir), WRAPPER_NAME, *argv,
    ]  # fmt: skip


def to_host_path(container_path: str, mounts: Sequence[Mount]) -> str:
    """Where a path the container will see lives on the host (through the deepest covering mount)."""
    path = posixpath.normpath(container_path)
    best: Mount | None = None
    for m in mounts:
        root = posixpath.normpath(m.container_path)
        if (path == root or path.startswith(root.rstrip("/") + "/")) and (
            best is None or len(root) > len(posixpath.normpath(best.container_path))
        ):
            best = m
    if best is None:
        return path
    rest = posixpath.relpath(path, posixpath.normpath(best.container_path))
    return best.host_path if rest == "." else posixpath.join(best.host_path, rest)


def find_executable(name: str, env: Mapping[str, str], workdir: str, mounts: Sequence[Mount]) -> str | None:
    """The container path `name` resolves to (like execvp), or None when nothing executable matches."""

    def ok(container_path: str) -> bool:
        host = to_host_path(container_path, mounts)
        return os.path.isfile(host) and os.access(host, os.X_OK)

    if "/" in name:
        path = name if name.startswith("/") else posixpath.join(workdir, name)
        return path if ok(path) else None
    for directory in env.get("PATH", os.defpath).split(":"):
        candidate = posixpath.join(directory or workdir, name)
        if ok(candidate):
            return candidate
    return None
