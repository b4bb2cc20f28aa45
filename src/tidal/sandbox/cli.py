"""`tidal sandbox ...`: try a sandbox by hand, check the machine, clean up.

A bad option is refused before any sandbox starts, naming the option as typed
(`--timeout`, not the `Limits` field behind it); exit 2 (docs/sandbox.md, "What bad input
gets").
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from tidal.sandbox import Limits

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
    from tidal.sandbox import Sandbox, SandboxConfig, SandboxError

    try:
        limits = _limits(timeout=timeout, memory_mb=memory_mb, pids=pids, cpu_s=cpu_s)
        for port in allow_port or ():
            if not 1 <= port <= 65535:
                raise ValueError(f"--allow-port {port} is not a TCP port (1..65535)")
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


def _limits(*, timeout: float, memory_mb: int, pids: int, cpu_s: float) -> Limits:
    """The `Limits` of these options, or ValueError naming the option as typed."""
    from tidal.sandbox import Limits

    for option, seconds in (("--timeout", timeout), ("--cpu-s", cpu_s)):
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"{option} must be a positive, finite number of seconds, got "
                             f"{seconds}")
    if memory_mb < 8:
        raise ValueError(f"--memory-mb must be at least 8, got {memory_mb}")
    if pids < 4:
        raise ValueError(f"--pids must be at least 4, got {pids}")
    return Limits(memory_bytes=memory_mb << 20, pids=pids, cpu_s=cpu_s, wall_s=timeout)


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
