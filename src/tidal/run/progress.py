"""What a run shows and writes while it goes: rich progress bars, metrics as JSON Lines
(`RUN_DIR/metrics.jsonl`, one row per warm start, RL step and evaluation) and the same
numbers as TensorBoard scalars (`RUN_DIR/tb/`)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class RunLog:
    def __init__(self, run_dir: Path, *, total_steps: int, quiet: bool = False) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._fh = self.path.open("a", encoding="utf-8")
        self._console = Console(stderr=True, quiet=quiet)
        self._progress = Progress(
            TextColumn("{task.description:<11}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=self._console,
        )
        self._tasks: dict[str, Any] = {}
        self._total_steps = total_steps
        self._tb: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tb"))
        except ImportError:  # tensorboard is optional at run time
            self._tb = None

    @contextlib.contextmanager
    def live(self) -> Iterator[None]:
        with self._progress:
            yield

    def phase(self, name: str, total: int, done: int = 0) -> None:
        if name in self._tasks:
            self._progress.reset(self._tasks[name], total=total, completed=done)
        else:
            self._tasks[name] = self._progress.add_task(name, total=total, completed=done, info="")

    def advance(self, name: str, **info: float) -> None:
        if name not in self._tasks:
            return
        text = " ".join(f"{k}={v:.3g}" for k, v in info.items())
        self._progress.update(self._tasks[name], advance=1, info=text)

    def metrics(self, row: dict[str, Any]) -> None:
        row = {"time": time.time(), **row}
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()
        if self._tb is not None:
            phase, step = row.get("phase", "x"), int(row.get("step", 0))
            for k, v in row.items():
                if isinstance(v, int | float) and not isinstance(v, bool) and k != "step":
                    self._tb.add_scalar(f"{phase}/{k}", v, step)
        if row.get("phase") == "rl" and "rl" in self._tasks:
            self._progress.update(
                self._tasks["rl"],
                info=f"reward={row['reward_mean']:.2f} success={row['success_rate']:.2f}",
            )
        elif row.get("phase") == "eval":
            self._console.log(
                f"held-out success {row['success_rate']:.2%} at step {row['step']}"
            )

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()
