"""How a refused pod becomes a condition: PodSecurity refusals get their own reason and a fix."""

from __future__ import annotations

from weightsync.operator.kube import KubeError
from weightsync.operator.reconcile import refused_pod_problem

PSA = ('pods "j-trainer-0" is forbidden: violates PodSecurity "restricted:latest": non-default capabilities '
       '(container "weightsync-agent" must not include "IPC_LOCK" in securityContext.capabilities.add)')


def test_gdr_ipc_lock_refusal_says_what_to_do() -> None:
    p = refused_pod_problem("pod j-trainer-0 was refused", KubeError(403, "Forbidden", PSA), "GDR")
    assert p.reason == "PodSecurityRefused"
    assert "IPC_LOCK" in p.message and "enforce=privileged" in p.message and "transfer.mode NCCL" in p.message


def test_template_refused_by_pod_security_names_the_fields_to_set() -> None:
    msg = PSA.replace('"weightsync-agent" must not include "IPC_LOCK" in securityContext.capabilities.add', '"app"')
    p = refused_pod_problem("pod j-trainer-0 was refused", KubeError(403, "Forbidden", msg), "NCCL")
    assert p.reason == "PodSecurityRefused" and "allowPrivilegeEscalation: false" in p.message


def test_other_refusals_stay_invalid_template() -> None:
    p = refused_pod_problem("pod x was refused", KubeError(422, "Invalid", "spec.containers[0].image: Required"), "NCCL")
    assert p.reason == "InvalidTemplate" and "image: Required" in p.message
