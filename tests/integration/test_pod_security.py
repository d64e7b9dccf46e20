"""F6 of the hostile-input issue, Pod Security half: the injected agent meets Pod Security `restricted`, so
a job whose own containers do gets its pods in a namespace that enforces `restricted`; a GDR job (its agent
needs IPC_LOCK) is refused there with the condition PodSecurityRefused saying why and what to do, not a
generic InvalidTemplate. The real kube-apiserver's PodSecurity admission decides; the real operator runs."""

from __future__ import annotations

from typing import Any

from op_helpers import condition, container, create_job, events_for, get_job, live_pods, separated_spec

from weightsync.e2e.pytest_plugin import wait_until

RESTRICTED_CONTAINER = {"securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                            "runAsNonRoot": True, "runAsUser": 1000,
                                            "seccompProfile": {"type": "RuntimeDefault"}}}


def _restricted(kube: Any, namespace: str) -> None:
    kube.core.patch_namespace(namespace, {"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}}})


def _spec(mode: str) -> dict[str, Any]:
    spec = separated_spec(trainer_pods=1, trainer_gpus=2, replicas=1, gpus_per_replica=1)
    spec["transfer"]["mode"] = mode
    spec["trainer"]["template"]["spec"]["containers"] = [container("trainer", **RESTRICTED_CONTAINER)]
    spec["inference"]["template"]["spec"]["containers"] = [container("engine", **RESTRICTED_CONTAINER)]
    return spec


def test_restricted_namespace_takes_the_injected_agent(kube, namespace, operator) -> None:
    _restricted(kube, namespace)
    operator()
    create_job(kube, namespace, "psa-ok", _spec("NCCL"))
    pods = wait_until(lambda: p if len(p := live_pods(kube, namespace, "psa-ok")) == 2 else None, timeout=60,
                      what="both pods admitted under restricted")
    assert set(pods) == {"psa-ok-trainer-0", "psa-ok-inference-0-0"}
    ready = condition(get_job(kube, namespace, "psa-ok"), "Ready") or {}
    assert ready.get("reason") not in ("InvalidTemplate", "PodSecurityRefused"), ready


def test_gdr_job_in_a_restricted_namespace_says_why_and_what_to_do(kube, namespace, operator) -> None:
    _restricted(kube, namespace)
    operator()
    create_job(kube, namespace, "psa-gdr", _spec("GDR"))

    def refused() -> dict[str, Any] | None:
        c = condition(get_job(kube, namespace, "psa-gdr"), "Ready")
        return c if c and c["reason"] == "PodSecurityRefused" else None

    ready = wait_until(refused, timeout=60, what="PodSecurityRefused condition")
    msg = ready["message"]
    assert "violates PodSecurity" in msg and "IPC_LOCK" in msg, msg
    assert "pod-security.kubernetes.io/enforce=privileged" in msg and "transfer.mode NCCL" in msg, msg
    wait_until(lambda: any(e.reason == "PodSecurityRefused" for e in events_for(kube, namespace, "psa-gdr")),
               what="PodSecurityRefused event")
    assert live_pods(kube, namespace, "psa-gdr") == {}
