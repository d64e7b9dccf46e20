"""Top-level test configuration: the Kubernetes fixtures (`cluster`, `process_runtime`, `kube`,
`namespace`) from weightsync.e2e.pytest_plugin. A test that uses them is marked `cluster` automatically;
the control plane starts once per session, only if such a test is selected."""

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ["weightsync.e2e.pytest_plugin"]


@pytest.fixture
def memory_staging_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A staging directory on tmpfs, as the pod's memory-backed staging volume is: the kernel pins (for DMA)
    memory-backed files only, and pytest's tmp_path may be on a disk."""
    from weightsync.agent.staging import segments

    path = Path(tempfile.mkdtemp(prefix="ws-test-", dir="/dev/shm"))
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)
