"""The logger seam (`[log] backends`), each backend for real: TensorBoard event files,
W&B offline (files under the run dir, no network), MLflow with a local file store, and a
user's own logger by module:attr. A backend that cannot start is a clear error naming
`log.backends` before the run does anything; one that fails mid-run is switched off.
Also: progress is plain lines without a terminal, rich bars on one."""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from tidal.run.config import ConfigError, dump_config, load_config, parse_config
from tidal.run.loggers import LogStart, flat_config, scalars
from tidal.run.loop import RunError, run
from tidal.run.progress import RunLog

ROWS: list[dict[str, Any]] = [
    {"phase": "warmstart", "step": 0, "loss_first": 12.5, "loss_last": 0.3, "seconds": 9.0},
    {"phase": "eval", "step": 0, "success_rate": 0.25, "checks": {"exists": 0.5, "equals": 0.25},
     "seconds": 3.0, "policy_version": 1},
    {"phase": "rl", "step": 1, "reward_mean": 0.4, "success_rate": 0.25,
     "statuses": {"complete": 3, "timeout": 1}, "staleness": [0, 1], "schedule_policy": "elastic",
     "rollout_tokens_per_s": 310.0, "train_tokens_per_s": 900.0, "verify": True},
    {"phase": "rl", "step": 2, "reward_mean": 0.6, "success_rate": 0.5,
     "statuses": {"complete": 4}, "staleness": [0], "schedule_policy": "elastic",
     "rollout_tokens_per_s": 330.0, "train_tokens_per_s": 950.0, "verify": True},
    {"phase": "eval", "step": 2, "success_rate": 0.5, "checks": {"exists": 1.0, "equals": 0.5},
     "seconds": 3.0, "policy_version": 3},
]
CONFIG = {"seed": 0, "rl": {"steps": 2, "lr": 1e-4}, "rollout": {"tools": ["finish"]}}


def _expected() -> dict[str, list[tuple[int, float]]]:
    """Every name each backend must show, with its (step, value) points."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in ROWS:
        for k, v in scalars(r).items():
            out.setdefault(k, []).append((r["step"], v))
    return out


def _write(run_dir: Path, backends: tuple[str, ...], *, resume: bool = False) -> None:
    start = LogStart.load(run_dir, name=run_dir.name, project="tidal-test", config=CONFIG,
                          resume=resume)
    log = RunLog(run_dir, total_steps=2, quiet=True, backends=backends, start=start)
    for r in ROWS:
        log.metrics(dict(r))
    log.close()


def test_scalars_keep_the_jsonl_names() -> None:
    assert scalars(ROWS[2]) == {
        "rl/reward_mean": 0.4, "rl/success_rate": 0.25, "rl/statuses/complete": 3.0,
        "rl/statuses/timeout": 1.0, "rl/rollout_tokens_per_s": 310.0,
        "rl/train_tokens_per_s": 900.0, "rl/verify": 1.0,
    }  # strings and lists (per-group staleness) stay in metrics.jsonl only
    assert dict(flat_config(CONFIG)) == {"seed": "0", "rl.steps": "2", "rl.lr": "0.0001",
                                         "rollout.tools": '["finish"]'}


def test_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _write(tmp_path, ("tensorboard",))
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    got = {tag: [(e.step, pytest.approx(e.value)) for e in acc.Scalars(tag)]
           for tag in acc.Tags()["scalars"]}
    assert got == _expected()
    assert "config" in "".join(acc.Tags()["tensors"])  # the run config as text


def test_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B in offline mode for real: the run's files are under RUN_DIR/wandb, with the
    config, and every metric in the run's history under its metrics.jsonl name."""
    from wandb.proto import wandb_internal_pb2

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    _write(tmp_path, ("wandb",))
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    run_id = json.loads((tmp_path / "loggers.json").read_text())["wandb_run_id"]
    assert run_dir.name.endswith(run_id)
    history: dict[str, list[tuple[int, float]]] = {}
    config: dict[str, Any] = {}
    for data in _wandb_records(run_dir / f"run-{run_id}.wandb"):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            items = {i.nested_key[0] if i.nested_key else i.key: json.loads(i.value_json)
                     for i in rec.history.item}
            phase = next(k.split("/")[0] for k in items if "/" in k)
            for k, v in items.items():
                if "/" in k and k != f"{phase}/step":
                    history.setdefault(k, []).append((items[f"{phase}/step"], v))
        elif rec.WhichOneof("record_type") in ("run", "config"):
            updates = rec.run.config.update if rec.HasField("run") else rec.config.update
            config.update((u.key, json.loads(u.value_json)) for u in updates)
    assert history == _expected()
    assert config["rl"] == CONFIG["rl"] and config["seed"] == 0


def _wandb_records(path: Path) -> list[bytes]:
    """The protobuf records of a .wandb file: a 7-byte header (":W&B", magic, version),
    then LevelDB-log framing in 32 KiB blocks (crc32, length, type; records split across
    blocks as first/middle/last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    out, pos, part = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:  # full
            out.append(payload)
        elif kind in (2, 3):  # first, middle
            part += payload
        elif kind == 4:  # last
            out.append(part + payload)
            part = b""
    return out


def test_mlflow_file_store(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    _write(tmp_path, ("mlflow",))
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run_id = json.loads((tmp_path / "loggers.json").read_text())["mlflow_run_id"]
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED" and got.info.run_name == tmp_path.name
    assert got.data.params["rl.steps"] == "2"
    for name, points in _expected().items():
        hist = client.get_metric_history(run_id, name)
        assert [(m.step, pytest.approx(m.value)) for m in hist] == points, name
    # a resumed run goes on in the same MLflow run
    _write(tmp_path, ("mlflow",), resume=True)
    assert len(client.get_metric_history(run_id, "rl/reward_mean")) == 4
    assert len(client.search_runs([got.info.experiment_id])) == 1


class Recorder:
    """A user's own logger (`log.backends = ["tests.run.test_loggers:Recorder"]`)."""

    seen: list[tuple[str, int, dict[str, float]]] = []  # noqa: RUF012

    def __init__(self, start: LogStart) -> None:
        self.start = start

    def log(self, phase: str, step: int, scalars: Mapping[str, float], at: float) -> None:
        Recorder.seen.append((phase, step, dict(scalars)))

    def close(self, failed: bool = False) -> None:
        Recorder.seen.append(("closed", int(failed), {}))


class Broken(Recorder):
    def log(self, phase: str, step: int, scalars: Mapping[str, float], at: float) -> None:
        raise OSError("disk full")


def test_module_attr_logger_gets_the_same_names(tmp_path: Path) -> None:
    Recorder.seen = []
    _write(tmp_path, ("tests.run.test_loggers:Recorder",))
    assert [(p, s) for p, s, _ in Recorder.seen] == [
        *((r["phase"], r["step"]) for r in ROWS), ("closed", 0)]
    assert Recorder.seen[2][2] == scalars(ROWS[2])


def test_a_logger_failing_mid_run_is_switched_off(tmp_path: Path) -> None:
    out = io.StringIO()
    start = LogStart.load(tmp_path, name="r", project="p", config={})
    log = RunLog(tmp_path, total_steps=2, backends=("tests.run.test_loggers:Broken",),
                 start=start, console=Console(file=out, width=200))
    for r in ROWS:
        log.metrics(dict(r))
    log.close()
    assert out.getvalue().count("log.backends 'tests.run.test_loggers:Broken' failed") == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == len(ROWS)


@pytest.mark.parametrize(
    ("backends", "message"),
    [
        (["tensorboard", "comet"], "log.backends: 'comet' is neither a built-in"),
        (["wandb", "wandb"], "log.backends names a backend twice"),
        (["not a/module"], "log.backends: 'not a/module'"),
    ],
)
def test_bad_backend_names_fail_when_the_config_is_read(backends: list[str],
                                                        message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"log": {"backends": backends}})


def test_the_log_section_round_trips(tmp_path: Path) -> None:
    cfg = parse_config({"log": {"backends": ["tensorboard", "wandb", "mlflow"],
                                "project": "p"}})
    (tmp_path / "c.toml").write_text(dump_config(cfg))
    assert load_config(tmp_path / "c.toml") == cfg
    assert parse_config({}).log.backends == ("tensorboard",)


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("wandb", r"log\.backends: 'wandb' could not start: UsageError: No API key"),
        ("tests.run.nowhere:Logger", r"log\.backends 'tests\.run\.nowhere:Logger': cannot "
                                     "import"),
        ("tests.run.test_loggers:ROWS", "is not callable"),
    ],
)
def test_a_logger_that_cannot_start_stops_the_run_before_anything_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, message: str) -> None:
    """W&B online without credentials (no key, no network): the run refuses to start,
    naming the key and the backend; nothing was rolled out or recorded."""
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    cfg = parse_config({"log": {"backends": ["tensorboard", backend]},
                        "rollout": {"sandbox": "local"}})
    out = tmp_path / "run"
    with pytest.raises(RunError, match=message):
        run(cfg, out)
    assert not (out / "ledger.db").exists() and not (out / "config.toml").exists()


def test_progress_is_plain_lines_without_a_terminal(tmp_path: Path) -> None:
    out = io.StringIO()
    log = RunLog(tmp_path, total_steps=2, backends=(), console=Console(file=out, width=120))
    with log.live():
        log.phase("rl", 2)
        for r in ROWS[2:4]:
            log.metrics(dict(r))
            log.advance("rl")
        log.phase("eval", 3)
        for _ in range(3):
            log.advance("eval")
        log.metrics(dict(ROWS[4]))
    log.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" ", 1)[1].rsplit(" (", 1)[0] for line in lines] == [
        "rl 0/2", "rl 1/2 reward=0.40 success=0.25", "rl 2/2 reward=0.60 success=0.50",
        "eval 0/3", "eval 1/3", "eval 3/3", "held-out success 50.00% at step 2"]
    assert "\x1b[" not in out.getvalue()  # no escape codes in a log file


def test_progress_is_bars_on_a_terminal(tmp_path: Path) -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    log = RunLog(tmp_path, total_steps=2, backends=(), console=console)
    with log.live():
        log.phase("rl", 2)
        log.metrics(dict(ROWS[2]))
        log.advance("rl")
    log.close()
    text = out.getvalue()
    assert "━" in text and "1/2" in text and "reward=0.40" in text
    assert "rl 1/2 reward" not in text  # no plain lines besides the bars
