"""`tidal trees` and `tidal inspect`: the trajectory processor from the command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from tidal.ledger.types import LedgerError, short_repr
from tidal.tree.trie import TreeError

if TYPE_CHECKING:
    from tidal.ledger.store import LedgerStore

StoreArg = Annotated[Path, typer.Argument(help="Path of the ledger store (a SQLite file).")]


def _fail(msg: str) -> NoReturn:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def _sessions_with_calls(store: LedgerStore) -> list[str]:
    """The sessions to rebuild: all that have calls. An outcome whose session has none
    (a run's `infra_error` for a sandbox that failed first, or an older import) is
    skipped with a note, never an error: the store is append-only, so it stays."""
    for seq, sid, status in store.orphan_outcomes():
        typer.echo(
            f"note: skipped the outcome of session {sid!r} (seq {seq}, {status}): the "
            "session has no calls", err=True,
        )
    return store.session_ids()


def _html_target(path: Path) -> None:
    """Refuse an --html path that cannot be written, before the store is read."""
    if path.is_dir():
        _fail(f"cannot write {path}: it is a directory (give a file path for --html)")
    if not path.absolute().parent.is_dir():
        _fail(f"cannot write {path}: directory {path.absolute().parent} does not exist")


def trees_cmd(
    store: StoreArg,
    *,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON, keyed by episode.")] = False,
    max_paths: Annotated[
        int, typer.Option("--max-paths", "-j", min=0, help="J: paths per episode (0: all).")
    ] = 5,
    order: Annotated[
        str, typer.Option(help="Within a role: coverage | longest | random.")
    ] = "coverage",
    seed: Annotated[int, typer.Option(help="Seed for --order random.")] = 0,
    incomplete: Annotated[
        str, typer.Option(help="timeout/truncated reward: partial | zero | mask.")
    ] = "partial",
    advantage: Annotated[
        str, typer.Option(help="baseline: mean | mean_std | batch_mean | none.")
    ] = "mean",
    normalisation: Annotated[str, typer.Option(help="two_level | token | path.")] = "two_level",
    compaction_samples: Annotated[
        bool, typer.Option(help="Each summary call becomes its own sample.")
    ] = False,
    strict: Annotated[bool, typer.Option(help="Stop at the first malformed episode.")] = True,
    infer_compaction: Annotated[bool, typer.Option(
        help="Type a silent compaction by the summary its fresh context carries.")] = True,
) -> None:
    """Rebuild every episode's tree and print its shape, sampled paths, status and reward."""
    from tidal.ledger.store import LedgerStore
    from tidal.tree.process import process_store

    try:
        with LedgerStore(store, readonly=True) as st:
            res = process_store(
                st, _sessions_with_calls(st), max_paths=max_paths or None, order=order,
                seed=seed, incomplete=incomplete,
                advantage=advantage, normalisation=normalisation,
                compaction_samples=compaction_samples, strict=strict,
                infer_compaction=infer_compaction,
            )
    except (TreeError, LedgerError, ValueError) as e:
        _fail(str(e))
    if json_out:
        typer.echo(json.dumps(res.to_json(), indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("episode", "status", "reward", "calls", "nodes", "leaves", "unique", "paths",
                  "dedup", "edges", "sampled")
    for ep in res.episodes:
        table.add_row(
            ep.episode_id, ep.status, "masked" if ep.reward is None else f"{ep.reward:g}",
            str(ep.calls), str(ep.nodes), str(ep.leaves), str(ep.unique_tokens),
            str(ep.path_tokens), f"{ep.dedup_ratio:.2f}",
            " ".join(
                f"{k}={v}" + (f" ({ep.inferred_edges[k]} inferred)" if k in ep.inferred_edges
                              else "")
                for k, v in ep.edges.items()
            ),
            str(ep.sampled_paths),
        )
    Console().print(table)


def inspect_cmd(
    store: StoreArg,
    *,
    session: Annotated[str, typer.Option("--session", help="A session id (its episode is shown).")],
    html_path: Annotated[Path, typer.Option("--html", help="Where to write the HTML page.")],
    max_paths: Annotated[
        int, typer.Option("--max-paths", "-j", min=0, help="J: paths per episode (0: all).")
    ] = 5,
    compaction_samples: Annotated[bool, typer.Option()] = False,
    infer_compaction: Annotated[bool, typer.Option()] = True,
) -> None:
    """Write a self-contained HTML page of one episode's trees."""
    from tidal.ledger.store import LedgerStore
    from tidal.tree.html import render_episode_html
    from tidal.tree.process import process_store

    _html_target(html_path)
    try:
        with LedgerStore(store, readonly=True) as st:
            if not st.has_session(session) and st.outcome(session) is not None:
                _fail(f"session {short_repr(session)} has an outcome but no calls in {store}: "
                      "there is no tree to draw")
            res = process_store(st, _sessions_with_calls(st), max_paths=max_paths or None,
                                keep_graphs=True,
                                compaction_samples=compaction_samples,
                                infer_compaction=infer_compaction)
    except (TreeError, LedgerError, ValueError) as e:
        _fail(str(e))
    for g, rep in zip(res.graphs, res.episodes, strict=True):
        if any(s.session_id == session for s in g.sessions):
            sids = {s.session_id for s in g.sessions}
            branches = [b for t in res.trees for b in t.branches if b.session_id in sids]
            try:
                html_path.write_text(render_episode_html(g, rep, branches), encoding="utf-8")
            except OSError as e:
                _fail(f"cannot write {html_path}: {e.strerror or e}")
            typer.echo(f"wrote {html_path} (episode {g.episode_id})")
            return
    _fail(f"session {short_repr(session)} is not in {store}")
