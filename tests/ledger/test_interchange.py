"""JSONL import/export: exact round trip, all-or-nothing imports, Parquet export."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tidal.ledger import LedgerError, LedgerStore, make_outcome
from tidal.ledger.interchange import export_jsonl, export_parquet, import_jsonl

from .helpers import call_dict, growing_session, mk_call


def _fill(store: LedgerStore) -> None:
    for c in growing_session("main-1", 8):
        store.append_call(c)
    store.append_call(mk_call("sub-1", "s0", role="subagent", parent_session_id="main-1",
                              parent_call_id="c3", raw_tool_calls='{"on": false}',
                              tool_calls=[{"name": "f", "arguments": {"on": False}}]))
    store.append_outcome(make_outcome({"session_id": "main-1", "status": "timeout",
                                       "reward": 0.25, "partial_score": 0.25,
                                       "details": {"checks": [True, False]}}))


def test_round_trip_is_exact(tmp_path: Path) -> None:
    with LedgerStore(tmp_path / "a.db") as a:
        _fill(a)
        export_jsonl(a, tmp_path / "a.jsonl")
        with LedgerStore(tmp_path / "b.db") as b:
            rep = import_jsonl(tmp_path / "a.jsonl", b)
            assert (rep.calls, rep.outcomes) == (9, 1)
            export_jsonl(b, tmp_path / "b.jsonl")
            assert b.check() == []
            for sid in a.session_ids():
                la, lb = a.call_log(sid), b.call_log(sid)
                for sc in la.calls:
                    ca, cb = la.full_call(sc.call_id), lb.full_call(sc.call_id)
                    assert np.array_equal(ca.prompt_ids, cb.prompt_ids)
                    assert np.array_equal(ca.output_logprobs, cb.output_logprobs)
            assert a.outcomes() == b.outcomes()
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()
    first = json.loads((tmp_path / "a.jsonl").read_text().splitlines()[0])
    contract = {"type", "session_id", "call_id", "role", "parent_call_id", "parent_session_id",
                "prompt_ids", "output_ids", "output_logprobs", "output_text", "raw_tool_calls",
                "tool_calls", "policy_version", "finish_reason", "started_at", "ended_at"}
    assert contract <= set(first)


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "line 3: not valid JSON"),
        ('["a list"]', "line 3: each line must be a JSON object"),
        ('{"type": "thing"}', 'line 3: "type" must be "call" or "outcome"'),
        (json.dumps(call_dict("s1", "c9", output_ids=[1])), "line 3: call 'c9'.*output_logprobs"),
        (json.dumps(call_dict("s1", "c9", parent_call_id="ghost")), "dangling parent"),
        (json.dumps({"type": "outcome", "session_id": "s1", "status": "won", "reward": 1}),
         "line 3: .*unknown status 'won'"),
        (json.dumps(call_dict("s1", "c0")), "line 3: call 'c0' of session 's1' appears twice"),
    ],
)
def test_import_refuses_bad_line_and_changes_nothing(
    tmp_path: Path, bad_line: str, message: str
) -> None:
    f = _write(tmp_path / "in.jsonl", [json.dumps(call_dict("s1", "c0")),
                                       json.dumps(call_dict("s1", "c1")), bad_line])
    with LedgerStore(tmp_path / "l.db") as store:
        store.append_call(mk_call("keep", "k0"))
        before = store.stats()
        with pytest.raises(LedgerError, match=message):
            import_jsonl(f, store)
        assert store.stats()["calls"] == before["calls"] == 1
        assert store.session_ids() == ["keep"]
        assert store.check() == []


def test_import_resolves_parents_within_the_file(tmp_path: Path) -> None:
    f = _write(tmp_path / "in.jsonl", [
        json.dumps(call_dict("p", "c0")),
        json.dumps(call_dict("child", "x0", parent_session_id="p", parent_call_id="c0")),
    ])
    with LedgerStore(tmp_path / "l.db") as store:
        assert import_jsonl(f, store).calls == 2


def test_parquet_export(tmp_path: Path) -> None:
    with LedgerStore(tmp_path / "a.db") as a:
        _fill(a)
        counts = export_parquet(a, tmp_path / "pq")
        log = a.call_log("main-1")
        want = log.prompt_ids("c5").tolist()
    assert counts == {"calls": 9, "outcomes": 1}
    t = pq.read_table(tmp_path / "pq" / "calls.parquet").to_pylist()
    row = next(r for r in t if r["call_id"] == "c5")
    assert row["prompt_ids"] == want
    sub = next(r for r in t if r["session_id"] == "sub-1")
    assert json.loads(sub["tool_calls"]) == [{"name": "f", "arguments": {"on": False}}]
    o = pq.read_table(tmp_path / "pq" / "outcomes.parquet").to_pylist()
    assert o[0]["status"] == "timeout" and o[0]["partial_score"] == 0.25
