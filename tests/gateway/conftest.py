"""Fixtures: the real Qwen2.5 tokenizer (tiny checkpoint), a scripted engine, a live
gateway on 127.0.0.1 with a real SQLite ledger, and the stock `openai` client."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.gateway.scripted_engine import ScriptedEngine
from tidal.engine.tiny import ensure_tiny, load_tokenizer
from tidal.gateway.server import GatewayServer
from tidal.ledger.store import LedgerStore


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return ensure_tiny()


@pytest.fixture(scope="session")
def tokenizer(tiny_dir: Path) -> Any:
    return load_tokenizer(tiny_dir)


@pytest.fixture
def engine(tokenizer: Any) -> ScriptedEngine:
    return ScriptedEngine(tokenizer)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LedgerStore]:
    s = LedgerStore(tmp_path / "ledger.db")
    yield s
    s.close()


@pytest.fixture
def server(engine: ScriptedEngine, tokenizer: Any, store: LedgerStore) -> Iterator[GatewayServer]:
    srv = GatewayServer(engine, tokenizer, store, port=0)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def client_for(server: GatewayServer) -> Callable[..., openai.OpenAI]:
    def make(session_id: str | None = None, **kw: Any) -> openai.OpenAI:
        url = server.session_url(session_id, **kw) if session_id else f"{server.base_url}/v1"
        return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)

    return make
