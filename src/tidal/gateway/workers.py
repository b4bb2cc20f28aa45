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

The router is aiohttp's: its low-level server (`aiohttp.web.Server`: no routing, no
middleware, no access log) serving the socket `listen` bound (`web.SockSite`), on uvloop's
event loop when installed, and one `aiohttp.ClientSession` whose `TCPConnector` keeps
connections to the workers alive. It routes per request (one keep-alive client connection
may carry many sessions; pipelined requests are answered in order), reads each request
body whole (chunked or not; it answers `Expect: 100-continue` itself) and forwards it with
a Content-Length, and relays the worker's answer: a chunked one (SSE) as each piece
arrives, any other once complete. It replaced a hand-written proxy (asyncio protocols and
httptools, ~650 lines) that added ~0.4 ms less to a call and spent ~0.15 ms of CPU on it
against aiohttp's ~0.5 (docs/gateway.md, `bench/gateway.py --router-compare`).

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
  a 503 naming it, in the API's error shape (Anthropic's on `/v1/messages`, else
  OpenAI's); a request in flight when it died gets the same 503 if nothing of the answer
  was relayed yet, else the client connection is closed. A connection to a worker that
  breaks before any answer (a kept-alive one it had closed) is tried once more. The
  restarted worker starts with no in-memory session state (rebuilding that from the
  ledger is the gateway's business).
- HTTP/1.x only, loopback only, no TLS; upgrades are refused (400); hop-by-hop headers
  are dropped; no request body size limit (the workers' uvicorn has none either), but
  aiohttp's 8190 bytes for the request line and each header.
- Every response from a worker carries `x-tidal-worker: <index>`, and so do the
  router's 503s for it.

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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import aiohttp
from aiohttp import web
from multidict import CIMultiDictProxy
from yarl import URL

from tidal.engine.base import Engine
from tidal.gateway import anthropic
from tidal.gateway.access import OPEN, Access, SessionKeys
from tidal.gateway.core import Gateway
from tidal.gateway.messages import RequestError
from tidal.gateway.server import GatewayApp, error_body

WORKER_HEADER = "x-tidal-worker"
EngineFactory = Callable[[Path, Any], Engine]
"""`--engine module:attr`: `factory(model_dir, tokenizer) -> Engine`."""

_START_TIMEOUT_S = 600.0  # an embedded engine may load a large checkpoint
_POOL_IDLE_S = 20.0  # under the workers' uvicorn keep-alive timeout (30 s)


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
    api_keys: tuple[str, ...] = ()  # required on every call when any (SessionKeys.add)

    def check(self) -> Path:
        """The model directory, once every option is known to be usable (SpecError if not).
        The cheap checks come first; nothing is created or loaded."""
        from tidal.engine.tiny import resolve_model

        if self.max_tokens < 1:
            raise SpecError(f"must be at least 1, got {self.max_tokens}", "--max-tokens")
        if any(not k.strip() or k != k.strip() for k in self.api_keys):
            raise SpecError("an API key must be non-empty, without surrounding spaces",
                            "--api-key")
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
        access=standing_keys(spec.api_keys),
    )


def standing_keys(keys: tuple[str, ...]) -> Access:
    """No check without keys; else every call must bear one of them."""
    if not keys:
        return OPEN
    access = SessionKeys()
    for k in keys:
        access.add(k)
    return access


class _WorkerApp(GatewayApp):
    """`GatewayApp` that tags every response with `x-tidal-worker: <index>`."""

    def __init__(self, gateway: Gateway, index: int) -> None:
        super().__init__(gateway)
        self._tag = (WORKER_HEADER.encode(), b"%d" % index)

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


# ------------------------------------------------------------------ the router
_HOP_BY_HOP = frozenset(
    {
        "connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
        "upgrade", "expect", "content-length",
    }
)
# headers aiohttp's client would add that the client did not send
_NO_AUTO_HEADERS = ("Accept", "Accept-Encoding", "Content-Type", "User-Agent")
_HEALTH_TIMEOUT = aiohttp.ClientTimeout(total=5.0)


def _json_response(
    status: int, obj: dict[str, Any], headers: dict[str, str] | None = None
) -> web.Response:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return web.Response(status=status, body=body, content_type="application/json",
                        headers=headers)


def _error(status: int, message: str, code: str) -> web.Response:
    """`status` in OpenAI's error shape; the connection closes after it."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    resp = _json_response(status, error_body(message, kind, None, code))
    resp.force_close()
    return resp


def _session_path(raw_path: str) -> str | None:
    """The session id of a `/sessions/{id}/...` URL, decoded as the gateway decodes it
    (uvicorn unquotes the path, then `parse_session_path` each of its parts)."""
    if not raw_path.startswith("/sessions/"):
        return None
    path = unquote(raw_path.split("?", 1)[0])
    return unquote(path[len("/sessions/") :].split("/", 1)[0]) or None


def _headers(headers: CIMultiDictProxy[str]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers.items() if k.lower() not in _HOP_BY_HOP]


class _Connection(web.RequestHandler):
    """aiohttp's protocol for one client connection: answers what it cannot parse (400)
    in OpenAI's error shape, without logging it, and closes the connection when an
    answer breaks off."""

    log: Callable[[str], None]

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if isinstance(exc, ConnectionError) or request.writer.output_size:
            # part of an answer was sent, or the client went away: aiohttp closes the
            # connection on a ConnectionError
            raise ConnectionResetError("the answer was cut off") from exc
        if status < 500:
            return _error(status, f"malformed HTTP request: {message}", "bad_request")
        self.log(f"router error: {exc!r}")
        return _error(status, f"router error: {exc!r}", "router_error")


class _Server(web.Server):
    """aiohttp's low-level server (no routing, no middleware) with `_Connection`s."""

    def __init__(self, handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
                 log: Callable[[str], None]) -> None:
        super().__init__(handler)
        self.log = log

    def __call__(self) -> web.RequestHandler:
        loop = asyncio.get_running_loop()
        # no access log: None, as aiohttp's own runners pass it (typed a Logger)
        conn = _Connection(self, loop=loop, access_log=None)  # type: ignore[arg-type]
        conn.log = self.log
        return conn


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
        self._client: aiohttp.ClientSession | None = None
        self._runner: web.ServerRunner | None = None
        self._site: web.SockSite | None = None
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def client(self) -> aiohttp.ClientSession:
        assert self._client is not None, "Router.start first"
        return self._client

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
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    status, _ = await self._get_health(port)
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
        loop = asyncio.get_running_loop()
        loop.remove_reader(proc.sentinel)
        if w.process is not proc:
            return
        w.up = False
        if w.pipe is not None:
            w.pipe.close()
            w.pipe = None
        if not self._stopping:
            task = loop.create_task(self._restart(w, proc))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

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
        self._client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=_POOL_IDLE_S),
            timeout=aiohttp.ClientTimeout(),  # none: a call takes what the engine takes
            cookie_jar=aiohttp.DummyCookieJar(),  # a proxy: no cookies of its own
            auto_decompress=False,
            skip_auto_headers=_NO_AUTO_HEADERS,
        )
        results = await asyncio.gather(
            *(self._spawn(w) for w in self.workers), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise errors[0] if isinstance(errors[0], RouterError) else RouterError(str(errors[0]))
        self._runner = web.ServerRunner(_Server(self._handle, self.log), shutdown_timeout=5.0)
        await self._runner.setup()
        self._site = web.SockSite(self._runner, listener, backlog=2048)
        await self._site.start()
        return int(listener.getsockname()[1])

    async def close(self) -> None:
        self._stopping = True
        if self._site is not None:
            await self._site.stop()  # no new connections; the open ones get their answers
        for t in list(self._tasks):
            t.cancel()
        loop = asyncio.get_running_loop()
        procs = [w.process for w in self.workers if w.process is not None]
        for w in self.workers:
            w.up = False
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
        if self._runner is not None:
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.close()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """Answer one request: `/health` here, anything else by its session's worker."""
        if request.method == "GET" and request.path == "/health":
            return _json_response(*await self._health())
        if "upgrade" in request.headers or request.method == "CONNECT":
            # (aiohttp would read the rest of the connection as the upgraded protocol's)
            return _error(400, "upgrades are not supported", "bad_request")
        sid = _session_path(request.raw_path) or request.headers.get("x-tidal-session")
        w = self.workers[worker_for(sid, self.n)]
        if request.headers.get("expect", "").lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = await request.content.read()  # whole (aiohttp undoes a chunked framing)
        headers = _headers(request.headers)
        for retry in (False, True):
            if not w.up:
                break
            url = URL(f"http://127.0.0.1:{w.port}{request.raw_path}", encoded=True)
            try:
                up = await self.client.request(
                    request.method, url, headers=headers, data=body, allow_redirects=False
                )
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                if retry or isinstance(e, aiohttp.ClientConnectorError):
                    break  # nothing listens there (any more)
                continue  # a kept-alive connection closed under it: once more
            except aiohttp.ClientError:
                break
            async with up:
                if up.content_length is not None or request.method == "HEAD":
                    try:
                        data = await up.read()
                    except aiohttp.ClientError:
                        break  # nothing of it was relayed yet: a 503
                    return web.Response(status=up.status, reason=up.reason,
                                        headers=_headers(up.headers), body=data)
                # chunked (an SSE stream): relayed as each piece arrives
                out = web.StreamResponse(status=up.status, reason=up.reason,
                                         headers=_headers(up.headers))
                await out.prepare(request)
                try:
                    async for chunk in up.content.iter_any():
                        await out.write(chunk)
                except aiohttp.ClientError as e:  # the worker went away: cut the answer
                    raise ConnectionResetError(f"worker {w.index}: {e!r}") from e
                await out.write_eof()
                return out
        return self._unavailable(w, request.path)

    def _unavailable(self, w: _Worker, path: str) -> web.Response:
        """503 naming the worker, in the shape of the request's API (Anthropic's for
        `/v1/messages`)."""
        pid = None if w.process is None else w.process.pid
        message = (
            f"gateway worker {w.index} of {self.n} (pid {pid}) is not answering; it is being "
            "restarted, retry shortly"
        )
        body = (
            anthropic.error_body(RequestError(message, status=503))
            if path.endswith("/v1/messages")
            else error_body(message, "server_error", None, "worker_unavailable")
        )
        return _json_response(503, body, {"retry-after": "1", WORKER_HEADER: str(w.index)})

    async def _get_health(self, port: int) -> tuple[int, bytes]:
        url = f"http://127.0.0.1:{port}/health"
        async with self.client.get(url, timeout=_HEALTH_TIMEOUT) as r:
            return r.status, await r.read()

    async def _health(self) -> tuple[int, dict[str, Any]]:
        async def one(w: _Worker) -> dict[str, Any]:
            st = w.status()
            if w.up:
                try:
                    code, body = await self._get_health(w.port)
                    st["health"] = json.loads(body) if code == 200 else {"status": code}
                except (aiohttp.ClientError, TimeoutError, ValueError) as e:
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
