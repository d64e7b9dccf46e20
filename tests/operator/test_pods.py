"""The pod builder: agent sidecar, volumes, env, GPUs, gates, affinity, ownership."""

from __future__ import annotations

from dataclasses import replace

import pytest

from weightsync.crds import contract
from weightsync.operator.placement import plan
from weightsync.operator.pods import (
    DRA_CLAIM,
    TemplateError,
    build_pod,
    build_pods,
    resource_claim_template_name,
)


def _pods(job, spec, cfg, **kw):
    p = plan(job.name, spec, cfg.node_gpu_count, cfg.rdma_available, cfg.dra_device_class_name)
    return {x["metadata"]["name"]: x for x in build_pods(job, spec, p, cfg, **kw)}


def _env(container):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _agent(pod):
    return next(c for c in pod["spec"]["initContainers"] if c["name"] == contract.AGENT_CONTAINER)


def test_agent_is_a_native_sidecar_with_configured_image(job, separated, cfg):
    for pod in _pods(job, separated(), cfg).values():
        agent = _agent(pod)
        assert pod["spec"]["initContainers"][0] is agent
        assert agent["restartPolicy"] == "Always"
        assert agent["image"] == "agent:test" and agent["command"] == ["weightsync-agent"]
        assert {p["containerPort"] for p in agent["ports"]} == set(contract.AGENT_PORTS)
        mounts = {m["mountPath"] for m in agent["volumeMounts"]}
        assert mounts == {contract.SOCKET_DIR, contract.STAGING_DIR, contract.TOPOLOGY_DIR, contract.TOKEN_DIR,
                          contract.SERVICE_ACCOUNT_DIR}
        assert _env(agent)[contract.ENV_TOKEN_PATH] == f"{contract.TOKEN_DIR}/{contract.TOKEN_FILE}"


def test_env_on_every_container(job, separated, cfg):
    pods = _pods(job, separated(), cfg)
    t1 = pods["demo-trainer-1"]
    for c in t1["spec"]["containers"] + t1["spec"]["initContainers"]:
        env = _env(c)
        assert env[contract.ENV_JOB] == "demo"
        assert env[contract.ENV_ROLE] == contract.ROLE_TRAINER
        assert env[contract.ENV_RANK] == "4" and env[contract.ENV_WORLD_SIZE] == "8"
        assert env[contract.ENV_POD_NAME] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env[contract.ENV_POD_IP] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env[contract.ENV_NAMESPACE] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
        assert env[contract.ENV_TOPOLOGY_PATH] == f"{contract.TOPOLOGY_DIR}/{contract.TOPOLOGY_FILE}"
        assert env[contract.ENV_TRANSFER_MODE] == "NCCL" and env[contract.ENV_BUCKET_SIZE_MB] == "64"
        assert env[contract.ENV_SOCKET_DIR] == contract.SOCKET_DIR
        assert env[contract.ENV_TIMEOUT_SECONDS] == "600"  # spec.transfer.timeoutSeconds bounds the agent's sync
    assert _env(t1["spec"]["containers"][0])["USER_VAR"] == "1"  # the user's env is kept
    i1 = pods["demo-inference-1-0"]
    env = _env(i1["spec"]["containers"][0])
    assert env[contract.ENV_ROLE] == contract.ROLE_INFERENCE and env[contract.ENV_REPLICA] == "1"
    assert env[contract.ENV_RANK] == "0" and env[contract.ENV_WORLD_SIZE] == "2"
    assert env[contract.ENV_ENGINE_URL] == "http://127.0.0.1:30000"


def test_delta_sync_env_only_when_enabled(job, separated, cfg):
    """spec.transfer.deltaSync reaches every container of every pod when enabled; absent or disabled, the
    variables are not set at all (pods of jobs without deltaSync keep their env and spec hash)."""
    spec = separated(transfer={"mode": "GDR", "deltaSync": {"enabled": True, "maxChangedFraction": 0.2}})
    pods = _pods(job, spec, cfg)
    assert len(pods) == 4
    for pod in pods.values():
        for c in pod["spec"]["containers"] + pod["spec"]["initContainers"]:
            env = _env(c)
            assert env[contract.ENV_DELTA_SYNC] == "true"
            assert float(env[contract.ENV_DELTA_MAX_CHANGED_FRACTION]) == 0.2
    default_fraction = _pods(job, separated(transfer={"mode": "GDR", "deltaSync": {"enabled": True}}), cfg)
    assert _env(_agent(default_fraction["demo-trainer-0"]))[contract.ENV_DELTA_MAX_CHANGED_FRACTION] == "0.1"
    plain = _pods(job, separated(transfer={"mode": "GDR"}), cfg)
    off = _pods(job, separated(transfer={"mode": "GDR", "deltaSync": {"enabled": False, "maxChangedFraction": 0.3}}),
                cfg)
    for pods_ in (plain, off):
        for pod in pods_.values():
            for c in pod["spec"]["containers"] + pod["spec"]["initContainers"]:
                env = _env(c)
                assert contract.ENV_DELTA_SYNC not in env and contract.ENV_DELTA_MAX_CHANGED_FRACTION not in env
    # disabled and absent give the same pods (same spec hash): no PodsOutdated for jobs that never used it
    assert {n: p["metadata"]["annotations"][contract.ANN_SPEC_HASH] for n, p in plain.items()} == \
        {n: p["metadata"]["annotations"][contract.ANN_SPEC_HASH] for n, p in off.items()}
    # enabling it changes the pods (the agent reads its env once): the operator marks them outdated
    assert pods["demo-trainer-0"]["metadata"]["annotations"][contract.ANN_SPEC_HASH] != \
        plain["demo-trainer-0"]["metadata"]["annotations"][contract.ANN_SPEC_HASH]


def test_ring_staging_reaches_only_the_trainer_pods_and_only_when_set(job, separated, cfg):
    """spec.transfer.staging.mode Ring sets the trainer agent's staging (agent/staging/ring.py reads it); Version or
    unset leaves every pod as it was (same spec hash), and inference pods never change with it."""
    ring = _pods(job, separated(transfer={"mode": "NCCL", "staging": {"mode": "Ring", "depth": 3}}), cfg)
    plain = _pods(job, separated(transfer={"mode": "NCCL"}), cfg)
    version = _pods(job, separated(transfer={"mode": "NCCL", "staging": {"mode": "Version", "depth": 3}}), cfg)
    env = _env(_agent(ring["demo-trainer-0"]))
    assert (env[contract.ENV_STAGING], env[contract.ENV_STAGING_DEPTH]) == ("ring", "3")
    from weightsync.agent.staging.ring import staging_mode_from_env
    assert staging_mode_from_env(env) == ("ring", 3), "what the agent reads from it"
    for name, pod in ring.items():
        if "inference" in name:
            assert contract.ENV_STAGING not in _env(_agent(pod))
    hashes = [{n: p["metadata"]["annotations"][contract.ANN_SPEC_HASH] for n, p in pods.items()}
              for pods in (ring, plain, version)]
    assert hashes[1] == hashes[2], "Version is the default: no PodsOutdated for jobs that never used Ring"
    assert hashes[0]["demo-trainer-0"] != hashes[1]["demo-trainer-0"]
    assert {n: h for n, h in hashes[0].items() if "inference" in n} == {
        n: h for n, h in hashes[1].items() if "inference" in n}


def test_lora_env_only_on_engine_pods_and_only_when_set(job, separated, cfg):
    """spec.inference.engine.lora reaches the inference pods as WEIGHTSYNC_LORA (JSON the agent parses);
    trainer pods never get it (so setting it does not mark them outdated), nor does a job without it."""
    import json

    lora = {"adapterName": "policy", "config": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}}
    pods = _pods(job, separated(inference={"engine": {"type": "SGLang", "lora": lora}}), cfg)
    plain = _pods(job, separated(), cfg)
    for name, pod in pods.items():
        env = _env(_agent(pod))
        if "trainer" in name:
            assert contract.ENV_LORA not in env
            assert pod["metadata"]["annotations"][contract.ANN_SPEC_HASH] == \
                plain[name]["metadata"]["annotations"][contract.ANN_SPEC_HASH]
        else:
            assert json.loads(env[contract.ENV_LORA]) == {**lora, "pinned": False}
    assert all(contract.ENV_LORA not in _env(_agent(p)) for p in plain.values())


def test_contract_env_overrides_a_spoofed_user_value(job, separated, cfg):
    tmpl = {"spec": {"containers": [{"name": "t", "image": "x", "env": [{"name": contract.ENV_RANK, "value": "99"}]}]}}
    pods = _pods(job, separated(trainer={"template": tmpl}), cfg)
    env = pods["demo-trainer-0"]["spec"]["containers"][0]["env"]
    assert [e["value"] for e in env if e["name"] == contract.ENV_RANK] == ["0"]


def test_shared_volumes_and_the_staging_volume(job, separated, cfg):
    tmpl = {"spec": {"containers": [{"name": "trainer", "image": "t",
                                     "volumeMounts": [{"name": "my-shm", "mountPath": "/dev/shm"}]}],
                     "volumes": [{"name": "my-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}]}}
    pod = _pods(job, separated(transfer={"bucketSizeMB": 300}, trainer={"template": tmpl}), cfg)["demo-trainer-0"]
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    # staging scales with the model, not the bucket: memory-backed, counted against the pod's memory
    assert vols["weightsync-shm"]["emptyDir"] == {"medium": "Memory"}
    # the app's own /dev/shm is the app's: ours is mounted elsewhere, in the agent and the app alike
    app = pod["spec"]["containers"][0]
    assert {"name": "my-shm", "mountPath": "/dev/shm"} in app["volumeMounts"]
    assert {"name": "weightsync-shm", "mountPath": contract.STAGING_DIR} in app["volumeMounts"]
    assert {"name": "weightsync-shm", "mountPath": contract.STAGING_DIR} in _agent(pod)["volumeMounts"]
    assert not any(m["mountPath"] == "/dev/shm" for m in _agent(pod)["volumeMounts"])
    pod = _pods(job, separated(transfer={"bucketSizeMB": 300}), cfg)["demo-trainer-0"]
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert vols["weightsync-topology"]["configMap"]["name"] == "demo-topology"
    assert vols["weightsync-token"]["secret"]["secretName"] == "demo-token"
    app = pod["spec"]["containers"][0]
    mounts = {m["mountPath"] for m in app["volumeMounts"]}
    assert mounts == {contract.SOCKET_DIR, contract.STAGING_DIR, contract.TOPOLOGY_DIR}  # no token for the app


def test_gpu_requests_and_readiness_gate(job, separated, cfg):
    pods = _pods(job, separated(), cfg)
    t = pods["demo-trainer-0"]
    res = t["spec"]["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == "4" and res["requests"]["nvidia.com/gpu"] == "4"
    assert "readinessGates" not in t["spec"]
    i = pods["demo-inference-0-0"]
    assert i["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert i["spec"]["readinessGates"] == [{"conditionType": contract.POD_CONDITION_SYNCED}]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in i["spec"]["tolerations"]


def _gpu_template(limits: dict[str, str], **extra):
    return {"spec": {"containers": [{"name": "t", "image": "x", "resources": {"limits": limits}}], **extra}}


def test_user_gpu_request_equal_to_ours_is_honoured(job, separated, cfg):
    tmpl = _gpu_template({"nvidia.com/gpu": "4", "cpu": "2"})
    pod = _pods(job, separated(trainer={"template": tmpl}), cfg)["demo-trainer-0"]
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "4", "cpu": "2"}


def test_user_gpu_request_that_disagrees_is_refused_not_rewritten(job, separated, cfg):
    """F7 of the hostile-input issue: 1 GPU asked, 4 assigned by gpusPerPod; was silently replaced."""
    spec = separated(trainer={"template": _gpu_template({"nvidia.com/gpu": "1"})})
    with pytest.raises(TemplateError, match=r"spec\.trainer\.template\.spec\.containers\[name=t\].*asks for 1 "
                                            r"nvidia\.com/gpu.*assigns 4.*gpusPerPod"):
        _pods(job, spec, cfg)


def test_gpu_request_on_a_second_container_is_refused(job, separated, cfg):
    tmpl = {"spec": {"containers": [{"name": "engine", "image": "x"},
                                    {"name": "side", "image": "y", "resources": {"requests": {"nvidia.com/gpu": "2"}}}]}}
    with pytest.raises(TemplateError, match=r"spec\.inference\.template\.spec\.containers\[name=side\].*assigns 0"):
        _pods(job, separated(inference={"template": tmpl}), cfg)


def test_init_containers_never_receive_gpus(job, separated, cfg):
    """F7: a GPU request on an initContainer used to pass through unchecked."""
    init = [{"name": "warm", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
    spec = separated(trainer={"template": {"spec": {"containers": [{"name": "t", "image": "x"}], "initContainers": init}}})
    with pytest.raises(TemplateError, match=r"spec\.trainer\.template\.spec\.initContainers\[name=warm\]"):
        _pods(job, spec, cfg)


def test_cpu_only_pods_request_no_gpu_and_no_affinity(job, separated, cfg):
    spec = separated(
        trainer={"replicas": 1, "gpusPerPod": 0, "parallelism": {"tensor": 1, "pipeline": 1, "data": 1}},
        inference={"replicas": 1, "gpusPerReplica": 0, "parallelism": {"tensor": 1}},
    )
    for pod in _pods(job, spec, cfg).values():
        assert "nvidia.com/gpu" not in str(pod["spec"]["containers"])
        assert "nodeAffinity" not in (pod["spec"].get("affinity") or {})
        assert "tolerations" not in pod["spec"]


def test_gdr_adds_rdma_and_ipc_lock_to_the_agent(job, separated, cfg):
    spec = separated(transfer={"mode": "GDR", "rdmaResourceName": "rdma/hca_a"})
    for pod in _pods(job, spec, cfg).values():
        agent = _agent(pod)
        assert agent["resources"]["limits"]["rdma/hca_a"] == "1"
        assert agent["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    nccl = _pods(job, separated(), cfg)["demo-trainer-0"]
    assert "add" not in _agent(nccl)["securityContext"]["capabilities"]  # only GDR adds a capability


def test_gdr_without_an_rdma_resource_in_the_spec_uses_the_operators(job, separated, cfg):
    spec = separated(transfer={"mode": "GDR"})
    assert spec.transfer.rdma_resource_name is None
    for pod in _pods(job, spec, cfg).values():
        assert _agent(pod)["resources"]["limits"] == {"rdma/hca_shared_devices_a": "1"}  # the config's default
    site = replace(cfg, rdma_resource_name="example.com/roce")
    for pod in _pods(job, spec, site).values():
        assert _agent(pod)["resources"]["limits"] == {"example.com/roce": "1"}
    # An explicit spec value still wins over the operator's.
    explicit = separated(transfer={"mode": "GDR", "rdmaResourceName": "rdma/hca_a"})
    assert _agent(_pods(job, explicit, site)["demo-trainer-0"])["resources"]["limits"] == {"rdma/hca_a": "1"}


def test_node_affinity_and_topology_key_packing(job, separated, cfg):
    spec = separated(placement={"mode": "Separated", "topologyKey": "example.com/rack"})
    pod = _pods(job, spec, cfg)["demo-inference-0-0"]
    aff = pod["spec"]["affinity"]
    terms = aff["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}]}]
    (pa,) = aff["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert pa["topologyKey"] == "example.com/rack"
    assert pa["labelSelector"]["matchLabels"] == {contract.LABEL_JOB: "demo", contract.LABEL_MANAGED_BY: contract.MANAGED_BY}
    assert "podAntiAffinity" not in aff


def test_inference_replicas_spread_without_topology_key(job, separated, cfg):
    pod = _pods(job, separated(), cfg)["demo-inference-0-0"]
    (term,) = pod["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"


def test_user_node_affinity_terms_are_anded(job, separated, cfg):
    user_term = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
    tmpl = {"spec": {"containers": [{"name": "t", "image": "x"}], "affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [user_term]}}}}}
    pod = _pods(job, separated(trainer={"template": tmpl}), cfg)["demo-trainer-0"]
    (term,) = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert [e["key"] for e in term["matchExpressions"]] == ["zone", "nvidia.com/gpu.present"]


def test_identity_labels_annotations_owner_and_service_account(job, separated, cfg):
    ann = {"demo-inference-1-0": {contract.ANN_TARGET_VERSION: "7"}}
    pods = _pods(job, separated(), cfg, desired_annotations=ann)
    pod = pods["demo-inference-1-0"]
    meta = pod["metadata"]
    assert meta["namespace"] == "ns1"
    assert meta["labels"] == {
        "team": "rl", contract.LABEL_JOB: "demo", contract.LABEL_MANAGED_BY: contract.MANAGED_BY,
        contract.LABEL_ROLE: contract.ROLE_INFERENCE, contract.LABEL_RANK: "0", contract.LABEL_REPLICA: "1",
    }
    assert meta["annotations"][contract.ANN_TARGET_VERSION] == "7"
    assert contract.ANN_SPEC_HASH in meta["annotations"]
    (ref,) = meta["ownerReferences"]
    assert ref == {"apiVersion": contract.API_VERSION, "kind": contract.KIND, "name": "demo", "uid": "uid-123",
                   "controller": True, "blockOwnerDeletion": True}
    assert pod["spec"]["serviceAccountName"] == "demo-agent"
    assert pod["spec"]["hostname"] == "demo-inference-1-0" and pod["spec"]["subdomain"] == "demo"
    assert pods["demo-trainer-0"]["metadata"]["annotations"]["note"] == "trainer"


def test_spec_hash_is_stable_and_ignores_desired_state(job, separated, cfg):
    a = _pods(job, separated(), cfg)["demo-trainer-0"]
    b = _pods(job, separated(), cfg, desired_annotations={"demo-trainer-0": {contract.ANN_PAUSED: "true"}})["demo-trainer-0"]
    assert a["metadata"]["annotations"][contract.ANN_SPEC_HASH] == b["metadata"]["annotations"][contract.ANN_SPEC_HASH]
    c = _pods(job, separated(transfer={"bucketSizeMB": 65}), cfg)["demo-trainer-0"]
    assert c["metadata"]["annotations"][contract.ANN_SPEC_HASH] != a["metadata"]["annotations"][contract.ANN_SPEC_HASH]


def test_colocated_pod_holds_trainer_inference_and_agent_on_the_same_gpus(job, colocated, cfg):
    pods = _pods(job, colocated(), cfg)
    assert list(pods) == ["demo-colocated-0", "demo-colocated-1"]
    pod = pods["demo-colocated-1"]
    trainer, engine = pod["spec"]["containers"]
    assert (trainer["name"], engine["name"]) == ("trainer", "engine")
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert "resources" not in engine or "nvidia.com/gpu" not in str(engine["resources"])
    assert _env(engine)["NVIDIA_VISIBLE_DEVICES"] == "all" and _env(_agent(pod))["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert _env(trainer)[contract.ENV_ROLE] == contract.ROLE_TRAINER and _env(trainer)[contract.ENV_RANK] == "8"
    assert _env(engine)[contract.ENV_ROLE] == contract.ROLE_INFERENCE
    assert _env(_agent(pod))[contract.ENV_ROLE] == contract.ROLE_COLOCATED
    assert pod["spec"]["readinessGates"] == [{"conditionType": contract.POD_CONDITION_SYNCED}]
    assert pod["metadata"]["labels"][contract.LABEL_ROLE] == contract.ROLE_COLOCATED
    assert contract.LABEL_REPLICA not in pod["metadata"]["labels"]  # hosts replicas 4..7


def test_colocated_gpu_pods_share_a_pid_namespace_and_the_agent_works_on_cuda(job, colocated, separated, cfg):
    """CUDA IPC handles open across containers only in one PID namespace, from an agent on the GPUs."""
    for pod in _pods(job, colocated(), cfg).values():
        assert pod["spec"]["shareProcessNamespace"] is True
        assert _env(_agent(pod))[contract.ENV_AGENT_DEVICE] == "cuda"
    for pod in _pods(job, separated(), cfg).values():  # separated: HTTP + weight-update group, no IPC
        assert "shareProcessNamespace" not in pod["spec"]
        assert contract.ENV_AGENT_DEVICE not in _env(_agent(pod))


def _with_dev_shm(container: str, image: str, volume: str) -> dict:
    """A template whose one container mounts `volume` (an in-memory emptyDir) at /dev/shm."""
    return {"spec": {"volumes": [{"name": volume, "emptyDir": {"medium": "Memory"}}],
                     "containers": [{"name": container, "image": image,
                                     "volumeMounts": [{"name": volume, "mountPath": "/dev/shm"}]}]}}


def _dev_shm(container):
    return [m["name"] for m in container.get("volumeMounts") or [] if m["mountPath"] == "/dev/shm"]


def test_a_colocated_gpu_pod_gives_every_container_the_dev_shm_one_of_them_mounts(job, colocated, separated, cfg):
    """torch keeps a CUDA IPC export's reference count in a file in the exporter's /dev/shm, opened by name on
    the other side: the trainer's volume at /dev/shm (a common way to enlarge it) becomes the engine's and
    the agent's too, or no handle would open between them."""
    spec = colocated(trainer={"template": _with_dev_shm("trainer", "trainer:1", "dshm")})
    for pod in _pods(job, spec, cfg).values():
        trainer, engine = pod["spec"]["containers"]
        assert _dev_shm(trainer) == _dev_shm(engine) == _dev_shm(_agent(pod)) == ["dshm"]
    for pod in _pods(job, colocated(), cfg).values():  # none mounted: every container keeps the pod's own
        assert not any(_dev_shm(c) for c in [*pod["spec"]["containers"], _agent(pod)])
    sep = separated(inference={"template": _with_dev_shm("engine", "engine:1", "dshm")})
    for name, pod in _pods(job, sep, cfg).items():  # separated: no CUDA IPC between containers, nothing added
        assert _dev_shm(_agent(pod)) == []
        assert _dev_shm(pod["spec"]["containers"][0]) == (["dshm"] if "inference" in name else [])


def test_colocated_containers_with_different_dev_shm_volumes_are_refused(job, colocated, cfg):
    spec = colocated(trainer={"template": _with_dev_shm("trainer", "trainer:1", "dshm")},
                     inference={"template": _with_dev_shm("engine", "engine:1", "engine-shm")})
    with pytest.raises(TemplateError, match=r"different volumes at /dev/shm \('dshm' in 'trainer', "
                                            r"'engine-shm' in 'engine'\)"):
        _pods(job, spec, cfg)


def test_colocated_with_dra_shares_one_claim(job, colocated, cfg):
    spec = colocated(
        placement={"mode": "Colocated", "dra": {"deviceClassName": "gpu.nvidia.com"}},
        trainer={"replicas": 2, "gpusPerPod": 4, "parallelism": {"tensor": 1, "pipeline": 1, "data": 8}},
        inference={"replicas": 4, "gpusPerReplica": 2},
    )
    pod = _pods(job, spec, cfg)["demo-colocated-0"]
    assert pod["spec"]["resourceClaims"] == [{"name": DRA_CLAIM, "resourceClaimTemplateName": resource_claim_template_name("demo")}]
    for c in pod["spec"]["containers"] + [_agent(pod)]:
        assert c["resources"]["claims"] == [{"name": DRA_CLAIM}]
        assert "nvidia.com/gpu" not in str(c["resources"].get("limits", {}))


def test_colocated_with_empty_dra_and_the_operators_device_class_shares_one_claim(job, colocated, cfg):
    spec = colocated(
        placement={"mode": "Colocated", "dra": {}},
        trainer={"replicas": 2, "gpusPerPod": 4, "parallelism": {"tensor": 1, "pipeline": 1, "data": 8}},
        inference={"replicas": 4, "gpusPerReplica": 2},
    )
    pod = _pods(job, spec, replace(cfg, dra_device_class_name="gpu.nvidia.com"))["demo-colocated-0"]
    assert pod["spec"]["resourceClaims"] == [{"name": DRA_CLAIM, "resourceClaimTemplateName": resource_claim_template_name("demo")}]


@pytest.mark.parametrize(
    "template, needle",
    [
        ({"spec": {"containers": [{"name": contract.AGENT_CONTAINER, "image": "x"}]}}, "reserved"),
        ({"spec": {"containers": [{"name": "t", "image": "x"}], "volumes": [{"name": "weightsync-shm", "emptyDir": {}}]}}, "reserved"),
    ],
)
def test_reserved_names_are_refused(job, separated, cfg, template, needle):
    spec = separated(trainer={"template": template})
    p = plan("demo", spec)
    with pytest.raises(TemplateError, match=needle):
        build_pod(job, spec, p, p.pods[0], cfg)


def test_colocated_container_name_clash_is_refused(job, colocated, cfg):
    same = {"spec": {"containers": [{"name": "main", "image": "x"}]}}
    spec = colocated(trainer={"template": same}, inference={"template": same})
    p = plan("demo", spec)
    with pytest.raises(TemplateError, match="distinct names"):
        build_pod(job, spec, p, p.pods[0], cfg)


def test_builder_does_not_mutate_the_spec(job, separated, cfg):
    spec = separated()
    before = spec.model_dump()
    _pods(job, spec, cfg)
    assert spec.model_dump() == before


def _sa_mounted(container):
    return any(m["mountPath"] == contract.SERVICE_ACCOUNT_DIR for m in container.get("volumeMounts") or [])


@pytest.mark.parametrize("placement", ["separated", "colocated"])
def test_only_the_agent_gets_the_kubernetes_api_token(job, separated, colocated, cfg, placement):
    """F4 of the hostile-input issue: with the pod's token every app container could annotate its pod (a
    forged published version wedged the job); automount was forced on for all containers."""
    spec = (separated if placement == "separated" else colocated)()
    for pod in _pods(job, spec, cfg).values():
        assert pod["spec"]["automountServiceAccountToken"] is False
        assert _sa_mounted(_agent(pod))
        apps = pod["spec"]["containers"] + [c for c in pod["spec"]["initContainers"] if c["name"] != contract.AGENT_CONTAINER]
        assert apps and not any(_sa_mounted(c) for c in apps)
        (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == "weightsync-kube-api-access"]
        assert vol["projected"]["sources"][0]["serviceAccountToken"]["path"] == "token"


def test_a_container_can_opt_in_to_the_token(job, separated, cfg):
    tmpl = {"metadata": {"annotations": {contract.ANN_API_TOKEN_CONTAINERS: "side"}},
            "spec": {"containers": [{"name": "t", "image": "x"}, {"name": "side", "image": "y"}]}}
    pod = _pods(job, separated(trainer={"template": tmpl}), cfg)["demo-trainer-0"]
    by_name = {c["name"]: c for c in pod["spec"]["containers"]}
    assert _sa_mounted(by_name["side"]) and not _sa_mounted(by_name["t"])
    bad = {"metadata": {"annotations": {contract.ANN_API_TOKEN_CONTAINERS: "nope"}},
           "spec": {"containers": [{"name": "t", "image": "x"}]}}
    with pytest.raises(TemplateError, match=r"names container\(s\) \['nope'\]"):
        _pods(job, separated(trainer={"template": bad}), cfg)


@pytest.mark.parametrize("mode", ["NCCL", "GDR"])
def test_agent_meets_pod_security_restricted_but_for_gdrs_ipc_lock(job, separated, cfg, mode):
    for pod in _pods(job, separated(transfer={"mode": mode, "bucketSizeMB": 64}), cfg).values():
        sc = _agent(pod)["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["runAsNonRoot"] is True
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"} and sc["capabilities"]["drop"] == ["ALL"]
        assert sc["capabilities"].get("add") == (["IPC_LOCK"] if mode == "GDR" else None)


def test_engine_only_changes_do_not_touch_trainer_pods(job, separated):
    """Issue 16: a new engine port (or update policy) changes the inference pods' spec hash only; the
    trainer pods stay current (not reported PodsOutdated)."""
    from weightsync.operator.config import OperatorConfig

    def hashes(spec):
        p = plan("demo", spec)
        return {x["metadata"]["name"]: x["metadata"]["annotations"][contract.ANN_SPEC_HASH]
                for x in build_pods(job, spec, p, OperatorConfig(), {})}

    before = hashes(separated())
    after = hashes(separated(inference={"engine": {"type": "SGLang", "port": 30001}},
                             updatePolicy={"maxStaleness": 3, "pauseGeneration": False}))
    trainers = [n for n in before if "trainer" in n]
    inference = [n for n in before if "inference" in n]
    assert trainers and all(before[n] == after[n] for n in trainers)
    assert inference and all(before[n] != after[n] for n in inference)


def test_fan_out_relay_reaches_every_agent_only_over_nccl(job, separated, cfg):
    """spec.transfer.fanOut Relay: trainer agents form the chains and inference agents forward along them, so
    every pod's agent gets it (and reads it, agent/config.py); Direct or unset leaves every pod as it was."""
    from weightsync.agent.config import AgentConfig

    relay = _pods(job, separated(transfer={"mode": "NCCL", "fanOut": "Relay"}), cfg)
    plain = _pods(job, separated(transfer={"mode": "NCCL"}), cfg)
    direct = _pods(job, separated(transfer={"mode": "NCCL", "fanOut": "Direct"}), cfg)
    for pod in relay.values():
        env = _env(_agent(pod))
        assert env[contract.ENV_FAN_OUT] == "Relay"
        cfg_env = {k: v for k, v in env.items() if isinstance(v, str)}
        cfg_env.update({contract.ENV_POD_NAME: "p", contract.ENV_JOB: "demo"})
        assert AgentConfig.from_env(cfg_env).fan_out == "Relay"
    hashes = [{n: p["metadata"]["annotations"][contract.ANN_SPEC_HASH] for n, p in pods.items()}
              for pods in (relay, plain, direct)]
    assert hashes[1] == hashes[2], "Direct is the default: no PodsOutdated for jobs that never used Relay"
    assert all(hashes[0][n] != hashes[1][n] for n in hashes[0])
    for pod in plain.values():
        assert contract.ENV_FAN_OUT not in _env(_agent(pod))
    for pod in _pods(job, separated(transfer={"mode": "GDR", "fanOut": "Relay"}), cfg).values():
        assert _env(_agent(pod))[contract.ENV_FAN_OUT] == "Relay"  # GDR relays too (NIXL READ from a replica)
