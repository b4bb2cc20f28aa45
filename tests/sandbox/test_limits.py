"""Each limit ends the command with its own status, never a hang, and the host and the
other sandboxes keep working. Limits are tight so the bombs stay small on a shared
2-core machine."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from tidal.sandbox import ExecStatus, Limits, Sandbox, SandboxConfig
from tidal.sandbox.types import truncation_marker

from .conftest import needs_cgroups

pytestmark = needs_cgroups

TIGHT = Limits(memory_bytes=64 << 20, pids=32, cpu_s=1.0, wall_s=20.0,
               output_bytes=32 * 1024, disk_bytes=32 << 20, file_bytes=1 << 20)


@pytest.fixture
def tight(config: SandboxConfig) -> SandboxConfig:
    return replace(config, limits=TIGHT)


def _healthy(sb: Sandbox) -> None:
    r = sb.exec("echo ok; ps -e | wc -l")
    assert r.ok and r.stdout.startswith("ok\n"), r
    assert int(r.stdout.split()[1]) < 10  # nothing of the bomb is left


def test_fork_bomb_is_contained_and_reported(tight: SandboxConfig) -> None:
    with Sandbox(tight) as bomb, Sandbox(tight) as other:
        t = time.monotonic()
        r = bomb.exec(":(){ :|:& };:")
        assert r.status is ExecStatus.PIDS and "process limit (32)" in r.detail
        assert time.monotonic() - t < 15
        _healthy(bomb)
        _healthy(other)
        r = bomb.exec("for i in $(seq 100); do sleep 5 & done; wait")  # a slower one
        assert r.status is ExecStatus.PIDS
        _healthy(bomb)


def test_memory_bomb_is_contained_and_reported(tight: SandboxConfig) -> None:
    with Sandbox(tight) as bomb, Sandbox(tight) as other:
        r = bomb.exec("python3 -c 'a = []\nwhile True: a.append(bytearray(1 << 20))'")
        assert r.status is ExecStatus.MEMORY and r.exit_code == 137, r
        assert "memory limit" in r.detail
        _healthy(bomb)
        _healthy(other)
        assert bomb.exec("python3 -c 'x = bytearray(16 << 20); print(len(x))'").ok  # under it


def test_infinite_loop_hits_the_cpu_limit(tight: SandboxConfig) -> None:
    with Sandbox(tight) as sb:
        r = sb.exec("while :; do :; done")
        assert r.status is ExecStatus.CPU and r.exit_code == 137, r
        assert "CPU time" in r.detail
        _healthy(sb)


def test_sleeping_command_hits_the_wall_clock_limit(tight: SandboxConfig) -> None:
    with Sandbox(tight) as sb:
        t = time.monotonic()
        r = sb.exec(["sleep", "60"], timeout=1.0)
        assert r.status is ExecStatus.TIMEOUT and r.exit_code == 137
        assert 0.9 < r.duration_s < 10 and time.monotonic() - t < 15
        r = sb.exec("sleep 60 | cat", timeout=1.0)  # the whole pipeline goes
        assert r.status is ExecStatus.TIMEOUT
        _healthy(sb)


def test_output_flood_is_truncated_with_a_marker(tight: SandboxConfig) -> None:
    with Sandbox(tight) as sb:
        r = sb.exec("yes")
        assert r.status is ExecStatus.OUTPUT_TRUNCATED and r.truncated
        assert r.stdout.endswith(truncation_marker(TIGHT.output_bytes))
        body = r.stdout[: -len(truncation_marker(TIGHT.output_bytes))]
        assert len(body.encode()) == TIGHT.output_bytes and set(body) == {"y", "\n"}
        r = sb.exec("yes 1>&2")
        assert r.status is ExecStatus.OUTPUT_TRUNCATED and r.stdout == ""
        assert "stderr" in r.detail
        _healthy(sb)


def test_disk_is_limited_by_the_layer_size(tight: SandboxConfig) -> None:
    with Sandbox(replace(tight, limits=replace(TIGHT, memory_bytes=256 << 20))) as sb:
        r = sb.exec("head -c 100M /dev/zero > /tmp/big")
        assert r.status is ExecStatus.NONZERO_EXIT and "No space left" in r.stderr
        assert sb.exec("rm /tmp/big && echo freed").stdout == "freed\n"


def test_pause_freezes_and_does_not_count_against_the_timeout(tight: SandboxConfig) -> None:
    import threading

    with Sandbox(tight) as sb:
        sb.exec("(while :; do echo x >> /tmp/ticks; sleep 0.02; done) >/dev/null 2>&1 &")
        time.sleep(0.3)
        sb.pause()
        assert sb.paused
        n1 = len(sb.read_file("/tmp/ticks"))
        time.sleep(0.5)
        assert len(sb.read_file("/tmp/ticks")) == n1  # frozen in place
        with pytest.raises(Exception, match="paused"):
            sb.exec("true")
        sb.resume()
        time.sleep(0.3)
        assert len(sb.read_file("/tmp/ticks")) > n1  # and it continued where it was

        out = []
        t = threading.Thread(target=lambda: out.append(sb.exec("sleep 1; echo done", timeout=2.5)))
        t.start()
        time.sleep(0.3)
        sb.pause()
        time.sleep(3.0)  # longer than what is left of the timeout
        sb.resume()
        t.join(timeout=20)
        assert out[0].ok and out[0].stdout == "done\n", out[0]
        assert out[0].duration_s < 2.5


def test_fork_bomb_started_in_the_background_is_killed_later(tight: SandboxConfig) -> None:
    with Sandbox(tight) as sb:
        r = sb.exec("(sleep 0.5; :(){ :|:& };:) >/dev/null 2>&1 &")
        assert r.ok  # the command itself returned at once
        deadline = time.monotonic() + 15
        while not sb.incidents and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sb.incidents and "hit the process limit and were killed" in sb.incidents[0]
        _healthy(sb)


def test_a_dead_pid1_is_a_clear_error(config: SandboxConfig) -> None:
    import os
    import signal

    from tidal.sandbox import SandboxStateError

    with Sandbox(config) as sb:
        os.kill(sb.box.init_pid, signal.SIGKILL)  # type: ignore[attr-defined]
        time.sleep(0.2)
        with pytest.raises(SandboxStateError, match="pid 1 is gone"):
            sb.exec("true")
