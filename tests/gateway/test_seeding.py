"""A seeded gateway seeds every request that brings no seed of its own from (run seed,
session seed key, call index), and derives the call's tool-call ids from that seed: two
sessions of one key sample and name alike, a restarted gateway continues a session's
count from the ledger, and a request's own seed is kept. Real HTTP, the official openai
client, real SQLite."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from tests.gateway.scripted_engine import ScriptedEngine
from tests.gateway.test_replay import TOOLS, _turns, reply
from tidal.agent.endpoint import session_base_url
from tidal.engine.tiny import ensure_tiny, load_tokenizer
from tidal.gateway.core import call_seed
from tidal.gateway.server import GatewayServer
from tidal.ledger import LedgerStore
from tidal.run.rollout import new_session_id, seed_key

SEED = 7


@pytest.fixture
def tokenizer() -> Any:
    return load_tokenizer(ensure_tiny())


def _serve(tokenizer: Any, store: LedgerStore) -> GatewayServer:
    srv = GatewayServer(ScriptedEngine(tokenizer, policy=reply), tokenizer, store, port=0,
                        seed=SEED, seed_key=seed_key)
    srv.start()
    return srv


def _client(srv: GatewayServer, session: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=session_base_url(srv.base_url, session), api_key="x",
                         max_retries=0)


def _calls(store: LedgerStore, session: str) -> list[tuple[int, list[str]]]:
    return [(sc.call.sampling["seed"], [t["id"] for t in sc.call.tool_calls or []])
            for sc in store.call_log(session).calls]


def test_sessions_of_one_seed_key_are_seeded_alike(tmp_path: Path, tokenizer: Any) -> None:
    a, b = (new_session_id("rl", 3, "digits-7", 1) for _ in range(2))
    other = new_session_id("rl", 3, "digits-7", 2)
    assert a != b and seed_key(a) == seed_key(b) == "rl-3-digits-7-1"
    assert seed_key(f"{a}-sub2") == "rl-3-digits-7-1-sub2"  # a subagent keeps its place
    store = LedgerStore(tmp_path / "ledger.db")
    srv = _serve(tokenizer, store)
    try:
        for sid in (a, b, other):
            list(_turns(_client(srv, sid), 3, ["0", "1", "2"]))
    finally:
        srv.stop()
    got = _calls(store, a)
    assert [s for s, _ in got] == [call_seed(SEED, "rl-3-digits-7-1", i) for i in range(3)]
    assert got == _calls(store, b)  # the same seeds, and the same tool-call ids
    assert all(len(ids) == 1 and ids[0].startswith("call_") for _, ids in got)
    theirs = _calls(store, other)
    assert {s for s, _ in theirs}.isdisjoint(s for s, _ in got)
    assert {i for _, ids in theirs for i in ids}.isdisjoint(i for _, ids in got for i in ids)


def test_a_restarted_gateway_continues_the_count_and_own_seeds_stay(
    tmp_path: Path, tokenizer: Any
) -> None:
    store = LedgerStore(tmp_path / "ledger.db")
    srv = _serve(tokenizer, store)
    try:
        list(_turns(_client(srv, "s-1"), 2, ["0", "1"]))
    finally:
        srv.stop()
    srv = _serve(tokenizer, store)  # nothing in memory: the count comes from the ledger
    try:
        client = _client(srv, "s-1")
        client.chat.completions.create(model="scripted", messages=[  # type: ignore[arg-type]
            {"role": "user", "content": "again"}], tools=TOOLS)  # type: ignore[arg-type]
        client.chat.completions.create(model="scripted", messages=[  # type: ignore[arg-type]
            {"role": "user", "content": "mine"}], seed=12345)
    finally:
        srv.stop()
    seeds = [s for s, _ in _calls(store, "s-1")]
    assert seeds == [call_seed(SEED, "s-1", i) for i in range(3)] + [12345]
