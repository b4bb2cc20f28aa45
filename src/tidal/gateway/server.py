"""HTTP layer: the routes of the three APIs, SSE streaming, errors, and a thread runner.

Routes (all on 127.0.0.1):
- `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `POST
  /v1/responses` (`tidal.gateway.responses`), `POST /v1/messages` (Anthropic's,
  `tidal.gateway.anthropic`: its SDK with `base_url=".../sessions/{id}"` posts there);
- the same under `/sessions/{session_id}[/parent/{call_id}][/task/{task_id}][/role/{role}]/v1/`
  so the stock `openai` client picks a session by its `base_url` alone
  (`OpenAI(base_url=f"{gw}/sessions/{sid}/v1")`), and a subagent by
  `/sessions/{sid}/parent/{call_id}/v1`;
- headers do the same for `/v1/...`: `X-Tidal-Session`, `X-Tidal-Parent-Call`,
  `X-Tidal-Parent-Session` (only needed for a parent this gateway did not record),
  `X-Tidal-Task`, `X-Tidal-Role` (URL parts win over headers).

Responses carry `X-Tidal-Session-Id`, `X-Tidal-Call-Id` and `X-Tidal-Engine-Ms` (the engine
time of the call, which `bench/gateway.py` subtracts to get the gateway's added latency).
Errors are OpenAI-style: `{"error": {"message", "type", "param", "code"}}` with the status;
on `/v1/messages` Anthropic's `{"type": "error", "error": {"type", "message"}}`. A body is
refused (400, before anything runs) unless it is UTF-8 JSON text, an object, nested at
most `MAX_DEPTH` levels and free of lone surrogates (`parse_body`): a client's bad input
is a 4xx, never a 500.

Streaming (`stream: true`) is produced after the call is generated and committed (the
engine protocol returns whole generations): without tool calls, one chunk per output
token, with its logprob when asked; with tool calls, the content in one chunk and one
chunk per tool call; then the finish chunk, the usage chunk (with
`stream_options.include_usage`) and `[DONE]`. Responses and Messages stream in their own
event sequences (their modules' `stream`).
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tidal.gateway import anthropic, responses
from tidal.gateway.core import Answer, Gateway, Route
from tidal.gateway.messages import MAX_DEPTH, RequestError, nested_deeper, shown
from tidal.gateway.sse import sse, text_pieces

HEADER_SESSION = "x-tidal-session"
HEADER_PARENT_CALL = "x-tidal-parent-call"
HEADER_PARENT_SESSION = "x-tidal-parent-session"
HEADER_TASK = "x-tidal-task"
HEADER_ROLE = "x-tidal-role"
_SURROGATE_RE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE_RE = re.compile(r"\\u[dD][89a-fA-F]")  # how JSON text spells one
_URL_PARTS = {
    "parent": "parent_call_id",
    "task": "task_id",
    "role": "role",
    "parent-session": "parent_session_id",
}


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def parse_session_path(rest: str) -> tuple[dict[str, str], str]:
    """`{sid}[/parent/{call}][/task/{t}][/role/{r}]/v1/{endpoint}` -> (fields, endpoint).
    `rest` is ASGI's `path`, already percent-decoded once (so `a%2Fb` cannot smuggle a
    "/" into an id: it splits here, and ids refuse "/" from every source)."""
    parts = rest.split("/")
    v1 = 1
    while v1 < len(parts) and parts[v1] != "v1":
        v1 += 2  # skip a (name, value) pair
    if v1 >= len(parts):
        raise RequestError(
            f"unknown path /sessions/{rest}: expected /sessions/{{id}}/v1/...",
            code="not_found",
            status=404,
        )
    if not parts[0]:
        raise RequestError(
            "invalid session id '' in the URL", param="session_id", code="invalid_session_id"
        )
    fields = {"session_id": parts[0]}
    rest_parts, endpoint = parts[1:v1], "/".join(parts[v1 + 1 :])
    for k, v in zip(rest_parts[::2], rest_parts[1::2], strict=True):
        if k not in _URL_PARTS:
            raise RequestError(
                f"unknown session path part {shown(k)} (known: {', '.join(_URL_PARTS)})",
                code="not_found",
                status=404,
            )
        fields[_URL_PARTS[k]] = v
    return fields, endpoint


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or a `RequestError` (400) saying what is wrong:
    not UTF-8, not JSON (an integer of over 4300 digits included), not an object, nested
    deeper than `MAX_DEPTH` levels, or a string (or key) holding a lone surrogate
    (`"\\ud800"`, which no UTF-8 text can carry), named by its field path."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(
            f"the request body is not UTF-8 text ({e.reason} at byte {e.start})",
            code="invalid_json",
        ) from e
    try:
        body = json.loads(text)
    except RecursionError as e:
        raise RequestError(
            f"the request body is nested deeper than {MAX_DEPTH} levels", code="invalid_json"
        ) from e
    except json.JSONDecodeError as e:
        raise RequestError(
            f"could not parse the request body as JSON: {e}", code="invalid_json"
        ) from e
    except ValueError as e:  # Python's limit on converting long digit strings to int
        raise RequestError(
            "could not parse the request body as JSON: a number in it has more than "
            f"{sys.get_int_max_str_digits()} digits",
            code="invalid_json",
        ) from e
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_json")
    if nested_deeper(body):
        raise RequestError(
            f"the request body is nested deeper than {MAX_DEPTH} levels", code="invalid_json"
        )
    if _SURROGATE_ESCAPE_RE.search(text):  # only an escape can make a lone surrogate
        where = _lone_surrogate(body, "")
        if where is not None:
            raise RequestError(
                f"{where or 'a key'} holds a lone surrogate (an unpaired \\ud800-\\udfff "
                "escape): not Unicode text",
                param=where or None,
            )
    return body


def _lone_surrogate(value: object, where: str) -> str | None:
    """The field path of the first string (or key: its object's path) holding a lone
    surrogate, or None. Only called when the text has a surrogate escape; `parse_body`
    bounds the depth first."""
    if isinstance(value, str):
        return where if _SURROGATE_RE.search(value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            if _SURROGATE_RE.search(k):
                return where
            found = _lone_surrogate(v, f"{where}.{k}" if where else k)
            if found is not None:
                return found
    if isinstance(value, list):
        for i, v in enumerate(value):
            found = _lone_surrogate(v, f"{where}[{i}]")
            if found is not None:
                return found
    return None


def route_from(headers: Mapping[str, str], url_fields: Mapping[str, str]) -> Route:
    def pick(field: str, header: str) -> str | None:
        v = url_fields.get(field)
        return v if v is not None else headers.get(header)

    return Route(
        session_id=pick("session_id", HEADER_SESSION),
        parent_call_id=pick("parent_call_id", HEADER_PARENT_CALL),
        parent_session_id=pick("parent_session_id", HEADER_PARENT_SESSION),
        task_id=pick("task_id", HEADER_TASK),
        role=pick("role", HEADER_ROLE),
        key=api_key(headers),
    )


def api_key(headers: Mapping[str, str]) -> str | None:
    """The request's API key: `Authorization: Bearer KEY` (openai's SDK) or `x-api-key:
    KEY` (anthropic's)."""
    auth = headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return headers.get("x-api-key") or None


def chat_stream(ans: Answer, include_usage: bool) -> Iterator[bytes]:
    """SSE chunks of a finished chat answer (OpenAI's chunk format)."""
    b = ans.body
    choice = b["choices"][0]
    msg = choice["message"]
    base = {
        "id": b["id"],
        "object": "chat.completion.chunk",
        "created": b["created"],
        "model": b["model"],
        "system_fingerprint": b.get("system_fingerprint"),
    }

    def chunk(delta: dict[str, Any], finish: str | None = None, lp: Any = None) -> bytes:
        return sse(
            {
                **base,
                "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}],
            }
        )

    yield chunk({"role": "assistant", "content": ""})
    lps = choice["logprobs"]["content"] if choice.get("logprobs") else None
    rest = lps
    content = msg.get("content") or ""
    if not msg.get("tool_calls"):
        pieces = text_pieces(content, ans.token_texts)
        aligned = (
            lps is not None
            and len(pieces) <= len(lps)
            and pieces == list(ans.token_texts[: len(pieces)])
        )
        for k, piece in enumerate(pieces):
            lp = {"content": [lps[k]]} if aligned and lps is not None else None
            yield chunk({"content": piece}, lp=lp)
        rest = lps[len(pieces) :] if aligned and lps is not None else lps
    else:
        if content:
            yield chunk({"content": content})
        for k, tc in enumerate(msg["tool_calls"]):
            yield chunk(
                {
                    "tool_calls": [
                        {"index": k, "id": tc["id"], "type": "function", "function": tc["function"]}
                    ]
                }
            )
    if rest:
        yield chunk({}, lp={"content": rest})
    yield chunk({}, finish=choice["finish_reason"])
    if include_usage:
        yield sse({**base, "choices": [], "usage": b["usage"]})
    yield b"data: [DONE]\n\n"


def completion_stream(ans: Answer, include_usage: bool) -> Iterator[bytes]:
    b = ans.body
    choice = b["choices"][0]
    base = {
        "id": b["id"],
        "object": "text_completion",
        "created": b["created"],
        "model": b["model"],
    }
    lps = choice.get("logprobs")  # per token when asked, as in the non-streamed answer
    for k, t in enumerate(ans.token_texts):
        lp = None if lps is None else {
            "tokens": [t],
            "token_logprobs": [lps["token_logprobs"][k]],
            "top_logprobs": None if lps["top_logprobs"] is None else [lps["top_logprobs"][k]],
            "text_offset": [lps["text_offset"][k]],
        }
        yield sse(
            {**base, "choices": [{"index": 0, "text": t, "logprobs": lp, "finish_reason": None}]}
        )
    yield sse(
        {
            **base,
            "choices": [
                {"index": 0, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}
            ],
        }
    )
    if include_usage:
        yield sse({**base, "choices": [], "usage": b["usage"]})
    yield b"data: [DONE]\n\n"


Handler = Callable[[Mapping[str, Any], Route], Answer]


def include_usage(body: Mapping[str, Any]) -> bool:
    """Chat and completions streams end with a usage chunk when the client asks."""
    opts = body.get("stream_options")
    return bool(isinstance(opts, dict) and opts.get("include_usage"))


Streamer = Callable[[Answer, Mapping[str, Any]], Iterator[bytes]]
_JSON = b"application/json"
_SSE = b"text/event-stream; charset=utf-8"
Headers = Sequence[tuple[bytes, bytes]]


def _json_bytes(obj: Any) -> bytes:
    # backslashreplace: a lone surrogate (none gets past `parse_body`) would become a
    # JSON escape rather than an exception
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode(
        "utf-8", "backslashreplace"
    )


async def _read_body(receive: Any) -> bytes | None:
    """The whole request body, or None when the client went away first."""
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(chunks)


class GatewayApp:
    """The ASGI app serving a `Gateway`: a plain ASGI callable rather than a web framework
    (the request bodies are parsed and checked by `Gateway`; a framework's routing, request
    and response objects cost ~0.1-0.2 ms a request). Calls run on a thread pool of
    `max_concurrency` threads (the engine call blocks; requests beyond wait their turn;
    `asyncio`'s executor hop is ~20 us cheaper than anyio's); `close()` lets the threads
    end once their calls are done. Serves only HTTP (no lifespan or websocket events)."""

    def __init__(self, gateway: Gateway, *, max_concurrency: int = 256) -> None:
        self.gateway = gateway
        self.responses = responses.ResponsesAPI(gateway)
        self.messages = anthropic.MessagesAPI(gateway)
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="tidal-gateway-call")
        # endpoint -> (serve a body, stream a finished answer)
        self._endpoints: dict[str, tuple[Handler, Streamer]] = {
            "chat/completions": (
                gateway.chat, lambda ans, body: chat_stream(ans, include_usage(body))
            ),
            "completions": (
                gateway.completion, lambda ans, body: completion_stream(ans, include_usage(body))
            ),
            "responses": (self.responses.create, lambda ans, body: responses.stream(ans)),
            "messages": (self.messages.create, lambda ans, body: anthropic.stream(ans)),
        }

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/health":
            allowed: tuple[str, ...] = ("GET",)
        elif path.startswith(("/v1/", "/sessions/")):
            allowed = ("GET", "POST")
        else:
            await self._error(send, RequestError("Not Found", code="not_found", status=404))
            return
        if method not in allowed:  # HEAD too: these routes never answered it
            await self._error(
                send, RequestError("Method Not Allowed", code="http_error", status=405)
            )
            return
        if path == "/health":
            await _send(send, 200, _json_bytes({
                "ok": True,
                "model": self.gateway.engine.model_name,
                "policy_version": self.gateway.policy_version,
            }))
            return
        endpoint = path[len("/v1/") :] if path.startswith("/v1/") else ""
        if not endpoint and "/v1/" in path:  # the API whose error shape a bad path gets
            endpoint = path.rsplit("/v1/", 1)[1]
        try:
            fields: dict[str, str] = {}
            if path.startswith("/sessions/"):
                fields, endpoint = parse_session_path(path[len("/sessions/") :])
            await self._serve(scope, receive, send, endpoint, fields)
        except RequestError as e:
            await self._error(send, e, endpoint)
        except Exception as e:  # an engine or ledger fault: nothing was answered
            await self._error(send, RequestError(
                f"internal error: {type(e).__name__}: {e}",
                code="internal_error",
                status=500,
                type_="server_error",
            ), endpoint)

    async def _error(self, send: Any, e: RequestError, endpoint: str = "") -> None:
        """The error in the shape of the endpoint's API (Anthropic's for /v1/messages)."""
        body = (
            anthropic.error_body(e)
            if endpoint.startswith("messages")
            else error_body(e.message, e.type, e.param, e.code)
        )
        await _send(send, e.status, _json_bytes(body))

    async def _serve(
        self,
        scope: dict[str, Any],
        receive: Any,
        send: Any,
        endpoint: str,
        url_fields: Mapping[str, str],
    ) -> None:
        gateway = self.gateway
        if endpoint == "models":
            await _send(send, 200, _json_bytes(gateway.models()))
            return
        if scope["method"] != "POST":
            raise RequestError(
                f"{scope['method']} is not allowed here; use POST",
                code="method_not_allowed",
                status=405,
            )
        if endpoint not in self._endpoints:
            raise RequestError(f"unknown endpoint /v1/{endpoint}", code="not_found", status=404)
        raw = await _read_body(receive)
        if raw is None:
            return
        body = parse_body(raw)
        headers: dict[str, str] = {}
        for k, v in scope["headers"]:  # the first of repeated headers counts
            headers.setdefault(k.decode("latin-1"), v.decode("latin-1"))
        route = route_from(headers, url_fields)
        fn, streamer = self._endpoints[endpoint]
        loop = asyncio.get_running_loop()
        ans: Answer = await loop.run_in_executor(self._pool, fn, body, route)
        extra: Headers = [
            (b"x-tidal-session-id", ans.session_id.encode()),
            (b"x-tidal-call-id", ans.call_id.encode()),
            (b"x-tidal-engine-ms", b"%.4f" % (ans.engine_s * 1e3)),
            (b"x-tidal-gateway-ms", b"%.4f" % ((ans.total_s - ans.engine_s) * 1e3)),
        ]
        if body.get("stream") is not True:  # a boolean: the handler checked it
            await _send(send, 200, _json_bytes(ans.body), extra)
            return
        await send({
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", _SSE), *extra],
        })
        for chunk in streamer(ans, body):  # cheap: the answer is complete
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


async def _send(send: Any, status: int, body: bytes, extra: Headers = ()) -> None:
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-length", b"%d" % len(body)),
            (b"content-type", _JSON),
            *extra,
        ],
    })
    await send({"type": "http.response.body", "body": body})


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now (imported modules, the loaded
    model and tokenizer) to the collector's permanent generation (`gc.freeze`).

    Call it once, when start-up is done and before serving. A full pass of Python's
    cyclic collector otherwise walks all of torch's and transformers' objects and stalls
    every call in flight: ~40 ms, the p99 of `bench/gateway.py`'s 32 paced sessions
    (5-6 ms with the freeze). Frozen objects are never collected as cycles, so this is
    for a process that keeps what it loaded at start-up, as a gateway does."""
    gc.collect()
    gc.freeze()


def uvicorn_config(app: GatewayApp, host: str, port: int) -> Any:
    """uvicorn settings for the gateway: the C HTTP parser (`httptools`, ~0.1 ms less per
    request than h11) and uvloop's event loop (picked when installed), no access log,
    lifespan or proxy-header rewriting (it only listens on 127.0.0.1)."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="off",
        proxy_headers=False,
        timeout_keep_alive=30,
        http="httptools",
    )


class GatewayServer:
    """Runs a `Gateway` over HTTP on 127.0.0.1 in a background thread.

    `GatewayServer(engine, tokenizer, store, port=0).start()` returns the base URL
    (`http://127.0.0.1:PORT`); `.stop()` shuts it down. `.gateway` is the core object
    (its `policy_version` follows the engine's).
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        store: Any,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        **gateway_kwargs: Any,
    ) -> None:
        self.gateway = Gateway(engine, tokenizer, store, **gateway_kwargs)
        self.host = host
        self.port = port
        self._server: Any = None
        self._app: GatewayApp | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def session_url(self, session_id: str, *, parent_call: str | None = None) -> str:
        """The `base_url` to give an OpenAI client for one session."""
        extra = f"/parent/{parent_call}" if parent_call else ""
        return f"{self.base_url}/sessions/{session_id}{extra}/v1"

    def start(self, timeout: float = 30.0) -> str:
        import uvicorn

        self._app = GatewayApp(self.gateway)
        self._server = uvicorn.Server(uvicorn_config(self._app, self.host, self.port))
        self._thread = threading.Thread(target=self._server.run, name="tidal-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = int(self._server.servers[0].sockets[0].getsockname()[1])
        return self.base_url

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._app is not None:
            self._app.close()
        self._server = self._thread = self._app = None

    def __enter__(self) -> GatewayServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
