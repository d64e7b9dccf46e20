"""The topology file: what the operator tells every agent about the job's membership.

The operator renders it into the job's topology ConfigMap (key `topology.json`), mounted at
`contract.TOPOLOGY_DIR`; agents read it at start and again when `generation` changes. One schema, used by
both sides, so the file cannot drift from its reader.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

TransferModeName = Literal["IPC", "NCCL", "GDR"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class PodMember(_Strict):
    """One pod of the job and the ranks its agent serves."""

    name: str
    index: int = Field(ge=0, description="Pod index within its role (trainer) or replica (inference).")
    ranks: list[int] = Field(description="Ranks served by this pod's agent: global trainer ranks, or ranks within the inference replica.")
    ip: str | None = Field(default=None, description="Pod IP once known; None while the pod is pending.")
    node: str | None = None


class TrainerTopology(_Strict):
    world_size: int = Field(ge=1, alias="worldSize")
    tensor: int = Field(ge=1)
    pipeline: int = Field(ge=1)
    data: int = Field(ge=1)
    pods: list[PodMember]


class InferenceReplicaTopology(_Strict):
    replica: int = Field(ge=0)
    tensor: int = Field(ge=1)
    world_size: int = Field(ge=1, alias="worldSize")
    pods: list[PodMember]


class TransportGroup(_Strict):
    """A set of pods that exchange bytes directly (one torch.distributed group for NCCL, one NIXL peer set
    for GDR, one node for IPC). Rank order in the group is the order of `members`."""

    name: str
    members: list[str]


class Topology(_Strict):
    job: str
    namespace: str
    generation: int = Field(ge=0, description="Membership generation: bumped whenever the set of pods or their IPs changes; transports rebuild their groups only then.")
    placement: Literal["Colocated", "Separated"]
    mode: TransferModeName
    bucket_size_mb: int = Field(ge=1, alias="bucketSizeMB")
    verify: Literal["None", "Checksum"] = "None"
    trainer: TrainerTopology
    inference: list[InferenceReplicaTopology]
    groups: list[TransportGroup] = Field(default_factory=list)

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Topology:
        return cls.model_validate_json(text)
