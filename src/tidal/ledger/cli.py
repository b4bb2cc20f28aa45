"""`tidal ledger ...`: check, import, export and measure a ledger store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from tidal.ledger.types import LedgerError

if TYPE_CHECKING:
    from tidal.ledger.store import LedgerStore

ledger_app = typer.Typer(
    help="Check, import, export and measure a ledger store.", no_args_is_help=True
)

StoreArg = Annotated[Path, typer.Argument(help="Path of the ledger store (a SQLite file).")]


def _fail(msg: str) -> NoReturn:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def _open(path: Path, *, readonly: bool = True) -> LedgerStore:
    from tidal.ledger.store import LedgerStore

    try:
        return LedgerStore(path, readonly=readonly)
    except LedgerError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e


def orphan_notes(store: LedgerStore) -> list[str]:
    """One line per outcome whose session has no calls (readers skip them)."""
    return [
        f"note: outcome of session {sid!r} (seq {seq}, {status}) has no calls; readers "
        "skip it" for seq, sid, status in store.orphan_outcomes()
    ]


@ledger_app.command("check")
def check_cmd(store: StoreArg) -> None:
    """Re-verify every record's hash, the hash chain and every prefix reference."""
    with _open(store) as s:
        problems = s.check()
        n = s.count_calls()
        notes = orphan_notes(s)
    for note in notes:
        typer.echo(note, err=True)
    if problems:
        for p in problems:
            typer.echo(f"CORRUPT {p}", err=True)
        typer.echo(f"{len(problems)} problem(s) in {store}", err=True)
        raise typer.Exit(1)
    typer.echo(f"ok: {n} calls verified in {store}")


def _remove_new_store(path: Path, created_dirs: list[Path]) -> None:
    """Undo the creation of a store that a refused import made: its files, then the
    directories made for it (only while empty)."""
    for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        p.unlink(missing_ok=True)
    for d in created_dirs:  # deepest first
        try:
            d.rmdir()
        except OSError:
            break


@ledger_app.command("import")
def import_cmd(
    store: Annotated[Path, typer.Option("--store", help="Store to append to (created if new).")],
    file: Annotated[
        Path | None, typer.Argument(help="A JSON Lines file (docs/ledger.md).")
    ] = None,
    atif: Annotated[
        Path | None, typer.Option("--atif", help="Import the Harbor ATIF trajectories in this "
                                  "directory instead (docs/ledger.md).")
    ] = None,
    skip_untrainable: Annotated[
        bool, typer.Option("--skip-untrainable", help="With --atif: skip agent steps without "
                           "token ids or logprobs (noting each) instead of refusing them.")
    ] = False,
) -> None:
    """Import a JSONL file, or a directory of ATIF trajectories: all of it, or nothing if
    any of it is bad."""
    import sqlite3

    from tidal.ledger.atif_import import append_atif, read_atif
    from tidal.ledger.interchange import ImportReport, import_records, parse_jsonl

    if (file is None) == (atif is None):
        _fail("give a JSONL FILE or --atif DIR (one of them)")
    if skip_untrainable and atif is None:
        _fail("--skip-untrainable goes with --atif DIR")
    source = file if file is not None else atif
    try:  # all of it read and checked before the store exists: a bad input creates nothing
        if file is not None:
            records = parse_jsonl(file)
        else:
            assert atif is not None
            trajectories = read_atif(atif, skip_untrainable=skip_untrainable)
            for note in trajectories.notes:
                typer.echo(f"note: {note}", err=True)
    except LedgerError as e:
        _fail(str(e))
    new = not store.exists()
    created = [d for d in store.absolute().parents if not d.exists()]
    s = _open(store, readonly=False)
    rep: ImportReport
    try:
        rep = import_records(records, s) if file is not None else append_atif(trajectories, s)
    except (LedgerError, sqlite3.Error) as e:
        empty = s.count_calls() == 0 and not s.outcomes()
        s.close()
        if new and empty:
            _remove_new_store(store, created)
        msg = str(e) if isinstance(e, LedgerError) else f"{source}: {e} (nothing was imported)"
        _fail(msg)
    finally:
        s.close()
    episodes = ""
    if atif is not None:
        n = trajectories.episodes
        episodes = f" ({n} episode{'' if n == 1 else 's'})"
    typer.echo(f"imported {rep.calls} calls and {rep.outcomes} outcomes{episodes} into {store}")


@ledger_app.command("export")
def export_cmd(
    store: StoreArg,
    jsonl: Annotated[Path | None, typer.Option("--jsonl", help="Write JSON Lines here.")] = None,
    parquet: Annotated[
        Path | None, typer.Option("--parquet", help="Write calls/outcomes Parquet files here.")
    ] = None,
    atif: Annotated[
        Path | None, typer.Option("--atif", help="Write one Harbor ATIF trajectory per "
                                  "episode here (docs/ledger.md).")
    ] = None,
) -> None:
    """Export the store as JSON Lines, Parquet and/or ATIF trajectories (refused if
    `check` finds it corrupt)."""
    from tidal.ledger.atif import write_atif
    from tidal.ledger.interchange import export_jsonl, export_parquet, writable_target

    if jsonl is None and parquet is None and atif is None:
        _fail("give --jsonl FILE, --parquet DIR and/or --atif DIR")
    try:
        if jsonl is not None:
            writable_target(jsonl)
        if parquet is not None:
            writable_target(parquet, directory=True)
        if atif is not None:
            writable_target(atif, directory=True)
    except LedgerError as e:
        _fail(str(e))
    with _open(store) as s:
        problems = s.check()
        if problems:
            for p in problems[:5]:
                typer.echo(f"CORRUPT {p}", err=True)
            typer.echo(
                f"error: {store} is corrupt ({len(problems)} problem(s)); nothing was "
                f"exported (`tidal ledger check {store}` lists them all)", err=True,
            )
            raise typer.Exit(1)
        try:
            if jsonl is not None:
                typer.echo(f"wrote {export_jsonl(s, jsonl)} records to {jsonl}")
            if parquet is not None:
                counts = export_parquet(s, parquet)
                typer.echo(
                    f"wrote {counts['calls']} calls, {counts['outcomes']} outcomes to {parquet}"
                )
            if atif is not None:
                typer.echo(f"wrote {write_atif(s, atif)} episode trajectories to {atif}")
        except LedgerError as e:
            _fail(str(e))


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
