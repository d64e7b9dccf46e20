"""One e2e environment: a cluster (local or existing), simulated GPU nodes and, optionally, the process
runtime. Shared by the pytest fixtures (e2e/pytest_plugin.py) and `make dev-up` (e2e/cli.py).

Environment variables (all optional):
  E2E_CLUSTER               which cluster (select_cluster()):
                              local     (default) start the embedded control plane
                              kind      a kind / nvkind cluster: kubeconfig from `kind get kubeconfig --name
                                        $KIND_CLUSTER_NAME` (default name "weightsync", see e2e/kind/), or
                                        WEIGHTSYNC_KUBECONFIG if set
                              existing  the cluster of WEIGHTSYNC_KUBECONFIG (required)
  WEIGHTSYNC_KUBECONFIG (alias KUBECONFIG_E2E)  use this existing cluster (kind, nvkind, ...) instead of
                                                 starting a local control plane (E2E_CLUSTER unset: existing)
  KIND_CLUSTER_NAME         the kind cluster for E2E_CLUSTER=kind (default "weightsync")
  KIND                      the kind binary (default: `kind` on PATH)
  WEIGHTSYNC_E2E_NODES      simulated GPU nodes to create (default 4 locally, 0 on an existing cluster)
  WEIGHTSYNC_E2E_GPUS       GPUs per simulated node (default 8)
  WEIGHTSYNC_E2E_RUNTIME    "0" never starts the process runtime, "1" starts it even on an existing cluster
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes

from weightsync.e2e.cluster import ClusterAccess, ClusterError, ExistingCluster, LocalCluster
from weightsync.e2e.nodes import NodeSimulator, gpu_fleet

log = logging.getLogger("weightsync.e2e.environment")

RUNTIME_MODULE = "weightsync.e2e.runtime"


CLUSTER_LOCAL = "local"
CLUSTER_KIND = "kind"
CLUSTER_EXISTING = "existing"
CLUSTER_CHOICES = (CLUSTER_LOCAL, CLUSTER_KIND, CLUSTER_EXISTING)
DEFAULT_KIND_CLUSTER = "weightsync"


class ClusterSelectionError(ClusterError):
    """E2E_CLUSTER and the kubeconfig variables do not name one cluster."""


def existing_kubeconfig(env: Mapping[str, str] = os.environ) -> str | None:
    """The kubeconfig of an existing cluster to test against, if one is configured."""
    return env.get("WEIGHTSYNC_KUBECONFIG") or env.get("KUBECONFIG_E2E") or None


@dataclass(frozen=True)
class ClusterSelection:
    """Which cluster the e2e environment uses: a pure function of the environment (select_cluster)."""

    kind: str                       # one of CLUSTER_CHOICES
    kubeconfig: str | None = None   # an existing kubeconfig file (WEIGHTSYNC_KUBECONFIG), if given
    kind_cluster: str | None = None  # kind: the cluster whose kubeconfig `kind get kubeconfig` prints

    @property
    def is_local(self) -> bool:
        return self.kind == CLUSTER_LOCAL


def select_cluster(env: Mapping[str, str] = os.environ) -> ClusterSelection:
    """E2E_CLUSTER = local (default) | kind | existing; see the module doc. Unset with WEIGHTSYNC_KUBECONFIG
    set means existing (as before E2E_CLUSTER existed). Raises ClusterSelectionError on a contradiction."""
    raw = env.get("E2E_CLUSTER", "").strip().lower()
    kubeconfig = existing_kubeconfig(env)
    if not raw:
        return ClusterSelection(CLUSTER_EXISTING, kubeconfig) if kubeconfig else ClusterSelection(CLUSTER_LOCAL)
    if raw not in CLUSTER_CHOICES:
        raise ClusterSelectionError(f"E2E_CLUSTER={raw!r}: expected one of {', '.join(CLUSTER_CHOICES)}")
    if raw == CLUSTER_LOCAL:
        if kubeconfig:
            raise ClusterSelectionError(
                "E2E_CLUSTER=local starts its own control plane, but WEIGHTSYNC_KUBECONFIG (or KUBECONFIG_E2E) "
                "names an existing cluster: unset one of them")
        return ClusterSelection(CLUSTER_LOCAL)
    if raw == CLUSTER_EXISTING:
        if not kubeconfig:
            raise ClusterSelectionError("E2E_CLUSTER=existing needs WEIGHTSYNC_KUBECONFIG=/path/to/kubeconfig")
        return ClusterSelection(CLUSTER_EXISTING, kubeconfig)
    name = env.get("KIND_CLUSTER_NAME", "").strip() or DEFAULT_KIND_CLUSTER
    return ClusterSelection(CLUSTER_KIND, kubeconfig, name)


def kind_kubeconfig(cluster_name: str, dest: Path, env: Mapping[str, str] = os.environ) -> Path:
    """Write the admin kubeconfig of kind cluster CLUSTER_NAME (`kind get kubeconfig`) to DEST (mode 0600)."""
    kind = env.get("KIND") or shutil.which("kind", path=env.get("PATH"))
    if not kind:
        raise ClusterError("E2E_CLUSTER=kind: the `kind` binary is not on PATH (set KIND=/path/to/kind, or "
                           "WEIGHTSYNC_KUBECONFIG to the cluster's kubeconfig); see e2e/kind/README.md")
    try:
        proc = subprocess.run([kind, "get", "kubeconfig", "--name", cluster_name], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"E2E_CLUSTER=kind: `{kind} get kubeconfig --name {cluster_name}` failed: {exc}") from exc
    if proc.returncode != 0 or not proc.stdout.strip():
        raise ClusterError(
            f"E2E_CLUSTER=kind: `{kind} get kubeconfig --name {cluster_name}` failed "
            f"(exit {proc.returncode}): {proc.stderr.strip() or 'no output'}; create the cluster with "
            "e2e/kind/create-cluster.sh or set KIND_CLUSTER_NAME")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(proc.stdout)
    return dest


def runtime_available() -> bool:
    """True once the process runtime (weightsync.e2e.runtime.ProcessRuntime) is importable."""
    if importlib.util.find_spec(RUNTIME_MODULE) is None:
        return False
    module = importlib.import_module(RUNTIME_MODULE)
    return hasattr(module, "ProcessRuntime")


@dataclass
class Environment:
    """A usable cluster plus the simulated nodes on it; delegates the ClusterAccess surface."""

    access: ClusterAccess
    local: LocalCluster | None = None
    cluster_kind: str = CLUSTER_LOCAL  # what select_cluster() chose: local | kind | existing
    nodes: NodeSimulator | None = None
    runtime: Any | None = None
    runtime_state_dir: Path | None = None
    _owned_dirs: list[Path] = field(default_factory=list)

    @property
    def kubeconfig(self) -> Path:
        return self.access.kubeconfig

    @property
    def server(self) -> str:
        return self.access.server

    @property
    def is_local(self) -> bool:
        return self.local is not None

    def api_client(self) -> kubernetes.client.ApiClient:
        return self.access.api_client()

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        return self.access.kubectl(*args, check=check, input=input, timeout=timeout)

    @property
    def node_names(self) -> list[str]:
        return self.nodes.node_names if self.nodes else []

    @property
    def process_node_names(self) -> list[str]:
        return self.nodes.process_node_names if self.nodes else []

    def start_runtime(self, state_dir: Path | None = None) -> Any | None:
        """Start the process runtime for the process nodes (once); None when it is not available."""
        if self.runtime is not None:
            return self.runtime
        if not runtime_available() or not self.process_node_names:
            log.info("process runtime not started available=%s process_nodes=%s",
                     runtime_available(), self.process_node_names)
            return None
        from weightsync.e2e.runtime import ProcessRuntime

        if state_dir is None:
            state_dir = Path(tempfile.mkdtemp(prefix="weightsync-runtime-"))
            self._owned_dirs.append(state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        self.runtime_state_dir = state_dir
        from weightsync.e2e.runtime.images import images_for_tests

        # WEIGHTSYNC_RUNTIME_IMAGES=buildah (`make e2e-images`): containers run from the images `make image` built
        self.runtime = ProcessRuntime(str(self.kubeconfig), self.process_node_names, state_dir,
                                      images=images_for_tests())
        self.runtime.start()
        log.info("process runtime started nodes=%s state_dir=%s", self.process_node_names, state_dir)
        return self.runtime

    def stop(self, delete_nodes: bool | None = None) -> None:
        """Stop the runtime, the node heartbeats and (if local) the control plane. On an existing
        cluster the simulated nodes are deleted (default), since nothing keeps them Ready any more."""
        if self.runtime is not None:
            try:
                self.runtime.stop()
            finally:
                self.runtime = None
        if self.nodes is not None:
            self.nodes.stop(delete=(not self.is_local) if delete_nodes is None else delete_nodes)
            self.nodes = None
        if self.local is not None:
            self.local.stop()
        for d in self._owned_dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._owned_dirs.clear()


def start_environment(
    *,
    kubeconfig: str | Path | None = None,
    work_dir: str | Path | None = None,
    node_count: int | None = None,
    gpus: int | None = None,
    process_nodes: bool | int = True,
    env: Mapping[str, str] = os.environ,
) -> Environment:
    """Start (or attach to) a cluster and create the simulated nodes; see the module doc for the env.
    KUBECONFIG: where a local cluster writes its admin kubeconfig (default: a new temp dir, removed on
    stop; `make dev-up` passes .dev/kubeconfig)."""
    selection = select_cluster(env)
    gpus = gpus if gpus is not None else int(env.get("WEIGHTSYNC_E2E_GPUS", "8"))
    environment: Environment
    if selection.kubeconfig:
        environment = Environment(access=ExistingCluster(selection.kubeconfig), cluster_kind=selection.kind)
        default_nodes = 0
    elif selection.kind == CLUSTER_KIND:
        assert selection.kind_cluster is not None
        kind_dir = Path(tempfile.mkdtemp(prefix="weightsync-kind-"))
        try:
            path = kind_kubeconfig(selection.kind_cluster, kind_dir / "kubeconfig", env)
            access = ExistingCluster(path)
        except BaseException:
            shutil.rmtree(kind_dir, ignore_errors=True)
            raise
        environment = Environment(access=access, cluster_kind=CLUSTER_KIND, _owned_dirs=[kind_dir])
        default_nodes = 0
    else:
        owned: list[Path] = []
        if kubeconfig is None:
            # Never the shared .dev/kubeconfig: parallel test sessions (and `make dev-up`) would clobber it.
            owned.append(Path(tempfile.mkdtemp(prefix="weightsync-e2e-")))
            kubeconfig = owned[0] / "kubeconfig"
        try:
            local = LocalCluster(kubeconfig=kubeconfig, work_dir=work_dir).start()
        except BaseException:
            for d in owned:
                shutil.rmtree(d, ignore_errors=True)
            raise
        environment = Environment(access=local, local=local, _owned_dirs=owned)
        default_nodes = 4
    try:
        count = node_count if node_count is not None else int(env.get("WEIGHTSYNC_E2E_NODES", str(default_nodes)))
        if count > 0:
            environment.nodes = NodeSimulator(environment.api_client,
                                              gpu_fleet(count, gpus=gpus, process=process_nodes)).start()
    except BaseException:
        environment.stop()
        raise
    return environment


def runtime_wanted(environment: Environment, env: Mapping[str, str] = os.environ) -> bool:
    """Whether the process runtime should run here (locally by default; on an existing cluster only
    when WEIGHTSYNC_E2E_RUNTIME=1)."""
    setting = env.get("WEIGHTSYNC_E2E_RUNTIME", "")
    if setting == "0":
        return False
    return environment.is_local or setting == "1"
