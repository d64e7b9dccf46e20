"""The closed-loop demo's pieces on a local control plane: the operator as a process, the examples, the job
and pod readers, the progress table, the bit-exact check and the demo runs (`run_demo`, `run_vllm_demo`).

`make demo` (e2e/demo_cli.py) narrates them through the helm chart; the e2e suite (e2e/tests/), e2e/chart.py,
e2e/rl_demo.py and bench/status_latency.py use them too. The command line lives in its own module so that
this one imports neither the chart nor the RL demo, which both import it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import kubernetes
import yaml
from kubernetes.client.exceptions import ApiException

from weightsync.crds import contract
from weightsync.crds.desired import overlay
from weightsync.e2e.environment import Environment, start_environment
from weightsync.e2e.procs import free_port

log = logging.getLogger("weightsync.e2e.demo")

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
CRD_FILE = REPO / "crds" / f"{contract.GROUP}_{contract.PLURAL}.yaml"
OPERATOR_BIN = Path(sys.executable).parent / "weightsync-operator"
DEMO_EXAMPLES = {"separated": "demo-separated.yaml", "colocated": "demo-colocated.yaml", "sglang": "demo-sglang.yaml",
                 "vllm": "demo-vllm.yaml", "rl": "rl-loop-vllm.yaml"}
BOTH = ("separated", "colocated", "sglang")  # --example both: every demo job but vLLM's (2 vLLM servers: ~5 GiB)
#: The trainers of the demo examples and the number of versions each publishes without --versions.
TRAINER_MODULES = {"weightsync.agent.demo.trainer": 5, "weightsync.agent.demo.llama_trainer": 3}
RL_TIMEOUT = 900.0    # --example rl: two vLLM servers start (30-60 s each on 2 cores), then 20 steps
TRAINER_PORT = 8000   # --port of the demo trainer in the examples
ENGINE_PORT = 8001    # --port of the demo engine in the examples
JSON = dict[str, Any]
T = TypeVar("T")


class DemoError(RuntimeError):
    """The demo did not reach its goal; the message says what was seen and where the logs are."""


# --- polling ----------------------------------------------------------------------------------------------
def poll(predicate: Callable[[], T | None], timeout: float, what: str, interval: float = 0.25,
         on_timeout: Callable[[], str] | None = None) -> T:
    """PREDICATE's first truthy value; DemoError after TIMEOUT seconds (API errors are retried)."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except (ApiException, OSError, ValueError, KeyError) as exc:
            last = exc
        if time.monotonic() > deadline:
            detail = f" (last error: {last})" if last else ""
            extra = f"\n{on_timeout()}" if on_timeout else ""
            raise DemoError(f"timed out after {timeout:.0f}s waiting for {what}{detail}{extra}")
        time.sleep(interval)


# --- the operator as a process ------------------------------------------------------------------------------
@dataclass
class OperatorProcess:
    """The real operator (`weightsync-operator --namespace NS`) as a child process with its own log file."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    namespace: str | None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL, as a crashed or evicted operator: no cleanup handlers run."""
        if self.alive():
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        return self.proc.returncode


def operator_key_file(kubeconfig: Path) -> Path:
    """One operator key per cluster, next to its kubeconfig (as the chart keeps one Secret per release): an
    operator restarted by a test keeps checking the version proofs of the jobs it already runs."""
    path = kubeconfig.parent / "weightsync-operator-key"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        os.replace(tmp, path)
    return path


def start_operator(kubeconfig: Path, namespace: str | None, log_dir: Path, *, resync_seconds: float = 5.0,
                   agent_image: str = "ghcr.io/weightsync/weightsync-agent:0.1.0",
                   report_address: str | None = "127.0.0.1") -> OperatorProcess:
    """Start the operator for NAMESPACE (None: all namespaces); metrics and health ports off (parallel runs).
    The agents push their reports to REPORT_ADDRESS on a free port (the process runtime's pods share the
    host's network; None: the listener is off, agents write their pods only)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"operator-{namespace or 'all'}-{time.strftime('%H%M%S')}-{os.getpid()}-{time.monotonic_ns() % 10**6}.log"
    scope = ["--namespace", namespace] if namespace else ["--all-namespaces"]
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "WEIGHTSYNC_AGENT_IMAGE": agent_image,
           "WEIGHTSYNC_RESYNC_SECONDS": str(resync_seconds), "PYTHONUNBUFFERED": "1",
           "WEIGHTSYNC_OPERATOR_KEY_FILE": str(operator_key_file(kubeconfig))}
    if not OPERATOR_BIN.exists():
        raise DemoError(f"{OPERATOR_BIN} not found: install the repository into the venv "
                        "(`make setup` or `.venv/bin/pip install -e '.[agent,gdr,dev]'`)")
    with log_path.open("wb") as out:
        report = ["--report-address", report_address, "--report-port", str(free_port())] if report_address else [
            "--report-port", "0"]
        proc = subprocess.Popen([str(OPERATOR_BIN), *scope, "--metrics-port", "0", "--health-port", "0", "--verbose",
                                 *report],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
    log.info("operator started pid=%s namespace=%s log=%s", proc.pid, namespace or "*", log_path)
    return OperatorProcess(proc, log_path, namespace)


# --- CRD and examples ---------------------------------------------------------------------------------------
def install_crd(env: Environment) -> None:
    """Apply the generated CRD (server-side, idempotent) and wait until it is served."""
    env.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=weightsync-e2e", "-f", str(CRD_FILE))
    wait_established(env.kubectl, contract.CRD_NAME)


def wait_established(kubectl: Callable[..., Any], crd: str, timeout: float = 60.0) -> None:
    """Until the CRD is Established. (Not `kubectl wait`: it fails at once while a new CRD has no conditions
    yet, which takes a moment for a CRD with the full pod template schema.)"""
    path = '{.status.conditions[?(@.type=="Established")].status}'
    poll(lambda: kubectl("get", f"crd/{crd}", "-o", f"jsonpath={path}", check=False).stdout.strip() == "True" or None,
         timeout, f"CRD {crd} Established")


def load_example(name: str, *, process_nodes: bool = True, name_override: str | None = None) -> JSON:
    """An example manifest as a dict. Without process nodes (kind: real kubelets run the images) the
    process-node selector is dropped, so the pods can land on any node."""
    path = EXAMPLES / DEMO_EXAMPLES.get(name, name)
    body: JSON = yaml.safe_load(path.read_text())
    if name_override:
        body["metadata"]["name"] = name_override
    if not process_nodes:
        for role in ("trainer", "inference"):
            spec = body["spec"][role]["template"]["spec"]
            sel = spec.get("nodeSelector") or {}
            sel.pop(contract.LABEL_PROCESS_NODE, None)
            if not sel:
                spec.pop("nodeSelector", None)
    return body


def trainer_versions(body: Mapping[str, Any]) -> int:
    """The last version the demo trainer of BODY publishes (its --versions argument, default 5; the tiny-Llama
    trainer's default is 3)."""
    for c in body["spec"]["trainer"]["template"]["spec"]["containers"]:
        argv = [str(a) for a in (c.get("command") or []) + (c.get("args") or [])]
        for module, default in TRAINER_MODULES.items():
            if module in argv:
                return int(argv[argv.index("--versions") + 1]) if "--versions" in argv else default
    raise DemoError(f"the trainer template runs none of {', '.join(TRAINER_MODULES)}")


def set_trainer_args(body: JSON, **flags: Any) -> JSON:
    """Replace (or add) `--flag value` arguments of the demo trainer's command (e.g. versions=3)."""
    for c in body["spec"]["trainer"]["template"]["spec"]["containers"]:
        argv = [str(a) for a in c.get("command") or []]
        if not any(module in argv for module in (*TRAINER_MODULES, "weightsync.agent.demo.rl_trainer")):
            continue
        for key, value in flags.items():
            flag = "--" + key.replace("_", "-")
            if flag in argv:
                argv[argv.index(flag) + 1] = str(value)
            else:
                argv += [flag, str(value)]
        c["command"] = argv
    return body


WRONG_ENGINE_PORT = 8999  # nothing listens there: the demo engines listen on 8001


def wrong_port_job(name: str, *, process_nodes: bool = True) -> JSON:
    """The SGLang demo job, one replica, whose engine.port / url point where no engine listens
    (Degraded reason EngineUnreachable)."""
    body = load_example("demo-sglang.yaml", process_nodes=process_nodes, name_override=name)
    body["spec"]["inference"]["replicas"] = 1
    body["spec"]["inference"]["engine"] = {"type": "SGLang", "port": WRONG_ENGINE_PORT,
                                           "url": f"http://$(WEIGHTSYNC_POD_IP):{WRONG_ENGINE_PORT}"}
    return body


def crash_loop_job(name: str, *, process_nodes: bool = True) -> JSON:
    """The separated demo job, one replica, whose engine exits with code 3 two seconds after each start
    (Degraded reason CrashLoopBackOff)."""
    body = load_example("separated", process_nodes=process_nodes, name_override=name)
    body["spec"]["inference"]["replicas"] = 1
    engine = body["spec"]["inference"]["template"]["spec"]["containers"][0]
    engine["command"] = ["python", "-c", "import sys, time; time.sleep(2); sys.exit(3)"]
    return body


def finishing_job(name: str, versions: int = 3, *, process_nodes: bool = True) -> JSON:
    """The separated demo job, one replica, whose trainer (restartPolicy OnFailure) publishes VERSIONS and
    exits 0 (condition Complete)."""
    body = load_example("separated", process_nodes=process_nodes, name_override=name)
    body["spec"]["inference"]["replicas"] = 1
    set_trainer_args(body, versions=versions, interval=1.0)
    trainer = body["spec"]["trainer"]["template"]["spec"]
    trainer["restartPolicy"] = "OnFailure"
    trainer["containers"][0]["command"] = [*trainer["containers"][0]["command"], "--exit"]
    return body


def set_demo_env(body: JSON, **env: str) -> JSON:
    """Add env to every demo container (e.g. WEIGHTSYNC_DEMO_HIDDEN for a bigger model)."""
    for role in ("trainer", "inference"):
        for c in body["spec"][role]["template"]["spec"]["containers"]:
            c["env"] = [e for e in c.get("env") or [] if e["name"] not in env] + [
                {"name": k, "value": v} for k, v in env.items()]
    return body


def apply(env: Environment, body: Mapping[str, Any], namespace: str) -> None:
    env.kubectl("apply", "--server-side", "--field-manager=weightsync-e2e", "-n", namespace, "-f", "-",
                input=yaml.safe_dump(dict(body)))


# --- reading the job and its pods ---------------------------------------------------------------------------
def get_job(custom: kubernetes.client.CustomObjectsApi, namespace: str, name: str) -> JSON:
    job: Any = custom.get_namespaced_custom_object(contract.GROUP, contract.VERSION, namespace, contract.PLURAL, name)
    return dict(job)


def patch_job(custom: kubernetes.client.CustomObjectsApi, namespace: str, name: str, spec: JSON) -> None:
    custom.patch_namespaced_custom_object(contract.GROUP, contract.VERSION, namespace, contract.PLURAL, name,
                                          {"spec": spec})


def condition(job: Mapping[str, Any], type_: str) -> JSON:
    return next((c for c in (job.get("status") or {}).get("conditions") or [] if c.get("type") == type_), {})


def job_pods(api: kubernetes.client.ApiClient, namespace: str, job: str) -> dict[str, JSON]:
    """The job's live pods as plain JSON (not the typed models: annotations and conditions stay raw), with
    what the operator asks of each (its entry in the job's desired-state ConfigMap: target version, pause,
    Atomic commit) shown as the annotations it replaced, as the operator's own rollout logic sees them."""
    core = kubernetes.client.CoreV1Api(api)
    resp: Any = core.list_namespaced_pod(namespace, label_selector=f"{contract.LABEL_JOB}={job}",
                                    _preload_content=False)
    items = json.loads(resp.data)["items"]
    pods = {p["metadata"]["name"]: p for p in items if not p["metadata"].get("deletionTimestamp")}
    try:
        raw: Any = core.read_namespaced_config_map(contract.desired_configmap_name(job), namespace,
                                                   _preload_content=False)
        cm: Any = json.loads(raw.data)
    except ApiException as exc:
        if exc.status != 404:
            raise
        cm = None
    return overlay(pods, cm)


def pod_condition(pod: Mapping[str, Any], type_: str) -> str | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return str(c.get("status"))
    return None


def annotation(pod: Mapping[str, Any], key: str) -> str | None:
    value = ((pod.get("metadata") or {}).get("annotations") or {}).get(key)
    return None if value is None else str(value)


def is_inference_pod(pod: Mapping[str, Any]) -> bool:
    role = ((pod.get("metadata") or {}).get("labels") or {}).get(contract.LABEL_ROLE)
    return role in (contract.ROLE_INFERENCE, contract.ROLE_COLOCATED)


def is_trainer_pod(pod: Mapping[str, Any]) -> bool:
    role = ((pod.get("metadata") or {}).get("labels") or {}).get(contract.LABEL_ROLE)
    return role in (contract.ROLE_TRAINER, contract.ROLE_COLOCATED)


def container_pid(pod: Mapping[str, Any], container: str) -> int | None:
    """The host pid (= process group) of a running container (process runtime: containerID `process://PID`)."""
    st = pod.get("status") or {}
    for s in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
        if s.get("name") == container and "running" in (s.get("state") or {}):
            cid = str(s.get("containerID") or "")
            if cid.startswith("process://"):
                return int(cid.removeprefix("process://"))
    return None


def agent_pid(pod: Mapping[str, Any]) -> int | None:
    """The host pid of the pod's agent sidecar."""
    return container_pid(pod, contract.AGENT_CONTAINER)


def agent_restarts(pod: Mapping[str, Any]) -> int:
    for s in (pod.get("status") or {}).get("initContainerStatuses") or []:
        if s.get("name") == contract.AGENT_CONTAINER:
            return int(s.get("restartCount") or 0)
    return 0


def status_line(job: Mapping[str, Any]) -> str:
    """One key=value line: versions, replica counts and the conditions (for progress logs)."""
    st = job.get("status") or {}
    reps = st.get("replicas") or {}
    conds = " ".join(f"{c['type']}={c['status']}" + (f"({c.get('reason')})" if c["status"] != "False" else "")
                     for c in st.get("conditions") or [])
    return (f"trainerVersion={st.get('trainerVersion')} servedVersion={st.get('servedVersion')} "
            f"synced={reps.get('synced', 0)}/{reps.get('inference', 0)} ready={reps.get('ready', 0)} {conds}")


# --- the demo containers' HTTP endpoints ----------------------------------------------------------------------
def http_json(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return int(e.code), json.loads(e.read())
        except ValueError:
            return int(e.code), None


def pod_ip(pod: Mapping[str, Any]) -> str:
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        raise DemoError(f"pod {pod['metadata']['name']} has no IP yet")
    return str(ip)


# Pod HTTP goes straight to the pod IP (process runtime: pods are 127.x.y.z on this host). On a cluster whose
# pod IPs are not reachable from here (kind), set POD_PROXY to an ApiClient: requests then go through the
# API server's pod proxy (`/api/v1/namespaces/NS/pods/NAME:PORT/proxy/PATH`).
POD_PROXY: kubernetes.client.ApiClient | None = None


def pod_get(pod: Mapping[str, Any], port: int, path: str, timeout: float = 5.0) -> tuple[int, Any]:
    """GET PATH on PORT of POD: (HTTP status, JSON body or None)."""
    if POD_PROXY is None:
        return http_json(f"http://{pod_ip(pod)}:{port}{path}", timeout)
    meta = pod["metadata"]
    url = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}:{port}/proxy{path}"
    try:
        resp = POD_PROXY.call_api(*POD_PROXY.param_serialize("GET", url, auth_settings=["BearerToken"]),
                                  _request_timeout=timeout)
        resp.read()
    except ApiException as exc:
        return int(exc.status or 0), None
    try:
        return int(resp.status), json.loads(resp.data or b"null")
    except ValueError:
        return int(resp.status), None


def trainer_get(pod: Mapping[str, Any], path: str) -> tuple[int, Any]:
    return pod_get(pod, TRAINER_PORT, path)


def engine_get(pod: Mapping[str, Any], path: str) -> tuple[int, Any]:
    return pod_get(pod, ENGINE_PORT, path)


def engine_state(pod: Mapping[str, Any]) -> JSON:
    """The demo engine's {version, paused, loads, aborts}."""
    code, body = engine_get(pod, "/version")
    if code != 200:
        raise DemoError(f"engine of {pod['metadata']['name']}: /version answered {code}")
    return dict(body)


def engine_events(pod: Mapping[str, Any]) -> list[tuple[str, int | None]]:
    _, body = engine_get(pod, "/events")
    return [(str(e), v) for e, v in (body or {}).get("events", [])]


@dataclass
class BitExactReport:
    version: int
    tensors: int
    engines: dict[str, int | None] = field(default_factory=dict)   # pod -> version served
    mismatches: dict[str, list[str]] = field(default_factory=dict)  # pod -> tensors that differ

    @property
    def ok(self) -> bool:
        return not self.mismatches and all(v == self.version for v in self.engines.values())


def verify_bit_exact(pods: Mapping[str, Mapping[str, Any]], version: int) -> BitExactReport:
    """Compare every engine's sha256 per tensor with the trainer's for VERSION."""
    trainer = next((p for p in pods.values() if is_trainer_pod(p)), None)
    if trainer is None:
        raise DemoError("no trainer pod found")
    code, body = trainer_get(trainer, f"/checksums?version={version}")
    if code != 200 or not body or not body.get("checksums"):
        raise DemoError(f"the demo trainer has no checksums for version {version} (HTTP {code})")
    want: dict[str, str] = body["checksums"]
    report = BitExactReport(version=version, tensors=len(want))
    for name, pod in sorted(pods.items()):
        if not is_inference_pod(pod):
            continue
        code, got = engine_get(pod, "/checksums")
        if code != 200:
            raise DemoError(f"engine of {name}: /checksums answered {code}")
        report.engines[name] = got.get("version")
        sums: dict[str, str] = got.get("checksums") or {}
        diff = sorted(k for k in set(want) | set(sums) if want.get(k) != sums.get(k))
        if diff:
            report.mismatches[name] = diff
    return report


# --- the live progress table ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProgressRow:
    """What one line of the demo's progress table shows (all but the time): the job's status columns as
    `kubectl get wsj` prints them and the version each inference pod serves (its served-version annotation,
    written by its agent)."""

    trainer: str
    served: str
    synced: str
    ready: str
    pods: str                             # Ready pods / live pods of the job (trainer and inference)
    engines: tuple[tuple[str, str], ...]  # (inference pod without the job-name prefix, version), by name
    state: str                            # reasons of the True Progressing / Degraded / Paused conditions


def _cell(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def progress_row(job: Mapping[str, Any], pods: Mapping[str, Mapping[str, Any]]) -> ProgressRow:
    """The table row of JOB and its PODS (job_pods): pure, no API calls."""
    st = job.get("status") or {}
    prefix = f"{(job.get('metadata') or {}).get('name', '')}-"
    # The job's status first: it takes the agents' reports as they are pushed, their pods follow later.
    by_status = {str(pod): r.get("servedVersion") for r in st.get("inferenceReplicas") or []
                 for pod in r.get("pods") or []}
    engines = tuple(sorted((n.removeprefix(prefix), _cell(by_status.get(n, annotation(p, contract.ANN_SERVED_VERSION))))
                           for n, p in pods.items() if is_inference_pod(p)))
    state = ",".join(str(c.get("reason") or c["type"]) for c in st.get("conditions") or []
                     if c.get("type") in (contract.COND_PROGRESSING, contract.COND_DEGRADED, contract.COND_PAUSED)
                     and c.get("status") == "True")
    ready_pods = sum(1 for p in pods.values() if pod_condition(p, "Ready") == "True")
    return ProgressRow(trainer=_cell(st.get("trainerVersion")), served=_cell(st.get("servedVersion")),
                       synced=_cell(condition(job, contract.COND_SYNCED).get("status")),
                       ready=_cell(condition(job, contract.COND_READY).get("status")),
                       pods=f"{ready_pods}/{len(pods)}", engines=engines, state=state)


_FIXED = (("TIME", 7), ("TRAINER", 7), ("SERVED", 6), ("SYNCED", 7), ("READY", 7), ("PODS", 5))


def _line(cells: list[str], engine_names: tuple[str, ...], state: str) -> str:
    widths = [w for _, w in _FIXED] + [max(len(n), 2) for n in engine_names]
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + ("  " + state if state else "")


def progress_header(engine_names: tuple[str, ...]) -> str:
    """TIME TRAINER SERVED SYNCED READY PODS <one column per inference pod: its served version> STATE."""
    return _line([h for h, _ in _FIXED] + list(engine_names), engine_names, "STATE").rstrip()


def progress_line(elapsed: float, row: ProgressRow) -> str:
    names = tuple(n for n, _ in row.engines)
    cells = [f"{elapsed:.1f}s", row.trainer, row.served, row.synced, row.ready, row.pods] + [v for _, v in row.engines]
    return _line(cells, names, row.state).rstrip()


class ProgressTable:
    """Successive observations of a job -> the lines to print: the header first (and again whenever the set
    of inference pods changes), then one line each time something shown changes; nothing while the job has
    neither status nor pods. Plain lines, no cursor movement: reads the same on a terminal and in a CI log."""

    def __init__(self) -> None:
        self.last: ProgressRow | None = None
        self.columns: tuple[str, ...] | None = None

    def update(self, elapsed: float, job: Mapping[str, Any], pods: Mapping[str, Mapping[str, Any]]) -> list[str]:
        if not job.get("status") and not pods:
            return []
        row = progress_row(job, pods)
        if row == self.last:
            return []
        lines = []
        names = tuple(n for n, _ in row.engines)
        if names != self.columns:
            lines.append(progress_header(names))
            self.columns = names
        lines.append(progress_line(elapsed, row))
        self.last = row
        return lines


def replica_lines(job: Mapping[str, Any]) -> list[str]:
    """status.inferenceReplicas as a table (index, pods, served / target version, ready, the load under way,
    last sync seconds, last error): what `kubectl get wsj NAME -o yaml` holds per replica, one line each."""
    rows = [["INDEX", "PODS", "SERVED", "TARGET", "READY", "PROGRESS", "LAST-SYNC", "LAST-ERROR"]]
    for r in (job.get("status") or {}).get("inferenceReplicas") or []:
        prog = r.get("progress") or {}
        progress = (f"v{prog['version']} bucket {prog['bucket']}/{prog['buckets']} "
                    f"{prog['bytes']}/{prog['totalBytes']}B" if prog else "-")
        last = r.get("lastSyncSeconds")
        rows.append([str(r.get("index")), ",".join(r.get("pods") or []) or "-", _cell(r.get("servedVersion")),
                     _cell(r.get("targetVersion")), str(bool(r.get("ready"))), progress,
                     "-" if last is None else f"{float(last):.3f}s", _cell(r.get("lastError"))])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]


# --- following a job -------------------------------------------------------------------------------------------
def wait_served(custom: kubernetes.client.CustomObjectsApi, namespace: str, name: str, version: int,
                timeout: float, on_change: Callable[[JSON], None] | None = None,
                diagnose: Callable[[], str] | None = None) -> JSON:
    """Poll the job until status.servedVersion >= VERSION and Synced=True; ON_CHANGE gets each new status."""
    last: list[str] = [""]

    def check() -> JSON | None:
        job = get_job(custom, namespace, name)
        line = status_line(job)
        if line != last[0]:
            last[0] = line
            if on_change is not None:
                on_change(job)
        st = job.get("status") or {}
        served = st.get("servedVersion")
        if served is not None and served >= version and condition(job, contract.COND_SYNCED).get("status") == "True":
            return job
        return None

    return poll(check, timeout, f"{namespace}/{name} status.servedVersion >= {version} and Synced=True",
                on_timeout=lambda: f"last status: {last[0]}" + (f"\n{diagnose()}" if diagnose else ""))


def log_tails(env: Environment, namespace: str, pods: Mapping[str, Mapping[str, Any]], lines: int = 15) -> str:
    """The last lines of every container log of PODS (process runtime only), for failure messages."""
    if env.runtime is None:
        return ""
    out = []
    for name, pod in sorted(pods.items()):
        spec = pod.get("spec") or {}
        for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
            path = env.runtime.log_path(namespace, name, c["name"])
            text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else ["(no log)"]
            out.append(f"--- {name}/{c['name']} ({path}) ---\n" + "\n".join(text))
    return "\n".join(out)


# --- the demo itself -------------------------------------------------------------------------------------------
def private_pod_cidr() -> str:
    """A random 127.X.0.0/16 for this runtime's pod IPs. The runtime's default CIDR is the same for every
    session on the machine, so two sessions would hand out the same pod IPs and agent ports would clash."""
    return f"127.{secrets.choice(range(101, 250))}.0.0/16"


def start_private_runtime(env: Environment, state_dir: Path) -> Any:
    """Start the process runtime for ENV's process nodes on a private pod CIDR (see private_pod_cidr)."""
    if env.runtime is not None:
        return env.runtime
    from weightsync.e2e.runtime import ProcessRuntime
    from weightsync.e2e.runtime.images import images_for_tests

    state_dir.mkdir(parents=True, exist_ok=True)
    runtime = ProcessRuntime(str(env.kubeconfig), env.process_node_names, state_dir, pod_cidr=private_pod_cidr(),
                             images=images_for_tests())
    runtime.start()
    env.runtime = runtime
    env.runtime_state_dir = state_dir
    return runtime


@contextlib.contextmanager
def demo_environment(work_dir: Path, nodes: int = 2) -> Iterator[Environment]:
    """A local control plane + NODES simulated process nodes + the process runtime, stopped afterwards."""
    env = start_environment(kubeconfig=work_dir / "kubeconfig", node_count=nodes, process_nodes=True)
    try:
        start_private_runtime(env, work_dir / "runtime")
        yield env
    finally:
        env.stop()


def ensure_namespace(env: Environment, namespace: str) -> None:
    """Create NAMESPACE (if missing) and wait for its default ServiceAccount (pods are admitted then)."""
    with env.api_client() as api:
        core = kubernetes.client.CoreV1Api(api)
        with contextlib.suppress(ApiException):
            core.create_namespace({"metadata": {"name": namespace}})  # type: ignore[arg-type]
        poll(lambda: core.read_namespaced_service_account("default", namespace), 60,
             f"serviceaccount {namespace}/default")


def print_served(env: Environment, custom: Any, namespace: str, name: str, last: int, took: float,
                 out: Callable[[str], None]) -> None:
    """What every demo prints once the job serves its last version: wsj, the replicas, the pods."""
    out(f"[demo] status.servedVersion reached {last} after {took:.1f}s")
    out(f"[demo] $ kubectl get wsj -o wide\n{env.kubectl('get', 'wsj', '-o', 'wide', '-n', namespace).stdout.rstrip()}")
    final = get_job(custom, namespace, name)
    out(f"[demo] status.inferenceReplicas (`kubectl get wsj {name} -o jsonpath='{{.status.inferenceReplicas}}'`):\n"
        + "\n".join(replica_lines(final)))
    out(f"[demo] $ kubectl get pods -o wide\n{env.kubectl('get', 'pods', '-o', 'wide', '-n', namespace).stdout.rstrip()}")


def run_demo(env: Environment, example: str, namespace: str, timeout: float, out: Callable[[str], None] = print,
             operator_log: Callable[[], str] | None = None, body: JSON | None = None) -> BitExactReport:
    """Apply EXAMPLE (or BODY, e.g. load_example + set_trainer_args) in NAMESPACE (an operator must serve it),
    print the progress table until status.servedVersion reaches the trainer's last version with the job Synced
    and Ready, then check the engines bit for bit. OPERATOR_LOG (the operator's log tail) goes into the failure message."""
    if body is None:
        body = load_example(example, process_nodes=env.runtime is not None)
    name = body["metadata"]["name"]
    last = trainer_versions(body)
    with env.api_client() as api:
        custom = kubernetes.client.CustomObjectsApi(api)
        t0 = time.monotonic()
        apply(env, body, namespace)
        out(f"[demo] applied examples/{DEMO_EXAMPLES.get(example, example)}: job={namespace}/{name}; the demo "
            f"trainer publishes versions 1..{last}, every inference pod's agent loads each one:")
        table = ProgressTable()

        def check() -> JSON | None:
            job = get_job(custom, namespace, name)
            for line in table.update(time.monotonic() - t0, job, job_pods(api, namespace, name)):
                out("    " + line)
            served = (job.get("status") or {}).get("servedVersion")
            synced = condition(job, contract.COND_SYNCED).get("status") == "True"
            # Ready too: servedVersion counts Ready replicas and Synced every replica, so either can show before
            # the last replica's pod is Ready again (its readiness gate follows its own, later, write)
            ready = condition(job, contract.COND_READY).get("status") == "True"
            return job if served is not None and served >= last and synced and ready else None

        def diagnose() -> str:
            text = f"operator log tail:\n{operator_log()}\n" if operator_log else ""
            return text + log_tails(env, namespace, job_pods(api, namespace, name))

        poll(check, timeout, f"{namespace}/{name} status.servedVersion >= {last}, Synced=True and Ready=True",
             interval=0.5, on_timeout=diagnose)
        print_served(env, custom, namespace, name, last, time.monotonic() - t0, out)
        report = verify_bit_exact(job_pods(api, namespace, name), last)
        for pod, version in report.engines.items():
            verdict = "bit-exact" if pod not in report.mismatches and version == last else (
                f"DIFFERS in {report.mismatches.get(pod, [])[:3]}")
            out(f"[demo] engine {pod}: version={version}, {report.tensors} tensors {verdict} with the trainer's")
        if not report.ok:
            raise DemoError(f"engines differ from the trainer's version {last}: {report}")
        return report


# --- the vLLM demo: a real vLLM server per replica, its outputs against a reference forward ---------------------
VLLM_GATES = f"{contract.SOCKET_DIR}/gates"  # the tiny-Llama trainer's --gate-dir in the vLLM demo


def pod_volume_dir(env: Environment, pod: Mapping[str, Any], volume: str) -> Path:
    """The host directory of POD's emptyDir VOLUME (process runtime: <state>/pods/<ns>_<name>_<uid>/volumes/)."""
    if env.runtime is None or env.runtime_state_dir is None:
        raise DemoError("reading a pod's files needs the process runtime (its pods' volumes are host directories)")
    from weightsync.e2e.runtime.pod_worker import pod_dir_name

    meta = pod["metadata"]
    return (Path(env.runtime.ctx.pods_dir) / pod_dir_name(meta["namespace"], meta["name"], meta["uid"])
            / "volumes" / volume)


def trainer_socket_dir(env: Environment, pods: Mapping[str, Mapping[str, Any]]) -> Path:
    """The trainer pod's socket dir (contract.SOCKET_DIR inside it) on this host."""
    from weightsync.operator.pods import VOL_SOCKET

    trainer = next((p for p in pods.values() if is_trainer_pod(p)), None)
    if trainer is None:
        raise DemoError("no trainer pod found")
    return pod_volume_dir(env, trainer, VOL_SOCKET)


def engine_url(pod: Mapping[str, Any]) -> str:
    return f"http://{pod_ip(pod)}:{ENGINE_PORT}"


@dataclass
class VersionCheck:
    """One version as every vLLM replica served it: its /weight_info label, its greedy outputs for the
    vllm_server.PROMPTS, transformers' scoring of those outputs over the trainer's saved state dict (teacher
    forced: the reference's best token and logprobs at every step) and what differs (vllm_server.differences)."""

    version: int
    labels: dict[str, str | None] = field(default_factory=dict)       # pod -> /weight_info weight_version
    outputs: dict[str, list[JSON]] = field(default_factory=dict)      # pod -> completions()
    reference: dict[str, list[JSON]] = field(default_factory=dict)    # pod -> the reference's scoring of them
    differences: dict[str, list[str]] = field(default_factory=dict)   # pod -> vllm_server.differences()

    @property
    def ok(self) -> bool:
        from weightsync.agent.engines.base import parse_version

        return bool(self.outputs) and not any(self.differences.values()) and all(
            parse_version(v or "") == self.version for v in self.labels.values())

    def near_ties(self, pod: str) -> int:
        """Greedy steps of POD where the reference's best token was another one, within TIE_NATS."""
        return sum(tok != top for g, w in zip(self.outputs[pod], self.reference[pod], strict=True)
                   for tok, top in zip(g["tokens"], w["top"], strict=True))


def check_vllm_version(env: Environment, pods: Mapping[str, Mapping[str, Any]], version: int) -> VersionCheck:
    """Every inference pod's vLLM outputs and /weight_info against the reference for VERSION: transformers'
    forward over the trainer's <socket dir>/llama-versions/v<VERSION>.pt (engine venv), one run scoring every
    replica's outputs."""
    from weightsync.agent.demo.llama_trainer import version_path
    from weightsync.e2e.engines import vllm_server

    weights = version_path(trainer_socket_dir(env, pods) / "llama-versions", version)
    if not weights.exists():
        raise DemoError(f"the trainer saved no {weights}")
    check = VersionCheck(version)
    for name, pod in sorted(pods.items()):
        if not is_inference_pod(pod):
            continue
        code, info = engine_get(pod, "/weight_info")
        check.labels[name] = (info or {}).get("weight_version") if code == 200 else None
        check.outputs[name] = vllm_server.completions(engine_url(pod))
    n = len(vllm_server.PROMPTS)
    scored = vllm_server.reference(weights, vllm_server.PROMPTS * len(check.outputs),
                                   forced=[g["tokens"] for got in check.outputs.values() for g in got])
    for i, (name, got) in enumerate(check.outputs.items()):
        check.reference[name] = scored[i * n:(i + 1) * n]
        check.differences[name] = vllm_server.differences(got, check.reference[name])
    return check


def vllm_lines(check: VersionCheck, prefix: str = "") -> list[str]:
    """What the demo prints for one version: per replica its /weight_info, its greedy tokens for the first
    prompt and whether its outputs for every prompt are the reference's."""
    from weightsync.e2e.engines import vllm_server

    lines = [f"[demo] version {check.version}: greedy tokens for prompt {vllm_server.PROMPTS[0]}, every replica's "
             f"outputs ({len(vllm_server.PROMPTS)} prompts x {vllm_server.MAX_TOKENS} tokens) scored by transformers over the trainer's "
             f"v{check.version}.pt:"]
    for name, got in check.outputs.items():
        diff = check.differences.get(name) or []
        ties = check.near_ties(name)
        verdict = ("= reference (each token its best, logprobs within bf16 tolerance"
                   + (f"; near-ties within {vllm_server.TIE_NATS} nats at {ties} steps" if ties else "") + ")") if not diff else (
            f"DIFFERS: {'; '.join(diff[:2])}")
        lines.append(f"    {name.removeprefix(prefix)}: weight_info={check.labels.get(name)} "
                     f"tokens {got[0]['tokens']} {verdict}")
    return lines


def run_vllm_demo(env: Environment, namespace: str, timeout: float, out: Callable[[str], None] = print,
                  operator_log: Callable[[], str] | None = None) -> list[VersionCheck]:
    """examples/demo-vllm.yaml with its trainer gated (--gate-dir): for each version, wait until every replica
    serves it, check every replica's greedy outputs against the reference, print them, then let the trainer
    publish the next one. Ends like run_demo (kubectl get wsj -o wide, the replicas, the pods)."""
    body = set_trainer_args(load_example("vllm", process_nodes=env.runtime is not None), gate_dir=VLLM_GATES)
    name, replicas = body["metadata"]["name"], body["spec"]["inference"]["replicas"]
    last = trainer_versions(body)
    checks: list[VersionCheck] = []
    with env.api_client() as api:
        custom = kubernetes.client.CustomObjectsApi(api)
        t0 = time.monotonic()
        apply(env, body, namespace)
        out(f"[demo] applied examples/demo-vllm.yaml: job={namespace}/{name}; the tiny-Llama trainer publishes "
            f"versions 1..{last}, each once the demo has checked the one before (--gate-dir); every inference pod "
            "runs vLLM's own server (CPU), which its agent loads each version into:")
        table = ProgressTable()

        def diagnose() -> str:
            text = f"operator log tail:\n{operator_log()}\n" if operator_log else ""
            return text + log_tails(env, namespace, job_pods(api, namespace, name))

        for version in range(1, last + 1):
            if version > 1:
                gates = trainer_socket_dir(env, job_pods(api, namespace, name)) / "gates"
                gates.mkdir(parents=True, exist_ok=True)
                (gates / f"go-{version}").touch()

            def served(version: int = version) -> JSON | None:
                job = get_job(custom, namespace, name)
                for line in table.update(time.monotonic() - t0, job, job_pods(api, namespace, name)):
                    out("    " + line)
                reps = (job.get("status") or {}).get("inferenceReplicas") or []
                ok = len(reps) == replicas and all((r.get("servedVersion") or 0) >= version and r.get("ready")
                                                   for r in reps)
                # Not Synced=True before the last version: it needs status.trainerVersion, which stays unset while
                # version 1 is the newest when the trainer published it before its agent's pod link was up (the
                # agent's start replaces the version it staged by what its pod showed: none).
                if version == last:
                    ok = ok and condition(job, contract.COND_SYNCED).get("status") == "True"
                return job if ok else None

            poll(served, timeout, f"{namespace}/{name} status.servedVersion >= {version} on both replicas",
                 interval=0.5, on_timeout=diagnose)
            check = check_vllm_version(env, job_pods(api, namespace, name), version)
            checks.append(check)
            for line in vllm_lines(check, prefix=f"{name}-"):
                out(line)
            if not check.ok:
                raise DemoError(f"version {version}: the vLLM engines' outputs differ from the reference: "
                                f"{check.labels} {check.differences}\n{diagnose()}")
        print_served(env, custom, namespace, name, last, time.monotonic() - t0, out)
    return checks
