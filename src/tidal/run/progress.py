"""What a run shows and writes while it goes: progress, and metrics as JSON Lines
(`RUN_DIR/metrics.jsonl`, one row per warm start, RL step and evaluation) sent on, with
the same names, to every logger of `[log] backends` (`tidal.run.loggers`: TensorBoard by
default, W&B, MLflow).

On a terminal, progress is rich bars (on stderr); when stdout is not a terminal (CI,
`nohup`, a pipe, `> log`), plain lines on stdout, each flushed: one as each phase starts,
one per RL step, and for the other phases their first and last item and one line every
`PLAIN_EVERY_S` seconds between, so a log file reads as a timeline. (Stdout a terminal
and stderr not: the plain lines go to stderr.) `say` prints one such line at once (what
`tidal run` says while it starts).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tidal.run.loggers import Logger, LogStart, open_loggers, scalars

PLAIN_EVERY_S = 10.0


def say(text: str) -> None:
    """One timestamped plain line, flushed: on stdout when it is not a terminal (where
    plain progress lines go), else on stderr (beside the bars)."""
    stream = sys.stderr if sys.stdout.isatty() else sys.stdout
    print(f"{time.strftime('%H:%M:%S')} {text}", file=stream, flush=True)


class _Plain:
    """One phase's progress as plain lines (no terminal)."""

    def __init__(self, total: int, done: int) -> None:
        self.total, self.done = total, done
        self.t0 = time.monotonic()
        self.last = -PLAIN_EVERY_S
        self.info = ""  # what the last metrics row said (the RL bar's reward, success)


class RunLog:
    """metrics.jsonl, the loggers, and progress. `backends` start here: one that cannot
    is a `LoggerError` (raised before the run does anything else). A `console` given
    takes everything (bars when it is a terminal, else plain lines); by default bars and
    warnings go to stderr, and plain lines to stdout when it is not a terminal."""

    def __init__(self, run_dir: Path, *, total_steps: int, quiet: bool = False,
                 backends: tuple[str, ...] = ("tensorboard",),
                 start: LogStart | None = None, console: Console | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        start = start or LogStart.load(run_dir, name=run_dir.name, project="tidal", config={})
        self._loggers: list[tuple[str, Logger]] = open_loggers(backends, start)
        self._fh = self.path.open("a", encoding="utf-8")
        self._console = console or Console(stderr=True, quiet=quiet)
        self._out = self._console  # where plain lines go
        if console is None and not sys.stdout.isatty():
            self._out = Console(file=sys.stdout, quiet=quiet)
        self._bars = self._out is self._console and self._console.is_terminal
        self._progress = Progress(
            TextColumn("{task.description:<11}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=self._console,
            disable=not self._bars,
        )
        self._tasks: dict[str, Any] = {}
        self._plain: dict[str, _Plain] = {}
        self._total_steps = total_steps
        self._closed = False

    @contextlib.contextmanager
    def live(self) -> Iterator[None]:
        with self._progress:
            yield

    def phase(self, name: str, total: int, done: int = 0) -> None:
        self._plain[name] = _Plain(total, done)
        self._line(f"{name} {done}/{total}")
        if name in self._tasks:
            self._progress.reset(self._tasks[name], total=total, completed=done)
        else:
            self._tasks[name] = self._progress.add_task(name, total=total, completed=done, info="")

    def advance(self, name: str, **info: float) -> None:
        if name not in self._tasks:
            return
        text = " ".join(f"{k}={v:.3g}" for k, v in info.items())
        self._progress.update(self._tasks[name], advance=1)
        if text:
            self._progress.update(self._tasks[name], info=text)
        p = self._plain[name]
        p.done += 1
        now = time.monotonic()
        if name == "rl" or p.done in (1, p.total) or now - p.last >= PLAIN_EVERY_S:
            p.last = now
            self._line(f"{name} {p.done}/{p.total} {text or p.info}".rstrip()
                       + f" ({now - p.t0:.0f} s)")

    def _line(self, text: str) -> None:
        if not self._bars:
            self._out.print(f"{time.strftime('%H:%M:%S')} {text}", soft_wrap=True,
                            markup=False, highlight=False)

    def metrics(self, row: dict[str, Any]) -> None:
        row = {"time": time.time(), **row}
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()
        phase, step = str(row.get("phase", "x")), int(row.get("step", 0))
        values = scalars(row)
        for name, logger in list(self._loggers):
            try:
                logger.log(phase, step, values, row["time"])
            except Exception as e:  # a tracker that fails mid-run is dropped, not fatal
                self._loggers.remove((name, logger))
                self._console.print(f"warning: log.backends {name!r} failed at {phase} step "
                                    f"{step} and is off for the rest of the run: {e}",
                                    markup=False, highlight=False)
        if phase == "rl" and "rl" in self._tasks:
            info = f"reward={row['reward_mean']:.2f} success={row['success_rate']:.2f}"
            self._progress.update(self._tasks["rl"], info=info)
            self._plain["rl"].info = info
        elif phase == "eval":
            text = f"held-out success {row['success_rate']:.2%} at step {row['step']}"
            if self._bars:
                self._console.log(text)
            else:
                self._line(text)

    def close(self, failed: bool = False) -> None:
        """Closes metrics.jsonl and every logger (a failed run says so to W&B/MLflow);
        a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._fh.close()
        for _, logger in self._loggers:
            with contextlib.suppress(Exception):
                logger.close(failed=failed)
