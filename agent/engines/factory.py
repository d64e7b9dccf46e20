"""Pick the engine adapter for `spec.inference.engine.type` (SGLang | VLLM | Custom).

Imports are lazy so that an agent image without an engine's optional bits still starts, and the Custom
adapter (agent/engines/custom.py) is only imported when a Custom engine is configured.
"""

from __future__ import annotations

from typing import Any

from weightsync.agent.engines.base import EngineAdapter, EngineError

ENGINE_TYPES = ("SGLang", "VLLM", "Custom")
_ALIASES = {"sglang": "SGLang", "vllm": "VLLM", "custom": "Custom"}


def normalize_engine_type(engine_type: str) -> str:
    """The CRD spelling of an engine type; case-insensitive, raises EngineError for unknown ones."""
    t = _ALIASES.get(engine_type.strip().lower())
    if t is None:
        raise EngineError(f"unknown engine type {engine_type!r}; expected one of {', '.join(ENGINE_TYPES)}")
    return t


def make_adapter(engine_type: str, *, url: str | None = None, **options: Any) -> EngineAdapter:
    """Build the adapter. SGLang and VLLM need the engine's base URL (http://host:port); Custom takes
    the keyword arguments of CustomEngineAdapter (registry, ranks, prefix, ...)."""
    t = normalize_engine_type(engine_type)
    if t == "Custom":
        from weightsync.agent.engines.custom import CustomEngineAdapter

        return CustomEngineAdapter(**options)
    if not url:
        raise EngineError(f"{t} engine needs its URL (WEIGHTSYNC_ENGINE_URL, e.g. http://127.0.0.1:30000)")
    if t == "SGLang":
        from weightsync.agent.engines.sglang import SGLangAdapter

        return SGLangAdapter(url, **options)
    from weightsync.agent.engines.vllm import VLLMAdapter

    return VLLMAdapter(url, **options)
