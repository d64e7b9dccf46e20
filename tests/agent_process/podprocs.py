"""Pods as processes: real agent, demo trainer and demo engine processes on loopback IPs, no Kubernetes.

Each "pod" gets its own 127.a.b.c address (so every pod uses the contract ports, like real pods), its
own socket directory (the shared emptyDir), and the job's token file. The test writes the topology file
the operator would render.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightsync.agent.staging.segments import SHM_DIR_ENV
from weightsync.crds import contract
from weightsync.crds.topology import (
    InferenceReplicaTopology,
    PodMember,
    Topology,
    TrainerTopology,
    TransportGroup,
)

PY = sys.executable
DEMO_PORT = 8000


def random_subnet() -> str:
    """127.a.b: a private /24 of loopback addresses for one test (avoids clashes with parallel tests)."""
    return f"127.{random.randint(20, 250)}.{random.randint(1, 250)}"


@dataclass
class Pod:
    name: str
    ip: str
    role: str
    rank: int = 0
    world_size: int = 1
    replica: int = 0
    ranks: list[int] | None = None  # ranks this pod's agent serves (default: [index in role/replica])
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)

    @property
    def metrics_url(self) -> str:
        return f"http://{self.ip}:{contract.METRICS_PORT}"

    @property
    def demo_url(self) -> str:
        return f"http://{self.ip}:{DEMO_PORT}"


class Cluster:
    """A job's pods as processes under one temporary directory."""

    def __init__(self, root: Path, *, job: str = "demo", mode: str = "NCCL", placement: str = "Separated",
                 bucket_mb: int = 1, token: str = "s3cret-token", verify: str = "None") -> None:
        self.verify = verify
        self.root = root
        self.job = job
        self.mode = mode
        self.placement = placement
        self.bucket_mb = bucket_mb
        self.subnet = random_subnet()
        self._next_ip = 10
        self.token_path = root / "token"
        self.token_path.write_text(token)
        self.topology_path = root / "topology.json"
        self.pods: dict[str, Pod] = {}
        self.generation = 1
        self.extra_env: dict[str, str] = {}
        # each pod's staging volume is memory-backed, as in a real pod (a disk-backed file would be written
        # back to disk, and SIGBUS the writer when the disk fills); removed by stop_all
        self.staging_root = Path(tempfile.mkdtemp(prefix="ws-podprocs-", dir="/dev/shm"))

    def ip(self) -> str:
        self._next_ip += 1
        return f"{self.subnet}.{self._next_ip}"

    def add_pod(self, name: str, role: str, **kw: Any) -> Pod:
        pod = Pod(name, self.ip(), role, **kw)
        self.pods[name] = pod
        (self.root / name / "sock").mkdir(parents=True, exist_ok=True)
        (self.staging_root / name).mkdir()  # the pod's staging emptyDir
        return pod

    def topology(self) -> Topology:
        trainers = [p for p in self.pods.values() if p.role in (contract.ROLE_TRAINER, contract.ROLE_COLOCATED)]
        infs = [p for p in self.pods.values() if p.role in (contract.ROLE_INFERENCE, contract.ROLE_COLOCATED)]
        replicas: dict[int, list[Pod]] = {}
        for p in infs:
            replicas.setdefault(p.replica, []).append(p)
        groups = []
        if self.mode == "IPC":
            groups = [TransportGroup(name=f"pod-{p.name}", members=[p.name]) for p in infs]
        else:
            for r, pods in sorted(replicas.items()):
                members = [t.name for t in trainers] + [p.name for p in pods if p.name not in {t.name for t in trainers}]
                groups.append(TransportGroup(name=f"replica-{r}", members=members))
        def ranks(pods: list[Pod]) -> list[list[int]]:
            out, nxt = [], 0
            for p in pods:
                r = p.ranks if p.ranks is not None else [nxt]
                out.append(r)
                nxt = max(r) + 1
            return out

        t_ranks = ranks(trainers)
        t_world = sum(len(r) for r in t_ranks)
        inference = []
        for r, pods in sorted(replicas.items()):
            pr = ranks(pods)
            world = sum(len(x) for x in pr)
            inference.append(InferenceReplicaTopology(replica=r, tensor=world, world_size=world, pods=[
                PodMember(name=p.name, index=j, ranks=pr[j], ip=p.ip) for j, p in enumerate(pods)]))
        return Topology(
            job=self.job, namespace="default", generation=self.generation, placement=self.placement,
            mode=self.mode, bucket_size_mb=self.bucket_mb, verify=self.verify,
            trainer=TrainerTopology(world_size=t_world, tensor=1, pipeline=1, data=t_world, pods=[
                PodMember(name=t.name, index=i, ranks=t_ranks[i], ip=t.ip) for i, t in enumerate(trainers)]),
            inference=inference,
            groups=groups,
        )

    def write_topology(self) -> None:
        tmp = self.topology_path.with_suffix(".tmp")
        tmp.write_text(self.topology().to_json())
        os.replace(tmp, self.topology_path)

    def env(self, pod: Pod, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            contract.ENV_JOB: self.job, contract.ENV_NAMESPACE: "default", contract.ENV_POD_NAME: pod.name,
            contract.ENV_POD_IP: pod.ip, contract.ENV_ROLE: pod.role, contract.ENV_RANK: str(pod.rank),
            contract.ENV_WORLD_SIZE: str(pod.world_size), contract.ENV_REPLICA: str(pod.replica),
            contract.ENV_TOPOLOGY_PATH: str(self.topology_path), contract.ENV_TOKEN_PATH: str(self.token_path),
            contract.ENV_SOCKET_DIR: str(self.root / pod.name / "sock"),
            contract.ENV_APP_SOCKET: str(self.root / pod.name / "sock" / contract.AGENT_SOCKET_NAME),
            SHM_DIR_ENV: str(self.staging_root / pod.name),
            contract.ENV_TRANSFER_MODE: self.mode, contract.ENV_BUCKET_SIZE_MB: str(self.bucket_mb),
            contract.ENV_VERIFY: self.verify, contract.ENV_ENGINE_TYPE: "Custom", contract.ENV_KUBE_ENABLED: "false",
            "WEIGHTSYNC_DEMO_PORT": str(DEMO_PORT), "PYTHONUNBUFFERED": "1",
        })
        env.update(self.extra_env)
        env.update(extra)
        return env

    def spawn(self, pod: Pod, what: str, args: list[str], **extra_env: str) -> subprocess.Popen[bytes]:
        log = self.root / pod.name / f"{what}.log"
        fh = log.open("ab")
        proc = subprocess.Popen(args, env=self.env(pod, **extra_env), stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        pod.procs[what] = proc
        pod.logs[what] = log
        return proc

    def start_agent(self, pod: Pod, **env: str) -> subprocess.Popen[bytes]:
        return self.spawn(pod, "agent", [PY, "-m", "weightsync.agent.main"], **env)

    def start_trainer(self, pod: Pod, *args: str) -> subprocess.Popen[bytes]:
        return self.spawn(pod, "trainer", [PY, "-m", "weightsync.agent.demo.trainer", *args])

    def start_script(self, pod: Pod, what: str, script: str, *args: str) -> subprocess.Popen[bytes]:
        return self.spawn(pod, what, [PY, str(Path(__file__).with_name(script)), *args])

    def start_engine(self, pod: Pod, *args: str) -> subprocess.Popen[bytes]:
        return self.spawn(pod, "engine", [PY, "-m", "weightsync.agent.demo.engine", *args])

    def start_separated(self, replicas: int, *trainer_args: str, replicas_ready: bool = False) -> tuple[Pod, list[Pod]]:
        """One trainer pod and REPLICAS one-pod inference replicas, each with its agent (and engine), then
        the demo trainer with TRAINER_ARGS: the usual shape of a separated job. REPLICAS_READY: the trainer
        starts only once every replica's agent has its engine and its link to the trainer agent (a test that
        counts what each version cost must not see a replica start late under load)."""
        trainer = self.add_pod("demo-trainer-0", contract.ROLE_TRAINER)
        infs = [self.add_pod(f"demo-inference-{r}-0", contract.ROLE_INFERENCE, replica=r) for r in range(replicas)]
        self.write_topology()
        for p in (trainer, *infs):
            self.start_agent(p)
        for p in infs:
            self.start_engine(p)
        if replicas_ready:
            for p in infs:
                self.wait_linked(p)
        self.start_trainer(trainer, *trainer_args)
        return trainer, infs

    def wait_linked(self, pod: Pod, timeout: float = 120.0) -> None:
        """Until POD's inference agent has its engine and its link to the trainer agent: a trainer started after
        this publishes v1 to a replica that is there for it, however loaded the machine."""
        wait_for(lambda: all(s in self.log_text(pod, "agent") for s in ("engine connected", "trainer.connected")),
                 timeout, f"{pod.name}'s agent linked to its engine and to the trainer agent", self)

    def join_late(self, replica: int) -> Pod:
        """An inference replica added to a running job: the topology grows (new generation)."""
        pod = self.add_pod(f"demo-inference-{replica}-0", contract.ROLE_INFERENCE, replica=replica)
        self.generation += 1
        self.write_topology()
        self.start_agent(pod)
        self.start_engine(pod)
        return pod

    def kill(self, pod: Pod, what: str, sig: int = signal.SIGKILL) -> None:
        proc = pod.procs.get(what)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, sig)
            proc.wait(10)

    def stop_all(self, grace: float = 5.0) -> None:
        """End every pod's processes and everything in their process groups. All are signalled at once and
        waited for together (one GRACE for all, not one per process): an agent, trainer or engine gets SIGTERM
        and GRACE seconds to close, then SIGKILL. A process under `unshare --fork` gets SIGKILL at once: unshare
        blocks SIGTERM while it waits for its child, and its child is a container's engine, the init of its own
        PID and mount namespaces (its /dev/shm goes with them), which SIGKILL ends with all its processes."""
        alive = [proc for pod in self.pods.values() for proc in pod.procs.values() if proc.poll() is None]
        for proc in alive:
            _signal_group(proc, signal.SIGKILL if _forked_namespace(proc) else signal.SIGTERM)
        deadline = time.monotonic() + grace
        while alive:
            for proc in list(alive):
                state = _exit_state(proc)
                if state == "exited":
                    _signal_group(proc, signal.SIGKILL)  # whatever of its group outlived it
                if state != "running":
                    _reap(proc)
                    alive.remove(proc)
            if alive and time.monotonic() > deadline:
                for proc in alive:
                    _signal_group(proc, signal.SIGKILL)
                    _reap(proc, 10)
                break
            time.sleep(0.02)
        shutil.rmtree(self.staging_root, ignore_errors=True)

    def log_text(self, pod: Pod, what: str) -> str:
        path = pod.logs.get(what)
        return path.read_text(errors="replace") if path and path.exists() else ""

    def dump_logs(self) -> str:
        out = []
        for pod in self.pods.values():
            for what in pod.logs:
                out.append(f"===== {pod.name} {what} =====\n{self.log_text(pod, what)[-6000:]}")
        return "\n".join(out)


def _forked_namespace(proc: subprocess.Popen[bytes]) -> bool:
    """PROC is `unshare --fork ...`: the command runs as unshare's child in new namespaces."""
    args = proc.args if isinstance(proc.args, list) else []
    return bool(args) and Path(str(args[0])).name == "unshare" and "--fork" in args


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """SIG to PROC's process group (spawn makes each process a group leader). Called only while PROC is not
    reaped, so that its id cannot have been reused by another group."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _exit_state(proc: subprocess.Popen[bytes]) -> str:
    """"running"; "exited" and not reaped (a zombie: its process group id is still its own); or "reaped"
    already, by a waitpid elsewhere in the test process (its id may be another process's by now)."""
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return "reaped"
    return "running" if info is None else "exited"


def _reap(proc: subprocess.Popen[bytes], timeout: float = 1.0) -> None:
    # AssertionError: Popen's waitpid race with gloo
    with contextlib.suppress(subprocess.TimeoutExpired, AssertionError, ChildProcessError):
        proc.wait(timeout)


def get_json(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            return e.code, json.loads(body)
        except ValueError:
            return e.code, body.decode(errors="replace")


def get_text(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def wait_for(pred: Any, timeout: float, what: str, cluster: Cluster | None = None, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last:
                return last
        except (OSError, urllib.error.URLError, ValueError) as exc:
            last = exc
        time.sleep(interval)
    logs = cluster.dump_logs() if cluster else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})\n{logs}")


def engine_version(pod: Pod) -> int | None:
    code, body = get_json(f"{pod.demo_url}/version", timeout=2)
    return body.get("version") if code == 200 else None


def engine_serving(pod: Pod, version: int) -> bool:
    """The demo engine serves VERSION and generates: the agent resumes it after the commit that sets the
    version, so a read right when the version shows can still find it paused."""
    code, body = get_json(f"{pod.demo_url}/version", timeout=2)
    return code == 200 and body.get("version") == version and body.get("paused") is False


def agent_served(pod: Pod, version: int) -> dict[str, Any] | None:
    """The agent's /healthz once it counts VERSION as served (after the engine's commit and resume)."""
    code, body = get_json(f"{pod.metrics_url}/healthz", timeout=2)
    return body if code == 200 and body.get("served") == version else None


def metric_value(text: str, name: str, labels: str = "") -> float | None:
    """The value of one sample in Prometheus text format (labels as written, e.g. 'direction="sent"')."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == name or (labels and key.startswith(name + "{") and all(lb in key for lb in labels.split(","))):
            return float(value)
    return None


def demo_replicas(root: Path, clusters: list[Cluster], hidden: int, replicas: int = 2,
                  **trainer_env: str) -> tuple[Cluster, Pod, list[Pod]]:
    """One demo trainer pod (its agent started with `trainer_env`; the test process is the trainer app) and
    `replicas` inference replicas of one pod each, agent and demo engine started, over NCCL with 1 MiB buckets."""
    c = Cluster(root, mode="NCCL", bucket_mb=1)
    c.extra_env["WEIGHTSYNC_DEMO_HIDDEN"] = str(hidden)
    clusters.append(c)
    trainer = c.add_pod("demo-trainer-0", contract.ROLE_TRAINER)
    infs = [c.add_pod(f"demo-inference-{r}-0", contract.ROLE_INFERENCE, replica=r) for r in range(replicas)]
    c.write_topology()
    c.start_agent(trainer, **trainer_env)
    for p in infs:
        c.start_agent(p)
        c.start_engine(p)
    return c, trainer, infs


def kill_inference_agent_mid_load(c: Cluster, versions: int = 4) -> tuple[Pod, Pod, int]:
    """One trainer and one inference pod; SIGKILL the inference agent while its engine is loading a version,
    wait for the engine to abort that version, restart the agent and wait until the engine serves VERSIONS.
    Returns (trainer, inference, the version that was being loaded) for the transport-specific checks."""
    c.extra_env["WEIGHTSYNC_DEMO_HIDDEN"] = "2048"  # fc2 is 16 MiB: a load spans many buckets
    t = c.add_pod("demo-trainer-0", contract.ROLE_TRAINER)
    i = c.add_pod("demo-inference-0-0", contract.ROLE_INFERENCE)
    c.write_topology()
    c.start_agent(t)
    c.start_agent(i)
    c.start_engine(i)
    c.start_trainer(t, "--versions", str(versions), "--interval", "3")

    def mid_load() -> int | None:
        _, body = get_json(f"{i.demo_url}/events", timeout=2)
        ev = body["events"]
        return ev[-1][1] if ev and ev[-1][0] == "begin" else None

    killed = int(wait_for(mid_load, 90, "a load in progress", c, interval=0.01))
    c.kill(i, "agent")
    # the engine drops the partial version and keeps serving what it had
    wait_for(lambda: ["abort", killed] in get_json(f"{i.demo_url}/events")[1]["events"], 30,
             f"abort of v{killed} after the agent died", c)
    assert engine_version(i) != killed
    c.start_agent(i)
    wait_for(lambda: engine_version(i) == versions, 120, f"restarted agent caught up to v{versions}", c)
    return t, i, killed
