"""Where a run's metrics go besides `RUN_DIR/metrics.jsonl`: TensorBoard, W&B, MLflow, or
a logger of the user's own (`[log] backends`, docs/config.md).

One small seam, so the recipe never knows which trackers are on: `RunLog` flattens each
metrics row once (`scalars`: `phase/key`, a dict's entries as `phase/key/sub`) and hands
the same names and step to every `Logger`. A backend is a built-in name or `module:attr`
(a class or function taking a `LogStart` and returning a `Logger`), like the other seams
in `tidal.run.components`.

A backend that cannot start (package missing, bad credentials, unknown name) is a
`LoggerError` naming `log.backends` and the backend, raised before any rollout; names and
packages are checked when the config is read. One that fails mid-run is switched off with
a warning: a metrics sink never ends a long run.

- tensorboard: `RUN_DIR/tb/` (torch's SummaryWriter); the config as a text entry.
- wandb: `RUN_DIR/wandb/`; `WANDB_MODE=offline` keeps everything there (`wandb sync`
  uploads it later). Each phase's metrics are plotted against their own `phase/step`.
- mlflow: `log.mlflow_uri`, else `MLFLOW_TRACKING_URI`, else a local file store
  `RUN_DIR/mlruns` (`mlflow ui --backend-store-uri RUN_DIR/mlruns`); the config as params.
A resumed run (`--resume`) continues the same W&B and MLflow runs: their ids are kept in
`RUN_DIR/loggers.json`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tidal.run.names import ComponentError, is_attr, load_attr

BACKENDS: dict[str, str] = {  # built-in name -> the package it needs
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow",
}
_SKIP = ("phase", "step", "time")


class LoggerError(RuntimeError):
    """A logger could not start; the message names `log.backends` and the backend."""


@runtime_checkable
class Logger(Protocol):
    """Receives every metrics row as scalars named `phase/key` at the row's step."""

    def log(self, phase: str, step: int, scalars: Mapping[str, float], at: float) -> None: ...

    def close(self, failed: bool = False) -> None: ...


@dataclass
class LogStart:
    """What a logger is given when the run starts. `config` is the run config as nested
    plain data; `ids` persists small strings (a tracker's run id) across `--resume`."""

    run_dir: Path
    name: str
    project: str
    config: dict[str, Any]
    resume: bool = False
    mlflow_uri: str = ""
    ids: dict[str, str] = field(default_factory=dict)

    def remember(self, key: str, value: str) -> None:
        self.ids[key] = value
        (self.run_dir / "loggers.json").write_text(json.dumps(self.ids, indent=1))

    @classmethod
    def load(cls, run_dir: Path, **kw: Any) -> LogStart:
        path = run_dir / "loggers.json"
        ids = json.loads(path.read_text()) if path.exists() else {}
        return cls(run_dir=run_dir, ids=ids, **kw)


LoggerFactory = Callable[[LogStart], Logger]


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """A metrics row's numbers as `phase/key` (and `phase/key/sub` for a dict of
    numbers). Strings, lists and None stay in metrics.jsonl only; bools are 0/1."""
    phase = str(row.get("phase", "x"))
    out: dict[str, float] = {}
    for k, v in row.items():
        if k in _SKIP:
            continue
        if isinstance(v, dict):
            for sub, x in v.items():
                if _number(x):
                    out[f"{phase}/{k}/{sub}"] = float(x)
        elif _number(v):
            out[f"{phase}/{k}"] = float(v)
    return out


def _number(v: object) -> bool:
    return isinstance(v, int | float) and math.isfinite(v)


# --------------------------------------------------------------------------- checks


def check_backends(backends: tuple[str, ...]) -> None:
    """When the config is read: every name is a built-in or module:attr syntax (its
    package is looked for, or its module imported, when the run starts); no name twice."""
    for name in backends:
        if name not in BACKENDS and not is_attr(name):
            raise ValueError(f"log.backends: {name!r} is neither a built-in "
                             f"({', '.join(BACKENDS)}) nor module:attr")
    if len(set(backends)) != len(backends):
        raise ValueError(f"log.backends names a backend twice: {list(backends)}")


def resolve(name: str) -> LoggerFactory:
    """The factory behind a backend name."""
    builtin: dict[str, LoggerFactory] = {
        "tensorboard": TensorBoardLogger, "wandb": WandbLogger, "mlflow": MlflowLogger,
    }
    if name in builtin:
        package = BACKENDS[name]
        if importlib.util.find_spec(package) is None:
            raise LoggerError(f"log.backends: {name!r} needs the {package} package, which "
                              "is not installed (pip install 'tidal[log]')")
        return builtin[name]
    try:
        obj = load_attr(name, "log.backends")
    except ComponentError as e:
        raise LoggerError(str(e)) from None
    if not callable(obj):
        raise LoggerError(f"log.backends {name!r} is not callable (a Logger class or factory)")
    return obj


def open_loggers(backends: tuple[str, ...], start: LogStart) -> list[tuple[str, Logger]]:
    """Start every backend, in order; the first that cannot start closes those before it
    and raises a `LoggerError` naming it."""
    opened: list[tuple[str, Logger]] = []
    try:
        for name in backends:
            try:
                logger = resolve(name)(start)
            except LoggerError:
                raise
            except Exception as e:  # a tracker's own error types: say which and why
                raise LoggerError(f"log.backends: {name!r} could not start: "
                                  f"{type(e).__name__}: {e}") from e
            if not isinstance(logger, Logger):
                raise LoggerError(f"log.backends {name!r} returned {type(logger).__name__}, "
                                  "which has no log(phase, step, scalars, at) and close()")
            opened.append((name, logger))
    except BaseException:
        for _, lg in reversed(opened):
            lg.close(failed=True)
        raise
    return opened


def flat_config(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """`section.key` -> value as text (MLflow params)."""
    for k, v in config.items():
        if isinstance(v, Mapping) and v and prefix == "":
            yield from flat_config(v, f"{k}.")
        else:
            yield f"{prefix}{k}", v if isinstance(v, str) else json.dumps(v)


# --------------------------------------------------------------------------- built-ins


class TensorBoardLogger:
    """`RUN_DIR/tb/`, one scalar per name; the config as a text entry."""

    def __init__(self, start: LogStart) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(str(start.run_dir / "tb"))
        if not start.resume:
            text = json.dumps(start.config, indent=1)
            self._w.add_text("config", "    " + text.replace("\n", "\n    "), 0)

    def log(self, phase: str, step: int, scalars: Mapping[str, float], at: float) -> None:
        for k, v in scalars.items():
            self._w.add_scalar(k, v, step, walltime=at)

    def close(self, failed: bool = False) -> None:
        self._w.close()


class WandbLogger:
    """A W&B run under `RUN_DIR/wandb/`; `WANDB_MODE=offline` needs no account."""

    def __init__(self, start: LogStart) -> None:
        os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")  # no LLM-tracing suggestions
        import wandb

        run_id = start.ids.get("wandb_run_id") or secrets.token_hex(4)
        mode: Any = os.environ.get("WANDB_MODE")  # read now: wandb's settings outlive a run
        self._wandb = wandb
        self._run = wandb.init(
            project=start.project, name=start.name, id=run_id, dir=str(start.run_dir),
            config=start.config, resume="allow", reinit="create_new",
            mode=mode if mode in ("online", "offline", "disabled") else None,
            settings=wandb.Settings(console="off", silent=True, init_timeout=60),
        )
        start.remember("wandb_run_id", run_id)
        self._phases: set[str] = set()

    def log(self, phase: str, step: int, scalars: Mapping[str, float], at: float) -> None:
        if phase not in self._phases:  # each phase's curves against its own step
            self._run.define_metric(f"{phase}/step")
            self._run.define_metric(f"{phase}/*", step_metric=f"{phase}/step")
            self._phases.add(phase)
        self._run.log({**scalars, f"{phase}/step": step})

    def close(self, failed: bool = False) -> None:
        self._run.finish(exit_code=1 if failed else 0)
        self._wandb.teardown()  # its service and settings end with the run


_MLFLOW_KEY = re.compile(r"[^\w\-. :/]")


class MlflowLogger:
    """An MLflow run in the experiment `log.project`; by default a local file store."""

    def __init__(self, start: LogStart) -> None:
        uri = start.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        if not uri:
            uri = (start.run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 keeps its file store in maintenance mode behind this switch
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self._client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        run_id = start.ids.get("mlflow_run_id")
        if run_id is not None:
            self._client.update_run(run_id, status="RUNNING")
        else:
            exp = self._client.get_experiment_by_name(start.project)
            exp_id = exp.experiment_id if exp else self._client.create_experiment(start.project)
            run = self._client.create_run(exp_id, run_name=start.name,
                                          tags={"tidal.run_dir": str(start.run_dir.resolve())})
            run_id = run.info.run_id
            params = [Param(k, v[:6000]) for k, v in flat_config(start.config)]
            for i in range(0, len(params), 100):  # MLflow takes 100 params per batch
                self._client.log_batch(run_id, params=params[i:i + 100])
            start.remember("mlflow_run_id", run_id)
        self._run_id = run_id

    def log(self, phase: str, step: int, scalars: Mapping[str, float], at: float) -> None:
        ms = int(at * 1000)
        metrics = [self._metric(_MLFLOW_KEY.sub("_", k), v, ms, step) for k, v in scalars.items()]
        self._client.log_batch(self._run_id, metrics=metrics)

    def close(self, failed: bool = False) -> None:
        self._client.set_terminated(self._run_id, status="FAILED" if failed else "FINISHED",
                                    end_time=int(time.time() * 1000))
