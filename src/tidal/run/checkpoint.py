"""Run-directory checkpoints: weights, optimizer, and the loop's progress, atomically.

A checkpoint is written to `checkpoint.tmp/` and renamed over `checkpoint/`, so a run
killed at any moment (SIGKILL included) leaves either the previous checkpoint or the new
one, never half of one. `RunState.trained_sessions` lists every session whose update is
in these weights: on `--resume`, committed sessions not in it are trained once, and
none in it is trained again.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

CHECKPOINT = "checkpoint"


@dataclass(frozen=True)
class RunState:
    step: int = 0  # RL steps completed
    policy_version: int = 0
    warmstart_done: bool = False
    success_rate_start: float | None = None
    elapsed_s: float = 0.0  # wall-clock of earlier attempts (before a resume)
    trained_sessions: tuple[str, ...] = ()
    dropped_sessions: tuple[str, ...] = ()  # scheduled but dropped (stale) or failed
    sessions: int = 0  # RL sessions rolled out
    task_signal: dict[str, tuple[int, int]] = field(default_factory=dict)  # curriculum.py
    demonstrated: tuple[str, ...] = ()  # training tasks the warm start imitated
    extra: dict[str, Any] = field(default_factory=dict)

    def advance(self, **changes: Any) -> RunState:
        return replace(self, **changes)


class Saves(Protocol):
    def save(self, out: Path) -> None: ...


def save_checkpoint(run_dir: Path, trainer: Saves, state: RunState) -> None:
    """`trainer.save` writes the weights (a transformers checkpoint: what the engine
    loads on resume) and the training state (`train_state/`: model and optimizer
    through torch.distributed.checkpoint, sharded when the trainer has ranks, loadable
    at any world size); then the loop's progress, and the atomic rename."""
    tmp = run_dir / f"{CHECKPOINT}.tmp"
    final = run_dir / CHECKPOINT
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    trainer.save(tmp)
    (tmp / "state.json").write_text(json.dumps(asdict(state), indent=1))
    old = run_dir / f"{CHECKPOINT}.old"
    if final.exists():
        if old.exists():  # a kill during the last save's cleanup left it, half removed
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)


def find_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (a kill between the two renames leaves `.old`)."""
    for name in (CHECKPOINT, f"{CHECKPOINT}.old"):
        p = run_dir / name
        if (p / "state.json").exists():
            return p
    return None


def load_state(ckpt: Path) -> RunState:
    d = json.loads((ckpt / "state.json").read_text())
    d["trained_sessions"] = tuple(d.get("trained_sessions", ()))
    d["dropped_sessions"] = tuple(d.get("dropped_sessions", ()))
    d["demonstrated"] = tuple(d.get("demonstrated", ()))
    d["task_signal"] = {t: (int(n), int(k)) for t, (n, k) in d.get("task_signal", {}).items()}
    return RunState(**d)
