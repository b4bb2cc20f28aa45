"""The OpenAI Responses API end to end: the official `openai` client (responses.create,
plain and streaming) over real HTTP, a live gateway, the real Qwen2.5 tokenizer and
template, a real SQLite ledger; multi-turn with tools, previous_response_id, the drift
catalogue sent back as Responses items, and errors that write nothing."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from tests.gateway.scripted_engine import ScriptedEngine
from tests.gateway.test_http_drift import tag_call
from tidal.gateway.server import GatewayServer
from tidal.gateway.verify import verify_store
from tidal.ledger.store import LedgerStore

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "set_switch",
        "description": "Turn a switch on or off.",
        "parameters": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "on": {"type": "boolean"}},
        },
    },
    {
        "type": "function",
        "name": "weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
]
USER = {"role": "user", "content": "Please do it."}


def calls(store: LedgerStore, sid: str) -> list[Any]:
    log = store.call_log(sid)
    return [log.full_call(sc.call_id) for sc in log.calls]


def kinds(call: Any) -> list[str]:
    return sorted(d["kind"] for d in call.metadata["drift"])


def continues(c1: Any, c2: Any) -> bool:
    ctx = np.concatenate([c1.prompt_ids, c1.output_ids])
    return bool(
        np.array_equal(c2.prompt_ids[: ctx.shape[0]], ctx)
        and c2.metadata["tito"]["continues"] == c1.call_id
    )


def assert_model_tokens_kept(c1: Any, c2: Any) -> None:
    """c1's sampled ids sit in c2's prompt: as its continued context, or spliced."""
    spliced = [s for s in c2.metadata["tito"]["spliced"] if s[0] == c1.call_id]
    if not spliced:
        assert continues(c1, c2)
        return
    (_, _, off, n) = spliced[0]
    assert np.array_equal(c2.prompt_ids[off : off + n], c1.output_ids)


def items(resp: Any) -> list[dict[str, Any]]:
    return [o.model_dump(exclude_none=True) for o in resp.output]


def test_multi_turn_with_tools_plain_and_streaming(
    client_for: Callable[..., openai.OpenAI], engine: ScriptedEngine, store: LedgerStore
) -> None:
    client = client_for("r-multi")
    engine.push(tag_call("weather", '{"city": "Zürich"}'), "It is sunny.", "Bye.")
    r1 = client.responses.create(
        model="scripted", instructions="Be brief.", input="Weather in Zürich?", tools=TOOLS
    )
    (fc,) = r1.output
    assert fc.type == "function_call" and fc.name == "weather"
    assert fc.arguments == '{"city": "Zürich"}'  # the model's exact text
    assert fc.call_id.startswith("call_") and r1.id.startswith("resp_")
    assert r1.status == "completed" and r1.usage.output_tokens > 0
    history = [
        {"role": "user", "content": "Weather in Zürich?"},
        *items(r1),
        {"type": "function_call_output", "call_id": fc.call_id, "output": "sunny, 21 C"},
    ]
    with client.responses.stream(
        model="scripted", instructions="Be brief.", input=history, tools=TOOLS
    ) as stream:
        events = [e.type for e in stream]
        r2 = stream.get_final_response()
    assert events[:2] == ["response.created", "response.in_progress"]
    assert events[-1] == "response.completed"
    assert events.count("response.output_text.delta") >= 2
    assert r2.output_text == "It is sunny."
    # previous_response_id: only the new input is sent (instructions and tools, as in
    # OpenAI's API, are the request's own)
    r3 = client.responses.create(
        model="scripted", instructions="Be brief.", previous_response_id=r2.id, input="Thanks!",
        tools=TOOLS,
    )
    assert r3.output_text == "Bye." and r3.previous_response_id == r2.id
    c1, c2, c3 = calls(store, "r-multi")
    assert continues(c1, c2) and continues(c2, c3)
    assert [c.metadata["drift"] for c in (c1, c2, c3)] == [[], [], []]
    assert c1.metadata["request"]["endpoint"] == "responses"
    text = engine._tok.decode(c2.prompt_ids.tolist())
    assert "<|im_start|>system\nBe brief." in text and "<tool_response>\nsunny, 21 C" in text
    rep = verify_store(store)
    assert rep.ok and rep.model_tokens == rep.model_tokens_verbatim


def test_full_history_resend_stores_only_new_items(
    client_for: Callable[..., openai.OpenAI], engine: ScriptedEngine, store: LedgerStore
) -> None:
    """A client that resends the whole history (store on): each call stores only the
    items after the conversation it extends, so the ledger grows with new items."""
    client = client_for("r-resend")
    history: list[Any] = []
    for i in range(4):
        engine.push(f"Answer {i}.")
        history.append({"role": "user", "content": f"Question {i}?"})
        r = client.responses.create(model="scripted", input=history)
        history.extend(items(r))
    stored = [c.metadata["responses"] for c in calls(store, "r-resend")]
    assert [len(s["input"]) for s in stored] == [1, 1, 1, 1]
    assert stored[0]["previous"] is None and all(s["previous"] for s in stored[1:])
    # and a later previous_response_id sees the whole conversation
    engine.push("Done.")
    client.responses.create(model="scripted", previous_response_id=r.id, input="End.")
    cs = calls(store, "r-resend")
    assert all(continues(a, b) for a, b in itertools.pairwise(cs))


def test_reasoning_items_round_trip(
    client_for: Callable[..., openai.OpenAI], engine: ScriptedEngine, store: LedgerStore
) -> None:
    client = client_for("r-think")
    engine.push("<think>\n2+2 is 4.\n</think>\n\nThe answer is 4.", "Yes.", "Sure.")
    r1 = client.responses.create(model="scripted", input="2+2?")
    reasoning, _message = r1.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "2+2 is 4."
    assert r1.output_text == "The answer is 4."
    kept = [{"role": "user", "content": "2+2?"}, *items(r1), {"role": "user", "content": "Sure?"}]
    client.responses.create(model="scripted", input=kept)  # reasoning sent back
    dropped = [{"role": "user", "content": "2+2?"}, items(r1)[1], {"role": "user", "content": "?"}]
    client.responses.create(model="scripted", input=dropped)  # reasoning dropped
    c1, c2, c3 = calls(store, "r-think")
    assert kinds(c2) == [] and continues(c1, c2)
    assert kinds(c3) == ["thinking_stripped"]
    assert "<think>" in engine._tok.decode(c3.prompt_ids.tolist())  # the model's tokens


@pytest.mark.parametrize(
    ("model_args", "client_args", "kind"),
    [
        ('{"name": "beta", "on": false}', "{'name': 'beta', 'on': False}", "json_literal"),
        ('{"name": "beta", "on": true}', '{"on": true, "name": "beta"}', "key_order"),
        ('{"name":"beta","on":true}', '{"name": "beta", "on": true}', "whitespace"),
        ('{"name": "Zürich"}', '{"name": "Z\\u00fcrich"}', "unicode_escape"),
        ('{"name": "x", "on": 1.0}', '{"name": "x", "on": 1}', "number_format"),
        ('{"name": "beta", "on": true}', '{"name": "gamma", "on": true}', "edited"),
    ],
)
def test_function_call_arguments_drift(  # noqa: PLR0917
    client_for: Callable[..., openai.OpenAI],
    engine: ScriptedEngine,
    store: LedgerStore,
    model_args: str,
    client_args: str,
    kind: str,
) -> None:
    sid = f"r-{kind}"
    client = client_for(sid)
    engine.push(tag_call("set_switch", model_args), "Done.")
    r1 = client.responses.create(model="scripted", input=[USER], tools=TOOLS)
    (fc,) = items(r1)
    assert fc["arguments"] == model_args
    fc["arguments"] = client_args  # the harness re-serialised them
    out = {"type": "function_call_output", "call_id": fc["call_id"], "output": "ok"}
    client.responses.create(model="scripted", input=[USER, fc, out], tools=TOOLS)
    c1, c2 = calls(store, sid)
    assert kind in kinds(c2)
    if kind == "edited":
        assert c2.metadata["tito"]["continues"] is None
    else:
        assert "edited" not in kinds(c2) and continues(c1, c2)
    assert verify_store(store).ok


def test_previous_response_errors_and_store_false(
    client_for: Callable[..., openai.OpenAI], engine: ScriptedEngine, store: LedgerStore
) -> None:
    client = client_for("r-prev")
    r1 = client.responses.create(model="scripted", input="hi", store=False)
    n = store.count_calls()
    with pytest.raises(openai.NotFoundError) as ei:
        client.responses.create(model="scripted", input="again", previous_response_id=r1.id)
    assert "store: false" in str(ei.value)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="scripted", input="x", previous_response_id="resp_nope")
    r2 = client.responses.create(model="scripted", input="hi")
    with pytest.raises(openai.BadRequestError) as ei:
        client_for("r-other").responses.create(
            model="scripted", input="x", previous_response_id=r2.id
        )
    assert "belongs to session 'r-prev'" in str(ei.value)
    assert store.count_calls() == n + 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": 5}, "input"),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": 9}, "temperature"),
    ],
)
def test_bad_requests_get_openai_errors_and_write_nothing(
    server: GatewayServer, store: LedgerStore, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(
        f"{server.base_url}/sessions/r-bad/v1/responses",
        json={"model": "scripted", **body},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert store.count_calls() == 0


def test_subagent_url_and_headers(
    server: GatewayServer, engine: ScriptedEngine, store: LedgerStore
) -> None:
    parent = openai.OpenAI(base_url=server.session_url("r-parent"), api_key="x", max_retries=0)
    r1 = parent.responses.create(model="scripted", input="Spawn a helper.")
    call_id = r1.model_extra["tidal"]["call_id"]
    child = openai.OpenAI(
        base_url=server.session_url("r-child", parent_call=call_id), api_key="x", max_retries=0
    )
    child.responses.create(model="scripted", input="Help.")
    via_headers = openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
        default_headers={
            "X-Tidal-Session": "r-hdr", "X-Tidal-Task": "t-9", "X-Tidal-Role": "judge"
        },
    )
    via_headers.responses.create(model="scripted", input="Judge.")
    (c,) = calls(store, "r-child")
    assert (c.parent_call_id, c.parent_session_id, c.role) == (call_id, "r-parent", "subagent")
    (h,) = calls(store, "r-hdr")
    assert (h.task_id, h.role) == ("t-9", "judge")
    assert json.loads(json.dumps(r1.model_extra["tidal"]))["session_id"] == "r-parent"


PAR = tag_call("weather", '{"city": "Paris"}') + "\n" + tag_call("weather", '{"city": "Oslo"}')
PROSE = "Let me switch it.\n" + tag_call("set_switch", '{"name": "beta", "on": true}')


def _reorder(out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    calls_, results_ = out[:2], out[2:]
    return [*reversed(calls_), *reversed(results_)]


def _unknown_result(out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [*out[:-1], {**out[-1], "call_id": "call_unknown"}]


def _drop_message(out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in out if o.get("type") != "message"]


def _respace(out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    m = out[0]
    text = m["content"][0]["text"]
    return [{**m, "content": [{**m["content"][0], "text": text.replace(" ", "  ")}]}, *out[1:]]


@pytest.mark.parametrize(
    ("model_text", "mutate", "instructions2", "expect"),
    [
        (PAR, _reorder, "Be brief.", {"parallel_reordered"}),
        (PAR, _unknown_result, "Be brief.", {"missing_tool_call_id"}),
        (PROSE, _drop_message, "Be brief.", {"content_dropped"}),
        (PROSE, _respace, "Be brief.", {"whitespace"}),
        (PROSE, lambda out: out, "Be thorough.", {"history_rewritten"}),
    ],
)
def test_drift_catalogue_through_responses(  # noqa: PLR0917
    client_for: Callable[..., openai.OpenAI],
    engine: ScriptedEngine,
    store: LedgerStore,
    model_text: str,
    mutate: Callable[[list[dict[str, Any]]], list[dict[str, Any]]],
    instructions2: str,
    expect: set[str],
) -> None:
    sid = f"r-cat-{'-'.join(sorted(expect))}"
    client = client_for(sid)
    engine.push(model_text, "Done.")
    r1 = client.responses.create(model="scripted", instructions="Be brief.", input=[USER],
                                 tools=TOOLS)
    out = items(r1)
    out += [{"type": "function_call_output", "call_id": o["call_id"], "output": f"r{k}"}
            for k, o in enumerate(out) if o["type"] == "function_call"]
    client.responses.create(
        model="scripted", instructions=instructions2, input=[USER, *mutate(out)], tools=TOOLS
    )
    c1, c2 = calls(store, sid)
    assert set(kinds(c2)) == expect, c2.metadata["drift"]
    # every kind here keeps the model's tokens: its output is spliced into the new prompt
    assert_model_tokens_kept(c1, c2)
    rep = verify_store(store)
    assert rep.ok and set(rep.drift) == expect


def test_streamed_function_calls_reasoning_and_logprobs(
    client_for: Callable[..., openai.OpenAI], engine: ScriptedEngine, store: LedgerStore
) -> None:
    client = client_for("r-stream")
    engine.push("<think>\nUse the tool.\n</think>\n\n" + PAR, "Both sunny.")
    with client.responses.stream(model="scripted", input=[USER], tools=TOOLS) as stream:
        events = [e.type for e in stream]
        r = stream.get_final_response()
    assert [o.type for o in r.output] == ["reasoning", "function_call", "function_call"]
    assert [json.loads(o.arguments)["city"] for o in r.output[1:]] == ["Paris", "Oslo"]
    assert events.count("response.function_call_arguments.done") == 2
    assert "response.reasoning_text.done" in events
    r2 = client.responses.create(
        model="scripted", input="again", include=["message.output_text.logprobs"], top_logprobs=0
    )
    (msg,) = r2.output
    (c1, c2) = calls(store, "r-stream")
    assert [lp.logprob for lp in msg.content[0].logprobs] == list(c2.output_logprobs)
    assert c1.raw_tool_calls == PAR
