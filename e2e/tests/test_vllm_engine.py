"""Real-engines issue end to end: examples/demo-vllm.yaml, whose engine type is VLLM, on the local cluster.

The engine container of each inference pod is vLLM 0.32's own OpenAI server (CPU build, engine venv) serving
the tiny Llama with weightsync's weight-transfer backend (`python -m weightsync.e2e.engines.vllm_server serve`:
the process runtime resolves `python` to the project's .venv, the module execs vLLM with the engine venv's
python). `--load-format dummy`: the server starts with random weights, so outputs equal to the reference can
only come from the versions the agents loaded. The trainer (weightsync.agent.demo.llama_trainer) saves each
version's state dict in its pod's socket dir before publishing it; the reference is transformers' forward over
that file (engine venv). Each replica's greedy tokens and logprobs (vLLM's /v1/completions) must equal it,
and its /weight_info must name the version.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from e2e_helpers import inference_pods, job, pods_show, served, wait

from weightsync.agent.engines.base import LABEL_DIGEST_CHARS, parse_version
from weightsync.crds import contract
from weightsync.e2e import demo

LABEL = re.compile(rf"^\d+-[0-9a-f]{{{LABEL_DIGEST_CHARS}}}$")

pytestmark = [pytest.mark.e2e, pytest.mark.engine_servers]

START_TIMEOUT = 420.0  # two vLLM servers start in 30-60 s each on 2 cores, then 3 versions load


def test_vllm_job_serves_the_last_version_with_the_reference_outputs(cluster, kube, namespace, operator,
                                                                     process_runtime):
    if process_runtime is None:
        pytest.skip("reads the trainer's saved versions from its pod's socket dir: needs the process runtime")
    operator()
    body = demo.load_example("vllm", process_nodes=True, name_override="vllm-ok")
    demo.apply(cluster, body, namespace)
    name, last = body["metadata"]["name"], demo.trainer_versions(body)
    assert last == 3

    def synced() -> bool | None:
        st = job(kube, namespace, name).get("status") or {}
        ok = (st.get("servedVersion") == last and (st.get("replicas") or {}).get("synced") == 2
              and demo.condition(job(kube, namespace, name), contract.COND_SYNCED).get("status") == "True")
        return True if ok else None

    wait(synced, START_TIMEOUT, f"{namespace}/{name} servedVersion {last} on 2 replicas", interval=1.0)
    pods_show(kube, namespace, name, contract.ANN_SERVED_VERSION, str(last))
    pods: dict[str, Any] = demo.job_pods(kube.api, namespace, name)
    check = demo.check_vllm_version(cluster, pods, last)
    assert len(check.outputs) == 2, check.outputs
    labels = set()
    for pod_name, pod in inference_pods(kube, namespace, name).items():
        assert check.differences[pod_name] == [], (pod_name, check.differences[pod_name])
        label = check.labels[pod_name]
        assert label is not None and LABEL.match(label) and parse_version(label) == last, (pod_name, label)
        labels.add(label)
        assert served(pod) == last and demo.pod_condition(pod, contract.POD_CONDITION_SYNCED) == "True"
        assert demo.pod_condition(pod, "Ready") == "True"
    assert len(labels) == 1, labels  # the same content, so the same digest, on both replicas
    assert check.ok

    # The comparison can fail: version 2's weights give other outputs than the version the engines serve.
    earlier = demo.check_vllm_version(cluster, pods, last - 1)
    assert all(earlier.differences.values()), earlier.differences
    assert not earlier.ok
