"""Preemption without loss: a process running an episode is SIGKILLed during a model call,
during a command and between calls; another process (this one) resumes the episode from
its last snapshot. The resumed episode must leave the same files and see the same observations as
an uninterrupted one, with every model call in the ledger once and no command run twice.

The driver (tests/agent/preempt_driver.py) runs the real gateway, ledger, bubblewrap
sandbox and built-in harness, with a deterministic scripted policy, so the uninterrupted
run is the reference each resumed run must equal. The killed runs are driver processes;
the reference and the resumed runs are built in this process from the same parts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from tests.agent.preempt_driver import SESSION, TURNS, build
from tidal.gateway.verify import verify_store
from tidal.ledger import LedgerStore

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _driver(out: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "tests.agent.preempt_driver", str(out), *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _episode(out: Path, result: dict[str, Any]) -> dict[str, Any]:
    """What the episode left: its files, the observations (tool results) of its last
    prompt, its calls (prompt ids, output ids), and its outcome."""
    store = LedgerStore(out / "ledger.db")
    try:
        log = store.call_log(SESSION)
        calls = [(tuple(log.prompt_ids(sc.call_id).tolist()), tuple(sc.call.output_ids.tolist()))
                 for sc in log.calls]
        outcome = store.outcome(SESSION)
        assert outcome is not None
        ok = verify_store(store).ok
    finally:
        store.close()
    return {"calls": calls, "files": outcome.details["grader"]["files"],
            "status": outcome.status.value, "verify_ok": ok,
            "abandoned": outcome.details.get("abandoned_calls"),
            "result": result}


def _resume_here(out: Path) -> dict[str, Any]:
    """Resume what `out`'s live directory holds, in this process (another one than the
    killed driver), as `tidal run --resume` does."""
    parts = build(out, stall=None)
    try:
        (group,) = parts.live.pending()
        result = parts.rollouts.group([(parts.task, sid) for _t, sid in group.jobs],
                                      base_version=0, resume=group.key)
        (ep,) = result.value
        assert ep.status == "complete"
        assert parts.live.pending() == []  # the group is done: nothing left live
    finally:
        parts.close()
    return {"generated": parts.engine.calls, "snapshots": parts.live.snapshots}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("reference")
    parts = build(out, stall=None)
    try:
        parts.rollouts.group([(parts.task, SESSION)], base_version=0)
    finally:
        parts.close()
    return _episode(out, {"generated": parts.engine.calls, "snapshots": parts.live.snapshots})


def test_the_uninterrupted_episode_counts_to_six_once(reference: dict[str, Any]) -> None:
    log = reference["files"]["log.txt"].split()
    assert log == [f"{e}-{k}" for k in range(1, TURNS + 1) for e in ("start", "end")]
    assert reference["status"] == "complete" and reference["verify_ok"]
    assert len(reference["calls"]) == TURNS + 2  # six commands, read_file, finish
    assert reference["result"]["snapshots"] >= 1


@pytest.mark.parametrize("where", ["call", "command", "between"])
def test_a_killed_episode_resumes_to_the_uninterrupted_result(
    tmp_path: Path, reference: dict[str, Any], where: str
) -> None:
    p = _driver(tmp_path, "--stall", f"{where}:3")
    deadline = time.monotonic() + 180
    while not (tmp_path / "stalled").exists():
        assert p.poll() is None, p.communicate()[0].decode()[-3000:]
        assert time.monotonic() < deadline, "the driver never reached turn 3"
        time.sleep(0.05)
    time.sleep(0.5 if where == "command" else 0.2)  # inside the 3 s command's sleep
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert not (tmp_path / "result.json").exists()  # it really died mid-episode
    with LedgerStore(tmp_path / "ledger.db") as store:
        before = len(store.call_log(SESSION))
        assert store.outcome(SESSION) is None
    # the call in flight was never recorded; the others were
    assert before == (2 if where == "call" else 3)

    got = _episode(tmp_path, _resume_here(tmp_path))

    assert got["files"] == reference["files"]  # no command ran twice, none was lost
    assert got["calls"] == reference["calls"]  # each call once, the same prompts and answers
    assert got["status"] == "complete" and got["verify_ok"] and got["abandoned"] is None
    # the resumed process generated only the calls that were not recorded before the kill
    assert got["result"]["generated"] == len(reference["calls"]) - before


def test_a_preempted_group_moves_and_resumes_in_the_same_process(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """Migration's half of preemption: `Rollouts.preempt` saves and stops a live group
    mid-episode, `group(..., resume=key)` continues it (as on another device), and the
    episode ends as the uninterrupted one did, each call recorded once."""
    import threading

    from tidal.run.live import GroupPreempted

    parts = build(tmp_path, stall=None)
    try:
        errors: list[BaseException] = []

        def first() -> None:
            try:
                parts.rollouts.group([(parts.task, SESSION)], base_version=0)
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=first)
        t.start()
        deadline = time.monotonic() + 120
        while not (parts.store.has_session(SESSION)
                   and len(parts.store.call_log(SESSION)) >= 3):
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.02)
        assert parts.rollouts.preempt(SESSION) == 1
        t.join(timeout=120)
        assert len(errors) == 1 and isinstance(errors[0], GroupPreempted), errors
        assert parts.store.outcome(SESSION) is None  # stopped, not ended
        generated = parts.engine.calls
        result = parts.rollouts.group([(parts.task, SESSION)], base_version=0, resume=SESSION)
        (ep,) = result.value
        assert ep.status == "complete"
    finally:
        parts.close()
    got = _episode(tmp_path, result={"generated": parts.engine.calls})
    assert got["files"] == reference["files"] and got["calls"] == reference["calls"]
    assert got["verify_ok"] and got["abandoned"] is None
    # nothing generated twice: the engine sampled each recorded call once, in either half
    assert parts.engine.calls == len(reference["calls"]) and generated >= 3


def test_pending_counts_the_snapshot_on_disk_not_the_record(tmp_path: Path) -> None:
    """Killed after a snapshot is written (atomically) and before its record: the record
    still says 0 snapshots, but the resume restores the tar, so `snapshotted` lists it.
    A finished episode's leftovers and an episode never snapshotted are not listed."""
    from tidal.agent.environment import SandboxRuntimes
    from tidal.agent.preempt import EpisodeRecord, LiveEpisodes
    from tidal.agent.sandboxed import sandboxed_runtime

    with LedgerStore(tmp_path / "ledger.db") as store:
        live = LiveEpisodes(tmp_path / "live", store, None, SandboxRuntimes(sandboxed_runtime))
        key = live.open_group([("t", "s-a"), ("t", "s-b"), ("t", "s-c")])
        d = tmp_path / "live" / key
        for sid in ("s-a", "s-b"):
            (d / f"{sid}.json").write_text(json.dumps(asdict(EpisodeRecord(sid, "t"))))
        (d / "s-a.tar").write_bytes(b"a snapshot")
        live.done(key, "s-c", {"reward": 1.0})
        (group,) = live.pending()
    assert group.records["s-a"].snapshots == 0  # the record a snapshot short
    assert group.snapshotted == {"s-a"} and set(group.done) == {"s-c"}


def test_a_snapshot_that_cannot_be_restored_here_starts_the_episode_fresh(
        tmp_path: Path) -> None:
    """A resumed episode whose snapshot this machine cannot restore (damaged here; a
    container snapshot taken on another node's engine) starts in a fresh runtime, warned,
    its snapshot discarded, instead of failing the episode."""
    from tidal.agent.environment import SandboxRuntimes
    from tidal.agent.preempt import LiveEpisodes
    from tidal.agent.sandboxed import sandboxed_runtime
    from tidal.agent.tasks import FileChecks, FileExists, Task

    task = Task("t", "make x", FileChecks((FileExists("x"),)))
    with LedgerStore(tmp_path / "ledger.db") as store:
        live = LiveEpisodes(tmp_path / "live", store, None, SandboxRuntimes(sandboxed_runtime))
        key = live.open_group([("t", "s-a")])
        snap = tmp_path / "live" / key / "s-a.tar"
        snap.write_bytes(b"not a snapshot")
        with pytest.warns(RuntimeWarning, match="cannot be restored here"), \
                live.runtime(key, task, "s-a", resume=True) as (rt, used):
            assert used == 0.0 and rt.exec("echo fresh", 10).stdout == "fresh\n"
        assert not snap.exists()
        live.close()
