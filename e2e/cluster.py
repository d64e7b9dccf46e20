"""A real local Kubernetes control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler.

    with LocalCluster() as c:               # or c = LocalCluster().start(); ...; c.stop()
        c.kubectl("get", "ns")              # CompletedProcess
        core = kubernetes.client.CoreV1Api(c.api_client())

Everything runs on 127.0.0.1 on free ports from a temporary directory (or WORK_DIR), each component in
its own process group; `stop()` terminates the groups (SIGTERM, grace, SIGKILL), so nothing is left
running and no port stays bound. Start to ready takes a few seconds once the binaries are cached
(`start_seconds` and the log say how long).

`ExistingCluster` gives the same access surface (kubeconfig, server, api_client(), kubectl()) for a
cluster someone else runs (kind, a dev cluster), so tests can target either.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import kubernetes
import yaml

from weightsync.e2e.binaries import Binaries, BinaryNotFound, find_binary
from weightsync.e2e.pki import SA_ISSUER, Pki, generate_pki, render_kubeconfig
from weightsync.e2e.procs import Proc, free_port, listening_ports, stop_all

log = logging.getLogger("weightsync.e2e.cluster")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_KUBECONFIG = REPO_ROOT / ".dev" / "kubeconfig"
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # first address of SERVICE_CIDR: the `kubernetes` Service


class ClusterError(RuntimeError):
    """The control plane could not start or is unhealthy; the message says what to do."""


class ComponentExited(ClusterError):
    """A component exited while starting; the message carries the tail of its log."""

    def __init__(self, name: str, rc: int | None, log_path: Path, log_tail: str) -> None:
        self.name, self.rc, self.log_path, self.log_tail = name, rc, log_path, log_tail
        super().__init__(f"{name} exited with code {rc} while starting (log: {log_path}); last lines:\n{log_tail}")

    @property
    def port_conflict(self) -> bool:
        return "address already in use" in self.log_tail


def _kubectl_binary() -> Path:
    """Our pinned kubectl, else one on PATH (enough for a cluster someone else runs)."""
    try:
        return find_binary("kubectl")
    except BinaryNotFound:
        found = shutil.which("kubectl")
        if found is None:
            raise
        return Path(found)


class ClusterAccess:
    """What tests need from any cluster: a kubeconfig, the server URL, API clients and kubectl."""

    kubeconfig: Path
    server: str
    kubectl_path: Path

    def api_client(self) -> kubernetes.client.ApiClient:
        """A new admin ApiClient for this cluster (close it, or use it as a context manager)."""
        return kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; raises CalledProcessError (with stderr) when CHECK fails."""
        argv = [str(self.kubectl_path), f"--kubeconfig={self.kubeconfig}", *args]
        proc = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, argv, proc.stdout, proc.stderr)
        return proc


class ExistingCluster(ClusterAccess):
    """A cluster run by someone else (kind, nvkind, a dev cluster), reached through its kubeconfig."""

    def __init__(self, kubeconfig: str | Path, context: str | None = None) -> None:
        self.kubeconfig = Path(kubeconfig).expanduser().resolve()
        if not self.kubeconfig.is_file():
            raise ClusterError(f"kubeconfig {self.kubeconfig} does not exist; point WEIGHTSYNC_KUBECONFIG at a real file")
        self.server = server_of(self.kubeconfig, context)
        self.kubectl_path = _kubectl_binary()
        self.context = context


def server_of(kubeconfig: Path, context: str | None = None) -> str:
    """The server URL of KUBECONFIG's current (or named) context."""
    doc = yaml.safe_load(kubeconfig.read_text()) or {}
    ctx_name = context or doc.get("current-context")
    ctx = next((c["context"] for c in doc.get("contexts", []) if c.get("name") == ctx_name), None)
    if ctx is None:
        raise ClusterError(f"kubeconfig {kubeconfig}: context {ctx_name!r} not found")
    cluster = next((c["cluster"] for c in doc.get("clusters", []) if c.get("name") == ctx["cluster"]), None)
    if cluster is None:
        raise ClusterError(f"kubeconfig {kubeconfig}: cluster {ctx['cluster']!r} not found")
    return str(cluster["server"])


def _poll(what: str, check: Callable[[], bool], timeout: float, interval: float,
          on_tick: Callable[[], None] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if on_tick is not None:
            on_tick()
        try:
            if check():
                return
        except Exception as exc:
            log.debug("waiting what=%s error=%s", what, exc)
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _https_ok(url: str, ctx: ssl.SSLContext) -> bool:
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=2) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


class LocalCluster(ClusterAccess):
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler on loopback; see the module doc.

    KUBECONFIG: where to write the admin kubeconfig (default `.dev/kubeconfig` in the repository).
    WORK_DIR: PKI, etcd data and logs (default: a new temp dir, removed by stop() unless KEEP_WORK_DIR).
    Call start() from a thread that outlives the cluster: children get SIGTERM when that thread exits.
    """

    def __init__(
        self,
        kubeconfig: str | Path | None = None,
        work_dir: str | Path | None = None,
        binaries: Binaries | None = None,
        *,
        keep_work_dir: bool = False,
        ready_timeout: float = 90.0,
        apiserver_port: int | None = None,
        extra_apiserver_args: Sequence[str] = (),
        extra_controller_manager_args: Sequence[str] = (),
        die_with_parent: bool = True,
    ) -> None:
        self.kubeconfig = Path(kubeconfig).expanduser().resolve() if kubeconfig else DEFAULT_KUBECONFIG
        self.binaries = binaries or Binaries.resolve()
        self.kubectl_path = self.binaries.kubectl
        self._given_work_dir = Path(work_dir).expanduser().resolve() if work_dir else None
        self.work_dir = self._given_work_dir or Path("/nonexistent")
        self.keep_work_dir = keep_work_dir or bool(os.environ.get("WEIGHTSYNC_KEEP_CLUSTER_DIR"))
        self.ready_timeout = ready_timeout
        self.requested_apiserver_port = apiserver_port
        self.extra_apiserver_args = list(extra_apiserver_args)
        self.extra_controller_manager_args = list(extra_controller_manager_args)
        self.die_with_parent = die_with_parent
        self.server = ""
        self.ports: dict[str, int] = {}
        self.procs: dict[str, Proc] = {}
        self.pki: Pki | None = None
        self.start_seconds: float | None = None
        self.phase_seconds: dict[str, float] = {}
        self.stopped_pids: dict[str, int] = {}  # every component pid this object stopped (for checks)
        self._started = False

    # --- public surface ---------------------------------------------------------------------------
    @property
    def log_dir(self) -> Path:
        return self.work_dir / "logs"

    @property
    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs.items() if p.pid is not None}

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self, attempts: int = 3) -> LocalCluster:
        """Start every component and wait until the cluster is usable (see `_wait_ready`)."""
        if self._started:
            return self
        for attempt in range(1, attempts + 1):
            try:
                self._start_once()
                return self
            except ComponentExited as exc:
                self._stop_procs()
                # Another process took a port we picked between choosing and binding it: pick again.
                if exc.port_conflict and self.requested_apiserver_port is None and attempt < attempts:
                    log.warning("port race component=%s attempt=%s; retrying with new ports", exc.name, attempt)
                    continue
                raise
            except BaseException:
                self._stop_procs()
                raise
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Stop every component (SIGTERM, grace, SIGKILL) and remove the work dir unless kept."""
        self._stop_procs()
        if self._started and not self.keep_work_dir and self._given_work_dir is None:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        self._started = False

    # --- internals --------------------------------------------------------------------------------
    def _stop_procs(self) -> None:
        self.stopped_pids.update(self.pids)
        order = ["kube-scheduler", "kube-controller-manager", "kube-apiserver"]
        stop_all([self.procs[n] for n in order if n in self.procs])
        if "etcd" in self.procs:
            stop_all([self.procs["etcd"]])
        self.procs = {}

    def _prepare_dirs(self) -> None:
        if self._given_work_dir is None:
            if self.work_dir == Path("/nonexistent"):
                self.work_dir = Path(tempfile.mkdtemp(prefix="weightsync-cluster-"))
        else:
            for sub in ("pki", "etcd", "logs", "run"):
                shutil.rmtree(self.work_dir / sub, ignore_errors=True)
        for sub in ("pki", "etcd", "logs", "run"):
            (self.work_dir / sub).mkdir(mode=0o700, parents=True, exist_ok=True)

    def _pick_ports(self) -> None:
        api = self.requested_apiserver_port
        if api is not None and api in listening_ports():
            raise ClusterError(f"port {api} on 127.0.0.1 is already in use; stop what listens there "
                               f"(`ss -ltnp 'sport = :{api}'`) or choose another apiserver_port")
        names = ("etcd-client", "etcd-peer", "kube-controller-manager", "kube-scheduler")
        self.ports = {name: free_port() for name in names}
        self.ports["kube-apiserver"] = api if api is not None else free_port()

    def _start_once(self) -> None:
        t0 = time.monotonic()
        self._prepare_dirs()
        self._pick_ports()
        self.pki = pki = generate_pki(self.work_dir / "pki", SERVICE_IP)
        self.phase_seconds = {"pki": time.monotonic() - t0}
        self.server = f"https://127.0.0.1:{self.ports['kube-apiserver']}"
        self._write_kubeconfigs(pki)
        self._started = True

        self._spawn("etcd", self._etcd_args())
        etcd_url = f"http://127.0.0.1:{self.ports['etcd-client']}/health"
        _poll("etcd /health", lambda: b'"health":"true"' in urllib.request.urlopen(etcd_url, timeout=2).read(),
              self.ready_timeout, 0.05, self._check_alive)
        self.phase_seconds["etcd"] = time.monotonic() - t0

        self._spawn("kube-apiserver", self._apiserver_args(pki))
        self._spawn("kube-controller-manager", self._controller_manager_args(pki))
        self._spawn("kube-scheduler", self._scheduler_args())

        admin_ctx = ssl.create_default_context(cafile=str(pki.ca.cert))
        admin_ctx.load_cert_chain(str(pki.admin.cert), str(pki.admin.key))
        _poll("kube-apiserver /readyz", lambda: _https_ok(f"{self.server}/readyz", admin_ctx),
              self.ready_timeout, 0.1, self._check_alive)
        self.phase_seconds["apiserver"] = time.monotonic() - t0

        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE
        for name in ("kube-controller-manager", "kube-scheduler"):
            url = f"https://127.0.0.1:{self.ports[name]}/healthz"
            _poll(f"{name} /healthz", functools.partial(_https_ok, url, insecure), self.ready_timeout, 0.1,
                  self._check_alive)
        self.phase_seconds["components"] = time.monotonic() - t0
        self._wait_ready()
        self.start_seconds = time.monotonic() - t0
        self.phase_seconds["ready"] = self.start_seconds
        log.info("cluster ready server=%s kubeconfig=%s start_seconds=%.2f phases=%s work_dir=%s",
                 self.server, self.kubeconfig, self.start_seconds,
                 {k: round(v, 2) for k, v in self.phase_seconds.items()}, self.work_dir)

    def _wait_ready(self) -> None:
        """Usable means: pods can be created in `default` (its ServiceAccount exists, so the ServiceAccount
        admission plugin admits them) and projected tokens can mount the root CA ConfigMap."""
        with self.api_client() as api:
            core = kubernetes.client.CoreV1Api(api)
            _poll("namespace default", lambda: core.read_namespace("default") is not None,
                  self.ready_timeout, 0.1, self._check_alive)
            _poll("serviceaccount default/default",
                  lambda: core.read_namespaced_service_account("default", "default") is not None,
                  self.ready_timeout, 0.1, self._check_alive)
            _poll("configmap default/kube-root-ca.crt",
                  lambda: core.read_namespaced_config_map("kube-root-ca.crt", "default") is not None,
                  self.ready_timeout, 0.1, self._check_alive)

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if not proc.alive():
                rc = proc.popen.returncode if proc.popen else None
                raise ComponentExited(name, rc, proc.log_path, proc.tail())

    def _spawn(self, name: str, args: list[str]) -> None:
        binary = {"etcd": self.binaries.etcd, "kube-apiserver": self.binaries.kube_apiserver,
                  "kube-controller-manager": self.binaries.kube_controller_manager,
                  "kube-scheduler": self.binaries.kube_scheduler}[name]
        env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "HTTPS_PROXY", "HTTP_PROXY",
                                                                "https_proxy", "http_proxy")}
        proc = Proc(name, [str(binary), *args], self.log_dir / f"{name}.log", env=env,
                    die_with_parent=self.die_with_parent)
        self.procs[name] = proc.start()

    def _write_kubeconfigs(self, pki: Pki) -> None:
        run = self.work_dir / "run"
        (run / "controller-manager.kubeconfig").write_text(
            render_kubeconfig(self.server, pki.ca.cert, pki.controller_manager, user="system:kube-controller-manager"))
        (run / "scheduler.kubeconfig").write_text(
            render_kubeconfig(self.server, pki.ca.cert, pki.scheduler, user="system:kube-scheduler"))
        (run / "scheduler.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": str(run / "scheduler.kubeconfig"), "qps": 200, "burst": 400},
            "leaderElection": {"leaderElect": False},
        }))
        self.kubeconfig.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.kubeconfig.with_name(self.kubeconfig.name + ".tmp")
        tmp.write_text(render_kubeconfig(self.server, pki.ca.cert, pki.admin))
        tmp.chmod(0o600)
        tmp.replace(self.kubeconfig)

    def _etcd_args(self) -> list[str]:
        client = f"http://127.0.0.1:{self.ports['etcd-client']}"
        peer = f"http://127.0.0.1:{self.ports['etcd-peer']}"
        return [
            "--name=weightsync", f"--data-dir={self.work_dir / 'etcd'}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=weightsync={peer}", "--unsafe-no-fsync=true",
            "--log-level=warn", "--quota-backend-bytes=4294967296",
            # One member on loopback: elect itself in ~0.1 s instead of the default ~1 s.
            "--heartbeat-interval=20", "--election-timeout=200",
        ]

    def _apiserver_args(self, pki: Pki) -> list[str]:
        return [
            f"--etcd-servers=http://127.0.0.1:{self.ports['etcd-client']}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={self.ports['kube-apiserver']}",
            f"--cert-dir={pki.dir}",
            f"--tls-cert-file={pki.apiserver.cert}", f"--tls-private-key-file={pki.apiserver.key}",
            f"--client-ca-file={pki.ca.cert}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",  # on top of the defaults (ServiceAccount, ...)
            f"--service-account-issuer={SA_ISSUER}",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            "--profiling=false",
            "--enable-priority-and-fairness=false",  # fewer startup objects; APF adds nothing on one machine
            "--event-ttl=1h",
            # The `kubernetes` Endpoints may not hold a loopback address; in-pod clients of the process
            # runtime use KUBERNETES_SERVICE_HOST=127.0.0.1 directly, so skip the reconciler (and its errors).
            "--endpoint-reconciler-type=none",
            # Without it, open watch streams (e.g. the process runtime's) hold graceful shutdown until
            # they time out; with it they are ended after 2 s, so stop() never needs SIGKILL.
            "--shutdown-watch-termination-grace-period=2s",
            *self.extra_apiserver_args,
        ]

    def _controller_manager_args(self, pki: Pki) -> list[str]:
        run = self.work_dir / "run"
        return [
            f"--kubeconfig={run / 'controller-manager.kubeconfig'}",
            "--bind-address=127.0.0.1", f"--secure-port={self.ports['kube-controller-manager']}",
            f"--cert-dir={run / 'controller-manager-certs'}",
            "--controllers=*",  # includes garbagecollector, namespace, serviceaccount(-token), root-ca-cert-publisher
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki.sa_key}",
            f"--root-ca-file={pki.ca.cert}",
            f"--cluster-signing-cert-file={pki.ca.cert}", f"--cluster-signing-key-file={pki.ca.key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--leader-elect=false", "--profiling=false",
            "--kube-api-qps=200", "--kube-api-burst=400",
            *self.extra_controller_manager_args,
        ]

    def _scheduler_args(self) -> list[str]:
        run = self.work_dir / "run"
        return [
            f"--config={run / 'scheduler.yaml'}",
            "--bind-address=127.0.0.1", f"--secure-port={self.ports['kube-scheduler']}",
            f"--cert-dir={run / 'scheduler-certs'}", "--profiling=false",
        ]

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary (for state files and logs)."""
        return {
            "server": self.server, "kubeconfig": str(self.kubeconfig), "work_dir": str(self.work_dir),
            "log_dir": str(self.log_dir), "pids": self.pids, "ports": self.ports,
            "binaries": self.binaries.as_dict(), "start_seconds": self.start_seconds,
        }


def bench(runs: int = 3) -> dict[str, Any]:
    """Start and stop a LocalCluster RUNS times; the timings as a JSON-able dict."""
    starts, stops, phases = [], [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="weightsync-bench-") as tmp:
            cluster = LocalCluster(kubeconfig=Path(tmp) / "kubeconfig").start()
            starts.append(round(cluster.start_seconds or 0.0, 2))
            phases.append({k: round(v, 2) for k, v in cluster.phase_seconds.items()})
            t0 = time.monotonic()
            cluster.stop()
            stops.append(round(time.monotonic() - t0, 2))
    return {"benchmark": "local-control-plane-start", "runs": runs, "start_to_ready_s": starts,
            "stop_s": stops, "phases_s": phases, "cpus": os.cpu_count(),
            "binaries": Binaries.resolve().as_dict()}


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m weightsync.e2e.cluster [--runs N]`: print start/stop timings as JSON (see bench/)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    print(json.dumps(bench(args.runs), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
