"""`tidal sandbox ...`: try a sandbox by hand, check the machine, clean up."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

sandbox_app = typer.Typer(
    help="Isolated episode sandboxes (bubblewrap + overlayfs + cgroups).",
    no_args_is_help=True,
)


@sandbox_app.command("run")
def run_cmd(
    command: Annotated[list[str], typer.Argument(
        help="The command, after `--`. One argument runs in the shell (`-- 'ls | wc -l'`); "
             "several are the argv (`-- ls -l /`).")],
    *,
    image: Annotated[Path | None, typer.Option(
        "--image", help="A directory to use as the read-only base image "
                        "(default: a view of the host's system directories).")] = None,
    timeout: Annotated[float, typer.Option(help="Wall-clock limit in seconds.")] = 120.0,
    memory_mb: Annotated[int, typer.Option("--memory-mb", help="Memory limit.")] = 1024,
    pids: Annotated[int, typer.Option(help="Process-count limit.")] = 256,
    cpu_s: Annotated[float, typer.Option("--cpu-s", help="CPU-time limit.")] = 60.0,
    allow_port: Annotated[list[int] | None, typer.Option(
        "--allow-port", help="A host loopback TCP port the command may reach (repeatable).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Run one command in a fresh sandbox and exit with its exit code."""
    from tidal.sandbox import Limits, Sandbox, SandboxConfig, SandboxError

    try:
        limits = Limits(memory_bytes=memory_mb << 20, pids=pids, cpu_s=cpu_s, wall_s=timeout)
        cfg = SandboxConfig(image=str(image) if image else None, limits=limits,
                            allow_ports=tuple(allow_port or ()))
        with Sandbox(cfg) as sb:
            r = sb.exec(command[0] if len(command) == 1 else command)
    except (SandboxError, ValueError, TypeError) as e:
        typer.echo(f"tidal sandbox: {e}", err=True)
        raise typer.Exit(2) from e
    if as_json:
        typer.echo(json.dumps(r.to_dict(), indent=2))
    else:
        sys.stdout.write(r.stdout)
        sys.stdout.flush()
        sys.stderr.write(r.stderr)
        if r.limit_hit:
            sys.stderr.write(f"[tidal sandbox: {r.status.value}: {r.detail}]\n")
        sys.stderr.flush()
    raise typer.Exit(r.exit_code)


@sandbox_app.command("check")
def check_cmd() -> None:
    """Say what works on this machine (bubblewrap, overlayfs, cgroups, CRIU, python3)."""
    from tidal.sandbox.local import environment_report

    rep = environment_report()
    for k, v in rep.items():
        typer.echo(f"{k:16} {v}")
    ok = all(rep[k].startswith("ok") for k in ("bubblewrap", "overlayfs"))
    raise typer.Exit(0 if ok else 1)


@sandbox_app.command("gc")
def gc_cmd() -> None:
    """Remove what sandboxes of dead processes left behind (mounts, cgroups, dirs)."""
    from tidal.sandbox.local import collect_garbage, state_root

    n = collect_garbage(state_root())
    typer.echo(f"removed {n} stale sandbox(es)")
