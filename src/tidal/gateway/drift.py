"""Drift classification: what the client sent back vs what the gateway recorded.

Pure functions, no I/O. A client (agent harness) sends the model's earlier turns back in
later requests, often reformatted. Each difference becomes a `DriftRecord` naming its
kind, what the client sent, what was recorded and what the trainer will see:

Kinds (example -> what the trainer sees):
- json_literal: `{"on": false}` back as `{'on': False}` -> recorded tokens.
- arguments_type: arguments as a mapping instead of a JSON string -> recorded tokens.
- key_order: `{"b":1,"a":2}` back as `{"a":2,"b":1}` -> recorded tokens.
- whitespace: `{"a":1}` back as `{"a": 1}`, or content re-spaced -> recorded tokens.
- unicode_escape: `"é"` back as `"\\u00e9"` (any escape change) -> recorded tokens.
- number_format: `1.0` back as `1`, `1e2` as `100.0` -> recorded tokens.
- thinking_stripped: an earlier `<think>...</think>` removed -> recorded tokens.
- content_dropped: prose before a tool call removed, the calls kept -> recorded tokens.
- parallel_reordered: tool calls in another order -> recorded tokens; tool results in
  another order -> the client's order, as prompt tokens.
- missing_tool_call_id: a tool call without (or with an unknown) id -> recorded tokens;
  a tool result without a known id -> the client's result text, as prompt tokens.
- edited: content or a tool call's value changed, truncated, calls added or removed ->
  the client's text rendered as prompt (never trained); the recorded output stays the
  end of its own call's path.
- history_rewritten: the messages before a recorded turn changed since it was produced
  -> the recorded tokens after the new history (a fork, not a continuation).
- special_token_text: client text (a message, a tool result, a tool call rendered from
  text, the tools) holds a special token's text, e.g. `<|im_start|>` -> that text as
  plain-text tokens, never the special token (`tidal.gateway.render`); `call_id` null,
  `message_index` -1 for the tools.

Cosmetic kinds leave the turn the model's: its recorded token ids are spliced into the
next prompt. `edited` makes the turn the client's.

Deliberately simplified: escape differences of any kind are reported as unicode_escape;
a JSON value that changed type (1 vs "1", true vs 1) is an edit, not a format change.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DRIFT_KINDS = (
    "json_literal",
    "arguments_type",
    "key_order",
    "whitespace",
    "unicode_escape",
    "number_format",
    "thinking_stripped",
    "content_dropped",
    "parallel_reordered",
    "missing_tool_call_id",
    "edited",
    "history_rewritten",
    "special_token_text",
)

RECORDED = "recorded_tokens"
CLIENT_PROMPT = "client_text_as_prompt"
CLIENT_ORDER = "client_order_as_prompt"
FORK = "recorded_tokens_after_new_history"
PLAIN_TEXT = "plain_text_tokens"
_SNIPPET = 2000


@dataclass(frozen=True)
class DriftRecord:
    kind: str
    message_index: int
    call_id: str | None
    client: str
    recorded: str
    trainer_sees: str
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "message_index": self.message_index,
            "call_id": self.call_id,
            "client": self.client[:_SNIPPET],
            "recorded": self.recorded[:_SNIPPET],
            "trainer_sees": self.trainer_sees,
            "detail": self.detail,
        }


def drift_key(record: Mapping[str, Any]) -> tuple[Any, ...]:
    """Identity of a stored drift record: the same turn sent back the same way again is
    the same event (the gateway stores it once per session; `tidal verify` counts it
    once, also in ledgers that stored it with every later call)."""
    return tuple(record.get(k) for k in
                 ("kind", "call_id", "message_index", "client", "recorded", "detail"))


@dataclass(frozen=True)
class RecordedToolCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ClientToolCall:
    """A tool call as a client sent it back. `object_api`: the client's API carries
    arguments as an object (Anthropic's tool_use `input`), given here as its JSON text;
    only its values and key order can differ from the model's text, never its spacing."""

    id: str | None
    name: str
    arguments: str | Mapping[str, Any] | Sequence[Any]
    object_api: bool = False


# ---------------------------------------------------------------------- JSON value compare


def strict_equal(a: Any, b: Any) -> bool:
    """Deep equality that tells bool from int (json true != 1) but 1 == 1.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(strict_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(strict_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)


_LEX_RE = re.compile(
    r'(?P<ws>\s+)|(?P<str>"(?:[^"\\]|\\.)*")|(?P<num>-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)'
    r"|(?P<lit>true|false|null)|(?P<punct>[{}\[\]:,])"
)


def _lex(text: str) -> tuple[list[tuple[str, str]], Counter[str]]:
    toks: list[tuple[str, str]] = []
    ws: Counter[str] = Counter()
    pos = 0
    while pos < len(text):
        m = _LEX_RE.match(text, pos)
        if m is None:
            raise ValueError(f"not JSON at offset {pos}")
        kind = m.lastgroup or ""
        if kind == "ws":
            ws[m.group()] += 1
        else:
            toks.append((kind, m.group()))
        pos = m.end()
    return toks, ws


def _tree(toks: list[tuple[str, str]], i: int) -> tuple[Any, int]:
    """Parse lexed JSON into a tree keeping raw literals: ("obj", [(key, raw, node)]),
    ("arr", [node]), ("str", raw), ("num", raw), ("lit", raw)."""
    kind, raw = toks[i]
    if raw == "{":
        items: list[tuple[str, str, Any]] = []
        i += 1
        while toks[i][1] != "}":
            key_raw = toks[i][1]
            node, i = _tree(toks, i + 2)  # skip key and ':'
            items.append((json.loads(key_raw), key_raw, node))
            if toks[i][1] == ",":
                i += 1
        return ("obj", items), i + 1
    if raw == "[":
        elems: list[Any] = []
        i += 1
        while toks[i][1] != "]":
            node, i = _tree(toks, i)
            elems.append(node)
            if toks[i][1] == ",":
                i += 1
        return ("arr", elems), i + 1
    return (kind, raw), i + 1


def _walk(a: Any, b: Any, kinds: set[str]) -> None:
    if a[0] == "obj" and b[0] == "obj":
        ka, kb = [k for k, _, _ in a[1]], [k for k, _, _ in b[1]]
        if ka != kb:
            kinds.add("key_order")
        bmap = {k: (raw, node) for k, raw, node in b[1]}
        for k, raw, node in a[1]:
            braw, bnode = bmap[k]
            if raw != braw:
                kinds.add("unicode_escape")
            _walk(node, bnode, kinds)
    elif a[0] == "arr" and b[0] == "arr":
        for x, y in zip(a[1], b[1], strict=True):
            _walk(x, y, kinds)
    elif a[1] != b[1]:
        kinds.add({"str": "unicode_escape", "num": "number_format"}.get(a[0], "edited"))


def classify_json_text(recorded: str, client: str) -> list[str]:
    """Why two JSON texts with equal values differ (sorted kinds); ["edited"] if the
    values differ; [] if the texts are identical."""
    if recorded == client:
        return []
    try:
        rv = json.loads(recorded)
    except (ValueError, RecursionError):  # not JSON, or not for Python (digits, depth)
        return ["edited"]
    try:
        cv = json.loads(client)
    except (ValueError, RecursionError):  # not JSON, or not for Python (digits, depth)
        try:
            pv = ast.literal_eval(client)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return ["edited"]
        return ["json_literal"] if strict_equal(rv, pv) else ["edited"]
    if not strict_equal(rv, cv):
        return ["edited"]
    ta, wa = _lex(recorded)
    tb, wb = _lex(client)
    kinds: set[str] = set()
    if ta != tb:
        _walk(_tree(ta, 0)[0], _tree(tb, 0)[0], kinds)
    if wa != wb:
        kinds.add("whitespace")
    return sorted(kinds or {"whitespace"})


def classify_object(recorded: str, client: object) -> list[str]:
    """Compare the model's arguments text with a value an object API sent back (its spacing
    and escapes are the API's, not a change): [] equal, key_order, or edited."""
    try:
        rv = json.loads(recorded)
    except (ValueError, RecursionError):  # not JSON, or not for Python (digits, depth)
        return ["edited"]
    if not strict_equal(rv, client):
        return ["edited"]
    kinds: set[str] = set()
    ta, tb = _lex(recorded)[0], _lex(json.dumps(client, ensure_ascii=False))[0]
    _walk(_tree(ta, 0)[0], _tree(tb, 0)[0], kinds)
    return sorted(kinds & {"key_order"})


def classify_arguments(recorded: str, client: object) -> list[str]:
    """Compare a tool call's arguments as returned (a JSON string) with the client's."""
    if isinstance(client, str):
        return classify_json_text(recorded, client)
    try:
        rv = json.loads(recorded)
    except (ValueError, RecursionError):  # not JSON, or not for Python (digits, depth)
        return ["arguments_type", "edited"]
    kinds = ["arguments_type"]
    if not strict_equal(rv, client):
        kinds.append("edited")
    elif isinstance(rv, dict) and isinstance(client, Mapping) and list(rv) != list(client):
        kinds.append("key_order")
    return kinds


# ------------------------------------------------------------------------ turn compare

_WS_RE = re.compile(r"\s+")


def _ws(text: str) -> str:
    return _WS_RE.sub(" ", text).strip()


def _no_ws(text: str) -> str:
    """Text without any whitespace: content split into blocks or merged again (Anthropic's
    text blocks) loses or gains the spaces between the pieces."""
    return _WS_RE.sub("", text)


def strip_thinking(text: str, open_tag: str = "<think>", close_tag: str = "</think>") -> str:
    pattern = re.escape(open_tag) + r".*?" + re.escape(close_tag)
    return re.sub(pattern, "", text, flags=re.DOTALL)


def compare_content(recorded: str | None, client: str | None, has_tool_calls: bool) -> str | None:
    """The drift kind of an assistant content change, or None if unchanged."""
    r, c = recorded or "", client or ""
    if r == c:
        return None
    if _ws(r) == _ws(c) or _no_ws(r) == _no_ws(c):
        return "whitespace"
    if ("<think>" in r) and _no_ws(strip_thinking(r)) == _no_ws(c):
        return "thinking_stripped"
    if not c and has_tool_calls:
        return "content_dropped"
    return "edited"


def compare_turn(
    index: int,
    *,
    call_id: str,
    rec_content: str | None,
    rec_calls: Sequence[RecordedToolCall],
    cli_content: str | None,
    cli_calls: Sequence[ClientToolCall],
) -> list[DriftRecord]:
    """Classify every difference between a recorded assistant turn and the client's copy."""
    out: list[DriftRecord] = []

    def add(kind: str, client: str, recorded: str, detail: str = "") -> None:
        sees = CLIENT_PROMPT if kind == "edited" else RECORDED
        out.append(DriftRecord(kind, index, call_id, client, recorded, sees, detail))

    ck = compare_content(rec_content, cli_content, bool(rec_calls))
    if ck is not None:
        truncated = bool(cli_content) and (rec_content or "").startswith(cli_content or "")
        add(
            ck,
            cli_content or "",
            rec_content or "",
            "truncated" if ck == "edited" and truncated else "",
        )
    if len(rec_calls) != len(cli_calls):
        add(
            "edited",
            json.dumps([c.name for c in cli_calls]),
            json.dumps([c.name for c in rec_calls]),
            "tool calls added or removed",
        )
        return out
    # Pair client calls with recorded ones: by id, else by equal name+value, else by index.
    by_id = {c.id: j for j, c in enumerate(rec_calls)}
    pairing: list[int] = []
    free = set(range(len(rec_calls)))
    for i, cc in enumerate(cli_calls):
        j: int | None = by_id.get(cc.id) if cc.id else None
        if j is None or j not in free:
            add(
                "missing_tool_call_id",
                str(cc.id or ""),
                rec_calls[min(i, len(rec_calls) - 1)].id,
                "absent" if not cc.id else "unknown or duplicate id",
            )
            j = next(
                (
                    k
                    for k in sorted(free)
                    if rec_calls[k].name == cc.name
                    and "edited" not in classify_arguments(rec_calls[k].arguments, cc.arguments)
                ),
                min(free),
            )
        free.discard(j)
        pairing.append(j)
    if pairing != sorted(pairing):
        add(
            "parallel_reordered",
            json.dumps([cli_calls[i].name for i in range(len(pairing))]),
            json.dumps([c.name for c in rec_calls]),
            "tool calls reordered",
        )
    for cc, j in zip(cli_calls, pairing, strict=True):
        rc = rec_calls[j]
        cli_args = cc.arguments if isinstance(cc.arguments, str) else json.dumps(cc.arguments)
        if cc.name != rc.name:
            add("edited", cc.name, rc.name, "tool name changed")
            continue
        if cc.object_api and isinstance(cc.arguments, str):
            found = classify_object(rc.arguments, json.loads(cc.arguments))
        else:
            found = classify_arguments(rc.arguments, cc.arguments)
        for kind in found:
            add(kind, cli_args, rc.arguments, f"arguments of tool call {rc.id}")
    return out


def check_tool_results(
    call_id: str,
    rec_calls: Sequence[RecordedToolCall],
    results: Sequence[tuple[int, str | None]],
) -> list[DriftRecord]:
    """Tool results (message index, tool_call_id) that follow a recorded tool-call turn."""
    out: list[DriftRecord] = []
    order = {c.id: j for j, c in enumerate(rec_calls)}
    seen: list[int] = []
    for index, tcid in results:
        if not tcid or tcid not in order:
            out.append(
                DriftRecord(
                    "missing_tool_call_id",
                    index,
                    call_id,
                    str(tcid or ""),
                    json.dumps([c.id for c in rec_calls]),
                    CLIENT_PROMPT,
                    "tool result without an id" if not tcid else "tool result with an unknown id",
                )
            )
        else:
            seen.append(order[tcid])
    if seen != sorted(seen):
        out.append(
            DriftRecord(
                "parallel_reordered",
                results[0][0],
                call_id,
                json.dumps([t for _, t in results]),
                json.dumps([c.id for c in rec_calls]),
                CLIENT_ORDER,
                "tool results reordered",
            )
        )
    return out
