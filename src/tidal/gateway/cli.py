"""`tidal serve` and `tidal verify`: wiring only (logic lives in server.py, verify.py).

Heavy imports (torch, transformers, uvicorn) happen inside the commands.
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
    port: Annotated[int, typer.Option(help="port on 127.0.0.1 (0: any free port)")] = 8000,
    engine: Annotated[str, typer.Option(help="embedded | vllm")] = "embedded",
    engine_url: Annotated[
        str | None, typer.Option(help="vLLM server URL (with --engine vllm)")
    ] = None,
    served_name: Annotated[
        str | None, typer.Option(help="the vLLM server's model name (default: --model)")
    ] = None,
    device: Annotated[str, typer.Option(help="device for the embedded engine")] = "cpu",
    max_tokens: Annotated[int, typer.Option(help="default max_tokens per call")] = 256,
    prefix_cache_mb: Annotated[
        float, typer.Option(help="embedded engine's prefix cache in MiB (0: off)")
    ] = 256.0,
) -> None:
    """Serve the OpenAI-compatible recording gateway on 127.0.0.1."""
    import uvicorn

    from tidal.engine.base import Engine
    from tidal.engine.tiny import load_tokenizer, resolve_model
    from tidal.gateway.core import Gateway
    from tidal.gateway.server import GatewayApp, freeze_startup_heap, uvicorn_config
    from tidal.ledger.store import LedgerStore

    try:
        model_dir = resolve_model(model)
    except Exception as e:
        raise typer.BadParameter(str(e), param_hint="--model") from e
    eng: Engine
    if engine == "embedded":
        from tidal.engine.embedded import EmbeddedEngine

        eng = EmbeddedEngine(model, device=device, prefix_cache_mb=prefix_cache_mb)
    elif engine == "vllm":
        if not engine_url:
            raise typer.BadParameter("--engine vllm needs --engine-url", param_hint="--engine-url")
        from tidal.engine.vllm import VLLMEngine

        eng = VLLMEngine(engine_url, served_name or model)
    else:
        raise typer.BadParameter(f"unknown engine {engine!r}", param_hint="--engine")
    aliases = (model,) if model != eng.model_name else ()
    gw = Gateway(
        eng,
        load_tokenizer(model_dir),
        LedgerStore(store),
        model_aliases=aliases,
        default_max_tokens=max_tokens,
    )
    typer.echo(f"tidal gateway: http://127.0.0.1:{port}/v1  (sessions: /sessions/<id>/v1)")
    app = GatewayApp(gw)
    freeze_startup_heap()
    try:
        uvicorn.Server(uvicorn_config(app, "127.0.0.1", port)).run()
    finally:
        app.close()


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
