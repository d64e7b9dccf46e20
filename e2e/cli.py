"""`python -m weightsync.e2e.cli up|down|status` (make dev-up / dev-down / dev-status).

`up` starts a detached supervisor process that owns the whole local environment (control plane,
simulated GPU nodes, process runtime) and writes `.dev/kubeconfig` and `.dev/state.json`; `down` asks
it to stop everything (SIGTERM, then SIGKILL of what is left); `status` reports what runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from weightsync.e2e.binaries import BinaryNotFound
from weightsync.e2e.cluster import REPO_ROOT, ClusterError
from weightsync.e2e.environment import Environment, runtime_available, start_environment
from weightsync.e2e.procs import pid_alive, tail

log = logging.getLogger("weightsync.e2e.cli")


def dev_dir() -> Path:
    return Path(os.environ.get("WEIGHTSYNC_DEV_DIR", str(REPO_ROOT / ".dev"))).resolve()


def state_path(root: Path) -> Path:
    return root / "state.json"


def read_state(root: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(state_path(root).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_state(root: Path, state: dict[str, Any]) -> None:
    tmp = state_path(root).with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
    tmp.replace(state_path(root))


def running(state: dict[str, Any] | None) -> bool:
    return bool(state) and pid_alive(int(state.get("supervisor_pid", -1)))  # type: ignore[union-attr]


def usage(state: dict[str, Any]) -> str:
    nodes = state.get("nodes") or []
    process = state.get("process_nodes") or []
    kubectl_dir = str(Path(state.get("kubectl", "kubectl")).parent)
    runtime = "running" if state.get("runtime") else "not running"
    return "\n".join([
        f"weightsync dev cluster is up (control plane ready in {state.get('start_seconds', 0):.1f} s)",
        f"  server:      {state.get('server')}",
        f"  kubeconfig:  {state.get('kubeconfig')}",
        f"  nodes:       {', '.join(nodes) or 'none'} ({state.get('gpus')} x nvidia.com/gpu each)",
        f"  process runtime ({runtime}) on: {', '.join(process) or 'none'}",
        f"  logs:        {state.get('log_dir')}, {state.get('supervisor_log')}",
        "Use it:",
        f"  export KUBECONFIG={state.get('kubeconfig')}",
        f"  export PATH={kubectl_dir}:$PATH   # the pinned kubectl",
        "  kubectl get nodes -L nvidia.com/gpu.product,nvidia.com/gpu.clique",
        "Stop it: make dev-down    Status: make dev-status",
    ])


# --- supervisor (the detached process) ----------------------------------------------------------------
def supervise(args: argparse.Namespace) -> int:
    """Run the environment until SIGTERM/SIGINT; keep state.json current."""
    root = dev_dir()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    state: dict[str, Any] = {"supervisor_pid": os.getpid(), "status": "starting", "started_at": time.time(),
                             "supervisor_log": str(root / "supervisor.log")}
    write_state(root, state)
    environment: Environment | None = None
    try:
        local_only = {k: v for k, v in os.environ.items() if k not in ("WEIGHTSYNC_KUBECONFIG", "KUBECONFIG_E2E", "E2E_CLUSTER")}
        environment = start_environment(kubeconfig=root / "kubeconfig", work_dir=root / "cluster",
                                        node_count=args.nodes, gpus=args.gpus, env=local_only)
        if not args.no_runtime:
            environment.start_runtime(root / "runtime")
        local = environment.local
        state.update({
            "status": "ready", "server": environment.server, "kubeconfig": str(environment.kubeconfig),
            "nodes": environment.node_names, "process_nodes": environment.process_node_names,
            "gpus": args.gpus, "runtime": environment.runtime is not None,
            "runtime_state_dir": str(environment.runtime_state_dir) if environment.runtime_state_dir else None,
            "pids": local.pids if local else {}, "ports": local.ports if local else {},
            "log_dir": str(local.log_dir) if local else None,
            "start_seconds": local.start_seconds if local else None,
            "kubectl": str(environment.access.kubectl_path),
        })
        write_state(root, state)
        log.info("dev environment ready %s", json.dumps({k: state[k] for k in ("server", "nodes", "runtime")}))
        while not stop.wait(1.0):
            if local is not None:
                dead = [n for n, p in local.procs.items() if not p.alive()]
                if dead:
                    log.error("component exited components=%s; stopping", dead)
                    state.update(status="failed", error=f"{dead} exited; see {local.log_dir}")
                    write_state(root, state)
                    return 1
        return 0
    except Exception as exc:  # every failure must reach state.json, which `up` is waiting on
        known = isinstance(exc, (ClusterError, BinaryNotFound))
        if not known:
            log.exception("dev environment failed")
        state.update(status="failed", error=str(exc) if known else f"{type(exc).__name__}: {exc}", known_error=known)
        write_state(root, state)
        log.error("dev environment failed error=%s", exc)
        return 1
    finally:
        if environment is not None:
            environment.stop()
        if (read_state(root) or {}).get("status") != "failed":
            state_path(root).unlink(missing_ok=True)
        log.info("dev environment stopped")


# --- commands ----------------------------------------------------------------------------------------
def cmd_up(args: argparse.Namespace) -> int:
    root = dev_dir()
    root.mkdir(parents=True, exist_ok=True)
    state = read_state(root)
    if running(state):
        assert state is not None
        print(f"already running (supervisor pid {state['supervisor_pid']})\n")
        print(usage(state) if state.get("status") == "ready" else f"status: {state.get('status')}")
        return 0
    state_path(root).unlink(missing_ok=True)
    argv = [sys.executable, "-m", "weightsync.e2e.cli", "supervise", "--nodes", str(args.nodes),
            "--gpus", str(args.gpus)] + (["--no-runtime"] if args.no_runtime else [])
    log_file = root / "supervisor.log"
    with open(log_file, "wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True, cwd=REPO_ROOT)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        state = read_state(root)
        if state and state.get("status") == "ready":
            print(usage(state))
            return 0
        if (state and state.get("status") == "failed") or proc.poll() is not None:
            proc.wait(timeout=60)
            error = (state or {}).get("error", "the supervisor exited")
            if (state or {}).get("known_error"):  # a missing binary, a busy port, ...: the line says it all
                print(f"dev-up failed: {error}", file=sys.stderr)
            else:
                print(f"dev-up failed: {error}\n--- {log_file} (last lines) ---\n{tail(log_file, 30)}",
                      file=sys.stderr)
            return 1
        time.sleep(0.2)
    print(f"dev-up: not ready after {args.timeout:.0f}s; see {log_file}; stop with `make dev-down`", file=sys.stderr)
    return 1


def _kill_groups(state: dict[str, Any]) -> None:
    for pid in [*(state.get("pids") or {}).values(), state.get("supervisor_pid")]:
        if isinstance(pid, int) and pid_alive(pid):
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(pid, signal.SIGKILL)


def cmd_down(args: argparse.Namespace) -> int:
    root = dev_dir()
    state = read_state(root)
    if not running(state):
        if state is not None:
            _kill_groups(state)  # a crashed supervisor may have left components behind
            state_path(root).unlink(missing_ok=True)
        print("dev cluster is not running")
        return 0
    assert state is not None
    pid = int(state["supervisor_pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if pid_alive(pid):
        print(f"supervisor {pid} did not stop in {args.timeout:.0f}s; killing what is left", file=sys.stderr)
    _kill_groups(state)
    left = [p for p in (state.get("pids") or {}).values() if pid_alive(p)]
    state_path(root).unlink(missing_ok=True)
    if left:
        print(f"dev-down: processes still alive: {left}", file=sys.stderr)
        return 1
    print("dev cluster stopped")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    root = dev_dir()
    state = read_state(root)
    if not running(state):
        print("dev cluster is not running (start it with `make dev-up`)")
        if state and state.get("error"):
            print(f"last error: {state['error']}")
        return 1
    assert state is not None
    print(f"supervisor pid {state['supervisor_pid']}: {state.get('status')}")
    for name, pid in (state.get("pids") or {}).items():
        print(f"  {name:<24} pid {pid:<8} {'running' if pid_alive(pid) else 'DEAD'}")
    if state.get("status") != "ready":
        return 1
    kubectl = [state["kubectl"], f"--kubeconfig={state['kubeconfig']}"]
    ready = subprocess.run([*kubectl, "get", "--raw", "/readyz"], capture_output=True, text=True, timeout=30)
    print(f"apiserver {state['server']} /readyz: {ready.stdout.strip() or ready.stderr.strip()}")
    nodes = subprocess.run([*kubectl, "get", "nodes", "-L", "nvidia.com/gpu.product,weightsync.io/process-node"],
                           capture_output=True, text=True, timeout=30)
    print(nodes.stdout.rstrip() or nodes.stderr.rstrip())
    print(f"process runtime: {'running' if state.get('runtime') else 'not running'}")
    print(f"export KUBECONFIG={state['kubeconfig']}")
    return 0 if ready.returncode == 0 else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m weightsync.e2e.cli", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("up", "supervise"):
        p = sub.add_parser(name, help="start the dev environment" if name == "up" else argparse.SUPPRESS)
        p.add_argument("--nodes", type=int, default=int(os.environ.get("WEIGHTSYNC_E2E_NODES", "4")))
        p.add_argument("--gpus", type=int, default=int(os.environ.get("WEIGHTSYNC_E2E_GPUS", "8")))
        p.add_argument("--no-runtime", action="store_true", help="do not start the process runtime")
        p.add_argument("--timeout", type=float, default=120.0)
    down = sub.add_parser("down", help="stop the dev environment")
    down.add_argument("--timeout", type=float, default=60.0)
    sub.add_parser("status", help="report what runs")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "up" and not args.no_runtime and not runtime_available():
        print("note: weightsync.e2e.runtime.ProcessRuntime is not available; starting without the process runtime")
    handlers = {"up": cmd_up, "down": cmd_down, "status": cmd_status, "supervise": supervise}
    return handlers[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
