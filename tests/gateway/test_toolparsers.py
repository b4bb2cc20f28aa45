"""Each tool-call parser on what models write: the Qwen2.5-Coder-1.5B-Instruct outputs of
issue 26 and of `tests/gateway/fixtures/qwen25_coder_tool_outputs.json` (recorded from the
real model by `bench/toolparse.py`), and each family's documented format. Lenient rules
on and off, refusals with reasons, the parser seam (`module:attr`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tidal.gateway.toolcalls import (
    ToolSet,
    looks_like_tool_call,
    parse_output,
    parsers_for_template,
    resolve_parsers,
)

TOOLS = ToolSet({
    "set_flag": {"type": "object", "properties": {"name": {"type": "string"},
                                                  "on": {"type": "boolean"}}},
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "days": {"type": "integer"}}},
})
QWEN = resolve_parsers("hermes,fenced,json")
FIXTURES = Path(__file__).parent / "fixtures" / "qwen25_coder_tool_outputs.json"

# What Qwen2.5-Coder-1.5B-Instruct wrote behind `tidal serve` (issue 26), exactly.
ISSUE_26 = [
    '{{"name": "set_flag", "arguments": {"name": "beta", "on": false}}}',
    '{\n    "name": "set_flag",\n    "arguments": {\n        "name": "beta",\n'
    '        "on": false\n    }\n}',
]


def calls(out: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


@pytest.mark.parametrize("text", ISSUE_26)
def test_issue_26_outputs_parse(text: str) -> None:
    out = parse_output(text, QWEN, TOOLS)
    assert calls(out) == [("set_flag", {"name": "beta", "on": False})]
    assert out.content is None and out.unparsed is None
    assert out.raw_tool_calls == text  # the model's text, verbatim


def test_doubled_brace_needs_the_lenient_rule() -> None:
    strict = parse_output(ISSUE_26[0], QWEN, TOOLS, lenient=False)
    assert strict.tool_calls == () and strict.unparsed  # looks like a call, says why
    assert parse_output(ISSUE_26[1], QWEN, TOOLS, lenient=False).tool_calls  # one object


def test_recorded_real_model_outputs() -> None:
    samples = json.loads(FIXTURES.read_text())
    assert len(samples) >= 10
    parsed = 0
    for s in samples:
        text = s["text"].removesuffix("<|im_end|>")
        out = parse_output(text, QWEN, TOOLS)
        if out.tool_calls:
            parsed += 1
            assert all(c.name in TOOLS.names for c in out.tool_calls)
            assert out.raw_tool_calls is not None and out.raw_tool_calls in text
            assert out.content is None or '"name"' not in out.content  # nothing left over
        else:
            assert s["expect"] == "prose", s
    assert parsed == sum(s["expect"] == "call" for s in samples)


@pytest.mark.parametrize(
    ("parser", "text", "expect", "content"),
    [
        ("hermes", 'On it.\n<tool_call>\n{"name": "set_flag", "arguments": {"name": "a", '
         '"on": true}}\n</tool_call>', [("set_flag", {"name": "a", "on": True})], "On it."),
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}',
         [("get_weather", {"city": "Oslo"})], None),  # lenient: stopped before the tag
        ("fenced", '```json\n[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
         '{"name": "get_weather", "arguments": {"city": "Rome"}}]\n```',
         [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})], None),
        ("json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
         [("get_weather", {"city": "Oslo"})], None),  # Llama 3.1
        ("json", 'I will check. {"name": "get_weather", "arguments": {"city": "Oslo"}} Done.',
         [("get_weather", {"city": "Oslo"})], "I will check.  Done."),
        ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
         [("get_weather", {"city": "Oslo"})], None),
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]set_flag'
         '[ARGS]{"name": "b", "on": false}',
         [("get_weather", {"city": "Oslo"}), ("set_flag", {"name": "b", "on": False})], None),
        ("pythonic", '[get_weather(city="Oslo", days=2), set_flag(name="b", on=False)]',
         [("get_weather", {"city": "Oslo", "days": 2}), ("set_flag", {"name": "b", "on": False})],
         None),
        ("pythonic", "<|python_start|>[get_weather(city='Oslo')]<|python_end|>",
         [("get_weather", {"city": "Oslo"})], None),  # Llama 4
        ("qwen3_xml", "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
         "Oslo\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
         [("get_weather", {"city": "Oslo", "days": 3})], "Checking."),
    ],
)
def test_each_parser(
    parser: str, text: str, expect: list[tuple[str, dict[str, Any]]], content: str | None
) -> None:
    out = parse_output(text, resolve_parsers(parser), TOOLS)
    assert calls(out) == expect
    assert out.content == content
    assert {c.format for c in out.tool_calls} == {parser}


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),
        ("hermes", '<tool_call>\n{"name": "set_flag", "arguments": [1]}\n</tool_call>'),
        ("json", 'Example: {"name": "get_weather", "arguments": "not json"}'),
        ("pythonic", "[get_weather(city=open('/etc/passwd').read())]"),
        ("pythonic", "[get_weather('Oslo')]"),
        ("qwen3_xml", "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>"),
        ("mistral", "[TOOL_CALLS]rm_rf[ARGS]{}"),
    ],
)
def test_strict_where_not_unambiguous(parser: str, text: str) -> None:
    out = parse_output(text, resolve_parsers(parser), TOOLS)
    assert out.tool_calls == ()
    assert out.content == text and out.unparsed  # kept as text, and the reason is given


def test_prose_is_not_a_call() -> None:
    for text in ("The weather is fine.", 'Use JSON like {"a": 1}.', "```python\nprint(1)\n```"):
        out = parse_output(text, QWEN, TOOLS)
        assert out.tool_calls == () and out.unparsed is None
    assert looks_like_tool_call("call get_weather(city) later", TOOLS)
    assert parse_output('{"name": "set_flag"}', QWEN, None).tool_calls == ()  # no tools


def test_detection_from_templates_and_errors() -> None:
    assert parsers_for_template("{{ '<tool_call>' }}") == ("hermes", "fenced", "json")
    assert parsers_for_template("<function=x><parameter=y>")[0] == "qwen3_xml"
    assert parsers_for_template("[TOOL_CALLS]")[0] == "mistral"
    assert parsers_for_template("<|python_start|>")[0] == "pythonic"
    with pytest.raises(ValueError, match="unknown tool parser 'nope'"):
        resolve_parsers("hermes,nope")
    with pytest.raises(ValueError, match="cannot be loaded"):
        resolve_parsers("tests.gateway.no_such_module:Parser")


class Shouting:
    """A user's own parser: `CALL name {json}` lines."""

    name = "shouting"

    def find(self, text: str, tools: ToolSet, lenient: bool = True) -> Any:
        from tidal.gateway.toolparsers import Span, ToolCallText

        spans = []
        pos = 0
        for line in text.splitlines(keepends=True):
            if line.startswith("CALL "):
                name, _, args = line[5:].strip().partition(" ")
                if name in tools.names:
                    spans.append(Span(pos, pos + len(line), (ToolCallText(name, args, self.name),)))
            pos += len(line)
        return spans, []


def test_user_parser_by_module_attr() -> None:
    (p,) = resolve_parsers("tests.gateway.test_toolparsers:Shouting")
    out = parse_output('ok\nCALL get_weather {"city": "Oslo"}\n', (p,), TOOLS)
    assert calls(out) == [("get_weather", {"city": "Oslo"})] and out.content == "ok"


# -------------------------------------------------- through the gateway, per parser

FORMATS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"days": 2, "city": "Oslo"}}'
              "\n</tool_call>",
    "fenced": '```json\n{"name": "get_weather", "arguments": {"days": 2, "city": "Oslo"}}\n```',
    "json": '{"name": "get_weather", "arguments": {"days": 2, "city": "Oslo"}}',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"days": 2, "city": "Oslo"}',
    "pythonic": '[get_weather(days=2, city="Oslo")]',
    "qwen3_xml": "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n"
                 "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
}
CHAT_TOOLS = [{"type": "function", "function": {"name": n, "parameters": p}}
              for n, p in TOOLS.schemas.items()]


@pytest.fixture
def parser_server(request: Any, tokenizer: Any, tmp_path: Path) -> Any:
    from tests.gateway.scripted_engine import ScriptedEngine
    from tidal.gateway.server import GatewayServer
    from tidal.ledger.store import LedgerStore

    store = LedgerStore(tmp_path / "ledger.db")
    engine = ScriptedEngine(tokenizer)
    srv = GatewayServer(engine, tokenizer, store, port=0, tool_parsers=request.param)
    srv.start()
    yield srv, engine, store
    srv.stop()
    store.close()


@pytest.mark.parametrize("parser_server", list(FORMATS), indirect=True)
@pytest.mark.parametrize("change", ["none", "key_order", "edited"])
def test_stream_and_drift_through_each_parser(parser_server: Any, change: str) -> None:
    import numpy as np
    import openai

    from tidal.gateway.verify import verify_store

    srv, engine, store = parser_server
    parser = srv.gateway.tool_parsers[0].name
    client = openai.OpenAI(base_url=srv.session_url(f"p-{change}"), api_key="x", max_retries=0)
    engine.push(FORMATS[parser], "Sunny.")
    user = {"role": "user", "content": "Weather in Oslo for 2 days?"}
    stream = client.chat.completions.create(model="scripted", messages=[user], tools=CHAT_TOOLS,
                                            stream=True)
    deltas = [tc for chunk in stream for tc in (chunk.choices[0].delta.tool_calls or [])
              if chunk.choices]
    (d,) = deltas
    assert d.function.name == "get_weather"
    assert json.loads(d.function.arguments) == {"days": 2, "city": "Oslo"}
    args = d.function.arguments
    if change == "key_order":
        args = json.dumps(dict(reversed(list(json.loads(args).items()))))
    elif change == "edited":
        args = json.dumps({"days": 3, "city": "Oslo"})
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": d.id, "type": "function", "function": {"name": "get_weather", "arguments": args}}]}
    result = {"role": "tool", "tool_call_id": d.id, "content": "sunny"}
    client.chat.completions.create(model="scripted", messages=[user, turn, result],
                                   tools=CHAT_TOOLS)
    log = store.call_log(f"p-{change}")
    c1, c2 = (log.full_call(sc.call_id) for sc in log.calls)
    assert c1.raw_tool_calls == FORMATS[parser] and c1.metadata["tool_call_formats"] == [parser]
    found = {r["kind"] for r in c2.metadata["drift"]}
    ctx = np.concatenate([c1.prompt_ids, c1.output_ids])
    spliced = np.array_equal(c2.prompt_ids[: ctx.shape[0]], ctx)
    if change == "edited":
        assert "edited" in found and not spliced
    else:
        assert found <= {change, "whitespace"} and ("edited" not in found) and spliced
    assert verify_store(store).ok


def test_unparsed_reason_reaches_response_and_ledger(tokenizer: Any, tmp_path: Path) -> None:
    import openai

    from tests.gateway.scripted_engine import ScriptedEngine
    from tidal.gateway.server import GatewayServer
    from tidal.ledger.store import LedgerStore

    store = LedgerStore(tmp_path / "l.db")
    engine = ScriptedEngine(tokenizer)
    with GatewayServer(engine, tokenizer, store, port=0) as srv:
        engine.push('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>')
        r = openai.OpenAI(base_url=srv.session_url("u"), api_key="x").chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "?"}], tools=CHAT_TOOLS)
    assert r.choices[0].message.tool_calls is None
    reason = r.model_extra["tidal"]["tool_parse"]["reason"]
    assert "hermes" in reason and "not one JSON value" in reason
    (c,) = [store.call_log("u").full_call(sc.call_id) for sc in store.call_log("u").calls]
    assert c.metadata["tool_parse"] == {"status": "unparsed", "reason": reason}
    store.close()
