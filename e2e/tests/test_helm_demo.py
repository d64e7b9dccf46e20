"""`make demo` in CI: the chart, helm-installed into the local control plane (its operator Deployment run by
the process runtime as a host process with the chart ServiceAccount's own token), syncs the demo job to
version 3, bit for bit; `helm uninstall` then leaves nothing of the release behind but the CRD."""

from __future__ import annotations

import re
import secrets
from pathlib import Path
from typing import Any

import pytest

from weightsync.crds import contract
from weightsync.e2e import chart, demo
from weightsync.e2e.environment import Environment
from weightsync.e2e.pytest_plugin import wait_until

FORBIDDEN = re.compile(r"Forbidden|forbidden:|\(403\)|\b403 ")


@pytest.mark.cluster
@pytest.mark.e2e
def test_helm_installed_operator_syncs_the_demo_job_and_uninstalls_cleanly(
        cluster: Environment, kube: Any, namespace: str, process_runtime: Any) -> None:
    if process_runtime is None:
        pytest.skip("no process runtime on this cluster: the chart's operator pod would need a real image")
    release_name = f"wso-{secrets.token_hex(2)}"
    release = chart.install_chart(cluster, namespace, release_name, resync_seconds=2)
    lines: list[str] = []
    ok = False
    try:
        assert f"It serves WeightSyncJobs in: {namespace}." in release.notes  # NOTES.txt, namespaced mode

        # The operator pod runs as the chart's ServiceAccount, and that is who it authenticates as: the token
        # in its own mount namespace (/proc/PID/root/var/run/secrets/...) answers a SelfSubjectReview.
        sa = release.service_account()
        assert sa == chart.fullname(release_name)
        pod = release.operator_pod()
        assert pod["spec"]["serviceAccountName"] == sa
        assert pod["spec"]["nodeName"] in cluster.process_node_names
        who = release.whoami()
        assert who["username"] == f"system:serviceaccount:{namespace}:{sa}", who
        assert who.get("extra", {}).get("authentication.kubernetes.io/pod-name") == [pod["metadata"]["name"]], who
        # ... and nothing hands it the admin kubeconfig instead.
        environ = Path(f"/proc/{release.operator_pid()}/environ").read_bytes().split(b"\0")
        assert not [e for e in environ if e.startswith(b"KUBECONFIG=")]
        assert any(e.startswith(b"KUBERNETES_SERVICE_HOST=") for e in environ)

        # The demo job (examples/demo-separated.yaml, the trainer stopping at version 3) through the demo's
        # own path: progress table, servedVersion >= 3 with Synced=True, bit-exact engines.
        body = demo.load_example("separated", name_override=f"helm-{secrets.token_hex(2)}")
        demo.set_trainer_args(body, versions=3, interval=1.5)
        report = demo.run_demo(cluster, "separated", namespace, 240, lines.append,
                               operator_log=lambda: release.logs(tail=60), body=body)
        assert report.ok and report.version == 3 and len(report.engines) == 2, report
        job = demo.get_job(kube.custom, namespace, body["metadata"]["name"])
        assert job["status"]["servedVersion"] >= 3
        table = [line.split() for line in lines if line.startswith("    ")]
        assert table[0][:6] == ["TIME", "TRAINER", "SERVED", "SYNCED", "READY", "PODS"], lines
        assert table[-1][1:4] == ["3", "3", "True"], lines  # the last line: trainer 3, served 3, Synced
        # status.inferenceReplicas in the demo: one line per replica, each serving 3 and Ready.
        block = next(ln for ln in lines if "status.inferenceReplicas" in ln).splitlines()[1:]
        assert block[0].split()[:5] == ["INDEX", "PODS", "SERVED", "TARGET", "READY"], block
        assert sorted(row.split()[0] for row in block[1:]) == ["0", "1"], block
        assert all(row.split()[2] == "3" and row.split()[4] == "True" for row in block[1:]), block

        # The chart's RBAC was enough: the operator reconciled the job and never got a 403.
        logs = release.logs()
        assert body["metadata"]["name"] in logs, logs[-3000:]
        assert not FORBIDDEN.search(logs), [ln for ln in logs.splitlines() if FORBIDDEN.search(ln)][:5]

        # Delete the job (the operator's pods go with it), uninstall: nothing of the release is left.
        cluster.kubectl("delete", "wsj", body["metadata"]["name"], "-n", namespace, "--wait=true", "--timeout=90s")
        wait_until(lambda: not demo.job_pods(kube.api, namespace, body["metadata"]["name"]),
                   timeout=90, what="the demo job's pods deleted")
        r = release.uninstall()
        assert f'release "{release_name}" uninstalled' in r.stdout, r.stdout + r.stderr
        left: list[str] = []

        def nothing_left() -> bool:
            left[:] = chart.leftovers(cluster, release_name, namespace)
            return not left

        wait_until(nothing_left, timeout=60, interval=2, what=f"nothing of release {release_name} left")
        assert left == []
        crd = cluster.kubectl("get", "crd", contract.CRD_NAME, "-o", "name", check=False)
        assert crd.returncode == 0 and crd.stdout.strip() == f"customresourcedefinition.apiextensions.k8s.io/{contract.CRD_NAME}"
        ok = True
    finally:
        if not ok:
            print("\n".join(lines))
            print(release.diagnostics())
        if not release.uninstalled:
            release.uninstall()


def test_leftovers_finds_every_kind_of_release_object() -> None:
    """belongs_to: the chart's instance label, helm's ownership annotations (same namespace only) and helm's
    release record Secret; anything else is not the release's."""
    ns, rel = "ops", "wso"
    assert chart.belongs_to({"kind": "ClusterRole", "metadata": {"name": "x", "labels": {chart.LABEL_INSTANCE: rel}}},
                            rel, ns)
    annotated: dict[str, Any] = {"kind": "Role", "metadata": {"name": "x", "namespace": "other", "annotations": {
        chart.ANN_RELEASE_NAME: rel, chart.ANN_RELEASE_NAMESPACE: ns}}}
    assert chart.belongs_to(annotated, rel, ns)
    annotated["metadata"]["annotations"][chart.ANN_RELEASE_NAMESPACE] = "elsewhere"
    assert not chart.belongs_to(annotated, rel, ns)  # a release of the same name in another namespace
    record = {"kind": "Secret", "metadata": {"name": f"sh.helm.release.v1.{rel}.v1", "namespace": ns,
                                             "labels": {"owner": "helm", "name": rel}}}
    assert chart.belongs_to(record, rel, ns)
    assert not chart.belongs_to({"kind": "Pod", "metadata": {"name": "p", "namespace": ns,
                                                              "labels": {chart.LABEL_INSTANCE: "other"}}}, rel, ns)
    assert chart.fullname("wso") == "wso-weightsync-operator"
    assert chart.fullname("my-weightsync-operator") == "my-weightsync-operator"
    assert chart.merge({"operator": {"resyncSeconds": 2, "logFormat": "plain"}, "a": 1},
                       {"operator": {"logFormat": "json"}}) == {"operator": {"resyncSeconds": 2, "logFormat": "json"},
                                                                "a": 1}


def test_resolve_in_root_follows_absolute_links_inside_the_root(tmp_path: Path) -> None:
    """/var/run -> /run inside a container's root must resolve to ROOT/run, not to this process's /run."""
    root = tmp_path / "root"
    (root / "run" / "secrets").mkdir(parents=True)
    (root / "run" / "secrets" / "token").write_text("t")
    (root / "var").mkdir()
    (root / "var" / "run").symlink_to("/run")
    (root / "var" / "rel").symlink_to("../run")
    assert chart.resolve_in_root(root, "/var/run/secrets/token") == root / "run" / "secrets" / "token"
    assert chart.resolve_in_root(root, "/var/rel/secrets/token").read_text() == "t"
