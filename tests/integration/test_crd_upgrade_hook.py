"""The chart's CRD upgrade hook for real: `weightsync-crds apply`, authenticated as the hook's ServiceAccount
(a TokenRequest token; only the hook's ClusterRole), upgrades an older WeightSyncJob CRD to the generated one,
and that ClusterRole's resourceNames-limited verbs are exactly enough.

The WeightSyncJob CRD is shared by the whole session (fixture `wsj_crd`): every test here puts the generated
CRD back in `finally` and checks it.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from op_helpers import separated_spec, token_kubeconfig

from weightsync.crds import contract
from weightsync.crds.install import FIELD_MANAGER
from weightsync.crds.schema import crd
from weightsync.e2e.binaries import find_binary
from weightsync.e2e.pytest_plugin import wait_until

pytestmark = pytest.mark.cluster
CHART = Path(__file__).resolve().parents[2] / "helm" / "weightsync-operator"
SCRIPT = Path(sys.executable).parent / "weightsync-crds"
TEST_MANAGER = "weightsync-tests"  # the wsj_crd fixture's field manager


def _live_crd(cluster: Any) -> dict[str, Any]:
    return dict(json.loads(cluster.kubectl("get", f"crd/{contract.CRD_NAME}", "-o", "json",
                                           "--show-managed-fields").stdout))


def _matches_generated(live: dict[str, Any], generated: dict[str, Any]) -> list[str]:
    """Keys of the generated spec the live one differs in, plus keys only the live one has (server defaults
    such as `conversion` aside)."""
    spec = live["spec"]
    bad = [k for k in generated["spec"] if spec.get(k) != generated["spec"][k]]
    return bad + [k for k in spec if k not in generated["spec"] and spec[k] != {"strategy": "None"}]


def _established(cluster: Any) -> bool:
    conds = {c["type"]: c["status"] for c in _live_crd(cluster).get("status", {}).get("conditions", [])}
    return conds.get("Established") == "True"


def _restore(cluster: Any, generated: dict[str, Any], tmp_path: Path) -> None:
    """Put the generated CRD back, exactly: apply it as the fixture's manager, replace it if a field that
    another manager kept still differs."""
    path = tmp_path / "generated-crd.yaml"
    path.write_text(yaml.safe_dump(generated, sort_keys=False))
    cluster.kubectl("apply", "--server-side", "--force-conflicts", f"--field-manager={TEST_MANAGER}", "-f", str(path))
    if _matches_generated(_live_crd(cluster), generated):
        cluster.kubectl("replace", "-f", str(path))
    assert not _matches_generated(_live_crd(cluster), generated), "the shared CRD could not be restored"
    wait_until(lambda: _established(cluster), timeout=60, what="CRD Established after restore")


@pytest.fixture
def hook_identity(cluster: Any, namespace: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The hook's ServiceAccount, ClusterRole and ClusterRoleBinding as the chart renders them (the Job
    itself needs an image and a kubelet: its command is run here as a process with the same identity);
    yields the ServiceAccount's full name and a kubeconfig with its token."""
    rendered = subprocess.run(
        [str(find_binary("helm")), "template", "ws", str(CHART), "-n", namespace, "--kube-version", "1.34.4",
         "--set", "crds.upgradeHook.enabled=true"],
        capture_output=True, text=True, check=True,
    ).stdout
    hook = [d for d in yaml.safe_load_all(rendered)
            if d and (d["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == "crd-upgrade"]
    (job,) = [d for d in hook if d["kind"] == "Job"]
    identity = [d for d in hook if d["kind"] != "Job"]
    assert sorted(d["kind"] for d in identity) == ["ClusterRole", "ClusterRoleBinding", "ServiceAccount"]
    sa = job["spec"]["template"]["spec"]["serviceAccountName"]
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][:2] == ["weightsync-crds", "apply"]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(identity))
    try:
        token = cluster.kubectl("create", "token", sa, "-n", namespace, "--duration=1h").stdout.strip()
        kubeconfig = token_kubeconfig(Path(cluster.kubeconfig), token, tmp_path / "hook.kubeconfig")
        yield f"system:serviceaccount:{namespace}:{sa}", kubeconfig
    finally:
        for d in identity:
            if d["kind"] != "ServiceAccount":  # cluster-scoped: the namespace's deletion does not remove them
                cluster.kubectl("delete", d["kind"].lower(), d["metadata"]["name"], "--ignore-not-found", check=False)


def _run_hook_command(kubeconfig: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    return subprocess.run([str(SCRIPT), "apply", "--kubeconfig", str(kubeconfig), *extra],
                          capture_output=True, text=True, timeout=120, env=env)


def _older(generated: dict[str, Any]) -> dict[str, Any]:
    """The generated CRD as an older release could have had it: without spec.paused, with a property the
    models no longer have, an older description, an extra served API version since dropped, and a webhook
    conversion the models never set (schema and versions are atomic for server-side apply, so a forced
    apply replaces them; `conversion` is not: only the replace removes what another manager set there)."""
    older = copy.deepcopy(generated)
    spec_props = older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    del spec_props["paused"]
    spec_props["legacyKnob"] = {"type": "string", "description": "dropped from the models"}
    spec_props["placement"]["description"] = "an older description"
    # releases before status.inferenceReplicas became an atomic list had it as a map list keyed by index
    status_props = older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    status_props["inferenceReplicas"].update({"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["index"]})
    old_version = {**copy.deepcopy(older["spec"]["versions"][0]), "name": "v1alpha0", "storage": False}
    older["spec"]["versions"].insert(0, old_version)
    older["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {
        "conversionReviewVersions": ["v1"],
        "clientConfig": {"service": {"namespace": "default", "name": "old-converter", "path": "/convert"}}}}
    return older


def test_hook_upgrades_an_older_crd_to_the_generated_one(cluster: Any, kube: Any, namespace: str, wsj_crd: str,
                                                         hook_identity: tuple[str, Path], tmp_path: Path) -> None:
    _, kubeconfig = hook_identity
    generated = crd()
    older_path = tmp_path / "older-crd.yaml"
    older_path.write_text(yaml.safe_dump(_older(generated), sort_keys=False))
    try:
        # The older CRD, owned by another field manager (as after `helm install` or a kubectl apply).
        cluster.kubectl("apply", "--server-side", "--force-conflicts", f"--field-manager={TEST_MANAGER}",
                        "-f", str(older_path))
        before = _live_crd(cluster)
        current = next(v for v in before["spec"]["versions"] if v["name"] == contract.VERSION)
        props = current["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        assert "paused" not in props and "legacyKnob" in props
        assert [v["name"] for v in before["spec"]["versions"]] == ["v1alpha0", contract.VERSION]
        assert _matches_generated(before, generated) == ["versions", "conversion"]

        dry = _run_hook_command(kubeconfig, "--dry-run")
        assert dry.returncode == 0, dry.stdout + dry.stderr
        assert "would be upgraded" in dry.stderr and _matches_generated(_live_crd(cluster), generated) == ["versions", "conversion"]

        r = _run_hook_command(kubeconfig)
        assert r.returncode == 0, r.stdout + r.stderr
        log = r.stderr
        assert ".properties.spec.properties.paused added" in log, log
        assert ".properties.spec.properties.legacyKnob removed" in log, log
        assert '.properties.spec.properties.placement.description: "an older description" ->' in log, log
        assert "crd established" in log and "Forbidden" not in log
        assert "spec.versions[name=v1alpha0] removed" in log, log
        assert 'spec.conversion.strategy: "Webhook" -> "None"' in log, log
        assert "inferenceReplicas.x-kubernetes-list-map-keys removed" in log, log
        # The conversion was set by the other field manager: server-side apply keeps it, the replace drops it.
        assert "fields kept by other field managers" in log and "replacing the spec" in log, log
        assert _live_crd(cluster)["spec"]["conversion"] == {"strategy": "None"}
        assert [v["name"] for v in _live_crd(cluster)["spec"]["versions"]] == [contract.VERSION]
        after = _live_crd(cluster)
        assert not _matches_generated(after, generated), _matches_generated(after, generated)
        assert FIELD_MANAGER in {m["manager"] for m in after["metadata"]["managedFields"]}

        # The API server serves the upgraded schema: spec.paused is kept again (no longer pruned).
        body = {"apiVersion": contract.API_VERSION, "kind": contract.KIND,
                "metadata": {"name": "upgraded", "namespace": namespace},
                "spec": {**separated_spec(trainer_pods=1, trainer_gpus=1, replicas=1, gpus_per_replica=1),
                         "paused": True}}

        def served() -> bool:
            obj = kube.custom.create_namespaced_custom_object(contract.GROUP, contract.VERSION, namespace,
                                                              contract.PLURAL, body, dry_run="All")
            return obj["spec"].get("paused") is True

        wait_until(served, timeout=30, what="spec.paused served by the upgraded CRD")

        # Idempotent: a second run changes nothing.
        again = _run_hook_command(kubeconfig)
        assert again.returncode == 0 and "crd up to date" in again.stderr and "changes=0" in again.stderr, again.stderr
        assert _live_crd(cluster)["metadata"]["resourceVersion"] == after["metadata"]["resourceVersion"]
    finally:
        _restore(cluster, generated, tmp_path)


def test_hook_role_is_least_privilege(cluster: Any, namespace: str, wsj_crd: str,
                                      hook_identity: tuple[str, Path]) -> None:
    user, _ = hook_identity

    def can(verb: str, resource: str) -> bool:
        r = cluster.kubectl("auth", "can-i", verb, resource, f"--as={user}", check=False)
        return r.stdout.strip() == "yes"

    crd_ref = f"customresourcedefinitions.apiextensions.k8s.io/{contract.CRD_NAME}"
    for verb in ("get", "create", "patch", "update"):
        assert can(verb, crd_ref), verb
    assert not can("delete", crd_ref)
    assert not can("list", "customresourcedefinitions.apiextensions.k8s.io")
    assert not can("patch", "customresourcedefinitions.apiextensions.k8s.io/kopfpeerings.kopf.dev")
    assert not can("create", "customresourcedefinitions.apiextensions.k8s.io")  # a POST to the collection
    assert not can("get", "pods") and not can("get", "weightsyncjobs.weightsync.io")


def test_server_side_apply_creates_under_a_resource_names_limited_create(cluster: Any, namespace: str,
                                                                         tmp_path: Path) -> None:
    """Why the hook's `create` can be limited to one name: server-side apply creates a missing object with
    a PATCH to its named URL, which the API server authorizes as `create` on that name. Shown with a
    throwaway CRD and the same rule shape (the shared WeightSyncJob CRD cannot be deleted to show it)."""
    name = "widgets.hooktest.weightsync.io"
    sa = "ssa-probe"
    rbac = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa, "namespace": namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": f"{namespace}-probe"},
         "rules": [{"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
                    "resourceNames": [name], "verbs": ["get", "create", "patch", "update"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": f"{namespace}-probe"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": f"{namespace}-probe"},
         "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}]},
    ]
    widget = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition", "metadata": {"name": name},
              "spec": {"group": "hooktest.weightsync.io", "scope": "Namespaced",
                       "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
                       "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                           "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}
    path = tmp_path / "widget.yaml"
    path.write_text(yaml.safe_dump(widget))
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac))
    try:
        token = cluster.kubectl("create", "token", sa, "-n", namespace, "--duration=1h").stdout.strip()
        kc = token_kubeconfig(Path(cluster.kubeconfig), token, tmp_path / "probe.kubeconfig")
        kubectl = str(find_binary("kubectl"))
        post = subprocess.run([kubectl, f"--kubeconfig={kc}", "create", "-f", str(path)],
                              capture_output=True, text=True, timeout=60)
        assert post.returncode != 0 and "forbidden" in post.stderr.lower(), post.stderr
        ssa = subprocess.run([kubectl, f"--kubeconfig={kc}", "apply", "--server-side", "--field-manager=probe",
                              "-f", str(path)], capture_output=True, text=True, timeout=60)
        assert ssa.returncode == 0, ssa.stdout + ssa.stderr
        assert "serverside-applied" in ssa.stdout
        assert cluster.kubectl("get", f"crd/{name}", "-o", "name").stdout.strip().endswith(name)
    finally:
        cluster.kubectl("delete", f"crd/{name}", "--ignore-not-found", "--wait=false", check=False)
        for kind in ("clusterrolebinding", "clusterrole"):
            cluster.kubectl("delete", kind, f"{namespace}-probe", "--ignore-not-found", check=False)
