"""A gateway killed with SIGKILL and restarted on the same store continues every session,
in all three APIs, with zero drift: `tidal serve` as a real process (a deterministic
policy engine), the official `openai` and `anthropic` clients, real HTTP, real SQLite.

The restarted process holds nothing in memory: it rebuilds each session's recorded turns
from the ledger on first use, and serves `previous_response_id` from the ledger too."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.gateway.policy_engines import TOOL_CALL
from tidal.gateway.verify import verify_store
from tidal.ledger.store import LedgerStore

ROOT = Path(__file__).resolve().parents[2]
CHAT_TOOLS = [{
    "type": "function",
    "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}},
}]
RESP_TOOLS = [{"type": "function", "name": "weather", "parameters": {"type": "object"}}]
MSG_TOOLS = [{"name": "weather", "input_schema": {"type": "object"}}]
ASK = "What is the weather in Bern?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Serve:
    """`tidal serve` in its own process on a fixed port and store."""

    def __init__(self, store: Path, port: int) -> None:
        self.store, self.port = store, port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tidal.cli", "serve", "--store", str(self.store),
             "--port", str(self.port), "--engine", "tests.gateway.policy_engines:weather_policy"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"tidal serve exited {self.proc.returncode}: {err[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("tidal serve did not start")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    s = Serve(tmp_path / "ledger.db", free_port())
    yield s
    s.stop()


def oai(s: Serve, sid: str, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.url}/sessions/{sid}{kw.get('extra', '')}/v1",
                         api_key="unused", max_retries=0, timeout=60)


def claude(s: Serve, sid: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"{s.url}/sessions/{sid}", api_key="unused",
                               max_retries=0, timeout=60)


def chat_turn(s: Serve, history: list[Any]) -> None:
    r = oai(s, "s-chat").chat.completions.create(model="tiny", messages=history, tools=CHAT_TOOLS)
    history.append(r.choices[0].message.model_dump(exclude_none=True, exclude={"refusal"}))
    for tc in r.choices[0].message.tool_calls or []:
        history.append({"role": "tool", "tool_call_id": tc.id, "content": "sunny"})


def responses_turn(s: Serve, history: list[Any]) -> Any:
    r = oai(s, "s-resp").responses.create(model="tiny", input=history, tools=RESP_TOOLS)
    history.extend(o.model_dump(exclude_none=True) for o in r.output)
    for o in r.output:
        if o.type == "function_call":
            history.append(
                {"type": "function_call_output", "call_id": o.call_id, "output": "sunny"}
            )
    return r


def messages_turn(s: Serve, history: list[Any]) -> None:
    m = claude(s, "s-msg").messages.create(model="tiny", max_tokens=100, messages=history,
                                           tools=MSG_TOOLS)
    history.append({"role": "assistant",
                    "content": [b.model_dump(exclude_none=True) for b in m.content]})
    uses = [b for b in m.content if b.type == "tool_use"]
    if uses:
        history.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": u.id, "content": "sunny"} for u in uses]})


def test_sigkill_and_restart_continue_every_session_without_drift(serve: Serve) -> None:
    serve.start()
    chat: list[Any] = [{"role": "user", "content": ASK}]
    resp: list[Any] = [{"role": "user", "content": ASK}]
    msgs: list[Any] = [{"role": "user", "content": ASK}]
    for _ in range(2):  # a tool call, then the answer after its result
        chat_turn(serve, chat)
        last = responses_turn(serve, resp)
        messages_turn(serve, msgs)
    assert chat[1]["tool_calls"] and msgs[1]["content"][0]["type"] == "tool_use"
    first = oai(serve, "s-chain").responses.create(model="tiny", input="Hello.", tools=RESP_TOOLS)
    parent_call = first.model_extra["tidal"]["call_id"]

    serve.kill()  # no shutdown: whatever was only in memory is gone
    serve.start()

    for history in (chat, resp, msgs):
        history.append({"role": "user", "content": "Thanks. Anything else?"})
    chat_turn(serve, chat)
    responses_turn(serve, resp)
    messages_turn(serve, msgs)
    # previous_response_id of responses made before the restart: served from the ledger
    r = oai(serve, "s-resp").responses.create(
        model="tiny", previous_response_id=last.id, input="And tomorrow?", tools=RESP_TOOLS
    )
    assert r.previous_response_id == last.id
    oai(serve, "s-chain").responses.create(
        model="tiny", previous_response_id=first.id, input="Again.", tools=RESP_TOOLS
    )
    # a subagent of a call recorded before the restart
    oai(serve, "s-sub", extra=f"/parent/{parent_call}").chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "help"}]
    )
    serve.stop()

    with LedgerStore(serve.store, readonly=True) as store:
        for sid, n_before in (("s-chat", 2), ("s-resp", 2), ("s-msg", 2), ("s-chain", 1)):
            log = store.call_log(sid)
            cs = [log.full_call(sc.call_id) for sc in log.calls]
            assert len(cs) > n_before
            expect = [prev.call_id for prev in cs[:-1]]
            if sid == "s-resp":  # the last call branches from `last` (previous_response_id)
                expect[-1] = "call-" + last.id.removeprefix("resp_")
            assert [c.metadata["tito"]["continues"] for c in cs[1:]] == expect, sid
            for c in cs:
                assert c.metadata["drift"] == [] and c.metadata["tito"]["foreign_turns"] == 0
            if sid != "s-chain":
                assert cs[0].output_text.startswith(TOOL_CALL)
        (sub,) = [store.call_log("s-sub").full_call(sc.call_id)
                  for sc in store.call_log("s-sub").calls]
        assert (sub.parent_call_id, sub.parent_session_id) == (parent_call, "s-chain")
        rep = verify_store(store)
    assert rep.ok and rep.drift == {} and rep.model_tokens == rep.model_tokens_verbatim
