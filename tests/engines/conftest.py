from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from recording_server import RecordingServer

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def server() -> Iterator[RecordingServer]:
    s = RecordingServer()
    yield s
    s.close()


def load_fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())
