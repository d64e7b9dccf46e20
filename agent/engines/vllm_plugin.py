"""weightsync as a vLLM weight-transfer backend (`--weight-transfer-config '{"backend": "weightsync"}'`).

vLLM loads `register` in every one of its processes from the `vllm.general_plugins` entry point this package
declares (pyproject.toml), so the backend exists wherever a worker creates its weight-transfer engine. The
engine's session is vLLM's own: start_weight_update initializes vLLM's layer-wise reload, every bucket goes
through the model's `load_weights` with HF names, finish_weight_update finalizes the reload. What the backend
adds is the wire and the checks (agent/engines/vllm_wire.py): the bytes come from the pod's weightsync agent
over a gloo (CPU) or NCCL (GPU) group, every tensor's digest leaf is checked inside the worker before it is
loaded, and no failure is ever raised into vLLM during a session (vLLM would leave the layers on the meta
device and the next generation would kill the engine): it is reported to the agent in-band, and the agent
never finishes such a session with a version.

This module imports vLLM; only vLLM's processes import it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from weightsync.agent.engines.vllm_wire import (
    BACKEND_NAME,
    WeightsyncInitInfo,
    WeightsyncUpdateInfo,
    WorkerReceiver,
    make_group,
)

# a child of vLLM's own logger: its handler prints it with the engine's log lines
log = logging.getLogger("vllm.plugins.weightsync")


def register() -> None:
    """The `vllm.general_plugins` entry point: register the backend (lazily; once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, __name__, "WeightsyncWeightTransferEngine")


def _engine_base() -> type:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return WeightTransferEngine


class WeightsyncWeightTransferEngine(_engine_base()):  # type: ignore[misc]
    """The worker side: one group with the pod's agent, vLLM's layer-wise reload around each session."""

    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver: WorkerReceiver | None = None
        self._store: Any = None
        self._reloading = False
        self._abandoned = False
        self.rank = 0

    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        from weightsync.agent.transports.rendezvous import LinkStore

        self.shutdown()  # a new agent (restarted, or after a broken group) forms the group afresh
        pc = self.parallel_config
        local = getattr(pc, "data_parallel_index", getattr(pc, "data_parallel_rank", 0)) * pc.world_size + pc.rank
        self.rank = init_info.rank_offset + local
        backend = init_info.backend
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"weightsync backend: an NCCL group needs a CUDA worker, this one runs on {self.device}")
        self._store = LinkStore(init_info.store_host, init_info.store_port, init_info.store_secret,
                                timeout=init_info.timeout_s)
        pg = make_group(self._store, init_info.group, self.rank, init_info.world_size, backend,
                        init_info.worker_host, init_info.timeout_s)
        self.receiver = WorkerReceiver(pg, self.device if backend == "nccl" else torch.device("cpu"))
        log.info("weightsync group ready: rank %s of %s (%s) group %s", self.rank, init_info.world_size, backend,
                 init_info.group)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self.receiver is not None:
            self.receiver.start_session()
        self._abandoned = False
        initialize_layerwise_reload(self.model)
        self._reloading = True

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        receiver = self.receiver
        if update_info.abandon:
            if receiver is not None:
                receiver.drop_held()
                if receiver.failure is not None:
                    log.warning("weightsync: the agent gave up this update after: %s", receiver.failure)
                    receiver.failure = None
            self._abandoned = True
            return
        if receiver is None:
            raise RuntimeError("weightsync backend: no group (POST /init_weight_transfer_engine first)")
        try:
            status = receiver.receive(update_info, self._load)
        except Exception as exc:  # the group broke (the agent died): recorded, never raised
            receiver.failure = receiver.failure or f"bucket {update_info.bucket}: transfer failed: {exc}"
            log.error("weightsync: %s", receiver.failure)
            return
        if status != 0:
            log.error("weightsync: bucket %s refused (status %s): %s", update_info.bucket, status,
                      receiver.failure or "on another rank")

    def _load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            self.model.load_weights(tensors)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's default synchronizes the accelerator after receive_weights; a CPU worker has none to sync."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def finish_weight_update(self) -> None:
        """Finalize vLLM's reload (the engine is never left with layers on meta). After a failed session the
        weights may mix two versions: raise after finalizing, so vLLM sets no version even if asked to."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self._reloading:
            self._reloading = False
            finalize_layerwise_reload(self.model, self.model_config)
        if self._abandoned:
            log.info("weightsync: an abandoned update closed (its weights may mix two versions; the agent reloads)")
        failure = self.receiver.failure if self.receiver is not None else None
        if failure is not None and self.receiver is not None:
            self.receiver.failure = None
            raise RuntimeError(f"weightsync: this weight update failed and is not a version: {failure}")

    def shutdown(self) -> None:
        receiver, self.receiver = self.receiver, None
        abort = getattr(receiver.pg, "abort", None) if receiver is not None else None
        if abort is not None:
            try:
                abort()
            except Exception as exc:  # already broken
                log.info("weightsync: group abort: %s", exc)
        store, self._store = self._store, None
        if store is not None:
            store.close()
