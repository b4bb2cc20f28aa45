"""Pure parts without HTTP: tool-call parsing, drift classification, block rendering and
TITO assembly (with the real Qwen2.5 tokenizer and chat template)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tidal.gateway.drift import (
    ClientToolCall,
    RecordedToolCall,
    check_tool_results,
    classify_arguments,
    classify_json_text,
    compare_turn,
    strict_equal,
)
from tidal.gateway.family import CHATML, GatewayError, detect_family
from tidal.gateway.messages import Message, RequestError, parse_messages, parse_tools
from tidal.gateway.render import Renderer, map_blocks, split_blocks
from tidal.gateway.tito import RecordedTurn, SessionTurns, assemble_prompt
from tidal.gateway.toolcalls import ToolSet, parse_output, resolve_parsers

NAMES = ToolSet({"f": {}, "g": {}})
TAGS = resolve_parsers("hermes")
BOTH = resolve_parsers("hermes,fenced")


# ------------------------------------------------------------------------- tool calls


def test_parse_tags_keeps_raw_argument_text() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"b":1,  "a": [1.0, "é"]}}\n</tool_call>'
    out = parse_output(text, BOTH, NAMES)
    assert out.content == "Sure."
    assert [(c.name, c.arguments, c.format) for c in out.tool_calls] == [
        ("f", '{"b":1,  "a": [1.0, "é"]}', "hermes")
    ]
    assert out.raw_tool_calls == text[text.index("<tool_call>") :]


def test_parse_fenced_block_and_list() -> None:
    text = '```json\n[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]\n```'
    out = parse_output(text, BOTH, NAMES)
    assert [c.name for c in out.tool_calls] == ["f", "g"]
    assert out.content is None and out.raw_tool_calls == text
    # A fenced block naming no offered tool is prose (a JSON example), not a call.
    other = '```json\n{"name": "h", "arguments": {}}\n```'
    assert parse_output(other, BOTH, NAMES).tool_calls == ()
    # The fenced format can be switched off per family.
    assert parse_output(text, TAGS, NAMES).tool_calls == ()


def test_parse_ignores_broken_and_disabled() -> None:
    broken = '<tool_call>\n{"name": "f", "arguments": {"x": }\n</tool_call>'
    assert parse_output(broken, TAGS, NAMES).tool_calls == ()
    truncated = '<tool_call>\n{"name": "f", "arguments": {"x": 1'
    assert parse_output(truncated, TAGS, NAMES).content == truncated
    ok = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert parse_output(ok, TAGS, None).tool_calls == ()  # no tools offered
    assert parse_output(ok, TAGS, NAMES).tool_calls[0].arguments == '{"x": 1}'


# ------------------------------------------------------------------------------ drift


@pytest.mark.parametrize(
    ("rec", "cli", "kinds"),
    [
        ('{"a": 1}', '{"a": 1}', []),
        ('{"on": false, "x": null}', "{'on': False, 'x': None}", ["json_literal"]),
        ('{"a": 1}', '{"a":1}', ["whitespace"]),
        ('{"a": 1, "b": 2}', '{"b": 2, "a": 1}', ["key_order"]),
        ('{"s": "ü"}', '{"s": "\\u00fc"}', ["unicode_escape"]),
        ('{"n": 1.0}', '{"n": 1}', ["number_format"]),
        ('{"n": 1e2}', '{"n": 100.0}', ["number_format"]),
        (
            '{"b": 1.0, "a": "ü"}',
            '{"a":"\\u00fc","b":1}',
            ["key_order", "number_format", "unicode_escape", "whitespace"],
        ),
        ('{"on": true}', '{"on": 1}', ["edited"]),
        ('{"a": 1}', '{"a": 2}', ["edited"]),
        ('{"a": 1}', "not json", ["edited"]),
    ],
)
def test_classify_json_text(rec: str, cli: str, kinds: list[str]) -> None:
    assert classify_json_text(rec, cli) == kinds


def test_classify_arguments_mapping() -> None:
    assert classify_arguments('{"a": 1, "b": false}', {"a": 1, "b": False}) == ["arguments_type"]
    assert classify_arguments('{"a": 1, "b": 2}', {"b": 2, "a": 1}) == [
        "arguments_type",
        "key_order",
    ]
    assert classify_arguments('{"a": 1}', {"a": True}) == ["arguments_type", "edited"]
    assert strict_equal([1, {"a": 1.0}], [1.0, {"a": 1}]) and not strict_equal(True, 1)


def test_compare_turn_cases() -> None:
    rec = (RecordedToolCall("c1", "f", '{"x": 1}'), RecordedToolCall("c2", "g", "{}"))
    same = [ClientToolCall("c1", "f", '{"x": 1}'), ClientToolCall("c2", "g", "{}")]
    kw: dict[str, Any] = {"call_id": "k", "rec_content": "Go.", "rec_calls": rec}
    assert compare_turn(1, cli_content="Go.", cli_calls=same, **kw) == []
    swapped = compare_turn(1, cli_content="Go.", cli_calls=same[::-1], **kw)
    assert [r.kind for r in swapped] == ["parallel_reordered"]
    noid = [ClientToolCall(None, "f", '{"x": 1}'), same[1]]
    assert [r.kind for r in compare_turn(1, cli_content="Go.", cli_calls=noid, **kw)] == [
        "missing_tool_call_id"
    ]
    assert [r.kind for r in compare_turn(1, cli_content=None, cli_calls=same, **kw)] == [
        "content_dropped"
    ]
    fewer = compare_turn(1, cli_content="Go.", cli_calls=same[:1], **kw)
    assert [r.kind for r in fewer] == ["edited"] and fewer[
        0
    ].trainer_sees == "client_text_as_prompt"
    renamed = [ClientToolCall("c1", "h", '{"x": 1}'), same[1]]
    assert "edited" in [r.kind for r in compare_turn(1, cli_content="Go.", cli_calls=renamed, **kw)]


def test_tool_results_checks() -> None:
    rec = (RecordedToolCall("c1", "f", "{}"), RecordedToolCall("c2", "f", "{}"))
    assert check_tool_results("k", rec, [(2, "c1"), (3, "c2")]) == []
    assert [r.kind for r in check_tool_results("k", rec, [(2, "c2"), (3, "c1")])] == [
        "parallel_reordered"
    ]
    recs = check_tool_results("k", rec, [(2, None), (3, "zz")])
    assert [r.kind for r in recs] == ["missing_tool_call_id"] * 2


# ---------------------------------------------------------------------- request parsing


def test_request_parsing_errors() -> None:
    with pytest.raises(RequestError, match=r"messages\[0\]\.role"):
        parse_messages([{"role": "bot", "content": "x"}])
    with pytest.raises(RequestError, match="only text content parts"):
        parse_messages([{"role": "user", "content": [{"type": "image_url"}]}])
    assert (
        parse_messages(
            [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ]
        )[0].content
        == "ab"
    )
    with pytest.raises(RequestError) as ei:
        parse_tools([{"type": "function", "function": {"name": "ok", "parameters": "x"}}])
    assert (
        ei.value.param == "tools[0].function.parameters" and ei.value.code == "invalid_tool_schema"
    )


# ------------------------------------------------------------------- render and splice

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "description": "d",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
]
CONVS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ],
    [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                {"id": "b", "type": "function", "function": {"name": "f", "arguments": '{"x": 2}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "1"},
        {"role": "tool", "tool_call_id": "b", "content": "2"},
        {"role": "user", "content": "ünïcode\n\n  spaces  "},
    ],
]


@pytest.fixture(scope="module")
def renderer(tokenizer: Any) -> Renderer:
    return Renderer(tokenizer, detect_family(tokenizer.chat_template))


@pytest.mark.parametrize("conv", CONVS)
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_blocks_tokenize_like_the_whole_render(
    tokenizer: Any, renderer: Renderer, conv: list[dict[str, Any]], tools: Any
) -> None:
    """Splitting at <|im_start|> and tokenizing per block gives the template's own ids."""
    msgs = parse_messages(conv)
    plan = assemble_prompt(msgs, tools, SessionTurns(), renderer)
    want = tokenizer.apply_chat_template(
        conv, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    # Qwen's template renders string arguments through tojson (quoted); ours parses them
    # first, so compare against the same normalisation.
    if any(m.get("tool_calls") for m in conv):
        import json

        fixed = [
            dict(
                m,
                tool_calls=[
                    dict(
                        t,
                        function=dict(
                            t["function"], arguments=json.loads(t["function"]["arguments"])
                        ),
                    )
                    for t in m["tool_calls"]
                ],
            )
            if m.get("tool_calls")
            else m
            for m in conv
        ]
        want = tokenizer.apply_chat_template(
            fixed, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    assert plan.prompt_ids.tolist() == list(want)
    assert plan.foreign_turns == sum(m["role"] == "assistant" for m in conv)


def test_map_blocks_rejects_mismatch(renderer: Renderer) -> None:
    msgs = parse_messages(CONVS[1])
    text = renderer.render(msgs, None)
    blocks = split_blocks(text, CHATML)
    assert [b.role for b in map_blocks(blocks, msgs, CHATML)] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    with pytest.raises(GatewayError, match="blocks"):
        map_blocks(blocks[:-1], msgs, CHATML)
    with pytest.raises(GatewayError, match="no known family"):
        detect_family("{{ messages }}")


def test_splice_uses_recorded_ids_not_text(tokenizer: Any, renderer: Renderer) -> None:
    """The model sampled ids whose text re-tokenizes differently ("Hel"+"lo" vs "Hello"):
    the next prompt carries the sampled ids, where a re-render would not."""
    msgs = parse_messages([{"role": "user", "content": "hi"}])
    turns = SessionTurns()
    p1 = assemble_prompt(msgs, None, turns, renderer)
    sampled = [*tokenizer.encode("Hel"), *tokenizer.encode("lo"), 151645]
    assert tokenizer.encode("Hello") != sampled[:-1]
    out = np.asarray(sampled, dtype=np.int32)
    turns.add(RecordedTurn("c1", 1, p1.prefix_fp, len(p1.prompt_ids), out, "Hello", ()))
    msgs2 = parse_messages(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "more"},
        ]
    )
    p2 = assemble_prompt(msgs2, None, turns, renderer)
    ctx = np.concatenate([p1.prompt_ids, out])
    assert p2.prompt_ids[: len(ctx)].tolist() == ctx.tolist()
    assert p2.continues == "c1" and p2.drift == ()
    rerender = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "more"},
        ],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    assert list(rerender) != p2.prompt_ids.tolist()
    assert tokenizer.decode(list(rerender)) == tokenizer.decode(p2.prompt_ids.tolist())


def test_history_rewritten_and_length_truncated(tokenizer: Any, renderer: Renderer) -> None:
    turns = SessionTurns()
    m1 = parse_messages([{"role": "user", "content": "hi"}])
    p1 = assemble_prompt(m1, None, turns, renderer)
    out = np.asarray(tokenizer.encode("cut"), dtype=np.int32)  # no <|im_end|>: length stop
    turns.add(RecordedTurn("c1", 1, p1.prefix_fp, len(p1.prompt_ids), out, "cut", ()))
    m2 = parse_messages(
        [
            {"role": "user", "content": "HI (edited)"},
            {"role": "assistant", "content": "cut"},
            {"role": "user", "content": "x"},
        ]
    )
    p2 = assemble_prompt(m2, None, turns, renderer)
    assert [d.kind for d in p2.drift] == ["history_rewritten"]
    assert p2.continues is None and p2.base_hint == "c1"
    (sp,) = p2.spliced
    assert p2.prompt_ids[sp.offset : sp.offset + sp.length].tolist() == out.tolist()
    # The closing <|im_end|>\n follows as prompt tokens.
    assert tokenizer.decode(p2.prompt_ids[sp.offset + sp.length :][:2].tolist()) == "<|im_end|>\n"


def test_turn_with_special_token_text_still_splices(tokenizer: Any, renderer: Renderer) -> None:
    """A random model may write <|im_start|>; the client's copy must not break the blocks."""
    turns = SessionTurns()
    m1 = parse_messages([{"role": "user", "content": "hi"}])
    p1 = assemble_prompt(m1, None, turns, renderer)
    out = np.asarray([*tokenizer.encode("a<|im_start|>b"), 151645], dtype=np.int32)
    turns.add(RecordedTurn("c1", 1, p1.prefix_fp, len(p1.prompt_ids), out, "a<|im_start|>b", ()))
    m2 = [*m1, Message("assistant", "a<|im_start|>b"), Message("user", "x")]
    p2 = assemble_prompt(m2, None, turns, renderer)
    assert p2.continues == "c1"
