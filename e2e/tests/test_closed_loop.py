"""Issue 6 end to end: the real operator and real agents (processes) under a real API server, the demo
trainer and demo engine as the containers (process runtime), real gloo and shared-memory transfers.

Each test applies a demo job in its own namespace under its own operator process and checks what a user
sees: `kubectl get wsj`, `kubectl wait --for=condition=Synced`, the status, pause/resume, and that every
engine's weights are bit-exact with the trainer's after failures and scaling.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Any

import pytest
from e2e_helpers import (
    PodRecorder,
    assert_bit_exact,
    cond,
    inference_pods,
    job,
    pods_show,
    served,
    target,
    wait,
)

from weightsync.crds import contract
from weightsync.e2e import demo

pytestmark = [pytest.mark.e2e]

START_TIMEOUT = 240.0   # pods start torch in 2-3 processes each; a loaded 2-core CI machine is slow
PRINTER_COLUMNS = ["NAME", "PLACEMENT", "MODE", "TRAINER", "SERVED", "SYNCED", "READY", "PAUSED", "DEGRADED", "AGE"]


def _commits(events: list[tuple[str, int | None]]) -> list[int]:
    """The versions of a demo engine's commit events, in order (a commit always names its version; only
    pause/resume events may carry None)."""
    out = []
    for e, v in events:
        if e == "commit":
            assert v is not None, events
            out.append(v)
    return out


def _needs_runtime(process_runtime: Any) -> None:
    if process_runtime is None:
        pytest.skip("kills host processes: needs the process runtime (local control plane)")


def _served_at_least(kube: Any, ns: str, name: str, version: int, timeout: float = START_TIMEOUT) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        j = job(kube, ns, name)
        v = (j.get("status") or {}).get("servedVersion")
        return j if v is not None and v >= version else None

    result: dict[str, Any] = wait(check, timeout, f"{ns}/{name} servedVersion >= {version}")
    return result


def _kubectl_wait_synced(cluster: Any, ns: str, name: str, timeout_s: int) -> None:
    r = cluster.kubectl("wait", "--for=condition=Synced", f"wsj/{name}", "-n", ns, f"--timeout={timeout_s}s",
                        check=False, timeout=timeout_s + 30)
    assert r.returncode == 0, f"kubectl wait failed: {r.stderr or r.stdout}"
    assert "condition met" in r.stdout


def _final_status(kube: Any, ns: str, name: str, last: int, replicas: int, timeout: float = 60.0) -> dict[str, Any]:
    """Wait until every replica is also Ready and synced (the agent's readiness probe and the synced gate may
    trail Synced=True by a probe period), then check the whole status."""
    def settled() -> dict[str, Any] | None:
        j = job(kube, ns, name)
        st = j.get("status") or {}
        counts = st.get("replicas") or {}
        # synced too: right after a forged annotation the operator may write one status from the forged view
        # (that replica's version unproven) before the agent's rewrite reaches it
        ok = st.get("servedVersion") == last and counts.get("ready") == replicas and counts.get("synced") == replicas
        # Degraded too: a container killed by the test counts as crashed for 20 s of running again
        ok = ok and cond(j, contract.COND_DEGRADED) == "False"
        return j if ok and cond(j, contract.COND_READY) == "True" else None

    try:
        j: dict[str, Any] = wait(settled, timeout, f"{ns}/{name}: version {last} on {replicas} Ready replicas")
    except demo.DemoError:
        j = job(kube, ns, name)
    _final_status_is_correct(j, last, replicas)
    return j


def _final_status_is_correct(j: dict[str, Any], last: int, replicas: int) -> None:
    st = j["status"]
    assert st["trainerVersion"] == last and st["servedVersion"] == last, st
    assert st["replicas"] == {"inference": replicas, "synced": replicas, "ready": replicas}, st
    assert st["observedGeneration"] == j["metadata"]["generation"]
    assert st["replicaVersions"] == ",".join([str(last)] * replicas), st  # the -o wide skew column
    per_replica = st["inferenceReplicas"]
    assert [r["index"] for r in per_replica] == list(range(replicas)), per_replica
    for r in per_replica:
        assert r["servedVersion"] == last and r["ready"] is True and "progress" not in r and r["pods"], r
        assert r.get("lastSyncSeconds") is not None and "lastError" not in r, r
    assert cond(j, contract.COND_SYNCED) == "True" and cond(j, contract.COND_READY) == "True", st["conditions"]
    assert cond(j, contract.COND_DEGRADED) == "False" and cond(j, contract.COND_PAUSED) == "False", st["conditions"]
    assert st["lastSync"]["version"] == last and st["lastSync"]["bytes"] > 0, st.get("lastSync")
    # content digests: every replica that reports one reports the trainer's (an agent restarted after it loaded
    # the last version adopted it from the engine and does not know it)
    digests = {r["servedDigest"] for r in per_replica if "servedDigest" in r}
    assert len(digests) <= 1 and (not digests or st["trainerDigest"] in digests), (st.get("trainerDigest"), per_replica)


# --- (1) the two demo examples ---------------------------------------------------------------------------------
@pytest.mark.parametrize("example, mode, engines", [("separated", "NCCL", 2), ("colocated", "IPC", 1)])
def test_demo_example_serves_every_version_bit_exact(cluster, kube, namespace, operator, demo_job, example, mode,
                                                      engines):
    operator()
    body = demo_job(example, interval=1.0)
    name, last = body["metadata"]["name"], demo.trainer_versions(body)
    assert last == 5

    _kubectl_wait_synced(cluster, namespace, name, int(START_TIMEOUT))  # Synced=True at some version first
    j = _served_at_least(kube, namespace, name, last)
    _kubectl_wait_synced(cluster, namespace, name, 60)
    j = _final_status(kube, namespace, name, last, engines)
    assert j["status"]["lastSync"]["mode"] == mode
    digest = j["status"].get("trainerDigest") or ""
    assert len(digest) == 32 and all(r.get("servedDigest") == digest for r in j["status"]["inferenceReplicas"]), \
        j["status"]

    out = cluster.kubectl("get", "wsj", "-n", namespace).stdout.splitlines()
    assert out[0].split() == PRINTER_COLUMNS
    row = out[1].split()
    placement = "Separated" if example == "separated" else "Colocated"
    assert row[:9] == [name, placement, mode, str(last), str(last), "True", "True", "False", "AsExpected"], out

    assert_bit_exact(kube, namespace, name, last, engines)
    pods_show(kube, namespace, name, contract.ANN_SERVED_VERSION, str(last))  # the pods follow the status
    for pod in inference_pods(kube, namespace, name).values():
        # every version 1..5 was committed in order, none twice, and the engine was never left paused
        events = demo.engine_events(pod)
        commits = _commits(events)
        assert commits == sorted(set(commits)) and commits[-1] == last, events
        assert not demo.engine_state(pod)["paused"]
        assert served(pod) == last and demo.pod_condition(pod, contract.POD_CONDITION_SYNCED) == "True"
    _only_agents_hold_the_api_token(kube, namespace, name)


def _only_agents_hold_the_api_token(kube: Any, namespace: str, name: str) -> None:
    """F4 of the hostile-input issue: an app container with the pod's ServiceAccount token could annotate its
    pod (a forged published version wedged the job). Look into each running container's own mount namespace:
    the agent has the token, app containers do not."""
    token = f"{contract.SERVICE_ACCOUNT_DIR}/token"
    for pod in demo.job_pods(kube.api, namespace, name).values():
        st = pod["status"]
        for cs in (st.get("containerStatuses") or []) + (st.get("initContainerStatuses") or []):
            pid = (cs.get("containerID") or "").removeprefix("process://")
            if not pid.isdigit() or "running" not in (cs.get("state") or {}):
                continue
            # enter the container's own mount namespace (where its volumes are bound) and look for the file
            has = subprocess.run(["nsenter", "-t", pid, "-m", "test", "-f", token], timeout=10).returncode == 0
            want = cs["name"] == contract.AGENT_CONTAINER
            assert has == want, f"{pod['metadata']['name']}/{cs['name']}: API token mounted={has}, expected {want}"


# --- (2) pause / resume ----------------------------------------------------------------------------------------
def _paused_everywhere(kube: Any, namespace: str, name: str) -> None:
    pods = pods_show(kube, namespace, name, contract.ANN_ENGINE_PAUSED, "true")  # the pods follow the status
    assert len(pods) == 2
    for p in pods.values():
        assert demo.engine_state(p)["paused"] is True, p["metadata"]["name"]
        code, _ = demo.engine_get(p, "/predict?x=0.5")
        assert code == 503, "a paused engine must not generate"


def test_pause_confirmed_by_every_engine_then_resume(cluster, kube, namespace, operator, demo_job, process_runtime):
    operator()
    body = demo_job("separated", versions=60, interval=1.0)
    name = body["metadata"]["name"]
    _served_at_least(kube, namespace, name, 2)

    slow = sorted(inference_pods(kube, namespace, name))[1]
    stopped: int | None = None
    if process_runtime is not None:
        # One engine cannot answer for a while (SIGSTOP): its replica cannot confirm the pause, so the job
        # must not say Paused=True yet.
        stopped = demo.container_pid(inference_pods(kube, namespace, name)[slow], "engine")
        assert stopped is not None
        os.killpg(stopped, signal.SIGSTOP)
    try:
        demo.patch_job(kube.custom, namespace, name, {"paused": True})
        if stopped is not None:
            wait(lambda: demo.annotation(inference_pods(kube, namespace, name)[slow], contract.ANN_PAUSED) == "true",
                 30, "paused annotation on the pods")
            t_end = time.monotonic() + 6
            while time.monotonic() < t_end:
                j = job(kube, namespace, name)
                assert cond(j, contract.COND_PAUSED) != "True", (
                    f"Paused=True while {slow}'s engine had not confirmed: {demo.condition(j, 'Paused')}")
                time.sleep(0.1)
            assert demo.annotation(inference_pods(kube, namespace, name)[slow], contract.ANN_ENGINE_PAUSED) != "true"
    finally:
        if stopped is not None:
            os.killpg(stopped, signal.SIGCONT)
    wait(lambda: cond(job(kube, namespace, name), contract.COND_PAUSED) == "True", 60, "Paused=True")
    _paused_everywhere(kube, namespace, name)
    time.sleep(3)  # versions keep coming: the engines stay paused across loads
    _paused_everywhere(kube, namespace, name)
    assert cond(job(kube, namespace, name), contract.COND_PAUSED) == "True"

    demo.patch_job(kube.custom, namespace, name, {"paused": False})
    wait(lambda: cond(job(kube, namespace, name), contract.COND_PAUSED) == "False", 60, "Paused=False")
    wait(lambda: all(not demo.engine_state(p)["paused"] and demo.annotation(p, contract.ANN_ENGINE_PAUSED) == "false"
                     for p in inference_pods(kube, namespace, name).values()), 60, "engines resumed")
    # Versions keep coming and pauseGeneration pauses each load, so one read can land inside a load (503, one
    # pause more than resumes); a lost resume never evens out. Polled until every engine answers and is even.
    last: dict[str, Any] = {}

    def answering_and_resumed() -> bool:
        for n, p in inference_pods(kube, namespace, name).items():
            code, answer = demo.engine_get(p, "/predict?x=0.5")
            kinds = [e for e, _ in demo.engine_events(p)]
            last[n] = (code, answer, kinds[-6:], kinds.count("pause"), kinds.count("resume"))
            if not (code == 200 and answer["version"] is not None and kinds.count("pause") == kinds.count("resume")):
                return False
        return True

    demo.poll(answering_and_resumed, 30, "every engine answers /predict and resumed each pause",
              on_timeout=lambda: f"(code, answer, last events, pauses, resumes) per pod: {last}")
    # and versions still flow after the resume
    now = job(kube, namespace, name)["status"]["servedVersion"]
    _served_at_least(kube, namespace, name, now + 1, timeout=60)


# --- (3a) an inference agent killed mid-transfer -----------------------------------------------------------------
def test_agent_killed_mid_transfer_never_reports_the_half_loaded_version(cluster, kube, namespace, operator,
                                                                         demo_job, process_runtime):
    _needs_runtime(process_runtime)
    operator()
    # A bigger model and 1 MB buckets make a load take long enough to be interrupted.
    body = demo_job("separated", versions=14, interval=2.0, hidden=2048, bucket_mb=1)
    name, last = body["metadata"]["name"], demo.trainer_versions(body)
    _served_at_least(kube, namespace, name, 1)
    victim = sorted(inference_pods(kube, namespace, name))[0]
    recorder = PodRecorder(kube.api, namespace).start()
    try:
        killed_at: int | None = None
        pid_before: int | None = None
        missed: list[int] = []
        deadline = time.monotonic() + 150
        while killed_at is None:
            assert time.monotonic() < deadline, f"never caught the agent mid-transfer (missed {missed})"
            pod = inference_pods(kube, namespace, name)[victim]
            events = demo.engine_events(pod)
            begun = [v for e, v in events if e == "begin"]
            done = {v for e, v in events if e in ("commit", "abort")}
            pid = demo.agent_pid(pod)
            if pid and begun and begun[-1] not in done and begun[-1] is not None and begun[-1] < last:
                os.killpg(pid, signal.SIGKILL)
                t_kill = time.monotonic()
                # A dead agent cannot commit: a commit of that version now means the load had finished
                # just before the kill landed. Try again on a later version once the sidecar is back.
                after = demo.engine_events(inference_pods(kube, namespace, name)[victim])
                if begun[-1] in {v for e, v in after if e == "commit"}:
                    missed.append(begun[-1])
                    wait(lambda pid=pid: (p := demo.agent_pid(inference_pods(kube, namespace, name)[victim]))
                         and p != pid, 60, "agent restarted after a missed kill")
                    continue
                killed_at, pid_before = begun[-1], pid
                commits_before_restart = {v for e, v in after if e == "commit"}
                break
            time.sleep(0.01)

        # The pod leaves readiness while its agent is down...
        wait(lambda: any(e.name == victim and e.t >= t_kill and e.ready == "False" for e in recorder.events),
             60, f"{victim} NotReady after its agent was killed")
        # ...the sidecar restarts and the replica catches up to the last version by itself.
        wait(lambda: demo.agent_restarts(inference_pods(kube, namespace, name)[victim]) >= 1, 60, "agent restarted")
        _served_at_least(kube, namespace, name, last, timeout=START_TIMEOUT)
        _kubectl_wait_synced(cluster, namespace, name, 60)
    finally:
        recorder.stop()

    pod = inference_pods(kube, namespace, name)[victim]
    assert demo.agent_pid(pod) != pid_before
    # Never reporting a half-loaded version: each served-version the pod ever showed was already served
    # by its engine (queried right after the event); the interrupted version was aborted, not committed.
    for e in recorder.of(victim):
        if e.served is not None and e.engine_version is not None:
            assert e.served <= e.engine_version, f"pod reported {e.served} while its engine served {e.engine_version}"
    assert killed_at not in commits_before_restart
    events = demo.engine_events(pod)
    commits = _commits(events)
    assert commits == sorted(set(commits)) and commits[-1] == last, events
    assert not demo.engine_state(pod)["paused"], "the engine was left paused by the dead agent"
    _final_status(kube, namespace, name, last, 2)
    assert_bit_exact(kube, namespace, name, last, 2)


# --- (3b) the operator killed mid-rollout ------------------------------------------------------------------------
def test_operator_killed_mid_rollout_new_one_converges(cluster, kube, namespace, operator, demo_job):
    first = operator()
    body = demo_job("separated", versions=10, interval=1.5)
    name, last = body["metadata"]["name"], demo.trainer_versions(body)
    _served_at_least(kube, namespace, name, 1)

    # Kill it while a rollout is in flight: some replica has a target it does not serve yet.
    def rolling() -> bool:
        pods = inference_pods(kube, namespace, name)
        return any(target(p) is not None and (served(p) or 0) < (target(p) or 0) for p in pods.values())

    wait(rolling, 60, "a rollout in flight", interval=0.02)
    first.kill()
    before = {n: p["metadata"]["uid"] for n, p in demo.job_pods(kube.api, namespace, name).items()}
    assert len(before) == 3
    time.sleep(4)  # versions keep coming while no operator runs

    second = operator()
    _served_at_least(kube, namespace, name, last, timeout=START_TIMEOUT)
    _kubectl_wait_synced(cluster, namespace, name, 60)
    assert second.alive()
    after = {n: p["metadata"]["uid"] for n, p in demo.job_pods(kube.api, namespace, name).items()}
    assert after == before, "the new operator must adopt the pods, not recreate or duplicate them"
    all_pods = kube.core.list_namespaced_pod(namespace, label_selector=f"{contract.LABEL_JOB}={name}").items
    assert len(all_pods) == 3
    _final_status(kube, namespace, name, last, 2)
    assert_bit_exact(kube, namespace, name, last, 2)


# --- (4) scaling inference 2 -> 4 while versions flow ---------------------------------------------------------
def test_scale_inference_from_2_to_4_while_versions_flow(cluster, kube, namespace, operator, demo_job):
    operator()
    body = demo_job("separated", versions=12, interval=1.5)
    name, last = body["metadata"]["name"], demo.trainer_versions(body)
    _served_at_least(kube, namespace, name, 2)
    demo.patch_job(kube.custom, namespace, name, {"inference": {"replicas": 4}})

    wait(lambda: len(inference_pods(kube, namespace, name)) == 4, 60, "4 inference pods")
    j = _served_at_least(kube, namespace, name, last, timeout=START_TIMEOUT)
    _kubectl_wait_synced(cluster, namespace, name, 120)
    j = _final_status(kube, namespace, name, last, 4)
    assert j["metadata"]["generation"] == j["status"]["observedGeneration"] >= 2
    pods = inference_pods(kube, namespace, name)
    assert sorted(pods) == [f"{name}-inference-{r}-0" for r in range(4)]
    for n in (f"{name}-inference-2-0", f"{name}-inference-3-0"):
        commits = _commits(demo.engine_events(pods[n]))
        assert commits and commits[-1] == last and commits[0] > 1, f"{n} caught up from a later version: {commits}"
    assert_bit_exact(kube, namespace, name, last, 4)


# --- a replica behind by more than maxStaleness leaves readiness -----------------------------------------------
def test_stale_replica_goes_not_ready_through_its_readiness_gate(cluster, kube, namespace, operator, demo_job,
                                                                 process_runtime):
    """Readiness is what Service endpoints follow. (The endpoints themselves cannot be checked here: the
    process runtime's pods have loopback IPs, which the API server refuses in EndpointSlices.)"""
    _needs_runtime(process_runtime)
    operator()
    body = demo_job("separated", versions=40, interval=1.0)
    name = body["metadata"]["name"]
    _served_at_least(kube, namespace, name, 2)
    stale = sorted(inference_pods(kube, namespace, name))[1]
    # Ready first: a pod the runtime has not yet marked Ready after its first load would pass the NotReady
    # wait below at once, with its synced gate already True.
    wait(lambda: demo.pod_condition(inference_pods(kube, namespace, name)[stale], "Ready") == "True", 60,
         f"{stale} Ready before its engine hangs")
    pid = demo.container_pid(inference_pods(kube, namespace, name)[stale], "engine")
    assert pid is not None
    os.killpg(pid, signal.SIGSTOP)  # a hung engine: its replica cannot load anything any more
    try:
        def not_ready() -> dict[str, Any] | None:
            p = inference_pods(kube, namespace, name)[stale]
            return p if demo.pod_condition(p, "Ready") == "False" else None

        pod = wait(not_ready, 60, f"{stale} NotReady once more than maxStaleness=1 versions behind")
        assert demo.pod_condition(pod, contract.POD_CONDITION_SYNCED) == "False"
        assert demo.pod_condition(pod, "ContainersReady") == "True", "NotReady by the readiness gate, not a crash"
        j = wait(lambda: (x := job(kube, namespace, name)) and cond(x, contract.COND_DEGRADED) == "True" and x,
                 30, "Degraded=True")
        assert demo.condition(j, contract.COND_DEGRADED)["reason"] == "ReplicasStale"
        # The healthy replica serves on. Awaited: while the hung one was still Ready and loading it held the
        # maxUnavailable budget, so the healthy one may itself be a version over maxStaleness until it loads.
        other = next(n for n in inference_pods(kube, namespace, name) if n != stale)
        wait(lambda: demo.pod_condition(inference_pods(kube, namespace, name)[other], "Ready") == "True" or None, 30,
             f"{other} Ready while {stale} is stale")
    finally:
        os.killpg(pid, signal.SIGCONT)
    wait(lambda: demo.pod_condition(inference_pods(kube, namespace, name)[stale], "Ready") == "True", 90,
         f"{stale} Ready again after catching up")


# --- Colocated with several pods: each engine loads from the trainer ranks of its own pod --------------------
def test_colocated_two_pods_each_engine_loads_from_its_own_pod(cluster, kube, namespace, operator,
                                                               process_runtime):
    operator()
    body = demo.load_example("colocated", name_override="col2", process_nodes=process_runtime is not None)
    spec = body["spec"]
    spec["trainer"]["replicas"] = 2
    spec["trainer"]["parallelism"]["data"] = 2   # two data-parallel trainer ranks: each holds every tensor
    spec["inference"]["replicas"] = 2            # one engine per pod, fed through that pod's shared memory
    demo.apply(cluster, body, namespace)
    last = demo.trainer_versions(body)
    _served_at_least(kube, namespace, "col2", last)
    _final_status(kube, namespace, "col2", last, 2)
    assert_bit_exact(kube, namespace, "col2", last, 2)


# --- forged versions: a principal that may patch pods writes versions on them --------------------------------
def test_forged_version_annotations_move_nothing(cluster, kube, namespace, operator, demo_job):
    """Issue 15 (F4): `weightsync.io/published-version=100000` on a trainer pod (and a forged served version
    on an inference pod), written again and again while the trainer publishes. The operator believes only
    versions carrying the agent's proof: status.trainerVersion never takes the forged value, served versions
    keep advancing to the last one, the agents write their own values back, and a Warning Event names the
    pods."""
    operator()
    body = demo_job("separated", versions=10, interval=1.0)
    name, last = body["metadata"]["name"], demo.trainer_versions(body)
    _served_at_least(kube, namespace, name, 1)
    forged = "100000"
    trainer_pod = f"{name}-trainer-0"
    inference_pod = sorted(inference_pods(kube, namespace, name))[0]
    seen: list[tuple[Any, Any]] = []
    stop = threading.Event()

    def forge() -> None:
        while not stop.is_set():
            for pod, key in ((trainer_pod, contract.ANN_PUBLISHED_VERSION), (inference_pod, contract.ANN_SERVED_VERSION)):
                kube.core.patch_namespaced_pod(pod, namespace, {"metadata": {"annotations": {key: forged}}},
                                               _content_type="application/merge-patch+json")
            stop.wait(0.3)

    forger = threading.Thread(target=forge, daemon=True)
    forger.start()
    try:
        deadline = time.monotonic() + 12.0
        while time.monotonic() < deadline:
            st = job(kube, namespace, name).get("status") or {}
            seen.append((st.get("trainerVersion"), st.get("servedVersion")))
            time.sleep(0.1)
    finally:
        stop.set()
        forger.join(10)
    assert all(t != int(forged) and s != int(forged) for t, s in seen), seen
    trainer_seen = [t for t, _ in seen if t is not None]
    assert trainer_seen == sorted(trainer_seen) and trainer_seen[-1] > trainer_seen[0], (
        f"trainerVersion must keep advancing while the forger writes: {trainer_seen}")

    j = _served_at_least(kube, namespace, name, last, timeout=START_TIMEOUT)
    assert j["status"].get("versionProofKey"), j["status"]
    try:
        _final_status(kube, namespace, name, last, 2)
    except AssertionError as exc:  # say what the pods carry: the agents' heal is what this test checks
        pods = demo.job_pods(kube.api, namespace, name)
        anns = {n: {k: v for k, v in (p["metadata"].get("annotations") or {}).items() if "version" in k or "epoch" in k}
                for n, p in pods.items()}
        raise AssertionError(f"{exc}\npod annotations: {anns}") from None
    # the agent writes its own version back (within its pod-write delay)
    pods_show(kube, namespace, name, contract.ANN_PUBLISHED_VERSION, str(last), role="trainer")
    def unproven_named() -> bool | None:  # the operator's Event may lag its status write under load
        events = kube.core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
        named = " ".join(e.message for e in events if e.reason == "UnprovenVersion")
        return True if trainer_pod in named or inference_pod in named else None

    wait(unproven_named, 30.0, f"an UnprovenVersion Event naming {trainer_pod} or {inference_pod}")
    assert_bit_exact(kube, namespace, name, last, 2)


# --- a restarted trainer publishes 1..N again: a new trainer epoch, not a stale one ----------------------------
def test_restarted_trainer_starts_a_new_epoch_and_is_served_at_once(cluster, kube, namespace, operator, demo_job,
                                                                    process_runtime):
    """Issue 15 (F4): the trainer container dies after publishing every version and is restarted by the
    kubelet; the new process publishes 1..N again through the same agent. Before, the agent refused version
    1 ("versions must increase") and the trainer crash-looped, and with a restarted agent trainerVersion
    stayed at N until the new run passed it. Now the agent starts trainer epoch 1: status.trainerEpoch is 1,
    the engines load the new run's versions as they come (version 1 again included) and end bit-exact."""
    _needs_runtime(process_runtime)
    operator()
    body = demo_job("separated", versions=6, interval=1.0)
    name, last = body["metadata"]["name"], demo.trainer_versions(body)
    _served_at_least(kube, namespace, name, last)
    trainer_pod = f"{name}-trainer-0"
    pid = demo.container_pid(demo.job_pods(kube.api, namespace, name)[trainer_pod], "trainer")
    assert pid is not None
    commits_before = {n: len(demo.engine_events(p)) for n, p in inference_pods(kube, namespace, name).items()}
    t0 = time.monotonic()
    os.killpg(pid, signal.SIGKILL)

    def new_epoch_served() -> dict[str, Any] | None:
        j = job(kube, namespace, name)
        st = j.get("status") or {}
        pods = inference_pods(kube, namespace, name)
        epochs = {(p["metadata"].get("annotations") or {}).get(contract.ANN_SERVED_EPOCH) for p in pods.values()}
        done = (st.get("trainerEpoch"), st.get("trainerVersion"), st.get("servedEpoch"), st.get("servedVersion"))
        return j if done == (1, last, 1, last) and epochs == {"1"} else None

    j = wait(new_epoch_served, START_TIMEOUT, f"{name}: version {last} of trainer epoch 1 served everywhere")
    took = time.monotonic() - t0
    assert j["status"]["trainerVersion"] == last
    trainer = demo.job_pods(kube.api, namespace, name)[trainer_pod]
    restarts = {s["name"]: s.get("restartCount", 0) for s in trainer["status"]["containerStatuses"]}
    assert restarts["trainer"] == 1, f"the restarted trainer must publish, not crash-loop: {restarts}"
    for n, p in inference_pods(kube, namespace, name).items():
        after = _commits(demo.engine_events(p)[commits_before[n]:])
        assert after and after[-1] == last and min(after) < last, (
            f"{n} must load the new epoch's versions as they come, not wait for version > {last}: {after}")
    _final_status(kube, namespace, name, last, 2)
    assert_bit_exact(kube, namespace, name, last, 2)
    print(f"restart -> version {last} of epoch 1 served on every replica in {took:.1f} s")
