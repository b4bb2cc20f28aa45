"""Request parsing: a chat request's messages, tools and tool choice, validated before
anything about its session is looked up (the first stage of `Gateway.call`).

Pure: no engine, ledger or session state. The messages of a session's next request are
parsed from where its last request's left off (`base`: the longest kept request whose
messages are a prefix of these, `tidal.gateway.tito.SessionTurns.seen_prefix`), so a long
session does not re-validate its whole history on every call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tidal.gateway.messages import (
    Message,
    RequestError,
    parse_message,
    parse_messages,
    parse_tools,
    shown,
)
from tidal.gateway.tito import Seen, turn_key


@dataclass(frozen=True)
class ChatRequest:
    """A validated chat request: its messages, the JSON text they were sent as (None when
    they are not JSON data), the kept request they extend (`base`), the tools offered and
    the tool choice (`auto` when tools are offered and none is named, else `none`)."""

    messages: list[Message]
    text: str | None
    base: Seen | None
    tools: list[dict[str, Any]] | None
    tool_choice: str | Mapping[str, Any]

    @property
    def tool_names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools or [])

    def routing(self) -> tuple[list[str], list[str]]:
        """What finds the automatic session a request continues: the keys of its
        assistant turns and its tool-call ids (`Gateway` remembers both per session)."""
        keys = [turn_key(m.content, [(c.name, c.arguments) for c in m.tool_calls])
                for m in self.messages if m.role == "assistant"]
        return keys, [c.id for m in self.messages for c in m.tool_calls if c.id]

    def tool_choice_record(self) -> str | dict[str, Any]:
        c = self.tool_choice
        return c if isinstance(c, str) else dict(c)


def parse_request(raw: Any, tools: Any, tool_choice: Any, *, text: str | None,
                  base: Seen | None, logprobs: bool, top_logprobs: int) -> ChatRequest:
    """Validate a request's messages (those after `base`'s only), tools, tool choice and
    logprobs options; a `RequestError` names the field at fault."""
    if base is not None and isinstance(raw, list):  # parse only the new messages
        messages = [*base.messages,
                    *(parse_message(raw[i], i) for i in range(len(base.messages), len(raw)))]
    else:
        messages = parse_messages(raw)
    offered = parse_tools(tools)
    choice = tool_choice if tool_choice is not None else ("auto" if offered else "none")
    names = frozenset(t["function"]["name"] for t in offered or [])
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        if not isinstance(fn, Mapping) or fn.get("name") not in names:
            raise RequestError("tool_choice names a function that is not in tools",
                               param="tool_choice", code="invalid_tool_schema")
    elif choice not in ("none", "auto", "required"):
        raise RequestError(
            f"tool_choice must be none, auto, required or a function, got {shown(choice)}",
            param="tool_choice")
    if top_logprobs and not logprobs:
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    return ChatRequest(messages, text, base, offered, choice)
