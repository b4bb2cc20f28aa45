"""The `tidal` command: wiring only. Each package keeps its logic; this file parses
arguments, calls one function, prints the result and sets the exit code.

Heavy imports (torch, transformers, fastapi) happen inside the commands, so
`tidal --help` stays fast.
"""

from __future__ import annotations

import typer

from tidal.ledger.cli import ledger_app

app = typer.Typer(
    name="tidal",
    help="RL post-training for long-running, tool-using LLM agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(ledger_app, name="ledger")

# Each package registers its commands below, one line each (keep this file wiring only).
# --- commands: gateway/engine (issue 3) ---
# --- commands: tree (issue 4) ---
# --- commands: train (issue 5) ---
# --- commands: sandbox (issue 6) ---
# --- commands: run loop (issue 7) ---
# --- commands: schedule (issue 8) ---


def main() -> None:
    app()


if __name__ == "__main__":
    main()
