"""The `tidal` command: wiring only. Each package keeps its commands in its own cli.py;
this file names them. Heavy imports (torch, transformers, uvicorn, ray) happen inside
the commands, so `tidal --help` stays fast.
"""

from __future__ import annotations

import typer

from tidal.agent.cli import tasks_app
from tidal.gateway.cli import serve, verify
from tidal.ledger.cli import ledger_app
from tidal.run.cli import report_cmd, run_cmd
from tidal.sandbox.cli import sandbox_app
from tidal.schedule.cli import simulate
from tidal.tree.cli import inspect_cmd, trees_cmd

app = typer.Typer(
    name="tidal",
    help="RL post-training for long-running, tool-using LLM agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("run")(run_cmd)
app.command("report")(report_cmd)
app.command("serve")(serve)
app.command("verify")(verify)
app.command("trees")(trees_cmd)
app.command("inspect")(inspect_cmd)
app.command("simulate")(simulate)
app.add_typer(ledger_app, name="ledger")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(tasks_app, name="tasks")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
