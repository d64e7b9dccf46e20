"""LoRA sync: each version is a LoRA adapter (a few MB of `lora_A` / `lora_B` tensors), loaded through the
engine's adapter-loading endpoint instead of its weight-update session.

Why a wrapper, not a third path in each adapter: every bucket of the version is received and verified as
for base weights (same plan, transports, checksums), but an engine takes an adapter whole, in one request,
under a name. So `LoraAdapter` holds the version's tensors (copied: the receive slots are reused) and hands
them over at commit; nothing reaches the engine before every bucket arrived, so an abort leaves the
engine's adapter as it was.

Versioned like base weights: the adapter keeps its name across versions (clients keep asking for
`spec.inference.engine.lora.adapterName`), the engine's weight version label becomes N once the new
adapter is in. Neither engine replaces a loaded adapter of the same name in one call under SGLang
0.5.23 (it refuses a second load of a name): the agent unloads, then loads; with `pauseGeneration` (the
default) no request runs in between. vLLM 0.33 replaces in place (`load_inplace`).

* SGLang 0.5.23: POST /unload_lora_adapter, POST /load_lora_adapter_from_tensors (the tensors pickled by
  value, one copy per TP rank, which SGLang's SafeUnpickler rebuilds in the engine's own container;
  `expected_checksums`: SGLang checks each tensor's sha256 itself before loading), /update_weight_version.
* vLLM 0.33: the agent writes `adapter_config.json` and `adapter_model.bin` under the pod's shared staging
  volume (mounted in the engine container at the same path), POST /v1/load_lora_adapter with
  `load_inplace: true`, /update_weight_version; the previous version's directory is removed after.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import pickle
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from weightsync.agent.config import LoraSpec
from weightsync.agent.engines import sglang, vllm
from weightsync.agent.engines.base import EngineAdapter, EngineError, NamedTensors, version_label
from weightsync.agent.engines.http import EngineHTTPError, HttpClient
from weightsync.agent.layout.shards import tensor_checksum

log = logging.getLogger(__name__)


class LoraLoader(Protocol):
    """The engine side of a LoRA load (SGLang or vLLM)."""

    client: HttpClient

    def load_lora(self, spec: LoraSpec, tensors: dict[str, torch.Tensor], version: int, label: str) -> None:
        """Replace the adapter `spec.adapter_name` by `tensors` (version `version`) and label the engine's
        weights `label` (base.version_label)."""


def pickle_by_value(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The tensors pickled with their bytes inline (`torch.storage._load_from_bytes`, which SGLang's
    SafeUnpickler allows), not as shared-memory handles a ForkingPickler would write: those name an fd or a
    /dev/shm file that does not exist in the engine's container."""
    plain = {n: t.detach().to("cpu").contiguous().clone() for n, t in tensors.items()}
    return pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL)


def sglang_load_body(spec: LoraSpec, tensors: Mapping[str, torch.Tensor], tp_size: int) -> dict[str, Any]:
    """LoadLoRAAdapterFromTensorsReqInput: one serialized copy per TP rank (each rank reads its own)."""
    payload = base64.b64encode(pickle_by_value(tensors)).decode("ascii")
    return {
        "lora_name": spec.adapter_name,
        "config_dict": dict(spec.config),
        "serialized_named_tensors": [payload] * tp_size,
        "pinned": spec.pinned,
        "load_format": None,
        "expected_checksums": {n: tensor_checksum(t) for n, t in tensors.items()},
    }


def vllm_load_body(spec: LoraSpec, path: Path) -> dict[str, Any]:
    """vLLM's LoadLoRAAdapterRequest: the adapter directory, replacing a loaded one of the same name."""
    return {"lora_name": spec.adapter_name, "lora_path": str(path), "load_inplace": True}


class SGLangLoraLoader:
    def __init__(self, client: HttpClient, tp_size: int = 1) -> None:
        self.client = client
        self.tp_size = tp_size

    def load_lora(self, spec: LoraSpec, tensors: dict[str, torch.Tensor], version: int, label: str) -> None:
        try:
            self.client.post("/unload_lora_adapter", {"lora_name": spec.adapter_name}, retry=False)
        except EngineHTTPError as exc:
            if exc.status != 400:  # 400: not loaded (the first version, or a restarted engine)
                raise
            log.info("lora.unload adapter=%s not loaded: %s", spec.adapter_name, exc.detail)
        self.client.post("/load_lora_adapter_from_tensors", sglang_load_body(spec, tensors, self.tp_size),
                         retry=False)
        self.client.post("/update_weight_version", sglang.weight_version_body(label), retry=False)


class VLLMLoraLoader:
    def __init__(self, client: HttpClient, root: Path) -> None:
        self.client = client
        self.root = root

    def write(self, spec: LoraSpec, tensors: Mapping[str, torch.Tensor], version: int) -> Path:
        """`<root>/<adapter>/v<N>/`: adapter_config.json + adapter_model.bin (torch.save of a name -> tensor
        dict, which vLLM reads with torch.load(weights_only=True))."""
        path = self.root / spec.adapter_name / f"v{version}"
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "adapter_config.json").write_text(json.dumps(dict(spec.config)))
        buf = io.BytesIO()
        torch.save({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}, buf)
        (tmp / "adapter_model.bin").write_bytes(buf.getvalue())
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)  # the engine never reads a half-written adapter
        return path

    def load_lora(self, spec: LoraSpec, tensors: dict[str, torch.Tensor], version: int, label: str) -> None:
        path = self.write(spec, tensors, version)
        self.client.post("/v1/load_lora_adapter", vllm_load_body(spec, path), retry=False)
        self.client.post("/update_weight_version", vllm.weight_version_body(label), retry=False)
        for old in (self.root / spec.adapter_name).iterdir():
            if old != path:
                shutil.rmtree(old, ignore_errors=True)


@dataclass
class LoraAdapter:
    """EngineAdapter for a LoRA job: buckets are held, the adapter is loaded whole at commit."""

    inner: EngineAdapter
    loader: LoraLoader
    spec: LoraSpec
    held: dict[str, torch.Tensor] = field(default_factory=dict)
    held_bytes: int = 0
    partial: int | None = None
    needs_restore: bool = False
    label_digest: str | None = None  # see SGLangAdapter.label_digest

    def pause(self) -> None:
        self.inner.pause()

    def resume(self) -> None:
        self.inner.resume()

    def begin_update(self, version: int) -> None:
        self.held, self.held_bytes = {}, 0

    def load_bucket(self, tensors: NamedTensors) -> None:
        for name, t in tensors:
            if name in self.held:
                raise EngineError(f"LoRA adapter {self.spec.adapter_name}: tensor {name} arrived twice")
            self.held[name] = t.detach().clone()  # the bucket's memory is reused for the next one
            self.held_bytes += t.numel() * t.element_size()

    def commit(self, version: int) -> None:
        if not self.held:
            raise EngineError(f"LoRA adapter {self.spec.adapter_name}: version {version} has no tensors")
        held, self.held, self.held_bytes = self.held, {}, 0
        log.info("lora.load adapter=%s version=%s tensors=%s", self.spec.adapter_name, version, len(held))
        try:
            label, self.label_digest = version_label(version, self.label_digest), None
            self.loader.load_lora(self.spec, held, version, label)
        except EngineError:
            # After the unload the engine may serve no adapter of that name: reload the last good version.
            self.partial = version
            self.needs_restore = True
            raise
        self.partial = None
        self.needs_restore = False

    def abort(self, version: int, reason: str) -> None:
        # Nothing reached the engine before commit: its adapter is the one it had.
        log.warning("lora.abort adapter=%s version=%s reason=%s", self.spec.adapter_name, version, reason)
        self.held, self.held_bytes = {}, 0

    def served_version(self) -> int | None:
        return None if self.partial is not None else self.inner.served_version()

    def __getattr__(self, name: str) -> Any:
        # check_engine_version, engine_version, close, ... of the engine's own adapter
        return getattr(self.inner, name)
