"""`tidal simulate` with bad options (issue 27): each is a usage error (exit 2) naming the
option, before the simulation starts; never a traceback, and never a run that cannot end
(`nan` or `inf` hours). Through the real `tidal` app (typer's CliRunner), a real ledger
store for `--ledger`."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import typer
from click.testing import CliRunner, Result

from tidal.cli import app
from tidal.ledger import LedgerStore

runner = CliRunner()
CLI = typer.main.get_command(app)
SMALL = ["--json", "-n", "8", "--slots", "2", "--steps", "2"]


def flat(text: str) -> str:
    """The text of an error, rich's box and line wrapping taken out."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


def simulate(*args: str | Path) -> Result:
    res = runner.invoke(CLI, ["simulate", *SMALL, *(str(a) for a in args)])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output
    return res


@pytest.mark.parametrize(("args", "option", "message"), [
    (["--devices", "0"], "'--devices' / '-n'", "greater than or equal to 2"),
    (["-n", "1"], "'--devices' / '-n'", "greater than or equal to 2"),
    (["--slots", "0"], "'--slots'", "greater than or equal to 1"),
    (["--steps", "0"], "'--steps'", "greater than or equal to 1"),
    (["--batch", "-1"], "'--batch'", "greater than or equal to 0"),
    (["--staleness", "-1"], "'--staleness'", "greater than or equal to 0"),
    (["--seed", "-1"], "'--seed'", "greater than or equal to 0"),
    (["--sigma", "-1"], "--sigma", "must be a finite number >= 0, got -1.0"),
    (["--mean-hours", "0"], "--mean-hours", "must be a finite number > 0, got 0.0"),
    (["--mean-hours", "nan"], "--mean-hours", "got nan"),
    (["--mean-hours", "inf"], "--mean-hours", "got inf"),
    (["--tokens-per-s", "-5"], "--tokens-per-s", ">= 0"),
    (["--migrate-s", "-1"], "--migrate-s", ">= 0"),
    (["--switch-to-train-s", "inf"], "--switch-to-train-s", "got inf"),
    (["--ledger-mean-hours", "-1"], "--ledger-mean-hours", ">= 0"),
    (["--p99-hours", "1"], "--p99-hours", "must be above --mean-hours 2.0"),
    (["--staleness-rule", "foo"], "--staleness-rule", "'foo' is not one of drop, downweight"),
    (["--async-train", "8"], "--async-train", "leave no rollout device of --devices 8"),
    (["--ledger", "missing.db"], "--ledger", "no ledger store at missing.db"),
])
def test_bad_option_is_a_usage_error_naming_it(args: list[str], option: str,
                                               message: str) -> None:
    res = simulate(*args)
    text = flat(res.output)
    assert res.exit_code == 2, res.output
    assert f"Invalid value for {option}" in text and message in text


def test_ledger_that_is_not_sqlite_is_left_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_text("not a database\n" * 50)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    res = simulate("--ledger", path)
    assert res.exit_code == 2
    assert f"Invalid value for --ledger: {path}" in flat(res.output)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before


def test_ledger_with_no_calls(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    LedgerStore(path).close()
    res = simulate("--ledger", path)
    assert res.exit_code == 2
    assert "Invalid value for --ledger" in flat(res.output) and "no calls" in flat(res.output)


def test_ledger_that_is_a_directory(tmp_path: Path) -> None:
    res = simulate("--ledger", tmp_path)
    assert res.exit_code == 2
    assert f"Invalid value for --ledger: {tmp_path}" in flat(res.output)


def test_the_smallest_accepted_options_still_simulate() -> None:
    res = simulate("-n", "2", "--slots", "1", "--steps", "1", "--tokens-per-s", "0")
    assert res.exit_code == 0, res.output
