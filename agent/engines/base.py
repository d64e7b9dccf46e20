"""The engine adapter interface: how an inference agent hands weights to an engine.

One adapter per engine type (SGLang and vLLM over HTTP, Custom over the local client socket). The agent
drives every adapter through `load_version`, which owns the ordering rules users rely on: pause before
the first byte, commit only after the last bucket, resume always (also when the load fails).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

log = logging.getLogger(__name__)

NamedTensors = Sequence[tuple[str, torch.Tensor]]

_LABEL = re.compile(r"^(\d+)(?:-[0-9a-f]{1,32})?$")
LABEL_DIGEST_CHARS = 16


def version_label(version: int, digest: str | None = None) -> str:
    """The engine's weight version label: `<N>-<digest prefix>` once the content digest is known (requests
    can then be attributed to exact weights), plain `<N>` otherwise."""
    return f"{version}-{digest[:LABEL_DIGEST_CHARS]}" if digest else str(version)


def parse_version(value: object) -> int | None:
    """The version N of an engine's label `N` or `N-<digest prefix>`; None for anything else (`partial-N`,
    an engine's own initial label)."""
    m = _LABEL.match(str(value)) if value is not None else None
    return int(m.group(1)) if m else None


#: Tensors a trainer publishes under this prefix are the engine's draft (speculative / MTP) model's weights,
#: named as the draft model names them after the prefix (vLLM's own `weight_info` lists its draft model's
#: parameters as `draft.<name>`). Each adapter loads them into the draft model: SGLang with `selector:
#: draft`, vLLM in a `/start_draft_weight_update` session.
DRAFT_PREFIX = "draft."


def split_draft(tensors: NamedTensors) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """(target tensors, draft tensors with DRAFT_PREFIX removed), each in the bucket's order."""
    target: list[tuple[str, torch.Tensor]] = []
    draft: list[tuple[str, torch.Tensor]] = []
    for name, t in tensors:
        if name.startswith(DRAFT_PREFIX):
            short = name[len(DRAFT_PREFIX):]
            if not short:
                raise EngineError(f"tensor {name!r}: a draft tensor needs a name after {DRAFT_PREFIX!r}")
            draft.append((short, t))
        else:
            target.append((name, t))
    return target, draft


class EngineError(RuntimeError):
    """The engine refused or failed an operation; the message says which and why."""


class EngineUnsupported(EngineError):
    """The engine is a release (or a configuration) this adapter does not speak: retrying cannot help (the
    agent reports it once, as the pod condition reason `reason`, and attempts no load)."""

    def __init__(self, message: str, reason: str = "EngineVersionUnsupported") -> None:
        super().__init__(message)
        self.reason = reason


@runtime_checkable
class EngineAdapter(Protocol):
    """What the inference agent needs from an engine. Methods raise EngineError on failure."""

    def pause(self) -> None:
        """Stop admitting new generation work (in-flight requests may finish or be aborted)."""

    def resume(self) -> None:
        """Admit generation again. Must be safe to call when not paused."""

    def begin_update(self, version: int) -> None:
        """Prepare to receive the tensors of `version`."""

    def load_bucket(self, tensors: NamedTensors) -> None:
        """Load one bucket of (name, tensor) pairs into the engine's weights."""

    def commit(self, version: int) -> None:
        """Make `version` the served version; called only after every bucket loaded and verified."""

    def abort(self, version: int, reason: str) -> None:
        """Forget a partial load of `version`; the engine keeps serving its previous version."""

    def served_version(self) -> int | None:
        """The version the engine reports it serves, or None if unknown."""


class RankRouter:
    """Tells a multi-rank adapter (e.g. the Custom one) which destination rank the next bucket is for, and an
    HTTP engine's adapter the version's content digest at commit (its label, `<N>-<digest prefix>`): the
    digest is complete by then, load_version commits only after the last bucket."""

    def __init__(self, inner: EngineAdapter, digest: Callable[[], str | None] | None = None) -> None:
        self.inner = inner
        self.digest = digest

    def commit(self, version: int) -> None:
        label = self.digest() if self.digest is not None else None
        if label and hasattr(self.inner, "label_digest"):
            self.inner.label_digest = label
        self.inner.commit(version)

    def load_bucket(self, tensors: NamedTensors) -> None:
        rank = getattr(tensors, "rank", None)
        if rank is not None and hasattr(self.inner, "rank"):
            self.inner.rank = rank
        self.inner.load_bucket(tensors)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def load_version(
    adapter: EngineAdapter,
    version: int,
    buckets: Iterable[NamedTensors],
    *,
    pause_generation: bool,
) -> int:
    """Load `version` bucket by bucket; returns the number of tensors loaded.

    Pause happens before the first bucket and resume after the last one, also when anything fails
    (review of seed 001): a failed load is aborted and re-raised, never committed.
    """
    paused = False
    loaded = 0
    try:
        if pause_generation:
            adapter.pause()
            paused = True
        adapter.begin_update(version)
        try:
            for bucket in buckets:
                adapter.load_bucket(bucket)
                loaded += len(bucket)
        except BaseException as exc:
            try:
                adapter.abort(version, f"{type(exc).__name__}: {exc}")
            except Exception:  # the original failure is the one to report
                log.exception("engine abort failed", extra={"version": version})
            raise
        adapter.commit(version)
        return loaded
    finally:
        if paused:
            adapter.resume()
