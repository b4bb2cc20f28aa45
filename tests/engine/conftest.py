"""Shared fixtures: the tiny checkpoint (built once, cached under ~/.cache/tidal)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.engine.tiny import ensure_tiny


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return ensure_tiny()
