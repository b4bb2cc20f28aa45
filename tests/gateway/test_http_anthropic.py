"""The Anthropic Messages API end to end: the official `anthropic` client (messages.create,
plain and streaming) with `base_url=".../sessions/{id}"` over real HTTP, a live gateway,
the real Qwen2.5 tokenizer and template, a real SQLite ledger; multi-turn with tools, the
drift catalogue sent back as content blocks, stop sequences, and errors in Anthropic's
shape that write nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import pytest

from tests.gateway.scripted_engine import ScriptedEngine
from tests.gateway.test_http_drift import tag_call
from tests.gateway.test_http_responses import assert_model_tokens_kept, calls, continues, kinds
from tidal.gateway.server import GatewayServer
from tidal.gateway.verify import verify_store
from tidal.ledger.store import LedgerStore

TOOLS: list[dict[str, Any]] = [
    {
        "name": "set_switch",
        "description": "Turn a switch on or off.",
        "input_schema": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "on": {"type": "boolean"}},
        },
    },
    {
        "name": "weather",
        "description": "Weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
]
USER = {"role": "user", "content": "Please do it."}


@pytest.fixture
def claude(server: GatewayServer) -> Callable[[str], anthropic.Anthropic]:
    def make(sid: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=f"{server.base_url}/sessions/{sid}", api_key="unused", max_retries=0
        )

    return make


def blocks(msg: Any) -> list[dict[str, Any]]:
    return [b.model_dump(exclude_none=True) for b in msg.content]


def results(msg: Any, text: str = "ok") -> dict[str, Any]:
    return {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": text}
            for b in msg.content
            if b.type == "tool_use"
        ],
    }


def test_multi_turn_with_tools_plain_and_streaming(
    claude: Callable[[str], anthropic.Anthropic], engine: ScriptedEngine, store: LedgerStore
) -> None:
    client = claude("a-multi")
    engine.push(
        tag_call("weather", '{"city": "Bern"}') + "\n" + tag_call("weather", '{"city": "Oslo"}'),
        "Sunny in both.",
        "Bye.",
    )
    system = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}]
    m1 = client.messages.create(
        model="scripted", max_tokens=200, system=system, tools=TOOLS,
        messages=[{"role": "user", "content": "Weather in Bern and Oslo?"}],
    )
    assert m1.stop_reason == "tool_use" and m1.id.startswith("msg_")
    uses = [b for b in m1.content if b.type == "tool_use"]
    assert [u.input for u in uses] == [{"city": "Bern"}, {"city": "Oslo"}]
    assert all(u.id.startswith("toolu_") for u in uses) and uses[0].id != uses[1].id
    history = [
        {"role": "user", "content": "Weather in Bern and Oslo?"},
        {"role": "assistant", "content": blocks(m1)},
        results(m1, "sunny"),
    ]
    with client.messages.stream(
        model="scripted", max_tokens=200, system=system, tools=TOOLS, messages=history
    ) as stream:
        events = [e.type for e in stream]
        m2 = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_delta" in events and m2.stop_reason == "end_turn"
    assert m2.content[0].text == "Sunny in both."
    history += [{"role": "assistant", "content": blocks(m2)}, {"role": "user", "content": "Ok."}]
    m3 = client.messages.create(
        model="scripted", max_tokens=200, system=system, tools=TOOLS, messages=history
    )
    assert m3.content[0].text == "Bye."
    assert m3.usage.input_tokens > m2.usage.input_tokens > 0
    c1, c2, c3 = calls(store, "a-multi")
    assert continues(c1, c2) and continues(c2, c3)
    assert [c.metadata["drift"] for c in (c1, c2, c3)] == [[], [], []]
    text = engine._tok.decode(c2.prompt_ids.tolist())
    # a system block list is one system message; tool_result blocks are tool messages
    assert "<|im_start|>system\nBe brief.\n\nUse tools." in text
    assert text.count("<tool_response>\nsunny\n</tool_response>") == 2
    rep = verify_store(store)
    assert rep.ok and rep.model_tokens == rep.model_tokens_verbatim


def tool_case(
    client: anthropic.Anthropic,
    engine: ScriptedEngine,
    model_text: str,
    mutate: Callable[[list[dict[str, Any]]], None],
) -> Any:
    engine.push(model_text, "Done.")
    m1 = client.messages.create(model="scripted", max_tokens=200, tools=TOOLS, messages=[USER])
    sent = blocks(m1)
    mutate(sent)
    history = [USER, {"role": "assistant", "content": sent}, results(m1)]
    client.messages.create(model="scripted", max_tokens=200, tools=TOOLS, messages=history)
    return m1


@pytest.mark.parametrize(
    ("model_args", "mutation", "kind"),
    [
        # the object sent back as it came: no drift, whatever the model's spacing
        ('{"name":"beta","on":true}', None, None),
        ('{"name": "beta", "on": false}', None, None),
        ('{"name": "beta", "on": true}', "reorder", "key_order"),
        ('{"name": "beta", "on": true}', "edit", "edited"),
        ('{"name": "beta", "on": true}', "no_id", "missing_tool_call_id"),
    ],
)
def test_tool_use_input_drift(  # noqa: PLR0917
    claude: Callable[[str], anthropic.Anthropic],
    engine: ScriptedEngine,
    store: LedgerStore,
    model_args: str,
    mutation: str | None,
    kind: str | None,
) -> None:
    sid = f"a-{mutation}-{len(model_args)}"

    def mutate(sent: list[dict[str, Any]]) -> None:
        use = next(b for b in sent if b["type"] == "tool_use")
        if mutation == "reorder":
            use["input"] = dict(reversed(list(use["input"].items())))
        elif mutation == "edit":
            use["input"]["name"] = "gamma"
        elif mutation == "no_id":
            use["id"] = "toolu_unknown"

    tool_case(claude(sid), engine, tag_call("set_switch", model_args), mutate)
    c1, c2 = calls(store, sid)
    assert c1.tool_calls[0]["arguments"] == model_args  # recorded as the model wrote it
    if kind is None:
        assert kinds(c2) == [] and continues(c1, c2)
    elif kind == "edited":
        assert "edited" in kinds(c2) and c2.metadata["tito"]["continues"] is None
    else:
        assert kind in kinds(c2) and "edited" not in kinds(c2) and continues(c1, c2)
    assert "arguments_type" not in kinds(c2)  # an object is this API's native form
    assert verify_store(store).ok


def test_text_blocks_split_and_thinking_dropped(
    claude: Callable[[str], anthropic.Anthropic], engine: ScriptedEngine, store: LedgerStore
) -> None:
    client = claude("a-text")
    engine.push("<think>\nCount them.\n</think>\n\nThere are three.\n\nAll red.", "Ok.", "Ok.")
    m1 = client.messages.create(model="scripted", max_tokens=200, messages=[USER])
    thinking, text = m1.content
    assert thinking.type == "thinking" and thinking.thinking == "Count them."
    assert text.text == "There are three.\n\nAll red."
    split = [
        {"type": "thinking", "thinking": "Count them.", "signature": thinking.signature},
        {"type": "text", "text": "There are three."},
        {"type": "text", "text": "All red."},
    ]
    q = {"role": "user", "content": "Sure?"}
    client.messages.create(
        model="scripted", max_tokens=50, messages=[USER, {"role": "assistant", "content": split}, q]
    )
    no_thinking = [{"type": "text", "text": "There are three.\n\nAll red."}]
    client.messages.create(
        model="scripted", max_tokens=50,
        messages=[USER, {"role": "assistant", "content": no_thinking}, q],
    )
    c1, c2, c3 = calls(store, "a-text")
    assert kinds(c2) == ["whitespace"] and continues(c1, c2)
    assert kinds(c3) == ["thinking_stripped"]
    assert "<think>\nCount them." in engine._tok.decode(c3.prompt_ids.tolist())


def test_stop_sequences_cut_the_recorded_output(
    claude: Callable[[str], anthropic.Anthropic], engine: ScriptedEngine, store: LedgerStore
) -> None:
    client = claude("a-stop")
    engine.push("Step one. END and more text after it.", "Next.")
    m1 = client.messages.create(
        model="scripted", max_tokens=100, messages=[USER], stop_sequences=["END", "never"]
    )
    assert m1.stop_reason == "stop_sequence" and m1.stop_sequence == "END"
    assert m1.content[0].text == "Step one. "
    (c1,) = calls(store, "a-stop")
    out = engine._tok.decode(c1.output_ids.tolist())
    assert out.startswith("Step one. END") and "more" not in out  # cut after the stop string
    assert len(c1.output_logprobs) == len(c1.output_ids)
    assert c1.metadata["stop_sequence"] == "END"
    history = [USER, {"role": "assistant", "content": blocks(m1)}, {"role": "user", "content": "?"}]
    client.messages.create(model="scripted", max_tokens=100, messages=history)
    _, c2 = calls(store, "a-stop")
    # the text sent back lacks the stop string the model sampled: cosmetic, not an edit;
    # the model's tokens (with END) are spliced and closed as prompt tokens
    assert "edited" not in kinds(c2) and continues(c1, c2)
    assert verify_store(store).ok


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"messages": [USER]}, "max_tokens"),
        ({"max_tokens": 10, "messages": []}, "messages"),
        ({"max_tokens": 10, "messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"max_tokens": 10, "temperature": 1.5, "messages": [USER]}, "temperature"),
        ({"max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
         "image"),
        ({"max_tokens": 10, "messages": [USER, {"role": "assistant", "content": "Sure"}]},
         "prefill"),
        ({"max_tokens": 10, "messages": [USER], "tools": [{"type": "web_search_20250305"}]},
         "client tools"),
        ({"max_tokens": 10, "messages": [USER], "tool_choice": {"type": "maybe"}}, "tool_choice"),
    ],
)
def test_bad_requests_get_anthropic_errors_and_write_nothing(
    server: GatewayServer, store: LedgerStore, body: dict[str, Any], needle: str
) -> None:
    r = httpx.post(
        f"{server.base_url}/sessions/a-bad/v1/messages",
        json={"model": "scripted", **body},
        headers={"x-api-key": "k", "anthropic-version": "2023-06-01"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    got = r.json()
    assert got["type"] == "error" and set(got["error"]) == {"type", "message"}
    assert got["error"]["type"] == "invalid_request_error" and needle in got["error"]["message"]
    assert store.count_calls() == 0


def test_sdk_errors_and_unknown_model(
    claude: Callable[[str], anthropic.Anthropic], store: LedgerStore
) -> None:
    with pytest.raises(anthropic.NotFoundError) as ei:
        claude("a-err").messages.create(model="nope", max_tokens=5, messages=[USER])
    assert ei.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        claude("bad id!").messages.create(model="scripted", max_tokens=5, messages=[USER])
    assert store.count_calls() == 0


def test_subagent_url_and_task_role(
    server: GatewayServer, claude: Callable[[str], anthropic.Anthropic], store: LedgerStore
) -> None:
    m = claude("a-parent").messages.create(model="scripted", max_tokens=5, messages=[USER])
    pc = m.model_extra["tidal"]["call_id"]
    child = anthropic.Anthropic(
        base_url=f"{server.base_url}/sessions/a-child/parent/{pc}/task/t-1/role/explorer",
        api_key="unused", max_retries=0,
    )
    child.messages.create(model="scripted", max_tokens=5, messages=[USER])
    (c,) = calls(store, "a-child")
    assert (c.parent_call_id, c.parent_session_id) == (pc, "a-parent")
    assert (c.task_id, c.role) == ("t-1", "explorer")
    assert c.metadata["request"]["endpoint"] == "messages"


PAR = tag_call("weather", '{"city": "Paris"}') + "\n" + tag_call("weather", '{"city": "Oslo"}')
PROSE = "Let me switch it.\n" + tag_call("set_switch", '{"name": "beta", "on": true}')


def _reorder_uses(sent: list[dict[str, Any]], res: dict[str, Any]) -> None:
    sent.reverse()


def _reorder_results(sent: list[dict[str, Any]], res: dict[str, Any]) -> None:
    res["content"].reverse()


def _unknown_result(sent: list[dict[str, Any]], res: dict[str, Any]) -> None:
    res["content"][-1]["tool_use_id"] = "toolu_unknown"


def _drop_text(sent: list[dict[str, Any]], res: dict[str, Any]) -> None:
    sent[:] = [b for b in sent if b["type"] != "text"]


def _respace(sent: list[dict[str, Any]], res: dict[str, Any]) -> None:
    sent[0]["text"] = sent[0]["text"].replace(" ", "\n")


@pytest.mark.parametrize(
    ("model_text", "mutate", "system2", "expect"),
    [
        (PAR, _reorder_uses, "Be brief.", {"parallel_reordered"}),
        (PAR, _reorder_results, "Be brief.", {"parallel_reordered"}),
        (PAR, _unknown_result, "Be brief.", {"missing_tool_call_id"}),
        (PROSE, _drop_text, "Be brief.", {"content_dropped"}),
        (PROSE, _respace, "Be brief.", {"whitespace"}),
        (PROSE, lambda sent, res: None, "Be thorough.", {"history_rewritten"}),
    ],
)
def test_drift_catalogue_through_messages(  # noqa: PLR0917
    claude: Callable[[str], anthropic.Anthropic],
    engine: ScriptedEngine,
    store: LedgerStore,
    model_text: str,
    mutate: Callable[[list[dict[str, Any]], dict[str, Any]], None],
    system2: str,
    expect: set[str],
) -> None:
    sid = f"a-cat-{mutate.__name__.strip('_<>')}"
    client = claude(sid)
    engine.push(model_text, "Done.")
    m1 = client.messages.create(model="scripted", max_tokens=200, system="Be brief.",
                                tools=TOOLS, messages=[USER])
    sent, res = blocks(m1), results(m1)
    for k, b in enumerate(res["content"]):
        b["content"] = f"r{k}"
    mutate(sent, res)
    client.messages.create(
        model="scripted", max_tokens=200, system=system2, tools=TOOLS,
        messages=[USER, {"role": "assistant", "content": sent}, res],
    )
    c1, c2 = calls(store, sid)
    assert set(kinds(c2)) == expect, c2.metadata["drift"]
    assert_model_tokens_kept(c1, c2)
    rep = verify_store(store)
    assert rep.ok and set(rep.drift) == expect


def test_streamed_thinking_and_tool_use(
    claude: Callable[[str], anthropic.Anthropic], engine: ScriptedEngine, store: LedgerStore
) -> None:
    client = claude("a-stream")
    engine.push("<think>\nUse the tool.\n</think>\n\n" + PROSE)
    with client.messages.stream(
        model="scripted", max_tokens=200, tools=TOOLS, messages=[USER]
    ) as stream:
        events = [e.type for e in stream]
        m = stream.get_final_message()
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert m.content[0].thinking == "Use the tool." and m.content[1].text == "Let me switch it."
    assert m.content[2].input == {"name": "beta", "on": True} and m.stop_reason == "tool_use"
    assert events[0] == "message_start" and events[-1] == "message_stop"
    (c,) = calls(store, "a-stream")
    assert c.tool_calls[0]["id"] == m.content[2].id
