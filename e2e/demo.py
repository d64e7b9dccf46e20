"""`python -m weightsync.e2e.demo` (`make demo`): the whole closed loop on one machine, in about a minute.

It starts a real local control plane with simulated GPU nodes and the process runtime (e2e/), installs
the WeightSyncJob CRD, runs the real operator as a process, applies examples/demo-separated.yaml (or
--example colocated), follows the job's status while the demo trainer publishes versions 1..N, waits
until status.servedVersion reaches N, prints `kubectl get wsj -o wide` and the pods, checks that every
engine's weights are bit-exact with the trainer's (sha256 of every tensor, from the demo trainer's and
engines' /checksums endpoints), and tears everything down (--keep leaves it running; Ctrl-C stops it).

The helpers here (operator process, example loading, job/pod readers, the bit-exact check) are also
what the e2e suite (e2e/tests/) and bench/status_latency.py use.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
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
from weightsync.e2e.environment import Environment, start_environment

log = logging.getLogger("weightsync.e2e.demo")

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
CRD_FILE = REPO / "crds" / f"{contract.GROUP}_{contract.PLURAL}.yaml"
OPERATOR_BIN = Path(sys.executable).parent / "weightsync-operator"
DEMO_EXAMPLES = {"separated": "demo-separated.yaml", "colocated": "demo-colocated.yaml"}
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


def start_operator(kubeconfig: Path, namespace: str | None, log_dir: Path, *, resync_seconds: float = 5.0,
                   agent_image: str = "ghcr.io/weightsync/weightsync-agent:0.1.0") -> OperatorProcess:
    """Start the operator for NAMESPACE (None: all namespaces); metrics and health ports off (parallel runs)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"operator-{namespace or 'all'}-{time.strftime('%H%M%S')}-{os.getpid()}-{time.monotonic_ns() % 10**6}.log"
    scope = ["--namespace", namespace] if namespace else ["--all-namespaces"]
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "WEIGHTSYNC_AGENT_IMAGE": agent_image,
           "WEIGHTSYNC_RESYNC_SECONDS": str(resync_seconds), "PYTHONUNBUFFERED": "1"}
    if not OPERATOR_BIN.exists():
        raise DemoError(f"{OPERATOR_BIN} not found: install the repository into the venv "
                        "(`make setup` or `.venv/bin/pip install -e '.[agent,gdr,dev]'`)")
    with log_path.open("wb") as out:
        proc = subprocess.Popen([str(OPERATOR_BIN), *scope, "--metrics-port", "0", "--health-port", "0", "--verbose"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
    log.info("operator started pid=%s namespace=%s log=%s", proc.pid, namespace or "*", log_path)
    return OperatorProcess(proc, log_path, namespace)


# --- CRD and examples ---------------------------------------------------------------------------------------
def install_crd(env: Environment) -> None:
    """Apply the generated CRD (server-side, idempotent) and wait until it is served."""
    env.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=weightsync-e2e", "-f", str(CRD_FILE))
    env.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{contract.CRD_NAME}")


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
    """The last version the demo trainer of BODY publishes (its --versions argument, default 5)."""
    for c in body["spec"]["trainer"]["template"]["spec"]["containers"]:
        argv = [str(a) for a in (c.get("command") or []) + (c.get("args") or [])]
        if "weightsync.agent.demo.trainer" in argv:
            return int(argv[argv.index("--versions") + 1]) if "--versions" in argv else 5
    raise DemoError("the trainer template does not run weightsync.agent.demo.trainer")


def set_trainer_args(body: JSON, **flags: Any) -> JSON:
    """Replace (or add) `--flag value` arguments of the demo trainer's command (e.g. versions=3)."""
    for c in body["spec"]["trainer"]["template"]["spec"]["containers"]:
        argv = [str(a) for a in c.get("command") or []]
        if "weightsync.agent.demo.trainer" not in argv:
            continue
        for key, value in flags.items():
            flag = "--" + key.replace("_", "-")
            if flag in argv:
                argv[argv.index(flag) + 1] = str(value)
            else:
                argv += [flag, str(value)]
        c["command"] = argv
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
    """The job's live pods as plain JSON (not the typed models: annotations and conditions stay raw)."""
    core = kubernetes.client.CoreV1Api(api)
    resp: Any = core.list_namespaced_pod(namespace, label_selector=f"{contract.LABEL_JOB}={job}",
                                    _preload_content=False)
    items = json.loads(resp.data)["items"]
    return {p["metadata"]["name"]: p for p in items if not p["metadata"].get("deletionTimestamp")}


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

    state_dir.mkdir(parents=True, exist_ok=True)
    runtime = ProcessRuntime(str(env.kubeconfig), env.process_node_names, state_dir, pod_cidr=private_pod_cidr())
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


def run_demo(env: Environment, example: str, namespace: str, operator: OperatorProcess, timeout: float,
             out: Callable[[str], None] = print) -> BitExactReport:
    """Apply EXAMPLE in NAMESPACE (served by OPERATOR) and follow it to the bit-exact check."""
    body = load_example(example, process_nodes=env.runtime is not None)
    name = body["metadata"]["name"]
    last = trainer_versions(body)
    with env.api_client() as api:
        custom = kubernetes.client.CustomObjectsApi(api)
        t0 = time.monotonic()
        apply(env, body, namespace)
        out(f"[demo] applied examples/{DEMO_EXAMPLES.get(example, example)}: job={namespace}/{name}, "
            f"the demo trainer publishes versions 1..{last}")

        def progress(job: JSON) -> None:
            out(f"[demo] t={time.monotonic() - t0:5.1f}s {status_line(job)}")

        def diagnose() -> str:
            return f"operator alive={operator.alive()} log tail:\n{operator.log()[-3000:]}\n" + log_tails(
                env, namespace, job_pods(api, namespace, name))

        wait_served(custom, namespace, name, last, timeout, progress, diagnose)
        out(f"[demo] status.servedVersion reached {last} after {time.monotonic() - t0:.1f}s")
        wait = env.kubectl("wait", "--for=condition=Synced", f"wsj/{name}", "-n", namespace, "--timeout=30s")
        out(f"[demo] $ kubectl wait --for=condition=Synced wsj/{name}\n{wait.stdout.strip()}")
        out(f"[demo] $ kubectl get wsj -o wide\n{env.kubectl('get', 'wsj', '-o', 'wide', '-n', namespace).stdout.rstrip()}")
        out(f"[demo] $ kubectl get pods -o wide\n{env.kubectl('get', 'pods', '-o', 'wide', '-n', namespace).stdout.rstrip()}")
        report = verify_bit_exact(job_pods(api, namespace, name), last)
        for pod, version in report.engines.items():
            verdict = "bit-exact" if pod not in report.mismatches and version == last else (
                f"DIFFERS in {report.mismatches.get(pod, [])[:3]}")
            out(f"[demo] engine {pod}: version={version}, {report.tensors} tensors {verdict} with the trainer's")
        if not report.ok:
            raise DemoError(f"engines differ from the trainer's version {last}: {report}")
        return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m weightsync.e2e.demo", description=__doc__.splitlines()[0])
    p.add_argument("--example", choices=[*DEMO_EXAMPLES, "both"], default="separated",
                   help="which demo job to run (default: separated, NCCL over gloo)")
    p.add_argument("--namespace", default="demo")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for servedVersion (default 300)")
    p.add_argument("--keep", action="store_true", help="leave the cluster, operator and pods running (Ctrl-C stops)")
    p.add_argument("--work-dir", type=Path, default=None, help="kubeconfig, runtime state and logs (default: temp)")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="weightsync-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"[demo] starting a local control plane + 2 simulated GPU nodes + the process runtime (work dir {work})")
    examples = list(DEMO_EXAMPLES) if args.example == "both" else [args.example]
    operators: list[OperatorProcess] = []
    try:
        with demo_environment(work) as env:
            print(f"[demo] cluster ready: server={env.server} kubeconfig={env.kubeconfig}")
            install_crd(env)
            for ex in examples:
                ns = args.namespace if len(examples) == 1 else f"{args.namespace}-{ex}"
                ensure_namespace(env, ns)
                operators.append(start_operator(env.kubeconfig, ns, work / "logs"))
                print(f"[demo] operator running pid={operators[-1].pid} namespace={ns} log={operators[-1].log_path}")
                run_demo(env, ex, ns, operators[-1], args.timeout)
            print("[demo] OK: every engine serves the trainer's last version, bit for bit")
            if args.keep:
                print(f"[demo] --keep: running until Ctrl-C. export KUBECONFIG={env.kubeconfig}; "
                      f"kubectl get wsj -A -o wide")
                with contextlib.suppress(KeyboardInterrupt):
                    while True:
                        time.sleep(3600)
            for op in operators:
                op.stop()
    except DemoError as exc:
        print(f"[demo] FAILED: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("[demo] interrupted; tearing down", file=sys.stderr)
        return 130
    finally:
        for op in operators:
            op.stop()
    print("[demo] torn down: no process and no port left")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
