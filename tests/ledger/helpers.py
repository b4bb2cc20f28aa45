"""Builders for ledger tests: valid call dicts that a test then breaks one field at a time."""

from __future__ import annotations

import hashlib
import sqlite3
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from tidal.ledger import Call, LedgerStore, make_call


def call_dict(session_id: str = "s1", call_id: str = "c0", **over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "type": "call",
        "session_id": session_id,
        "call_id": call_id,
        "role": "main",
        "parent_call_id": None,
        "parent_session_id": None,
        "prompt_ids": [1, 2, 3],
        "output_ids": [4, 5],
        "output_logprobs": [-0.5, -0.25],
        "output_text": "hi",
        "raw_tool_calls": None,
        "tool_calls": None,
        "policy_version": 0,
        "finish_reason": "stop",
        "started_at": 100.0,
        "ended_at": 101.5,
    }
    d.update(over)
    return d


def mk_call(session_id: str = "s1", call_id: str = "c0", **over: Any) -> Call:
    return make_call(call_dict(session_id, call_id, **over))


def growing_session(
    session_id: str, n_calls: int, out_len: int = 7, tool_len: int = 11, seed: int = 0
) -> list[Call]:
    """A linear agent session: each prompt = previous prompt + output + a tool result."""
    rng = np.random.default_rng(seed)
    ctx = rng.integers(0, 150_000, 50).astype(np.int32)
    calls = []
    for i in range(n_calls):
        out = rng.integers(0, 150_000, out_len).astype(np.int32)
        calls.append(
            mk_call(
                session_id, f"c{i}", prompt_ids=ctx, output_ids=out,
                output_logprobs=-rng.random(out_len).astype(np.float32),
                started_at=float(i), ended_at=float(i) + 0.5,
            )
        )
        ctx = np.concatenate([ctx, out, rng.integers(0, 150_000, tool_len).astype(np.int32)])
    return calls


def fill(store: LedgerStore) -> None:
    """A small store of every record kind: a growing main session with a task id, a
    subagent it spawned (parent links, tool calls, metadata), and their outcomes."""
    from tidal.ledger import make_outcome

    for c in growing_session("main-1", 4, out_len=3, tool_len=4):
        store.append_call(replace(c, task_id="task-1", sampling={"temperature": 1.0}))
    store.append_call(mk_call("sub-1", "s0", role="subagent", parent_session_id="main-1",
                              parent_call_id="c2", raw_tool_calls='{"on": false}',
                              tool_calls=[{"name": "f", "arguments": {"on": False}}],
                              metadata={"note": "ünïcode ✓", "n": [1, 2.5, None]}))
    store.append_outcome(make_outcome({"session_id": "main-1", "status": "timeout",
                                       "reward": 0.25, "partial_score": 0.25,
                                       "details": {"checks": [True, False]}}))
    store.append_outcome(make_outcome({"session_id": "sub-1", "status": "complete",
                                       "reward": 1.0}))


def fingerprint(path: Path) -> dict[str, tuple[int, int, str]]:
    """Every table's row count, max rowid and a hash of its rows, read through a fresh
    read-only connection: equal before and after means nothing was written."""
    db = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)
    try:
        tables = [r[0] for r in db.execute(
            "SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
        out = {}
        for t in tables:
            rows = db.execute(f"SELECT rowid, * FROM {t} ORDER BY rowid").fetchall()
            digest = hashlib.sha256(repr(rows).encode()).hexdigest()
            out[t] = (len(rows), max((r[0] for r in rows), default=0), digest)
        return out
    finally:
        db.close()


def table_counts(path: Path) -> dict[str, tuple[int, int]]:
    """Every table's row count and max rowid: a cheap fingerprint of an append-only store
    (its triggers refuse updates and deletes, so equal counts mean equal contents)."""
    db = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)
    try:
        tables = [r[0] for r in db.execute(
            "SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
        return {t: db.execute(f"SELECT COUNT(*), COALESCE(MAX(rowid), 0) FROM {t}").fetchone()
                for t in tables}
    finally:
        db.close()
