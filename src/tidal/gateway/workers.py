"""Gateway processes for `tidal serve`: one, or N workers behind a sticky front router.

Why: one gateway process runs one call's CPU work at a time (the GIL), so where its
~500-1,000 calls a second (instant engine) are not enough, `tidal serve --workers N` runs
N gateway processes on one ledger store (SQLite in WAL mode takes several writers). A
session must stay on one process: token-in-token-out keeps its recorded turns and kept
assemblies in that process's memory, and an embedded engine's prefix cache lives there
too. So a front router on `--port` forwards each request to the worker its session id
hashes to (`worker_for`: `zlib.crc32(id) % N`), and each worker is the same gateway
`tidal serve --workers 1` runs (`build_gateway` + `run_gateway`, the one way to build
and serve one), listening on its own loopback port.

The router is a raw asyncio proxy: `asyncio.Protocol` callbacks on uvloop's event loop
(when installed), httptools parsing both directions, no HTTP framework and no task or
future per request on a pooled connection. It routes per request (one keep-alive client
connection may carry many sessions), reads each request body whole and forwards it with
a Content-Length, and relays the worker's response bytes unchanged over a pool of
keep-alive connections per worker: a chunked response (SSE) as each read arrives, any
other once complete (one write instead of uvicorn's two; a loopback write costs more
than the copy). Protocol callbacks rather than asyncio streams: ~25-40% less router CPU
per request, measured.

What it simplifies:
- Placement is a fixed hash of the session id, not load-aware or consistent hashing:
  N is fixed for the life of the router, and a busy session cannot move. A request
  without a session id (`/v1/...` without `X-Tidal-Session`) goes to worker 0, where
  automatic sessions (found by their content) live; `/v1/models` too.
- A subagent session may hash to another worker than its parent: that worker finds the
  parent call in the ledger (`LedgerStore.session_of_call`), not in its memory.
- `GET /health` is answered by the router: each worker's own `/health` plus its index,
  pid, port and restart count; 200 when every worker is up, else 503.
- A worker that dies is restarted at once, then after 1, 2, 4 ... up to 30 s while it
  keeps dying within a minute of its start or failing to start. Meanwhile its requests get
  a 503 OpenAI-style error naming it; a request in flight when it died gets the same
  503 if nothing of the answer was relayed yet, else the client connection is closed.
  The restarted worker starts with no in-memory session state (rebuilding that from the
  ledger is the gateway's business).
- HTTP/1.1 only, loopback only, no TLS, no upgrades; requests are answered in order
  (a pipelined request waits for the one before it); hop-by-hop headers are dropped;
  no request size limit (the workers' uvicorn has none either).
- Every response from a worker carries `x-tidal-worker: <index>`.

Both ways, `tidal serve` checks every option (`GatewaySpec.check`: the store, the device,
the numbers, the model) and binds its port (`listen`) before it loads a model, creates the
store or starts a worker, and prints its URL (with the port really bound: `--port 0`
takes any free one) only once it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import math
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, cast
from urllib.parse import unquote

import httptools

from tidal.engine.base import Engine
from tidal.gateway import anthropic
from tidal.gateway.core import Gateway
from tidal.gateway.messages import RequestError
from tidal.gateway.server import GatewayApp, error_body

WORKER_HEADER = b"x-tidal-worker"
EngineFactory = Callable[[Path, Any], Engine]
"""`--engine module:attr`: `factory(model_dir, tokenizer) -> Engine`."""

_START_TIMEOUT_S = 600.0  # an embedded engine may load a large checkpoint
_POOL_IDLE_S = 20.0  # under the workers' uvicorn keep-alive timeout (30 s)
_READ = 65536
_HOLD = 1 << 20  # bytes of a Content-Length response held before relaying them
_MAX_QUEUED = 32  # pipelined requests read ahead of the one being answered


class SpecError(ValueError):
    """A `tidal serve` option that cannot work; `param` names it (e.g. `--engine`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def load_engine_factory(ref: str) -> EngineFactory:
    """Resolve `module:attr` (attr may be dotted) to a callable, or raise SpecError."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise SpecError(
            f"unknown engine {ref!r}: expected 'embedded', 'vllm' or 'module:attr'", "--engine"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise SpecError(f"cannot import {module_name!r} for engine {ref!r}: {e}", "--engine") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SpecError(
                f"{module_name!r} has no attribute {attr!r} (engine {ref!r})", "--engine"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise SpecError(
            f"engine {ref!r} is not callable ({type(obj).__name__}); it must be a "
            "factory(model_dir, tokenizer) -> Engine",
            "--engine",
        )
    return obj


@dataclass(frozen=True)
class GatewaySpec:
    """What a process needs to build the gateway `tidal serve` runs (picklable: a worker
    process receives it)."""

    model: str = "tiny"
    store: Path = Path("tidal-ledger.db")
    engine: str = "embedded"  # embedded | vllm | module:attr
    engine_url: str | None = None
    served_name: str | None = None
    device: str = "cpu"
    max_tokens: int = 256
    prefix_cache_mb: float = 256.0
    tool_parser: str | None = None  # names or module:attr; None: the template's
    tool_parser_strict: bool = False

    def check(self) -> Path:
        """The model directory, once every option is known to be usable (SpecError if not).
        The cheap checks come first; nothing is created or loaded."""
        from tidal.engine.tiny import resolve_model

        if self.max_tokens < 1:
            raise SpecError(f"must be at least 1, got {self.max_tokens}", "--max-tokens")
        if not (math.isfinite(self.prefix_cache_mb) and self.prefix_cache_mb >= 0):
            raise SpecError(f"must be a finite number of MiB >= 0 (0: off), got "
                            f"{self.prefix_cache_mb}", "--prefix-cache-mb")
        check_store(self.store)
        if self.engine == "embedded":
            check_device(self.device)
        try:
            model_dir = resolve_model(self.model)
        except Exception as e:
            raise SpecError(str(e), "--model") from e
        if self.engine == "vllm" and not self.engine_url:
            raise SpecError("--engine vllm needs --engine-url", "--engine-url")
        if self.engine not in ("embedded", "vllm"):
            load_engine_factory(self.engine)
        if self.tool_parser is not None:
            from tidal.gateway.toolcalls import resolve_parsers

            try:
                resolve_parsers(self.tool_parser)
            except ValueError as e:
                raise SpecError(str(e), "--tool-parser") from e
        return model_dir


def check_store(path: Path) -> None:
    """`--store` is a tidal ledger store this process can write, or a new one it can
    create (SpecError if not); an existing store is only opened read-only here."""
    from tidal.ledger.store import LedgerStore
    from tidal.ledger.types import LedgerError

    try:
        if path.is_dir():
            raise SpecError(f"{path} is a directory, not a ledger store", "--store")
        if not path.exists():
            base = next(p for p in path.parents if p.exists())
            if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
                raise SpecError(f"cannot create {path}: {base} is not a writable directory",
                                "--store")
            return
        if not os.access(path, os.R_OK | os.W_OK) or not os.access(path.parent, os.W_OK):
            raise SpecError(f"{path} is not writable (the gateway records into it)", "--store")
        if path.stat().st_size == 0:
            return  # an empty file: SQLite's empty database
    except OSError as e:
        raise SpecError(f"{path}: {e.strerror}", "--store") from None
    try:
        LedgerStore(path, readonly=True).close()
    except LedgerError as e:
        raise SpecError(str(e), "--store") from None


def check_device(device: str) -> None:
    """`--device` names a device torch has here: cpu, cuda, cuda:N or mps (SpecError)."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise SpecError(f"{device!r} is not a device: expected cpu, cuda, cuda:N or mps",
                        "--device") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SpecError(f"{device!r}: CUDA is not available here (torch "
                            f"{torch.__version__}); use --device cpu", "--device")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise SpecError(f"{device!r}: there are {torch.cuda.device_count()} CUDA devices",
                            "--device")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise SpecError(f"{device!r}: MPS is not available here; use --device cpu",
                            "--device")
    elif dev.type != "cpu":
        raise SpecError(f"{device!r}: expected cpu, cuda, cuda:N or mps", "--device")


def listen(port: int) -> socket.socket:
    """A socket listening on 127.0.0.1:`port` (0: any free port), or SpecError: bound
    before anything is loaded, so a port in use fails at once."""
    if not 0 <= port <= 65535:
        raise SpecError(f"{port} is not a TCP port: expected 1..65535, or 0 for any free "
                        "port", "--port")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise SpecError(f"cannot listen on 127.0.0.1:{port}: {e.strerror}", "--port") from None
    return sock


def build_gateway(spec: GatewaySpec) -> Gateway:
    """The engine, tokenizer, ledger store and `Gateway` of one gateway process."""
    from tidal.engine.tiny import load_tokenizer
    from tidal.ledger.store import LedgerStore

    model_dir = spec.check()
    tokenizer = load_tokenizer(model_dir)
    eng: Engine
    if spec.engine == "embedded":
        from tidal.engine.embedded import EmbeddedEngine

        eng = EmbeddedEngine(spec.model, device=spec.device, prefix_cache_mb=spec.prefix_cache_mb)
    elif spec.engine == "vllm":
        from tidal.engine.vllm import VLLMEngine

        eng = VLLMEngine(spec.engine_url or "", spec.served_name or spec.model)
    else:
        eng = load_engine_factory(spec.engine)(model_dir, tokenizer)
        if not isinstance(eng, Engine):
            raise SpecError(
                f"engine factory {spec.engine!r} returned a {type(eng).__name__}, not an Engine",
                "--engine",
            )
    aliases = (spec.model,) if spec.model != eng.model_name else ()
    return Gateway(
        eng,
        tokenizer,
        LedgerStore(spec.store),
        model_aliases=aliases,
        default_max_tokens=spec.max_tokens,
        tool_parsers=spec.tool_parser,
        lenient_tool_parsing=not spec.tool_parser_strict,
    )


class _WorkerApp(GatewayApp):
    """`GatewayApp` that tags every response with `x-tidal-worker: <index>`."""

    def __init__(self, gateway: Gateway, index: int) -> None:
        super().__init__(gateway)
        self._tag = (WORKER_HEADER, b"%d" % index)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        tag = self._tag

        async def tagged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), tag]}
            await send(message)

        await super().__call__(scope, receive, tagged)


def run_gateway(
    gateway: Gateway,
    *,
    port: int = 0,
    sockets: Sequence[socket.socket] = (),
    worker: int | None = None,
) -> None:
    """Serve `gateway` under uvicorn on 127.0.0.1:`port`, or on the listening `sockets`,
    until SIGINT/SIGTERM; `worker` tags the responses. Freezes the start-up heap first."""
    import uvicorn

    from tidal.gateway.server import freeze_startup_heap, uvicorn_config

    app = GatewayApp(gateway) if worker is None else _WorkerApp(gateway, worker)
    freeze_startup_heap()
    try:
        uvicorn.Server(uvicorn_config(app, "127.0.0.1", port)).run(
            sockets=list(sockets) or None
        )
    finally:
        app.close()


def worker_for(session_id: str | None, n_workers: int) -> int:
    """The worker a session sticks to: `crc32(utf-8 id) % n`; no session: worker 0."""
    if not session_id or n_workers <= 1:
        return 0
    return zlib.crc32(session_id.encode("utf-8", "surrogatepass")) % n_workers


# ------------------------------------------------------------------ worker process
def _exit_with_parent(conn: Connection) -> None:
    """Block on the pipe from the router; when it closes (the router died, even by
    SIGKILL, also while this worker is still starting) or says anything, stop this
    worker the way SIGTERM does."""
    with contextlib.suppress(EOFError, OSError):
        conn.recv()
    os.kill(os.getpid(), signal.SIGTERM)


def _worker_main(spec: GatewaySpec, index: int, conn: Connection) -> None:
    """A worker process (started with "spawn"): listen on a loopback port, build the
    gateway, report the port, serve."""
    os.setpgrp()  # a terminal's Ctrl-C reaches the router only; it stops its workers
    threading.Thread(target=_exit_with_parent, args=(conn,), daemon=True).start()
    try:
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind(("127.0.0.1", 0))
        tcp.listen(2048)
        gateway = build_gateway(spec)
    except BaseException as e:
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(e).__name__}: {e}"))
        raise
    conn.send(("ready", int(tcp.getsockname()[1])))
    run_gateway(gateway, sockets=[tcp], worker=index)


def _recv(conn: Connection) -> Any:
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


# ------------------------------------------------------------------ HTTP plumbing
_HOP_BY_HOP = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"te",
        b"trailer", b"upgrade", b"expect", b"content-length",
    }
)
_REASONS = {400: b"Bad Request", 503: b"Service Unavailable", 200: b"OK"}


def _json_response(
    status: int, obj: Any, *, close: bool = False, extra: tuple[bytes, ...] = ()
) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    head = [
        b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Error")),
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(body),
        *extra,
        b"connection: close\r\n" if close else b"",
        b"\r\n",
    ]
    return b"".join(head) + body


def _session_path(url: bytes) -> str | None:
    """The session id of a `/sessions/{id}/...` URL, decoded as the gateway decodes it
    (uvicorn unquotes the path, then `parse_session_path` each of its parts)."""
    if not url.startswith(b"/sessions/"):
        return None
    path = unquote(url.split(b"?", 1)[0].decode("latin-1"))
    return unquote(path[len("/sessions/") :].split("/", 1)[0]) or None


class _Request:
    __slots__ = (
        "body",
        "data",
        "headers",
        "is_health",
        "keep_alive",
        "method",
        "session_id",
        "url",
    )

    def __init__(self) -> None:
        self.url = b""
        self.method = b""
        self.headers: list[bytes] = []  # forwarded header lines
        self.body: list[bytes] = []
        self.data = b""  # the request as forwarded to a worker
        self.keep_alive = True
        self.is_health = False
        self.session_id: str | None = None  # from the header, unless the URL names one


class _ResponseReader:
    """httptools callbacks for a worker's response: its status, framing and end."""

    __slots__ = ("chunked", "done", "headers_done", "keep_alive", "parser", "status")

    def __init__(self) -> None:
        self.done = self.headers_done = self.keep_alive = self.chunked = False
        self.status = 0
        self.parser: Any = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"transfer-encoding":
            self.chunked = b"chunked" in value.lower()

    def on_headers_complete(self) -> None:
        self.headers_done = True
        # read here: once `feed_data` returns, the parser has moved on to the next message
        self.keep_alive = bool(self.parser.should_keep_alive())
        self.status = int(self.parser.get_status_code())

    def on_message_complete(self) -> None:
        self.done = True


class _CollectingResponse(_ResponseReader):
    __slots__ = ("body",)

    def __init__(self) -> None:
        super().__init__()
        self.body: list[bytes] = []

    def on_body(self, body: bytes) -> None:
        self.body.append(bytes(body))


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Client(asyncio.Protocol):
    """One client connection: parses its requests (this object is the httptools
    callback target) and has the router answer them one at a time, in order."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.transport: asyncio.Transport | None = None
        self.parser: Any = httptools.HttpRequestParser(self)
        self.req = _Request()
        self.queue: deque[_Request] = deque()
        self.current: _Request | None = None  # being answered
        self.upstream: _Upstream | None = None  # relaying the current answer
        self.closed = False
        self.paused = False  # its transport's buffer is full: upstreams pause reading
        self.reading = True  # False while too many pipelined requests wait

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        _nodelay(transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.fail("upgrades are not supported")
            return
        except httptools.HttpParserError as e:
            self.fail(f"malformed HTTP request: {e}")
            return
        if len(self.queue) > _MAX_QUEUED and self.transport is not None:
            self.transport.pause_reading()  # a client pipelining far ahead waits
            self.reading = False
        self.next()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.queue.clear()
        up, self.upstream = self.upstream, None
        if up is not None:
            up.abandon()

    def pause_writing(self) -> None:
        self.paused = True
        if self.upstream is not None:
            self.upstream.pause_reading(True)

    def resume_writing(self) -> None:
        self.paused = False
        if self.upstream is not None:
            self.upstream.pause_reading(False)

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.req = _Request()

    def on_url(self, url: bytes) -> None:
        self.req.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        req, low = self.req, name.lower()
        if low in _HOP_BY_HOP:
            if low == b"expect" and value.lower() == b"100-continue" and self.transport:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            return
        if low == b"x-tidal-session" and req.session_id is None:  # the first one counts
            req.session_id = value.decode("latin-1")
        req.headers.append(name + b": " + value + b"\r\n")

    def on_headers_complete(self) -> None:
        req = self.req
        req.method = self.parser.get_method()
        sid = _session_path(req.url)
        if sid is not None:
            req.session_id = sid
        req.is_health = req.method == b"GET" and req.url.split(b"?", 1)[0] == b"/health"

    def on_body(self, body: bytes) -> None:
        self.req.body.append(bytes(body))

    def on_message_complete(self) -> None:
        req = self.req
        req.keep_alive = bool(self.parser.should_keep_alive())  # not once feed_data returns
        self.queue.append(req)

    # answering
    def next(self) -> None:
        """Dispatch the next queued request unless one is being answered."""
        while self.current is None and self.queue and not self.closed:
            self.current = self.queue.popleft()
            self.router.dispatch(self, self.current)
        if not self.reading and len(self.queue) <= _MAX_QUEUED // 2 and self.transport:
            self.transport.resume_reading()
            self.reading = True

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def answered(self, data: bytes, keep_alive: bool) -> None:
        """Write the rest of the current request's answer; then the next, or close."""
        self.write(data)
        self.current = None
        if not keep_alive:
            self.close()
        else:
            self.next()

    def fail(self, message: str) -> None:
        self.write(
            _json_response(
                400, error_body(message, "invalid_request_error", None, "bad_request"), close=True
            )
        )
        self.close()

    def close(self) -> None:
        self.closed = True
        self.queue.clear()
        if self.transport is not None:
            self.transport.close()  # after what is buffered has been sent


class _Upstream(asyncio.Protocol):
    """One keep-alive connection to a worker, relaying one response at a time to a
    `_Client`. A chunked response (an SSE stream) is relayed as each read arrives; any
    other is written once complete (uvicorn sends its head and body apart, and each
    loopback write costs more than the copy), or every `_HOLD` bytes."""

    def __init__(self, router: Router, worker: _Worker) -> None:
        self.router = router
        self.worker = worker
        self.transport: asyncio.Transport | None = None
        self.client: _Client | None = None
        self.req: _Request | None = None
        self.resp: _ResponseReader | None = None
        self.held: list[bytes] = []
        self.held_n = 0
        self.relayed = False  # part of the current answer went to the client
        self.reused = False  # the current request came on a pooled connection
        self.idle_since = 0.0
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        _nodelay(transport)

    def send(self, client: _Client, req: _Request, *, reused: bool) -> None:
        self.client, self.req, self.resp = client, req, _ResponseReader()
        self.held, self.held_n, self.relayed, self.reused = [], 0, False, reused
        client.upstream = self
        assert self.transport is not None
        if client.paused:
            self.transport.pause_reading()
        self.transport.write(req.data)

    def data_received(self, data: bytes) -> None:
        client, resp, req = self.client, self.resp, self.req
        if client is None or resp is None or req is None:
            self.abandon()  # nothing was asked
            return
        try:
            resp.parser.feed_data(data)
        except httptools.HttpParserError:
            self.abandon(lost=True)
            return
        self.held.append(data)
        self.held_n += len(data)
        if resp.done or (req.method == b"HEAD" and resp.headers_done):
            held = self.held
            self.client = self.req = self.resp = None
            self.held, self.held_n = [], 0
            client.upstream = None
            self.router.finished(self, client, req, resp, b"".join(held))
        elif resp.chunked or self.held_n >= _HOLD:
            client.write(b"".join(self.held))
            self.held, self.held_n, self.relayed = [], 0, True

    def connection_lost(self, exc: Exception | None) -> None:
        self.abandon(lost=True)

    def abandon(self, *, lost: bool = False) -> None:
        """Close this connection; a request in flight on it is failed (when `lost`: the
        worker went away) or dropped (the client went away)."""
        if self.lost:
            return
        self.lost = True
        with contextlib.suppress(ValueError):
            self.worker.pool.remove(self)
        if self.transport is not None:
            self.transport.close()
        client, req = self.client, self.req
        self.client = self.req = self.resp = None
        if client is not None and req is not None:
            client.upstream = None
            if lost:
                self.router.failed(self, client, req)

    def pause_reading(self, pause: bool) -> None:
        if self.transport is not None and not self.lost:
            if pause:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()


@dataclass(eq=False)
class _Worker:
    index: int
    process: BaseProcess | None = None
    port: int = 0
    up: bool = False
    restarts: int = 0
    failures: int = 0  # consecutive failed starts
    started_at: float = 0.0
    pipe: Connection | None = None  # open for the worker's life: it exits when this closes
    pool: list[_Upstream] = field(default_factory=list)

    def drop_pool(self) -> None:
        for up in list(self.pool):
            up.abandon()
        self.pool.clear()

    def status(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "pid": None if self.process is None else self.process.pid,
            "port": self.port,
            "up": self.up,
            "restarts": self.restarts,
        }


class RouterError(RuntimeError):
    """The router could not start (a worker failed to start or to become healthy)."""


async def _exchange(port: int, request: bytes, timeout: float) -> tuple[int, bytes]:
    """One request on a fresh connection to a worker: (status, body)."""

    async def go() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            cb = _CollectingResponse()
            writer.write(request)
            while not cb.done:
                data = await reader.read(_READ)
                if not data:
                    raise ConnectionError("worker closed the connection")
                cb.parser.feed_data(data)
            return cb.status, b"".join(cb.body)
        finally:
            writer.close()

    return await asyncio.wait_for(go(), timeout)


_HEALTH_REQUEST = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 0\r\n\r\n"


class Router:
    """N gateway worker processes on one store, behind one listening port (module doc).

    `await start(listener)` starts the workers, waits until every one answers `/health`,
    then serves on `listener` (a listening socket, `listen`) and returns its port;
    `await close()` stops serving and stops them."""

    def __init__(
        self,
        spec: GatewaySpec,
        n_workers: int,
        *,
        start_timeout_s: float = _START_TIMEOUT_S,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if n_workers < 1:
            raise ValueError(f"n_workers must be >= 1, got {n_workers}")
        self.spec = spec
        self.n = n_workers
        self.workers = [_Worker(i) for i in range(n_workers)]
        self.start_timeout_s = start_timeout_s
        self.log = log or (lambda msg: print(f"tidal gateway: {msg}", file=sys.stderr, flush=True))
        self._ctx = multiprocessing.get_context("spawn")
        self._server: asyncio.Server | None = None
        self._stopping = False
        self._tasks: set[asyncio.Task[Any]] = set()

    # ---------------------------------------------------------------- workers
    async def _spawn(self, w: _Worker) -> None:
        """Start worker `w`'s process and wait until it answers `/health` (RouterError)."""
        loop = asyncio.get_running_loop()
        parent_end, child_end = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=_worker_main,
            args=(self.spec, w.index, child_end),
            name=f"tidal-gateway-worker-{w.index}",
        )
        proc.start()
        child_end.close()
        w.process, w.port, w.up = proc, 0, False
        deadline = time.monotonic() + self.start_timeout_s
        try:
            msg = await asyncio.wait_for(
                loop.run_in_executor(None, _recv, parent_end), self.start_timeout_s
            )
            if not (isinstance(msg, tuple) and msg[0] == "ready"):
                why = msg[1] if isinstance(msg, tuple) else f"exit code {proc.exitcode}"
                raise RouterError(f"worker {w.index} failed to start: {why}")
            port = int(msg[1])
            while True:
                with contextlib.suppress(OSError, TimeoutError):
                    status, _ = await _exchange(port, _HEALTH_REQUEST, 5.0)
                    if status == 200:
                        break
                if not proc.is_alive():
                    raise RouterError(f"worker {w.index} exited (code {proc.exitcode}) at start")
                if time.monotonic() > deadline:
                    raise RouterError(f"worker {w.index} not healthy in {self.start_timeout_s} s")
                await asyncio.sleep(0.02)
        except BaseException:
            proc.kill()
            parent_end.close()
            await loop.run_in_executor(None, proc.join, 10.0)
            raise
        w.pipe = parent_end
        w.port, w.up, w.started_at = port, True, time.monotonic()
        loop.add_reader(proc.sentinel, self._exited, w, proc)

    def _exited(self, w: _Worker, proc: BaseProcess) -> None:
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        if w.process is not proc:
            return
        w.up = False
        w.drop_pool()
        if w.pipe is not None:
            w.pipe.close()
            w.pipe = None
        if not self._stopping:
            self._task(self._restart(w, proc))

    async def _restart(self, w: _Worker, dead: BaseProcess) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, dead.join, 5.0)
        # restarted at once, unless it keeps dying: then with a growing pause
        w.failures = 0 if time.monotonic() - w.started_at > 60.0 else w.failures + 1
        self.log(
            f"worker {w.index} (pid {dead.pid}) exited with code {dead.exitcode}; restarting"
        )
        while True:
            if w.failures > 1:
                await asyncio.sleep(min(30.0, 2.0 ** (w.failures - 2)))
            if self._stopping:
                return
            try:
                await self._spawn(w)
            except RouterError as e:
                w.failures += 1
                self.log(f"{e}; retrying")
                continue
            w.restarts += 1
            pid = None if w.process is None else w.process.pid
            self.log(f"worker {w.index} restarted (pid {dead.pid} -> {pid})")
            return

    # ---------------------------------------------------------------- serving
    async def start(self, listener: socket.socket) -> int:
        from tidal.ledger.store import LedgerStore

        LedgerStore(self.spec.store).close()  # create the schema once, before N writers
        results = await asyncio.gather(
            *(self._spawn(w) for w in self.workers), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise errors[0] if isinstance(errors[0], RouterError) else RouterError(str(errors[0]))
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Client(self), sock=listener, backlog=2048
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        self._stopping = True
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        loop = asyncio.get_running_loop()
        procs = [w.process for w in self.workers if w.process is not None]
        for w in self.workers:
            w.up = False
            w.drop_pool()
            if w.process is not None:
                with contextlib.suppress(ValueError, OSError):
                    loop.remove_reader(w.process.sentinel)
        for p in procs:
            if p.is_alive():
                p.terminate()  # SIGTERM: uvicorn finishes the calls in flight
        for p in procs:
            await loop.run_in_executor(None, p.join, 15.0)
            if p.is_alive():
                p.kill()
                await loop.run_in_executor(None, p.join, 5.0)
        for w in self.workers:
            if w.pipe is not None:
                w.pipe.close()
                w.pipe = None

    def _unavailable(self, w: _Worker, close: bool, url: bytes = b"") -> bytes:
        """503 naming the worker, in the shape of the request's API (Anthropic's for
        `/v1/messages`)."""
        pid = None if w.process is None else w.process.pid
        message = (
            f"gateway worker {w.index} of {self.n} (pid {pid}) is not answering; it is being "
            "restarted, retry shortly"
        )
        path = url.split(b"?", 1)[0]
        body = (
            anthropic.error_body(RequestError(message, status=503))
            if path.endswith(b"/v1/messages")
            else error_body(message, "server_error", None, "worker_unavailable")
        )
        return _json_response(
            503,
            body,
            close=close,
            extra=(b"retry-after: 1\r\n", b"x-tidal-worker: %d\r\n" % w.index),
        )

    def _forward_bytes(self, req: _Request) -> bytes:
        body = b"".join(req.body)
        return b"".join(
            [
                req.method, b" ", req.url, b" HTTP/1.1\r\n", *req.headers,
                b"content-length: %d\r\n\r\n" % len(body), body,
            ]
        )

    def _task(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def dispatch(self, client: _Client, req: _Request) -> None:
        """Start answering `req` (called by `client`, which waits for `answered`)."""
        if req.is_health:
            self._task(self._answer_health(client, req))
            return
        w = self.workers[worker_for(req.session_id, self.n)]
        if not w.up:
            client.answered(self._unavailable(w, not req.keep_alive, req.url), req.keep_alive)
            return
        req.data = self._forward_bytes(req)
        now = time.monotonic()
        while w.pool:
            up = w.pool.pop()
            if now - up.idle_since < _POOL_IDLE_S and not up.lost:
                up.send(client, req, reused=True)
                return
            up.abandon()
        self._task(self._connect_and_send(w, client, req))

    async def _connect_and_send(self, w: _Worker, client: _Client, req: _Request) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, up = await loop.create_connection(lambda: _Upstream(self, w), "127.0.0.1", w.port)
        except OSError:
            if not client.closed:
                client.answered(self._unavailable(w, not req.keep_alive, req.url), req.keep_alive)
            return
        if client.closed:
            up.abandon()
        else:
            up.send(client, req, reused=False)

    def finished(
        self, up: _Upstream, client: _Client, req: _Request, resp: _ResponseReader, rest: bytes
    ) -> None:
        """`up` has the whole answer to `req`; `rest` is what was not relayed yet."""
        if resp.keep_alive and req.method != b"HEAD" and up.worker.up and not up.lost:
            up.idle_since = time.monotonic()
            up.worker.pool.append(up)
        else:
            up.abandon()
        client.answered(rest, req.keep_alive and resp.keep_alive)

    def failed(self, up: _Upstream, client: _Client, req: _Request) -> None:
        """The worker connection of `req` broke before its answer was complete."""
        if client.closed:
            return
        if up.relayed:
            client.close()  # half an answer was sent: nothing else can follow it
        elif up.reused and up.worker.up:
            self._task(self._connect_and_send(up.worker, client, req))  # once, fresh
        else:
            body = self._unavailable(up.worker, not req.keep_alive, req.url)
            client.answered(body, req.keep_alive)

    async def _answer_health(self, client: _Client, req: _Request) -> None:
        status, obj = await self._health()
        if not client.closed:
            client.answered(_json_response(status, obj, close=not req.keep_alive), req.keep_alive)

    async def _health(self) -> tuple[int, dict[str, Any]]:
        async def one(w: _Worker) -> dict[str, Any]:
            st = w.status()
            if w.up:
                try:
                    code, body = await _exchange(w.port, _HEALTH_REQUEST, 5.0)
                    st["health"] = json.loads(body) if code == 200 else {"status": code}
                except (TimeoutError, OSError, ValueError) as e:
                    st["health"] = {"error": f"{type(e).__name__}: {e}"}
            return st

        statuses = await asyncio.gather(*(one(w) for w in self.workers))
        ok = all(s["up"] and s.get("health", {}).get("ok") is True for s in statuses)
        first = statuses[0].get("health", {})
        body = {
            "ok": ok,
            "model": first.get("model"),
            "policy_version": first.get("policy_version"),
            "workers": self.n,
            "worker_status": statuses,
        }
        return (200 if ok else 503), body


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run_router(
    spec: GatewaySpec,
    listener: socket.socket,
    n_workers: int,
    *,
    announce: Callable[[int], None],
) -> None:
    """Start `n_workers` workers and the router on `listener` (`listen(port)`);
    `announce(port)` once all are healthy and it serves; serve until SIGINT/SIGTERM, then
    stop them. Raises RouterError when a worker does not start."""

    async def main() -> None:
        import gc

        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        router = Router(spec, n_workers)
        loop.set_exception_handler(
            lambda _loop, ctx: router.log(
                f"router error: {ctx.get('message')}: {ctx.get('exception')!r}"
            )
        )
        starting = asyncio.ensure_future(router.start(listener))
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                return  # stopped while the workers were starting
            bound = starting.result()
            gc.collect()
            gc.freeze()  # as `freeze_startup_heap` does for a gateway process
            announce(bound)
            await stopped
        finally:
            for t in (starting, stopped):
                t.cancel()
            with contextlib.suppress(asyncio.CancelledError, RouterError):
                await starting
            await router.close()

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(main())
