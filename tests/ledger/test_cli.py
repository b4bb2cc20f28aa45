"""`tidal ledger ...` through the real console entry point."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

from tidal.ledger import LedgerStore

from .helpers import call_dict, growing_session


def tidal(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tidal.cli", *args], check=False, capture_output=True, text=True,
        timeout=120,
    )


def test_import_stats_export_check(tmp_path: Path) -> None:
    with LedgerStore(tmp_path / "src.db") as s:
        for c in growing_session("s1", 5):
            s.append_call(c)
    r = tidal("ledger", "export", str(tmp_path / "src.db"), "--jsonl", str(tmp_path / "x.jsonl"))
    assert r.returncode == 0, r.stderr
    r = tidal("ledger", "import", str(tmp_path / "x.jsonl"), "--store", str(tmp_path / "d.db"))
    assert r.returncode == 0 and "imported 5 calls" in r.stdout
    r = tidal("ledger", "stats", str(tmp_path / "d.db"), "--json")
    st = json.loads(r.stdout)
    assert {"sessions", "calls", "unique_tokens", "prompt_tokens_total", "output_tokens",
            "bytes"} <= set(st)
    assert st["calls"] == 5 and st["sessions"] == 1
    assert tidal("ledger", "check", str(tmp_path / "d.db")).returncode == 0


def test_check_fails_naming_the_record(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    with LedgerStore(path) as s:
        for c in growing_session("s1", 4):
            s.append_call(c)
    db = sqlite3.connect(path)
    db.execute("DROP TRIGGER calls_no_update")
    db.execute("UPDATE calls SET output_logprobs = zeroblob(length(output_logprobs)) "
               "WHERE call_id = 'c2'")
    db.commit()
    db.close()
    r = tidal("ledger", "check", str(path))
    assert r.returncode == 1
    assert "call 'c2' of session 's1'" in r.stderr


def test_bad_import_exits_nonzero_with_line(tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps(call_dict()) + "\n" + json.dumps(call_dict("s1", "c1", role=5)) + "\n")
    r = tidal("ledger", "import", str(f), "--store", str(tmp_path / "d.db"))
    assert r.returncode == 2
    assert "line 2" in r.stderr and "role" in r.stderr
    with LedgerStore(tmp_path / "d.db") as s:
        assert s.count_calls() == 0
