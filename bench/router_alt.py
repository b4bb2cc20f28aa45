"""The sticky router of `tidal serve --workers N` written as bare proxies on maintained
libraries, to measure against tidal's own (`tidal.gateway.workers`: aiohttp's low-level
server and `ClientSession`, plus the worker supervision, `/health` and 503s).

Each sends a request to the worker its session id hashes to
(`tidal.gateway.workers.worker_for`: the `/sessions/{id}/...` path, else the
`X-Tidal-Session` header, else worker 0) over pooled keep-alive connections, and
streams the worker's answer back as it arrives (SSE too):
- `--impl starlette`: uvicorn (httptools, uvloop) serving a Starlette app, forwarding
  with one `httpx.AsyncClient`;
- `--impl aiohttp`: aiohttp's `web.Application` and its `ClientSession`, streaming every
  answer: the least an aiohttp proxy does, the library tidal's router is written with.
Nothing else: no health aggregation, no restarts. bench/gateway.py's `--router-compare`
starts it beside a running `tidal serve --workers N` and uses the same workers.

    python bench/router_alt.py --port P --workers PORT0 PORT1 ... [--impl aiohttp]
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from urllib.parse import unquote

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from tidal.gateway.workers import worker_for

HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
       "proxy-authorization", "proxy-authenticate", "host", "content-length"}


def session_of(request: Request) -> str | None:
    path = request.url.path
    if path.startswith("/sessions/"):
        return unquote(path[len("/sessions/"):].split("/", 1)[0]) or None
    return request.headers.get("x-tidal-session")


def app_for(ports: list[int]) -> Starlette:
    client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_keepalive_connections=64))
    bases = [f"http://127.0.0.1:{p}" for p in ports]

    async def proxy(request: Request) -> StreamingResponse:
        base = bases[worker_for(session_of(request), len(bases))]
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP]
        upstream = await client.send(
            client.build_request(request.method, base + request.url.path,
                                 params=request.query_params, headers=headers, content=body),
            stream=True)

        async def chunks() -> AsyncIterator[bytes]:
            async for chunk in upstream.aiter_raw():
                yield chunk

        out = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP}
        return StreamingResponse(chunks(), status_code=upstream.status_code, headers=out,
                                 background=BackgroundTask(upstream.aclose))

    return Starlette(routes=[Route("/{path:path}", proxy, methods=["GET", "POST", "DELETE"])])


def serve_aiohttp(port: int, ports: list[int]) -> None:
    from aiohttp import ClientSession, TCPConnector, web

    bases = [f"http://127.0.0.1:{p}" for p in ports]
    state: dict[str, ClientSession] = {}

    async def start(app: web.Application) -> None:
        state["client"] = ClientSession(connector=TCPConnector(limit=0), auto_decompress=False)

    async def proxy(request: web.Request) -> web.StreamResponse:
        sid = request.headers.get("x-tidal-session")
        if request.path.startswith("/sessions/"):
            sid = unquote(request.path[len("/sessions/"):].split("/", 1)[0]) or None
        base = bases[worker_for(sid, len(bases))]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        async with state["client"].request(request.method, base + request.path_qs,
                                           headers=headers, data=await request.read()) as up:
            out = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in HOP})
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def stop(app: web.Application) -> None:
        await state["client"].close()

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_route("*", "/{tail:.*}", proxy)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--workers", type=int, nargs="+", required=True, help="worker ports")
    ap.add_argument("--impl", choices=("starlette", "aiohttp"), default="starlette")
    args = ap.parse_args()
    if args.impl == "aiohttp":
        serve_aiohttp(args.port, args.workers)
        return
    uvicorn.run(app_for(args.workers), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False)


if __name__ == "__main__":
    main()
