"""A real agent process driving an HTTP engine adapter (SGLang) against a recording HTTP server: the
engine is paused, gets the version's full tensors in flattened buckets, the version is set, and it is
resumed, in that order, for every version."""

from __future__ import annotations

import sys
from pathlib import Path

from podprocs import Cluster, wait_for
from weightsync.crds import contract

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engines"))
from recording_server import RecordingServer


def test_agent_drives_an_sglang_engine_over_http(tmp_path: Path, clusters: list[Cluster]) -> None:
    server = RecordingServer()
    try:
        c = Cluster(tmp_path, mode="NCCL", bucket_mb=1)
        clusters.append(c)
        t = c.add_pod("demo-trainer-0", contract.ROLE_TRAINER)
        i = c.add_pod("demo-inference-0-0", contract.ROLE_INFERENCE)
        c.write_topology()
        c.start_agent(t)
        c.start_agent(i, **{contract.ENV_ENGINE_TYPE: "SGLang", contract.ENV_ENGINE_URL: server.url})
        c.start_trainer(t, "--versions", "2", "--interval", "1.0")

        def versions_set() -> list[str]:
            return [str(call.body.get("new_version")) for call in server.calls
                    if call.path == "/update_weight_version" and isinstance(call.body, dict)]

        wait_for(lambda: "2" in versions_set(), 90, "SGLang told to serve version 2", c)
        paths = [p for p in server.paths() if p != "/model_info"]
        # per version: pause, >= 1 bucket, set the version, resume
        for v in ("1", "2"):
            k = next(n for n, call in enumerate(server.calls)
                     if call.path == "/update_weight_version" and str(call.body.get("new_version")) == v)
            before = [c.path for c in server.calls[:k]]
            last_pause = len(before) - 1 - before[::-1].index("/pause_generation")
            assert "/update_weights_from_tensor" in before[last_pause:], paths
            assert "/continue_generation" not in before[last_pause:], paths
            assert server.calls[k + 1].path == "/continue_generation", paths
        assert paths.count("/pause_generation") == paths.count("/continue_generation") >= 1
    finally:
        server.close()
