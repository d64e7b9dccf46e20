"""Image hygiene, checked on the images `make image` built (marker `images`; CI builds the operator image and
runs these for it, `make e2e-images` for both): non-root user, console-script entrypoints that start, no
build tools or caches left, no torch in the operator, the locked versions inside, the size and `pip freeze`
recorded next to the image (build/images/).

    WEIGHTSYNC_IMAGE_TARGETS="operator"  which targets to check (default: operator agent)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from weightsync.e2e.runtime.images import (
    BuildahImages,
    LocalImage,
    container_argv,
    image_user,
    image_wrapper_argv,
)

pytestmark = [pytest.mark.images]

REPO = Path(__file__).resolve().parents[2]
TARGETS = os.environ.get("WEIGHTSYNC_IMAGE_TARGETS", "operator agent").split()
SIZE_BUDGET_BYTES = {"operator": 600_000_000, "agent": 8_000_000_000}  # unpacked; docs/operations.md has the figures
BUILD_TOOLS = ("gcc", "cc", "g++", "c++", "make", "git", "apt-get")  # apt-get: Debian bases keep it; see below
LEFTOVERS = ("root/.cache/pip", "wheels", "src", "var/lib/apt/lists/partial")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _freeze(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, sep, version = line.strip().partition("==")
        if not sep:  # the project's own wheel: "weightsync @ file:///wheels/weightsync-0.1.0-py3-none-any.whl"
            name, sep, version = line.strip().partition(" @ ")
        if sep:
            out[_norm(name)] = version
    return out


@pytest.fixture(scope="module")
def store() -> Iterator[BuildahImages]:
    s = BuildahImages()
    yield s
    s.close()


def _record(target: str) -> dict[str, object]:
    path = REPO / "build" / "images" / f"{target}.json"
    assert path.is_file(), f"{path} missing: build the image first (`make image IMAGE_TARGETS={target}`)"
    return dict(json.loads(path.read_text()))


def _image(store: BuildahImages, target: str) -> LocalImage:
    record = _record(target)
    image = store.get(str(record["image"]))
    assert image is not None, f"{record['image']} is not in buildah's storage: `make image IMAGE_TARGETS={target}`"
    assert image.id == record["id"], "build/images/ describes another build of this tag: run `make image` again"
    return image


@pytest.mark.parametrize("target", TARGETS)
def test_runs_as_the_non_root_user(store: BuildahImages, target: str) -> None:
    image = _image(store, target)
    assert image.config.user == "65532:65532"
    assert image_user(image) == (65532, 65532)
    passwd = Path(image.rootfs, "etc/passwd").read_text()
    assert re.search(r"^weightsync:x:65532:65532:", passwd, re.M), passwd


@pytest.mark.parametrize("target", TARGETS)
def test_entrypoint_is_the_console_script_and_starts(store: BuildahImages, target: str, tmp_path: Path) -> None:
    image = _image(store, target)
    script = f"weightsync-{target}"
    assert list(image.config.entrypoint) == [script] and not image.config.cmd
    body = Path(image.rootfs, "usr/local/bin", script).read_text()
    assert f"from weightsync.{target}.main import main" in body, body  # pip's console-script wrapper
    argv = container_argv({"args": ["--help"]}, image.config)
    env = {k: v for k, v in (e.split("=", 1) for e in image.config.env)}
    r = subprocess.run(image_wrapper_argv(image, str(tmp_path / "c"), [], image.config.workdir or "/", 65532, 65532,
                                          argv), capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "usage:" in r.stdout, (r.returncode, r.stdout[-1500:], r.stderr[-1500:])


@pytest.mark.parametrize("target", TARGETS)
def test_no_build_tools_or_caches_left(store: BuildahImages, target: str) -> None:
    image = _image(store, target)
    root = Path(image.rootfs)
    tools = [t for t in BUILD_TOOLS if t != "apt-get" and any((root / d / t).exists() for d in ("usr/bin", "usr/local/bin"))]
    assert tools == [], f"build tools in the image: {tools}"
    left = [p for p in LEFTOVERS if (root / p).exists()]
    assert left == [], f"left in the image: {left}"
    # (Debian's python3-venv keeps its seed wheels in /usr/share/python-wheels: part of the base, not ours)
    wheels = [str(p.relative_to(root)) for d in ("usr", "tmp", "home") for p in (root / d).rglob("*.whl")
              if "usr/share/python-wheels" not in str(p)]
    assert wheels == [], wheels[:5]
    assert not any((root / "var/lib/apt/lists").glob("*_Packages*")), "apt lists left in the image"
    assert list((root / "tmp").iterdir()) == []


@pytest.mark.parametrize("target", TARGETS)
def test_installs_exactly_the_locked_versions(store: BuildahImages, target: str) -> None:
    image = _image(store, target)
    inside = Path(image.rootfs, "usr/share/weightsync/pip-freeze.txt").read_text()
    beside = (REPO / "build" / "images" / f"{target}-pip-freeze.txt").read_text()
    assert inside == beside, "build/images/ records another build's packages"
    installed, lock = _freeze(inside), _freeze((REPO / "constraints.txt").read_text())
    assert "weightsync" in installed and "kopf" in installed, installed
    assert "weightsync-0.1.0" in installed["weightsync"], installed["weightsync"]
    differ = {n: (v, lock.get(n)) for n, v in installed.items() if n != "weightsync" and lock.get(n) != v}
    assert differ == {}, f"image versions that differ from constraints.txt (image, lock): {differ}"
    agent_only = {"torch", "nixl", "numpy", "xxhash"}
    if target == "operator":
        assert agent_only.isdisjoint(installed), sorted(agent_only & installed.keys())
    else:
        assert agent_only <= installed.keys(), sorted(agent_only - installed.keys())


@pytest.mark.parametrize("target", TARGETS)
def test_size_is_recorded_and_within_budget(target: str) -> None:
    record = _record(target)
    size = int(str(record["size_bytes"]))
    assert 50_000_000 < size <= SIZE_BUDGET_BYTES[target], f"{target} image: {size / 1e6:.0f} MB unpacked"
    assert record["python"] and str(record["python"]).startswith("3.11"), record
