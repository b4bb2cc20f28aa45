"""Every drift case end to end: the real openai client over real HTTP, a live gateway,
the real Qwen2.5 tokenizer and template, a real SQLite ledger.

Each case: the (scripted) model writes a turn; the client sends the history back with
one harness-style change; the test checks the drift record in the ledger, that the
recorded output ids reach the next prompt unchanged (or, for an edit, do not), and what
`tidal verify` reports.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import openai
import pytest

from tests.gateway.scripted_engine import ScriptedEngine
from tidal.gateway.verify import verify_store
from tidal.ledger.store import LedgerStore

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "set_switch",
            "description": "Turn a switch on or off.",
            "parameters": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "on": {"type": "boolean"}},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
]
USER = {"role": "user", "content": "Please do it."}


def tag_call(name: str, args_text: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args_text}}}\n</tool_call>'


def first_turn(client: openai.OpenAI, engine: ScriptedEngine, text: str) -> Any:
    engine.push(text)
    return client.chat.completions.create(model="scripted", messages=[USER], tools=TOOLS)


def assistant_msg(resp: Any) -> dict[str, Any]:
    return resp.choices[0].message.model_dump(exclude_none=True, exclude={"refusal"})


def second_turn(client: openai.OpenAI, engine: ScriptedEngine, history: list[Any]) -> Any:
    engine.push("Done.")
    return client.chat.completions.create(model="scripted", messages=history, tools=TOOLS)


def calls_of(store: LedgerStore, sid: str) -> tuple[Any, list[Any]]:
    log = store.call_log(sid)
    return log, [log.full_call(sc.call_id) for sc in log.calls]


def kinds(call: Any) -> list[str]:
    return [d["kind"] for d in call.metadata["drift"]]


def assert_continues(c1: Any, c2: Any) -> None:
    ctx = np.concatenate([c1.prompt_ids, c1.output_ids])
    assert np.array_equal(c2.prompt_ids[: ctx.shape[0]], ctx)
    assert c2.metadata["tito"]["continues"] == c1.call_id


def run_tool_case(  # noqa: PLR0917
    client_for: Callable[..., openai.OpenAI],
    engine: ScriptedEngine,
    store: LedgerStore,
    sid: str,
    model_text: str,
    mutate: Callable[[dict[str, Any]], None],
) -> tuple[Any, Any]:
    client = client_for(sid)
    r1 = first_turn(client, engine, model_text)
    assert r1.choices[0].finish_reason == "tool_calls"
    msg = assistant_msg(r1)
    mutate(msg)
    results = [
        {"role": "tool", "tool_call_id": tc["id"], "content": "ok"} for tc in msg["tool_calls"]
    ]
    second_turn(client, engine, [USER, msg, *results])
    _, (c1, c2) = calls_of(store, sid)
    return c1, c2


def set_args(text: str) -> Callable[[dict[str, Any]], None]:
    def mutate(msg: dict[str, Any]) -> None:
        msg["tool_calls"][0]["function"]["arguments"] = text

    return mutate


@pytest.mark.parametrize(
    ("model_args", "client_args", "kind"),
    [
        ('{"name": "beta", "on": false}', "{'name': 'beta', 'on': False}", "json_literal"),
        ('{"name": "beta", "on": true}', '{"on": true, "name": "beta"}', "key_order"),
        ('{"name":"beta","on":true}', '{"name": "beta", "on": true}', "whitespace"),
        ('{\n    "name": "beta",\n    "on": true\n}', '{"name": "beta", "on": true}', "whitespace"),
        ('{"name": "Zürich"}', '{"name": "Z\\u00fcrich"}', "unicode_escape"),
        ('{"name": "x", "on": 1.0}', '{"name": "x", "on": 1}', "number_format"),
    ],
)
def test_argument_text_drift_keeps_recorded_tokens(  # noqa: PLR0917
    client_for: Callable[..., openai.OpenAI],
    engine: ScriptedEngine,
    store: LedgerStore,
    model_args: str,
    client_args: str,
    kind: str,
) -> None:
    c1, c2 = run_tool_case(
        client_for,
        engine,
        store,
        f"s-{kind}",
        tag_call("set_switch", model_args),
        set_args(client_args),
    )
    # The client got the arguments exactly as the model wrote them.
    assert c1.tool_calls[0]["arguments"] == model_args
    assert c1.raw_tool_calls == tag_call("set_switch", model_args)
    recs = [d for d in c2.metadata["drift"] if d["kind"] == kind]
    assert len(recs) == 1, c2.metadata["drift"]
    assert recs[0]["client"] == client_args
    assert recs[0]["recorded"] == model_args
    assert recs[0]["trainer_sees"] == "recorded_tokens"
    assert "edited" not in kinds(c2)
    assert_continues(c1, c2)
    rep = verify_store(store)
    assert rep.ok and rep.model_tokens == rep.model_tokens_verbatim
    assert rep.drift[kind] >= 1


def test_arguments_as_mapping(client_for: Any, engine: ScriptedEngine, store: LedgerStore) -> None:
    def mutate(msg: dict[str, Any]) -> None:
        fn = msg["tool_calls"][0]["function"]
        fn["arguments"] = json.loads(fn["arguments"])  # AReaL #1420: a mapping, not a string

    c1, c2 = run_tool_case(
        client_for,
        engine,
        store,
        "s-argtype",
        tag_call("set_switch", '{"name": "beta", "on": false}'),
        mutate,
    )
    assert kinds(c2) == ["arguments_type"]
    assert_continues(c1, c2)
    # Rendering the mapping through the template would also have worked; rendering the
    # string through `tojson` would have produced a quoted string. Neither reaches training.
    assert verify_store(store).ok


def test_agents_sdk_fenced_block(
    client_for: Any, engine: ScriptedEngine, store: LedgerStore
) -> None:
    """What real Qwen2.5-Coder writes (a fenced block) and what the OpenAI Agents SDK sends
    back (content null, arguments re-serialised): the raw text is kept and spliced."""
    text = '```json\n{"name": "set_switch", "arguments": {"name":"beta","on":false}}\n```'

    def mutate(msg: dict[str, Any]) -> None:
        msg["content"] = None
        fn = msg["tool_calls"][0]["function"]
        fn["arguments"] = json.dumps(json.loads(fn["arguments"]))

    c1, c2 = run_tool_case(client_for, engine, store, "s-sdk", text, mutate)
    assert c1.raw_tool_calls == text
    assert c1.metadata["tool_call_formats"] == ["fenced"]
    assert c1.tool_calls[0]["arguments"] == '{"name":"beta","on":false}'
    assert kinds(c2) == ["whitespace"]
    assert_continues(c1, c2)


def test_parallel_calls_and_results_reordered(
    client_for: Any, engine: ScriptedEngine, store: LedgerStore
) -> None:
    text = tag_call("weather", '{"city": "Paris"}') + "\n" + tag_call("weather", '{"city": "Oslo"}')
    client = client_for("s-par")
    r1 = first_turn(client, engine, text)
    msg = assistant_msg(r1)
    ids = [tc["id"] for tc in msg["tool_calls"]]
    assert [json.loads(tc["function"]["arguments"])["city"] for tc in msg["tool_calls"]] == [
        "Paris",
        "Oslo",
    ]
    assert len(set(ids)) == 2
    msg["tool_calls"].reverse()
    results = [{"role": "tool", "tool_call_id": i, "content": f"r{i}"} for i in reversed(ids)]
    second_turn(client, engine, [USER, msg, *results])
    _, (c1, c2) = calls_of(store, "s-par")
    recs = [d for d in c2.metadata["drift"] if d["kind"] == "parallel_reordered"]
    assert {d["trainer_sees"] for d in recs} == {"recorded_tokens", "client_order_as_prompt"}
    assert_continues(c1, c2)
    # The results reach the prompt in the order the client sent them (prompt tokens).
    tail = engine._tok.decode(c2.prompt_ids[c1.context_len :].tolist())
    assert tail.index(f"r{ids[1]}") < tail.index(f"r{ids[0]}")


def test_missing_tool_call_ids(client_for: Any, engine: ScriptedEngine, store: LedgerStore) -> None:
    def mutate(msg: dict[str, Any]) -> None:
        msg["tool_calls"][0]["id"] = ""

    client = client_for("s-noid")
    r1 = first_turn(client, engine, tag_call("set_switch", '{"name": "a", "on": true}'))
    msg = assistant_msg(r1)
    mutate(msg)
    second_turn(client, engine, [USER, msg, {"role": "tool", "content": "ok"}])
    _, (c1, c2) = calls_of(store, "s-noid")
    recs = [d for d in c2.metadata["drift"] if d["kind"] == "missing_tool_call_id"]
    assert len(recs) == 2  # the call's id and the result's id
    assert {d["trainer_sees"] for d in recs} == {"recorded_tokens", "client_text_as_prompt"}
    assert_continues(c1, c2)  # matched by content + position: still the model's tokens


def text_case(  # noqa: PLR0917
    client_for: Any,
    engine: ScriptedEngine,
    store: LedgerStore,
    sid: str,
    model_text: str,
    client_text: str,
) -> tuple[Any, Any]:
    client = client_for(sid)
    engine.push(model_text)
    client.chat.completions.create(model="scripted", messages=[USER])
    engine.push("Next.")
    hist = [USER, {"role": "assistant", "content": client_text}, {"role": "user", "content": "?"}]
    client.chat.completions.create(model="scripted", messages=hist)
    _, (c1, c2) = calls_of(store, sid)
    return c1, c2


def test_thinking_stripped(client_for: Any, engine: ScriptedEngine, store: LedgerStore) -> None:
    c1, c2 = text_case(
        client_for,
        engine,
        store,
        "s-think",
        "<think>\n2+2 is 4.\n</think>\n\nThe answer is 4.",
        "The answer is 4.",
    )
    assert kinds(c2) == ["thinking_stripped"]
    assert_continues(c1, c2)
    assert "<think>" in engine._tok.decode(c2.prompt_ids.tolist())


def test_content_whitespace(client_for: Any, engine: ScriptedEngine, store: LedgerStore) -> None:
    c1, c2 = text_case(
        client_for, engine, store, "s-ws", "Line one.\n\nLine two.  ", "Line one.\nLine two."
    )
    assert kinds(c2) == ["whitespace"]
    assert_continues(c1, c2)


@pytest.mark.parametrize(
    ("client_text", "detail"), [("The answer is 5.", ""), ("The answer", "truncated")]
)
def test_edited_turn_is_not_the_models(
    client_for: Any, engine: ScriptedEngine, store: LedgerStore, client_text: str, detail: str
) -> None:
    _c1, c2 = text_case(client_for, engine, store, "s-edit", "The answer is 4.", client_text)
    (rec,) = c2.metadata["drift"]
    assert rec["kind"] == "edited" and rec["detail"] == detail
    assert rec["trainer_sees"] == "client_text_as_prompt"
    assert rec["client"] == client_text and rec["recorded"] == "The answer is 4."
    assert c2.metadata["tito"]["spliced"] == [] and c2.metadata["tito"]["continues"] is None
    # The edited text is in the prompt, as template-rendered prompt tokens ...
    assert f"<|im_start|>assistant\n{client_text}<|im_end|>" in engine._tok.decode(
        c2.prompt_ids.tolist()
    )
    # ... and the model's own output is not: it stays the end of call 1's path, verbatim.
    rep = verify_store(store)
    assert rep.ok and rep.drift == {"edited": 1}


def test_clean_history_has_no_drift(
    client_for: Any, engine: ScriptedEngine, store: LedgerStore
) -> None:
    c1, c2 = text_case(client_for, engine, store, "s-clean", "Hello there.", "Hello there.")
    assert c2.metadata["drift"] == []
    assert_continues(c1, c2)
    # Without the gateway, re-tokenizing the template render gives the same ids here; the
    # splice matters when text and tokens disagree (see test_tito.py).
