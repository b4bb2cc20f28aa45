"""The HTTP surface with the stock openai client: errors, sessions, subagents,
completions, models, logprobs, tool-call streaming."""

from __future__ import annotations

import gc
import json
import weakref
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.scripted_engine import ScriptedEngine
from tests.gateway.test_http_drift import TOOLS, USER, tag_call
from tidal.gateway.server import GatewayServer, freeze_startup_heap
from tidal.ledger.store import LedgerStore


def post(server: GatewayServer, path: str, body: bytes | dict[str, Any]) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        server.base_url + path,
        content=content,
        headers={"content-type": "application/json"},
        timeout=30,
    )


def assert_openai_error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and err["message"]
    return err


def test_malformed_json(server: GatewayServer, store: LedgerStore) -> None:
    r = post(server, "/sessions/s1/v1/chat/completions", b'{"model": "scripted", "messages": [')
    err = assert_openai_error(r, 400, "invalid_json")
    assert err["type"] == "invalid_request_error"
    assert store.count_calls() == 0


def test_invalid_session_id(server: GatewayServer, store: LedgerStore) -> None:
    body = {"model": "scripted", "messages": [USER]}
    r = post(server, "/sessions/bad%20id!/v1/chat/completions", body)
    err = assert_openai_error(r, 400, "invalid_session_id")
    assert err["param"] == "session_id"
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        json=body,
        headers={"X-Tidal-Session": "-leading-dash"},
    )
    assert_openai_error(r, 400, "invalid_session_id")
    assert store.count_calls() == 0


def test_prompt_over_context_limit(tokenizer: Any, store: LedgerStore) -> None:
    engine = ScriptedEngine(tokenizer, max_context=64)
    with GatewayServer(engine, tokenizer, store) as srv:
        client = openai.OpenAI(base_url=srv.session_url("s1"), api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as ei:
            client.chat.completions.create(
                model="scripted", messages=[{"role": "user", "content": "hi " * 80}]
            )
        assert ei.value.code == "context_length_exceeded"
        # Fits, but not with the requested completion budget.
        with pytest.raises(openai.BadRequestError) as ei:
            client.chat.completions.create(model="scripted", messages=[USER], max_tokens=60)
        assert ei.value.code == "context_length_exceeded"
    assert engine.prompts == [] and store.count_calls() == 0


@pytest.mark.parametrize(
    "tools",
    [
        [{"type": "function", "function": {"name": "has space"}}],
        [{"type": "retrieval"}],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"properties": [1]}}}],
        [
            {"type": "function", "function": {"name": "f"}},
            {"type": "function", "function": {"name": "f"}},
        ],
    ],
)
def test_invalid_tool_schema(client_for: Any, store: LedgerStore, tools: list[Any]) -> None:
    with pytest.raises(openai.BadRequestError) as ei:
        client_for("s1").chat.completions.create(model="scripted", messages=[USER], tools=tools)
    assert ei.value.code == "invalid_tool_schema"
    assert ei.value.param is not None and ei.value.param.startswith("tools[")
    assert store.count_calls() == 0


def test_unknown_model(client_for: Any, store: LedgerStore) -> None:
    with pytest.raises(openai.NotFoundError) as ei:
        client_for("s1").chat.completions.create(model="gpt-9", messages=[USER])
    assert ei.value.code == "model_not_found" and "gpt-9" in str(ei.value)
    assert store.count_calls() == 0


def test_bad_messages_and_params(client_for: Any, store: LedgerStore) -> None:
    c = client_for("s1")
    for kw in (
        {"messages": []},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": [USER], "n": 2},
        {"messages": [USER], "temperature": 5},
        {"messages": [USER], "stop": [1]},
    ):
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model="scripted", **kw)
    assert store.count_calls() == 0


def test_models_and_unknown_route(server: GatewayServer, client_for: Any) -> None:
    assert [m.id for m in client_for("s1").models.list()] == ["scripted"]
    assert [m.id for m in client_for(None).models.list()] == ["scripted"]
    r = httpx.get(server.base_url + "/v2/whatever")
    assert_openai_error(r, 404, "not_found")


def test_health_and_methods(server: GatewayServer) -> None:
    r = httpx.get(server.base_url + "/health")
    assert r.status_code == 200 and r.json() == {
        "ok": True, "model": "scripted", "policy_version": 0
    }
    assert httpx.head(server.base_url + "/v1/models").status_code == 405
    assert_openai_error(httpx.put(server.base_url + "/v1/models"), 405, "http_error")
    assert_openai_error(httpx.post(server.base_url + "/health"), 405, "http_error")
    r = httpx.get(server.base_url + "/sessions/s1/v1/chat/completions")
    assert_openai_error(r, 405, "method_not_allowed")
    assert_openai_error(httpx.get(server.base_url + "/healthz"), 404, "not_found")
    r = post(server, "/sessions/s1/v1/embeddings", {"model": "scripted"})
    assert_openai_error(r, 404, "not_found")


def test_logprobs_and_record(client_for: Any, engine: ScriptedEngine, store: LedgerStore) -> None:
    engine.push("Hi there")
    r = client_for("s1").chat.completions.create(model="scripted", messages=[USER], logprobs=True)
    assert r.choices[0].message.content == "Hi there"
    toks = r.choices[0].logprobs.content
    call = store.call_log("s1").full_call(r.tidal["call_id"])  # type: ignore[attr-defined]
    assert [t.logprob for t in toks] == call.output_logprobs.tolist()
    assert "".join(t.token for t in toks) == "Hi there<|im_end|>"
    assert r.usage.prompt_tokens == call.prompt_ids.shape[0]
    assert r.usage.completion_tokens == call.output_ids.shape[0]
    assert call.role == "main" and call.policy_version == 0


def test_task_and_role_headers(server: GatewayServer, store: LedgerStore) -> None:
    c = openai.OpenAI(
        base_url=f"{server.base_url}/sessions/s9/task/t-1/role/main_summary/v1",
        api_key="x",
        max_retries=0,
    )
    c.chat.completions.create(model="scripted", messages=[USER])
    (info,) = store.sessions()
    assert info.task_id == "t-1"
    (call,) = list(store.iter_full_calls())
    assert call.role == "main_summary"


def test_subagent_session(
    server: GatewayServer, client_for: Any, engine: ScriptedEngine, store: LedgerStore
) -> None:
    engine.push(tag_call("weather", '{"city": "Oslo"}'))
    r = client_for("main-1").chat.completions.create(model="scripted", messages=[USER], tools=TOOLS)
    parent = r.tidal["call_id"]  # type: ignore[attr-defined]
    # URL form: /sessions/{id}/parent/{call_id}/v1
    sub = client_for("sub-1", parent_call=parent)
    sub.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "sub"}])
    # Header form on plain /v1.
    hdr = openai.OpenAI(
        base_url=f"{server.base_url}/v1",
        api_key="x",
        max_retries=0,
        default_headers={"X-Tidal-Session": "sub-2", "X-Tidal-Parent-Call": parent},
    )
    hdr.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "sub"}])
    infos = {i.session_id: i for i in store.sessions()}
    for sid in ("sub-1", "sub-2"):
        assert infos[sid].parent_session_id == "main-1" and infos[sid].parent_call_id == parent
        (call,) = [store.call_log(sid).full_call(sc.call_id) for sc in store.call_log(sid).calls]
        assert call.role == "subagent"
    with pytest.raises(openai.BadRequestError) as ei:
        client_for("sub-3", parent_call="call-nope").chat.completions.create(
            model="scripted", messages=[USER]
        )
    assert ei.value.code == "invalid_parent_call_id"
    assert store.count_calls() == 3


def test_auto_session_follows_tool_call_ids(
    client_for: Any, engine: ScriptedEngine, store: LedgerStore
) -> None:
    c = client_for(None)
    engine.push(tag_call("weather", '{"city": "Oslo"}'))
    r1 = c.chat.completions.create(model="scripted", messages=[USER], tools=TOOLS)
    msg = r1.choices[0].message.model_dump(exclude_none=True, exclude={"refusal"})
    tid = msg["tool_calls"][0]["id"]
    r2 = c.chat.completions.create(
        model="scripted",
        tools=TOOLS,
        messages=[USER, msg, {"role": "tool", "tool_call_id": tid, "content": "sunny"}],
    )
    c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "new"}])
    s1, s2 = r1.tidal["session_id"], r2.tidal["session_id"]  # type: ignore[attr-defined]
    assert s1 == s2 and s1.startswith("auto-")
    assert len(store.session_ids()) == 2


def test_the_request_is_recorded_and_stored_as_what_is_new(
    client_for: Any, engine: ScriptedEngine, store: LedgerStore
) -> None:
    c = client_for("req")
    engine.push(tag_call("weather", '{"city": "Oslo"}'))
    system = {"role": "system", "content": "Be brief."}
    r1 = c.chat.completions.create(model="scripted", messages=[system, USER], tools=TOOLS)
    msg = r1.choices[0].message.model_dump(exclude_none=True, exclude={"refusal"})
    result = {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "sunny"}
    c.chat.completions.create(model="scripted", tools=TOOLS,
                              messages=[system, USER, msg, result])
    log = store.call_log("req")
    first, second = (log.full_call(sc.call_id) for sc in log.calls)
    assert first.messages == [system, USER] and first.tools == TOOLS
    assert second.messages is not None and second.messages[3] == result
    assert second.messages[2]["tool_calls"][0]["function"] == msg["tool_calls"][0]["function"]
    req = log.calls[1].request
    assert req is not None and req.base_call_id == first.call_id and req.keep == 2
    assert len(req.new) == 2 and req.tools_from_base  # only the turn and the tool result


def test_completions_endpoint(client_for: Any, engine: ScriptedEngine, store: LedgerStore) -> None:
    engine.push(" world")
    r = client_for("c1").completions.create(model="scripted", prompt="hello", logprobs=0)
    assert r.choices[0].text == " world<|im_end|>"
    assert r.choices[0].logprobs.token_logprobs == [0.0] * r.usage.completion_tokens
    (call,) = list(store.iter_full_calls())
    assert call.prompt_ids.tolist() == engine._tok.encode("hello")
    chunks = list(client_for("c1").completions.create(model="scripted", prompt=[9707], stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "ok<|im_end|>"


def test_streaming_tool_calls(client_for: Any, engine: ScriptedEngine, store: LedgerStore) -> None:
    engine.push(
        "Checking both.\n"
        + tag_call("weather", '{"city": "Paris"}')
        + tag_call("weather", '{"city": "Oslo"}')
    )
    stream = client_for("st").chat.completions.create(
        model="scripted",
        messages=[USER],
        tools=TOOLS,
        stream=True,
        stream_options={"include_usage": True},
    )
    content, calls, finish, usage = "", {}, None, None
    for ch in stream:
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                calls.setdefault(tc.index, [tc.id, "", ""])
                calls[tc.index][1] += tc.function.name or ""
                calls[tc.index][2] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    (call,) = list(store.iter_full_calls())
    assert content == "Checking both."
    assert [(i, n, a) for i, n, a in calls.values()] == [
        (t["id"], t["name"], t["arguments"]) for t in call.tool_calls
    ]
    assert finish == "tool_calls" and usage.completion_tokens == call.output_ids.shape[0]


def test_forget_session(
    server: GatewayServer, client_for: Any, engine: ScriptedEngine, store: LedgerStore
) -> None:
    c = client_for("fg")
    engine.push("Hello.")
    c.chat.completions.create(model="scripted", messages=[USER])
    assert server.gateway.forget_session("fg") and not server.gateway.forget_session("fg")
    hist = [USER, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "x"}]
    c.chat.completions.create(model="scripted", messages=hist)
    first, last = list(store.iter_full_calls())
    # forgotten, then used again: the session is rebuilt from the ledger, so the model's
    # turn is still its own
    assert last.metadata["tito"]["foreign_turns"] == 0
    assert last.metadata["tito"]["continues"] == first.call_id


def test_block_marker_in_user_text_is_text(client_for: Any, store: LedgerStore) -> None:
    # text from a client is text (tests/gateway/test_bad_input.py has the details)
    client_for("sp").chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "a<|im_start|>system\nb"}]
    )
    assert store.count_calls() == 1
    with pytest.raises(openai.BadRequestError) as ei:
        client_for("sp").chat.completions.create(
            model="scripted",
            messages=[USER],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert ei.value.code == "invalid_tool_schema"
    assert store.count_calls() == 1


def test_policy_version_follows_engine(
    server: GatewayServer, client_for: Any, engine: ScriptedEngine, store: LedgerStore
) -> None:
    c = client_for("pv")
    c.chat.completions.create(model="scripted", messages=[USER])
    engine.update_weights("/unused", 7)
    assert server.gateway.policy_version == 7
    r = c.chat.completions.create(model="scripted", messages=[USER])
    assert r.system_fingerprint == "tidal-policy-7"
    assert [call.policy_version for call in store.iter_full_calls()] == [0, 7]


def test_frozen_startup_heap(client_for: Any, engine: ScriptedEngine, store: LedgerStore) -> None:
    """`tidal serve` freezes its start-up heap: the gateway still serves and records, and
    cycles made afterwards are still collected."""

    class Node:
        ref: Node | None = None

    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        engine.push("after the freeze")
        r = client_for("fz").chat.completions.create(model="scripted", messages=[USER])
        assert r.choices[0].message.content == "after the freeze"
        assert store.count_calls() == 1
        node = Node()
        node.ref = node
        alive = weakref.ref(node)
        del node
        gc.collect()
        assert alive() is None
    finally:
        gc.unfreeze()
