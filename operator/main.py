"""`weightsync-operator`: run the kopf operator with weightsync's handlers.

    weightsync-operator --namespace team-a            # namespace-scoped (a Role is enough)
    weightsync-operator --all-namespaces              # cluster-wide (ClusterRole)
    weightsync-operator --all-namespaces --peering weightsync-operator --priority 100   # HA replicas
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import socket
import sys
import uuid
from collections.abc import Sequence
from dataclasses import replace

import kopf

from weightsync.operator import handlers
from weightsync.operator.config import OperatorConfig

log = logging.getLogger("weightsync.operator")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="weightsync-operator",
        description="Kubernetes operator for WeightSyncJob (weights from RL trainers to inference engines).",
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[],
                       help="Serve only this namespace (repeatable). Default: $WEIGHTSYNC_WATCH_NAMESPACES.")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="Serve every namespace (ClusterRole).")
    p.add_argument("--peering", default=os.environ.get("WEIGHTSYNC_PEERING") or None,
                   help="kopf peering object name: enables active/standby between operator replicas.")
    p.add_argument("--priority", type=int, default=int(os.environ.get("WEIGHTSYNC_PRIORITY") or 0),
                   help="Peering priority; give each replica a distinct one (e.g. random).")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (0: off). Default 8080.")
    p.add_argument("--health-port", type=int, default=None, help="Liveness /healthz port (0: off). Default 8081.")
    p.add_argument("--report-port", type=int, default=None,
                   help="Port agents push their reports to (0: off, agents write their pods only). Default 8082.")
    p.add_argument("--report-address", default=None,
                   help="Address agents reach this replica at (default $WEIGHTSYNC_REPORT_ADDRESS, else $POD_IP; "
                        "none: the report listener is off).")
    p.add_argument("--resync-seconds", type=float, default=None, help="Periodic resync interval. Default 30.")
    p.add_argument("--agent-image", default=None, help="Agent sidecar image (default $WEIGHTSYNC_AGENT_IMAGE).")
    p.add_argument("--log-format", choices=["json", "plain", "full"],
                   default=os.environ.get("WEIGHTSYNC_LOG_FORMAT") or "plain", help="Log format (json in clusters).")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--debug", action="store_true")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> OperatorConfig:
    overrides = {}
    if args.metrics_port is not None:
        overrides["metrics_port"] = args.metrics_port
    if args.health_port is not None:
        overrides["health_port"] = args.health_port
    if args.report_port is not None:
        overrides["report_port"] = args.report_port
    if args.report_address is not None:
        overrides["report_address"] = args.report_address
    if args.resync_seconds is not None:
        overrides["resync_seconds"] = args.resync_seconds
    if args.agent_image:
        overrides["agent_image"] = args.agent_image
    return OperatorConfig.from_env(**overrides)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    fmt = {"json": kopf.LogFormat.JSON, "plain": kopf.LogFormat.PLAIN, "full": kopf.LogFormat.FULL}[args.log_format]
    kopf.configure(verbose=args.verbose, debug=args.debug, log_format=fmt)
    try:
        cfg = replace(build_config(args), report_instance=uuid.uuid4().hex[:12])
    except ValueError as err:
        print(f"weightsync-operator: {err}", file=sys.stderr)
        return 2
    if cfg.operator_key is None:
        log.warning("no operator key (WEIGHTSYNC_OPERATOR_KEY_FILE): job tokens are random and versions written "
                    "on pods are believed without proof; the Helm chart always sets one")

    namespaces = list(args.namespace)
    if not namespaces and not args.all_namespaces:
        env_ns = os.environ.get("WEIGHTSYNC_WATCH_NAMESPACES", "")
        namespaces = [n.strip() for n in env_ns.split(",") if n.strip()]
    if not namespaces and not args.all_namespaces:
        print("weightsync-operator: choose a scope: --namespace NS (repeatable) or --all-namespaces",
              file=sys.stderr)
        return 2

    identity = f"{os.environ.get('POD_NAME') or socket.gethostname()}/{uuid.uuid4().hex[:8]}"
    standalone = args.peering is None
    priority = args.priority
    if not standalone and priority == 0:
        # kopf pauses every replica when two share a priority: pick a random one unless told.
        priority = random.randint(1, 1_000_000)
    handlers.OPTIONS = handlers.RuntimeOptions(
        config=cfg,
        identity=identity,
        standalone=standalone,
        peering_name=args.peering or "default",
        peering_namespace=None if args.all_namespaces else namespaces[0],
        priority=priority,
        # Watching CRDs/namespaces needs cluster-scoped read access; a namespaced install has only a Role.
        scanning=bool(args.all_namespaces),
        namespaces=None if args.all_namespaces else namespaces,
    )
    liveness = f"http://0.0.0.0:{cfg.health_port}/healthz" if cfg.health_port > 0 else None
    log.info("starting scope=%s standalone=%s identity=%s", "cluster" if args.all_namespaces else ",".join(namespaces),
             standalone, identity)
    kopf.run(
        clusterwide=bool(args.all_namespaces),
        namespaces=namespaces,
        standalone=standalone,
        peering_name=args.peering,
        priority=priority,
        liveness_endpoint=liveness,
        identity=identity,  # type: ignore[arg-type]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
