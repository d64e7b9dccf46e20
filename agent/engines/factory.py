"""Build the engine adapter for `spec.inference.engine` (SGLang | VLLM | Custom, base weights or LoRA): the one
place that knows which adapter, last hop and options each engine and placement gets, plus the few engine
facts the rest of the agent asks about (full tensors or TP slices, how many versions stay staged).

Imports are lazy so that an agent image without an engine's optional bits still starts, and the Custom
adapter (agent/engines/custom.py) is only imported when a Custom engine is configured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightsync.agent.config import ConfigError, LoraSpec
from weightsync.agent.engines.base import EngineAdapter, EngineError
from weightsync.crds import contract

if TYPE_CHECKING:
    from weightsync.agent.engines.custom import AppRegistry

ENGINE_TYPES = ("SGLang", "VLLM", "Custom")
_ALIASES = {"sglang": "SGLang", "vllm": "VLLM", "custom": "Custom"}


def normalize_engine_type(engine_type: str) -> str:
    """The CRD spelling of an engine type; case-insensitive, raises EngineError for unknown ones."""
    t = _ALIASES.get(engine_type.strip().lower())
    if t is None:
        raise EngineError(f"unknown engine type {engine_type!r}; expected one of {', '.join(ENGINE_TYPES)}")
    return t


def make_adapter(engine_type: str, *, url: str | None = None, device: str = "cpu", tp_size: int = 1,
                 timeout: float | None = None, lora: LoraSpec | None = None, fault: str = "",
                 registry: AppRegistry | None = None, ranks: list[int] | None = None,
                 prefix: str = "") -> EngineAdapter:
    """The adapter for one engine. SGLang and VLLM need the engine's base URL (http://host:port); `lora` makes
    it a LoRA adapter (agent/engines/lora.py) that loads each version through the engine's adapter endpoint.
    Custom needs the agent's app registry, the engine ranks this agent feeds and its staging prefix.
    `timeout` (spec.transfer.timeoutSeconds) bounds each engine request; None keeps the adapter's default."""
    t = normalize_engine_type(engine_type)
    if t == "Custom":
        from weightsync.agent.engines.custom import CustomEngineAdapter

        if registry is None or ranks is None:
            raise EngineError("a Custom engine adapter needs the agent's app registry and its engine ranks")
        return CustomEngineAdapter(registry, ranks, prefix=prefix, device=device,
                                   **({} if timeout is None else {"request_timeout": float(timeout)}))
    options: dict[str, Any] = {} if timeout is None else {"timeout": float(timeout)}
    if t == "SGLang":
        # CUDA agents hand the engine CUDA IPC handles (device named by GPU UUID); an agent without a GPU
        # broadcasts each bucket into the engine's ranks over SGLang's weight-update group (a CPU tensor
        # pickled for another container cannot be rebuilt there).
        options.update(tp_size=tp_size, path="tensor" if device.startswith("cuda") else "distributed")
        if device.startswith("cuda"):
            options["devices"] = engine_devices(device, tp_size)
    else:
        # The backend is the one the server announces (its --weight-transfer-config, GET /server_info):
        # `weightsync` (the plugin: gloo from a CPU agent, NCCL from a GPU one), `nccl` (rank 0 on a GPU of
        # the agent's own) or `ipc` (colocated: CUDA IPC handles keyed by GPU UUID).
        options.update(backend="auto", device=device)
        if device.startswith("cuda"):
            options["devices"] = engine_devices(device, tp_size)
        if fault:
            from weightsync.agent.engines.vllm import EngineFault

            options["fault"] = EngineFault.parse(fault)
    if lora is not None:
        return _lora_adapter(t, url, lora, tp_size, timeout)
    if not url:
        # a configuration error (the agent exits 2 with this line), not an engine failure
        raise ConfigError(f"{t} engine needs its URL ({contract.ENV_ENGINE_URL}, e.g. http://127.0.0.1:30000)")
    if t == "SGLang":
        from weightsync.agent.engines.sglang import SGLangAdapter

        return SGLangAdapter(url, **options)
    from weightsync.agent.engines.vllm import VLLMAdapter

    return VLLMAdapter(url, **options)


def _lora_adapter(engine_type: str, url: str | None, spec: LoraSpec, tp_size: int,
                  timeout: float | None) -> EngineAdapter:
    """A LoRA job: the engine's adapter-loading endpoint, not its weight-update session (which the agent
    then never opens: no update group, no GPU of the agent's own for vLLM)."""
    from weightsync.agent.engines import lora
    from weightsync.agent.engines.http import HttpClient

    if not url:
        raise ConfigError(f"{engine_type} engine needs its URL ({contract.ENV_ENGINE_URL})")
    client = HttpClient(url, engine_type) if timeout is None else HttpClient(url, engine_type, timeout=float(timeout))
    loader: lora.LoraLoader
    if engine_type == "SGLang":
        from weightsync.agent.engines.sglang import SGLangAdapter

        inner: EngineAdapter = SGLangAdapter(url, tp_size=tp_size, client=client)
        loader = lora.SGLangLoraLoader(client, tp_size)
    else:
        from weightsync.agent.engines.vllm import VLLMAdapter
        from weightsync.agent.staging.segments import shm_dir

        inner = VLLMAdapter(url, client=client, lora=True)
        loader = lora.VLLMLoraLoader(client, shm_dir() / "lora")
    return lora.LoraAdapter(inner=inner, loader=loader, spec=spec)


def engine_devices(device: str, tp_size: int) -> list[str]:
    """The CUDA device of each engine TP rank as the agent sees it (a pinned cuda:N: all on N)."""
    return [device] * tp_size if ":" in device else [f"cuda:{r}" for r in range(tp_size)]


def engine_takes_full_tensors(engine_type: str) -> bool:
    """SGLang and vLLM load full (unsharded) HF tensors over HTTP and shard them inside the engine, so the
    agent fetches one full copy per replica instead of per-rank TP slices."""
    return engine_type in ("SGLang", "VLLM")


def staged_versions_to_keep(engine_type: str) -> int:
    """Complete versions a trainer agent keeps staged. SGLang and vLLM load in place and cannot roll back,
    so the version before the newest stays staged: the last good version is reloaded after a load failed
    half-way. A Custom engine applies a version only at commit, so one is enough (and costs one model copy
    of staging less)."""
    return 2 if engine_type in ("SGLang", "VLLM") else 1
