"""LocalDirRuntime (real processes and files) and the session URL/header scheme."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tidal.agent.endpoint import SpawnLink, request_headers, session_base_url
from tidal.agent.runtime import LocalDirRuntime, RuntimeToolError, ToolRuntime


def test_local_runtime_satisfies_the_protocol(runtime: LocalDirRuntime) -> None:
    assert isinstance(runtime, ToolRuntime)


def test_exec_runs_in_the_root_and_captures_both_streams(runtime: LocalDirRuntime) -> None:
    r = runtime.exec("pwd; echo oops >&2; exit 5", timeout_s=10)
    assert r.exit_code == 5 and r.stdout.strip() == str(runtime.root)
    assert r.stderr == "oops\n" and not r.timed_out


def test_exec_timeout_kills_the_whole_process_group(runtime: LocalDirRuntime) -> None:
    r = runtime.exec("(sleep 30; echo late > late.txt) & sleep 30", timeout_s=0.5)
    assert r.timed_out and r.exit_code == 124
    assert not (runtime.root / "late.txt").exists()


def test_end_agent_kills_what_its_commands_left_running(runtime: LocalDirRuntime) -> None:
    r = runtime.exec("(sleep 1; echo late > late.txt) >/dev/null 2>&1 & echo started",
                     timeout_s=10)
    assert r.stdout == "started\n"
    assert runtime.end_agent(()) == "shared (a local directory: no pristine image)"
    time.sleep(1.5)
    assert not (runtime.root / "late.txt").exists()


def test_exec_output_is_capped(tmp_path: Path) -> None:
    rt = LocalDirRuntime(tmp_path, output_cap=100)
    r = rt.exec("head -c 5000 /dev/zero | tr '\\0' x", timeout_s=10)
    assert r.truncated and r.stdout.startswith("x" * 100)
    assert "4900 more characters cut" in r.stdout


def test_files_round_trip_and_list(runtime: LocalDirRuntime) -> None:
    runtime.write_file("/d/e/f.txt", "hi")  # absolute means under the root
    assert runtime.read_file("d/e/f.txt") == "hi"
    runtime.write_file("top.txt", "")
    assert runtime.list("/") == ["d/", "top.txt"]
    assert runtime.list("d") == ["e/"]


def test_bad_paths_and_requests_are_refused(runtime: LocalDirRuntime) -> None:
    with pytest.raises(RuntimeToolError, match="leaves the runtime's root"):
        runtime.write_file("a/../../x.txt", "no")
    with pytest.raises(RuntimeToolError, match="leaves the runtime's root"):
        runtime.read_file("../../etc/passwd")
    with pytest.raises(FileNotFoundError):
        runtime.read_file("nope.txt")
    with pytest.raises(RuntimeToolError, match="is a directory"):
        runtime.write_file("/", "x")
    with pytest.raises(RuntimeToolError, match="non-empty"):
        runtime.exec("  ", timeout_s=1)
    with pytest.raises(RuntimeToolError, match="timeout_s must be > 0"):
        runtime.exec("true", timeout_s=0)
    with pytest.raises(RuntimeToolError, match="not a directory"):
        LocalDirRuntime(runtime.root / "missing")


def test_session_urls_and_headers() -> None:
    assert session_base_url("http://h:1/", "s-1") == "http://h:1/sessions/s-1/v1"
    assert (
        session_base_url("http://h:1", "sub-2", SpawnLink("s-1", "c-7"))
        == "http://h:1/sessions/sub-2/parent/c-7/parent-session/s-1/v1"
    )
    with pytest.raises(ValueError, match="URL-path safe"):
        session_base_url("http://h:1", "a/b")
    with pytest.raises(ValueError, match="http"):
        session_base_url("h:1", "s")
    assert request_headers("main") == {"X-Tidal-Role": "main"}
    assert request_headers("main_summary", "t", "c-3") == {
        "X-Tidal-Role": "main_summary",
        "X-Tidal-Task": "t",
        "X-Tidal-Parent-Call": "c-3",
    }
