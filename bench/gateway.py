"""Added latency of the recording gateway over calling the engine in process.

For each call, `added = end-to-end HTTP time (client side) - engine time of that call`,
where the engine time is what `Engine.generate` took inside the gateway (returned in the
`X-Tidal-Engine-Ms` header). "Added" therefore covers HTTP parsing, validation,
rendering, TITO assembly and drift checks, tokenization, tool-call parsing, the ledger
commit (SQLite, WAL) and the response. Sessions are multi-turn chats whose history grows,
so every call after the first goes through the token-in-token-out splice.

Engines: the embedded transformers engine on the tiny model (max_tokens small, CPU);
`instant_engine`, which answers at once (the gateway's own cost); and `paced_engine`,
which answers after a random wait of 0.5-1.5x `--engine-ms` without using the CPU, the way
a batching server on its own device (vLLM on a GPU) serves concurrent calls.
Target: p50 added < 2 ms. Run: `.venv/bin/python bench/gateway.py [--calls N]
[--engines instant|paced|tiny|all]`; prints JSON.

Why a paced engine at 32 sessions: with an instant engine and clients that send their next
call the moment an answer arrives, 32 sessions are a throughput test. Every call then
waits for the ~31 ahead of it (one Python process runs one call's CPU work at a time), so
its p50 is about 32 calls' worth of gateway time and says how many calls a second the
gateway can serve (`calls_per_s`), not what it adds to one call. Real agent calls spend
most of their time in the engine (0.5-10 s to decode 50-500 tokens at 30-100 tokens/s
per sequence). The paced engine's default of 200 ms a call is shorter than that, and
`--engine-ms` lists paces to sweep up to where the gateway saturates.

The HTTP clients run in a child process (their own GIL), one keep-alive `http.client`
connection per session: the request body is encoded before the clock starts and the
response parsed after it stops, so the client's own JSON work is not counted as the
gateway's, while sending, the gateway's whole turn and reading the complete response are.
On a shared 2-core machine the figures include CPU contention with the engine's torch
threads, the clients and whatever else runs; `load_avg_1m` is printed with them.

`--apis chat responses messages` measures the same added latency (instant engine, one
session in process) for each API the gateway speaks: chat completions, the Responses API
(`/v1/responses`, each answer's `output` items appended to the next `input`) and
Anthropic Messages (`/v1/messages`, the answer's `content` blocks sent back as the
assistant turn). An API whose endpoint answers 404 is reported as unavailable.

`--workers 1 2` measures `tidal serve --workers N` as a real subprocess (the factories
`bench.gateway:instant_factory` and `bench.gateway:paced_factory`, the repo root on
PYTHONPATH; the paced one reads its mean wait from `TIDAL_BENCH_ENGINE_MS`), for each N:
the instant engine at 1 session and at 32 sessions (`calls_per_s`), and the paced engine
(the first `--engine-ms`) at 32 sessions; for N > 1 also the router's own cost (`router`:
single sessions alternately sent straight to worker 0's port and through the router to
the same worker, the difference of their end-to-end percentiles).

`machine` says how the host treats a process that waits: the same pure-Python job timed
back to back and after a 200 ms pause (`machine_cold_factor`). A paced call starts after
such a pause, so on a host with a large `cold_factor` its added latency is that much
above the instant engine's, whatever the gateway does.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np

if TYPE_CHECKING:
    from tidal.engine.base import Weights


class InstantEngine:
    """A deterministic policy that answers at once (one fixed token, then the stop token):
    isolates the gateway's own cost from the engine's CPU use. Diagnostic only."""

    def __init__(self, stop_id: int, model_name: str = "tiny") -> None:
        self._stop = stop_id
        self._name = model_name

    model_name = property(lambda self: self._name)
    policy_version = property(lambda self: 0)
    max_context = property(lambda self: 32768)

    def generate(self, prompts: Any, params: Any, *, session: str | None = None) -> list[Any]:
        from tidal.engine.base import Generation

        ids = np.asarray([9707, self._stop][: params.max_tokens], dtype=np.int32)
        return [Generation(ids, np.zeros(len(ids), np.float32), "stop", 0) for _ in prompts]

    def update_weights(self, source: Weights | str | Path, version: int) -> None:
        pass

    def forget(self, session: str) -> None:
        pass

    def metrics(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class PacedEngine(InstantEngine):
    """Answers like `InstantEngine` after sleeping 0.5-1.5x `ms` (seeded per call): an engine
    on its own device, whose wait costs the gateway's CPU nothing and overlaps across calls.
    The jitter keeps 32 sessions from marching in step (equal waits would make every call
    arrive in bursts of 32)."""

    def __init__(self, stop_id: int, ms: float) -> None:
        super().__init__(stop_id)
        self._ms = ms

    def generate(self, prompts: Any, params: Any, *, session: str | None = None) -> list[Any]:
        jitter = np.random.default_rng(params.seed).uniform(0.5, 1.5)
        time.sleep(self._ms * jitter / 1e3)
        return super().generate(prompts, params)


def _stop_id(tokenizer: Any) -> int:
    return int(tokenizer.convert_tokens_to_ids("<|im_end|>"))


def instant_factory(model_dir: Path, tokenizer: Any) -> InstantEngine:
    """`tidal serve --engine bench.gateway:instant_factory` (repo root on PYTHONPATH)."""
    return InstantEngine(_stop_id(tokenizer))


def paced_factory(model_dir: Path, tokenizer: Any) -> PacedEngine:
    """`--engine bench.gateway:paced_factory`: waits `TIDAL_BENCH_ENGINE_MS` (200) a call."""
    return PacedEngine(_stop_id(tokenizer), float(os.environ.get("TIDAL_BENCH_ENGINE_MS", "200")))


Sample = tuple[float, float, float]  # end-to-end, engine, in-process gateway (seconds)
APIS = ("chat", "responses", "messages")
SYSTEM = "You are a bench agent."


class UnavailableError(RuntimeError):
    """The gateway answered 404 for an API's endpoint."""


class _Api:
    """One API's request shape: the path, headers, body and how an answer extends the
    conversation (chat completions, OpenAI Responses, Anthropic Messages)."""

    def __init__(self, api: str, max_tokens: int) -> None:
        self.api = api
        self.max_tokens = max_tokens
        self.path = {
            "chat": "chat/completions",
            "responses": "responses",
            "messages": "messages",
        }[api]
        self.headers = {"Content-Type": "application/json"}
        if api == "messages":
            self.headers |= {"x-api-key": "unused", "anthropic-version": "2023-06-01"}
        self.turns: list[Any] = (
            [{"role": "system", "content": SYSTEM}] if api == "chat" else []
        )

    def body(self, user: str, seed: int) -> dict[str, Any]:
        self.turns.append({"role": "user", "content": user})
        if self.api == "chat":
            return {"model": "tiny", "messages": self.turns, "max_tokens": self.max_tokens,
                    "seed": seed}
        if self.api == "responses":
            return {"model": "tiny", "input": self.turns, "instructions": SYSTEM,
                    "max_output_tokens": self.max_tokens, "seed": seed}
        return {"model": "tiny", "system": SYSTEM, "messages": self.turns,
                "max_tokens": self.max_tokens}

    def answered(self, answer: dict[str, Any]) -> None:
        if self.api == "chat":
            content = answer["choices"][0]["message"]["content"]
            self.turns.append({"role": "assistant", "content": content})
        elif self.api == "responses":
            self.turns.extend(answer["output"])
        else:
            self.turns.append({"role": "assistant", "content": answer["content"]})


_FILLER = ("alpha", "beta", "gamma", "delta", "file", "src/main.py", "def", "return", "{", "\n")


def run_session(
    base: str,
    sid: str,
    n_calls: int,
    max_tokens: int,
    *,
    start_s: float = 0.0,
    filler_words: int = 0,
    api: str = "chat",
) -> list[Sample]:
    """One session of `n_calls` calls of `api`, each user message padded with
    `filler_words` seeded words (a long history: what a tool-heavy agent sends back
    every call). Raises `UnavailableError` when the endpoint answers 404."""
    time.sleep(start_s)
    rng = np.random.default_rng(zlib.crc32(sid.encode()))
    out = []
    shape = _Api(api, max_tokens)
    url = urlsplit(base)
    path = f"/sessions/{sid}/v1/{shape.path}"
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=300)
    try:
        for i in range(n_calls):
            filler = " ".join(rng.choice(_FILLER, filler_words)) if filler_words else ""
            seed = (zlib.crc32(sid.encode()) + i) % 2**31
            data = json.dumps(shape.body(f"step {i}: report status {filler}", seed)).encode()
            t0 = time.perf_counter()
            conn.request("POST", path, body=data, headers=shape.headers)
            r = conn.getresponse()
            payload = r.read()
            e2e = time.perf_counter() - t0
            if r.status == 404:
                raise UnavailableError(f"{api}: HTTP 404 on {path}: {payload[:300]!r}")
            if r.status != 200:
                raise RuntimeError(f"{api}: HTTP {r.status}: {payload[:500]!r}")
            engine_ms = r.getheader("x-tidal-engine-ms")
            if engine_ms is None:
                raise RuntimeError(f"{api}: no x-tidal-engine-ms header in the answer")
            inproc = float(r.getheader("x-tidal-gateway-ms") or "nan") / 1e3
            shape.answered(json.loads(payload))
            out.append((e2e, float(engine_ms) / 1e3, inproc))
    finally:
        conn.close()
    return out


def client_load(
    base: str,
    prefix: str,
    n_sessions: int,
    n_calls: int,
    max_tokens: int,
    *,
    stagger_s: float = 0.0,
    filler_words: int = 0,
    api: str = "chat",
) -> tuple[list[Sample], float]:
    """Run `n_sessions` concurrent sessions (one thread each, session k starting k/n of
    `stagger_s` late) and return their samples and the wall time; runs in a child process
    so that the HTTP clients do not share the gateway's GIL."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n_sessions) as pool:
        futs = [
            pool.submit(
                run_session,
                base,
                f"{prefix}{k}",
                n_calls,
                max_tokens,
                start_s=stagger_s * k / n_sessions,
                filler_words=filler_words,
                api=api,
            )
            for k in range(n_sessions)
        ]
        samples = [s for f in futs for s in f.result()]
    return samples, time.perf_counter() - t0


def stats(result: tuple[list[Sample], float]) -> dict[str, float]:
    samples, wall_s = result

    def pct(values: list[float], q: float) -> float:
        return round(float(np.percentile(np.asarray(values) * 1e3, q)), 3)

    added = [e - g for e, g, _ in samples]
    return {
        "calls": len(samples),
        "added_ms_p50": pct(added, 50),
        "added_ms_p99": pct(added, 99),
        "in_process_ms_p50": pct([i for _, _, i in samples if not math.isnan(i)] or [0.0], 50),
        "e2e_ms_p50": pct([e for e, _, _ in samples], 50),
        "engine_ms_p50": pct([g for _, g, _ in samples], 50),
        "calls_per_s": round(len(samples) / wall_s, 1),
    }


def measure(
    engine: Any,
    tokenizer: Any,
    args: argparse.Namespace,
    *,
    one_session: bool = True,
    stagger_s: float = 0.0,
    apis: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Added latency at 1 session (unless `one_session` is False) and at 32 sessions whose
    starts are spread over `stagger_s` (the wall time, and so `calls_per_s`, includes it);
    then at 1 session for each of `apis` (`out["apis"]`)."""
    from tidal.gateway.server import GatewayServer, freeze_startup_heap
    from tidal.ledger.store import LedgerStore

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = LedgerStore(Path(tmp) / "bench.db")
        with GatewayServer(engine, tokenizer, store) as srv:
            freeze_startup_heap()  # as `tidal serve` does
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(1, mp_context=ctx) as clients:
                load = partial(clients.submit, client_load, srv.base_url,
                               filler_words=args.filler_words)
                load("warmup", 1, 3, args.max_tokens).result()
                if one_session:
                    out["sessions_1"] = stats(load("one", 1, args.calls, args.max_tokens).result())
                many = load("c", 32, args.calls_concurrent, args.max_tokens, stagger_s=stagger_s)
                out["sessions_32"] = stats(many.result())
                if apis:
                    out["apis"] = {
                        api: api_stats(load, api, args.calls, args.max_tokens) for api in apis
                    }
            out["recorded_calls"] = store.count_calls()
        store.close()
    return out


def api_stats(load: Any, api: str, n_calls: int, max_tokens: int) -> dict[str, Any]:
    """One session of `api` (after a 3-call warm-up): its stats, or why it could not run."""
    try:
        load(f"warmup-{api}-", 1, 3, max_tokens, api=api).result()
        return stats(load(f"api-{api}-", 1, n_calls, max_tokens, api=api).result())
    except UnavailableError as e:
        return {"unavailable": str(e)}
    except RuntimeError as e:
        return {"error": str(e)}


# ------------------------------------------------------------------ tidal serve --workers N
ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Serve:
    """`tidal serve --workers N --engine bench.gateway:<factory>` as a subprocess."""

    def __init__(self, store: Path, workers: int, factory: str, engine_ms: float) -> None:
        self.port = _free_port()  # `--port 0` would do for N > 1 only (the router says it)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
            ),
            "TIDAL_BENCH_ENGINE_MS": f"{engine_ms:g}",
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tidal.cli", "serve", "--model", "tiny", "--store",
             str(store), "--port", str(self.port), "--engine", f"bench.gateway:{factory}",
             "--workers", str(workers)],
            env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
        )
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"tidal serve --workers {workers} did not start")
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            finally:
                conn.close()
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def router_overhead(
    srv: Serve, n: int, clients: ProcessPoolExecutor, args: argparse.Namespace
) -> dict[str, Any]:
    """The router's own cost: one session at a time, alternately straight to worker 0's
    port (from the router's `/health`) and through the router to the same worker
    (a session id that hashes to it), `--router-rounds` rounds of `--calls` calls each;
    `added_ms_*` is the difference of the two's end-to-end percentiles."""
    from tidal.gateway.workers import worker_for

    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request("GET", "/health")
    port0 = json.loads(conn.getresponse().read())["worker_status"][0]["port"]
    conn.close()
    direct: list[Sample] = []
    routed: list[Sample] = []
    for r in range(args.router_rounds):
        prefix = next(f"r{r}x{j}-" for j in range(1000) if worker_for(f"r{r}x{j}-0", n) == 0)
        for base, pre, into in (
            (f"http://127.0.0.1:{port0}", f"d{r}-", direct),
            (srv.base, prefix, routed),
        ):
            samples, _ = clients.submit(
                client_load, base, pre, 1, args.calls, args.max_tokens,
                filler_words=args.filler_words,
            ).result()
            into.extend(samples)

    def pct(samples: list[Sample], q: float) -> float:
        return float(np.percentile([e for e, _, _ in samples], q)) * 1e3

    return {
        "calls_each": len(direct),
        "direct_e2e_ms_p50": round(pct(direct, 50), 3),
        "routed_e2e_ms_p50": round(pct(routed, 50), 3),
        "added_ms_p50": round(pct(routed, 50) - pct(direct, 50), 3),
        "added_ms_p99": round(pct(routed, 99) - pct(direct, 99), 3),
    }


def measure_workers(n: int, args: argparse.Namespace) -> dict[str, Any]:
    """`tidal serve --workers n`: instant engine at 1 and 32 sessions, paced at 32."""
    out: dict[str, Any] = {}
    ms = args.engine_ms[0]
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(1, mp_context=ctx) as clients:
        for factory, key in (("instant_factory", "instant_engine"), ("paced_factory", "paced")):
            srv = Serve(Path(tmp) / f"{factory}.db", n, factory, ms)
            try:
                load = partial(clients.submit, client_load, srv.base,
                               filler_words=args.filler_words)
                load("warmup", 4, 3, args.max_tokens).result()
                if key == "instant_engine":
                    out[key] = {
                        "sessions_1": stats(load("one", 1, args.calls, args.max_tokens).result()),
                        "sessions_32": stats(
                            load("c", 32, args.calls_concurrent, args.max_tokens).result()
                        ),
                    }
                    if n > 1:
                        out["router"] = router_overhead(srv, n, clients, args)
                else:
                    many = load("p", 32, args.calls_concurrent, args.max_tokens,
                                stagger_s=ms / 1e3)
                    out[f"paced_{ms:g}_ms"] = {"sessions_32": stats(many.result())}
            finally:
                srv.close()
    return out


def compare_routers(args: argparse.Namespace) -> dict[str, Any]:
    """tidal's router against bare proxies on maintained libraries (bench/router_alt.py:
    uvicorn + Starlette + httpx, and aiohttp, the library tidal's router is built on),
    all in front of the same `tidal serve --workers 2` workers (instant engine): single
    sessions sent straight to worker 0 and through each router, round after round in
    turn (added p50/p99: routed minus direct); then 32 sessions straight to worker 0 and
    through each router in turn (calls a second, p50/p99 added), twice.
    `router_cpu_us_per_call`: each router process's CPU time (user + system) over the
    calls it routed (Linux), which the machine's other load disturbs less than latency."""
    from tidal.gateway.workers import worker_for

    ctx = multiprocessing.get_context("spawn")
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(1, mp_context=ctx) as clients:
        srv = Serve(Path(tmp) / "s.db", 2, "instant_factory", args.engine_ms[0])
        alts: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}
        try:
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
            conn.request("GET", "/health")
            ports = [w["port"] for w in json.loads(conn.getresponse().read())["worker_status"]]
            conn.close()
            for impl in ("starlette", "aiohttp"):
                port = _free_port()
                alts[impl] = (port, subprocess.Popen(
                    [sys.executable, str(ROOT / "bench" / "router_alt.py"), "--port", str(port),
                     "--impl", impl, "--workers", *map(str, ports)],
                    cwd=ROOT, stdout=subprocess.DEVNULL))
                _wait_port(port)
            bases = {"direct": f"http://127.0.0.1:{ports[0]}", "tidal": srv.base,
                     **{impl: f"http://127.0.0.1:{port}" for impl, (port, _) in alts.items()}}
            for base in bases.values():
                clients.submit(client_load, base, "warm-", 4, 3, args.max_tokens).result()
            pids = {"tidal": srv.proc.pid, **{impl: p.pid for impl, (_, p) in alts.items()}}
            cpu0 = {name: _cpu_s(pid) for name, pid in pids.items()}
            one: dict[str, list[Sample]] = {k: [] for k in bases}
            for r in range(args.router_rounds):
                pre = next(f"q{r}x{j}-" for j in range(1000) if worker_for(f"q{r}x{j}-0", 2) == 0)
                for name, base in bases.items():
                    one[name] += clients.submit(client_load, base, f"{name}-{pre}", 1,
                                                args.calls, args.max_tokens).result()[0]

            def pct(samples: list[Sample], q: float) -> float:
                return float(np.percentile([e for e, _, _ in samples], q)) * 1e3

            out["single_session"] = {
                name: {"e2e_ms_p50": round(pct(got, 50), 3),
                       "added_ms_p50": round(pct(got, 50) - pct(one["direct"], 50), 3),
                       "added_ms_p99": round(pct(got, 99) - pct(one["direct"], 99), 3)}
                for name, got in one.items() if name != "direct"}
            many: dict[str, list[dict[str, float]]] = {k: [] for k in bases}
            for r in range(2):
                for name, rows in many.items():
                    rows.append(stats(clients.submit(
                        client_load, bases[name], f"m{r}{name}-", 32, args.calls_concurrent,
                        args.max_tokens).result()))
            out["sessions_32"] = many
            out["router_cpu_us_per_call"] = {
                name: round((_cpu_s(pid) - cpu0[name]) * 1e6
                            / (len(one[name]) + sum(r["calls"] for r in many[name])), 1)
                for name, pid in pids.items()}
        finally:
            for _port, proc in alts.values():
                proc.terminate()
                proc.wait(timeout=30)
            srv.close()
    return out


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds process `pid` has used so far (Linux /proc; nan else)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_port(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port} after {timeout_s:g} s")


_PROBE_BODY = {
    "model": "tiny",
    "messages": [{"role": "user", "content": f"step {i}: report status " * 3} for i in range(30)],
    "tools": [{"name": f"t{i}", "parameters": {"a": i, "b": [1, 2, 3]}} for i in range(8)],
}


def _probe_work() -> int:
    """A fixed pure-Python job (~0.1 ms hot): JSON out and back, and a loop over it."""
    text = json.dumps(_PROBE_BODY)
    body = json.loads(text)
    return len(text) + sum(len(m["content"].split()) for m in body["messages"])


def machine_cold_factor(pause_s: float = 0.2, n: int = 30) -> dict[str, float]:
    """How much slower the same pure-Python job runs after a pause than back to back, on
    this machine, with nothing of tidal's involved: p50 ms back to back, after `pause_s`
    asleep, and after `pause_s` spent busy-looping (so the CPU never idles). A factor well
    above 1 in the busy case means something outside this process evicts its caches while
    it waits (a shared virtual machine's host or neighbours): every paced call then pays
    it, in the gateway and in the HTTP stack alike."""

    def p50(pause: str | None) -> float:
        out = []
        for _ in range(n):
            if pause == "sleep":
                time.sleep(pause_s)
            elif pause == "busy":
                t = time.perf_counter()
                while time.perf_counter() - t < pause_s:
                    pass
            t0 = time.perf_counter()
            _probe_work()
            out.append(time.perf_counter() - t0)
        return float(np.median(out)) * 1e3

    p50(None)  # warm up
    hot, asleep, busy = p50(None), p50("sleep"), p50("busy")
    return {
        "hot_ms": round(hot, 4),
        "after_sleep_ms": round(asleep, 4),
        "after_busy_loop_ms": round(busy, 4),
        "cold_factor": round(asleep / hot, 2),
        "cold_factor_busy": round(busy / hot, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=40, help="calls per session at 1 session")
    ap.add_argument("--calls-concurrent", type=int, default=8, help="calls per session at 32")
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument(
        "--filler-words",
        type=int,
        default=0,
        help="words added to every user message (a long history: 400 words ~ 2.5 KB a turn)",
    )
    ap.add_argument(
        "--engines",
        choices=("all", "tiny", "instant", "paced"),
        default="all",
        help="which engines to measure",
    )
    ap.add_argument(
        "--engine-ms",
        type=float,
        nargs="+",
        default=[200.0],
        help="paced engine: mean engine time per call (ms), one measurement (32 sessions) each",
    )
    ap.add_argument(
        "--apis",
        nargs="*",
        choices=APIS,
        default=list(APIS),
        help="APIs measured at 1 session, instant engine, in process (none: skip)",
    )
    ap.add_argument(
        "--workers",
        type=int,
        nargs="*",
        default=[],
        help="worker counts to measure through `tidal serve --workers N` (e.g. 1 2)",
    )
    ap.add_argument(
        "--router-rounds",
        type=int,
        default=5,
        help="with --workers N > 1: rounds of direct vs routed single sessions",
    )
    ap.add_argument(
        "--router-compare",
        action="store_true",
        help="only compare tidal's router with bench/router_alt.py (bare proxies)",
    )
    args = ap.parse_args()
    if args.router_compare:
        print(json.dumps({"bench": "router_compare", "load_avg_1m": round(os.getloadavg()[0], 2),
                          **compare_routers(args)}, indent=1))
        return

    from tidal.engine.embedded import EmbeddedEngine
    from tidal.engine.tiny import ensure_tiny, load_tokenizer

    model = ensure_tiny()
    tokenizer = load_tokenizer(model)
    result: dict[str, Any] = {
        "bench": "gateway_added_latency",
        "max_tokens": args.max_tokens,
        "filler_words": args.filler_words,
        "target_p50_ms": 2.0,
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "machine": machine_cold_factor(),
    }
    if args.engines in ("all", "tiny"):
        engine = EmbeddedEngine(model, model_name="tiny", max_batch_size=32, seed=0)
        result["embedded_tiny_cpu"] = measure(engine, tokenizer, args)
        engine.close()
    stop = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    if args.engines in ("all", "instant"):
        result["instant_engine"] = measure(
            InstantEngine(stop), tokenizer, args, apis=tuple(args.apis)
        )
        if args.apis:
            result["apis"] = result["instant_engine"].pop("apis")
            result["target_met_p50_apis"] = {
                k: v["added_ms_p50"] < 2.0 for k, v in result["apis"].items() if "calls" in v
            }
    if args.engines in ("all", "paced"):
        result["paced_engine"] = {
            f"{ms:g}_ms": measure(
                PacedEngine(stop, ms), tokenizer, args, one_session=False, stagger_s=ms / 1e3
            )
            for ms in args.engine_ms
        }
        result["target_met_p50_32_sessions_paced"] = {
            k: v["sessions_32"]["added_ms_p50"] < 2.0 for k, v in result["paced_engine"].items()
        }
    if args.workers:
        result["workers"] = {str(n): measure_workers(n, args) for n in args.workers}
        w = result["workers"]
        if "2" in w:
            result["router_added_ms_p50"] = w["2"]["router"]["added_ms_p50"]
            result["router_added_ms_p99"] = w["2"]["router"]["added_ms_p99"]
        result["target_met_p99_paced_2_workers"] = (
            w["2"][f"paced_{args.engine_ms[0]:g}_ms"]["sessions_32"]["added_ms_p99"] < 10.0
            if "2" in w
            else None
        )
    result["target_met_p50"] = {
        k: result[k]["sessions_1"]["added_ms_p50"] < 2.0
        for k in ("embedded_tiny_cpu", "instant_engine")
        if k in result
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
