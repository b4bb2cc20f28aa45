"""`tidal trees` and `tidal inspect`: the trajectory processor from the command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from tidal.ledger.types import LedgerError
from tidal.tree.trie import TreeError

StoreArg = Annotated[Path, typer.Argument(help="Path of the ledger store (a SQLite file).")]


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def trees_cmd(
    store: StoreArg,
    *,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON, keyed by episode.")] = False,
    max_paths: Annotated[
        int, typer.Option("--max-paths", "-j", help="J: paths per episode (0: all).")
    ] = 5,
    order: Annotated[
        str, typer.Option(help="Within a role: coverage | longest | random.")
    ] = "coverage",
    seed: Annotated[int, typer.Option(help="Seed for --order random.")] = 0,
    incomplete: Annotated[
        str, typer.Option(help="timeout/truncated reward: partial | zero | mask.")
    ] = "partial",
    advantage: Annotated[str, typer.Option(help="GRPO baseline: mean | mean_std | none.")] = "mean",
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
                st, max_paths=max_paths or None, order=order, seed=seed, incomplete=incomplete,
                advantage=advantage, normalisation=normalisation,
                compaction_samples=compaction_samples, strict=strict,
                infer_compaction=infer_compaction,
            )
    except (TreeError, LedgerError, ValueError) as e:
        _fail(str(e))
        return
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
    max_paths: Annotated[int, typer.Option("--max-paths", "-j")] = 5,
    compaction_samples: Annotated[bool, typer.Option()] = False,
    infer_compaction: Annotated[bool, typer.Option()] = True,
) -> None:
    """Write a self-contained HTML page of one episode's trees."""
    from tidal.ledger.store import LedgerStore
    from tidal.tree.html import render_episode_html
    from tidal.tree.process import process_store

    try:
        with LedgerStore(store, readonly=True) as st:
            res = process_store(st, max_paths=max_paths or None, keep_graphs=True,
                                compaction_samples=compaction_samples,
                                infer_compaction=infer_compaction)
    except (TreeError, LedgerError, ValueError) as e:
        _fail(str(e))
        return
    for g, rep in zip(res.graphs, res.episodes, strict=True):
        if any(s.session_id == session for s in g.sessions):
            sids = {s.session_id for s in g.sessions}
            branches = [b for t in res.trees for b in t.branches if b.session_id in sids]
            html_path.write_text(render_episode_html(g, rep, branches), encoding="utf-8")
            typer.echo(f"wrote {html_path} (episode {g.episode_id})")
            return
    _fail(f"session {session!r} is not in {store}")
