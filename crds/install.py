"""`weightsync-crds`: print or install/upgrade the WeightSyncJob CRD, built in-process from the models.

    weightsync-crds print                       # the CRD YAML (the same bytes as crds/weightsync.io_weightsyncjobs.yaml)
    weightsync-crds apply [--kubeconfig PATH]   # create or upgrade it in the cluster, log what changed
    weightsync-crds apply --dry-run             # only log what would change

Helm installs `crds/` on the first install and never upgrades it; the chart's opt-in pre-upgrade hook
(`crds.upgradeHook.enabled`) runs `weightsync-crds apply` in a Job with the operator image, so the CRD always
matches the operator that is about to start. Credentials: the pod's in-cluster ServiceAccount token, else
--kubeconfig / $KUBECONFIG / ~/.kube/config.

`apply` server-side applies the CRD as field manager `weightsync-crds` with force (the models win any
conflict); the schema and the versions list are atomic for server-side apply, so that replaces them. It
never removes a granular field another field manager (Helm's first install, `kubectl apply`) set and the
models no longer have (e.g. `spec.conversion`), so when the applied CRD still differs from the generated
one the whole spec is replaced with an update (PUT). Permissions needed, all on
the one object customresourcedefinitions/weightsyncjobs.weightsync.io (resourceNames can hold them all:
server-side apply creates a missing object through a PATCH to its named URL, and the API server checks
`create` on that name, unlike a POST to the collection): get (read and wait for Established), patch
(server-side apply), create (the first apply when the CRD is missing), update (replace the spec; and the
dry-run replace that computes what changed).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from weightsync.crds import contract
from weightsync.crds.schema import crd

log = logging.getLogger("weightsync.crds.install")

FIELD_MANAGER = "weightsync-crds"
CRDS_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
REQUIRED_VERBS = ("get", "create", "patch", "update")
MAX_LOGGED_CHANGES = 40

Obj = dict[str, Any]


class CRDError(Exception):
    """A failure with a message that says what to do (printed as-is by the command)."""


@dataclass
class ApplyResult:
    created: bool = False
    changes: list[str] = field(default_factory=list)
    replaced: bool = False   # a PUT removed fields that other field managers kept
    dry_run: bool = False

    @property
    def changed(self) -> bool:
        return self.created or bool(self.changes)


# --- the API ---------------------------------------------------------------------------------------------
def api_client(kubeconfig: str | None = None) -> Any:
    """A kubernetes ApiClient: --kubeconfig if given, else the in-cluster ServiceAccount, else $KUBECONFIG."""
    from kubernetes import client as k8s_client
    from kubernetes import config as k8s_config

    if kubeconfig:
        return k8s_config.new_client_from_config(config_file=kubeconfig)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        cfg = k8s_client.Configuration()
        k8s_config.load_incluster_config(client_configuration=cfg)
        return k8s_client.ApiClient(cfg)
    return k8s_config.new_client_from_config()


class _Api:
    """The few raw calls this needs, with errors turned into CRDError messages that name the fix."""

    def __init__(self, api: Any, timeout: float = 30.0) -> None:
        self.api = api
        self.timeout = timeout

    def call(self, method: str, path: str, body: Any = None, query: list[tuple[str, str]] | None = None,
             content_type: str = "application/json") -> Obj | None:
        """The response object; None for a 404 on GET."""
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": "application/json", "Content-Type": content_type}
        try:
            m, url, hdrs, data, post = self.api.param_serialize(
                method, path, query_params=query or [], header_params=headers,
                # The apply-patch body goes as text (JSON is YAML); JSON bodies are serialised by the client.
                body=json.dumps(body) if body is not None and content_type.endswith("yaml") else body,
                auth_settings=["BearerToken"],
            )
            resp = self.api.call_api(m, url, hdrs, data, post, _request_timeout=self.timeout)
            raw = resp.read()
            status, reason = int(resp.status), str(resp.reason or "")
        except ApiException as exc:
            raw = exc.body.encode() if isinstance(exc.body, str) else (exc.body or b"")
            status, reason = int(exc.status or 0), str(exc.reason or "")
        except OSError as exc:  # urllib3 wraps connection failures in OSError subclasses
            raise CRDError(f"cannot reach the API server: {exc}") from None
        if 200 <= status <= 299:
            return json.loads(raw) if raw else {}
        if status == 404 and method == "GET":
            return None
        raise CRDError(_explain(method, status, reason, raw))


def _explain(method: str, status: int, reason: str, raw: bytes) -> str:
    message = reason
    try:
        message = str(json.loads(raw).get("message") or reason)
    except (ValueError, AttributeError):
        message = raw.decode(errors="replace")[:500] or reason
    if status == 403:
        m = re.search(r'User "([^"]+)" cannot (\w+) resource "([^"]+)"', message)
        who, verb = (m.group(1), m.group(2)) if m else ("this identity", method.lower())
        return (
            f"forbidden: {who} may not {verb} customresourcedefinitions/{contract.CRD_NAME}. "
            f"Grant verbs {', '.join(REQUIRED_VERBS)} on apiextensions.k8s.io customresourcedefinitions with "
            f"resourceNames [{contract.CRD_NAME}] (the Helm chart's crds.upgradeHook ClusterRole does). "
            f"API server: {message}"
        )
    if status == 401:
        return f"unauthorized: the API server refused the credentials (expired or wrong token?): {message}"
    if status == 422:
        return f"the API server refused the generated CRD (invalid): {message}"
    if status == 409:
        return f"conflict: the CRD changed while it was being upgraded; run again: {message}"
    return f"{method} {contract.CRD_NAME} failed: HTTP {status} {reason}: {message}"


# --- what changed ------------------------------------------------------------------------------------------
def changes(old: Any, new: Any, path: str = "spec") -> list[str]:
    """The paths where `new` differs from `old`: `path added`, `path removed`, `path: a -> b`."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for k in [*old, *(k for k in new if k not in old)]:
            sub = f"{path}.{k}"
            if k not in new:
                out.append(f"{sub} removed")
            elif k not in old:
                out.append(f"{sub} added")
            else:
                out += changes(old[k], new[k], sub)
        return out
    if isinstance(old, list) and isinstance(new, list) and _named(old) and _named(new):
        # Lists keyed by name (spec.versions): match entries by name, not position.
        was, now = {e["name"]: e for e in old}, {e["name"]: e for e in new}
        out = []
        for n in [*was, *(n for n in now if n not in was)]:
            sub = f"{path}[name={n}]"
            out += [f"{sub} removed"] if n not in now else [f"{sub} added"] if n not in was else changes(was[n], now[n], sub)
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [c for i, (a, b) in enumerate(zip(old, new, strict=True)) for c in changes(a, b, f"{path}[{i}]")]
    if old != new:
        return [f"{path}: {_short(old)} -> {_short(new)}"]
    return []


def _named(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(e, dict) and isinstance(e.get("name"), str) for e in items)


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def _replacement(live: Obj, desired: Obj) -> Obj:
    """The live object with the generated spec and labels: the body of the replacing update."""
    meta = {k: v for k, v in (live.get("metadata") or {}).items() if k != "managedFields"}
    meta["labels"] = {**(meta.get("labels") or {}), **(desired["metadata"].get("labels") or {})}
    return {"apiVersion": desired["apiVersion"], "kind": desired["kind"], "metadata": meta,
            "spec": copy.deepcopy(desired["spec"])}


# --- apply -------------------------------------------------------------------------------------------------
def apply(api: Any, desired: Obj | None = None, dry_run: bool = False, wait_seconds: float = 60.0) -> ApplyResult:
    """Create or upgrade the CRD so its spec equals the generated one; returns what changed."""
    body = desired or crd()
    name = body["metadata"]["name"]
    raw = _Api(api)
    path = f"{CRDS_PATH}/{name}"
    dry = [("dryRun", "All")] if dry_run else []
    ssa = [("fieldManager", FIELD_MANAGER), ("force", "true"), *dry]
    result = ApplyResult(dry_run=dry_run)

    live = raw.call("GET", path)
    if live is None:
        raw.call("PATCH", path, body, ssa, "application/apply-patch+yaml")
        result.created = True
        log.info("crd %s name=%s field_manager=%s", "would be created" if dry_run else "created", name, FIELD_MANAGER)
    else:
        # What the spec will be once replaced (server defaults included), without changing anything.
        target = raw.call("PUT", path, _replacement(live, body), [("fieldManager", FIELD_MANAGER), ("dryRun", "All")])
        assert target is not None
        result.changes = changes(live.get("spec"), target.get("spec"))
        result.changes += changes((live.get("metadata") or {}).get("labels") or {},
                                  (target.get("metadata") or {}).get("labels") or {}, "metadata.labels")
        for line in result.changes[:MAX_LOGGED_CHANGES]:
            log.info("crd change name=%s %s", name, line)
        if len(result.changes) > MAX_LOGGED_CHANGES:
            log.info("crd change name=%s ... and %d more", name, len(result.changes) - MAX_LOGGED_CHANGES)
        applied = raw.call("PATCH", path, body, ssa, "application/apply-patch+yaml")
        assert applied is not None
        if applied.get("spec") != target.get("spec"):
            # Fields another manager still owns (e.g. a property the models dropped): replace the spec.
            left = changes(applied.get("spec"), target.get("spec"))
            log.info("crd fields kept by other field managers name=%s %s; replacing the spec", name, "; ".join(left[:5]))
            raw.call("PUT", path, _replacement(applied, body), [("fieldManager", FIELD_MANAGER), *dry])
            result.replaced = True
        log.info("crd %s name=%s changes=%d", ("would be upgraded" if dry_run else "upgraded") if result.changes
                 else "up to date", name, len(result.changes))
    if not dry_run:
        wait_established(raw, path, wait_seconds)
    return result


def wait_established(raw: _Api, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    state: dict[str, str] = {}
    while True:
        obj = raw.call("GET", path) or {}
        state = {c.get("type", ""): c.get("status", "") for c in (obj.get("status") or {}).get("conditions") or []}
        if state.get("Established") == "True" and state.get("NamesAccepted") == "True":
            log.info("crd established name=%s", contract.CRD_NAME)
            return
        if time.monotonic() > deadline:
            raise CRDError(f"{contract.CRD_NAME} not Established after {timeout:.0f} s (conditions: {state})")
        time.sleep(0.5)


# --- command line ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="weightsync-crds", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("print", help="print the CRD YAML generated from the models")
    ap = sub.add_parser("apply", help="create or upgrade the CRD in the cluster (server-side apply)")
    ap.add_argument("--kubeconfig", default=None, help="default: in-cluster ServiceAccount, else $KUBECONFIG")
    ap.add_argument("--dry-run", action="store_true", help="log what would change; change nothing")
    ap.add_argument("--wait-seconds", type=float, default=60.0, help="wait this long for Established")
    args = parser.parse_args(argv)

    if args.command == "print":
        from weightsync.crds.generate import render

        sys.stdout.write(render())
        return 0

    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    try:
        api = api_client(args.kubeconfig)
        apply(api, dry_run=args.dry_run, wait_seconds=args.wait_seconds)
    except CRDError as err:
        log.error("%s", err)
        return 1
    except Exception as err:  # config errors (no kubeconfig, bad token file) with the reason, no traceback
        log.error("cannot apply %s: %s: %s", contract.CRD_NAME, type(err).__name__, err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
