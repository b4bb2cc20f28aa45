"""Bad input to `tidal run` and its config (issue 27): a clear message naming the file,
key or option, exit 2, never a traceback, and nothing written where nothing ran. Through
the real `tidal` app (typer's CliRunner, in process) and real files; every case is
refused before a model loads, except the one run that fails while it starts."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import typer
from click.testing import CliRunner, Result
from pydantic import BaseModel

from tidal.cli import app
from tidal.run.cli import RunInputError, prepare_run
from tidal.run.config import INT_MAX, ConfigError, RunConfig, load_config
from tidal.run.progress import RunLog, say

runner = CliRunner()
CLI = typer.main.get_command(app)


def tidal(*args: str | Path) -> Result:
    res = runner.invoke(CLI, [str(a) for a in args])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output
    return res


def write(path: Path, text: str | bytes) -> Path:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def saved_run(tmp_path: Path, name: str, text: str) -> Path:
    """A run directory as a started run leaves it, its config.toml written by hand."""
    out = tmp_path / name
    out.mkdir()
    write(out / "config.toml", text)
    return out


# ----------------------------------------------------------------- item 1: --resume


def test_resume_with_out_runs_the_saved_config(tmp_path: Path) -> None:
    out = saved_run(tmp_path, "run", "[rl]\nsteps = 7\n[tasks]\ntrain_size = 5\n")
    plan = prepare_run(None, out, resume=True)
    assert (plan.cfg.rl.steps, plan.cfg.tasks.train_size) == (7, 5)
    assert plan.out == out and plan.source == str(out / "config.toml")
    # the same config given again is fine
    same = write(tmp_path / "same.toml", "[tasks]\ntrain_size = 5\n[rl]\nsteps = 7\n")
    assert prepare_run(same, out, resume=True).cfg == plan.cfg


def test_resume_without_out_takes_the_newest_run(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    saved_run(runs, "a", "[rl]\nsteps = 3\n")
    newest = saved_run(runs, "b", "[rl]\nsteps = 4\n")
    plan = prepare_run(None, None, resume=True, runs=runs)
    assert plan.out == newest and plan.cfg.rl.steps == 4


def test_resume_with_a_different_config_is_refused_naming_the_key(tmp_path: Path) -> None:
    out = saved_run(tmp_path, "run", "[rl]\nsteps = 7\n")
    saved = (out / "config.toml").read_bytes()
    other = write(tmp_path / "other.toml", "[rl]\nsteps = 9\n")
    with pytest.raises(RunInputError, match=r"at rl\.steps \(9 here, 7 saved\)"):
        prepare_run(other, out, resume=True)
    res = tidal("run", other, "--out", out, "--resume")
    assert res.exit_code == 2
    assert "differs from the run's own config" in res.output and "rl.steps" in res.output
    assert (out / "config.toml").read_bytes() == saved  # the saved config is untouched
    assert sorted(p.name for p in out.iterdir()) == ["config.toml"]


def test_resume_where_there_is_no_run(tmp_path: Path) -> None:
    res = tidal("run", "--resume", "--out", tmp_path / "none")
    assert res.exit_code == 2 and "nothing to resume in" in res.output
    assert not (tmp_path / "none").exists()


def test_new_run_into_a_run_directory_is_refused(tmp_path: Path) -> None:
    out = saved_run(tmp_path, "run", "[rl]\nsteps = 7\n")
    res = tidal("run", "--out", out)
    assert res.exit_code == 2 and "already holds a run: pass --resume" in res.output


# ----------------------------------------------------------------- item 7: tracebacks


def test_non_utf8_config(tmp_path: Path) -> None:
    cfg = write(tmp_path / "c.toml", b"[rl]\nsteps = 3\n# caf\xe9\n")
    res = tidal("run", cfg, "--out", tmp_path / "run")
    assert res.exit_code == 2
    assert f"config {cfg} is not UTF-8 text" in res.output and "line 3" in res.output
    assert not (tmp_path / "run").exists()


def test_model_dir_that_does_not_exist(tmp_path: Path) -> None:
    cfg = write(tmp_path / "c.toml", f"[model]\nname = \"{tmp_path / 'no-model'}\"\n")
    for _ in range(2):  # refused before the run directory exists: a retry gets the same
        res = tidal("run", cfg, "--out", tmp_path / "run")
        assert res.exit_code == 2, res.output
        assert "model.name: no checkpoint directory at" in res.output
        assert not (tmp_path / "run").exists()


def test_model_dir_without_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "empty-model").mkdir()
    cfg = write(tmp_path / "c.toml", f"[model]\nname = \"{tmp_path / 'empty-model'}\"\n")
    res = tidal("run", cfg, "--out", tmp_path / "run")
    assert res.exit_code == 2 and "has no config.json" in res.output


def test_model_device_cuda_without_cuda(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    cfg = write(tmp_path / "c.toml", "[model]\ndevice = \"cuda\"\n")
    res = tidal("run", cfg, "--out", tmp_path / "run")
    assert res.exit_code == 2
    assert "model.device = \"cuda\" but CUDA is not available here" in res.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("under", [False, True])
def test_out_naming_a_file(tmp_path: Path, under: bool) -> None:
    f = write(tmp_path / "file", "precious")
    res = tidal("run", "--out", f / "run" if under else f)
    assert res.exit_code == 2
    assert "is a file, not a" in res.output and str(f) in res.output
    assert f.read_text() == "precious"


def test_a_run_that_fails_while_it_starts_leaves_no_run_dir(tmp_path: Path) -> None:
    """Past every check, the run fails while it starts (a task source that does not
    import): the directory it made is gone, and the same command fails the same way
    (not with 'already holds a run'). Says what it is doing as it starts, too."""
    cfg = write(tmp_path / "c.toml", "[tasks]\nsource = \"no_such_module_zz:tasks\"\n")
    out = tmp_path / "run"
    for _ in range(2):
        res = tidal("run", cfg, "--out", out)
        assert res.exit_code == 2, res.output
        assert f"starting run {out} (config: {cfg})" in res.output
        assert "tasks.source 'no_such_module_zz:tasks': cannot import" in res.output
        assert not out.exists()


def test_a_run_dir_made_beforehand_is_kept(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    cfg = write(tmp_path / "c.toml", "[tasks]\nsource = \"no_such_module_zz:tasks\"\n")
    assert tidal("run", cfg, "--out", out).exit_code == 2
    assert out.is_dir()  # not this command's to remove


# ----------------------------------------------------------------- item 9: strict values


def _int_fields() -> list[tuple[str, str]]:
    """(section or "", key) of every integer field of the config."""
    out = [("", name) for name, f in RunConfig.model_fields.items() if f.annotation is int]
    for name, f in RunConfig.model_fields.items():
        section = f.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            out += [(name, k) for k, g in section.model_fields.items() if g.annotation is int]
    return out


def _toml(section: str, key: str, value: str) -> str:
    return f"{key} = {value}\n" if not section else f"[{section}]\n{key} = {value}\n"


INT_FIELDS = _int_fields()


def test_every_int_field_is_found() -> None:
    assert {"seed", "rl.steps", "rollout.max_tokens", "model.seed"} <= {
        f"{s}.{k}".lstrip(".") for s, k in INT_FIELDS}


@pytest.mark.parametrize(("section", "key"), INT_FIELDS)
@pytest.mark.parametrize(("value", "messages"), [
    ("true", ["Input should be a valid integer (got true)"]),
    ("3.0", ["Input should be a valid integer (got 3.0)"]),
    ('"3"', ["Input should be a valid integer (got '3')"]),
    ("{a = 1}", ["Input should be a valid integer"]),
    # out of range: the common bound, or the field's own (tighter) one
    ("99999999999999999999", [f"out of range: at most {INT_MAX}", "less than or equal to"]),
    (str(INT_MAX + 1), [f"out of range: at most {INT_MAX}", "less than or equal to"]),
    (str(-INT_MAX - 1), [f"out of range: at most {INT_MAX}", "greater than or equal to"]),
])
def test_int_fields_refuse_bools_floats_strings_and_huge(
    tmp_path: Path, section: str, key: str, value: str, messages: list[str]
) -> None:
    path = write(tmp_path / "c.toml", _toml(section, key, value))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    dotted = f"{section}.{key}".lstrip(".")
    assert f"  {dotted}: " in str(e.value) and str(path) in str(e.value)
    assert any(m in str(e.value) for m in messages), str(e.value)


@pytest.mark.parametrize(("text", "message"), [
    ("[rl]\nlr = true\n", r"rl\.lr: Input should be a valid number \(got true\)"),
    ("[rl]\nlr = \"1e-3\"\n", r"rl\.lr: Input should be a valid number"),
    ("[tasks]\ntime_limit_s = inf\n", r"tasks\.time_limit_s: Input should be a finite number"),
    ("[rollout]\ntemperature = nan\n", r"rollout\.temperature: Input should be a finite"),
    ("[tasks]\ntime_limit_s = 1e300\n", r"tasks\.time_limit_s: Input should be less than"),
    ("[engine]\ntool_parser_strict = 1\n", r"engine\.tool_parser_strict: Input should be a "
                                           r"valid boolean"),
    ("[rollout]\ntools = \"finish\"\n", r"rollout\.tools: Input should be a valid tuple"),
    ("[rl.steps]\nx = 1\n", r"rl\.steps: Input should be a valid integer"),
])
def test_other_fields_read_strictly(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path / "c.toml", text))


def test_arrays_still_read_as_lists(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path / "c.toml", "[rollout]\ntools = [\"bash\", \"finish\"]\n"))
    assert cfg.rollout.tools == ("bash", "finish")


# ----------------------------------------------------------------- item 10: unclear


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_empty_config_is_refused_saying_how_to_get_the_default(tmp_path: Path,
                                                               text: str) -> None:
    cfg = write(tmp_path / "c.toml", text)
    res = tidal("run", cfg, "--out", tmp_path / "run")
    assert res.exit_code == 2
    assert f"config {cfg} sets nothing" in res.output
    assert "run `tidal run` without CONFIG" in res.output
    assert not (tmp_path / "run").exists()


def test_plain_progress_lines_on_stdout_when_it_is_not_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert not sys.stdout.isatty()  # pytest captures it
    say("starting run X")
    log = RunLog(tmp_path, total_steps=2, backends=())
    with log.live():
        log.phase("warm start", 2)
        log.advance("warm start", loss=1.5)
        log.phase("rl", 2)
        log.advance("rl")
    log.close()
    lines = [ln.split(" ", 1)[1] for ln in capsys.readouterr().out.splitlines()]
    assert [ln.rsplit(" (", 1)[0] for ln in lines] == [
        "starting run X", "warm start 0/2", "warm start 1/2 loss=1.5", "rl 0/2", "rl 1/2"]


def test_a_given_console_still_takes_everything(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from rich.console import Console

    buf = io.StringIO()
    log = RunLog(tmp_path, total_steps=1, backends=(), console=Console(file=buf, width=100))
    log.phase("rl", 1)
    log.close()
    assert "rl 0/1" in buf.getvalue() and capsys.readouterr().out == ""
