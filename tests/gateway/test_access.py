"""Episode keys (`tidal.gateway.access.SessionKeys`) over real HTTP: the stock openai and
anthropic clients, a live gateway, a real SQLite ledger. A key reaches its episode's
root session and the subagent sessions opened under it; everything else is 403 with a
reason, and nothing is recorded."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.gateway.scripted_engine import ScriptedEngine
from tidal.agent.endpoint import SpawnLink, call_id_of, session_base_url
from tidal.gateway.access import SessionKeys
from tidal.gateway.server import GatewayServer
from tidal.ledger.store import LedgerStore

MSG: list[Any] = [{"role": "user", "content": "hi"}]


@pytest.fixture
def keys() -> SessionKeys:
    return SessionKeys()


@pytest.fixture
def keyed(engine: ScriptedEngine, tokenizer: Any, store: LedgerStore,
          keys: SessionKeys) -> Iterator[GatewayServer]:
    srv = GatewayServer(engine, tokenizer, store, port=0, access=keys)
    srv.start()
    yield srv
    srv.stop()


def client(srv: GatewayServer, key: str, session: str,
           spawn: SpawnLink | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=session_base_url(srv.base_url, session, spawn), api_key=key,
                         max_retries=0, timeout=60)


def post(srv: GatewayServer, key: str, session: str, spawn: SpawnLink | None = None) -> str:
    r = client(srv, key, session, spawn).chat.completions.create(model="scripted", messages=MSG)
    return call_id_of(r)


def refused(srv: GatewayServer, key: str, session: str,
            spawn: SpawnLink | None = None) -> str:
    with pytest.raises(openai.PermissionDeniedError) as e:
        post(srv, key, session, spawn)
    assert e.value.status_code == 403
    body = e.value.body
    assert isinstance(body, dict)
    return str(body["message"])


def test_an_episode_key_reaches_its_session_and_its_subagents(
        keyed: GatewayServer, keys: SessionKeys, store: LedgerStore) -> None:
    key = keys.open("ep-a")
    first = post(keyed, key, "ep-a")
    post(keyed, key, "ep-a-sub1", SpawnLink("ep-a", first))
    sub_call = post(keyed, key, "ep-a-sub1", SpawnLink("ep-a", first))
    post(keyed, key, "ep-a-sub1-sub1", SpawnLink("ep-a-sub1", sub_call))  # a subagent's own
    assert set(store.session_ids()) == {"ep-a", "ep-a-sub1", "ep-a-sub1-sub1"}


def test_forged_sessions_are_refused_and_nothing_is_recorded(
        keyed: GatewayServer, keys: SessionKeys, store: LedgerStore) -> None:
    mine, theirs = keys.open("ep-a"), keys.open("ep-b")
    call_b = post(keyed, theirs, "ep-b")
    n = store.count_calls()
    # another episode's session, by its id
    assert "belongs to another API key" in refused(keyed, mine, "ep-b")
    # a new session of one's own choosing, outside the episode's tree
    assert "not this API key's" in refused(keyed, mine, "ep-forged")
    # a subagent hung under another episode's session
    assert "does not own" in refused(keyed, mine, "ep-x-sub", SpawnLink("ep-b", call_b))
    # a made-up key, the placeholder harnesses send where no key is required, no key
    for bad in ("tidal-ep-guess", "tidal"):
        assert "unknown API key" in refused(keyed, bad, "ep-a")
    r = httpx.post(session_base_url(keyed.base_url, "ep-a") + "/chat/completions",
                   json={"model": "scripted", "messages": MSG})
    assert r.status_code == 403 and "requires an API key" in r.text
    # a session the gateway would pick by content (no id): never under an episode key
    auto = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key=mine, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError, match="name the session"):
        auto.chat.completions.create(model="scripted", messages=MSG)
    assert store.count_calls() == n
    assert store.session_ids() == ["ep-b"]


def test_a_closed_episode_key_is_refused(keyed: GatewayServer, keys: SessionKeys,
                                         store: LedgerStore) -> None:
    key = keys.open("ep-a")
    post(keyed, key, "ep-a")
    keys.close(key)
    assert "has ended" in refused(keyed, key, "ep-a")
    assert store.count_calls() == 1


def test_a_resumed_episode_reaches_its_recorded_subagents(
        engine: ScriptedEngine, tokenizer: Any, store: LedgerStore) -> None:
    """A preempted episode continues under a new key on a new gateway: its root is opened
    again, and its subagent sessions (in the ledger, not in memory) are its own by their
    recorded parent; another episode's recorded session still is not."""
    before = SessionKeys()
    with GatewayServer(engine, tokenizer, store, port=0, access=before) as srv:
        k = before.open("ep-a")
        first = post(srv, k, "ep-a")
        post(srv, k, "ep-a-sub1", SpawnLink("ep-a", first))
        post(srv, before.open("ep-b"), "ep-b")
    after = SessionKeys()
    with GatewayServer(engine, tokenizer, store, port=0, access=after) as srv:
        k = after.open("ep-a")
        post(srv, k, "ep-a-sub1", SpawnLink("ep-a", first))
        assert "not this API key's" in refused(srv, k, "ep-b")


def test_the_anthropic_client_sends_the_key_as_x_api_key(
        keyed: GatewayServer, keys: SessionKeys, store: LedgerStore) -> None:
    key = keys.open("ep-a")
    base = session_base_url(keyed.base_url, "ep-a").removesuffix("/v1")
    ok = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)
    ok.messages.create(model="scripted", max_tokens=16, messages=MSG)
    other = anthropic.Anthropic(base_url=base, api_key=keys.open("ep-b"), max_retries=0)
    with pytest.raises(anthropic.PermissionDeniedError):
        other.messages.create(model="scripted", max_tokens=16, messages=MSG)
    assert store.count_calls() == 1


def test_a_standing_key_reaches_every_session(
        keyed: GatewayServer, keys: SessionKeys, store: LedgerStore) -> None:
    keys.add("operator")
    post(keyed, "operator", "mine")
    post(keyed, "operator", "mine-too")
    assert "unknown API key" in refused(keyed, "not-the-operator", "mine")
    assert store.count_calls() == 2


def test_an_open_gateway_takes_any_key(server: GatewayServer, store: LedgerStore) -> None:
    """`tidal serve` without keys: a user's harness sends whatever key it likes."""
    for key in ("unused", "tidal", "sk-anything"):
        post(server, key, "s-open")
    assert store.count_calls() == 3
