"""Tool-call parsing: raw model text -> (content, tool calls) for the client.

Pure functions. Two formats, chosen per model family (`ChatFamily.tool_call_formats`):
- `tags`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen's template);
- `fenced`: a fenced block ```json {"name": ..., "arguments": {...}} ``` (what real
  Qwen2.5-Coder writes when given tools), or a JSON list of such objects.

What the client gets and what is kept:
- the tool call's `arguments` string handed to the client is the exact substring the
  model wrote for the arguments object (so a faithful client sends back the same bytes);
  if the model wrote the arguments as a JSON string, that string's value;
- `raw_tool_calls` is the model's text from the first tool-call span to the end of the
  last one, verbatim. The ledger keeps it and the output token ids; training uses those,
  never the parsed form.

Deliberately simplified: a fenced block counts as a tool call only when it names a tool
the request offered (prose answers with JSON examples stay content); an unterminated
`<tool_call>` (a length-truncated output) stays content. No streaming parser: the engine
protocol returns whole generations.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_TAG_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FENCE_RE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n?(.*?)```", re.DOTALL)
_ARGS_KEY_RE = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCallText:
    """One parsed tool call: the name, the arguments text returned to the client, format."""

    name: str
    arguments: str
    format: str


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: tuple[ToolCallText, ...]
    raw_tool_calls: str | None


def _raw_arguments(body: str, obj: dict[str, Any]) -> str:
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


def _call_objects(body: str) -> list[tuple[dict[str, Any], str]] | None:
    """Parse a span body into tool-call objects, or None if it is not one."""
    text = body.strip()
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    out: list[tuple[dict[str, Any], str]] = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if not isinstance(args, dict | str):
            return None
        out.append((item, text if len(items) == 1 else json.dumps(item, ensure_ascii=False)))
    return out or None


def parse_output(
    text: str, formats: tuple[str, ...], known_tools: frozenset[str] | None
) -> ParsedOutput:
    """Split model text into client content and tool calls.

    `known_tools=None` disables parsing (no tools offered or tool_choice "none").
    """
    if known_tools is None or not formats:
        return ParsedOutput(text or None, (), None)
    spans: list[tuple[int, int, list[ToolCallText]]] = []
    if "tags" in formats:
        for m in _TAG_RE.finditer(text):
            objs = _call_objects(m.group(1))
            if objs:
                calls = [ToolCallText(o["name"], _raw_arguments(b, o), "tags") for o, b in objs]
                spans.append((m.start(), m.end(), calls))
    if "fenced" in formats:
        for m in _FENCE_RE.finditer(text):
            if any(s < m.end() and m.start() < e for s, e, _ in spans):
                continue
            objs = _call_objects(m.group(1))
            if objs and all(o["name"] in known_tools for o, _ in objs):
                calls = [ToolCallText(o["name"], _raw_arguments(b, o), "fenced") for o, b in objs]
                spans.append((m.start(), m.end(), calls))
    if not spans:
        return ParsedOutput(text or None, (), None)
    spans.sort(key=lambda s: s[0])
    pieces, pos = [], 0
    for s, e, _ in spans:
        pieces.append(text[pos:s])
        pos = e
    pieces.append(text[pos:])
    content = "".join(pieces).strip()
    found = tuple(c for _, _, cs in spans for c in cs)
    return ParsedOutput(content or None, found, text[spans[0][0] : spans[-1][1]])
