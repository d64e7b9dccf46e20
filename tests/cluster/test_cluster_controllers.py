"""The control plane is a real one: CRUD, the status subresource, RBAC and kube-controller-manager's
controllers (garbage collection, Deployment -> ReplicaSet -> Pods, ServiceAccounts, the root CA)."""

from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException

from weightsync.e2e.environment import Environment
from weightsync.e2e.pytest_plugin import Kube, wait_until


def gone(read: object) -> bool:
    try:
        read()  # type: ignore[operator]
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return False


def test_crud_and_owned_configmap_is_garbage_collected(kube: Kube, namespace: str) -> None:
    owner = kube.core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}, "data": {"a": "1"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    kube.core.create_namespaced_config_map(namespace, {"metadata": {"name": "child", "ownerReferences": [ref]},
                                                       "data": {"b": "2"}})
    kube.core.patch_namespaced_config_map("owner", namespace, {"data": {"a": "2"}})
    assert kube.core.read_namespaced_config_map("owner", namespace).data == {"a": "2"}
    kube.core.create_namespaced_config_map(namespace, {"metadata": {"name": "bystander"}})

    kube.core.delete_namespaced_config_map("owner", namespace)
    wait_until(lambda: gone(lambda: kube.core.read_namespaced_config_map("child", namespace)), timeout=60,
               what="the garbage collector to delete the owned ConfigMap")
    assert kube.core.read_namespaced_config_map("bystander", namespace).metadata.name == "bystander"


def test_orphan_propagation_keeps_dependents(kube: Kube, namespace: str) -> None:
    owner = kube.core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    kube.core.create_namespaced_config_map(namespace, {"metadata": {"name": "child", "ownerReferences": [ref]}})
    kube.core.delete_namespaced_config_map("owner", namespace, propagation_policy="Orphan")
    wait_until(lambda: not kube.core.read_namespaced_config_map("child", namespace).metadata.owner_references,
               timeout=60, what="the garbage collector to orphan the child")


def test_deployment_gets_replicaset_and_pods_then_gc_removes_them(kube: Kube, namespace: str) -> None:
    """Pods are kept unschedulable (no node has the label), so this runs with or without a runtime."""
    labels = {"app": "gc-demo"}
    kube.apps.create_namespaced_deployment(namespace, {
        "metadata": {"name": "gc-demo"},
        "spec": {"replicas": 2, "selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels},
            "spec": {"nodeSelector": {"weightsync.io/no-such-node": "true"},
                     "containers": [{"name": "c", "image": "weightsync.local/none", "command": ["true"]}]}}},
    })
    rs = wait_until(lambda: kube.apps.list_namespaced_replica_set(namespace, label_selector="app=gc-demo").items,
                    timeout=60, what="the Deployment's ReplicaSet")
    assert rs[0].metadata.owner_references[0].kind == "Deployment"
    pods = wait_until(lambda: [p for p in kube.core.list_namespaced_pod(namespace, label_selector="app=gc-demo").items]
                      if len(kube.core.list_namespaced_pod(namespace, label_selector="app=gc-demo").items) == 2
                      else None, timeout=60, what="two pods")
    assert {p.metadata.owner_references[0].kind for p in pods} == {"ReplicaSet"}
    # The ServiceAccount admission plugin mounted a projected token volume.
    assert any(v.projected is not None for v in pods[0].spec.volumes)

    kube.apps.delete_namespaced_deployment("gc-demo", namespace, propagation_policy="Background")
    wait_until(lambda: not kube.apps.list_namespaced_replica_set(namespace, label_selector="app=gc-demo").items
               and not kube.core.list_namespaced_pod(namespace, label_selector="app=gc-demo").items,
               timeout=60, what="GC of the ReplicaSet and its pods")


def test_new_namespace_gets_serviceaccount_and_root_ca(kube: Kube, namespace: str) -> None:
    sa = kube.core.read_namespaced_service_account("default", namespace)
    assert sa.metadata.name == "default"
    cm = wait_until(lambda: kube.core.read_namespaced_config_map("kube-root-ca.crt", namespace), timeout=30,
                    what="kube-root-ca.crt")
    assert "BEGIN CERTIFICATE" in cm.data["ca.crt"]


def test_rbac_is_enforced_for_a_service_account_token(cluster: Environment, kube: Kube, namespace: str) -> None:
    """A token from the TokenRequest API authenticates as the ServiceAccount; RBAC decides."""
    import kubernetes

    kube.core.create_namespaced_service_account(namespace, {"metadata": {"name": "reader"}})
    token = kube.core.create_namespaced_service_account_token(
        "reader", namespace, {"spec": {"expirationSeconds": 600}}).status.token
    config = kubernetes.client.Configuration()
    admin_config = kube.api.configuration
    config.host, config.ssl_ca_cert = admin_config.host, admin_config.ssl_ca_cert
    config.api_key = {"authorization": f"Bearer {token}"}
    with kubernetes.client.ApiClient(config) as api:
        core = kubernetes.client.CoreV1Api(api)
        with pytest.raises(ApiException) as info:
            core.list_namespaced_pod(namespace)
        assert info.value.status == 403
        kube.rbac.create_namespaced_role(namespace, {
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]})
        kube.rbac.create_namespaced_role_binding(namespace, {
            "metadata": {"name": "pod-reader"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}]})
        wait_until(lambda: core.list_namespaced_pod(namespace) is not None, timeout=30, what="RBAC to allow listing")
