"""Find the control plane's binaries: explicit paths, then KUBEBUILDER_ASSETS, then the version-keyed cache.

Lookup order for one binary NAME (e.g. `kube-apiserver`):
1. `$WEIGHTSYNC_KUBE_APISERVER`, then `$TEST_ASSET_KUBE_APISERVER` (envtest's convention): an explicit file;
2. `$KUBEBUILDER_ASSETS/kube-apiserver` (a setup-envtest directory);
3. the cache: `$WEIGHTSYNC_CACHE/bin/<component>-<version>/<name>` (default cache root
   `$XDG_CACHE_HOME/weightsync` or `~/.cache/weightsync`), versions pinned in e2e/versions.env, where
   `e2e/scripts/build-binaries.sh` puts them and marks a finished build with a `.complete` file.

A binary that is not found raises `BinaryNotFound` whose message is one line saying what to run.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

E2E_DIR = Path(__file__).resolve().parent
VERSIONS_ENV = E2E_DIR / "versions.env"
BUILD_SCRIPT = "e2e/scripts/build-binaries.sh"

# binary name -> (component built by build-binaries.sh, key of its version in versions.env)
COMPONENTS: dict[str, tuple[str, str]] = {
    "etcd": ("etcd", "ETCD_VERSION"),
    "kube-apiserver": ("kubernetes", "KUBERNETES_VERSION"),
    "kube-controller-manager": ("kubernetes", "KUBERNETES_VERSION"),
    "kube-scheduler": ("kubernetes", "KUBERNETES_VERSION"),
    "kubectl": ("kubernetes", "KUBERNETES_VERSION"),
    "kwok": ("kwok", "KWOK_VERSION"),
    "helm": ("helm", "HELM_VERSION"),
}
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
COMPLETE_MARKER = ".complete"


class BinaryNotFound(RuntimeError):
    """A control-plane binary is missing; the message is one line that says what to run."""


def read_versions(path: Path = VERSIONS_ENV) -> dict[str, str]:
    """Parse the KEY=VALUE lines of versions.env (comments and blank lines ignored)."""
    versions: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        versions[key.strip()] = value.strip().strip('"').strip("'")
    return versions


def cache_root(env: Mapping[str, str] = os.environ) -> Path:
    """The cache root shared with build-binaries.sh (same rule, so both agree)."""
    if env.get("WEIGHTSYNC_CACHE"):
        return Path(env["WEIGHTSYNC_CACHE"]).expanduser()
    xdg = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME", str(Path.home()))) / ".cache")
    return Path(xdg).expanduser() / "weightsync"


def env_var_names(name: str) -> tuple[str, str]:
    """`kube-apiserver` -> (`WEIGHTSYNC_KUBE_APISERVER`, `TEST_ASSET_KUBE_APISERVER`)."""
    suffix = name.upper().replace("-", "_")
    return f"WEIGHTSYNC_{suffix}", f"TEST_ASSET_{suffix}"


def cache_dir(name: str, env: Mapping[str, str] = os.environ, versions: Mapping[str, str] | None = None) -> Path:
    """The cache directory that holds NAME once `build-binaries.sh <component>` has run."""
    component, version_key = COMPONENTS[name]
    versions = versions if versions is not None else read_versions()
    return cache_root(env) / "bin" / f"{component}-{versions[version_key]}"


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_binary(name: str, env: Mapping[str, str] = os.environ, versions: Mapping[str, str] | None = None) -> Path:
    """Return the path of binary NAME, or raise BinaryNotFound with one line saying what to run."""
    if name not in COMPONENTS:
        raise ValueError(f"unknown binary {name!r}; known: {', '.join(COMPONENTS)}")
    component, _ = COMPONENTS[name]
    fix = f"run `make binaries` (or `{BUILD_SCRIPT} {component}`)"
    for var in env_var_names(name):
        value = env.get(var)
        if value:
            path = Path(value).expanduser()
            if not _is_executable(path):
                raise BinaryNotFound(f"{name}: ${var}={value} is not an executable file; fix or unset ${var}")
            return path
    assets = env.get("KUBEBUILDER_ASSETS")
    if assets and _is_executable(Path(assets).expanduser() / name):
        return Path(assets).expanduser() / name
    directory = cache_dir(name, env, versions)
    candidate = directory / name
    if _is_executable(candidate) and (directory / COMPLETE_MARKER).exists():
        return candidate
    if directory.with_name(directory.name + ".tmp").exists() and not directory.exists():
        raise BinaryNotFound(
            f"{name}: the build of {directory.name} is unfinished ({directory}.tmp exists); wait for it, or {fix}"
        )
    if directory.exists() and not (directory / COMPLETE_MARKER).exists():
        raise BinaryNotFound(f"{name}: broken cache {directory} (no {COMPLETE_MARKER} marker); delete it and {fix}")
    searched = f"${env_var_names(name)[0]}, $KUBEBUILDER_ASSETS, {candidate}"
    raise BinaryNotFound(f"{name} not found (looked in {searched}); {fix}")


@dataclass(frozen=True)
class Binaries:
    """Resolved paths of the binaries one LocalCluster runs."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path

    @classmethod
    def resolve(cls, env: Mapping[str, str] = os.environ) -> Binaries:
        """Find every control-plane binary; the first missing one raises BinaryNotFound."""
        versions = read_versions()
        paths = {name.replace("-", "_"): find_binary(name, env, versions) for name in CONTROL_PLANE}
        return cls(**paths)

    def as_dict(self) -> dict[str, str]:
        return {name: str(getattr(self, name.replace("-", "_"))) for name in CONTROL_PLANE}


def main() -> int:
    """`python -m weightsync.e2e.binaries`: print where each binary resolves, or what is missing."""
    rc = 0
    for name in COMPONENTS:
        try:
            print(f"{name}={find_binary(name)}")
        except BinaryNotFound as exc:
            print(f"{name}: MISSING: {exc}")
            rc = 1
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
