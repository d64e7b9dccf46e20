"""The WeightSyncJob API as pydantic v2 models: the single source of truth for the CRD schema.

`weightsync.crds.schema` turns these models into the structural OpenAPI v3 schema of the CRD; the
cross-field rules below are written once, as a CEL expression for the API server and a Python predicate
for the operator and unit tests, so both refuse the same objects with the same message.

Counting rules (documented here because the operator's placement planner relies on them):

* Trainer: one rank per GPU. World size W = tensor * pipeline * data must equal
  replicas * gpusPerPod. A CPU-only trainer (gpusPerPod = 0, used by the demo and CI) runs one rank per
  pod, so replicas must equal W.
* Inference: a replica is one engine instance spread over podsPerReplica pods. With GPUs it has one rank
  per GPU (gpusPerReplica ranks; parallelism.tensor divides it, the quotient is the engine's data
  parallel size) and podsPerReplica divides gpusPerReplica. A CPU-only replica has `tensor` ranks and
  podsPerReplica divides `tensor`.
* Colocated: the trainer pods are the colocated pods (trainer.replicas of them, trainer.gpusPerPod GPUs
  each) and the inference ranks live on the same GPUs, so the totals must match:
  inference.replicas * gpusPerReplica == trainer.replicas * gpusPerPod. Each colocated pod holds either
  whole single-pod replicas (podsPerReplica = 1 and gpusPerReplica divides gpusPerPod) or exactly one pod
  of a multi-pod replica (gpusPerReplica / podsPerReplica == gpusPerPod). Without GPUs:
  inference.replicas * podsPerReplica == trainer.replicas (one inference pod per colocated pod).
  Because of this rule, a Colocated job cannot scale inference.replicas on its own.
* Transfer mode Auto resolves to IPC for Colocated, GDR for Separated when the operator is configured
  with an RDMA resource (see `effective_transfer_mode`), else NCCL. GDR is only valid for Separated; IPC
  only for Colocated or for Separated packed onto one node (placement.topologyKey =
  kubernetes.io/hostname).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from weightsync.crds import contract
from weightsync.crds.k8s_schema import pod_template_schema

# --- Enumerations ---------------------------------------------------------------------------------------
PlacementMode = Literal["Colocated", "Separated"]
TransferModeSpec = Literal["Auto", "IPC", "NCCL", "GDR"]
TransferMode = Literal["IPC", "NCCL", "GDR"]
VerifyMode = Literal["None", "Checksum"]
EngineType = Literal["SGLang", "VLLM", "Custom"]
UpdateStrategy = Literal["Rolling", "Atomic"]
ConditionStatus = Literal["True", "False", "Unknown"]

HOSTNAME_TOPOLOGY_KEY = "kubernetes.io/hostname"
# The operator's default RDMA resource (OperatorConfig.rdma_resource_name) when spec.transfer.rdmaResourceName
# is unset; an extended resource name `<domain>/<name>`.
DEFAULT_RDMA_RESOURCE = "rdma/hca_shared_devices_a"
RDMA_RESOURCE_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
# Owned pods are named `<job>-inference-<replica>-<index>`; keeping the job name short keeps every owned
# name a valid DNS label (63 characters) and a valid label value.
MAX_JOB_NAME_LENGTH = 40
# The job's Service is named after the job, and a Service name is a DNS-1035 label: lowercase letters,
# digits and '-', starting with a letter. The API server accepts any DNS-1123 subdomain for a custom
# resource ('grpo.run-2', '7b-grpo'), so without this rule such a job is stored and its Service never is.
JOB_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
JOB_NAME_MESSAGE = (
    f"metadata.name must be a DNS-1035 label of at most {MAX_JOB_NAME_LENGTH} characters: lowercase letters, "
    "digits and '-', starting with a letter and ending with a letter or digit (no dots), because the job's "
    "Service, pods (<job>-inference-<replica>-<index>), Secret and ServiceAccount are named after it"
)
_PERCENT_RE = re.compile(r"^(100|[1-9][0-9]?)%$")


# --- Cross-field rules: one CEL expression and one Python predicate each --------------------------------
@dataclass(frozen=True)
class Rule:
    """A validation rule the API server checks in CEL and pydantic checks in Python.

    `cel` is evaluated with `self` bound to the object of the model the rule is attached to; `check`
    receives the same object as a pydantic model and returns True when the object is valid.
    """

    cel: str
    message: str
    check: Callable[[Any], bool]
    field_path: str | None = None

    def to_k8s(self) -> dict[str, str]:
        out = {"rule": self.cel, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out


def immutable(path: str) -> dict[str, Any]:
    """json_schema_extra for a field that must not change once the job exists (a CEL transition rule)."""
    return {
        "x-kubernetes-validations": [
            {
                "rule": "self == oldSelf",
                "message": f"{path} is immutable: delete and recreate the WeightSyncJob to change it",
            }
        ]
    }


def _rules_schema_extra(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    rules: tuple[Rule, ...] = getattr(cls, "__rules__", ())
    if rules:
        schema["x-kubernetes-validations"] = [r.to_k8s() for r in rules]


class _Model(BaseModel):
    """Base: camelCase aliases, unknown fields refused (the API server prunes them; we fail loudly),
    and the class's `__rules__` checked after field validation."""

    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        validate_assignment=False,
        json_schema_extra=_rules_schema_extra,
    )
    __rules__: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> Any:
        failed = [r.message for r in self.__rules__ if not r.check(self)]
        if failed:
            raise ValueError("; ".join(failed))
        return self

    def to_dict(self) -> dict[str, Any]:
        """The camelCase JSON form the API server stores (None fields left out)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# --- Pod templates --------------------------------------------------------------------------------------
def _check_template(value: dict[str, Any]) -> dict[str, Any]:
    spec = value.get("spec")
    if not isinstance(spec, dict):
        raise ValueError("template.spec is required (a PodSpec with at least one container)")
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
        raise ValueError("template.spec.containers must list at least one container")
    for i, c in enumerate(containers):
        if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not c["name"]:
            raise ValueError(f"template.spec.containers[{i}].name is required")
    return value


# The full core/v1 PodTemplateSpec schema (crds/k8s_schema.py: a snapshot of the pinned kube-apiserver's
# OpenAPI): the API server refuses unknown fields with --validate=strict and `kubectl explain` documents
# every field. The operator still validates the whole pod with a server-side dry-run create.
POD_TEMPLATE_SCHEMA: dict[str, Any] = pod_template_schema()

PodTemplate = Annotated[
    dict[str, Any],
    AfterValidator(_check_template),
    WithJsonSchema(POD_TEMPLATE_SCHEMA),
]


# --- Spec -----------------------------------------------------------------------------------------------
class DRAConfig(_Model):
    """Dynamic Resource Allocation for Colocated pods: one ResourceClaim shared by the trainer, inference
    and agent containers of a pod, so all three see the same GPUs."""

    device_class_name: str | None = Field(
        default=None,
        alias="deviceClassName",
        min_length=1,
        max_length=253,
        description="DeviceClass (resource.k8s.io/v1) the per-pod ResourceClaim requests, e.g. gpu.nvidia.com. "
        "Unset: the operator's default (Helm chart value cluster.draDeviceClassName); a job with neither is "
        "refused with a condition.",
    )


class Placement(_Model):
    """Where the trainer and inference ranks run relative to each other."""

    __rules__ = (
        Rule(
            cel="!has(self.dra) || self.mode == 'Colocated'",
            message="spec.placement.dra is only used by Colocated jobs: remove it or set spec.placement.mode=Colocated",
            check=lambda p: p.dra is None or p.mode == "Colocated",
            field_path=".dra",
        ),
        Rule(
            cel="!has(self.topologyKey) || self.mode == 'Separated'",
            message="spec.placement.topologyKey only applies to Separated jobs (Colocated pods already share GPUs): remove it",
            check=lambda p: p.topology_key is None or p.mode == "Separated",
            field_path=".topologyKey",
        ),
    )

    mode: PlacementMode = Field(
        description="Colocated: one pod per GPU set holds the trainer, the inference engine and the agent, "
        "on the same GPUs. Separated: trainer and inference run in distinct pods on distinct GPUs.",
    )
    topology_key: str | None = Field(
        default=None,
        alias="topologyKey",
        min_length=1,
        max_length=253,
        description="Separated only: a node label key (e.g. kubernetes.io/hostname, a rack or NVLink-domain "
        "label); all trainer and inference pods are packed into one domain of this key. "
        "kubernetes.io/hostname puts them on one node and makes transfer.mode=IPC possible.",
    )
    dra: DRAConfig | None = Field(
        default=None,
        description="Colocated only: share the pod's GPUs through one DRA ResourceClaim instead of the device plugin "
        "(`dra: {}` uses the operator's default DeviceClass). Without DRA, Colocated is valid only for whole-node pods.",
    )


class DeltaSync(_Model):
    """Send only the words of each bucket that changed since the last synced version (GDR transport only)."""

    enabled: bool = Field(default=False, description="Send only the changed words of a bucket when that is smaller.")
    max_changed_fraction: float = Field(
        default=0.1,
        alias="maxChangedFraction",
        ge=0.0,
        le=1.0,
        description="Above this fraction of changed words in a bucket that bucket is sent in full (0..1).",
    )


class Staging(_Model):
    """Where the trainer's published versions wait to be sent (docs/performance.md, "Memory")."""

    mode: Literal["Version", "Ring"] = Field(
        default="Version",
        description="Version: the trainer agent stages whole versions (memory: 2 x the trainer pod's shard bytes, in "
        "GPU memory for a Colocated job with GPUs, whose agent stages on the GPUs it shares; host memory otherwise); "
        "publish holds the trainer for one copy. Ring: every transfer streams through `depth` bucket-sized slots "
        "that the trainer fills (memory: depth x bucketSizeMB per trainer rank, whatever the model size); the "
        "trainer is held only for a device snapshot when its tensors are on a GPU, else until the version is "
        "served (or it asks for a host snapshot). Not with deltaSync.",
    )
    depth: int = Field(default=2, ge=1, le=16,
                       description="Ring: slots per transfer (bucket k+1 is filled while bucket k is on the wire).")


def _delta_mode_ok(t: TransferSpec) -> bool:
    return t.delta_sync is None or not t.delta_sync.enabled or t.mode not in ("IPC", "NCCL")


def _relay_over_a_network(t: TransferSpec) -> bool:
    return t.fan_out != "Relay" or (t.mode != "IPC" and (t.delta_sync is None or not t.delta_sync.enabled))


def _ring_without_delta(t: TransferSpec) -> bool:
    return t.staging is None or t.staging.mode != "Ring" or t.delta_sync is None or not t.delta_sync.enabled


class TransferSpec(_Model):
    """How weights move from the trainer to the inference engines."""

    __rules__ = (
        Rule(
            cel="!(has(self.deltaSync) && has(self.deltaSync.enabled) && self.deltaSync.enabled && "
            "has(self.mode) && (self.mode == 'IPC' || self.mode == 'NCCL'))",
            message="spec.transfer.deltaSync needs transfer.mode GDR (or Auto on a cluster with RDMA): IPC and "
            "NCCL always send full buckets; remove deltaSync (or set deltaSync.enabled=false), or use "
            "transfer.mode GDR or Auto",
            check=_delta_mode_ok,
            field_path=".deltaSync",
        ),
        Rule(
            cel="!(has(self.staging) && has(self.staging.mode) && self.staging.mode == 'Ring' && "
            "has(self.deltaSync) && has(self.deltaSync.enabled) && self.deltaSync.enabled)",
            message="spec.transfer.staging.mode Ring cannot be combined with deltaSync: delta sync encodes each "
            "bucket against the previous version's in send slots of its own, which the ring does not have; use "
            "staging.mode Version or set deltaSync.enabled=false",
            check=_ring_without_delta,
            field_path=".staging",
        ),
        Rule(
            cel="!(has(self.fanOut) && self.fanOut == 'Relay' && ((has(self.mode) && self.mode == 'IPC') || "
            "(has(self.deltaSync) && has(self.deltaSync.enabled) && self.deltaSync.enabled)))",
            message="spec.transfer.fanOut Relay needs transfer.mode NCCL or GDR (or Auto: a Colocated job's IPC "
            "moves no bytes between pods and is sent directly) and no deltaSync (a relay forwards the buckets "
            "it received, not the trainer's deltas); use fanOut Direct, or set deltaSync.enabled=false",
            check=_relay_over_a_network,
            field_path=".fanOut",
        ),
    )

    mode: TransferModeSpec = Field(
        default="Auto",
        description="Auto | IPC | NCCL | GDR. Auto: Colocated -> IPC; Separated -> GDR when the operator has "
        "an RDMA resource configured, else NCCL. GDR needs Separated; IPC needs Colocated or Separated "
        "with placement.topologyKey=kubernetes.io/hostname. Immutable.",
        json_schema_extra=immutable("spec.transfer.mode"),
    )
    bucket_size_mb: int = Field(
        default=512,
        alias="bucketSizeMB",
        ge=1,
        le=16384,
        description="Weights move in flattened buckets of at most this many MiB: the bound on transient memory per bucket.",
    )
    verify: VerifyMode = Field(
        default="None",
        description="None | Checksum. Checksum: every bucket is checksummed and compared before a version is committed.",
    )
    timeout_seconds: int = Field(
        default=600,
        alias="timeoutSeconds",
        ge=1,
        le=86400,
        description="A sync of one version that takes longer fails (the engine is resumed, the old version kept).",
    )
    delta_sync: DeltaSync | None = Field(
        default=None,
        alias="deltaSync",
        description="Optional: send only the words of a bucket that changed since the previous version. "
        "Only the GDR transport sends deltas: refused with an explicit mode IPC or NCCL; with mode Auto "
        "resolving to IPC or NCCL full buckets are sent (the agent logs it once).",
    )
    fan_out: Literal["Direct", "Relay"] = Field(
        default="Direct",
        alias="fanOut",
        description="Direct | Relay. Direct: every trainer rank sends each version to every inference replica. "
        "Relay: the replicas fetching one version together form a chain, the trainer sends each byte to the "
        "first and each replica forwards every bucket it checked to the next (trainer egress once per version, "
        "not once per replica). NCCL and GDR, not with deltaSync; replicas whose ranks span pods are sent directly "
        "(docs/placement-and-transfer.md, \"Fan-out\").",
    )
    staging: Staging | None = Field(
        default=None,
        description="Optional: how the trainer agent stages versions (unset: whole versions, mode Version). "
        "Ring bounds the trainer pod's staging memory by depth x bucketSizeMB per trainer rank.",
    )
    rdma_resource_name: str | None = Field(
        default=None,
        alias="rdmaResourceName",
        min_length=1,
        max_length=253,
        pattern=RDMA_RESOURCE_PATTERN,
        description="Extended resource requested (1 per pod) for GDR, e.g. rdma/hca_shared_devices_a from the RDMA "
        "shared device plugin. Unset: the operator's default (Helm chart value cluster.rdmaResourceName, "
        f"{DEFAULT_RDMA_RESOURCE} unless changed).",
    )


class TrainerParallelism(_Model):
    """The trainer's parallel layout; world size = tensor * pipeline * data."""

    tensor: int = Field(default=1, ge=1, le=1024, description="Tensor parallel size.")
    pipeline: int = Field(default=1, ge=1, le=1024, description="Pipeline parallel size.")
    data: int = Field(default=1, ge=1, le=65536, description="Data parallel (or FSDP shard) size.")

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline * self.data


class TrainerSpec(_Model):
    """The trainer pods: they publish each new version of the weights."""

    __rules__ = (
        Rule(
            cel="self.gpusPerPod == 0 || self.replicas * self.gpusPerPod == "
            "self.parallelism.tensor * self.parallelism.pipeline * self.parallelism.data",
            message="spec.trainer: replicas * gpusPerPod must equal parallelism.tensor * parallelism.pipeline * "
            "parallelism.data (one trainer rank per GPU); fix the replica count, GPUs per pod or parallelism",
            check=lambda t: t.gpus_per_pod == 0 or t.replicas * t.gpus_per_pod == t.parallelism.world_size,
        ),
        Rule(
            cel="self.gpusPerPod != 0 || self.replicas == "
            "self.parallelism.tensor * self.parallelism.pipeline * self.parallelism.data",
            message="spec.trainer: a CPU-only trainer (gpusPerPod=0) runs one rank per pod, so replicas must equal "
            "parallelism.tensor * parallelism.pipeline * parallelism.data",
            check=lambda t: t.gpus_per_pod != 0 or t.replicas == t.parallelism.world_size,
        ),
    )

    replicas: int = Field(
        ge=1, le=4096, description="Number of trainer pods. Immutable.",
        json_schema_extra=immutable("spec.trainer.replicas"),
    )
    gpus_per_pod: int = Field(
        alias="gpusPerPod",
        ge=0,
        le=16,
        description="GPUs requested by each trainer pod (nvidia.com/gpu); 0 for a CPU-only trainer (one rank per pod). Immutable.",
        json_schema_extra=immutable("spec.trainer.gpusPerPod"),
    )
    parallelism: TrainerParallelism = Field(
        default_factory=TrainerParallelism,
        description="Tensor, pipeline and data parallel sizes of the trainer. Immutable.",
        json_schema_extra=immutable("spec.trainer.parallelism"),
    )
    template: PodTemplate = Field(
        description="Pod template of a trainer pod (a core/v1 PodTemplateSpec). The operator adds the agent "
        "sidecar, volumes, env and GPU requests. Immutable.",
        json_schema_extra=immutable("spec.trainer.template"),
    )

    @property
    def world_size(self) -> int:
        return self.parallelism.world_size

    @property
    def ranks_per_pod(self) -> int:
        return self.gpus_per_pod if self.gpus_per_pod > 0 else 1


class InferenceParallelism(_Model):
    """The inference engine's parallel layout."""

    tensor: int = Field(default=1, ge=1, le=64, description="Tensor parallel size of one engine replica. Immutable.")


LORA_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
LORA_CONFIG_REQUIRED = ("r", "lora_alpha", "target_modules")

LoraConfig = Annotated[
    dict[str, Any],
    WithJsonSchema({
        "type": "object", "x-kubernetes-preserve-unknown-fields": True,
        "description": "The adapter's PEFT adapter_config.json (r, lora_alpha, target_modules, ...), handed to "
                       "the engine with every version.",
        "required": list(LORA_CONFIG_REQUIRED),
        "properties": {
            "r": {"type": "integer", "minimum": 1, "description": "LoRA rank."},
            "lora_alpha": {"type": "number", "description": "LoRA scaling numerator."},
            "target_modules": {"x-kubernetes-preserve-unknown-fields": True,
                               "description": "Module names (a list) or a PEFT shorthand such as all-linear."},
        },
    }),
]


class LoraSpec(_Model):
    """Sync a LoRA adapter instead of the base weights: the trainer publishes only the adapter's tensors
    (PEFT names, e.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`) and each version
    replaces the engine's adapter of this name through its adapter-loading endpoint."""

    adapter_name: str = Field(
        alias="adapterName", pattern=LORA_NAME_PATTERN, max_length=64,
        description="The adapter's name in the engine: what requests ask for (SGLang `lora_path`, vLLM `model`).",
    )
    config: LoraConfig
    pinned: bool = Field(default=False, description="SGLang: keep the adapter in GPU memory (never evicted).")

    @field_validator("config")
    @classmethod
    def _peft_config(cls, v: dict[str, Any]) -> dict[str, Any]:
        missing = [k for k in LORA_CONFIG_REQUIRED if k not in v]
        if missing:
            raise ValueError(f"spec.inference.engine.lora.config must be a PEFT adapter_config: missing {missing}")
        if not isinstance(v["r"], int) or isinstance(v["r"], bool) or v["r"] < 1:
            raise ValueError("spec.inference.engine.lora.config.r must be an integer >= 1")
        return v


class EngineSpec(_Model):
    """The inference engine the agent drives."""

    __rules__ = (
        Rule(
            cel="!has(self.lora) || self.type != 'Custom'",
            message="spec.inference.engine.lora needs an SGLang or VLLM engine (their adapter-loading endpoints); "
            "a Custom engine receives every published tensor as it is",
            check=lambda e: e.lora is None or e.type != "Custom",
            field_path=".lora",
        ),
        Rule(
            cel="!has(self.url) || self.url.startsWith('http://') || self.url.startsWith('https://')",
            message="spec.inference.engine.url must start with http:// or https://",
            check=lambda e: e.url is None or e.url.startswith(("http://", "https://")),
            field_path=".url",
        ),
    )

    type: EngineType = Field(
        description="SGLang | VLLM | Custom (the trainer-side Python client calls back into your engine). Immutable.",
        json_schema_extra=immutable("spec.inference.engine.type"),
    )
    port: int = Field(default=30000, ge=1, le=65535, description="HTTP port of the engine inside the inference pod.")
    url: str | None = Field(
        default=None,
        max_length=512,
        description="Engine base URL as seen from the agent; default http://127.0.0.1:<port>.",
    )
    lora: LoraSpec | None = Field(
        default=None,
        description="Sync a LoRA adapter (MBs) into the engine's adapter-loading endpoint instead of base weights.",
    )


class InferenceSpec(_Model):
    """The inference engines: each replica loads every new version."""

    __rules__ = (
        Rule(
            cel="self.gpusPerReplica == 0 || self.gpusPerReplica % self.parallelism.tensor == 0",
            message="spec.inference.parallelism.tensor must divide spec.inference.gpusPerReplica "
            "(one engine rank per GPU); change the tensor parallel size or the GPUs per replica",
            check=lambda i: i.gpus_per_replica == 0 or i.gpus_per_replica % i.parallelism.tensor == 0,
            field_path=".parallelism.tensor",
        ),
        Rule(
            cel="self.gpusPerReplica == 0 || self.gpusPerReplica % self.podsPerReplica == 0",
            message="spec.inference.podsPerReplica must divide spec.inference.gpusPerReplica "
            "(every pod of a replica gets the same number of GPUs)",
            check=lambda i: i.gpus_per_replica == 0 or i.gpus_per_replica % i.pods_per_replica == 0,
            field_path=".podsPerReplica",
        ),
        Rule(
            cel="self.gpusPerReplica != 0 || self.parallelism.tensor % self.podsPerReplica == 0",
            message="spec.inference.podsPerReplica must divide spec.inference.parallelism.tensor for a CPU-only "
            "engine (gpusPerReplica=0 runs `tensor` ranks per replica)",
            check=lambda i: i.gpus_per_replica != 0 or i.parallelism.tensor % i.pods_per_replica == 0,
            field_path=".podsPerReplica",
        ),
    )

    replicas: int = Field(
        ge=0, le=4096,
        description="Number of engine replicas. Mutable: scale up or down; new replicas catch up to the current version.",
    )
    gpus_per_replica: int = Field(
        alias="gpusPerReplica",
        ge=0,
        le=64,
        description="GPUs of one engine replica (spread over podsPerReplica pods); 0 for a CPU-only engine. Immutable.",
        json_schema_extra=immutable("spec.inference.gpusPerReplica"),
    )
    pods_per_replica: int = Field(
        default=1,
        alias="podsPerReplica",
        ge=1,
        le=64,
        description="Pods per engine replica (multi-node engines). Immutable.",
        json_schema_extra=immutable("spec.inference.podsPerReplica"),
    )
    parallelism: InferenceParallelism = Field(
        default_factory=InferenceParallelism,
        description="Parallel layout of one engine replica. Immutable.",
        json_schema_extra=immutable("spec.inference.parallelism"),
    )
    engine: EngineSpec = Field(description="The engine type and endpoint.")
    template: PodTemplate = Field(
        description="Pod template of an inference pod (a core/v1 PodTemplateSpec). The operator adds the agent "
        "sidecar, volumes, env, GPU requests and the weightsync.io/synced readiness gate. Immutable.",
        json_schema_extra=immutable("spec.inference.template"),
    )

    @property
    def ranks_per_replica(self) -> int:
        return self.gpus_per_replica if self.gpus_per_replica > 0 else self.parallelism.tensor

    @property
    def ranks_per_pod(self) -> int:
        return self.ranks_per_replica // self.pods_per_replica

    @property
    def gpus_per_pod(self) -> int:
        return self.gpus_per_replica // self.pods_per_replica


def _validate_int_or_percent(value: int | str) -> int | str:
    if isinstance(value, bool):
        raise ValueError("spec.updatePolicy.maxUnavailable must be an integer >= 1 or a percentage like '25%'")
    if isinstance(value, int):
        if value < 1:
            raise ValueError("spec.updatePolicy.maxUnavailable must be an integer >= 1 or a percentage like '25%'")
        return value
    if not _PERCENT_RE.match(value):
        raise ValueError("spec.updatePolicy.maxUnavailable must be an integer >= 1 or a percentage like '25%'")
    return value


IntOrPercent = Annotated[
    StrictInt | StrictStr,
    AfterValidator(_validate_int_or_percent),
    WithJsonSchema({"x-kubernetes-int-or-string": True}),
]


class UpdatePolicy(_Model):
    """How a new version rolls out over the inference replicas."""

    strategy: UpdateStrategy = Field(
        default="Rolling",
        description="Rolling: replicas load a new version in waves bounded by maxUnavailable (Ready replicas may "
        "serve two versions meanwhile). Atomic: a two-phase update: every serving replica fetches and verifies the "
        "version without serving it (prepare), then all switch together (commit); a replica failing to prepare "
        "keeps every replica on the previous version, and Ready replicas never serve two versions.",
    )
    pause_generation: bool = Field(
        default=True,
        alias="pauseGeneration",
        description="Pause the engine's generation around each load; it is always resumed, also when the load fails.",
    )
    max_unavailable: IntOrPercent = Field(
        default="25%",
        alias="maxUnavailable",
        description="Inference replicas loading a new version at once: an integer >= 1 or a percentage of "
        "replicas ('25%', rounded down, at least 1).",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "type(self) == int ? self >= 1 : self.matches('^(100|[1-9][0-9]?)%$')",
                    "message": "spec.updatePolicy.maxUnavailable must be an integer >= 1 or a percentage from 1% to 100% (e.g. '25%')",
                }
            ]
        },
    )
    max_staleness: int = Field(
        default=1,
        alias="maxStaleness",
        ge=0,
        le=1000,
        description="A replica more than this many versions behind the trainer is NotReady (leaves the Service endpoints).",
    )


def _colocated_totals_ok(s: WeightSyncJobSpec) -> bool:
    if s.placement.mode != "Colocated":
        return True
    t, i = s.trainer, s.inference
    if t.gpus_per_pod > 0 or i.gpus_per_replica > 0:
        return i.replicas * i.gpus_per_replica == t.replicas * t.gpus_per_pod
    return i.replicas * i.pods_per_replica == t.replicas


def _colocated_alignment_ok(s: WeightSyncJobSpec) -> bool:
    if s.placement.mode != "Colocated" or s.trainer.gpus_per_pod == 0 or s.inference.gpus_per_replica == 0:
        return True
    t, i = s.trainer, s.inference
    if i.pods_per_replica == 1:
        return t.gpus_per_pod % i.gpus_per_replica == 0
    return i.gpus_per_replica // i.pods_per_replica == t.gpus_per_pod


def _colocated_http_engine_has_gpus(s: Any) -> bool:
    return not (s.placement.mode == "Colocated" and s.inference.engine.type != "Custom"
                and s.inference.gpus_per_replica == 0)


class WeightSyncJobSpec(_Model):
    """Desired state: trainer and inference pods, their placement and how weights move between them."""

    __rules__ = (
        Rule(
            cel="!(self.placement.mode == 'Colocated' && self.inference.engine.type != 'Custom' && "
            "self.inference.gpusPerReplica == 0)",
            message="spec.inference.gpusPerReplica: a Colocated SGLang or VLLM engine takes weights as CUDA IPC "
            "handles on its own GPUs, and a CPU tensor cannot be handed to another container; give the "
            "replicas GPUs, use placement Separated (the engine then receives over its weight-update group), "
            "or engine type Custom",
            check=_colocated_http_engine_has_gpus,
            field_path=".inference.gpusPerReplica",
        ),
        Rule(
            cel="self.transfer.mode != 'GDR' || self.placement.mode == 'Separated'",
            message="spec.transfer.mode: GDR (GPUDirect RDMA between pods) needs spec.placement.mode=Separated; "
            "use IPC or Auto for a Colocated job",
            check=lambda s: s.transfer.mode != "GDR" or s.placement.mode == "Separated",
            field_path=".transfer.mode",
        ),
        Rule(
            cel="self.transfer.mode != 'IPC' || self.placement.mode == 'Colocated' || "
            "(has(self.placement.topologyKey) && self.placement.topologyKey == 'kubernetes.io/hostname')",
            message="spec.transfer.mode: IPC needs all pods on one node: set spec.placement.mode=Colocated, or "
            "spec.placement.topologyKey=kubernetes.io/hostname for a Separated job; otherwise use NCCL or GDR",
            check=lambda s: s.transfer.mode != "IPC"
            or s.placement.mode == "Colocated"
            or s.placement.topology_key == HOSTNAME_TOPOLOGY_KEY,
            field_path=".transfer.mode",
        ),
        Rule(
            cel="self.placement.mode != 'Colocated' || "
            "((self.trainer.gpusPerPod > 0 || self.inference.gpusPerReplica > 0) ? "
            "self.inference.replicas * self.inference.gpusPerReplica == self.trainer.replicas * self.trainer.gpusPerPod : "
            "self.inference.replicas * self.inference.podsPerReplica == self.trainer.replicas)",
            message="spec.inference.replicas: a Colocated job runs inference on the trainer's GPUs, so "
            "inference.replicas * inference.gpusPerReplica must equal trainer.replicas * trainer.gpusPerPod "
            "(CPU-only: inference.replicas * inference.podsPerReplica == trainer.replicas)",
            check=_colocated_totals_ok,
            field_path=".inference.replicas",
        ),
        Rule(
            cel="self.placement.mode != 'Colocated' || self.trainer.gpusPerPod == 0 || "
            "self.inference.gpusPerReplica == 0 || (self.inference.podsPerReplica == 1 ? "
            "self.trainer.gpusPerPod % self.inference.gpusPerReplica == 0 : "
            "self.inference.gpusPerReplica / self.inference.podsPerReplica == self.trainer.gpusPerPod)",
            message="spec.inference.gpusPerReplica: in a Colocated job each pod holds whole replicas "
            "(podsPerReplica=1 and gpusPerReplica divides trainer.gpusPerPod) or one pod of a multi-pod replica "
            "(gpusPerReplica / podsPerReplica == trainer.gpusPerPod)",
            check=_colocated_alignment_ok,
            field_path=".inference.gpusPerReplica",
        ),
    )

    placement: Placement = Field(
        description="Colocated or Separated, plus optional topology packing and DRA. Immutable.",
        json_schema_extra=immutable("spec.placement"),
    )
    transfer: TransferSpec = Field(
        default_factory=TransferSpec, description="How weights move: mode, bucket size, verification, timeout."
    )
    trainer: TrainerSpec = Field(description="The trainer pods that publish weights.")
    inference: InferenceSpec = Field(description="The inference engine replicas that load weights.")
    update_policy: UpdatePolicy = Field(
        default_factory=UpdatePolicy,
        alias="updatePolicy",
        description="Rollout of a new version over the inference replicas.",
    )
    paused: bool = Field(
        default=False,
        description="Pause generation on every inference replica until unset (user pause/resume).",
    )


# --- Status ---------------------------------------------------------------------------------------------
class Condition(_Model):
    """A metav1.Condition."""

    type: str = Field(min_length=1, max_length=316, description="Ready, Synced, Progressing, Paused or Degraded.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        description="CamelCase reason for the last transition.",
    )
    message: str = Field(default="", max_length=32768, description="Human-readable detail.")
    observed_generation: int | None = Field(
        default=None, alias="observedGeneration", ge=0,
        description="metadata.generation the condition was computed from.",
    )
    last_transition_time: datetime = Field(
        alias="lastTransitionTime", description="When status last changed (RFC 3339)."
    )

    @field_validator("last_transition_time")
    @classmethod
    def _utc_seconds(cls, v: datetime) -> datetime:
        if v.tzinfo is None:
            v = v.replace(tzinfo=timezone.utc)
        return v.astimezone(timezone.utc).replace(microsecond=0)


class ReplicaCounts(_Model):
    """Inference replica counts."""

    inference: int = Field(default=0, ge=0, description="Inference replicas that exist.")
    synced: int = Field(default=0, ge=0, description="Replicas serving the trainer's newest version.")
    ready: int = Field(default=0, ge=0, description="Replicas Ready (serving a version within maxStaleness).")


class LastSync(_Model):
    """The most recent completed sync."""

    version: int = Field(ge=0, description="Weight version synced.")
    duration_seconds: float = Field(alias="durationSeconds", ge=0, description="Wall time of the sync.")
    bytes: int = Field(ge=0, description="Bytes moved.")
    mode: TransferMode = Field(description="Transport used: IPC, NCCL or GDR.")
    relayed_from: str | None = Field(
        default=None, alias="relayedFrom", max_length=253,
        description="With transfer.fanOut Relay: the inference pod this load took its buckets from (absent: the "
                    "trainer agents sent them).")


class SyncProgress(_Model):
    """The load under way on a replica."""

    version: int = Field(ge=0, description="Version being loaded.")
    bucket: int = Field(ge=0, description="Buckets arrived so far.")
    buckets: int = Field(ge=0, description="Buckets of this replica's load.")
    bytes: int = Field(ge=0, description="Bytes arrived so far.")
    total_bytes: int = Field(alias="totalBytes", ge=0, description="Bytes of this replica's load.")


MAX_REPLICAS_IN_STATUS = 128


DIGEST_PATTERN = r"^[0-9a-f]{32}$"


class InferenceReplicaStatus(_Model):
    """One inference replica as the operator sees it (from its pods' annotations and conditions)."""

    index: int = Field(ge=0, description="Replica index.")
    pods: list[Annotated[str, Field(max_length=253, description="Pod name.")]] = Field(
        default_factory=list, max_length=64, description="The replica's pods.")
    served_version: int | None = Field(default=None, alias="servedVersion", ge=0,
                                       description="Version every pod of the replica serves.")
    served_epoch: int | None = Field(default=None, alias="servedEpoch", ge=0, description="Its trainer epoch.")
    served_digest: str | None = Field(
        default=None, alias="servedDigest", pattern=DIGEST_PATTERN, max_length=32,
        description="Content digest of servedVersion as the replica's agents checked it piece by piece against the "
                    "trainer agents' hashes (the sum over its pods for a multi-pod replica).")
    target_version: int | None = Field(default=None, alias="targetVersion", ge=0,
                                       description="Version the operator asked the replica to load.")
    ready: bool = Field(default=False, description="Every pod of the replica is Ready.")
    progress: SyncProgress | None = Field(default=None, description="The load under way, if any.")
    last_sync_seconds: float | None = Field(default=None, alias="lastSyncSeconds", ge=0,
                                            description="Wall time of the replica's last completed load.")
    last_error: str | None = Field(default=None, alias="lastError", max_length=1024,
                                   description="The last failed load's error (cleared by a successful one).")
    relayed_from: str | None = Field(
        default=None, alias="relayedFrom", max_length=253,
        description="With transfer.fanOut Relay: the pod of the replica before this one in the chain its last load "
                    "came through (absent: the trainer agents sent it).")


class WeightSyncJobStatus(_Model):
    """Observed state, written by the operator through the status subresource."""

    observed_generation: int | None = Field(
        default=None, alias="observedGeneration", ge=0, description="metadata.generation last reconciled."
    )
    mode: TransferMode | None = Field(default=None, description="Effective transfer mode (Auto resolved).")
    trainer_version: int | None = Field(
        default=None, alias="trainerVersion", ge=0, description="Newest version the trainer published."
    )
    trainer_epoch: int | None = Field(
        default=None, alias="trainerEpoch", ge=0,
        description="Trainer epoch of trainerVersion: bumped when a restarted trainer publishes again from a "
                    "version it already published, so versions are ordered by (trainerEpoch, version).",
    )
    served_version: int | None = Field(
        default=None, alias="servedVersion", ge=0, description="Lowest version served by a Ready inference replica."
    )
    served_epoch: int | None = Field(
        default=None, alias="servedEpoch", ge=0, description="Trainer epoch of servedVersion.",
    )
    trainer_digest: str | None = Field(
        default=None, alias="trainerDigest", pattern=DIGEST_PATTERN, max_length=32,
        description="Content digest of trainerVersion: the trainer agents' piece hashes, as every replica that "
                    "loaded it checked them (replicas that disagree make the job Degraded, reason DigestMismatch). "
                    "Engines label the version <N>-<first 16 digits>.",
    )
    committed_version: int | None = Field(
        default=None, alias="committedVersion", ge=0,
        description="updatePolicy.strategy Atomic: the version committed to every replica (the only version a Ready "
                    "replica serves).",
    )
    committed_epoch: int | None = Field(
        default=None, alias="committedEpoch", ge=0, description="Trainer epoch of committedVersion.",
    )
    membership_generation: int | None = Field(
        default=None, alias="membershipGeneration", ge=0,
        description="Bumped whenever the set of pods or their IPs changes (the topology's generation).",
    )
    replicas: ReplicaCounts | None = Field(default=None, description="Inference replica counts.")
    last_sync: LastSync | None = Field(default=None, alias="lastSync", description="The most recent completed sync.")
    inference_replicas: list[InferenceReplicaStatus] | None = Field(
        default=None, alias="inferenceReplicas", max_length=MAX_REPLICAS_IN_STATUS,
        description=f"Per inference replica: versions, readiness, the load under way, the last error. Jobs with "
                    f"more than {MAX_REPLICAS_IN_STATUS} replicas list the ones not serving the newest version "
                    f"first, up to {MAX_REPLICAS_IN_STATUS}.",
        # atomic, not a map keyed by index: only the operator writes status (a merge patch replaces the
        # list anyway), and an atomic list is one managed field instead of one per entry and field, which
        # halves the API server's work per status write at 128 entries (docs/performance.md)
        json_schema_extra={"x-kubernetes-list-type": "atomic"},
    )
    replica_versions: str | None = Field(
        default=None, alias="replicaVersions", max_length=256,
        description="The version each inference replica serves, in replica order (`-` for none), e.g. `7,7,6`; "
                    "with more than 16 replicas, counts per version, e.g. `7x60 6x4` (kubectl get wsj -o wide).",
    )
    selector: str | None = Field(
        default=None, max_length=512,
        description="Label selector of the inference pods (the scale subresource's, for HPAs).",
    )
    version_proof_key: str | None = Field(
        default=None, alias="versionProofKey", max_length=16, pattern="^[0-9a-f]{16}$",
        description="Fingerprint of the operator key the job's token was derived from. While it matches the "
                    "running operator's key, versions written on pods are believed only with the agent's proof "
                    "(annotation weightsync.io/version-proof).",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        description="Ready, Synced, Progressing, Paused, Degraded (metav1.Condition).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )

    def to_patch(self) -> dict[str, Any]:
        """Body for a merge patch of the status subresource: `{"status": {...}}`."""
        return {"status": self.to_dict()}

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)


class WeightSyncJob(_Model):
    """A WeightSyncJob object as read from the API server."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, json_schema_extra=_rules_schema_extra)

    api_version: Literal["weightsync.io/v1alpha1"] = Field(default=contract.API_VERSION, alias="apiVersion")
    kind: Literal["WeightSyncJob"] = Field(default=contract.KIND)
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: WeightSyncJobSpec
    status: WeightSyncJobStatus | None = None

    @field_validator("metadata")
    @classmethod
    def _name_is_a_dns_1035_label(cls, v: dict[str, Any]) -> dict[str, Any]:
        name = v.get("name")
        if isinstance(name, str) and (len(name) > MAX_JOB_NAME_LENGTH or not re.match(JOB_NAME_PATTERN, name)):
            raise ValueError(JOB_NAME_MESSAGE)
        return v

    @classmethod
    def from_k8s(cls, obj: Mapping[str, Any]) -> WeightSyncJob:
        """Parse an object from the API server (or kopf's body, whose nested values are read-only mapping
        views); raises `pydantic.ValidationError`. The input is deep-copied into plain dicts and lists."""
        return cls.model_validate(_plain(obj))

    @property
    def name(self) -> str:
        return str(self.metadata.get("name", ""))

    @property
    def namespace(self) -> str:
        return str(self.metadata.get("namespace", ""))

    @property
    def generation(self) -> int:
        return int(self.metadata.get("generation", 0))


def _plain(value: Any) -> Any:
    """Deep copy of mappings and sequences as dicts and lists (kopf hands out mapping views)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# --- Helpers the operator uses ----------------------------------------------------------------------------
def effective_transfer_mode(spec: WeightSyncJobSpec, rdma_available: bool = False) -> TransferMode:
    """Resolve transfer.mode=Auto: Colocated -> IPC; Separated -> GDR when the operator is configured with
    an RDMA resource (`rdma_available`), else NCCL. An explicit mode is returned as-is."""
    mode = spec.transfer.mode
    if mode != "Auto":
        return mode
    if spec.placement.mode == "Colocated":
        return "IPC"
    return "GDR" if rdma_available else "NCCL"


def max_unavailable_count(spec: WeightSyncJobSpec) -> int:
    """Replicas allowed to load at once: an integer as-is, a percentage of inference.replicas rounded down;
    clamped to [1, replicas] so a rollout always progresses (0 when there are no replicas)."""
    replicas = spec.inference.replicas
    if replicas == 0:
        return 0
    value = spec.update_policy.max_unavailable
    count = value if isinstance(value, int) else math.floor(replicas * int(value.rstrip("%")) / 100)
    return max(1, min(replicas, count))


def utcnow() -> datetime:
    """Now in UTC at second precision (metav1.Time precision)."""
    return datetime.now(timezone.utc).replace(microsecond=0)


def set_condition(
    conditions: Iterable[Condition],
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str = "",
    observed_generation: int | None = None,
    now: datetime | None = None,
) -> list[Condition]:
    """Return `conditions` with `type_` set; lastTransitionTime only moves when the status changes."""
    out: list[Condition] = []
    found = False
    for c in conditions:
        if c.type != type_:
            out.append(c)
            continue
        found = True
        ltt = c.last_transition_time if c.status == status else (now or utcnow())
        out.append(
            Condition(
                type=type_, status=status, reason=reason, message=message,
                observed_generation=observed_generation, last_transition_time=ltt,
            )
        )
    if not found:
        out.append(
            Condition(
                type=type_, status=status, reason=reason, message=message,
                observed_generation=observed_generation, last_transition_time=now or utcnow(),
            )
        )
    return out


def validation_messages(err: ValidationError) -> list[str]:
    """Flatten a pydantic error into `path: message` lines (for conditions and events)."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        lines.append(f"{loc}: {e['msg']}" if loc else e["msg"])
    return lines


__all__ = [
    "DEFAULT_RDMA_RESOURCE",
    "HOSTNAME_TOPOLOGY_KEY",
    "JOB_NAME_MESSAGE",
    "JOB_NAME_PATTERN",
    "MAX_JOB_NAME_LENGTH",
    "POD_TEMPLATE_SCHEMA",
    "RDMA_RESOURCE_PATTERN",
    "Condition",
    "DRAConfig",
    "DeltaSync",
    "EngineSpec",
    "InferenceParallelism",
    "InferenceSpec",
    "LastSync",
    "Placement",
    "ReplicaCounts",
    "Rule",
    "TrainerParallelism",
    "TrainerSpec",
    "TransferSpec",
    "UpdatePolicy",
    "WeightSyncJob",
    "WeightSyncJobSpec",
    "WeightSyncJobStatus",
    "effective_transfer_mode",
    "max_unavailable_count",
    "set_condition",
    "utcnow",
    "validation_messages",
]
