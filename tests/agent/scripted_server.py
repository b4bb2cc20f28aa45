"""A real OpenAI-compatible HTTP server on 127.0.0.1 that answers from a script.

A deterministic test peer for the harness: FastAPI + uvicorn in a thread, the same
routes the gateway serves (`/sessions/{sid}/v1/chat/completions`, and the subagent
form with `/parent/{pcid}/parent-session/{psid}`). Each request is recorded (path,
headers, body) and answered by the test's `responder(request) -> Reply`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


@dataclass(frozen=True)
class Seen:
    """One request as the server saw it."""

    session_id: str
    parent_session_id: str | None
    parent_call_id: str | None
    headers: dict[str, str]
    body: dict[str, Any]
    call_id: str

    @property
    def role(self) -> str:
        return self.headers.get("x-tidal-role", "")

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list(self.body["messages"])

    @property
    def tool_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.body.get("tools", [])]


@dataclass(frozen=True)
class Reply:
    content: str | None = None
    tool_calls: list[tuple[str, Any]] = field(default_factory=list)  # (name, args or raw str)
    prompt_tokens: int = 10
    completion_tokens: int = 5
    delay_s: float = 0.0
    status_code: int = 200


def tc(name: str, **arguments: Any) -> tuple[str, Any]:
    return (name, arguments)


Responder = Callable[[Seen, list[Seen]], Reply]


class ScriptedServer:
    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self.responder: Responder = lambda s, h: Reply(content="no script")
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        app = FastAPI()

        async def handle(
            request: Request, sid: str, psid: str | None = None, pcid: str | None = None
        ) -> JSONResponse:
            body = await request.json()
            with self._lock:
                seen = Seen(
                    session_id=sid,
                    parent_session_id=psid,
                    parent_call_id=pcid,
                    headers={k.lower(): v for k, v in request.headers.items()},
                    body=body,
                    call_id=f"call-{next(self._ids)}",
                )
                history = [s for s in self.seen if s.session_id == sid]
                self.seen.append(seen)
            reply = self.responder(seen, history)
            if reply.delay_s:
                await asyncio.sleep(reply.delay_s)
            if reply.status_code != 200:
                return JSONResponse(
                    {"error": {"message": "scripted failure", "type": "test"}},
                    status_code=reply.status_code,
                )
            return JSONResponse(completion(seen.call_id, body["model"], reply))

        @app.post("/sessions/{sid}/v1/chat/completions")
        async def main(request: Request, sid: str) -> JSONResponse:
            return await handle(request, sid)

        @app.post("/sessions/{sid}/parent/{pcid}/parent-session/{psid}/v1/chat/completions")
        async def sub(request: Request, sid: str, psid: str, pcid: str) -> JSONResponse:
            return await handle(request, sid, psid, pcid)

        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("scripted server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def reset(self, responder: Responder) -> None:
        with self._lock:
            self.seen = []
            self.responder = responder


def completion(call_id: str, model: str, reply: Reply) -> dict[str, Any]:
    tool_calls = [
        {
            "id": f"{call_id}-tc{i}",
            "type": "function",
            "function": {
                "name": name,
                "arguments": args if isinstance(args, str) else json.dumps(args),
            },
        }
        for i, (name, args) in enumerate(reply.tool_calls)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": f"chatcmpl-{call_id}",  # the gateway's id form
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if tool_calls else "stop",
            }
        ],
        "usage": {
            "prompt_tokens": reply.prompt_tokens,
            "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        },
    }
