"""spec.transfer.deltaSync inside the agent: which transport gets a DeltaConfig, and that the agent's
transport cache hands the same GDR transport (and so the same delta base) to every version of a group."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from weightsync.agent.config import AgentConfig
from weightsync.agent.main import delta_config
from weightsync.agent.transfer.groups import TransportCache
from weightsync.agent.transports.delta import DeltaConfig
from weightsync.crds import contract


def _cfg(tmp: Path, **env: str) -> AgentConfig:
    base = {contract.ENV_JOB: "j", contract.ENV_POD_NAME: "j-trainer-0", contract.ENV_ROLE: "trainer",
            contract.ENV_TOPOLOGY_PATH: str(tmp / "topo.json"), contract.ENV_TOKEN_PATH: str(tmp / "token"),
            contract.ENV_SOCKET_DIR: str(tmp)}
    return AgentConfig.from_env({**base, **env})


def test_delta_config_only_for_gdr(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    on = _cfg(tmp_path, **{contract.ENV_DELTA_SYNC: "true", contract.ENV_DELTA_MAX_CHANGED_FRACTION: "0.2"})
    assert delta_config(on, "GDR") == DeltaConfig(max_changed_fraction=0.2)
    assert delta_config(_cfg(tmp_path), "GDR") is None
    with caplog.at_level(logging.WARNING, logger="weightsync.agent"):
        for mode in ("NCCL", "IPC"):  # transfer.mode Auto resolved to a transport without deltas
            assert delta_config(on, mode) is None
    warned = [r.getMessage() for r in caplog.records if "deltaSync requested" in r.getMessage()]
    assert warned == ["deltaSync requested but the transport is NCCL: full buckets (only GDR sends deltas)",
                      "deltaSync requested but the transport is IPC: full buckets (only GDR sends deltas)"]


def test_transport_cache_reuses_the_gdr_transport_and_its_delta_base() -> None:
    delta = DeltaConfig(max_changed_fraction=0.2)
    cache = TransportCache(mode="GDR", job="j", pod_ip="127.0.0.1", transport_port=0, delta=delta)
    group = {"name": "replica-0", "generation": 1, "epoch": "e1"}
    try:
        first, _ = cache.get(group, None, role="src0")  # type: ignore[arg-type]
        assert first.delta == delta  # type: ignore[attr-defined]
        again, _ = cache.get(group, None, role="src0")  # type: ignore[arg-type]
        assert again is first, "a new transport per version would start every version without a delta base"
        newer, _ = cache.get({**group, "generation": 2}, None, role="src0")  # type: ignore[arg-type]
        assert newer is not first  # new membership: new transport, empty base, first version in full
        plain = TransportCache(mode="NCCL", job="j", pod_ip="127.0.0.1", transport_port=0, delta=delta)
        assert plain.delta is None  # only GDR transports are built with a delta config
    finally:
        cache.close()
