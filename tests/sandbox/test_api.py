"""The everyday API: exec, files, lifecycle, concurrency, several sandboxes at once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from tidal.sandbox import (
    ExecResult,
    ExecStatus,
    FileEntry,
    Sandbox,
    SandboxConfig,
    SandboxStateError,
)


def test_exec_string_runs_in_shell_and_list_is_argv(sb: Sandbox) -> None:
    r = sb.exec("echo hello; echo oops >&2; exit 3")
    assert isinstance(r, ExecResult)
    assert (r.status, r.exit_code, r.stdout, r.stderr) == (
        ExecStatus.NONZERO_EXIT, 3, "hello\n", "oops\n")
    assert r.duration_s > 0 and not r.truncated and not r.ok
    r = sb.exec(["printf", "%s|", "a b", "$HOME"])  # no shell: no splitting, no expansion
    assert r.ok and r.stdout == "a b|$HOME|"
    with pytest.raises(AttributeError):
        r.stdout = "x"  # type: ignore[misc]  # frozen


def test_default_image_has_python_and_a_clean_environment(sb: Sandbox) -> None:
    r = sb.exec("python3 -c 'import sys, os; print(sys.version_info[:2] >= (3, 8)); "
                "print(os.getcwd(), os.environ[\"HOME\"], os.getuid())'")
    assert r.ok, r
    assert r.stdout.splitlines() == ["True", "/root /root 0"]
    env = sb.exec(["env"]).stdout
    assert "PYENV" not in env and "VIRTUAL_ENV" not in env
    assert sb.exec("command -v python3").stdout.strip() == "/usr/bin/python3"


def test_stdin_env_cwd_and_command_not_found(sb: Sandbox) -> None:
    assert sb.exec("tr a-z A-Z", stdin="shout\n").stdout == "SHOUT\n"
    big = b"x" * 300_000  # more than a pipe buffer
    assert sb.exec("wc -c", stdin=big).stdout.strip() == "300000"
    assert sb.exec("echo $FOO", env={"FOO": "bar"}).stdout == "bar\n"
    sb.exec("mkdir -p /work/sub")
    assert sb.exec("pwd", cwd="/work/sub").stdout == "/work/sub\n"
    r = sb.exec(["no-such-program"])
    assert r.exit_code == 127 and r.status is ExecStatus.NONZERO_EXIT


def test_files_roundtrip_and_list(sb: Sandbox) -> None:
    assert sb.write_file("notes/a.txt", "one\n") == 4  # parents made, relative to /root
    sb.write_file("/root/notes/b.bin", b"\x00\x01", mode=0o600)
    assert sb.read_file("notes/a.txt") == b"one\n"
    assert sb.read_text("/root/notes/a.txt") == "one\n"
    assert sb.exec("cat notes/a.txt; stat -c %a notes/b.bin").stdout == "one\n600\n"
    sb.exec("ln -s a.txt notes/link; mkdir notes/d")
    entries = sb.list("notes")
    assert [e.name for e in entries] == ["a.txt", "b.bin", "d", "link"]
    kinds = {e.name: e.kind for e in entries}
    assert kinds == {"a.txt": "file", "b.bin": "file", "d": "dir", "link": "symlink"}
    assert isinstance(entries[0], FileEntry) and entries[0].size == 4
    assert sb.read_file("notes/link") == b"one\n"  # followed, inside the sandbox
    sb.exec("echo two >> notes/a.txt")
    assert sb.read_file("notes/a.txt") == b"one\ntwo\n"
    with pytest.raises(FileNotFoundError):
        sb.read_file("notes/missing")
    with pytest.raises(IsADirectoryError):
        sb.read_file("notes/d")
    with pytest.raises(NotADirectoryError):
        sb.list("notes/a.txt")
    assert any(e.name == "python3" for e in sb.list("/usr/bin"))


def test_background_processes_persist_between_commands(sb: Sandbox) -> None:
    r = sb.exec("(sleep 60 >/dev/null 2>&1 &) ; echo started")
    assert r.ok and r.duration_s < 5
    ps = sb.exec("ps -eo comm").stdout.split()
    assert "sleep" in ps and "init" in ps


def test_writable_layer_is_fresh_per_sandbox(config: SandboxConfig) -> None:
    with Sandbox(config) as a, Sandbox(config) as b:
        a.exec("echo from-a > /tmp/mark; rm -f /etc/hosts")
        assert b.exec("cat /tmp/mark").exit_code != 0
        assert b.exec("cat /etc/hosts").ok
    with Sandbox(config) as c:
        assert c.exec("test -e /tmp/mark").exit_code == 1  # a new layer, every time


def test_parallel_commands_in_one_sandbox_and_several_sandboxes(config: SandboxConfig) -> None:
    with Sandbox(config) as s1, Sandbox(config) as s2:
        def run(i: int) -> str:
            s = (s1, s2)[i % 2]
            return s.exec(f"sleep 0.2; echo {i}").stdout
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(run, range(8)))
        assert outs == [f"{i}\n" for i in range(8)]
        assert len(s1.log) == 4 and len(s2.log) == 4


def test_lifecycle_errors(config: SandboxConfig) -> None:
    s = Sandbox(config)
    with pytest.raises(SandboxStateError, match="not started"):
        s.exec("true")
    with s:
        assert s.started
    assert s.closed
    with pytest.raises(SandboxStateError, match="closed"):
        s.exec("true")
    with pytest.raises(SandboxStateError, match="closed"):
        s.start()
    s.close()  # idempotent


def test_close_kills_everything_and_releases_resources(config: SandboxConfig) -> None:
    s = Sandbox(config).start()
    s.exec("(sleep 300 >/dev/null 2>&1 &)")
    box = s.box
    init, box_dir = box.init_pid, box.dir  # type: ignore[attr-defined]
    assert Path(f"/proc/{init}").exists()
    s.close()
    assert not Path(f"/proc/{init}").exists()
    assert not box_dir.exists()
    assert str(box_dir) not in Path("/proc/self/mounts").read_text()
    assert not any(Path("/sys/fs/cgroup").glob(f"*/tidal/{box.id}"))  # type: ignore[attr-defined]


def test_concurrent_close_while_a_command_runs(config: SandboxConfig) -> None:
    s = Sandbox(config).start()
    results: list[ExecResult] = []
    t = threading.Thread(target=lambda: results.append(s.exec("sleep 30")))
    t.start()
    time.sleep(0.5)
    s.close()
    t.join(timeout=20)
    assert not t.is_alive()
    assert results and results[0].exit_code != 0


def test_fallbacks_without_cgroups_or_the_static_init(config: SandboxConfig,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Where cgroup v1 or the x86-64 init is missing: rlimits, SIGSTOP, and the host's cat."""
    from tidal.sandbox import _linux, cgroups

    monkeypatch.setattr(cgroups, "v1_available", lambda: (False, "forced off"))
    monkeypatch.setattr(_linux, "init_elf", lambda: None)
    with Sandbox(config, limits=replace(config.limits, cpu_s=1.0)) as sb:
        assert sb.box.capabilities["limits"].startswith("rlimit fallback")
        assert sb.exec("echo hi").stdout == "hi\n"
        assert sb.exec("while :; do :; done").status is ExecStatus.CPU
        assert sb.exec(["sleep", "30"], timeout=1).status is ExecStatus.TIMEOUT
        assert sb.exec("yes").status is ExecStatus.OUTPUT_TRUNCATED
        sb.exec("(while :; do echo x >> /tmp/t; sleep 0.02; done) >/dev/null 2>&1 &")
        time.sleep(0.2)
        sb.pause()
        n = len(sb.read_file("/tmp/t"))
        time.sleep(0.3)
        assert len(sb.read_file("/tmp/t")) == n
        sb.resume()
        time.sleep(0.3)
        assert len(sb.read_file("/tmp/t")) > n
