"""DRA for Colocated pods: one ResourceClaimTemplate per job; each pod gets its own claim from it, and
the trainer, inference and agent containers of that pod all reference the claim, so they share the GPUs
(the Dynamo GPU Memory Service pattern). The resource-claim controller creates and deletes the claims."""

from __future__ import annotations

from typing import Any

from weightsync.crds.models import WeightSyncJobSpec
from weightsync.operator.common import JobRef, metadata
from weightsync.operator.config import OperatorConfig
from weightsync.operator.placement import dra_device_class
from weightsync.operator.pods import resource_claim_template_name

DRA_API = "resource.k8s.io/v1"
REQUEST_NAME = "gpus"


def build_resource_claim_template(
    job: JobRef, spec: WeightSyncJobSpec, cfg: OperatorConfig | None = None
) -> dict[str, Any] | None:
    """The job's ResourceClaimTemplate, or None when it uses no DRA. The DeviceClass is the spec's, else the
    operator's default (`cfg.dra_device_class_name`); with neither the planner has refused the job already,
    so None is returned here too."""
    dra = spec.placement.dra
    if dra is None or spec.placement.mode != "Colocated" or spec.trainer.gpus_per_pod == 0:
        return None
    device_class = dra_device_class(spec, cfg.dra_device_class_name if cfg is not None else "")
    if not device_class:
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
                                "deviceClassName": device_class,
                                "allocationMode": "ExactCount",
                                "count": spec.trainer.gpus_per_pod,
                            },
                        }
                    ]
                }
            }
        },
    }
