"""Tool-call parsing: raw model text -> (content, tool calls) for the client.

Pure functions. Which parsers run is a model's choice (`tidal.gateway.toolparsers` holds
the built-in ones, one per format real models write): `tidal serve --tool-parser NAMES`,
`[engine] tool_parser` in `tidal run`, or detected from the chat template
(`parsers_for_template`); a name may be `module:attr`, your own object with
`name` and `find(text, tools, lenient) -> (spans, reasons)`.

What the client gets and what is kept:
- the tool call's `arguments` string handed to the client is the exact substring the
  model wrote for the arguments object in JSON formats (so a faithful client sends back
  the same bytes); if the model wrote the arguments as a JSON string, that string's value;
- `raw_tool_calls` is the model's text from the first tool-call span to the end of the
  last one, verbatim. The ledger keeps it and the output token ids; training uses those,
  never the parsed form;
- when the text looks like a tool call (a format's marker, or an offered tool's name as a
  JSON "name" or called like a function) and no parser accepts it, `unparsed` says why:
  the gateway puts it in the response's `tidal.tool_parse` and the call's metadata, and
  `tidal run` counts such calls per step (`tool_parse_failures`).

Deliberately simplified: no streaming parser (the engine protocol returns whole
generations; streams replay the parsed result, a delta per tool call).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tidal.gateway.messages import json_text_problem
from tidal.gateway.toolparsers import BUILTIN, Span, ToolCallText, ToolSet

__all__ = [
    "ParsedOutput",
    "Span",
    "ToolCallText",
    "ToolParser",
    "ToolSet",
    "looks_like_tool_call",
    "parse_output",
    "parsers_for_template",
    "resolve_parsers",
]

DEFAULT_PARSERS = ("hermes", "fenced", "json")


class ToolParser(Protocol):
    """One tool-call format: `find` returns the spans of calls in `text` and the reasons
    it refused text that looked like its format."""

    name: str

    def find(self, text: str, tools: ToolSet, lenient: bool = True) -> tuple[
        list[Span], list[str]
    ]: ...


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: tuple[ToolCallText, ...]
    raw_tool_calls: str | None
    unparsed: str | None = None  # why text that looks like a tool call is not one


def resolve_parsers(spec: str | Sequence[str | ToolParser]) -> tuple[ToolParser, ...]:
    """Parsers from names: built-in (`hermes`, `fenced`, `json`, `mistral`, `pythonic`,
    `qwen3_xml`; `tags` = hermes) or `module:attr`; a string may list several,
    comma-separated, tried in that order. Raises ValueError naming an unknown one."""
    items = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    out: list[ToolParser] = []
    for item in items:
        if not isinstance(item, str):
            out.append(item)
        elif item in BUILTIN:
            out.append(BUILTIN[item])
        elif ":" in item:
            mod, _, attr = item.partition(":")
            try:
                obj: Any = importlib.import_module(mod)
                for part in attr.split("."):
                    obj = getattr(obj, part)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"tool parser {item!r} cannot be loaded: {e}") from e
            if isinstance(obj, type):
                obj = obj()
            if not callable(getattr(obj, "find", None)) or not isinstance(
                getattr(obj, "name", None), str
            ):
                raise ValueError(
                    f"tool parser {item!r} must have a `name` and a "
                    "`find(text, tools, lenient)` method"
                )
            out.append(obj)
        else:
            known = ", ".join(sorted(BUILTIN))
            raise ValueError(f"unknown tool parser {item!r} (built in: {known}; or module:attr)")
    if not out:
        raise ValueError("no tool parser named")
    return tuple(out)


def parsers_for_template(chat_template: str | None) -> tuple[str, ...]:
    """The parsers a chat template's own tool-call format asks for, plus the ones its
    models are seen to write instead (Qwen2.5-Coder: fenced and bare JSON)."""
    t = chat_template or ""
    if "<function=" in t and "<parameter=" in t:
        return ("qwen3_xml", "hermes")
    if "[TOOL_CALLS]" in t:
        return ("mistral", "json")
    if "<|python_start|>" in t:
        return ("pythonic", "json")
    if "<|python_tag|>" in t:
        return ("json", "pythonic")
    return DEFAULT_PARSERS


_MARKERS = ("<tool_call>", "<function=", "[TOOL_CALLS]", "<|python_tag|>", "<|python_start|>")


def looks_like_tool_call(text: str, tools: ToolSet) -> str | None:
    """What in `text` looks like a tool call (a marker, or an offered tool named as a JSON
    "name" or called like a function), or None."""
    for m in _MARKERS:
        if m in text:
            return m
    for name in tools.names:
        if re.search(r'"name"\s*:\s*"' + re.escape(name) + '"', text) or re.search(
            r"(^|[\[\s])" + re.escape(name) + r"\(", text
        ):
            return f"the tool name {name!r}"
    return None


def parse_output(
    text: str,
    parsers: Sequence[ToolParser],
    tools: ToolSet | None,
    *,
    lenient: bool = True,
) -> ParsedOutput:
    """Split model text into client content and tool calls. `tools=None` disables
    parsing (no tools offered, or tool_choice "none"). Parsers run in order; a later one
    keeps only spans that do not overlap an earlier one's."""
    if tools is None or not parsers:
        return ParsedOutput(text or None, (), None)
    spans: list[Span] = []
    reasons: list[str] = []
    for p in parsers:
        try:
            found, why = p.find(text, tools, lenient)
        except (ValueError, RecursionError):  # json: too deep, or a number too long
            reasons.append(f"{p.name}: a JSON value in the text is nested too deeply or has "
                           "a number too long for Python to read")
            continue
        reasons.extend(f"{p.name}: {w}" for w in why)
        for s in found:
            # arguments a client could not send back (`json_text_problem`) stay text
            problem = next(
                (q for c in s.calls if (q := json_text_problem(c.arguments)) is not None), None
            )
            if problem is not None:
                reasons.append(f"{p.name}: the arguments {problem}")
            elif not any(o.start < s.end and s.start < o.end for o in spans):
                spans.append(s)
    if not spans:
        hint = looks_like_tool_call(text, tools)
        unparsed = None
        if hint is not None:
            names = ", ".join(p.name for p in parsers)
            unparsed = "; ".join(reasons) if reasons else (
                f"the text has {hint} but no parser ({names}) accepted a call in it"
            )
        return ParsedOutput(text or None, (), None, unparsed)
    spans.sort(key=lambda s: s.start)
    pieces, pos = [], 0
    for s in spans:
        pieces.append(text[pos : s.start])
        pos = s.end
    pieces.append(text[pos:])
    content = "".join(pieces).strip()
    found_calls = tuple(c for s in spans for c in s.calls)
    return ParsedOutput(content or None, found_calls, text[spans[0].start : spans[-1].end])


def split_thinking(
    content: str | None, open_tag: str = "<think>", close_tag: str = "</think>"
) -> tuple[str | None, str | None]:
    """(thinking, the rest) of a turn that opens with a thinking block (Qwen3's
    `<think>...</think>`), for the APIs that carry thinking apart (Responses' reasoning
    items, Anthropic's thinking blocks); (None, content) otherwise. An unterminated block
    (a length-truncated output) stays content."""
    if not content:
        return None, content
    s = content.lstrip()
    if not s.startswith(open_tag):
        return None, content
    end = s.find(close_tag)
    if end < 0:
        return None, content
    rest = s[end + len(close_tag) :].lstrip("\n")
    return s[len(open_tag) : end].strip("\n"), rest or None


def join_thinking(
    thinking: str | None, text: str | None, open_tag: str = "<think>", close_tag: str = "</think>"
) -> str | None:
    """The turn's content as the model writes it, from thinking sent back apart (the
    inverse of `split_thinking` for Qwen3's layout; other spacing is whitespace drift)."""
    if thinking is None:
        return text
    head = f"{open_tag}\n{thinking}\n{close_tag}"
    return f"{head}\n\n{text}" if text else head
