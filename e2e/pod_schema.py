"""Retake the CRD's core/v1 PodTemplateSpec snapshot (crds/k8s/pod-template-spec.json) from the local control
plane's kube-apiserver, the pinned release; `make crds` then rebuilds the CRD. It lives here, not in crds/,
because it starts the local cluster: the API package imports nothing of e2e/.

    python -m weightsync.e2e.pod_schema --refresh
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from weightsync.crds.k8s_schema import ROOT, SNAPSHOT, convert
from weightsync.e2e.environment import start_environment


def refresh() -> Path:
    """Retake the snapshot from the local control plane's kube-apiserver (the pinned release)."""
    work = Path(tempfile.mkdtemp(prefix="weightsync-openapi-"))
    env = start_environment(kubeconfig=work / "kubeconfig", node_count=0, process_nodes=False)
    try:
        doc = json.loads(env.kubectl("get", "--raw", "/openapi/v3/api/v1").stdout)
        version = json.loads(env.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
    finally:
        env.stop()
    body = {"kubernetesVersion": version, "source": "/openapi/v3/api/v1 " + ROOT,
            "schema": convert(doc["components"]["schemas"])}
    SNAPSHOT.parent.mkdir(parents=True, exist_ok=True)
    SNAPSHOT.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    return SNAPSHOT


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m weightsync.e2e.pod_schema", description=__doc__.splitlines()[0])
    p.add_argument("--refresh", action="store_true", help="retake the snapshot from a local kube-apiserver")
    args = p.parse_args(argv)
    if args.refresh:
        print(f"wrote {refresh()}")
    else:
        snap = json.loads(SNAPSHOT.read_text())
        print(f"{SNAPSHOT}: {snap['kubernetesVersion']}, {len(json.dumps(snap['schema']))} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
