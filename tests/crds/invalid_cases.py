"""Invalid WeightSyncJob objects, shared by the pydantic mirror test (tests/crds) and the API-server test
(tests/api): every case names the field the refusal message must mention.

A case starts from a valid base object (`separated()` or `colocated()`), applies `mutate`, and is either
created (`op="create"`) or, for immutability, created valid and then updated with the mutation
(`op="update"`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Obj = dict[str, Any]


def _template(name: str) -> Obj:
    return {"spec": {"containers": [{"name": name, "image": f"example.com/{name}:1"}]}}


def separated(name: str = "wsj-sep") -> Obj:
    """Separated NCCL job: 2 trainer pods x 4 GPUs (TP2 x DP4), 2 SGLang replicas x 2 GPUs (TP2)."""
    return {
        "apiVersion": "weightsync.io/v1alpha1",
        "kind": "WeightSyncJob",
        "metadata": {"name": name},
        "spec": {
            "placement": {"mode": "Separated"},
            "transfer": {"mode": "NCCL"},
            "trainer": {
                "replicas": 2,
                "gpusPerPod": 4,
                "parallelism": {"tensor": 2, "pipeline": 1, "data": 4},
                "template": _template("trainer"),
            },
            "inference": {
                "replicas": 2,
                "gpusPerReplica": 2,
                "parallelism": {"tensor": 2},
                "engine": {"type": "SGLang"},
                "template": _template("engine"),
            },
        },
    }


def colocated(name: str = "wsj-colo") -> Obj:
    """Colocated job: 2 pods x 8 GPUs, 8 inference replicas x 2 GPUs."""
    obj = separated(name)
    obj["spec"]["placement"] = {"mode": "Colocated"}
    obj["spec"]["transfer"] = {"mode": "IPC"}
    obj["spec"]["trainer"].update(replicas=2, gpusPerPod=8, parallelism={"tensor": 1, "pipeline": 1, "data": 16})
    obj["spec"]["inference"].update(replicas=8, gpusPerReplica=2)
    return obj


def _set(path: str, value: Any) -> Callable[[Obj], None]:
    """Mutation setting a dotted path (integers index lists)."""

    def apply(obj: Obj) -> None:
        keys: list[Any] = [int(k) if k.isdigit() else k for k in path.split(".")]
        cur: Any = obj
        for k in keys[:-1]:
            cur = cur[k]
        cur[keys[-1]] = value

    return apply


def _delete(path: str) -> Callable[[Obj], None]:
    def apply(obj: Obj) -> None:
        keys = path.split(".")
        cur: Any = obj
        for k in keys[:-1]:
            cur = cur[k]
        del cur[keys[-1]]

    return apply


def _all(*fns: Callable[[Obj], None]) -> Callable[[Obj], None]:
    def apply(obj: Obj) -> None:
        for fn in fns:
            fn(obj)

    return apply


@dataclass(frozen=True)
class Case:
    id: str
    mutate: Callable[[Obj], None]
    field: str                       # the refusal message must name this field
    kind: str                        # what refuses it: enum, bound, required, pattern, CEL, immutable
    op: Literal["create", "update"] = "create"
    base: Callable[[str], Obj] = separated
    also: str | None = None          # a second substring the API server's message must contain

    def build(self, name: str) -> Obj:
        obj = self.base(name)
        if self.op == "create":
            self.mutate(obj)
        return obj

    def updated(self, stored: Obj) -> Obj:
        obj = copy.deepcopy(stored)
        self.mutate(obj)
        return obj


CASES: list[Case] = [
    # --- schema: enums -------------------------------------------------------------------------------
    Case("placement-mode-enum", _set("spec.placement.mode", "Mixed"), "spec.placement.mode", "enum",
         also="Unsupported value"),
    Case("transfer-mode-enum", _set("spec.transfer.mode", "RDMA"), "spec.transfer.mode", "enum",
         also="Unsupported value"),
    Case("verify-enum", _set("spec.transfer.verify", "Sha256"), "spec.transfer.verify", "enum"),
    Case("engine-type-enum", _set("spec.inference.engine.type", "TGI"), "spec.inference.engine.type", "enum"),
    # --- schema: bounds ------------------------------------------------------------------------------
    Case("bucket-size-zero", _set("spec.transfer.bucketSizeMB", 0), "spec.transfer.bucketSizeMB", "bound"),
    Case("bucket-size-huge", _set("spec.transfer.bucketSizeMB", 20000), "spec.transfer.bucketSizeMB", "bound"),
    Case("timeout-zero", _set("spec.transfer.timeoutSeconds", 0), "spec.transfer.timeoutSeconds", "bound"),
    Case("trainer-replicas-zero", _set("spec.trainer.replicas", 0), "spec.trainer.replicas", "bound"),
    Case("trainer-gpus-too-many", _set("spec.trainer.gpusPerPod", 17), "spec.trainer.gpusPerPod", "bound"),
    Case("inference-replicas-negative", _set("spec.inference.replicas", -1), "spec.inference.replicas", "bound"),
    Case("engine-port-range", _set("spec.inference.engine.port", 70000), "spec.inference.engine.port", "bound"),
    Case("delta-fraction-range",
         _all(_set("spec.transfer.mode", "GDR"),
              _set("spec.transfer.deltaSync", {"enabled": True, "maxChangedFraction": 1.5})),
         "spec.transfer.deltaSync.maxChangedFraction", "bound"),
    Case("parallelism-zero", _set("spec.trainer.parallelism.tensor", 0), "spec.trainer.parallelism.tensor", "bound"),
    # --- schema: required fields and pod templates ----------------------------------------------------
    Case("placement-required", _delete("spec.placement"), "spec.placement", "required", also="Required value"),
    Case("trainer-template-required", _delete("spec.trainer.template"), "spec.trainer.template", "required",
         also="Required value"),
    Case("engine-required", _delete("spec.inference.engine"), "spec.inference.engine", "required"),
    Case("template-no-containers", _set("spec.inference.template.spec.containers", []),
         "spec.inference.template.spec.containers", "required"),
    Case("container-without-name", _set("spec.trainer.template.spec.containers", [{"image": "x"}]),
         "spec.trainer.template.spec.containers[0].name", "required"),
    # --- schema: patterns ------------------------------------------------------------------------------
    Case("rdma-resource-pattern", _set("spec.transfer.rdmaResourceName", "not a resource"),
         "spec.transfer.rdmaResourceName", "pattern"),
    # --- CEL: cross-field rules -----------------------------------------------------------------------
    Case("gdr-needs-separated", _set("spec.transfer.mode", "GDR"), "spec.transfer.mode", "CEL",
         base=colocated, also="GDR"),
    Case("ipc-needs-same-node", _set("spec.transfer.mode", "IPC"), "spec.transfer.mode", "CEL",
         also="kubernetes.io/hostname"),
    Case("trainer-gpus-vs-parallelism", _set("spec.trainer.parallelism.data", 2), "spec.trainer", "CEL",
         also="gpusPerPod"),
    Case("cpu-trainer-vs-parallelism",
         _all(_set("spec.trainer.gpusPerPod", 0), _set("spec.trainer.replicas", 3)), "spec.trainer", "CEL",
         also="gpusPerPod=0"),
    Case("inference-tp-divides-gpus", _set("spec.inference.parallelism.tensor", 4),
         "spec.inference.parallelism.tensor", "CEL", also="gpusPerReplica"),
    Case("pods-per-replica-divides-gpus", _set("spec.inference.podsPerReplica", 3),
         "spec.inference.podsPerReplica", "CEL"),
    Case("colocated-gpu-totals", _set("spec.inference.replicas", 4), "spec.inference.replicas", "CEL",
         base=colocated, also="Colocated"),
    Case("colocated-alignment",
         _all(_set("spec.inference.gpusPerReplica", 16), _set("spec.inference.replicas", 1)),
         "spec.inference.gpusPerReplica", "CEL", base=colocated),
    Case("colocated-http-engine-needs-gpus",
         _all(_set("spec.trainer.gpusPerPod", 0), _set("spec.trainer.parallelism.data", 2),
              _set("spec.trainer.replicas", 2), _set("spec.inference.gpusPerReplica", 0),
              _set("spec.inference.parallelism.tensor", 1), _set("spec.inference.replicas", 2)),
         "spec.inference.gpusPerReplica", "CEL", base=colocated, also="CUDA IPC"),
    Case("dra-needs-colocated", _set("spec.placement.dra", {"deviceClassName": "gpu.nvidia.com"}),
         "spec.placement.dra", "CEL"),
    Case("topology-key-needs-separated", _set("spec.placement.topologyKey", "kubernetes.io/hostname"),
         "spec.placement.topologyKey", "CEL", base=colocated),
    Case("max-unavailable-zero-percent", _set("spec.updatePolicy", {"maxUnavailable": "0%"}),
         "spec.updatePolicy.maxUnavailable", "CEL"),
    Case("update-strategy-enum", _set("spec.updatePolicy", {"strategy": "BlueGreen"}),
         "spec.updatePolicy.strategy", "enum"),
    Case("max-unavailable-garbage", _set("spec.updatePolicy", {"maxUnavailable": "half"}),
         "spec.updatePolicy.maxUnavailable", "CEL"),
    Case("delta-sync-needs-gdr", _set("spec.transfer.deltaSync", {"enabled": True}), "spec.transfer.deltaSync",
         "CEL", also="IPC and NCCL always send full buckets"),
    Case("delta-sync-not-over-ipc", _set("spec.transfer.deltaSync", {"enabled": True, "maxChangedFraction": 0.2}),
         "spec.transfer.deltaSync", "CEL", base=colocated, also="transfer.mode GDR"),
    Case("ring-staging-not-with-delta-sync",
         _all(_set("spec.transfer.mode", "GDR"), _set("spec.transfer.deltaSync", {"enabled": True}),
              _set("spec.transfer.staging", {"mode": "Ring"})),
         "spec.transfer.staging", "CEL", also="deltaSync.enabled=false"),
    Case("fan-out-relay-not-over-ipc", _set("spec.transfer.fanOut", "Relay"), "spec.transfer.fanOut", "CEL",
         base=colocated, also="transfer.mode NCCL"),
    Case("fan-out-relay-not-with-delta-sync",
         _all(_set("spec.transfer.mode", "GDR"), _set("spec.transfer.deltaSync", {"enabled": True}),
              _set("spec.transfer.fanOut", "Relay")),
         "spec.transfer.fanOut", "CEL", also="not the trainer's deltas"),
    Case("fan-out-enum", _set("spec.transfer.fanOut", "Tree"), "spec.transfer.fanOut", "enum"),
    Case("ring-staging-depth-range", _set("spec.transfer.staging", {"mode": "Ring", "depth": 0}),
         "spec.transfer.staging.depth", "bound"),
    Case("engine-url-scheme", _set("spec.inference.engine.url", "ftp://engine:30000"),
         "spec.inference.engine.url", "CEL"),
    Case("lora-needs-an-http-engine",
         _all(_set("spec.inference.engine", {"type": "Custom", "lora": {
             "adapterName": "policy", "config": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}}})),
         "spec.inference.engine.lora", "CEL", also="SGLang or VLLM"),
    Case("lora-config-needs-rank", _set("spec.inference.engine.lora", {
        "adapterName": "policy", "config": {"lora_alpha": 16, "target_modules": ["q_proj"]}}),
         "spec.inference.engine.lora.config.r", "required"),
    Case("lora-name-pattern", _set("spec.inference.engine.lora", {
        "adapterName": "../etc", "config": {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}}),
         "spec.inference.engine.lora.adapterName", "pattern"),
    Case("name-too-long", _set("metadata.name", "a" * 41), "metadata.name", "CEL"),
    # F1 (hostile-input issue): the API server takes any DNS-1123 subdomain for a custom resource, but the
    # job's Service name must be a DNS-1035 label; the operator's Service create got 422 forever
    Case("name-with-a-dot", _set("metadata.name", "grpo.run-2"), "metadata.name", "CEL", also="DNS-1035"),
    Case("name-leading-digit", _set("metadata.name", "7b-grpo"), "metadata.name", "CEL", also="starting with a letter"),
    # --- CEL: immutable fields on a running job (update) -----------------------------------------------
    Case("immutable-placement", _set("spec.placement.topologyKey", "kubernetes.io/hostname"), "spec.placement",
         "immutable", op="update", also="immutable"),
    Case("immutable-transfer-mode", _set("spec.transfer.mode", "GDR"), "spec.transfer.mode", "immutable",
         op="update", also="immutable"),
    Case("immutable-trainer-parallelism",
         _all(_set("spec.trainer.parallelism.tensor", 4), _set("spec.trainer.parallelism.data", 2)),
         "spec.trainer.parallelism", "immutable", op="update", also="immutable"),
    Case("immutable-trainer-replicas",
         _all(_set("spec.trainer.replicas", 1), _set("spec.trainer.gpusPerPod", 8)),
         "spec.trainer.replicas", "immutable", op="update", also="immutable"),
    Case("immutable-inference-gpus", _set("spec.inference.gpusPerReplica", 4), "spec.inference.gpusPerReplica",
         "immutable", op="update", also="immutable"),
    Case("immutable-engine-type", _set("spec.inference.engine.type", "VLLM"), "spec.inference.engine.type",
         "immutable", op="update", also="immutable"),
    Case("immutable-inference-template", _set("spec.inference.template.spec.containers.0.image", "other:2"),
         "spec.inference.template", "immutable", op="update", also="immutable"),
]

CREATE_CASES = [c for c in CASES if c.op == "create"]
UPDATE_CASES = [c for c in CASES if c.op == "update"]

# Updates that must be accepted on a running job.
ALLOWED_UPDATES: list[tuple[str, Callable[[Obj], None]]] = [
    ("scale-inference", _set("spec.inference.replicas", 5)),
    ("pause", _set("spec.paused", True)),
    ("update-policy", _set("spec.updatePolicy", {"maxUnavailable": 2, "maxStaleness": 3, "pauseGeneration": False})),
    ("update-strategy-atomic", _set("spec.updatePolicy", {"strategy": "Atomic"})),
    ("bucket-size", _set("spec.transfer.bucketSizeMB", 256)),
    ("verify", _set("spec.transfer.verify", "Checksum")),
    ("delta-sync-disabled", _set("spec.transfer.deltaSync", {"enabled": False, "maxChangedFraction": 0.3})),  # NCCL: off is ok
    ("ring-staging", _set("spec.transfer.staging", {"mode": "Ring", "depth": 3})),
    ("fan-out-relay", _set("spec.transfer.fanOut", "Relay")),
]
