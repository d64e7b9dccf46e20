"""`python -m weightsync.e2e.demo_cli` (`make demo`): the whole closed loop on one machine, in about a minute.

It starts a real local control plane with simulated GPU nodes and the process runtime (e2e/), `helm
install`s the chart (helm/weightsync-operator: the CRD from its crds/, the operator Deployment, which the
process runtime runs as a host process with the chart ServiceAccount's own token, so only the chart's
RBAC is used), applies examples/demo-separated.yaml (or --example colocated) and prints one table line
whenever the job or a pod changes while the demo trainer publishes versions 1..N, until
status.servedVersion reaches N. Then it prints `kubectl get wsj -o wide` and the pods, checks that every
engine's weights are bit-exact with the trainer's (sha256 of every tensor, from the demo trainer's and
engines' /checksums endpoints), `helm uninstall`s and tears everything down (--keep leaves it running
until Ctrl-C and prints what to run against it). --example vllm (run_vllm_demo) runs examples/demo-vllm.yaml
instead: real vLLM servers, the trainer gated version by version, and each version's greedy outputs from every
replica checked against transformers' forward over the weights the trainer saved. --example rl (e2e/rl_demo.py)
runs examples/rl-loop-vllm.yaml: a policy-gradient loop whose rollouts come from those servers.

The pieces it runs (the demo runs, the progress table, the bit-exact check) are in e2e/demo.py, which the e2e
suite (e2e/tests/) and bench/status_latency.py use too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from weightsync.e2e import chart
from weightsync.e2e.binaries import find_binary
from weightsync.e2e.demo import (
    BOTH,
    DEMO_EXAMPLES,
    RL_TIMEOUT,
    DemoError,
    demo_environment,
    ensure_namespace,
    run_demo,
    run_vllm_demo,
)
from weightsync.e2e.environment import Environment
from weightsync.e2e.rl_demo import run_rl_demo


def keep_instructions(env: Environment, namespaces: list[str], release: Any, examples: list[str] | None = None) -> str:
    """What to run against the cluster while `make demo --keep` holds it."""
    bins = sorted({str(find_binary(b).parent) for b in ("kubectl", "helm")})
    logs = ", ".join(str(f) for f in release.log_files()) or f"kubectl -n {release.namespace} logs deploy/{release.deployment}"
    ns = namespaces[0]
    other = "demo-separated.yaml" if examples == ["colocated"] else "demo-colocated.yaml"
    return "\n".join([
        "[demo] --keep: everything stays up while this process runs. In another shell:",
        f"    export KUBECONFIG={env.kubeconfig}",
        f"    export PATH={':'.join(bins)}:$PATH",
        f"    kubectl get wsj -n {ns} -w      # the job's versions and conditions",
        f"    kubectl get pods -n {ns} -o wide",
        f"    helm list -n {release.namespace}",
        f"    kubectl apply --server-side -n {ns} -f examples/{other}   # one more job, versions 1..5",
        f"  operator log: {logs}",
        "[demo] press Ctrl-C here to stop: helm uninstall, then the pods, the runtime and the control plane go away.",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m weightsync.e2e.demo_cli", description=__doc__.splitlines()[0])
    p.add_argument("--example", choices=[*DEMO_EXAMPLES, "both"], default="separated",
                   help="which demo job to run (default: separated, NCCL over gloo; colocated: IPC; sglang: the "
                   "SGLang stand-in; vllm: a real vLLM server (CPU); rl: an RL loop whose rollouts come from real "
                   "vLLM servers; both: all but vllm and rl)")
    p.add_argument("--namespace", default="demo", help="the job's namespace (default demo)")
    p.add_argument("--operator-namespace", default="weightsync-system", help="where the chart is installed")
    p.add_argument("--release", default="weightsync", help="the helm release name (default weightsync)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for servedVersion (default 300)")
    p.add_argument("--keep", action="store_true", help="leave everything running until Ctrl-C")
    p.add_argument("--work-dir", type=Path, default=None, help="kubeconfig, runtime state and logs (default: temp)")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    t0 = time.monotonic()

    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # Ctrl-C and SIGTERM (also when started in the background, where SIGINT may arrive ignored) unwind
    # through the teardown: helm uninstall, pods, runtime, control plane.
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)

    def say(msg: str) -> None:
        print(msg, flush=True)

    def step(msg: str) -> None:
        say(f"[demo {time.monotonic() - t0:5.1f}s] {msg}")

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="weightsync-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    examples = list(BOTH) if args.example == "both" else [args.example]
    namespaces = [args.namespace if len(examples) == 1 else f"{args.namespace}-{ex}" for ex in examples]
    step(f"starting a local control plane + 2 simulated GPU nodes + the process runtime (work dir {work})")
    release: Any = None
    try:
        with demo_environment(work) as env:
            step(f"cluster ready: server={env.server}, nodes {', '.join(env.node_names)}")
            for ns in namespaces:
                ensure_namespace(env, ns)
            step(f"$ helm install {args.release} helm/weightsync-operator -n {args.operator_namespace} "
                 f"--create-namespace --set watchNamespaces={{{','.join(namespaces)}}} --wait")
            release = chart.install_chart(env, args.operator_namespace, args.release, watch_namespaces=namespaces,
                                          create_namespace=True)
            pod = release.operator_pod()
            who = release.whoami()
            step(f"values: {json.dumps(release.values, sort_keys=True)} (pods are host processes here: free "
                 "host ports, and the operator pinned to a process node)")
            step(f"chart installed in {release.install_seconds:.1f}s: deploy/{release.deployment} pod "
                 f"{pod['metadata']['name']} on {pod['spec'].get('nodeName')} (a host process, pid "
                 f"{release.operator_pid()}), authenticated as {who.get('username')}")
            for ex, ns in zip(examples, namespaces, strict=True):
                if ex == "vllm":
                    run_vllm_demo(env, ns, args.timeout, say, operator_log=lambda: release.logs(tail=40))
                elif ex == "rl":
                    run_rl_demo(env, ns, max(args.timeout, RL_TIMEOUT), say, operator_log=lambda: release.logs(tail=40))
                else:
                    run_demo(env, ex, ns, args.timeout, say, operator_log=lambda: release.logs(tail=40))
            step("OK: every vLLM engine served each version with the reference's outputs" if examples == ["vllm"]
                 else "OK: the policy learned from rollouts the vLLM servers generated with its fresh versions"
                 if examples == ["rl"] else "OK: every engine serves the trainer's last version, bit for bit")
            if args.keep:
                say(keep_instructions(env, namespaces, release, examples))
                with contextlib.suppress(KeyboardInterrupt):
                    while True:
                        time.sleep(3600)
                say("")
                step("Ctrl-C: tearing down")
            for ns in namespaces:
                env.kubectl("delete", "wsj", "--all", "-n", ns, "--wait=true", "--timeout=60s", check=False)
            release.uninstall()
            left = chart.leftovers(env, release.release, release.namespace)
            if left:
                raise DemoError(f"helm uninstall {release.release} left objects behind: {left}")
            step(f"$ helm uninstall {release.release}: nothing of the release is left (the CRD stays, as helm "
                 "keeps crds/)")
    except (DemoError, chart.ChartError) as exc:
        say(f"[demo] FAILED: {exc}")
        say(f"[demo] logs: {work}")
        return 1
    except KeyboardInterrupt:
        say("[demo] interrupted; torn down")
        return 130
    step("torn down: control plane, nodes, runtime and pods stopped; no process and no port left. "
         "`make demo DEMO_ARGS=--keep` keeps it running.")
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
