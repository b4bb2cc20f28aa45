"""Crash safety (SIGKILL mid-write) and many concurrent writers, with real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from tidal.ledger import LedgerStore

from .helpers import growing_session

WRITER = r"""
import sys
import numpy as np
from tidal.ledger import LedgerStore, make_call
path, tag, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = LedgerStore(path)
rng = np.random.default_rng(abs(hash(tag)) % 2**32)
ctx = {s: rng.integers(0, 1000, 20).tolist() for s in ("a", "b", "shared")}
for i in range(n):
    sid = ("a", "b", "shared")[i % 3]
    session = "shared" if sid == "shared" else f"{tag}-{sid}"
    out = rng.integers(0, 1000, 30).tolist()
    store.append_call(make_call(dict(
        session_id=session, call_id=f"{tag}-{i}", role="main", prompt_ids=ctx[sid],
        output_ids=out, output_logprobs=[-1.0] * 30, output_text="x" * 2000,
        policy_version=0, finish_reason="stop", started_at=0.0, ended_at=1.0)))
    ctx[sid] = ctx[sid] + out + [1, 2, 3]
    print(f"committed {tag}-{i}", flush=True)
"""


def _spawn(path: Path, tag: str, n: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), tag, str(n)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONHASHSEED": "0"},
    )


def test_sigkill_during_writes_keeps_every_committed_call(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    proc = _spawn(path, "k", 100_000)
    assert proc.stdout is not None
    committed: list[str] = []
    deadline = time.time() + 60
    while len(committed) < 150 and time.time() < deadline:
        line = proc.stdout.readline()
        if line.startswith("committed "):
            committed.append(line.split()[1])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(committed) >= 150
    with LedgerStore(path) as store:
        assert store.check() == []
        stored = {sc.call_id for sc in store.iter_calls()}
        assert set(committed) <= stored
        for sid in store.session_ids():  # every prompt still reconstructs
            log = store.call_log(sid)
            for sc in log.calls:
                assert log.prompt_ids(sc.call_id).shape[0] == sc.prompt.prompt_len


def test_concurrent_processes_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    LedgerStore(path).close()
    procs = [_spawn(path, f"p{i}", 60) for i in range(4)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(o.count("committed") for o in outs) == 240
    with LedgerStore(path) as store:
        assert store.count_calls() == 240
        assert store.check() == []
        # the shared session was extended by 4 processes with stale caches: still exact
        log = store.call_log("shared")
        assert len(log) == 80
        assert all(log.prompt_ids(sc.call_id).shape[0] == sc.prompt.prompt_len for sc in log.calls)


def test_concurrent_threads_share_one_store(tmp_path: Path) -> None:
    sessions = [growing_session(f"t{i}", 25, seed=i) for i in range(8)]
    with LedgerStore(tmp_path / "l.db") as store:
        errors: list[BaseException] = []

        def work(calls: list) -> None:  # type: ignore[type-arg]
            try:
                for c in calls:
                    store.append_call(c)
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(s,)) for s in sessions]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert store.count_calls() == 200
        for calls in sessions:
            log = store.call_log(calls[0].session_id)
            for c in calls:
                assert np.array_equal(log.prompt_ids(c.call_id), c.prompt_ids)
