"""DRA for Colocated pods: one ResourceClaimTemplate per job; each pod gets its own claim from it, and
the trainer, inference and agent containers of that pod all reference the claim, so they share the GPUs
(the Dynamo GPU Memory Service pattern). The resource-claim controller creates and deletes the claims."""

from __future__ import annotations

from typing import Any

from weightsync.crds.models import WeightSyncJobSpec
from weightsync.operator.common import JobRef, metadata
from weightsync.operator.pods import resource_claim_template_name

DRA_API = "resource.k8s.io/v1"
REQUEST_NAME = "gpus"


def build_resource_claim_template(job: JobRef, spec: WeightSyncJobSpec) -> dict[str, Any] | None:
    dra = spec.placement.dra
    if dra is None or spec.placement.mode != "Colocated" or spec.trainer.gpus_per_pod == 0:
        return None
    return {
        "apiVersion": DRA_API,
        "kind": "ResourceClaimTemplate",
        "metadata": metadata(job, resource_claim_template_name(job.name)),
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": REQUEST_NAME,
                            "exactly": {
                                "deviceClassName": dra.device_class_name,
                                "allocationMode": "ExactCount",
                                "count": spec.trainer.gpus_per_pod,
                            },
                        }
                    ]
                }
            }
        },
    }
