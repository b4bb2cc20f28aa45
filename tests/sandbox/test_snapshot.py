"""Snapshot, restore and fast-forward: a resumed session gives the same files and the
same next observations as an uninterrupted one, and nothing runs twice."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tidal.sandbox import (
    ExecResult,
    MemorySnapshotUnavailableError,
    MemorySnapshotWarning,
    ReplayDivergenceError,
    Sandbox,
    SandboxConfig,
    SandboxError,
    Snapshot,
)
from tidal.sandbox.layer import FOOTER

BUMP = "n=$(cat counter); echo $((n+1)) > counter; echo $((n+1))"
STATE = ("cd /; find root etc/hosts etc/passwd usr/share/doc tmp -printf '%p %y %s %m\\n' "
         "2>&1 | sort; cat root/counter root/log.txt; md5sum root/d/e/f; stat -c %h root/hard; "
         "python3 -c \"import os; print(os.getxattr('/root/d/e/f', 'user.k'))\"")
# An episode's operations; SPLIT marks where the first run is preempted.
EPISODE: list[tuple[str, Any]] = [
    ("exec", "echo start > log.txt"),
    ("write", ("counter", "0")),
    ("exec", BUMP),
    ("exec", "echo appended >> log.txt; wc -l < log.txt"),
    ("exec", "rm -f /etc/hosts; rm -rf /usr/share/doc; mkdir /usr/share/doc; "  # opaque dir
             "echo new > /usr/share/doc/only; mkdir -p d/e; echo x > d/e/f; ln d/e/f hard; "
             "ln -s d/e/f soft; mkfifo pipe; python3 -c \"import os; "
             "os.setxattr('d/e/f', 'user.k', b'v')\""),
    ("read", "log.txt"),
    ("list", "."),
    ("exec", BUMP),
    ("exec", ["python3", "-c", "print(open('counter').read().strip())"]),
]
SPLIT = 6
TAIL: list[tuple[str, Any]] = [
    ("exec", BUMP),
    ("exec", "cat log.txt; ls /usr/share/doc; cat /etc/hosts; find d | sort; "
             "stat -c '%h %s' hard; readlink soft"),
    ("write", ("later.txt", "z")),
    ("exec", BUMP),
    ("exec", STATE),
]


def run(sb: Sandbox, ops: list[tuple[str, Any]]) -> list[Any]:
    out: list[Any] = []
    for op, arg in ops:
        if op == "exec":
            r = sb.exec(arg)
            out.append((r.status.value, r.exit_code, r.stdout, r.stderr))
        elif op == "write":
            out.append(sb.write_file(*arg))
        elif op == "read":
            out.append(sb.read_file(arg).decode())
        else:
            out.append([(e.name, e.kind, e.size) for e in sb.list(arg)])
    return out


def test_resumed_session_equals_uninterrupted(config: SandboxConfig, tmp_path: Path) -> None:
    with Sandbox(config) as a:
        expected = run(a, EPISODE + TAIL)
    assert expected[2][2] == "1\n" and expected[7][2] == "2\n" and expected[9][2] == "3\n"

    with Sandbox(config) as b:
        first = run(b, EPISODE[:SPLIT])
        snap = b.snapshot(tmp_path / "ep.tar")
    assert first == expected[:SPLIT]
    assert snap.log_len == SPLIT and snap.path.exists()

    c = Sandbox.restore(snap)
    try:
        assert c.replay_pending == SPLIT
        got = run(c, EPISODE + TAIL)  # the harness starts the episode over
        assert c.replay_pending == 0
        assert got == expected  # same observations, and the files: STATE is the last op
        assert [e.op for e in c.log[:SPLIT]] == ["exec", "write_file", "exec", "exec", "exec",
                                            "read_file"]
    finally:
        c.close()


def test_restore_in_another_process(config: SandboxConfig, tmp_path: Path) -> None:
    with Sandbox(config) as a:
        expected = run(a, EPISODE + TAIL)
    with Sandbox(config) as b:
        run(b, EPISODE[:SPLIT])
        snap = b.snapshot(tmp_path / "ep.tar", durable=True)
    ops = json.dumps(EPISODE + TAIL)
    code = (
        "import json, sys\n"
        "from tidal.sandbox import Sandbox\n"
        "sys.path.insert(0, sys.argv[3])\n"
        "from test_snapshot import run\n"
        "with Sandbox.restore(sys.argv[1]) as sb:\n"
        "    print(json.dumps(run(sb, [tuple(o) for o in json.loads(sys.argv[2])])))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(snap.path), ops,
                          str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout)
    assert got == json.loads(json.dumps(expected))


def test_replayed_results_are_marked_and_equal(config: SandboxConfig, tmp_path: Path) -> None:
    with Sandbox(config) as b:
        r1 = b.exec("echo once >> f; cat f")
        snap = b.snapshot(tmp_path / "s.tar")
    with Sandbox.restore(snap) as c:
        r2 = c.exec("echo once >> f; cat f")
        assert r2.replayed and not r1.replayed
        assert r2 == r1 and isinstance(r2, ExecResult)
        r3 = c.exec("cat f")  # past the log: live, and the append happened exactly once
        assert r3.stdout == "once\n" and not r3.replayed


def test_divergence_is_an_error_unless_lenient(config: SandboxConfig, tmp_path: Path) -> None:
    with Sandbox(config) as b:
        b.exec("echo 1 >> f")
        b.exec("echo 2 >> f")
        snap = b.snapshot(tmp_path / "s.tar")
    with Sandbox.restore(snap) as c, pytest.raises(ReplayDivergenceError, match="#0: exec"):
        c.exec("echo other")
    with Sandbox.restore(snap) as c:
        c.exec("echo 2 >> f")  # identical operations may come in another order
        c.exec("echo 1 >> f")
        assert c.exec("cat f").stdout == "1\n2\n"
    with Sandbox.restore(snap, strict=False) as c:
        assert c.exec("echo other").stdout == "other\n"


def test_snapshot_keeps_processes_running_and_works_paused(config: SandboxConfig,
                                                           tmp_path: Path) -> None:
    with Sandbox(config) as sb:
        sb.exec("(while :; do echo x >> /tmp/ticks; sleep 0.02; done) >/dev/null 2>&1 &")
        time.sleep(0.2)
        sb.snapshot(tmp_path / "a.tar")
        n = len(sb.read_file("/tmp/ticks"))
        time.sleep(0.3)
        assert len(sb.read_file("/tmp/ticks")) > n  # resumed after the copy
        sb.pause()
        snap = sb.snapshot(tmp_path / "b.tar")
        assert sb.paused  # still paused
        frozen = sb.read_file("/tmp/ticks")
        sb.resume()
    with Sandbox.restore(snap, strict=False) as c:  # look without replaying the episode
        assert c.exec("cat /tmp/ticks").stdout.encode() == frozen
        assert "sh" not in c.exec("ps -eo comm").stdout.split()  # processes are not carried


def test_memory_snapshot_falls_back_and_says_why(sb: Sandbox, tmp_path: Path) -> None:
    with pytest.warns(MemorySnapshotWarning, match="process memory is not captured"):
        snap = sb.snapshot(tmp_path / "m.tar", memory=True)
    assert snap.memory["captured"] is False and snap.memory["reason"]
    with pytest.raises(MemorySnapshotUnavailableError, match="cannot be snapshotted"):
        sb.snapshot(tmp_path / "m2.tar", require_memory=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sb.snapshot(tmp_path / "m3.tar")  # no warning without memory=True


def _rewrite_index(src: Path, dst: Path, edit: Any) -> None:
    """Copy a snapshot file with its JSON index changed by `edit` (a forged snapshot)."""
    raw = src.read_bytes()
    n, end = FOOTER.unpack(raw[-FOOTER.size:])
    index = json.loads(raw[-FOOTER.size - n:-FOOTER.size])
    edit(index)
    new = json.dumps(index).encode()
    dst.write_bytes(raw[:-FOOTER.size - n] + new + FOOTER.pack(len(new), end))


def test_snapshot_file_errors(config: SandboxConfig, tmp_path: Path, image: Path) -> None:
    with pytest.raises(SandboxError, match="does not exist"):
        Snapshot.load(tmp_path / "missing.tar")
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a snapshot at all" * 10)
    with pytest.raises(SandboxError, match="not a tidal sandbox snapshot"):
        Sandbox.restore(junk)
    with Sandbox(config) as sb:
        sb.exec("touch /usr/x; echo data > /root/f")
        snap = sb.snapshot(tmp_path / "s.tar")
    truncated = tmp_path / "trunc.tar"
    truncated.write_bytes(snap.path.read_bytes()[:-5])
    with pytest.raises(SandboxError, match="truncated or damaged"):
        Sandbox.restore(truncated)
    with pytest.raises(SandboxError, match="same image"):
        Sandbox.restore(snap, image=str(image))

    def entry(index: dict[str, Any], **kw: Any) -> dict[str, Any]:
        base = {"mode": 0o644, "uid": 0, "gid": 0, "mtime_ns": 0}
        return {**base, **kw}

    forgeries = {
        "unsafe path": lambda ix: ix["layers"]["root"].append(
            entry(ix, path="../../outside", type="file", offset=30, size=1)),
        "before its directory": lambda ix: ix["layers"]["root"].extend([
            entry(ix, path="esc", type="symlink", link="/etc"),
            entry(ix, path="esc/passwd", type="file", offset=30, size=1)]),
        "outside the data": lambda ix: ix["layers"]["root"].append(
            entry(ix, path="big", type="file", offset=30, size=10**9)),
        "unknown entry type": lambda ix: ix["layers"]["root"].append(
            entry(ix, path="dev", type="blockdev")),
    }
    for message, forge in forgeries.items():
        evil = tmp_path / "evil.tar"
        _rewrite_index(snap.path, evil, forge)
        with pytest.raises(SandboxError, match=message):
            Sandbox.restore(evil)
    assert not Path("/outside").exists()


def test_restored_sandbox_can_be_snapshotted_again(config: SandboxConfig, tmp_path: Path) -> None:
    with Sandbox(config) as a:
        a.exec("echo 1 >> f")
        s1 = a.snapshot(tmp_path / "1.tar")
    with Sandbox.restore(s1) as b:
        b.exec("echo 1 >> f")  # replayed
        b.exec("echo 2 >> f")  # live
        s2 = b.snapshot(tmp_path / "2.tar")
    assert s2.log_len == 2
    with Sandbox.restore(s2) as c:
        c.exec("echo 1 >> f")
        c.exec("echo 2 >> f")
        assert c.exec("cat f").stdout == "1\n2\n"
    assert replace(config).limits == Snapshot.load(s2.path).config.limits
