"""`tidal run` and `tidal report`.

`prepare_run` is everything `tidal run` checks before it loads a model or writes anything:
the config (a resumed run's own saved one), the run directory, the model. A run that
fails before it wrote its `config.toml` (it never started) leaves no run directory
behind that `tidal run` made.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from tidal.run.config import RunConfig

RUNS = Path("runs")


class RunInputError(ValueError):
    """A `tidal run` argument that cannot work; the message names it."""


@dataclass(frozen=True)
class Prepared:
    """What `tidal run` will run: the config, where, and where the config came from."""

    cfg: RunConfig
    out: Path
    source: str


def _newest_run(runs: Path) -> Path | None:
    found = sorted((p for p in runs.glob("*") if (p / "config.toml").exists()),
                   key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _check_out(out: Path) -> None:
    """`--out` is, or can be made as, a writable directory."""
    try:
        if out.exists() and not out.is_dir():
            raise RunInputError(f"--out {out} is a file, not a run directory")
        base = next(p for p in (out, *out.parents) if p.exists())
    except OSError as e:
        raise RunInputError(f"--out {out}: {e.strerror}") from None
    if not base.is_dir():
        raise RunInputError(f"--out {out}: {base} is a file, not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise RunInputError(f"--out {out}: {base} is not writable")


def _value_at(cfg: RunConfig, key: str) -> object:
    value: object = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


# keys a resumed run may change: where the trainer runs, not what it trains (its sharded
# state loads at any world size)
RESUME_LAYOUT = ("world_size", "nodes", "threads")


def _resumed_config(saved: Path, given: Path | None) -> RunConfig:
    """The run's own saved config; a CONFIG given with --resume must equal it, except
    for the trainer's layout (`train.world_size`, `nodes`, `threads`), which it sets."""
    from tidal.run.config import RunConfig, first_difference, load_config

    cfg = load_config(saved)
    if given is not None:
        other = load_config(given)
        layout = {k: getattr(other.train, k) for k in RESUME_LAYOUT}
        try:
            cfg = RunConfig.model_validate({**cfg.model_dump(),
                                            "train": {**cfg.train.model_dump(), **layout}})
        except ValueError as e:
            raise RunInputError(f"--resume with {given}: {e}") from None
        key = first_difference(other, cfg)
        if key is not None:
            here, there = _value_at(other, key), _value_at(cfg, key)
            raise RunInputError(
                f"--resume: {given} differs from the run's own config {saved} at {key} "
                f"({here!r} here, {there!r} saved); a resumed run keeps its config: leave "
                "CONFIG out, or start a new run with another --out"
            )
    return cfg


def _check_model(cfg: RunConfig) -> None:
    """`model.name` names a model there is (without building or loading it), and
    `model.device` a device there is."""
    from tidal.engine.pretrained import PRETRAINED
    from tidal.engine.tiny import TinyModelError, resolve_model

    name = cfg.model.name
    if name != "tiny" and name not in PRETRAINED:
        try:
            resolve_model(name)  # a local directory: only looked at
        except (TinyModelError, OSError, ValueError) as e:
            raise RunInputError(f"model.name: {e}") from None
    if cfg.model.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RunInputError("model.device = \"cuda\" but CUDA is not available here: use "
                                "\"auto\" or \"cpu\"")


def prepare_run(config: Path | None, out: Path | None, *, resume: bool,
                runs: Path = RUNS) -> Prepared:
    """Read and check everything `tidal run` needs before it loads a model. Raises
    ConfigError (the config) or RunInputError (an argument, the model)."""
    from tidal.run.config import load_config

    if resume and out is None:
        out = _newest_run(runs)
        if out is None:
            raise RunInputError(f"--resume found no run under {runs}/; pass --out")
    if out is not None:
        _check_out(out)
    if resume:
        assert out is not None
        saved = out / "config.toml"
        if not saved.is_file():
            raise RunInputError(f"--resume: nothing to resume in {out} (no config.toml: the "
                                "run never started)")
        cfg, source = _resumed_config(saved, config), str(saved)
    else:
        cfg, source = load_config(config), str(config) if config else "built-in default"
        if out is not None and (out / "config.toml").exists():
            raise RunInputError(f"--out {out} already holds a run: pass --resume or choose "
                                "another --out")
    _check_model(cfg)
    return Prepared(cfg, out or runs / time.strftime("run-%Y%m%d-%H%M%S"), source)


def _torchrun_rank() -> int:
    """This process's rank when torchrun started it (RANK and WORLD_SIZE set), else 0."""
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) <= 1:
        return 0
    return int(os.environ.get("RANK", "0"))


def _serve_rank(config: Path | None, out: Path | None, *, resume: bool, rank: int) -> None:
    """Rank > 0 of `tidal run` under torchrun: build the trainer rank 0 builds (the same
    config, the same checkpoint) and serve it; rank 0 runs everything else."""
    from tidal.engine.tiny import ensure_tiny, resolve_model
    from tidal.run import components
    from tidal.run.checkpoint import find_checkpoint
    from tidal.run.config import load_config
    from tidal.train.group import serve

    if out is None:
        raise RunInputError("tidal run under torchrun needs --out (every rank must find the "
                            "same run directory)")
    cfg = _resumed_config(out / "config.toml", config) if resume else load_config(config)
    ckpt = find_checkpoint(out) if resume else None
    base = ensure_tiny(seed=cfg.model.seed) if cfg.model.name == "tiny" else \
        resolve_model(cfg.model.name)
    device = components.resolve_device(cfg.model.device)
    spec = components.trainer_spec(cfg, ckpt or base, ckpt, device=device)
    serve(spec, rank, int(os.environ["WORLD_SIZE"]))


def _discard_unstarted(out: Path, made: bool) -> None:
    """Remove the run directory this command made for a run that never started (no
    config.toml yet), so that nothing is left to get in a retry's way."""
    if made and out.is_dir() and not (out / "config.toml").exists():
        shutil.rmtree(out, ignore_errors=True)


def run_cmd(
    config: Annotated[
        Path | None, typer.Argument(help="A TOML config (docs/config.md); default: built-in.")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Run directory (default: runs/<time>).")
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue a killed run from its last checkpoint, "
                           "with its own saved config.")
    ] = False,
) -> None:
    """Run the RL loop: warm start, rollouts through the gateway, tree training."""
    from tidal.run.config import ConfigError
    from tidal.run.progress import say

    rank = _torchrun_rank()
    if rank > 0:  # under torchrun: this process is one more trainer rank
        try:
            _serve_rank(config, out, resume=resume, rank=rank)
        except (ConfigError, RunInputError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from e
        return
    try:
        plan = prepare_run(config, out, resume=resume)
    except (ConfigError, RunInputError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    say(f"{'resuming' if resume else 'starting'} run {plan.out} (config: {plan.source}): "
        "loading tasks, model and engine")
    made = not plan.out.exists()
    from tidal.run.loop import RunError, run
    from tidal.run.stop import RunStopped, stop_on_signals
    from tidal.run.watch import watch_this_process

    watch_this_process()  # what the run starts ends with it, SIGKILL included
    try:
        with stop_on_signals(plan.cfg.stop_grace_s):
            summary = run(plan.cfg, plan.out, resume=resume)
    except RunStopped as e:
        _discard_unstarted(plan.out, made)
        resumable = (plan.out / "config.toml").exists()
        say(f"{e}: everything the run started is stopped"
            + (f"; continue with: tidal run --resume --out {plan.out}" if resumable else ""))
        sys.stdout.flush()
        sys.stderr.flush()
        # episode threads still in a sandbox command must not hold the exit: their
        # sandboxes die with this process (bubblewrap's --die-with-parent)
        os._exit(e.exit_code)
    except RunError as e:
        _discard_unstarted(plan.out, made)
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    except BaseException:
        _discard_unstarted(plan.out, made)
        raise
    typer.echo(json.dumps(summary))
    typer.echo(f"run directory: {plan.out}  (tidal report {plan.out} --html "
               f"{plan.out}/report.html)")


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
