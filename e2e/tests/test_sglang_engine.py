"""Real-engines issue end to end: a demo job whose engine type is SGLang, on the local cluster.

The engine container of each inference pod is the SGLang 0.5.23 stand-in (weightsync.e2e.engines.
sglang_standin): SGLang's own FastAPI app (routes, body validation, status codes) in front of SGLang's own
session rules (SchedulerWeightUpdaterManager) and receive code (WeightUpdater, init_custom_process_group).
The container command is `python -m weightsync.e2e.engines.sglang_standin`; the process runtime resolves
`python` to the project's .venv, and the module re-executes itself with the engine venv's python
(e2e/engine_venv.py; `make setup` builds it). It runs in its own mount namespace with its own /dev/shm
(process runtime), so nothing but SGLang's protocol crosses from the agent: HTTP control and SGLang's
weight-update group.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from e2e_helpers import assert_bit_exact, inference_pods, job, pods_show, served, wait

from weightsync.agent.engines.base import LABEL_DIGEST_CHARS, parse_version
from weightsync.crds import contract
from weightsync.e2e import demo

LABEL = re.compile(rf"^\d+-[0-9a-f]{{{LABEL_DIGEST_CHARS}}}$")

pytestmark = [pytest.mark.e2e]

START_TIMEOUT = 300.0  # SGLang's app imports its serving stack at start (~20 s per engine on 2 cores)
SESSION_OPS = ("begin_weight_update", "end_weight_update")


def _events(pod: dict[str, Any]) -> list[dict[str, Any]]:
    code, body = demo.engine_get(pod, "/standin/events")
    assert code == 200, code
    return list(body["events"])


def _state(pod: dict[str, Any]) -> dict[str, Any]:
    code, body = demo.engine_get(pod, "/standin/state")
    assert code == 200, code
    return dict(body)


def _served_everywhere(kube: Any, ns: str, name: str, version: int, replicas: int) -> None:
    def check() -> bool | None:
        st = job(kube, ns, name).get("status") or {}
        ok = st.get("servedVersion") == version and (st.get("replicas") or {}).get("synced") == replicas
        return True if ok else None

    wait(check, START_TIMEOUT, f"{ns}/{name} servedVersion {version} on {replicas} replicas")


def _trainer_checksums(kube: Any, ns: str, name: str, version: int) -> dict[str, str]:
    trainer = next(p for p in demo.job_pods(kube.api, ns, name).values() if demo.is_trainer_pod(p))
    code, body = demo.trainer_get(trainer, f"/checksums?version={version}")
    assert code == 200 and body.get("checksums"), (code, body)
    return dict(body["checksums"])


def _sessions(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The events of each weight-update session, begin to end (inclusive)."""
    out: list[list[dict[str, Any]]] = []
    cur: list[dict[str, Any]] | None = None
    for e in events:
        if e["op"] == "begin_weight_update" and e["status"] == 200:
            cur = [e]
            out.append(cur)
        elif cur is not None:
            cur.append(e)
            if e["op"] == "end_weight_update":
                cur = None
    return out


def test_sglang_job_serves_every_version_through_sglang_protocol(kube, namespace, operator, demo_job):
    operator()
    body = demo_job("demo-sglang.yaml", interval=1.5, name="sgl-ok")
    name, last = body["metadata"]["name"], demo.trainer_versions(body)
    _served_everywhere(kube, namespace, name, last, 2)
    assert_bit_exact(kube, namespace, name, last, 2)
    label_of: dict[int | None, set[str]] = {}
    pods_show(kube, namespace, name, contract.ANN_SERVED_VERSION, str(last))  # the pods follow the status
    for pod in inference_pods(kube, namespace, name).values():
        st = _state(pod)
        assert st == {**st, "paused": False, "session_open": False}, st
        assert parse_version(st["weight_version"]) == last and LABEL.match(st["weight_version"]), st
        events = _events(pod)
        assert not [e for e in events if e["op"] == "refused"], events
        sessions = _sessions(events)
        assert len(sessions) >= 1
        for s in sessions:
            ops = [e["op"] for e in s]
            # every load of a version happened inside a session, and the session was closed
            assert ops[-1] == "end_weight_update" and all(e["status"] == 200 for e in s), ops
            assert set(ops[1:-1]) <= {"update_weights_from_distributed"} and len(ops) > 2, ops
        labels = [e["version"] for e in events if e["op"] == "weights"]
        versions = [parse_version(v) for v in labels]
        assert versions == sorted(v or 0 for v in versions) and versions[-1] == last, labels
        # the label names the content: `N-<digest prefix>`, the same on every replica for the same N
        assert all(LABEL.match(v) for v in labels), labels
        for v in labels:
            label_of.setdefault(parse_version(v), set()).add(v)
        # the version is recorded after end, the radix cache flushed once per version, then generation resumes
        ops = [e["op"] for e in events]
        for i, op in enumerate(ops):
            if op == "end_weight_update":
                assert ops[i + 1 : i + 5] == ["update_weight_version", "weights", "flush_cache",
                                              "continue_generation"], ops[i - 2 : i + 6]
        assert ops.count("flush_cache") == len(sessions)
        assert served(pod) == last and demo.pod_condition(pod, contract.POD_CONDITION_SYNCED) == "True"
    assert all(len(v) == 1 for v in label_of.values()), label_of  # both replicas: one digest per version


def test_sglang_load_failing_at_bucket_k_restores_the_previous_version(cluster, kube, namespace, operator,
                                                                      process_runtime):
    """The 2nd session's 1st bucket fails half-way (the engine's weights are mixed): the session is closed,
    the engine stays paused while the agent reloads the last good version, is resumed, serves that version
    bit for bit, and later versions load normally."""
    operator()
    body = demo.load_example("demo-sglang.yaml", process_nodes=process_runtime is not None, name_override="sgl-fail")
    # SGLang's own app takes ~20 s to start on 2 cores (longer under load): versions keep coming for ~40 s, so
    # that the engine's 2nd session (the one that fails) comes after a first one it can restore
    demo.set_trainer_args(body, interval=4.0, versions=10)
    body["spec"]["inference"]["replicas"] = 1
    body["spec"]["inference"]["template"]["spec"]["containers"][0]["command"] += ["--fail-load", "2:1"]
    demo.apply(cluster, body, namespace)
    name = body["metadata"]["name"]
    last = demo.trainer_versions(body)
    _served_everywhere(kube, namespace, name, last, 1)
    (pod,) = inference_pods(kube, namespace, name).values()
    events = _events(pod)
    failed = [i for i, e in enumerate(events) if e["op"] == "update_weights_from_distributed" and e["status"] != 200]
    assert len(failed) == 1, "\n".join(f"{e['op']} {e.get('status')} {e.get('message', '')[:80]}" for e in events)
    k = failed[0]
    after = [e["op"] for e in events[k:]]
    # closed at once, marked partial, never resumed before the restore committed
    assert after[1:3] == ["end_weight_update", "update_weight_version"], after[:8]
    assert events[k + 2]["version"].startswith("partial-"), events[k + 2]
    restored_at = next(i for i in range(k + 3, len(events))
                       if events[i]["op"] == "weights" and not events[i]["version"].startswith("partial-"))
    between = [e["op"] for e in events[k:restored_at]]
    assert "continue_generation" not in between, between
    restored = parse_version(events[restored_at]["version"])
    assert restored is not None and restored == int(events[k + 2]["version"].removeprefix("partial-")) - 1
    assert events[restored_at]["checksums"] == _trainer_checksums(kube, namespace, name, restored)
    assert [e["op"] for e in events[restored_at + 1 : restored_at + 3]] == ["flush_cache", "continue_generation"]
    assert parse_version(_state(pod)["weight_version"]) == last and not _state(pod)["paused"]
    assert_bit_exact(kube, namespace, name, last, 1)
