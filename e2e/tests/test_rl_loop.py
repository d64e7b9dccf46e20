"""An RL loop through real vLLM servers (examples/rl-loop-vllm.yaml) on the local cluster: the policy learns.

The trainer (weightsync.agent.demo.rl_trainer) trains the tiny Llama with REINFORCE to emit one target token,
publishing every step through TrainerSession; its rollouts come from the two inference pods' vLLM servers (vLLM
0.32's own OpenAI server, CPU build, the weightsync backend) through the job's routing Service, whose address
the process runtime gives the trainer as the kubelet does (service-link env; a userspace proxy to Ready
endpoints). Every rollout carries the weight versions vLLM itself says sampled it (`weight_versions`, the label
the agent set at commit). If a version were half-loaded, mislabelled or stale, the reward would not climb, or
the labels would show it.

One run of the loop (one test: the runs cost two vLLM servers each, so the clean run and the fault run are one),
with one inference pod deleted once 2 steps are done, before the reward climbs. With a fixed seed: the mean reward
over the last 5 of 20 steps is at least 0.8 and at least 3x the first step's; no rollout a step used came from a
version more than maxStaleness behind it; the surviving replica committed every version a rollout used, and the
deleted pod, up to its deletion, every one used until then (each with a sync stall); the loop went on with the
survivor (wait_served(only_serving=True)) while the new pod served nothing; the new pod's agent loads the current
version, its completions equal the survivor's, and every server reports the last version. It takes 3 to 5 minutes
here (two vLLM servers start, 20 steps of 1-2 s on 2 shared cores, the new pod's vLLM server starts; 297 s with
other work at load 6).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import inference_pods, job, wait

from weightsync.agent.engines.base import LABEL_DIGEST_CHARS, parse_version
from weightsync.crds import contract
from weightsync.e2e import demo
from weightsync.e2e.engines import vllm_server
from weightsync.e2e.rl_demo import COMMITTED, EXAMPLE, RlRun, run_rl_demo

pytestmark = [pytest.mark.e2e, pytest.mark.engine_servers]

LABEL = re.compile(rf"^\d+-[0-9a-f]{{{LABEL_DIGEST_CHARS}}}$")
RUN_TIMEOUT = 600.0  # two vLLM servers start in 30-60 s each on 2 cores, then 20 steps of 1-2 s
MAX_STALENESS = 1
STEPS = 20


def _body(name: str) -> dict[str, Any]:
    body = demo.load_example(EXAMPLE, process_nodes=True, name_override=name)
    assert body["spec"]["updatePolicy"]["maxStaleness"] == MAX_STALENESS
    argv = body["spec"]["trainer"]["template"]["spec"]["containers"][0]["command"]
    assert argv[argv.index("--steps") + 1] == str(STEPS) and argv[argv.index("--max-staleness") + 1] == "1"
    return body


def check_learned(run: RlRun) -> None:
    rewards = run.rewards()
    assert len(rewards) == STEPS, rewards
    last5 = sum(rewards[-5:]) / 5
    assert last5 >= 0.8 and last5 >= 3 * rewards[0], rewards
    assert last5 >= 3 * sum(rewards[:3]) / 3, rewards  # not only against a lucky or unlucky first step


def check_rollout_versions(run: RlRun) -> set[int]:
    """Every rollout a step used: labelled by the engine with a weightsync label (N-<digest prefix>), N within
    maxStaleness of the step's version. Returns the versions used."""
    used: set[int] = set()
    for rec in run.steps:
        assert rec["labels"], rec
        for label in rec["labels"]:
            assert LABEL.match(label), (rec["step"], label)
            v = parse_version(label)
            assert v is not None and rec["version"] - MAX_STALENESS <= v <= rec["version"], (rec, label)
            used.add(v)
        assert min(rec["rollout_versions"]) >= rec["version"] - MAX_STALENESS, rec
    return used


def committed_by_incarnation(env: Any, namespace: str, pod: str, uid: str) -> dict[int, float | None]:
    """Version -> stall seconds from the agent log of one incarnation of POD (RlRun.committed merges them)."""
    from weightsync.e2e.runtime.pod_worker import pod_dir_name

    log_file = Path(env.runtime.ctx.pods_dir) / pod_dir_name(namespace, pod, uid) / f"{contract.AGENT_CONTAINER}.log"
    out: dict[int, float | None] = {}
    for line in log_file.read_text(errors="replace").splitlines():
        m = COMMITTED.search(line)
        if m:
            out[int(m.group(1))] = float(m.group(2)) if m.group(2) else None
    return out


def test_rl_loop_learns_and_goes_on_while_an_inference_pod_is_deleted(cluster, kube, namespace, operator,
                                                                      process_runtime):
    if process_runtime is None:
        pytest.skip("reads the trainer's step records and the agents' logs from the pod dirs: needs the process runtime")
    operator()
    name = "rl"
    survivor_name, victim = f"{name}-inference-0-0", f"{name}-inference-1-0"
    deleted: dict[str, Any] = {}

    def delete_mid_run(run: RlRun) -> None:
        if not deleted and len(run.steps) >= 2:  # before the reward climbs: it climbs on one replica
            pod = demo.job_pods(kube.api, namespace, name)[victim]
            deleted.update(step=len(run.steps), uid=pod["metadata"]["uid"], at=time.monotonic())
            kube.core.delete_namespaced_pod(victim, namespace)

    run = run_rl_demo(cluster, namespace, RUN_TIMEOUT, out=print, body=_body(name), during=delete_mid_run)
    assert deleted, "the pod was deleted mid-run"
    check_learned(run)
    used = check_rollout_versions(run)
    assert len(used) >= STEPS // 2, f"the rollouts followed the versions: {sorted(used)}"
    pods = inference_pods(kube, namespace, name)
    assert len(pods) == 2 and set(run.committed) == set(pods)
    # the survivor committed every version a rollout used, each with a sync stall (paused: stall)
    survivor = run.committed[survivor_name]
    assert used <= set(survivor), sorted(used - set(survivor))
    assert all((survivor[v] or 0) > 0 for v in used), survivor
    # so did the victim's first pod, up to its deletion: step D's record is written after wait_served(D) (every
    # serving replica at D or later), so it had loaded every version up to D when it went
    first = committed_by_incarnation(cluster, namespace, victim, deleted["uid"])
    used_before = {v for v in used if v <= deleted["step"]}
    assert used_before and used_before <= set(first), (deleted["step"], sorted(used_before - set(first)))
    assert all((first[v] or 0) > 0 for v in used_before), first
    # the fleet ends on the last version, and the servers say so themselves; the new pod's agent caught up: it
    # loaded the current version into its fresh vLLM server
    new = pods[victim]
    assert new["metadata"]["uid"] != deleted["uid"]
    last = STEPS + 1
    wait(lambda: True if parse_version((demo.engine_get(new, "/weight_info")[1] or {}).get("weight_version", "")
                                       ) == last else None, 120, f"{victim} serves version {last}")
    # the trainer's last wait_served counted serving replicas only; the status follows the pods' own writes
    wait(lambda: (job(kube, namespace, name).get("status") or {}).get("servedVersion") == last or None, 30,
         f"status.servedVersion {last}")
    for pod in pods.values():
        code, info = demo.engine_get(pod, "/weight_info")
        assert code == 200 and parse_version(info["weight_version"]) == last, info
    # the loop did not stop for the missing replica: steps went on while the new pod served nothing yet (the
    # survivor loaded every version after the deletion; the first version the new pod loaded was published
    # more than one step after it)
    assert set(range(deleted["step"] + 1, STEPS + 2)) <= set(survivor), sorted(survivor)
    # the agent logs the commit after the server took it and resumed (awaited: the server shows it first)
    renewed = wait(lambda: (r := committed_by_incarnation(cluster, namespace, victim, new["metadata"]["uid"]))
                   and last in r and r, 30, f"{victim}'s agent logs version {last} committed")
    assert min(renewed) > deleted["step"] + 2, (deleted["step"], renewed)
    # the agent writes the pod's Synced condition after the commit the server and the log already show
    wait(lambda: demo.pod_condition(inference_pods(kube, namespace, name)[victim], contract.POD_CONDITION_SYNCED)
         == "True" or None, 30, f"{victim} Synced=True")
    got = vllm_server.completions(demo.engine_url(new))
    assert got == vllm_server.completions(demo.engine_url(pods[survivor_name]))
