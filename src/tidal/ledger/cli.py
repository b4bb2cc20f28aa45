"""`tidal ledger ...`: check, import, export and measure a ledger store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tidal.ledger.types import LedgerError

if TYPE_CHECKING:
    from tidal.ledger.store import LedgerStore

ledger_app = typer.Typer(
    help="Check, import, export and measure a ledger store.", no_args_is_help=True
)

StoreArg = Annotated[Path, typer.Argument(help="Path of the ledger store (a SQLite file).")]


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def _open(path: Path, *, readonly: bool = True) -> LedgerStore:
    from tidal.ledger.store import LedgerStore

    try:
        return LedgerStore(path, readonly=readonly)
    except LedgerError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e


@ledger_app.command("check")
def check_cmd(store: StoreArg) -> None:
    """Re-verify every record's hash, the hash chain and every prefix reference."""
    with _open(store) as s:
        problems = s.check()
        n = s.count_calls()
    if problems:
        for p in problems:
            typer.echo(f"CORRUPT {p}", err=True)
        typer.echo(f"{len(problems)} problem(s) in {store}", err=True)
        raise typer.Exit(1)
    typer.echo(f"ok: {n} calls verified in {store}")


@ledger_app.command("import")
def import_cmd(
    file: Annotated[Path, typer.Argument(help="A JSON Lines file (docs/ledger.md).")],
    store: Annotated[Path, typer.Option("--store", help="Store to append to (created if new).")],
) -> None:
    """Import a JSONL file: all of it, or nothing if any line is bad."""
    from tidal.ledger.interchange import import_jsonl

    with _open(store, readonly=False) as s:
        try:
            rep = import_jsonl(file, s)
        except LedgerError as e:
            _fail(str(e))
            return
    typer.echo(f"imported {rep.calls} calls and {rep.outcomes} outcomes into {store}")


@ledger_app.command("export")
def export_cmd(
    store: StoreArg,
    jsonl: Annotated[Path | None, typer.Option("--jsonl", help="Write JSON Lines here.")] = None,
    parquet: Annotated[
        Path | None, typer.Option("--parquet", help="Write calls/outcomes Parquet files here.")
    ] = None,
) -> None:
    """Export the store as JSON Lines and/or Parquet."""
    from tidal.ledger.interchange import export_jsonl, export_parquet

    if jsonl is None and parquet is None:
        _fail("give --jsonl FILE and/or --parquet DIR")
    with _open(store) as s:
        if jsonl is not None:
            typer.echo(f"wrote {export_jsonl(s, jsonl)} records to {jsonl}")
        if parquet is not None:
            counts = export_parquet(s, parquet)
            typer.echo(f"wrote {counts['calls']} calls, {counts['outcomes']} outcomes to {parquet}")


@ledger_app.command("stats")
def stats_cmd(
    store: StoreArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Sessions, calls, unique tokens stored, prompt tokens represented, bytes on disk."""
    with _open(store) as s:
        st = s.stats()
    if as_json:
        typer.echo(json.dumps(st))
    else:
        for k, v in st.items():
            typer.echo(f"{k:>20}: {v:,}")
