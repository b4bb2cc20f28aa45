"""`tidal serve` and `tidal verify`: wiring only (logic lives in server.py, verify.py,
workers.py).

Heavy imports (torch, transformers, uvicorn) happen inside the commands. `tidal serve`
checks its options and binds its port before it loads a model or creates the store, and
prints its URL (the port really bound) only when it serves (docs/gateway.md, "`tidal
serve`: what bad input gets").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def serve(
    *,
    model: Annotated[str, typer.Option(help="'tiny' or a local checkpoint directory")] = "tiny",
    store: Annotated[Path, typer.Option(help="ledger store (SQLite file)")] = Path(
        "tidal-ledger.db"
    ),
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="port on 127.0.0.1 (0: any free port)")
    ] = 8000,
    engine: Annotated[
        str,
        typer.Option(
            help="embedded | vllm | module:attr (a factory(model_dir, tokenizer) -> Engine)"
        ),
    ] = "embedded",
    engine_url: Annotated[
        str | None, typer.Option(help="vLLM server URL (with --engine vllm)")
    ] = None,
    served_name: Annotated[
        str | None, typer.Option(help="the vLLM server's model name (default: --model)")
    ] = None,
    device: Annotated[
        str, typer.Option(help="device for the embedded engine: cpu, cuda, cuda:N or mps")
    ] = "cpu",
    max_tokens: Annotated[
        int, typer.Option(min=1, help="default max_tokens per call")
    ] = 256,
    prefix_cache_mb: Annotated[
        float, typer.Option(min=0, help="embedded engine's prefix cache in MiB (0: off)")
    ] = 256.0,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            help="gateway processes on the one store, behind a router that keeps each "
            "session on one of them (1: a single process, no router)",
        ),
    ] = 1,
    tool_parser: Annotated[
        str | None,
        typer.Option(
            help="tool-call parsers, comma-separated: hermes, fenced, json, mistral, "
            "pythonic, qwen3_xml, or module:attr (default: the chat template's)"
        ),
    ] = None,
    tool_parser_strict: Annotated[
        bool, typer.Option(help="turn the parsers' lenient rules off (docs/gateway.md)")
    ] = False,
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            envvar="TIDAL_SERVE_API_KEY",
            help="require this API key (Authorization: Bearer or x-api-key) on every "
            "call; repeat for several (default: no key required)",
        ),
    ] = None,
) -> None:
    """Serve the recording gateway (Chat Completions, Responses, Anthropic Messages) on
    127.0.0.1."""
    from tidal.engine.base import EngineError
    from tidal.gateway.workers import (
        GatewaySpec,
        RouterError,
        SpecError,
        build_gateway,
        listen,
        run_gateway,
        run_router,
    )

    spec = GatewaySpec(
        model=model,
        store=store,
        engine=engine,
        engine_url=engine_url,
        served_name=served_name,
        device=device,
        max_tokens=max_tokens,
        prefix_cache_mb=prefix_cache_mb,
        tool_parser=tool_parser,
        tool_parser_strict=tool_parser_strict,
        api_keys=tuple(api_key or ()),
    )
    sessions = "(sessions: /sessions/<id>/v1)"
    try:
        spec.check()  # every option first: nothing is loaded or created yet
        listener = listen(port)  # then the port: one in use fails here, before the model
        if workers == 1:
            gw = build_gateway(spec)
            bound = listener.getsockname()[1]
            typer.echo(f"tidal gateway: http://127.0.0.1:{bound}/v1  {sessions}")
            run_gateway(gw, sockets=[listener])
            return
    except SpecError as e:
        raise typer.BadParameter(str(e), param_hint=e.param) from e
    except EngineError as e:  # the engine would not start (a vLLM server not reachable)
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from e
    try:
        run_router(
            spec,
            listener,
            workers,
            announce=lambda bound: typer.echo(
                f"tidal gateway: http://127.0.0.1:{bound}/v1  {sessions}, {workers} workers"
            ),
        )
    except RouterError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from e


def verify(
    store: Annotated[Path, typer.Argument(help="ledger store to audit")],
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Audit a store: are the sampled tokens what training will see? Exit 1 if not."""
    from tidal.gateway.verify import verify_store
    from tidal.ledger.store import LedgerStore
    from tidal.ledger.types import LedgerError

    try:
        ledger = LedgerStore(store, readonly=True)
    except LedgerError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    with ledger:
        report = verify_store(ledger)
    d = report.to_dict()
    if as_json:
        typer.echo(json.dumps(d, indent=2))
    else:
        typer.echo(
            f"calls {d['calls']}, model tokens {d['model_tokens']}, verbatim "
            f"{d['model_tokens_verbatim']}, drift {d['drift']}: {'ok' if d['ok'] else 'FAILED'}"
        )
        for p in d["problems"]:
            typer.echo(f"  {p}")
    if not report.ok:
        raise typer.Exit(1)
