"""HTTP layer: the OpenAI-compatible routes, SSE streaming, errors, and a thread runner.

Routes (all on 127.0.0.1):
- `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`;
- the same under `/sessions/{session_id}[/parent/{call_id}][/task/{task_id}][/role/{role}]/v1/`
  so the stock `openai` client picks a session by its `base_url` alone
  (`OpenAI(base_url=f"{gw}/sessions/{sid}/v1")`), and a subagent by
  `/sessions/{sid}/parent/{call_id}/v1`;
- headers do the same for `/v1/...`: `X-Tidal-Session`, `X-Tidal-Parent-Call`,
  `X-Tidal-Parent-Session` (only needed for a parent this gateway did not record),
  `X-Tidal-Task`, `X-Tidal-Role` (URL parts win over headers).

Responses carry `X-Tidal-Session-Id`, `X-Tidal-Call-Id` and `X-Tidal-Engine-Ms` (the engine
time of the call, which `bench/gateway.py` subtracts to get the gateway's added latency).
Errors are OpenAI-style: `{"error": {"message", "type", "param", "code"}}` with the status.

Streaming (`stream: true`) is produced after the call is generated and committed (the
engine protocol returns whole generations): without tool calls, one chunk per output
token, with its logprob when asked; with tool calls, the content in one chunk and one
chunk per tool call; then the finish chunk, the usage chunk (with
`stream_options.include_usage`) and `[DONE]`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import unquote

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route as HTTPRoute

from tidal.gateway.core import Answer, Gateway, Route
from tidal.gateway.messages import RequestError

HEADER_SESSION = "x-tidal-session"
HEADER_PARENT_CALL = "x-tidal-parent-call"
HEADER_PARENT_SESSION = "x-tidal-parent-session"
HEADER_TASK = "x-tidal-task"
HEADER_ROLE = "x-tidal-role"
_URL_PARTS = {
    "parent": "parent_call_id",
    "task": "task_id",
    "role": "role",
    "parent-session": "parent_session_id",
}


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def parse_session_path(rest: str) -> tuple[dict[str, str], str]:
    """`{sid}[/parent/{call}][/task/{t}][/role/{r}]/v1/{endpoint}` -> (fields, endpoint)."""
    parts = [unquote(p) for p in rest.split("/")]
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
                f"unknown session path part {k!r} (known: {', '.join(_URL_PARTS)})",
                code="not_found",
                status=404,
            )
        fields[_URL_PARTS[k]] = v
    return fields, endpoint


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
    )


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _pieces(content: str, token_texts: tuple[str, ...]) -> list[str]:
    """Content split per token when the token texts add up to it, else in ~16 pieces."""
    n = 0
    for k, t in enumerate(token_texts):
        n += len(t)
        if n == len(content) and "".join(token_texts[: k + 1]) == content:
            return list(token_texts[: k + 1])
    if not content:
        return []
    step = max(1, len(content) // 16)
    return [content[i : i + step] for i in range(0, len(content), step)]


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
        return _sse(
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
        pieces = _pieces(content, ans.token_texts)
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
        yield _sse({**base, "choices": [], "usage": b["usage"]})
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
    for t in ans.token_texts:
        yield _sse(
            {**base, "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": None}]}
        )
    yield _sse(
        {
            **base,
            "choices": [
                {"index": 0, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}
            ],
        }
    )
    if include_usage:
        yield _sse({**base, "choices": [], "usage": b["usage"]})
    yield b"data: [DONE]\n\n"


def _no_head(request: Request) -> None:
    # Starlette answers HEAD wherever GET is allowed; these routes never did
    if request.method == "HEAD":
        raise StarletteHTTPException(405)


def create_app(gateway: Gateway, *, max_concurrency: int = 256) -> Starlette:
    """The ASGI app serving `gateway`: plain Starlette routes (the request bodies are
    parsed and checked by `Gateway`, so FastAPI's validation layer had nothing to do but
    cost ~0.1-0.2 ms a request)."""
    limiter = anyio.CapacityLimiter(max_concurrency)

    def err(e: RequestError) -> JSONResponse:
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)

    async def _http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return JSONResponse(
            error_body(
                str(exc.detail),
                "invalid_request_error",
                None,
                "not_found" if exc.status_code == 404 else "http_error",
            ),
            status_code=exc.status_code,
        )

    async def serve(request: Request, endpoint: str, url_fields: Mapping[str, str]) -> Response:
        try:
            if endpoint == "models":
                return JSONResponse(gateway.models())
            if request.method != "POST":
                raise RequestError(
                    f"{request.method} is not allowed here; use POST",
                    code="method_not_allowed",
                    status=405,
                )
            if endpoint not in ("chat/completions", "completions"):
                raise RequestError(f"unknown endpoint /v1/{endpoint}", code="not_found", status=404)
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(
                    f"could not parse the request body as JSON: {e}", code="invalid_json"
                ) from e
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object", code="invalid_json")
            route = route_from(request.headers, url_fields)
            fn = gateway.chat if endpoint == "chat/completions" else gateway.completion
            ans: Answer = await anyio.to_thread.run_sync(fn, body, route, limiter=limiter)
        except RequestError as e:
            return err(e)
        except Exception as e:  # an engine or ledger fault: nothing was answered
            return JSONResponse(
                error_body(
                    f"internal error: {type(e).__name__}: {e}",
                    "server_error",
                    None,
                    "internal_error",
                ),
                status_code=500,
            )
        headers = {
            "X-Tidal-Session-Id": ans.session_id,
            "X-Tidal-Call-Id": ans.call_id,
            "X-Tidal-Engine-Ms": f"{ans.engine_s * 1e3:.4f}",
            "X-Tidal-Gateway-Ms": f"{(ans.total_s - ans.engine_s) * 1e3:.4f}",
        }
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
            gen = chat_stream if endpoint == "chat/completions" else completion_stream
            return StreamingResponse(
                gen(ans, usage), media_type="text/event-stream", headers=headers
            )
        return Response(
            json.dumps(ans.body, ensure_ascii=False), media_type="application/json", headers=headers
        )

    async def v1(request: Request) -> Response:
        _no_head(request)
        return await serve(request, request.path_params["endpoint"], {})

    async def sessions(request: Request) -> Response:
        _no_head(request)
        try:
            fields, endpoint = parse_session_path(request.path_params["rest"])
        except RequestError as e:
            return err(e)
        return await serve(request, endpoint, fields)

    async def health(request: Request) -> Response:
        _no_head(request)
        return JSONResponse(
            {
                "ok": True,
                "model": gateway.engine.model_name,
                "policy_version": gateway.policy_version,
            }
        )

    return Starlette(
        routes=[
            HTTPRoute("/v1/{endpoint:path}", v1, methods=["GET", "POST"]),
            HTTPRoute("/sessions/{rest:path}", sessions, methods=["GET", "POST"]),
            HTTPRoute("/health", health, methods=["GET"]),
        ],
        exception_handlers={StarletteHTTPException: _http_error},
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

        config = uvicorn.Config(
            create_app(self.gateway),
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=30,
            http="httptools",  # C parser: ~0.1 ms less per request than h11
        )
        self._server = uvicorn.Server(config)
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
        self._server = self._thread = None

    def __enter__(self) -> GatewayServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
