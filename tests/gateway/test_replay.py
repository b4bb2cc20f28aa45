"""Replay mode: a resumed session's calls are answered from the ledger, not sampled.

A gateway restarted on the store (nothing in memory) with the session in replay mode
answers the same requests with the recorded calls (ids, text, tool calls and their ids,
logprobs), records nothing and never calls the engine; the first request that matches no
recorded prompt is generated and recorded; what was never asked for again is reported.
Real HTTP, the official openai and anthropic clients, real SQLite."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.gateway.scripted_engine import ScriptedEngine
from tidal.agent.endpoint import session_base_url
from tidal.engine.tiny import ensure_tiny, load_tokenizer
from tidal.gateway.server import GatewayServer
from tidal.gateway.verify import verify_store
from tidal.ledger import LedgerStore

COMMAND = {"type": "object", "properties": {"command": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": COMMAND}}]


def reply(prompt: str) -> str:
    """A deterministic policy: a tool call whose argument counts the tool results so far."""
    k = prompt.count("<tool_response>")
    call = {"name": "bash", "arguments": {"command": f"echo {k}"}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


@pytest.fixture
def tokenizer() -> Any:
    return load_tokenizer(ensure_tiny())


def _serve(tokenizer: Any, store: LedgerStore) -> tuple[GatewayServer, ScriptedEngine]:
    engine = ScriptedEngine(tokenizer, policy=reply)
    srv = GatewayServer(engine, tokenizer, store, port=0)
    srv.start()
    return srv, engine


def _turns(client: openai.OpenAI, n: int, results: list[str]) -> Iterator[Any]:
    """n chat turns, the i-th tool result being results[i]."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "count"}]
    for i in range(n):
        r = client.chat.completions.create(model="scripted", messages=messages,  # type: ignore[arg-type]
                                           tools=TOOLS, logprobs=True)  # type: ignore[arg-type]
        yield r
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id,  # type: ignore[index]
                         "content": results[i]})


def test_a_replayed_session_gets_its_recorded_calls_and_records_nothing(
    tmp_path: Path, tokenizer: Any
) -> None:
    store = LedgerStore(tmp_path / "ledger.db")
    srv, engine = _serve(tokenizer, store)
    url = session_base_url(srv.base_url, "s-1")
    first = list(_turns(openai.OpenAI(base_url=url, api_key="x", max_retries=0), 3,
                        ["0", "1", "2"]))
    srv.stop()
    assert len(store.call_log("s-1")) == 3

    srv, engine = _serve(tokenizer, store)  # restarted: nothing in memory
    try:
        assert srv.gateway.replay(["s-1", "never-recorded"]) == 3
        url = session_base_url(srv.base_url, "s-1")  # a new port
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        # the same two turns, then a tool result that differs from the recorded one
        again = list(_turns(client, 3, ["0", "CHANGED", "2"]))
        for a, b in zip(first[:2], again[:2], strict=True):
            assert a.id == b.id
            assert a.choices[0].message.tool_calls == b.choices[0].message.tool_calls
            assert [t.logprob for t in a.choices[0].logprobs.content] == [  # type: ignore[union-attr]
                t.logprob for t in b.choices[0].logprobs.content]  # type: ignore[union-attr]
            assert b.model_extra["tidal"]["replayed"] is True  # type: ignore[index]
        assert again[1].choices[0].finish_reason == "tool_calls"
        # the prompt after a changed tool result is new: generated and recorded
        assert again[2].id != first[2].id and "replayed" not in again[2].model_extra["tidal"]  # type: ignore[index]
        assert len(engine.prompts) == 1
        assert len(store.call_log("s-1")) == 4
        status = srv.gateway.replay_status("s-1")
        assert status is not None and status.served == 2
        assert status.left == (first[2].id.removeprefix("chatcmpl-"),)
        assert srv.gateway.replay_status("other") is None
    finally:
        srv.stop()
    assert verify_store(store).ok
    store.close()


def test_the_messages_api_replays_the_same_way(tmp_path: Path, tokenizer: Any) -> None:
    store = LedgerStore(tmp_path / "ledger.db")
    srv, _ = _serve(tokenizer, store)
    tools = [{"name": "bash", "input_schema": {"type": "object"}}]

    def ask() -> Any:
        url = session_base_url(srv.base_url, "m-1").removesuffix("/v1")
        return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0).messages.create(
            model="scripted", max_tokens=64, tools=tools,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": "count"}])

    first = ask()
    srv.stop()
    srv, engine = _serve(tokenizer, store)
    try:
        srv.gateway.replay(["m-1"])
        again = ask()
        assert (again.id, again.content) == (first.id, first.content)
        assert engine.prompts == [] and len(store.call_log("m-1")) == 1
    finally:
        srv.stop()
        store.close()
