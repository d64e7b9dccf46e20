"""A 403 from the authorizer is the operator's missing permission; a 403 from admission is not."""

from __future__ import annotations

from weightsync.operator.kube import KubeError
from weightsync.operator.reconcile import permission_message

RBAC_403 = ('pods is forbidden: User "system:serviceaccount:ns:ws" cannot create resource "pods" in API group "" '
            'in the namespace "ns"')
ADMISSION_403 = 'pods "t-0" is forbidden: violates PodSecurity "restricted:latest": privileged (container "x")'


def test_authorizer_refusal_is_a_missing_permission() -> None:
    assert KubeError(403, "Forbidden", RBAC_403).forbidden_by_rbac


def test_admission_refusal_is_not() -> None:
    err = KubeError(403, "Forbidden", ADMISSION_403)
    assert not err.forbidden_by_rbac
    assert err.invalid  # still reported as an invalid template


def test_other_statuses_are_not() -> None:
    assert not KubeError(401, "Unauthorized", "cannot authenticate").forbidden_by_rbac
    assert not KubeError(422, "Invalid", "cannot be empty").forbidden_by_rbac


def test_message_names_what_is_missing_and_the_fix() -> None:
    msg = permission_message(KubeError(403, "Forbidden", RBAC_403))
    assert 'cannot create resource "pods"' in msg
    assert "rbac.create=true" in msg and "retries" in msg
    assert len(permission_message(KubeError(403, "Forbidden", "x cannot " + "y" * 5000))) <= 1000
