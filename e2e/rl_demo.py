"""`make demo DEMO_ARGS='--example rl'`: an RL loop whose rollouts come from real vLLM servers (examples/rl-loop-vllm.yaml).

The trainer pod (weightsync.agent.demo.rl_trainer) writes one JSON line per step to its socket dir; this module
follows it and prints, per step, the mean reward, the versions its rollouts were generated with (the engines'
own `weight_versions` labels), and the time split: generation, training, the trainer's wait for the fleet,
and the engines' sync stall (generation paused to resumed, from each inference agent's `version committed ...
stall=` log line: the load of the version that step published). The tests (e2e/tests/test_rl_loop.py) check
the same records.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes

from weightsync.crds import contract
from weightsync.e2e import demo
from weightsync.e2e.environment import Environment

JSON = dict[str, Any]
EXAMPLE = "rl-loop-vllm.yaml"
STEPS_FILE = "rl-steps.jsonl"  # agent/demo/rl_trainer.py STEPS_FILE (the trainer's module needs torch)
DONE_FILE = "rl-done"
COMMITTED = re.compile(r"version committed version=(\d+) .*?(?: stall=([0-9.]+))?$")


@dataclass
class RlRun:
    """What one run of the loop showed: the trainer's step records and, per inference pod (every incarnation
    of it, a deleted pod's included), the versions its agent committed and each one's stall (None: not paused)."""

    name: str
    steps: list[JSON] = field(default_factory=list)
    committed: dict[str, dict[int, float | None]] = field(default_factory=dict)
    took: float = 0.0

    def rewards(self) -> list[float]:
        return [float(s["reward"]) for s in self.steps]

    def stall(self, version: int) -> float | None:
        """The longest sync stall of `version` over the replicas that loaded it."""
        got = [c[version] for c in self.committed.values() if c.get(version) is not None]
        return max(v for v in got if v is not None) if got else None


def committed_versions(env: Environment, namespace: str, pod: str) -> dict[int, float | None]:
    """Version -> stall seconds from the agent logs of every incarnation of POD (process runtime pod dirs)."""
    from weightsync.e2e.runtime.pod_worker import pod_dir_name

    if env.runtime is None:
        raise demo.DemoError("reading the agents' logs needs the process runtime")
    out: dict[int, float | None] = {}
    for pod_dir in sorted(Path(env.runtime.ctx.pods_dir).glob(pod_dir_name(namespace, pod, "*"))):
        log_file = pod_dir / f"{contract.AGENT_CONTAINER}.log"
        if not log_file.exists():
            continue
        for line in log_file.read_text(errors="replace").splitlines():
            m = COMMITTED.search(line)
            if m:
                out[int(m.group(1))] = float(m.group(2)) if m.group(2) else None
    return out


def read_steps(path: Path) -> list[JSON]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def step_line(rec: Mapping[str, Any], stall: float | None) -> str:
    versions = ",".join(str(v) for v in rec["rollout_versions"])
    dropped = f" (dropped {rec['stale_dropped']} stale)" if rec.get("stale_dropped") else ""
    stall_text = f"{stall:5.2f}s" if stall is not None else "  -  "
    return (f"    step {rec['step']:3d}  reward {rec['reward']:.3f}  rollouts from v{versions:<11}{dropped}  "
            f"generate {rec['generate_s']:.2f}s  train {rec['train_s']:.2f}s  wait {rec['wait_s']:.2f}s  "
            f"stall(v{rec['version'] + 1}) {stall_text}")


def summary_lines(run: RlRun) -> list[str]:
    r = run.rewards()
    n = len(run.steps)
    last5 = sum(r[-5:]) / len(r[-5:]) if r else 0.0
    mean = {k: sum(float(s[k]) for s in run.steps) / max(1, n) for k in ("generate_s", "train_s", "wait_s", "publish_s")}
    stalls = [x for x in (run.stall(int(s["version"]) + 1) for s in run.steps) if x is not None]
    stall = sum(stalls) / len(stalls) if stalls else float("nan")
    return [f"[demo] {n} steps in {run.took:.1f}s: reward {r[0]:.3f} at step 1, {last5:.3f} over the last 5 steps",
            f"[demo] one step, mean: generate {mean['generate_s']:.3f}s, train {mean['train_s']:.3f}s, wait for the "
            f"fleet {mean['wait_s']:.3f}s, publish {mean['publish_s']:.3f}s; a replica's sync stall (its generation "
            f"paused to resumed while it loads the next version) {stall:.3f}s"]


def run_rl_demo(env: Environment, namespace: str, timeout: float, out: Callable[[str], None] = print,
                operator_log: Callable[[], str] | None = None, body: JSON | None = None,
                during: Callable[[RlRun], None] | None = None) -> RlRun:
    """Apply examples/rl-loop-vllm.yaml (or BODY), follow the trainer's steps until it is done and the fleet
    serves its last version, print them, end like the other demos (kubectl get wsj -o wide). DURING is called
    on every poll with what is known so far (a test deletes a pod mid-run there)."""
    body = body or demo.load_example(EXAMPLE, process_nodes=env.runtime is not None)
    name = body["metadata"]["name"]
    run = RlRun(name)
    with env.api_client() as api:
        custom = kubernetes.client.CustomObjectsApi(api)
        t0 = time.monotonic()
        demo.apply(env, body, namespace)
        out(f"[demo] applied examples/{EXAMPLE}: job={namespace}/{name}; the trainer publishes its initial policy "
            "as version 1, then trains on rollouts from the vLLM servers (through the Service "
            f"{contract.routing_service_name(name)}) and publishes every step:")
        table = demo.ProgressTable()
        printed = 0
        state: dict[str, Any] = {"last": None}

        def diagnose() -> str:
            text = f"operator log tail:\n{operator_log()}\n" if operator_log else ""
            return text + demo.log_tails(env, namespace, demo.job_pods(api, namespace, name))

        def progress() -> bool | None:
            nonlocal printed
            pods = demo.job_pods(api, namespace, name)
            job = demo.get_job(custom, namespace, name)
            if not run.steps:  # until the loop runs: the pods coming up, vLLM starting, version 1 loading
                for line in table.update(time.monotonic() - t0, job, pods):
                    out("    " + line)
            if not any(demo.is_trainer_pod(p) for p in pods.values()):
                return None
            sock = demo.trainer_socket_dir(env, pods)
            run.steps = read_steps(sock / STEPS_FILE)
            for pod in (n for n, p in pods.items() if demo.is_inference_pod(p)):
                run.committed[pod] = committed_versions(env, namespace, pod)
            if during is not None:
                during(run)
            # a step's line once its published version's stall is known (or the loop moved on without it)
            while printed < len(run.steps):
                rec = run.steps[printed]
                stall = run.stall(int(rec["version"]) + 1)
                if stall is None and printed + 1 >= len(run.steps) and not (sock / DONE_FILE).exists():
                    break
                if printed == 0:
                    out("[demo] the loop (stall: the longest generation pause of any replica loading the version "
                        "that step published):")
                out(step_line(rec, stall))
                printed += 1
            if (sock / DONE_FILE).exists() and printed == len(run.steps):
                last = int((sock / DONE_FILE).read_text())
                st = job.get("status") or {}
                state["last"] = last
                return True if (st.get("servedVersion") or 0) >= last else None
            return None

        demo.poll(progress, timeout, f"{namespace}/{name}: the RL loop done and its last version served",
                  interval=0.5, on_timeout=diagnose)
        run.took = time.monotonic() - t0
        for line in summary_lines(run):
            out(line)
        demo.print_served(env, custom, namespace, name, state["last"], run.took, out)
    return run
