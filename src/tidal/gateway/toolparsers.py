"""The built-in tool-call parsers, one per format real models write.

Each parser finds the tool calls of one format in a model's text and returns them as
spans (where each call's text starts and ends, and the calls in it), plus the reasons it
refused text that looked like its format. `tidal.gateway.toolcalls` combines the parsers
a model uses (by name, or `module:attr` for your own) and splits the text into content
and calls; the raw text is what the ledger keeps and training uses, whatever is parsed.

- `hermes` (alias `tags`): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  (Qwen2.5, Hermes and most ChatML tool templates);
- `fenced`: a fenced block ```` ```json {"name": ..., "arguments": {...}} ``` ```` or a
  list of such objects (what Qwen2.5-Coder writes);
- `json`: bare objects or lists `{"name": ..., "arguments"|"parameters": {...}}`
  (Llama 3.x after `<|python_tag|>`; Qwen2.5-Coder);
- `mistral`: `[TOOL_CALLS] [{...}, ...]`, or `[TOOL_CALLS]name[ARGS]{...}` (v11+);
- `pythonic`: `[get_weather(city="Paris"), f(x=1)]`, optionally inside
  `<|python_start|>...<|python_end|>` (Llama 3.2/4);
- `qwen3_xml`: `<tool_call><function=NAME><parameter=P>value</parameter></function>
  </tool_call>` (Qwen3-Coder).

Strict everywhere: a call must name a tool the request offered (prose with a JSON example
stays content), its arguments must be an object (or a JSON string of one), and Python
calls take only literal keyword arguments. Lenient rules (on by default; `lenient=False`
turns them off), each where the intent is unambiguous:
- `hermes`: a missing `</tool_call>` when the text ends there (the turn stopped); text
  after the JSON object inside the tags; a doubled outer brace `{{...}}`.
- `json`: text around the object(s) (strict: the whole text, after `<|python_tag|>`, is
  one object, or several joined by `;`, or a list); a doubled outer brace
  `{{"name": ..., "arguments": {...}}}` (what Qwen2.5-Coder copies from its template's
  example); `<tools>...</tools>` around a call (the template's tool-list tags, which
  the same model sometimes writes instead of `<tool_call>`).
- `fenced`, `mistral`, `pythonic`, `qwen3_xml`: a missing closing fence / tag at the end.

`arguments` handed to the client is the exact text the model wrote for the arguments
object when the format is JSON; for `pythonic` and `qwen3_xml`, a JSON serialisation
(parameter values typed by the tool's schema for `qwen3_xml`).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_DECODER = json.JSONDecoder()
_ARGS_KEY_RE = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


@dataclass(frozen=True)
class ToolCallText:
    """One parsed tool call: the name, the arguments text returned to the client, and the
    parser (format) that found it."""

    name: str
    arguments: str
    format: str


@dataclass(frozen=True)
class Span:
    """Where tool calls sit in the text: `text[start:end]` holds `calls`."""

    start: int
    end: int
    calls: tuple[ToolCallText, ...]


@dataclass(frozen=True)
class ToolSet:
    """The tools a request offered: names, and each one's JSON-schema parameters."""

    schemas: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.schemas)

    @staticmethod
    def of(tools: list[dict[str, Any]] | None) -> ToolSet:
        """From chat-format tools (`tidal.gateway.messages.parse_tools`)."""
        return ToolSet({
            t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or []
        })


Found = tuple[list[Span], list[str]]  # spans, reasons for text refused


def _raw_arguments(body: str, obj: Mapping[str, Any]) -> str:
    """The arguments exactly as written inside `body` (falls back to a re-serialisation)."""
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return args
    for m in _ARGS_KEY_RE.finditer(body):
        try:
            value, end = _DECODER.raw_decode(body, m.end())
        except json.JSONDecodeError:
            continue
        if value == args:
            return body[m.end() : end]
    return json.dumps(args, ensure_ascii=False)


def _call_of(obj: object, body: str, tools: ToolSet, fmt: str) -> tuple[ToolCallText | None, str]:
    """A tool call from a decoded JSON object, or (None, why not)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, "not an object with a string 'name'"
    name = obj["name"]
    if name not in tools.names:
        return None, f"names {name!r}, which the request did not offer"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            return None, f"the arguments of {name!r} are a string that is not JSON"
        if not isinstance(parsed, dict):
            return None, f"the arguments of {name!r} are not an object"
    elif not isinstance(args, dict):
        return None, f"the arguments of {name!r} are not an object"
    return ToolCallText(name, _raw_arguments(body, obj), fmt), ""


def _calls_of(value: object, body: str, tools: ToolSet, fmt: str) -> tuple[list[ToolCallText], str]:
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        call, why = _call_of(item, body, tools, fmt)
        if call is None:
            return [], why
        out.append(call)
    return (out, "") if out else ([], "an empty list")


def _decode_at(text: str, pos: int, lenient: bool) -> tuple[object, int, int] | None:
    """A JSON value starting at `pos` (skipping spaces): (value, start, end). Lenient: a
    doubled outer brace `{{...}}` decodes as its inner object."""
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    try:
        value, end = _DECODER.raw_decode(text, pos)
        return value, pos, end
    except json.JSONDecodeError:
        pass
    if lenient and text.startswith("{{", pos):
        try:
            value, end = _DECODER.raw_decode(text, pos + 1)
        except json.JSONDecodeError:
            return None
        close = end
        while close < len(text) and text[close] in " \t\r\n":
            close += 1
        if close < len(text) and text[close] == "}":
            return value, pos, close + 1
        if close >= len(text):  # the extra brace never came: the turn stopped
            return value, pos, end
    return None


class Hermes:
    """`<tool_call>{json}</tool_call>` (Qwen's templates, Hermes)."""

    name = "hermes"
    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"

    def find(self, text: str, tools: ToolSet, lenient: bool = True) -> Found:
        spans: list[Span] = []
        why: list[str] = []
        pos = 0
        while (start := text.find(self._OPEN, pos)) >= 0:
            body_start = start + len(self._OPEN)
            close = text.find(self._CLOSE, body_start)
            if close < 0 and not (lenient and text.find(self._OPEN, body_start) < 0):
                why.append("<tool_call> without </tool_call>")
                break
            body_end = close if close >= 0 else len(text)
            end = close + len(self._CLOSE) if close >= 0 else len(text)
            body = text[body_start:body_end]
            dec = _decode_at(body, 0, lenient)
            ok = dec is not None and (lenient or not body[dec[2]:].strip())
            if dec is None or not ok:
                why.append("the text inside <tool_call> is not one JSON value")
            else:
                value, a, b = dec
                calls, reason = _calls_of(value, body[a:b], tools, self.name)
                if calls:
                    spans.append(Span(start, end, tuple(calls)))
                else:
                    why.append(f"<tool_call>: {reason}")
            pos = end
        return spans, why


class Fenced:
    """A fenced JSON block, ```json {...}``` (or a list), naming an offered tool."""

    name = "fenced"
    _RE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n?(.*?)(```|\Z)", re.DOTALL)

    def find(self, text: str, tools: ToolSet, lenient: bool = True) -> Found:
        spans: list[Span] = []
        why: list[str] = []
        for m in self._RE.finditer(text):
            if not m.group(2) and not lenient:
                continue
            body = m.group(1).strip()
            try:
                value = json.loads(body)
            except json.JSONDecodeError:
                continue  # a code block, not a call
            calls, reason = _calls_of(value, body, tools, self.name)
            if calls:
                spans.append(Span(m.start(), m.end(), tuple(calls)))
            elif '"name"' in body:
                why.append(f"fenced block: {reason}")
        return spans, why


class BareJSON:
    """Bare JSON tool calls: one object, several (`;` or newlines between), or a list;
    after `<|python_tag|>` (Llama 3) when present."""

    name = "json"
    _TAG = "<|python_tag|>"

    def find(self, text: str, tools: ToolSet, lenient: bool = True) -> Found:
        if not lenient:
            return self._strict(text, tools)
        spans: list[Span] = []
        why: list[str] = []
        pos = 0
        while True:
            i, j = text.find("{", pos), text.find("[", pos)
            starts = [k for k in (i, j) if k >= 0]
            if not starts:
                break
            start = min(starts)
            dec = _decode_at(text, start, lenient)
            if dec is None:
                pos = start + 1
                continue
            value, a, b = dec
            inner = text[a:b]
            calls, reason = _calls_of(value, inner, tools, self.name)
            if calls:
                s, e = a, b
                for open_, close in ((self._TAG, None), ("<tools>", "</tools>")):
                    k = text.rfind(open_, 0, a)
                    if k < 0 or text[k + len(open_) : a].strip():
                        continue
                    if close is None:
                        s = k
                    else:  # the template's tool-list tags copied around the call
                        after = text[b:].lstrip()
                        if after.startswith(close):
                            s, e = k, len(text) - len(after) + len(close)
                spans.append(Span(s, e, tuple(calls)))
                pos = e
            else:
                if isinstance(value, dict | list) and '"name"' in inner:
                    why.append(f"JSON object: {reason}")
                # past the whole value: calls are top-level objects (or lists), never
                # dug out of other JSON, and each brace is decoded once
                pos = b if isinstance(value, dict | list) else start + 1
        return spans, why

    def _strict(self, text: str, tools: ToolSet) -> Found:
        start = 0
        if text.lstrip().startswith(self._TAG):
            start = text.find(self._TAG) + len(self._TAG)
        pieces = [p for p in re.split(r";\s*(?=\{)", text[start:].strip()) if p.strip()]
        calls: list[ToolCallText] = []
        for p in pieces:
            try:
                value = json.loads(p)
            except json.JSONDecodeError:
                return [], (["not a JSON tool call (strict: the whole text)"]
                            if '"name"' in text else [])
            found, reason = _calls_of(value, p.strip(), tools, self.name)
            if not found:
                return [], [f"JSON object: {reason}"]
            calls.extend(found)
        return ([Span(0, len(text), tuple(calls))] if calls else []), []


class Mistral:
    """`[TOOL_CALLS] [{"name", "arguments"}, ...]` (v3 tokenizers) or
    `[TOOL_CALLS]name[ARGS]{...}` repeated (v11+)."""

    name = "mistral"
    _MARK = "[TOOL_CALLS]"
    _ARGS = "[ARGS]"

    def find(self, text: str, tools: ToolSet, lenient: bool = True) -> Found:
        start = text.find(self._MARK)
        if start < 0:
            return [], []
        rest = text[start + len(self._MARK) :]
        dec = _decode_at(rest, 0, lenient)
        if dec is not None and isinstance(dec[0], list | dict):
            value, a, b = dec
            calls, reason = _calls_of(value, rest[a:b], tools, self.name)
            if calls:
                return [Span(start, start + len(self._MARK) + b, tuple(calls))], []
            return [], [f"[TOOL_CALLS]: {reason}"]
        calls = []
        pos = 0
        while True:
            k = rest.find(self._ARGS, pos)
            if k < 0:
                break
            name = rest[pos:k].strip()
            dec = _decode_at(rest, k + len(self._ARGS), lenient)
            if dec is None or not isinstance(dec[0], dict):
                return [], [f"[TOOL_CALLS]{name}[ARGS]: the arguments are not a JSON object"]
            if name not in tools.names:
                return [], [f"[TOOL_CALLS] names {name!r}, which the request did not offer"]
            calls.append(ToolCallText(name, rest[dec[1] : dec[2]], self.name))
            pos = dec[2]
            if rest.startswith(self._MARK, pos):
                pos += len(self._MARK)
        if not calls:
            return [], ["[TOOL_CALLS] without a call"]
        return [Span(start, start + len(self._MARK) + pos, tuple(calls))], []


def _literal(node: ast.expr) -> Any:
    return ast.literal_eval(node)


class Pythonic:
    """A Python list of calls with literal keyword arguments: `[f(a=1), g(b="x")]`."""

    name = "pythonic"
    _RE = re.compile(r"(<\|python_start\|>)?\s*(\[\s*[A-Za-z_][\w.-]*\s*\(.*?\)\s*\])"
                     r"\s*(<\|python_end\|>)?", re.DOTALL)

    def find(self, text: str, tools: ToolSet, lenient: bool = True) -> Found:
        spans: list[Span] = []
        why: list[str] = []
        for m in self._RE.finditer(text):
            src = m.group(2)
            try:
                tree = ast.parse(src, mode="eval").body
            except SyntaxError:
                why.append("a bracketed call list that is not Python")
                continue
            if not isinstance(tree, ast.List) or not all(isinstance(e, ast.Call)
                                                         for e in tree.elts):
                continue
            calls = []
            for call in tree.elts:
                assert isinstance(call, ast.Call)
                fname = ast.unparse(call.func)
                if fname not in tools.names:
                    why.append(f"calls {fname!r}, which the request did not offer")
                    break
                if call.args:
                    why.append(f"{fname}(...) has positional arguments")
                    break
                try:
                    kwargs = {kw.arg: _literal(kw.value) for kw in call.keywords if kw.arg}
                except (ValueError, SyntaxError):
                    why.append(f"{fname}(...) has an argument that is not a literal")
                    break
                calls.append(ToolCallText(fname, json.dumps(kwargs, ensure_ascii=False),
                                          self.name))
            else:
                if calls:
                    spans.append(Span(m.start(), m.end(), tuple(calls)))
        return spans, why


def _typed(value: str, schema: Mapping[str, Any]) -> Any:
    """A qwen3_xml parameter value in the type its schema gives (text when it says
    string or nothing, or when the text does not parse as that type)."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if kind in (None, "string") or not isinstance(kind, str):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        if kind == "boolean" and value.lower() in ("true", "false"):
            return value.lower() == "true"
        return value
    types: dict[str, tuple[type, ...]] = {
        "integer": (int,), "number": (int, float), "boolean": (bool,), "object": (dict,),
        "array": (list,), "null": (type(None),),
    }
    want = types.get(kind)
    ok = want is None or (
        isinstance(parsed, want) and not (kind in ("integer", "number") and
                                          isinstance(parsed, bool))
    )
    return parsed if ok else value


class Qwen3XML:
    """Qwen3-Coder's XML-style calls: `<tool_call><function=NAME><parameter=P>value
    </parameter>...</function></tool_call>`."""

    name = "qwen3_xml"
    _CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)(</function>\s*</tool_call>|\Z)",
                       re.DOTALL)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def find(self, text: str, tools: ToolSet, lenient: bool = True) -> Found:
        spans: list[Span] = []
        why: list[str] = []
        for m in self._CALL.finditer(text):
            if not m.group(3) and not lenient:
                why.append("<function=...> without </function></tool_call>")
                continue
            name = m.group(1).strip()
            if name not in tools.names:
                why.append(f"<function={name}>: the request did not offer it")
                continue
            props = (tools.schemas.get(name) or {}).get("properties") or {}
            args = {p.group(1).strip(): _typed(p.group(2), props.get(p.group(1).strip(), {}))
                    for p in self._PARAM.finditer(m.group(2))}
            call = ToolCallText(name, json.dumps(args, ensure_ascii=False), self.name)
            spans.append(Span(m.start(), m.end(), (call,)))
        return spans, why


BUILTIN: dict[str, Any] = {
    p.name: p for p in (Hermes(), Fenced(), BareJSON(), Mistral(), Pythonic(), Qwen3XML())
}
BUILTIN["tags"] = BUILTIN["hermes"]  # the name ledgers written before parsers had
