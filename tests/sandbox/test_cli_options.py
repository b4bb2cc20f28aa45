"""`tidal sandbox run` with bad options (issue 27): refused before any sandbox starts,
exit 2, the message naming the option as the user typed it (`--timeout`, not the
`Limits.wall_s` behind it). Through the real `tidal` app (typer's CliRunner)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tidal.cli import app

runner = CliRunner()


@pytest.mark.parametrize(("args", "message"), [
    (["--timeout", "-1"], "--timeout must be a positive, finite number of seconds, got -1.0"),
    (["--timeout", "0"], "--timeout must be a positive, finite number of seconds, got 0.0"),
    (["--timeout", "nan"], "--timeout must be a positive, finite number of seconds, got nan"),
    (["--timeout", "inf"], "--timeout must be a positive, finite number of seconds, got inf"),
    (["--cpu-s", "-1"], "--cpu-s must be a positive, finite number of seconds, got -1.0"),
    (["--memory-mb", "-5"], "--memory-mb must be at least 8, got -5"),
    (["--memory-mb", "0"], "--memory-mb must be at least 8, got 0"),
    (["--pids", "0"], "--pids must be at least 4, got 0"),
    (["--allow-port", "70000"], "--allow-port 70000 is not a TCP port (1..65535)"),
    (["--allow-port", "0"], "--allow-port 0 is not a TCP port (1..65535)"),
])
def test_bad_option_names_the_option_typed(args: list[str], message: str) -> None:
    r = runner.invoke(app, ["sandbox", "run", *args, "--", "true"])
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert f"tidal sandbox: {message}" in r.output
    assert "Limits." not in r.output and "wall_s" not in r.output


def test_timeout_hit_says_the_limit_in_seconds() -> None:
    r = runner.invoke(app, ["sandbox", "run", "--timeout", "1", "--", "sleep 5"])
    assert r.exit_code == 137
    assert "killed at the wall-clock limit (1 s)" in r.output and "wall_s" not in r.output
