"""Fixtures for the operator unit tests: spec factories (validated through the real pydantic models)
and an operator config; no cluster."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from weightsync.crds.models import WeightSyncJobSpec
from weightsync.operator.common import JobRef
from weightsync.operator.config import OperatorConfig

TRAINER_TEMPLATE = {
    "metadata": {"labels": {"team": "rl"}, "annotations": {"note": "trainer"}},
    "spec": {"containers": [{"name": "trainer", "image": "trainer:1", "env": [{"name": "USER_VAR", "value": "1"}]}]},
}
INFERENCE_TEMPLATE = {
    "metadata": {"labels": {"team": "rl"}},
    "spec": {"containers": [{"name": "engine", "image": "engine:1"}]},
}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def separated_spec_dict() -> dict[str, Any]:
    return {
        "placement": {"mode": "Separated"},
        "transfer": {"mode": "NCCL", "bucketSizeMB": 64},
        "trainer": {"replicas": 2, "gpusPerPod": 4, "parallelism": {"tensor": 2, "pipeline": 1, "data": 4},
                    "template": TRAINER_TEMPLATE},
        "inference": {"replicas": 2, "gpusPerReplica": 2, "parallelism": {"tensor": 2},
                      "engine": {"type": "SGLang", "port": 30000}, "template": INFERENCE_TEMPLATE},
    }


def colocated_spec_dict() -> dict[str, Any]:
    return {
        "placement": {"mode": "Colocated"},
        "transfer": {"mode": "IPC", "bucketSizeMB": 128},
        "trainer": {"replicas": 2, "gpusPerPod": 8, "parallelism": {"tensor": 1, "pipeline": 1, "data": 16},
                    "template": TRAINER_TEMPLATE},
        "inference": {"replicas": 8, "gpusPerReplica": 2, "parallelism": {"tensor": 2},
                      "engine": {"type": "VLLM", "port": 8000}, "template": INFERENCE_TEMPLATE},
    }


SpecFactory = Callable[..., WeightSyncJobSpec]


@pytest.fixture
def separated() -> SpecFactory:
    def make(**over: Any) -> WeightSyncJobSpec:
        return WeightSyncJobSpec.model_validate(_merge(separated_spec_dict(), over))
    return make


@pytest.fixture
def colocated() -> SpecFactory:
    def make(**over: Any) -> WeightSyncJobSpec:
        return WeightSyncJobSpec.model_validate(_merge(colocated_spec_dict(), over))
    return make


@pytest.fixture
def job() -> JobRef:
    return JobRef(name="demo", namespace="ns1", uid="uid-123", generation=3)


@pytest.fixture
def cfg() -> OperatorConfig:
    return OperatorConfig(agent_image="agent:test", node_gpu_count=8)
