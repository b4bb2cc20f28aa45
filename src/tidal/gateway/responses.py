"""The OpenAI Responses API (`POST .../v1/responses`), on the gateway's one chat path.

Codex-style harnesses speak Responses, not Chat Completions. Rather than a second
recording path, a request is translated to chat terms (`ChatCall`), served by
`Gateway.call` (token-in-token-out, drift, ledger: exactly as for chat) and the recorded
turn is written back as Responses output items. The mapping:

| Responses input | chat message |
| --- | --- |
| `instructions` | leading system message |
| `input` string | one user message |
| message item, role user / system / developer | that message (`input_text` parts joined) |
| message item, role assistant (`output_text` parts) | assistant content |
| `function_call` items after it | that assistant turn's tool calls (`call_id` = id) |
| `function_call_output` | tool message (`tool_call_id` = `call_id`) |
| `reasoning` item before an assistant turn | `<think>...</think>` opening its content |

Output: a `reasoning` item when the turn opens with a thinking block, a `message` item
with the text, one `function_call` item per tool call (`arguments` = the model's exact
text). `previous_response_id` continues a held response: its conversation (the inputs and
outputs of its chain) comes before `input`, its `instructions` do not carry over. A
response is held when `store` is true (the default); held responses survive a restart:
each call's metadata keeps its own new input items (`metadata.responses`), so the chain is
rebuilt from the ledger on first use. When a client resends the whole history, the items
stored are only those after the session's latest held conversation, so the ledger grows
with the new items, not with the history.

Deliberately simplified: function tools only (hosted tools such as web_search are
refused), text output only (`text.format` other than text is refused: no constrained
decoding), no `item_reference` items, `GET /responses/{id}` not served; logprobs (with
`include: ["message.output_text.logprobs"]`) cover every sampled token and ride on the
message's text part. Streaming replays the finished turn in the Responses event sequence.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import orjson

from tidal.gateway.core import (
    Answer,
    ChatCall,
    ChatTurn,
    Route,
    answer,
    chat_message,
    flag,
    int_field,
    lp_entries,
    tidal_block,
)
from tidal.gateway.drift import RecordedToolCall
from tidal.gateway.messages import RequestError, check_json_text, flat_tools, shown
from tidal.gateway.sse import sse, text_pieces
from tidal.gateway.toolcalls import join_thinking, split_thinking

if TYPE_CHECKING:
    from tidal.gateway.core import Gateway

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass(frozen=True)
class Held:
    """A response that can be continued: its own new input and its output, in chat form."""

    session_id: str
    previous: str | None  # the response whose conversation comes before `input`
    input: tuple[dict[str, Any], ...]
    output: dict[str, Any]


@dataclass(frozen=True)
class Latest:
    """A session's latest held response: its id, and its conversation (chat messages) as
    JSON text and as a count, for a client that resends the whole history."""

    response_id: str
    text: str
    n_messages: int


def _extends(text: str, prefix: str) -> bool:
    """Whether the JSON list `text` holds the list `prefix`'s items, then more."""
    k = len(prefix)
    return len(text) > k and text.startswith(prefix[:-1]) and text[k - 1] == ","


def response_id(call_id: str) -> str:
    """`resp_<hex>` of a recorded call `call-<hex>` (so a restarted gateway finds it)."""
    return "resp_" + call_id.removeprefix("call-")


def _err(message: str, param: str) -> RequestError:
    return RequestError(message, param=param)


def _text(value: object, where: str, kinds: tuple[str, ...] = _TEXT_PARTS) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _err(f"{where} must be a string or a list of content parts", where)
    out = []
    for k, part in enumerate(value):
        if not isinstance(part, Mapping) or part.get("type") not in kinds:
            got = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise _err(
                f"{where}[{k}]: content part {shown(got)} is not supported (text only: "
                f"{', '.join(kinds)}; the engines are text-only)",
                f"{where}[{k}]",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise _err(f"{where}[{k}].text must be a string", f"{where}[{k}].text")
        out.append(text)
    return "".join(out)


def _field(item: Mapping[str, Any], key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str) or not v:
        raise _err(f"{where}.{key} is required (a non-empty string)", f"{where}.{key}")
    return v


class _Turn:
    """An assistant turn being assembled from consecutive output items."""

    def __init__(self) -> None:
        self.thinking: list[str] = []
        self.text: str | None = None
        self.calls: list[dict[str, Any]] = []

    def message(self) -> dict[str, Any]:
        thinking = "\n".join(self.thinking) if self.thinking else None
        msg: dict[str, Any] = {"role": "assistant", "content": join_thinking(thinking, self.text)}
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg


def input_messages(value: object) -> list[dict[str, Any]]:
    """Responses `input` (a string or items) as chat messages (see the module docstring)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise _err("input must be a string or a list of items", "input")
    out: list[dict[str, Any]] = []
    turn: _Turn | None = None

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            out.append(turn.message())
            turn = None

    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise _err(f"{where} must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role == "assistant":
                if turn is not None and (turn.text is not None or turn.calls):
                    flush()
                turn = turn or _Turn()
                parts = (*_TEXT_PARTS, "refusal")
                turn.text = _text(item.get("content"), f"{where}.content", parts)
            elif role in ("user", "system", "developer"):
                flush()
                text = _text(item.get("content"), f"{where}.content")
                out.append({"role": role, "content": text})
            else:
                raise _err(
                    f"{where}.role must be user, system, developer or assistant, got "
                    f"{shown(role)}",
                    f"{where}.role",
                )
        elif kind == "function_call":
            args = item.get("arguments", "{}")
            if not isinstance(args, str):
                raise _err(f"{where}.arguments must be a JSON string", f"{where}.arguments")
            check_json_text(args, f"{where}.arguments")
            turn = turn or _Turn()
            turn.calls.append({
                "id": _field(item, "call_id", where),
                "type": "function",
                "function": {"name": _field(item, "name", where), "arguments": args},
            })
        elif kind == "function_call_output":
            flush()
            out.append({
                "role": "tool",
                "tool_call_id": _field(item, "call_id", where),
                "content": _text(item.get("output"), f"{where}.output"),
            })
        elif kind == "reasoning":
            if turn is not None and (turn.text is not None or turn.calls):
                flush()
            turn = turn or _Turn()
            pieces = item.get("content") or item.get("summary") or []
            thought = _text(pieces, f"{where}.content", ("reasoning_text", "summary_text"))
            if thought:  # an item with only encrypted_content carries nothing to render
                turn.thinking.append(thought)
        else:
            raise _err(
                f"{where}.type {shown(kind)} is not supported (supported: message, function_call, "
                "function_call_output, reasoning)",
                f"{where}.type",
            )
    flush()
    return out


def chat_tools(value: object) -> list[dict[str, Any]] | None:
    """Responses function tools (flat: name, description, parameters) in chat form."""
    return flat_tools(value, kind="function", default_kind=None, schema_key="parameters",
                      served="function tools")


def chat_tool_choice(value: object) -> object:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    raise _err(
        "tool_choice must be none, auto, required or {type: function, name}", "tool_choice"
    )


class ResponsesAPI:
    """Serves `/v1/responses` on a `Gateway` and holds its responses for
    `previous_response_id` (per session; dropped with `Gateway.forget_session`)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self._lock = threading.Lock()
        self._held: dict[str, Held] = {}
        self._by_session: dict[str, list[str]] = {}
        self._latest: dict[str, Latest] = {}
        gateway.on_forget.append(self.forget)

    def forget(self, session_id: str) -> None:
        with self._lock:
            for rid in self._by_session.pop(session_id, []):
                self._held.pop(rid, None)
            self._latest.pop(session_id, None)

    # --------------------------------------------------------------- held responses
    def _hold(self, rid: str, held: Held) -> None:
        with self._lock:
            self._held[rid] = held
            self._by_session.setdefault(held.session_id, []).append(rid)

    def _load(self, rid: str) -> Held | None:
        """Held responses of `rid`'s session, read back from the ledger (after a restart)."""
        store = self.gateway.store
        call_id = "call-" + rid.removeprefix("resp_")
        sid = store.session_of_call(call_id) if rid.startswith("resp_") else None
        if sid is None:
            return None
        for sc in store.call_log(sid).calls:
            meta = sc.call.metadata or {}
            r = meta.get("responses")
            turn = meta.get("turn")
            if not isinstance(r, Mapping) or not r.get("store") or not isinstance(turn, Mapping):
                continue
            content = turn["content"] if "content" in turn else self.gateway.visible_text(
                sc.call.output_ids
            )
            out = chat_message(content, [
                RecordedToolCall(t["id"], t["name"], t["arguments"])
                for t in sc.call.tool_calls or []
            ])
            rid_k = response_id(sc.call_id)
            with self._lock:
                known = rid_k in self._held
            if not known:
                self._hold(rid_k, Held(sid, r.get("previous"), tuple(r["input"]), out))
        with self._lock:
            return self._held.get(rid)

    def held(self, rid: str) -> Held:
        with self._lock:
            h = self._held.get(rid)
        if h is None:
            h = self._load(rid)
        if h is None:
            raise RequestError(
                f"previous_response_id {shown(rid)} is not a response this gateway holds (unknown, "
                "or created with store: false)",
                param="previous_response_id",
                code="previous_response_not_found",
                status=404,
            )
        return h

    def conversation(self, rid: str) -> list[dict[str, Any]]:
        """The chat messages of response `rid`'s conversation: each response of its chain,
        oldest first, its input then its output."""
        chain: list[Held] = []
        seen: set[str] = set()
        cur: str | None = rid
        while cur is not None:
            if cur in seen:
                raise RequestError(
                    f"response chain of {shown(rid)} loops", param="previous_response_id"
                )
            seen.add(cur)
            h = self.held(cur)
            chain.append(h)
            cur = h.previous
        out: list[dict[str, Any]] = []
        for h in reversed(chain):
            out.extend(h.input)
            out.append(h.output)
        return out

    # --------------------------------------------------------------------- create
    # long by design: the Responses API body checked field by field, in the order its docs give
    def create(self, body: Mapping[str, Any], route: Route) -> Answer:  # noqa: PLR0915
        gw = self.gateway
        gw.check_model(body)
        prev = body.get("previous_response_id")
        if prev is not None and not isinstance(prev, str):
            raise _err("previous_response_id must be a string", "previous_response_id")
        new = input_messages(body.get("input"))
        history: list[dict[str, Any]] = []
        if prev:
            h = self.held(prev)
            if route.session_id is not None and route.session_id != h.session_id:
                raise _err(
                    f"previous_response_id {shown(prev)} belongs to session {h.session_id!r}, not "
                    f"{shown(route.session_id)}",
                    "previous_response_id",
                )
            route = replace(route, session_id=h.session_id)
            history = self.conversation(prev)
        items = [*history, *new]
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise _err("instructions must be a string", "instructions")
        messages = ([{"role": "system", "content": instructions}] if instructions else []) + items
        if not messages:
            raise _err("input must not be empty", "input")
        store = flag(body, "store", True)
        stream = flag(body, "stream")
        flag(body, "parallel_tool_calls", True)  # echoed, not enforced
        meta = body.get("metadata")
        if meta is not None and not isinstance(meta, Mapping):
            raise _err(f"metadata must be an object, got {shown(meta)}", "metadata")
        text_opts = body.get("text")
        if text_opts is not None and not isinstance(text_opts, Mapping):
            raise _err(f"text must be an object, got {shown(text_opts)}", "text")
        fmt = text_opts.get("format") if text_opts is not None else None
        if fmt is not None and not isinstance(fmt, Mapping):
            raise _err(f"text.format must be an object, got {shown(fmt)}", "text.format")
        if fmt is not None and fmt.get("type", "text") != "text":
            raise _err(
                f"text.format {shown(fmt.get('type'))} is not supported (text only: no constrained "
                "decoding)",
                "text.format",
            )
        mot = body.get("max_output_tokens")
        if mot is not None and (isinstance(mot, bool) or not isinstance(mot, int) or mot < 1):
            raise _err(f"max_output_tokens must be an integer >= 1, got {shown(mot)}",
                       "max_output_tokens")
        include = body.get("include") or []
        if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
            raise _err(f"include must be a list of strings, got {shown(include)}", "include")
        want_lp = LOGPROBS_INCLUDE in include
        top = int_field(body, "top_logprobs", 0, 0, 20) or 0
        sampling = {
            "max_tokens": body.get("max_output_tokens"),
            **{k: body.get(k) for k in ("temperature", "top_p", "top_k", "seed")},
        }
        # what this call stores of its input: only what follows a held conversation
        base, stored_input = prev, new
        items_text = orjson.dumps(items).decode() if store else ""
        if store and not prev and route.session_id is not None:
            with self._lock:
                latest = self._latest.get(route.session_id)
            if latest is not None and _extends(items_text, latest.text):
                base, stored_input = latest.response_id, items[latest.n_messages :]
        rid_meta: dict[str, Any] = {"store": store}
        if store:
            rid_meta.update(previous=base, input=stored_input)
        turn = gw.call(
            ChatCall(
                messages=messages,
                tools=chat_tools(body.get("tools")),
                tool_choice=chat_tool_choice(body.get("tool_choice")),
                sampling=sampling,
                logprobs=want_lp,
                top_logprobs=top if want_lp else 0,
                endpoint="responses",
                metadata={"responses": rid_meta},
                want_texts=stream,
            ),
            route,
        )
        rid = response_id(turn.call_id)  # derived, so the ledger needs no copy of it
        output_msg = turn.message()
        if store:
            self._hold(rid, Held(turn.session_id, base, tuple(stored_input), output_msg))
            out = orjson.dumps(output_msg).decode()
            conv = f"{items_text[:-1]},{out}]" if items else f"[{out}]"
            with self._lock:
                self._latest[turn.session_id] = Latest(rid, conv, len(items) + 1)
        return answer(turn, self._body(turn, body, rid, prev, want_lp))

    def _body(
        self, turn: ChatTurn, req: Mapping[str, Any], rid: str, prev: str | None, want_lp: bool
    ) -> dict[str, Any]:
        fam = self.gateway.renderer.family
        thinking, text = split_thinking(turn.content, fam.think_open, fam.think_close)
        hexid = turn.call_id.removeprefix("call-")
        items: list[dict[str, Any]] = []
        if thinking is not None:
            items.append({
                "type": "reasoning", "id": f"rs_{hexid}", "summary": [],
                "content": [{"type": "reasoning_text", "text": thinking}],
                "status": "completed",
            })
        if text or not turn.tool_calls or want_lp:
            part: dict[str, Any] = {"type": "output_text", "text": text or "", "annotations": []}
            if want_lp:
                part["logprobs"] = lp_entries(turn.texts, turn.logprobs, turn.tops or [])
            items.append({
                "type": "message", "id": f"msg_{hexid}", "status": "completed",
                "role": "assistant", "content": [part],
            })
        for k, t in enumerate(turn.tool_calls):
            items.append({
                "type": "function_call", "id": f"fc_{hexid}_{k}", "call_id": t.id,
                "name": t.name, "arguments": t.arguments, "status": "completed",
            })
        n_out = int(turn.output_ids.shape[0])
        cached = int(turn.gen.extra.get("cached_tokens", 0))
        incomplete = turn.finish == "length"
        return {
            "id": rid,
            "object": "response",
            "created_at": int(turn.started),
            "status": "incomplete" if incomplete else "completed",
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.get("instructions"),
            "max_output_tokens": req.get("max_output_tokens"),
            "model": self.gateway.engine.model_name,
            "output": items,
            "parallel_tool_calls": req.get("parallel_tool_calls") is not False,
            "previous_response_id": prev,
            "store": req.get("store") is not False,
            "temperature": req.get("temperature", 1.0),
            "top_p": req.get("top_p", 1.0),
            "text": {"format": {"type": "text"}},
            "tool_choice": req.get("tool_choice", "auto"),
            "tools": list(req.get("tools") or []),
            "truncation": "disabled",
            "metadata": dict(req.get("metadata") or {}),
            "usage": {
                "input_tokens": turn.n_prompt,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": n_out,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": turn.n_prompt + n_out,
            },
            "tidal": tidal_block(turn),
        }


def stream(ans: Answer) -> Iterator[bytes]:
    """A finished response as Responses API server-sent events: created, in_progress, per
    item added / deltas / done, completed (or incomplete)."""
    body = ans.body
    seq = 0

    def ev(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        seq += 1
        return sse({"type": kind, "sequence_number": seq - 1, **fields}, kind)

    start = {**body, "status": "in_progress", "output": [], "usage": None}
    yield ev("response.created", response=start)
    yield ev("response.in_progress", response=start)
    for k, item in enumerate(body["output"]):
        iid = item["id"]
        if item["type"] == "message":
            yield ev("response.output_item.added", output_index=k,
                     item={**item, "status": "in_progress", "content": []})
            part = item["content"][0]
            empty = {"type": "output_text", "text": "", "annotations": []}
            yield ev("response.content_part.added", item_id=iid, output_index=k,
                     content_index=0, part=empty)
            for piece in text_pieces(part["text"], ans.token_texts):
                yield ev("response.output_text.delta", item_id=iid, output_index=k,
                         content_index=0, delta=piece, logprobs=[])
            yield ev("response.output_text.done", item_id=iid, output_index=k, content_index=0,
                     text=part["text"], logprobs=part.get("logprobs", []))
            yield ev("response.content_part.done", item_id=iid, output_index=k,
                     content_index=0, part=part)
        elif item["type"] == "function_call":
            yield ev("response.output_item.added", output_index=k,
                     item={**item, "status": "in_progress", "arguments": ""})
            yield ev("response.function_call_arguments.delta", item_id=iid, output_index=k,
                     delta=item["arguments"])
            yield ev("response.function_call_arguments.done", item_id=iid, output_index=k,
                     arguments=item["arguments"], name=item["name"])
        else:  # reasoning
            yield ev("response.output_item.added", output_index=k,
                     item={**item, "status": "in_progress", "content": []})
            text = item["content"][0]["text"]
            yield ev("response.reasoning_text.delta", item_id=iid, output_index=k,
                     content_index=0, delta=text)
            yield ev("response.reasoning_text.done", item_id=iid, output_index=k,
                     content_index=0, text=text)
        yield ev("response.output_item.done", output_index=k, item=item)
    done = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
    yield ev(done, response=body)

