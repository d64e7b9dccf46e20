"""The kubelet's atomic volume writer: readers never see a half-updated set of files.

Layout: `<dir>/..<timestamp>/` holds the files, `<dir>/..data` links to it, and each top-level name is a
link `<name> -> ..data/<name>`. An update writes a new timestamped dir and renames a fresh `..data`
link over the old one (rename(2) is atomic), then drops the old dir.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from weightsync.e2e.runtime.volumes import FileEntry, Payload

DATA_LINK = "..data"


def read_current(target: Path) -> Payload | None:
    """The payload currently published in `target`, or None when nothing was written yet."""
    data = target / DATA_LINK
    if not data.is_symlink():
        return None
    root = target / os.readlink(data)
    current: Payload = {}
    for path in root.rglob("*"):
        if path.is_file():
            current[str(path.relative_to(root))] = FileEntry(path.read_bytes(), path.stat().st_mode & 0o7777)
    return current


def with_fs_group(payload: Payload) -> Payload:
    """The kubelet's SetVolumeOwnership for a read-only volume of a pod with fsGroup: group-readable."""
    return {rel: FileEntry(e.data, e.mode | 0o440) for rel, e in payload.items()}


def write_atomic(target: Path, payload: Payload, fs_group: int | None = None) -> bool:
    """Publish `payload` in `target`; returns False (and touches nothing) when it is already current.
    With `fs_group` the files belong to that group and are group-readable (the pod's fsGroup), so a
    container running as a non-root user in that group reads them (image mode)."""
    target.mkdir(parents=True, exist_ok=True)
    if fs_group is not None:
        payload = with_fs_group(payload)
    if read_current(target) == payload:
        return False
    stamp = time.strftime("..%Y_%m_%d_%H_%M_%S.", time.gmtime()) + str(time.monotonic_ns())
    new_dir = target / stamp
    new_dir.mkdir()
    for rel, entry in payload.items():
        path = new_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(entry.data)
        os.chmod(path, entry.mode)
        if fs_group is not None:
            os.chown(path, -1, fs_group)
    data_link = target / DATA_LINK
    old_dir = os.readlink(data_link) if data_link.is_symlink() else None
    tmp_link = target / "..data_tmp"
    if tmp_link.is_symlink() or tmp_link.exists():
        tmp_link.unlink()
    os.symlink(stamp, tmp_link)
    os.rename(tmp_link, data_link)
    top_level = {rel.split("/", 1)[0] for rel in payload}
    for name in top_level:
        link = target / name
        if not link.is_symlink():
            if link.exists():
                shutil.rmtree(link) if link.is_dir() else link.unlink()
            os.symlink(f"{DATA_LINK}/{name}", link)
    for child in target.iterdir():
        if child.name.startswith(".."):
            continue
        if child.is_symlink() and child.name not in top_level:
            child.unlink()
    if old_dir and old_dir != stamp:
        shutil.rmtree(target / old_dir, ignore_errors=True)
    return True
