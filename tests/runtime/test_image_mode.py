"""The process runtime's image mode, pure parts: argv / user / env from an image config as the kubelet
resolves them, the overlay + chroot script, lookups inside the image, fsGroup on volume files. (The mode
itself runs in `make e2e-images`, and `tests/docker/test_built_images.py` starts each built image's
entrypoint through `image_wrapper_argv`.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from weightsync.e2e.runtime.atomic_writer import read_current, write_atomic
from weightsync.e2e.runtime.images import (
    ImageConfig,
    ImageError,
    LocalImage,
    check_non_root,
    container_argv,
    container_user,
    find_in_image,
    image_env,
    image_mount_script,
    image_user,
    images_from_env,
    resolve_in_root,
    supplementary_groups,
)
from weightsync.e2e.runtime.launch import Mount
from weightsync.e2e.runtime.volumes import FileEntry

CFG = ImageConfig(entrypoint=("weightsync-agent",), cmd=("--serve",), env=("PATH=/usr/local/bin:/usr/bin", "A=1=2"),
                  user="65532:65532", workdir="/home/weightsync")


def _image(tmp_path: Path, user: str = "65532:65532") -> LocalImage:
    etc = tmp_path / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nweightsync:x:65532:65533:ws:/home/weightsync:/bin/false\n")
    (etc / "group").write_text("root:x:0:\nweightsync:x:65533:\n")
    return LocalImage("img:1", "sha256:abc", str(tmp_path), ImageConfig(CFG.entrypoint, CFG.cmd, CFG.env, user, CFG.workdir))


@pytest.mark.parametrize("spec, argv", [
    ({}, ["weightsync-agent", "--serve"]),                                          # Entrypoint + Cmd
    ({"args": ["--x"]}, ["weightsync-agent", "--x"]),                               # args replace Cmd only
    ({"command": ["python", "-m", "m"]}, ["python", "-m", "m"]),                    # command drops Cmd too
    ({"command": ["python"], "args": ["-V"]}, ["python", "-V"]),
])
def test_argv_follows_the_kubelet(spec: dict, argv: list[str]) -> None:
    assert container_argv(spec, CFG) == argv


def test_env_from_the_image() -> None:
    assert image_env(CFG) == {"PATH": "/usr/local/bin:/usr/bin", "A": "1=2"}


@pytest.mark.parametrize("user, expected", [
    ("65532:65532", (65532, 65532)), ("weightsync", (65532, 65533)), ("65532", (65532, 65533)),
    ("weightsync:root", (65532, 0)), ("", (0, 0)), ("4242", (4242, 0)),
])
def test_image_user(tmp_path: Path, user: str, expected: tuple[int, int]) -> None:
    assert image_user(_image(tmp_path, user)) == expected


def test_unknown_user_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ImageError) as exc:
        image_user(_image(tmp_path, "nobody-here"))
    assert exc.value.reason == "CreateContainerConfigError"


def test_security_context_wins_over_the_image(tmp_path: Path) -> None:
    image = _image(tmp_path)
    pod = {"spec": {"securityContext": {"runAsUser": 1000, "fsGroup": 2000, "supplementalGroups": [3000]}}}
    assert container_user(pod, {}, image) == (1000, 65532)
    assert container_user(pod, {"securityContext": {"runAsUser": 7, "runAsGroup": 8}}, image) == (7, 8)
    assert container_user({}, {}, image) == (65532, 65532)
    assert supplementary_groups(pod) == [2000, 3000]


def test_run_as_non_root_refuses_root() -> None:
    pod = {"spec": {"securityContext": {"runAsNonRoot": True}}}
    check_non_root(pod, {}, 65532)
    with pytest.raises(ImageError, match="runAsNonRoot"):
        check_non_root(pod, {}, 0)
    check_non_root(pod, {"securityContext": {"runAsNonRoot": False}}, 0)  # the container's own setting wins


def test_mount_script_overlays_the_image_binds_volumes_and_chroots(tmp_path: Path) -> None:
    image = _image(tmp_path)
    script = image_mount_script(image, "/state/c1", [Mount("/host/tok", "/var/run/tok", read_only=True)],
                                "/home/weightsync", 65532, 65532, [2000])
    lines = script.splitlines()
    overlay = next(i for i, ln in enumerate(lines) if ln.startswith("mount -t overlay"))
    assert f"lowerdir={tmp_path},upperdir=/state/c1/upper,workdir=/state/c1/work /state/c1/root" in lines[overlay]
    bind = next(i for i, ln in enumerate(lines) if "/state/c1/root/var/run/tok" in ln and "--bind" in ln)
    assert overlay < bind and "mount -o remount,bind,ro /state/c1/root/var/run/tok" in lines[bind + 1]
    assert lines.index("exec {WS_FD0}</host/tok") < overlay  # sources opened before anything is mounted over
    assert any("mount --rbind /proc /state/c1/root/proc" in ln for ln in lines)
    assert lines[-1].startswith("exec chroot --userspec=65532:65532 --groups=2000 /state/c1/root /bin/sh -c")
    assert lines[-1].endswith("/home/weightsync \"$@\"")


def test_mount_points_follow_the_image_symlinks_inside_the_image(tmp_path: Path) -> None:
    image = _image(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "var").mkdir()
    os.symlink("/run", tmp_path / "var" / "run")  # Debian: absolute, must not be resolved on the host
    os.symlink("../run", tmp_path / "var" / "rel")
    assert resolve_in_root(str(tmp_path), "/var/run/weightsync/key") == "/run/weightsync/key"
    assert resolve_in_root(str(tmp_path), "/var/rel/x") == "/run/x"
    assert resolve_in_root(str(tmp_path), "/../../etc") == "/etc"
    script = image_mount_script(image, "/c", [Mount("/h", "/var/run/weightsync")], "/", 0, 0)
    assert "mkdir -p /c/root/run/weightsync" in script and "/c/root/var/run" not in script
    os.symlink("loop", tmp_path / "loop")
    with pytest.raises(ImageError, match="too many symlinks"):
        resolve_in_root(str(tmp_path), "/loop/x")


def test_executables_are_looked_up_inside_the_image(tmp_path: Path) -> None:
    image = _image(tmp_path)
    bin_dir = tmp_path / "usr" / "local" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "weightsync-agent").write_text("#!/bin/sh\n")
    (bin_dir / "weightsync-agent").chmod(0o755)
    os.symlink("/usr/local/bin/weightsync-agent", bin_dir / "alias")  # absolute: resolved inside the image
    env = image_env(CFG)
    assert find_in_image("weightsync-agent", env, "/", image) == "/usr/local/bin/weightsync-agent"
    assert find_in_image("alias", env, "/", image) == "/usr/local/bin/alias"
    assert find_in_image("missing", env, "/", image) is None
    assert find_in_image("/usr/local/bin/weightsync-agent", env, "/", image) is not None


def test_fs_group_makes_volume_files_group_readable(tmp_path: Path) -> None:
    payload = {"token": FileEntry(b"secret", 0o400)}
    assert write_atomic(tmp_path / "v", payload, fs_group=4321)
    f = tmp_path / "v" / "token"
    st = f.stat()
    assert st.st_gid == 4321 and st.st_mode & 0o777 == 0o440
    assert not write_atomic(tmp_path / "v", payload, fs_group=4321)  # already current: not rewritten
    assert read_current(tmp_path / "v") == {"token": FileEntry(b"secret", 0o440)}


def test_image_store_selection() -> None:
    assert images_from_env(None) is None and images_from_env("host") is None
    with pytest.raises(ValueError, match="buildah or host"):
        images_from_env("docker")
