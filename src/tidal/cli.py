"""The `tidal` command: wiring only. Each package keeps its logic; this file parses
arguments, calls one function, prints the result and sets the exit code.

Heavy imports (torch, transformers, fastapi) happen inside the commands, so
`tidal --help` stays fast.
"""

from __future__ import annotations

import typer

from tidal.ledger.cli import ledger_app
from tidal.sandbox.cli import sandbox_app

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
from tidal.gateway.cli import serve, verify  # noqa: E402, I001
app.command("serve")(serve); app.command("verify")(verify)  # noqa: E702
# --- commands: tree (issue 4) ---
from tidal.tree.cli import inspect_cmd, trees_cmd  # noqa: E402, I001
app.command("trees")(trees_cmd); app.command("inspect")(inspect_cmd)  # noqa: E702
# --- commands: train (issue 5) ---
# --- commands: sandbox (issue 6) ---
app.add_typer(sandbox_app, name="sandbox")
# --- commands: run loop (issue 7) ---
from tidal.run.cli import report_cmd, run_cmd  # noqa: E402, I001
app.command("run")(run_cmd); app.command("report")(report_cmd)  # noqa: E702
# --- commands: schedule (issue 8) ---
from tidal.schedule.cli import simulate  # noqa: E402, I001
app.command("simulate")(simulate)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
