from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.scripted_server import ScriptedServer
from tidal.agent.runtime import LocalDirRuntime


@pytest.fixture(scope="session")
def scripted() -> Iterator[tuple[ScriptedServer, str]]:
    server = ScriptedServer()
    url = server.start()
    yield server, url
    server.stop()


@pytest.fixture
def runtime(tmp_path: Path) -> LocalDirRuntime:
    root = tmp_path / "work"
    root.mkdir()
    return LocalDirRuntime(root)
