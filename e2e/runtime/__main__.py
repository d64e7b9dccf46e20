"""`python -m weightsync.e2e.runtime --kubeconfig K --nodes a,b --state-dir D`: the process runtime as a
process (what `make dev-up` launches). SIGTERM / SIGINT stop it cleanly, killing every pod process."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from weightsync.e2e.runtime.images import images_from_env
from weightsync.e2e.runtime.ips import DEFAULT_POD_CIDR
from weightsync.e2e.runtime.runtime import ProcessRuntime
from weightsync.e2e.runtime.services import DEFAULT_SERVICE_CIDR


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m weightsync.e2e.runtime", description=__doc__)
    parser.add_argument("--kubeconfig", required=True, help="admin kubeconfig of the cluster")
    parser.add_argument("--nodes", required=True, help="comma-separated process node names")
    parser.add_argument("--state-dir", required=True, type=Path, help="pod dirs and container logs go here")
    parser.add_argument("--python-bin-dir", type=Path, default=None, help="prepended to PATH (default: this venv)")
    parser.add_argument("--pod-cidr", default=DEFAULT_POD_CIDR, help="loopback CIDR for pod IPs (inside 127.0.0.0/8)")
    parser.add_argument("--service-cidr", default=DEFAULT_SERVICE_CIDR,
                        help="loopback CIDR for the Service proxy's addresses (stand-ins for ClusterIPs); '' disables it")
    parser.add_argument("--images", default=os.environ.get("WEIGHTSYNC_RUNTIME_IMAGES", ""),
                        help="buildah: run containers whose image is in this host's buildah storage from that image "
                             "(default: $WEIGHTSYNC_RUNTIME_IMAGES, else host processes only)")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
    try:
        runtime = ProcessRuntime(args.kubeconfig, nodes, args.state_dir, args.python_bin_dir, pod_cidr=args.pod_cidr,
                                 images=images_from_env(args.images), service_cidr=args.service_cidr or None)
    except Exception as exc:  # one clear line instead of a traceback
        print(
            f"error: cannot start the process runtime with --kubeconfig {args.kubeconfig}: {exc} "
            "(start a cluster with `make dev-up`, which writes .dev/kubeconfig)",
            file=sys.stderr,
        )
        return 2
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    runtime.start()
    print(f"process runtime ready nodes={','.join(nodes)} state_dir={args.state_dir}", flush=True)
    done.wait()
    runtime.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
