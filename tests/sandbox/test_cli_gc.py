"""`tidal sandbox run/check/gc`, and cleanup after an owner that died without closing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tidal.cli import app
from tidal.sandbox.local import collect_garbage


def test_cli_run_shell_and_argv() -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["sandbox", "run", "--", "echo hi | tr a-z A-Z"])
    assert r.exit_code == 0 and r.stdout == "HI\n"
    r = runner.invoke(app, ["sandbox", "run", "--", "python3", "-c", "import sys; sys.exit(7)"])
    assert r.exit_code == 7
    r = runner.invoke(app, ["sandbox", "run", "--json", "--timeout", "1", "--", "sleep 5"])
    assert r.exit_code == 137 and json.loads(r.stdout)["status"] == "timeout"


def test_cli_run_with_image_and_bad_image(image: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["sandbox", "run", "--image", str(tmp_path / "nope"), "--", "ls"])
    assert r.exit_code == 2 and "does not exist" in r.output
    r = runner.invoke(app, ["sandbox", "run", "--image", str(image), "--", "/bin/true", "x"])
    assert r.exit_code == 127


def test_cli_check() -> None:
    r = CliRunner().invoke(app, ["sandbox", "check"])
    assert r.exit_code == 0, r.output
    assert "bubblewrap" in r.stdout and "memory_snapshot" in r.stdout


def test_dead_owner_leaves_nothing_running_and_gc_cleans_up(state_dir: Path) -> None:
    code = (
        "import json, os, sys\n"
        "from tidal.sandbox import Sandbox\n"
        "sb = Sandbox(state_dir=sys.argv[1]).start()\n"
        "sb.exec('(sleep 300 >/dev/null 2>&1 &)')\n"
        "b = sb.box\n"
        "print(json.dumps({'init': b.init_pid, 'dir': str(b.dir), 'id': b.id}), flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    p = subprocess.run([sys.executable, "-c", code, str(state_dir)], capture_output=True,
                       text=True, timeout=120, check=False)
    assert p.returncode == -9, p.stderr
    info = json.loads(p.stdout)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{info['init']}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{info['init']}").exists()  # its pid 1 died with its owner
    assert Path(info["dir"]).exists()
    assert collect_garbage(state_dir) >= 1
    assert not Path(info["dir"]).exists()
    assert info["dir"] not in Path("/proc/self/mounts").read_text()
    assert not any(Path("/sys/fs/cgroup").glob(f"*/tidal/{info['id']}"))


def test_gc_skips_a_box_that_vanishes_while_it_looks(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process's box can be closed (its dir removed) between gc listing it and
    reading it: gc skips it instead of failing the sandbox that called it (a resumed
    run's episode once became infra_error so)."""
    boxes = tmp_path / "boxes"
    boxes.mkdir()
    gone = boxes / "d8653192478c"  # listed, then removed by its owner
    listing = Path.iterdir

    def iterdir(self: Path) -> Iterator[Path]:
        yield from listing(self)
        if self == boxes:
            yield gone

    monkeypatch.setattr(Path, "iterdir", iterdir)
    assert collect_garbage(tmp_path) == 0
