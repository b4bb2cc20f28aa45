"""`tidal tasks ...`: check a directory of tasks in the Harbor format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from tidal.agent.taskcheck import TaskCheck

tasks_app = typer.Typer(help="Tasks in the Harbor format (docs/agent.md).", no_args_is_help=True)


def parse_images(pairs: list[str] | None) -> dict[str, str]:
    """`REF=DIR` pairs (the `--image` option) as the `[environment] images` map."""
    out = {}
    for pair in pairs or ():
        ref, sep, target = pair.partition("=")
        if not sep or not ref.strip() or not target.strip():
            raise typer.BadParameter(f"{pair!r} is not REF=DIR (e.g. ubuntu:24.04=/srv/rootfs)")
        out[ref.strip()] = target.strip()
    return out


@tasks_app.command("check")
def check_cmd(
    directory: Annotated[str, typer.Argument(
        help="A directory of task directories, one task, or a built-in set (swe-mini, "
             "shell-skills).")],
    *,
    image: Annotated[list[str] | None, typer.Option(
        "--image", help="REF=DIR: build FROM REF (or docker_image REF) on the image directory DIR, "
                        "or on tidal's default image with DIR = default (repeatable). With "
                        "--sandbox docker, REF=IMAGE: a local engine image.")] = None,
    sandbox: Annotated[str, typer.Option(
        help="bwrap: tidal's bubblewrap sandboxes, on environments tidal builds; docker: "
             "containers on a Docker-API engine (Docker, or podman's service: $DOCKER_HOST, "
             "else .ci/podman.sh's socket), environments built by the engine as written.",
    )] = "bwrap",
    fallback: Annotated[str | None, typer.Option(
        help="What an unmapped FROM gets: `default` (tidal's default image) or a directory; "
             "without it an unmapped FROM is an error.")] = None,
    cache_dir: Annotated[Path | None, typer.Option(
        "--cache-dir", help="Built environments (default: ~/.cache/tidal/envs).")] = None,
    jobs: Annotated[int, typer.Option(help="Tasks checked at once.")] = 2,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Every task's oracle must earn 1 and its untouched environment less than 1; exits
    1 naming each broken task and the file at fault."""
    from tidal.agent.environment import TaskRuntimes
    from tidal.agent.taskcheck import check_tasks
    from tidal.agent.tasks import TaskError
    from tidal.sandbox import SandboxError

    runtimes: TaskRuntimes
    try:
        if sandbox == "docker":
            from tidal.agent.containers import ContainerEnvironments, ContainerRuntimes, connect

            if fallback is not None:
                raise typer.BadParameter("--fallback is for --sandbox bwrap: with docker, map "
                                         "each FROM with --image REF=IMAGE")
            runtimes = ContainerRuntimes(ContainerEnvironments(connect(), parse_images(image)))
        elif sandbox == "bwrap":
            from tidal.agent.environment import Environments, SandboxRuntimes
            from tidal.agent.sandboxed import sandboxed_runtime
            from tidal.engine.tiny import default_cache_root
            from tidal.sandbox import Limits, SandboxConfig

            envs = Environments(parse_images(image), fallback,
                                cache_dir or default_cache_root() / "envs")
            runtimes = SandboxRuntimes(sandboxed_runtime, SandboxConfig(
                limits=Limits(cpu_s=3600.0, wall_s=3600.0)), envs)
        else:
            raise typer.BadParameter(f"--sandbox must be bwrap or docker, got {sandbox!r}")
        results = check_tasks(directory, runtimes, jobs=jobs)
    except (TaskError, SandboxError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    broken = [r for r in results if not r.ok]
    if as_json:
        typer.echo(json.dumps({"ok": not broken, "tasks": [r.to_dict() for r in results]},
                              indent=1))
    else:
        _table(results)
    for r in broken:
        for p in r.problems:
            typer.echo(f"broken: {r.task}: {p.file}: {p.problem}", err=True)
    if broken:
        raise typer.Exit(1)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _table(results: list[TaskCheck]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table("task", "oracle", "untouched", "verdict")
    for r in results:
        verdict = "ok" if r.ok else "; ".join(f"{p.file}: {p.problem}" for p in r.problems)
        if r.notes:
            verdict += "  (" + "; ".join(r.notes) + ")"
        t.add_row(r.task, _fmt(r.oracle_reward), _fmt(r.untouched_reward), verdict)
    Console(width=160).print(t)
    n_ok = sum(r.ok for r in results)
    typer.echo(f"{n_ok} of {len(results)} tasks ok")
