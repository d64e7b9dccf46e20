"""Agent configuration: who this agent is (env set by the operator) and the job's membership (topology file).

Every path and port comes from an env var with the in-pod default, so agent tests without Kubernetes can
point an agent at a temporary directory and a loopback IP. The topology file is re-read when its
`generation` changes (the operator bumps it when the set of pods or their IPs changes).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightsync.crds import contract
from weightsync.crds.topology import Topology

log = logging.getLogger(__name__)

ROLES = (contract.ROLE_TRAINER, contract.ROLE_INFERENCE, contract.ROLE_COLOCATED)
ENGINE_TYPES = ("SGLang", "VLLM", "Custom")
TRANSFER_MODES = ("Auto", "IPC", "NCCL", "GDR")
DEFAULT_DELTA_MAX_CHANGED_FRACTION = 0.1  # the CRD's default for spec.transfer.deltaSync.maxChangedFraction


class ConfigError(ValueError):
    """The agent's environment or topology file is wrong; the message says which variable and how to fix it."""


def _get(env: Mapping[str, str], name: str, default: str | None = None) -> str:
    value = env.get(name, default)
    if value is None or value == "":
        raise ConfigError(f"environment variable {name} is required (the operator sets it on agent containers)")
    return value


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"environment variable {name}={raw!r} is not a boolean (use true or false)")


def _fraction(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not a number (expected a fraction from 0 to 1)") from None
    if not 0.0 <= value <= 1.0:  # also refuses nan
        raise ConfigError(f"environment variable {name}={raw!r} must be a fraction from 0 to 1")
    return value


def _device(raw: str) -> str:
    if raw == "cpu" or raw == "cuda" or (raw.startswith("cuda:") and raw[5:].isdigit()):
        return raw
    raise ConfigError(f"{contract.ENV_AGENT_DEVICE}={raw!r}: expected cpu, cuda or cuda:N")


@dataclass(frozen=True)
class LoraSpec:
    """spec.inference.engine.lora as the agent reads it (WEIGHTSYNC_LORA, JSON)."""

    adapter_name: str
    config: Mapping[str, Any]
    pinned: bool = False

    @classmethod
    def from_json(cls, raw: str) -> LoraSpec:
        try:
            doc = json.loads(raw)
            return cls(adapter_name=str(doc["adapterName"]), config=dict(doc["config"]),
                       pinned=bool(doc.get("pinned", False)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"not a LoRA spec ({{adapterName, config, pinned}}): {exc}") from None


@dataclass(frozen=True)
class AgentConfig:
    """Identity and settings of one agent, read once at start."""

    job: str
    namespace: str
    pod_name: str
    pod_ip: str
    role: str
    rank: int
    world_size: int
    replica: int
    topology_path: Path
    token_path: Path
    socket_dir: Path
    control_port: int = contract.CONTROL_PORT
    metrics_port: int = contract.METRICS_PORT
    transport_port: int = contract.TRANSPORT_PORT
    transfer_mode: str = "Auto"
    bucket_size_mb: int = 512
    verify: str = "None"
    engine_type: str = "Custom"
    engine_url: str = ""
    pause_generation: bool = True
    max_staleness: int = 1
    kube_enabled: bool = True
    device: str = "cpu"
    timeout_seconds: float = 600.0
    delta_sync: bool = False  # spec.transfer.deltaSync.enabled: send changed words only (GDR transport)
    delta_max_changed_fraction: float = DEFAULT_DELTA_MAX_CHANGED_FRACTION
    lora: LoraSpec | None = None  # spec.inference.engine.lora: sync an adapter, not base weights
    fan_out: str = "Direct"  # spec.transfer.fanOut: Relay forwards versions along a chain of replicas
    engine_fault: str = ""  # contract.ENV_ENGINE_FAULT: a chaos drill on the engine's last hop
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def socket_path(self) -> Path:
        return self.socket_dir / contract.AGENT_SOCKET_NAME

    @property
    def is_trainer(self) -> bool:
        return self.role in (contract.ROLE_TRAINER, contract.ROLE_COLOCATED)

    @property
    def is_inference(self) -> bool:
        return self.role in (contract.ROLE_INFERENCE, contract.ROLE_COLOCATED)

    def read_token(self) -> bytes:
        """The per-job HMAC key; an empty or missing file is an error, never a silent empty key."""
        try:
            token = self.token_path.read_bytes().strip()
        except FileNotFoundError:
            raise ConfigError(
                f"token file {self.token_path} not found: mount the job's token Secret there or set {contract.ENV_TOKEN_PATH}"
            ) from None
        if not token:
            raise ConfigError(f"token file {self.token_path} is empty: the job's token Secret has no key")
        return token

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AgentConfig:
        env = os.environ if env is None else env
        role = _get(env, contract.ENV_ROLE)
        if role not in ROLES:
            raise ConfigError(f"{contract.ENV_ROLE}={role!r}: expected one of {', '.join(ROLES)}")
        mode = env.get(contract.ENV_TRANSFER_MODE) or "Auto"
        if mode not in TRANSFER_MODES:
            raise ConfigError(f"{contract.ENV_TRANSFER_MODE}={mode!r}: expected one of {', '.join(TRANSFER_MODES)}")
        engine = env.get(contract.ENV_ENGINE_TYPE) or "Custom"
        if engine not in ENGINE_TYPES:
            raise ConfigError(f"{contract.ENV_ENGINE_TYPE}={engine!r}: expected one of {', '.join(ENGINE_TYPES)}")
        verify = env.get(contract.ENV_VERIFY) or "None"
        if verify not in ("None", "Checksum"):
            raise ConfigError(f"{contract.ENV_VERIFY}={verify!r}: expected None or Checksum")
        fan_out = env.get(contract.ENV_FAN_OUT) or "Direct"
        if fan_out not in ("Direct", "Relay"):
            raise ConfigError(f"{contract.ENV_FAN_OUT}={fan_out!r}: expected Direct or Relay")
        lora = None
        if env.get(contract.ENV_LORA):
            try:
                lora = LoraSpec.from_json(env[contract.ENV_LORA])
            except ValueError as exc:
                raise ConfigError(f"{contract.ENV_LORA}: {exc}") from None
        world = _int(env, contract.ENV_WORLD_SIZE, 1)
        rank = _int(env, contract.ENV_RANK, 0)
        if world < 1 or not 0 <= rank < world:
            raise ConfigError(f"{contract.ENV_RANK}={rank} must be within [0, {contract.ENV_WORLD_SIZE}={world})")
        return cls(
            job=_get(env, contract.ENV_JOB),
            namespace=env.get(contract.ENV_NAMESPACE) or "default",
            pod_name=_get(env, contract.ENV_POD_NAME),
            pod_ip=env.get(contract.ENV_POD_IP) or "127.0.0.1",
            role=role,
            rank=rank,
            world_size=world,
            replica=_int(env, contract.ENV_REPLICA, 0),
            topology_path=Path(
                env.get(contract.ENV_TOPOLOGY_PATH) or f"{contract.TOPOLOGY_DIR}/{contract.TOPOLOGY_FILE}"
            ),
            token_path=Path(env.get(contract.ENV_TOKEN_PATH) or f"{contract.TOKEN_DIR}/{contract.TOKEN_FILE}"),
            socket_dir=Path(env.get(contract.ENV_SOCKET_DIR) or contract.SOCKET_DIR),
            control_port=_int(env, contract.ENV_CONTROL_PORT, contract.CONTROL_PORT),
            metrics_port=_int(env, contract.ENV_METRICS_PORT, contract.METRICS_PORT),
            transport_port=_int(env, contract.ENV_TRANSPORT_PORT, contract.TRANSPORT_PORT),
            transfer_mode=mode,
            bucket_size_mb=max(1, _int(env, contract.ENV_BUCKET_SIZE_MB, 512)),
            verify=verify,
            engine_type=engine,
            engine_url=env.get(contract.ENV_ENGINE_URL) or "",
            pause_generation=_bool(env, contract.ENV_PAUSE_GENERATION, True),
            max_staleness=max(0, _int(env, contract.ENV_MAX_STALENESS, 1)),
            kube_enabled=_bool(env, contract.ENV_KUBE_ENABLED, True),
            device=_device(env.get(contract.ENV_AGENT_DEVICE) or "cpu"),
            timeout_seconds=float(max(1, _int(env, contract.ENV_TIMEOUT_SECONDS, 600))),
            delta_sync=_bool(env, contract.ENV_DELTA_SYNC, False),
            delta_max_changed_fraction=_fraction(env, contract.ENV_DELTA_MAX_CHANGED_FRACTION,
                                                 DEFAULT_DELTA_MAX_CHANGED_FRACTION),
            lora=lora,
            fan_out=fan_out,
            engine_fault=env.get(contract.ENV_ENGINE_FAULT) or "",
        )


def read_topology(path: Path) -> Topology:
    """Parse the topology file; a clear error names the file when it is missing or invalid."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(
            f"topology file {path} not found: mount the job's topology ConfigMap or set {contract.ENV_TOPOLOGY_PATH}"
        ) from None
    try:
        return Topology.from_json(text)
    except ValueError as exc:
        raise ConfigError(f"topology file {path} is invalid: {exc}") from None


class TopologyWatcher:
    """Re-reads the topology file when it changes on disk and reports a new membership generation.

    ConfigMap volumes are updated by an atomic symlink swap, so the stat of the resolved path is compared.
    A file that is briefly unreadable or invalid keeps the last good topology (logged, never fatal).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.current = read_topology(path)
        self._stamp = self._stat()

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.resolve().stat()
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def poll(self) -> Topology | None:
        """Return the new topology if its generation changed since the last poll, else None."""
        stamp = self._stat()
        if stamp is None or stamp == self._stamp:
            return None
        self._stamp = stamp
        try:
            topo = read_topology(self.path)
        except ConfigError as exc:
            log.warning("topology reload failed, keeping generation=%s: %s", self.current.generation, exc)
            return None
        if topo.generation == self.current.generation and topo == self.current:
            return None
        old = self.current.generation
        self.current = topo
        log.info("topology changed generation=%s->%s", old, topo.generation)
        return topo
