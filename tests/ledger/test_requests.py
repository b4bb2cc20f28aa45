"""A call's request messages and tools: stored as deltas (a session costs what its new
messages do), read back whole, carried by JSONL, covered by the hashes."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tidal.ledger import Call, LedgerError, LedgerStore
from tidal.ledger.interchange import export_jsonl, import_jsonl

from .helpers import growing_session

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def chat_session(session_id: str, n_calls: int) -> list[Call]:
    """A linear session whose every request repeats the last and adds the assistant's
    turn and a tool result (as an agent's client sends them); the tools change once."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Count the files."}]
    calls = []
    for i, c in enumerate(growing_session(session_id, n_calls)):
        tools = TOOLS if i < n_calls // 2 else [*TOOLS, {"type": "function", "function": {
            "name": "finish", "parameters": {"type": "object"}}}]
        args = json.dumps({"cmd": f"ls {i}"})
        calls.append(replace(c, messages=list(messages), tools=tools, tool_calls=[
            {"id": f"t{i}", "name": "bash", "arguments": args}]))
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"t{i}", "type": "function",
                 "function": {"name": "bash", "arguments": args}}]},
            {"role": "tool", "tool_call_id": f"t{i}", "content": f"file-{i}\n" * 3}]
    return calls


def _stored_messages(path: Path) -> int:
    with sqlite3.connect(path) as db:
        headers = [json.loads(h) for (h,) in db.execute("SELECT header FROM calls")]
    return sum(len(h["request"]["new"]) for h in headers if "request" in h)


def test_requests_are_stored_once_and_read_back_whole(tmp_path: Path) -> None:
    calls = chat_session("s1", 30)
    with LedgerStore(tmp_path / "l.db") as store:
        store.append_calls(calls)
        log = store.call_log("s1")
        for c in calls:
            got = log.full_call(c.call_id)
            assert got.messages == c.messages and got.tools == c.tools, c.call_id
        assert log["c0"].request is not None and log["c0"].request.base_call_id is None
        later = log["c20"].request
        assert later is not None and later.base_call_id == "c19" and later.keep == 2 + 2 * 19
        assert log["c20"].request.tools_from_base  # type: ignore[union-attr]
        assert not log["c15"].request.tools_from_base  # type: ignore[union-attr]  # changed
    # linear: each message once (the first call's two, then two a call), not the square
    assert calls[-1].messages is not None
    assert _stored_messages(tmp_path / "l.db") == len(calls[-1].messages)
    assert sum(len(c.messages or ()) for c in calls) > 10 * len(calls[-1].messages)


def test_a_rewritten_history_is_stored_from_where_it_differs(tmp_path: Path) -> None:
    calls = chat_session("s1", 6)
    last = calls[-1]
    assert last.messages is not None
    # a compacting client: the same system prompt, then a summary instead of the history
    compacted = [last.messages[0], {"role": "user", "content": "Summary: 5 files so far."}]
    fresh = replace(last, call_id="c6", messages=compacted,
                    prompt_ids=last.prompt_ids[:60], started_at=9.0, ended_at=9.5)
    with LedgerStore(tmp_path / "l.db") as store:
        store.append_calls([*calls, fresh])
        log = store.call_log("s1")
        assert log.full_call("c6").messages == compacted
        req = log["c6"].request
        assert req is not None and req.keep == 1 and req.new == compacted[1:]


def test_a_restarted_store_still_stores_a_delta(tmp_path: Path) -> None:
    calls = chat_session("s1", 8)
    with LedgerStore(tmp_path / "l.db") as store:
        store.append_calls(calls[:5])
    with LedgerStore(tmp_path / "l.db") as store:  # a new process: nothing remembered
        store.append_calls(calls[5:])
        req = store.call_log("s1")["c7"].request
        assert req is not None and req.base_call_id == "c6" and len(req.new) == 2
        assert store.call_log("s1").full_call("c7").messages == calls[7].messages
        assert store.check() == []


def test_jsonl_carries_requests_both_ways(tmp_path: Path) -> None:
    calls = chat_session("s1", 5)
    with LedgerStore(tmp_path / "a.db") as store:
        store.append_calls(calls)
        export_jsonl(store, tmp_path / "a.jsonl")
    lines = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert lines[1]["messages"] == calls[1].messages and lines[1]["tools"] == TOOLS
    with LedgerStore(tmp_path / "b.db") as store:
        import_jsonl(tmp_path / "a.jsonl", store)
        log = store.call_log("s1")
        assert [log.full_call(c.call_id).messages for c in calls] == [c.messages for c in calls]


def test_a_call_without_a_request_stays_without_one(tmp_path: Path) -> None:
    (plain,) = growing_session("s1", 1)
    with LedgerStore(tmp_path / "l.db") as store:
        store.append_call(plain)
        got = store.call_log("s1").full_call("c0")
    assert got.messages is None and got.tools is None
    with sqlite3.connect(tmp_path / "l.db") as db:
        (header,) = db.execute("SELECT header FROM calls").fetchone()
    assert "request" not in json.loads(header)  # a ledger without requests is unchanged


def test_an_altered_or_dangling_request_is_found(tmp_path: Path) -> None:
    with LedgerStore(tmp_path / "l.db") as store:
        store.append_calls(chat_session("s1", 4))
    with sqlite3.connect(tmp_path / "l.db") as db:
        db.execute("DROP TRIGGER calls_no_update")
        (header,) = db.execute("SELECT header FROM calls WHERE call_id='c2'").fetchone()
        h = json.loads(header)
        h["request"]["new"][0]["content"] = "an edited tool result"
        db.execute("UPDATE calls SET header=? WHERE call_id='c2'", (json.dumps(h),))
        (header,) = db.execute("SELECT header FROM calls WHERE call_id='c3'").fetchone()
        h = json.loads(header)
        h["request"]["keep"] = 99
        db.execute("UPDATE calls SET header=? WHERE call_id='c3'", (json.dumps(h),))
    with LedgerStore(tmp_path / "l.db", readonly=True) as store:
        problems = store.check()
    assert any("'c2'" in p and "content hash mismatch" in p for p in problems), problems
    assert any("'c3'" in p and "keeps 99 messages of 'c2', which has 6" in p
               for p in problems), problems


@pytest.mark.parametrize(("field", "value", "message"), [
    ("messages", "hello", "messages must be a list of objects or null"),
    ("messages", [{"content": "x"}], "every message must have a role"),
    ("tools", [1], "tools must be a list of objects or null")])
def test_a_malformed_request_is_refused(tmp_path: Path, field: str, value: Any,
                                        message: str) -> None:
    from .helpers import call_dict

    line = json.dumps(call_dict(**{field: value}))
    (tmp_path / "bad.jsonl").write_text(line + "\n")
    with LedgerStore(tmp_path / "l.db") as store, pytest.raises(LedgerError, match=message):
        import_jsonl(tmp_path / "bad.jsonl", store)
