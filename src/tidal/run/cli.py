"""`tidal run` and `tidal report`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

RUNS = Path("runs")


def _newest_run() -> Path | None:
    runs = sorted((p for p in RUNS.glob("*") if (p / "config.toml").exists()),
                  key=lambda p: p.stat().st_mtime)
    return runs[-1] if runs else None


def run_cmd(
    config: Annotated[
        Path | None, typer.Argument(help="A TOML config (docs/config.md); default: built-in.")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Run directory (default: runs/<time>).")
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue a killed run from its last checkpoint.")
    ] = False,
) -> None:
    """Run the RL loop: warm start, rollouts through the gateway, tree training."""
    from tidal.run.config import ConfigError, load_config

    if resume and out is None:
        out = _newest_run()
        if out is None:
            typer.echo("error: --resume found no run under runs/; pass --out", err=True)
            raise typer.Exit(2)
        if config is None:
            config = out / "config.toml"
    try:
        cfg = load_config(config)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    out = out or RUNS / time.strftime("run-%Y%m%d-%H%M%S")
    from tidal.run.loop import RunError, run

    try:
        summary = run(cfg, out, resume=resume)
    except RunError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    typer.echo(json.dumps(summary))
    typer.echo(f"run directory: {out}  (tidal report {out} --html {out}/report.html)")


def report_cmd(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.")],
    html: Annotated[Path, typer.Option("--html", help="Where to write the page.")],
) -> None:
    """Write a self-contained HTML report of a run: curves, time split, sample trees."""
    try:
        from tidal.run.report import write_report
    except ImportError as e:  # matplotlib, the report extra, is missing
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    try:
        write_report(run_dir, html)
    except FileNotFoundError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    typer.echo(f"wrote {html}")
