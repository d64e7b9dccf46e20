"""The one place that installs the helm chart (helm/weightsync-operator) into an e2e environment so that its
operator Deployment runs as a pod: on the local control plane the pod lands on a process node and the
process runtime runs it as a host process with the pod's own projected ServiceAccount token, so the
operator talks to the API server with exactly the chart's RBAC (never the admin kubeconfig).

    release = install_chart(env, "weightsync-system", watch_namespaces=["demo"])
    release.logs(); release.operator_pod(); release.whoami()   # who the operator authenticates as
    release.uninstall()
    assert leftovers(env, release.release, release.namespace) == []   # everything but the CRDs is gone

Used by `make demo` (e2e/demo_cli.py) and the tests (e2e/tests/test_helm_demo.py,
tests/integration/test_helm_install.py).
"""

from __future__ import annotations

import json
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from weightsync.crds import contract
from weightsync.e2e.binaries import find_binary
from weightsync.e2e.demo import wait_established
from weightsync.e2e.environment import Environment
from weightsync.e2e.procs import free_port

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "helm" / "weightsync-operator"
CHART_NAME = "weightsync-operator"
CONTAINER = "operator"  # the Deployment's container
LABEL_INSTANCE = "app.kubernetes.io/instance"
ANN_RELEASE_NAME = "meta.helm.sh/release-name"
ANN_RELEASE_NAMESPACE = "meta.helm.sh/release-namespace"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
JSON = dict[str, Any]


class ChartError(RuntimeError):
    """helm failed, or the operator pod did not come up; the message carries the diagnostics."""


def helm_binary() -> Path:
    return find_binary("helm")


def fullname(release: str) -> str:
    """The chart's `weightsync-operator.fullname` (Deployment, ServiceAccount, Role names)."""
    name = release if CHART_NAME in release else f"{release}-{CHART_NAME}"
    return name[:63].rstrip("-")


def merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> JSON:
    """Deep merge of helm values (EXTRA wins; nested dicts merge, everything else is replaced)."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def local_values(watch_namespaces: Sequence[str], *, resync_seconds: float = 2.0, log_format: str = "plain",
                 process_node: bool = True) -> JSON:
    """The values that make the chart run on the local control plane: free host ports for metrics and
    health (pods are host processes: the chart's fixed ports would clash), the Deployment pinned to a process node, a short resync."""
    values: JSON = {
        "watchNamespaces": list(watch_namespaces),
        "metrics": {"port": free_port()},
        "health": {"port": free_port()},
        "operator": {"resyncSeconds": resync_seconds, "logFormat": log_format},
    }
    if process_node:
        values["nodeSelector"] = {contract.LABEL_PROCESS_NODE: "true"}
    return values


@dataclass
class ChartRelease:
    """An installed release of the chart."""

    env: Environment
    release: str
    namespace: str
    values: JSON
    notes: str = ""          # helm install's stdout (NOTES.txt)
    install_seconds: float = 0.0
    uninstalled: bool = field(default=False)

    @property
    def deployment(self) -> str:
        return fullname(self.release)

    def helm(self, *args: str, check: bool = True, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        return run_helm(self.env, *args, "-n", self.namespace, check=check, timeout=timeout)

    def service_account(self) -> str:
        """The ServiceAccount the Deployment's pods run as (spec.template.spec.serviceAccountName)."""
        dep = json.loads(self.env.kubectl("get", "deploy", self.deployment, "-n", self.namespace, "-o", "json").stdout)
        return str(dep["spec"]["template"]["spec"].get("serviceAccountName") or "default")

    def operator_pods(self) -> list[JSON]:
        """The release's live (not terminating) operator pods."""
        out = self.env.kubectl("get", "pods", "-n", self.namespace, "-l", f"{LABEL_INSTANCE}={self.release}",
                               "-o", "json")
        return [p for p in json.loads(out.stdout)["items"] if not p["metadata"].get("deletionTimestamp")]

    def operator_pod(self) -> JSON:
        pods = [p for p in self.operator_pods() if (p.get("status") or {}).get("phase") == "Running"]
        if len(pods) != 1:
            raise ChartError(f"expected one running operator pod of release {self.release}, found "
                             f"{[p['metadata']['name'] for p in pods]}")
        return pods[0]

    def operator_pid(self) -> int:
        """Host pid of the operator container (process runtime: containerID process://PID)."""
        for s in (self.operator_pod().get("status") or {}).get("containerStatuses") or []:
            cid = str(s.get("containerID") or "")
            if s.get("name") == CONTAINER and cid.startswith("process://"):
                return int(cid.removeprefix("process://"))
        raise ChartError("the operator container has no process:// container id (not on a process node?)")

    def log_files(self) -> list[Path]:
        """The process runtime's log files of the operator container, one per operator pod seen."""
        if self.env.runtime is None:
            return []
        return [Path(self.env.runtime.log_path(self.namespace, p["metadata"]["name"], CONTAINER))
                for p in self.operator_pods()]

    def logs(self, tail: int | None = None) -> str:
        """The operator's log: the process runtime's container log file (no kubelet serves `kubectl logs`
        there), else `kubectl logs deploy/...` (kind)."""
        files = self.log_files()
        if files:
            text = "".join(f.read_text(errors="replace") for f in files if f.exists())
            return "\n".join(text.splitlines()[-tail:]) if tail else text
        args = ["logs", f"deploy/{self.deployment}", "-n", self.namespace, "-c", CONTAINER]
        r = self.env.kubectl(*args, *([f"--tail={tail}"] if tail else []), check=False)
        return r.stdout if r.returncode == 0 else f"(kubectl logs failed: {r.stderr.strip()})"

    def diagnostics(self, tail: int = 60) -> str:
        """Pods, their description, the operator's log tail and the log file paths: for failure messages."""
        parts = []
        for args in (("get", "deploy,rs,pods", "-o", "wide"),
                     ("describe", "pods", "-l", f"{LABEL_INSTANCE}={self.release}")):
            r = self.env.kubectl(*args, "-n", self.namespace, check=False)
            parts.append(f"$ kubectl {' '.join(args)}\n{r.stdout[-4000:]}{r.stderr[-500:]}")
        parts.append(f"--- operator log (last {tail} lines; files {[str(f) for f in self.log_files()]}) ---\n"
                     + self.logs(tail))
        return "\n".join(parts)

    def in_pod_file(self, name: str) -> str:
        """A file of the operator's ServiceAccount volume as the operator process sees it: through
        /proc/PID/root, i.e. in the container's own mount namespace where the runtime mounted the volume."""
        return resolve_in_root(Path(f"/proc/{self.operator_pid()}/root"), f"{SA_DIR}/{name}").read_text()

    def whoami(self) -> JSON:
        """SelfSubjectReview with the operator's in-pod token and CA: the user the operator authenticates
        as ({username, uid, groups, extra})."""
        return self_subject_review(self.env.server, self.in_pod_file("token").strip(), self.in_pod_file("ca.crt"))

    def uninstall(self, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """`helm uninstall --wait --cascade foreground`: returns once the Deployment's pods are gone too."""
        r = self.helm("uninstall", self.release, "--wait", "--cascade", "foreground", "--timeout", f"{int(timeout)}s",
                      check=False, timeout=timeout + 60)
        if r.returncode != 0 and "not found" not in r.stderr:
            raise ChartError(f"helm uninstall {self.release} failed: {r.stdout}{r.stderr}")
        self.uninstalled = True
        return r


def resolve_in_root(root: Path, path: str, _depth: int = 0) -> Path:
    """PATH under ROOT (e.g. /proc/PID/root) with symlinks resolved as that process sees them: an absolute
    link (/var/run -> /run) is followed from ROOT, not from this process's root."""
    if _depth > 40:
        raise OSError(f"too many symlinks resolving {path} under {root}")
    parts = [x for x in path.split("/") if x and x != "."]
    current: list[str] = []
    for i, part in enumerate(parts):
        if part == "..":
            current = current[:-1]
            continue
        candidate = root.joinpath(*current, part)
        if candidate.is_symlink():
            target = str(candidate.readlink())
            rest = "/".join(parts[i + 1:])
            base = "" if target.startswith("/") else "/".join(current)
            return resolve_in_root(root, f"{base}/{target}/{rest}", _depth + 1)
        current.append(part)
    return root.joinpath(*current)


def run_helm(env: Environment, *args: str, check: bool = True, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([str(helm_binary()), *args, "--kubeconfig", str(env.kubeconfig)], capture_output=True,
                       text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise ChartError(f"helm {' '.join(args)} failed ({r.returncode}): {r.stdout}{r.stderr}")
    return r


def install_chart(env: Environment, namespace: str, release: str = "weightsync", *,
                  watch_namespaces: Sequence[str] | None = None, extra_values: Mapping[str, Any] | None = None,
                  resync_seconds: float = 2.0, log_format: str = "plain", create_namespace: bool = False,
                  timeout: float = 180.0) -> ChartRelease:
    """`helm install RELEASE helm/weightsync-operator -n NAMESPACE --wait` with local_values (serving
    WATCH_NAMESPACES, default [NAMESPACE], which must exist: the chart puts a Role in each) merged with
    EXTRA_VALUES. The chart's crds/ installs the CRD if it is missing. On failure (helm's --wait timed
    out, the pod crashed) ChartError carries the pod description and the operator's log."""
    values = merge(local_values(watch_namespaces if watch_namespaces is not None else [namespace],
                                resync_seconds=resync_seconds, log_format=log_format,
                                process_node=env.runtime is not None), extra_values or {})
    rel = ChartRelease(env, release, namespace, values)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="weightsync-values-") as f:
        yaml.safe_dump(values, f)
        f.flush()
        t0 = time.monotonic()
        r = run_helm(env, "install", release, str(CHART), "-n", namespace, "-f", f.name, "--wait",
                     "--timeout", f"{int(timeout)}s", *(["--create-namespace"] if create_namespace else []),
                     check=False, timeout=timeout + 60)
        rel.install_seconds = time.monotonic() - t0
    rel.notes = r.stdout
    if r.returncode != 0:
        raise ChartError(f"helm install {release} failed ({r.returncode}): {r.stdout}{r.stderr}\n{rel.diagnostics()}")
    wait_established(env.kubectl, contract.CRD_NAME)
    return rel


def self_subject_review(server: str, token: str, ca_pem: str, timeout: float = 10.0) -> JSON:
    """POST authentication.k8s.io/v1 SelfSubjectReview as TOKEN: status.userInfo."""
    ctx = ssl.create_default_context(cadata=ca_pem)
    req = urllib.request.Request(
        f"{server.rstrip('/')}/apis/authentication.k8s.io/v1/selfsubjectreviews",
        data=json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as resp:
            return dict(json.loads(resp.read())["status"]["userInfo"])
    except urllib.error.HTTPError as exc:
        raise ChartError(f"SelfSubjectReview answered {exc.code}: {exc.read()[:300]!r}") from exc


# --- what a release leaves behind ----------------------------------------------------------------------------
def listable_resources(env: Environment) -> list[str]:
    """Every API resource (namespaced and cluster-scoped, built-in and custom) that supports list."""
    out = env.kubectl("api-resources", "--verbs=list", "-o", "name").stdout
    return sorted({line.strip() for line in out.splitlines() if line.strip()})


def belongs_to(obj: Mapping[str, Any], release: str, namespace: str) -> bool:
    """Whether OBJ was made by (or for) the helm release RELEASE in NAMESPACE: the chart's instance label,
    helm's ownership annotations, or helm's own release record (Secret owner=helm,name=RELEASE)."""
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    ann = meta.get("annotations") or {}
    if labels.get(LABEL_INSTANCE) == release:
        return True
    if ann.get(ANN_RELEASE_NAME) == release and ann.get(ANN_RELEASE_NAMESPACE, namespace) == namespace:
        return True
    return (obj.get("kind") == "Secret" and meta.get("namespace") == namespace
            and labels.get("owner") == "helm" and labels.get("name") == release)


def leftovers(env: Environment, release: str, namespace: str, *,
              keep_kinds: Sequence[str] = ("CustomResourceDefinition",)) -> list[str]:
    """Every object still in the cluster that belongs to RELEASE (see belongs_to), across all listable
    resources and namespaces, as "Kind namespace/name"; KEEP_KINDS are left out (helm never deletes the
    CRDs of a chart's crds/ folder, by design: deleting them would delete every WeightSyncJob)."""
    found: list[str] = []
    resources = listable_resources(env)
    r = env.kubectl("get", ",".join(resources), "-A", "-o", "json", check=False, timeout=180)
    if r.returncode == 0:
        items = json.loads(r.stdout)["items"]
    else:  # one resource failed to list (e.g. an aggregated API): list them one by one
        items = []
        for res in resources:
            one = env.kubectl("get", res, "-A", "-o", "json", check=False)
            if one.returncode == 0:
                items += json.loads(one.stdout)["items"]
    for obj in items:
        if obj.get("kind") in keep_kinds or not belongs_to(obj, release, namespace):
            continue
        meta = obj["metadata"]
        where = f"{meta['namespace']}/" if meta.get("namespace") else ""
        found.append(f"{obj.get('kind')} {where}{meta['name']}")
    return sorted(found)
