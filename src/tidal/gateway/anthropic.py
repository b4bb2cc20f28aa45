"""The Anthropic Messages API (`POST .../v1/messages`), on the gateway's one chat path.

Claude-Code-style harnesses speak Anthropic Messages. As for Responses
(`tidal.gateway.responses`), a request is translated to chat terms (`ChatCall`), served by
`Gateway.call` (token-in-token-out, drift, ledger: as for chat), and the recorded turn is
written back as content blocks. The official `anthropic` client with
`base_url=".../sessions/{id}"` posts to `.../sessions/{id}/v1/messages`, a session route.
The `x-api-key` and `anthropic-version` headers are accepted and not checked. The mapping:

| Anthropic | chat message |
| --- | --- |
| `system` string, or text blocks (joined by a blank line) | one leading system message |
| user text blocks (joined by a newline) | a user message |
| user `tool_result` blocks | a tool message each (`tool_call_id` = `tool_use_id`), first |
| assistant text blocks (concatenated) | assistant content |
| assistant `tool_use` blocks | its tool calls (`id`; `input` compared as an object) |
| assistant `thinking` blocks | `<think>...</think>` opening its content |
| assistant `redacted_thinking` blocks | dropped |
| tools `{name, description, input_schema}` | function tools (`parameters` = `input_schema`) |
| tool_choice auto / any / tool / none | auto / required / that function / none |

Output blocks: `thinking` (when the turn opens with a thinking block; `signature` names the
call), `text`, one `tool_use` per tool call (`input` parsed from the model's arguments
text). `stop_reason`: end_turn, max_tokens, stop_sequence (the output is cut after the
token that completes the string; the recorded ids end there) or tool_use.

A tool_use `input` sent back with its keys in another order is `key_order` drift; its
spacing is the API's, never drift. Text blocks split or merged differ from the model's
text only in whitespace (`whitespace` drift); a dropped thinking block is
`thinking_stripped`. All three keep the model's recorded tokens.

Deliberately simplified: text only (image and document blocks are refused), client tools
only (server tools such as web_search are refused), no assistant prefill (a final
assistant message is refused: the recorded output must be only what was sampled),
`is_error` of a tool result is not rendered, `thinking` settings are recorded, not
enforced. Streaming replays the finished turn in Anthropic's event sequence.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from tidal.gateway.core import Answer, ChatCall, ChatTurn, Route, answer, flag, tidal_block
from tidal.gateway.messages import OBJECT_ARGUMENTS, RequestError, flat_tools, shown
from tidal.gateway.sse import sse, text_pieces
from tidal.gateway.toolcalls import join_thinking, split_thinking

if TYPE_CHECKING:
    from tidal.gateway.core import Gateway

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(e: RequestError) -> dict[str, Any]:
    """Anthropic's error shape: `{"type": "error", "error": {"type", "message"}}`."""
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    where = f" ({e.param})" if e.param else ""
    return {"type": "error", "error": {"type": kind, "message": f"{e.message}{where}"}}


def _err(message: str, param: str) -> RequestError:
    return RequestError(message, param=param)


def _texts(blocks: list[Any], where: str, allowed: tuple[str, ...]) -> list[tuple[str, Any]]:
    """(type, block) of each block, refusing the kinds not in `allowed`."""
    out = []
    for k, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, Mapping) else None
        if kind not in allowed:
            raise _err(
                f"{where}[{k}]: block type {shown(kind)} is not supported here (supported: "
                f"{', '.join(allowed)}; the engines are text-only)",
                f"{where}[{k}].type",
            )
        out.append((kind, b))
    return out


def _str(b: Mapping[str, Any], key: str, where: str) -> str:
    v = b.get(key)
    if not isinstance(v, str):
        raise _err(f"{where}.{key} must be a string", f"{where}.{key}")
    return v


def system_text(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value or None
    if not isinstance(value, list):
        raise _err("system must be a string or a list of text blocks", "system")
    blocks = _texts(value, "system", ("text",))
    return "\n\n".join(_str(b, "text", f"system[{k}]") for k, (_, b) in enumerate(blocks))


def _tool_result_text(value: object, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _err(f"{where} must be a string or a list of text blocks", where)
    return "\n".join(_str(b, "text", f"{where}[{k}]")
                     for k, (_, b) in enumerate(_texts(value, where, ("text",))))


def chat_messages(value: object) -> list[dict[str, Any]]:
    """Anthropic `messages` as chat messages (see the module docstring)."""
    if not isinstance(value, list) or not value:
        raise _err("messages must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise _err(f"{where} must be an object", where)
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise _err(f"{where}.role must be user or assistant, got {shown(role)}",
                       f"{where}.role")
        if isinstance(content, str):
            blocks: list[Any] = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            blocks = content
        else:
            raise _err(f"{where}.content must be a string or a list of blocks", f"{where}.content")
        if role == "user":
            texts = []
            for k, (kind, b) in enumerate(_texts(blocks, f"{where}.content",
                                                ("text", "tool_result"))):
                bw = f"{where}.content[{k}]"
                if kind == "text":
                    texts.append(_str(b, "text", bw))
                else:
                    tid = b.get("tool_use_id")
                    if not isinstance(tid, str) or not tid:
                        raise _err(f"{bw}.tool_use_id is required", f"{bw}.tool_use_id")
                    out.append({
                        "role": "tool", "tool_call_id": tid,
                        "content": _tool_result_text(b.get("content"), f"{bw}.content"),
                    })
            if texts or not blocks:
                out.append({"role": "user", "content": "\n".join(texts)})
            continue
        if i == len(value) - 1:
            raise _err(
                "a final assistant message (prefill) is not supported: the recorded output "
                "must be only what the model sampled",
                where,
            )
        thinking: list[str] = []
        parts: list[str] = []
        calls: list[dict[str, Any]] = []
        for k, (kind, b) in enumerate(_texts(
            blocks, f"{where}.content", ("text", "tool_use", "thinking", "redacted_thinking")
        )):
            bw = f"{where}.content[{k}]"
            if kind == "text":
                parts.append(_str(b, "text", bw))
            elif kind == "thinking":
                thinking.append(_str(b, "thinking", bw))
            elif kind == "tool_use":
                tool_input = b.get("input")
                if not isinstance(tool_input, Mapping):
                    raise _err(f"{bw}.input must be an object", f"{bw}.input")
                calls.append({
                    "id": _str(b, "id", bw),
                    "type": "function",
                    "function": {
                        "name": _str(b, "name", bw),
                        "arguments": json.dumps(tool_input, ensure_ascii=False),
                    },
                    OBJECT_ARGUMENTS: True,
                })
        msg: dict[str, Any] = {
            "role": "assistant",
            "content": join_thinking("\n".join(thinking) if thinking else None,
                                     "".join(parts) or None),
        }
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def chat_tools(value: object) -> list[dict[str, Any]] | None:
    """Anthropic client tools (name, description, input_schema) in chat form."""
    return flat_tools(value, kind="custom", default_kind="custom", schema_key="input_schema",
                      served="client tools (name, description, input_schema)")


def chat_tool_choice(value: object) -> object:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(value, Mapping):
        return {"type": "function", "function": {"name": value.get("name")}}
    raise _err("tool_choice must be {type: auto | any | tool | none}", "tool_choice")


class MessagesAPI:
    """Serves `/v1/messages` on a `Gateway`."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def create(self, body: Mapping[str, Any], route: Route) -> Answer:
        gw = self.gateway
        gw.check_model(body)
        max_tokens = body.get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise _err("max_tokens is required (an integer >= 1)", "max_tokens")
        temp = body.get("temperature")
        if temp is not None and (
            isinstance(temp, bool) or not isinstance(temp, int | float) or not 0 <= temp <= 1
        ):
            raise _err(f"temperature must be a number in [0, 1], got {shown(temp)}", "temperature")
        stops = body.get("stop_sequences") or []
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise _err("stop_sequences must be a list of non-empty strings", "stop_sequences")
        system = system_text(body.get("system"))
        messages = ([{"role": "system", "content": system}] if system else []) + chat_messages(
            body.get("messages")
        )
        meta: dict[str, Any] = {}
        if isinstance(body.get("thinking"), Mapping):
            meta["anthropic"] = {"thinking": dict(body["thinking"])}
        turn = gw.call(
            ChatCall(
                messages=messages,
                tools=chat_tools(body.get("tools")),
                tool_choice=chat_tool_choice(body.get("tool_choice")),
                sampling={k: body.get(k) for k in ("max_tokens", "temperature", "top_p", "top_k")},
                stop=tuple(stops),
                endpoint="messages",
                tool_id_prefix="toolu_",
                metadata=meta,
                want_texts=flag(body, "stream"),
            ),
            route,
        )
        return answer(turn, self._body(turn))

    def _body(self, turn: ChatTurn) -> dict[str, Any]:
        fam = self.gateway.renderer.family
        thinking, text = split_thinking(turn.content, fam.think_open, fam.think_close)
        content: list[dict[str, Any]] = []
        if thinking is not None:
            content.append({"type": "thinking", "thinking": thinking,
                            "signature": f"tidal:{turn.call_id}"})
        if text or not turn.tool_calls:
            content.append({"type": "text", "text": text or ""})
        for t in turn.tool_calls:
            try:
                value = json.loads(t.arguments)
            except (ValueError, RecursionError):  # not JSON, or not for Python
                value = None
            content.append({
                "type": "tool_use", "id": t.id, "name": t.name,
                "input": value if isinstance(value, dict) else {"arguments": t.arguments},
            })
        if turn.tool_calls:
            reason = "tool_use"
        elif turn.stop_sequence is not None:
            reason = "stop_sequence"
        elif turn.finish == "length":
            reason = "max_tokens"
        else:
            reason = "end_turn"
        cached = int(turn.gen.extra.get("cached_tokens", 0))
        return {
            "id": "msg_" + turn.call_id.removeprefix("call-"),
            "type": "message",
            "role": "assistant",
            "model": self.gateway.engine.model_name,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": turn.stop_sequence,
            "usage": {
                "input_tokens": turn.n_prompt - cached,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached,
                "output_tokens": int(turn.output_ids.shape[0]),
            },
            "tidal": tidal_block(turn),
        }


def stream(ans: Answer) -> Iterator[bytes]:
    """A finished message as Anthropic's server-sent events: message_start, per block
    content_block_start / deltas / content_block_stop, message_delta, message_stop."""
    body = ans.body

    def ev(kind: str, **fields: Any) -> bytes:
        return sse({"type": kind, **fields}, kind)

    usage = body["usage"]
    start = {**body, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**usage, "output_tokens": 0}}
    yield ev("message_start", message=start)
    yield ev("ping")
    for k, block in enumerate(body["content"]):
        kind = block["type"]
        if kind == "text":
            yield ev("content_block_start", index=k, content_block={"type": "text", "text": ""})
            for piece in text_pieces(block["text"], ans.token_texts):
                yield ev("content_block_delta", index=k,
                         delta={"type": "text_delta", "text": piece})
        elif kind == "thinking":
            yield ev("content_block_start", index=k,
                     content_block={"type": "thinking", "thinking": "", "signature": ""})
            yield ev("content_block_delta", index=k,
                     delta={"type": "thinking_delta", "thinking": block["thinking"]})
            yield ev("content_block_delta", index=k,
                     delta={"type": "signature_delta", "signature": block["signature"]})
        else:  # tool_use
            yield ev("content_block_start", index=k,
                     content_block={**block, "input": {}})
            yield ev("content_block_delta", index=k,
                     delta={"type": "input_json_delta",
                            "partial_json": json.dumps(block["input"], ensure_ascii=False)})
        yield ev("content_block_stop", index=k)
    yield ev("message_delta",
             delta={"stop_reason": body["stop_reason"], "stop_sequence": body["stop_sequence"]},
             usage={"output_tokens": usage["output_tokens"]})
    yield ev("message_stop")
