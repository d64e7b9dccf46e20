"""One e2e environment: a cluster (local or existing), simulated GPU nodes and, optionally, the process
runtime. Shared by the pytest fixtures (e2e/pytest_plugin.py) and `make dev-up` (e2e/cli.py).

Environment variables (all optional):
  WEIGHTSYNC_KUBECONFIG (alias KUBECONFIG_E2E)  use this existing cluster (kind, nvkind, ...) instead of
                                                 starting a local control plane
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
from weightsync.e2e.cluster import ClusterAccess, ExistingCluster, LocalCluster
from weightsync.e2e.nodes import NodeSimulator, gpu_fleet

log = logging.getLogger("weightsync.e2e.environment")

RUNTIME_MODULE = "weightsync.e2e.runtime"


def existing_kubeconfig(env: Mapping[str, str] = os.environ) -> str | None:
    """The kubeconfig of an existing cluster to test against, if one is configured."""
    return env.get("WEIGHTSYNC_KUBECONFIG") or env.get("KUBECONFIG_E2E") or None


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
        self.runtime = ProcessRuntime(str(self.kubeconfig), self.process_node_names, state_dir)
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
    existing = existing_kubeconfig(env)
    gpus = gpus if gpus is not None else int(env.get("WEIGHTSYNC_E2E_GPUS", "8"))
    environment: Environment
    if existing:
        environment = Environment(access=ExistingCluster(existing))
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
