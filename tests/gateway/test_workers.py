"""`tidal serve --workers N`: real processes, real HTTP on loopback, the stock `openai`
client. A router in front of two worker processes (scripted engine, one ledger store)
must keep each session on one worker, relay streams and keep-alive connections, answer
503 for a killed worker's sessions until it is restarted, and refuse `--workers 0`."""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.worker_engines import REPLY, SLOW, SLOW_S
from tidal.gateway.verify import verify_store
from tidal.gateway.workers import worker_for
from tidal.ledger.store import LedgerStore

ROOT = Path(__file__).resolve().parents[2]
ENGINE = "tests.gateway.worker_engines:scripted"


def tidal_serve(*args: str) -> subprocess.Popen[str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.Popen(
        [sys.executable, "-m", "tidal.cli", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


@dataclass
class Served:
    proc: subprocess.Popen[str]
    base: str
    store: Path
    stderr: list[str]

    def client(self, sid: str | None = None) -> openai.OpenAI:
        url = f"{self.base}/sessions/{sid}/v1" if sid else f"{self.base}/v1"
        return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)

    def health(self) -> httpx.Response:
        return httpx.get(self.base + "/health", timeout=30)


def start(tmp: Path, workers: int) -> Served:
    store = tmp / "ledger.db"
    proc = tidal_serve(
        "--port", "0", "--store", str(store), "--engine", ENGINE, "--workers", str(workers)
    )
    lines: queue.Queue[str] = queue.Queue()
    stderr: list[str] = []
    assert proc.stdout is not None and proc.stderr is not None
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
    try:
        line = lines.get(timeout=60)
    except queue.Empty:
        proc.kill()
        raise AssertionError(f"tidal serve did not announce itself: {''.join(stderr)}") from None
    base = line.split()[2].removesuffix("/v1")
    if not (base.startswith("http://127.0.0.1:") and f"{workers} workers" in line):
        proc.kill()
        raise AssertionError(f"unexpected announcement: {line!r}")
    return Served(proc, base, store, stderr)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = start(tmp_path_factory.mktemp("workers"), 2)
    try:
        pids = [w["pid"] for w in s.health().json()["worker_status"]]
        yield s
        pids += [w["pid"] for w in s.health().json()["worker_status"]]
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=30) == 0, "".join(s.stderr)
        for pid in pids:  # the router stopped its workers
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if s.proc.poll() is None:  # a failure above: do not leave it serving
            s.proc.kill()
            s.proc.wait(timeout=30)


def sids_on(worker: int, n: int, prefix: str) -> list[str]:
    out = [f"{prefix}{k}" for k in range(200) if worker_for(f"{prefix}{k}", 2) == worker]
    return out[:n]


def chat_turns(served: Served, sid: str, n: int) -> list[str]:
    """`n` calls of one growing chat; returns the `x-tidal-worker` of each answer."""
    client = served.client(sid)
    msgs: list[Any] = [{"role": "system", "content": "You are terse."}]
    workers = []
    for i in range(n):
        msgs.append({"role": "user", "content": f"step {i}"})
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=msgs)
        workers.append(raw.headers["x-tidal-worker"])
        msg = raw.parse().choices[0].message
        assert msg.content == REPLY
        msgs.append({"role": "assistant", "content": msg.content})
    return workers


def test_health_lists_workers(served: Served) -> None:
    h = served.health()
    assert h.status_code == 200
    body = h.json()
    assert body["ok"] is True and body["workers"] == 2 and body["model"] == "tiny"
    assert [w["index"] for w in body["worker_status"]] == [0, 1]
    assert all(w["up"] and w["health"]["ok"] for w in body["worker_status"])
    assert len({w["pid"] for w in body["worker_status"]}) == 2


def test_sessions_stick_to_one_worker(served: Served) -> None:
    sids = sids_on(0, 3, "stick-") + sids_on(1, 3, "stick-")
    results: dict[str, list[str]] = {}
    threads = [
        threading.Thread(target=lambda s=s: results.__setitem__(s, chat_turns(served, s, 4)))
        for s in sids
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert set(results) == set(sids)
    for sid, workers in results.items():
        assert workers == [str(worker_for(sid, 2))] * 4, sid
    with LedgerStore(served.store, readonly=True) as store:
        for sid in sids:  # one process kept each session's turns: every call continues
            calls = store.call_log(sid).calls
            assert len(calls) == 4
            conts = [c.call.metadata["tito"]["continues"] for c in calls]
            assert conts == [None, *(c.call_id for c in calls[:-1])], sid
        report = verify_store(store)
        assert report.ok, report.to_dict()["problems"]


def test_stream_through_router(served: Served) -> None:
    sid = sids_on(1, 1, "stream-")[0]
    client = served.client(sid)
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "tell me"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY
    assert len(chunks) > 5  # one chunk per token, relayed, not one blob
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [f for f in finish if f] == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    with httpx.stream(
        "POST",
        f"{served.base}/sessions/{sid}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "again"}], "stream": True},
        timeout=30,
    ) as r:
        assert r.headers["transfer-encoding"] == "chunked"
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-tidal-worker"] == "1"
        events = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]"


def test_keep_alive_routes_each_request(served: Served) -> None:
    a, b = sids_on(0, 1, "ka-")[0], sids_on(1, 1, "ka-")[0]
    host, port = served.base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    heads = {"content-type": "application/json"}
    seen = []
    sock = None
    try:
        for sid, path, extra in [
            (a, f"/sessions/{a}/v1/chat/completions", {}),
            (b, f"/sessions/{b}/v1/chat/completions", {}),
            (b, "/v1/chat/completions", {"X-Tidal-Session": b}),  # the header form
            (a, "/v1/chat/completions", {"X-Tidal-Session": a}),
            (None, "/v1/chat/completions", {}),  # no session: worker 0 (automatic)
            (None, "/v1/models", {}),
            (b, f"/sessions/{b}/v1/chat/completions", {}),
        ]:
            method = "GET" if path.endswith("models") else "POST"
            conn.request(method, path, body=None if method == "GET" else body,
                         headers={**heads, **extra})
            r = conn.getresponse()
            payload = r.read()
            assert r.status == 200, payload
            if sock is None:
                sock = conn.sock
            assert conn.sock is sock  # one connection throughout
            seen.append(r.getheader("x-tidal-worker"))
            if sid is not None:
                assert r.getheader("x-tidal-session-id") == sid
    finally:
        conn.close()
    assert seen == ["0", "1", "1", "0", "0", "0", "1"]


def read_response(f: Any) -> tuple[int, dict[str, str], bytes]:
    """One Content-Length response from a buffered socket file."""
    status = int(f.readline().split()[1])
    headers = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        k, v = line.decode().split(":", 1)
        headers[k.strip().lower()] = v.strip()
    return status, headers, f.read(int(headers.get("content-length", 0)))


def test_raw_http_pipelining_chunked_bodies_expect_and_garbage(served: Served) -> None:
    a, b = sids_on(0, 1, "raw-")[0], sids_on(1, 1, "raw-")[0]
    host, port = served.base.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode()

    def post(sid: str, extra: bytes = b"", payload: bytes | None = None) -> bytes:
        data = body if payload is None else payload
        framing = b"" if payload is not None else b"content-length: %d\r\n" % len(data)
        return (
            f"POST /sessions/{sid}/v1/chat/completions HTTP/1.1\r\nhost: x\r\n".encode()
            + b"content-type: application/json\r\n" + framing + extra + b"\r\n" + data
        )

    chunked = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (10, body[:10], len(body) - 10, body[10:])
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        f = sock.makefile("rb")
        # two requests in one write (pipelined, different workers), answered in order
        sock.sendall(post(a) + post(b) + post(b, b"transfer-encoding: chunked\r\n", chunked))
        answers = [read_response(f) for _ in range(3)]
        assert [(st, h["x-tidal-worker"], h["x-tidal-session-id"]) for st, h, _ in answers] == [
            (200, "0", a), (200, "1", b), (200, "1", b)
        ]
        # Expect: 100-continue is answered by the router before the body is sent
        head = post(a, b"expect: 100-continue\r\n")[: -len(body)]
        sock.sendall(head)
        assert f.readline() == b"HTTP/1.1 100 Continue\r\n" and f.readline() == b"\r\n"
        sock.sendall(body)
        status, headers, payload = read_response(f)
        assert status == 200 and headers["x-tidal-worker"] == "0"
        assert json.loads(payload)["choices"][0]["message"]["content"] == REPLY
        # a request that is not HTTP gets a 400 in OpenAI's shape, and the connection closes
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, headers, payload = read_response(f)
        assert status == 400 and json.loads(payload)["error"]["code"] == "bad_request"
        assert f.read() == b""


def test_subagent_on_another_worker_finds_its_parent(served: Served) -> None:
    parent, sub = sids_on(0, 1, "parent-")[0], sids_on(1, 1, "sub-")[0]
    raw = served.client(parent).chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "spawn a helper"}]
    )
    call_id = raw.headers["x-tidal-call-id"]
    sub_client = openai.OpenAI(
        base_url=f"{served.base}/sessions/{sub}/parent/{call_id}/v1",
        api_key="unused",
        max_retries=0,
    )
    raw = sub_client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "help"}]
    )
    assert raw.headers["x-tidal-worker"] == "1"
    with LedgerStore(served.store, readonly=True) as store:
        info = {s.session_id: s for s in store.sessions()}[sub]
    assert (info.parent_session_id, info.parent_call_id) == (parent, call_id)


def assert_unavailable(r: httpx.Response, worker: int) -> None:
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "worker_unavailable" and f"worker {worker} of 2" in err["message"]
    assert r.headers["x-tidal-worker"] == str(worker)


def test_killed_worker_is_answered_503_then_restarted(served: Served) -> None:
    """Runs last in this module: it kills worker 1 and waits for its replacement."""
    on0, on1 = sids_on(0, 1, "kill-")[0], sids_on(1, 1, "kill-")[0]
    chat_turns(served, on1, 1)
    dead = served.health().json()["worker_status"][1]["pid"]
    in_flight: list[httpx.Response] = []
    slow = {"model": "tiny", "messages": [{"role": "user", "content": f"{SLOW}, please"}]}
    t = threading.Thread(target=lambda: in_flight.append(httpx.post(
        f"{served.base}/sessions/{on1}/v1/chat/completions", json=slow, timeout=30
    )))
    t.start()
    time.sleep(SLOW_S / 3)  # the call is in the engine now
    os.kill(dead, signal.SIGKILL)
    t.join(timeout=30)
    assert_unavailable(in_flight[0], 1)  # nothing of it had been relayed: a clean 503
    body = {"model": "tiny", "messages": [{"role": "user", "content": "still there?"}]}
    statuses = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = httpx.post(f"{served.base}/sessions/{on1}/v1/chat/completions", json=body, timeout=30)
        statuses.append(r.status_code)
        if r.status_code == 200:
            break
        assert_unavailable(r, 1)
        m = httpx.post(f"{served.base}/sessions/{on1}/v1/messages", timeout=30, json={
            "model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "?"}]})
        if m.status_code == 503:  # in Anthropic's shape on its route
            assert m.json()["type"] == "error", m.text
            assert m.json()["error"]["type"] == "overloaded_error"
        # the other worker's sessions go on meanwhile
        assert chat_turns(served, on0, 1) == ["0"]
        time.sleep(0.2)
    assert statuses[-1] == 200, statuses
    assert 503 in statuses  # the restart takes seconds: the kill was seen
    h = served.health().json()
    w1 = h["worker_status"][1]
    assert h["ok"] and w1["up"] and w1["restarts"] == 1 and w1["pid"] != dead
    assert chat_turns(served, on1, 2) == ["1", "1"]
    assert any("worker 1" in ln and "restarting" in ln for ln in served.stderr)


def error_text(p: subprocess.Popen[str]) -> str:
    """The usage error's text, the rich box around it taken off."""
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2, err
    return " ".join(err.replace("│", " ").split())


def test_workers_zero_is_refused() -> None:
    err = error_text(tidal_serve("--workers", "0", "--engine", ENGINE))
    assert "Invalid value for '--workers'" in err and "greater than or equal to 1" in err


@pytest.mark.parametrize(
    ("engine", "says"),
    [
        ("tests.gateway.no_such_module:scripted", "cannot import"),
        ("tests.gateway.worker_engines:missing", "no attribute 'missing'"),
        ("tests.gateway.worker_engines:not_callable", "is not callable (int)"),
        ("magic", "expected 'embedded', 'vllm' or 'module:attr'"),
    ],
)
def test_bad_engine_factory_is_refused(engine: str, says: str) -> None:
    err = error_text(tidal_serve("--engine", engine, "--workers", "2", "--port", "0"))
    assert "Invalid value for --engine" in err and says in err, err


def test_one_worker_is_todays_single_process(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = tidal_serve("--port", str(port), "--store", str(tmp_path / "l.db"), "--engine", ENGINE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "tidal serve died"
            try:
                h = httpx.get(base + "/health", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert h.json() == {"ok": True, "model": "tiny", "policy_version": 0}  # no router
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        if children.exists():
            assert children.read_text().split() == []
        r = httpx.post(
            f"{base}/sessions/one/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert r.status_code == 200 and "x-tidal-worker" not in r.headers
        assert r.json()["choices"][0]["message"]["content"] == REPLY
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
