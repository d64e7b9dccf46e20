"""F2 of the hostile-input issue: a flood of idle TCP connections on every agent port, kept up (closed
ones are reopened) by a client with its own address, as another pod in the cluster would be, while the
demo trainer publishes versions through real agent processes. Before, 80 idle connections held all 64
handshake slots of the trainer agent's control port, syncs failed and the readiness gate took the fleet
NotReady; the metrics port spawned a thread per connection. Now handshakes are bounded per client address
and the HTTP port bounds and times out its connections: served versions advance, bit-exact, and every
readiness probe from another address is answered 200 during the flood."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

from podprocs import Cluster, Pod, engine_version, get_json, get_text, metric_value, wait_for
from test_demo_processes import engine_sums, trainer_sums

from weightsync.agent.wire import link
from weightsync.crds import contract

FLOOD_PER_PORT = 80
VERSIONS = 8


def agent_threads(pod: Pod) -> int:
    """Threads of the pod's agent process now."""
    status = Path(f"/proc/{pod.procs['agent'].pid}/status").read_text()
    return int(status.split("Threads:")[1].split()[0])


class Flood:
    """FLOOD_PER_PORT idle connections to each (host, port) from SOURCE, reopened when the agent drops them."""

    def __init__(self, source: str, targets: list[tuple[str, int]]) -> None:
        self.source, self.targets = source, targets
        self.stop = threading.Event()
        self.opened = 0
        self.socks: dict[tuple[str, int], list[socket.socket]] = {t: [] for t in targets}
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self, target: tuple[str, int]) -> socket.socket | None:
        s = socket.socket()
        s.bind((self.source, 0))
        s.settimeout(1.0)
        try:
            s.connect(target)
        except OSError:
            s.close()
            return None
        self.opened += 1
        return s

    @staticmethod
    def _alive(s: socket.socket) -> bool:
        s.setblocking(False)
        try:
            return s.recv(1, socket.MSG_PEEK) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False
        finally:
            s.setblocking(True)

    def _run(self) -> None:
        while not self.stop.is_set():
            for target, socks in self.socks.items():
                for s in [s for s in socks if not self._alive(s)]:
                    socks.remove(s)
                    s.close()
                while len(socks) < FLOOD_PER_PORT and not self.stop.is_set():
                    s = self._open(target)
                    if s is None:
                        break
                    socks.append(s)
            self.stop.wait(0.2)

    def __enter__(self) -> Flood:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
        for socks in self.socks.values():
            for s in socks:
                with contextlib.suppress(OSError):
                    s.close()


def test_idle_connection_flood_slows_no_sync_and_never_flips_readiness(tmp_path: Path,
                                                                        clusters: list[Cluster]) -> None:
    c = Cluster(tmp_path, mode="NCCL", bucket_mb=1)
    clusters.append(c)
    t, (i,) = c.start_separated(1, "--versions", str(VERSIONS), "--interval", "1.5")
    wait_for(lambda: (engine_version(i) or 0) >= 1, 90, "the first version served before the flood", c)
    ports = (contract.CONTROL_PORT, contract.METRICS_PORT, contract.TRANSPORT_PORT)
    targets = [(pod.ip, port) for pod in (t, i) for port in ports]
    probes: list[tuple[str, int]] = []
    base_threads = agent_threads(t)
    with Flood(f"{c.subnet}.250", targets) as flood:
        wait_for(lambda: flood.opened >= len(targets) * FLOOD_PER_PORT // 2, 30, "the flood under way", c)
        time.sleep(1.0)
        # a peer with the job token (the agent's own connect) gets through at once, every time
        refused = []
        for _ in range(10):
            try:
                link.connect(t.ip, contract.CONTROL_PORT, c.token_path.read_text(), timeout=3).close()
            except link.LinkError as exc:
                refused.append(str(exc))
            time.sleep(0.2)
        assert not refused, f"{len(refused)} of 10 authenticated connects refused under the flood: {refused[:2]}"
        threads = agent_threads(t)
        start = engine_version(i) or 0
        # the inference agent restarts under the flood: it must handshake with the trainer agent again
        c.kill(i, "agent")
        c.start_agent(i)
        t0 = time.monotonic()
        wait_for(lambda: get_json(f"{i.metrics_url}/healthz", timeout=5)[0] == 200, 60, "the restarted agent up", c)
        deadline = t0 + 120
        while (engine_version(i) or 0) < VERSIONS:
            assert time.monotonic() < deadline, f"versions stopped at {engine_version(i)} under the flood"
            for pod in (t, i):  # the kubelet's readiness probe, from another address
                code, _ = get_json(f"{pod.metrics_url}/healthz", timeout=5)
                probes.append((pod.name, code))
            time.sleep(0.5)
        opened = flood.opened
    # threads bounded: at most the per-address slots of the control and metrics ports beyond the base
    assert threads - base_threads <= 16, (base_threads, threads)
    assert start < VERSIONS, "the flood must overlap versions still to come"
    assert probes and all(code == 200 for _, code in probes), [p for p in probes if p[1] != 200]
    version, got = engine_sums(i.demo_url)
    assert version == VERSIONS and got == trainer_sums(t, VERSIONS)
    # the bound did the work: the flood was refused, not merely tolerated
    assert opened >= len(targets) * 8, opened
    _, m = get_text(f"{t.metrics_url}/metrics")
    assert (metric_value(m, "weightsync_agent_rejected_connections") or 0) > 0
