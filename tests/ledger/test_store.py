"""The SQLite store: prefix deltas, append-only enforcement, integrity checks."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest

from tidal.ledger import Call, LedgerError, LedgerStore, Status, make_outcome
from tidal.ledger.store import common_prefix_len

from .helpers import growing_session, mk_call


def test_prefix_delta_reconstructs_every_prompt(tmp_path: Path) -> None:
    calls = growing_session("s1", 40)
    # a branch: same context as call 10, a different tool result
    branch_prompt = np.concatenate([calls[10].prompt_ids, calls[10].output_ids, [7, 7, 7]])
    calls.append(mk_call("s1", "branch", prompt_ids=branch_prompt.astype(np.int32)))
    # a retry of call 5 (same prompt), hinted at a call the cache no longer holds
    calls.append(mk_call("s1", "retry", prompt_ids=calls[5].prompt_ids))
    with LedgerStore(tmp_path / "l.db") as store:
        for c in calls[:-2]:
            store.append_call(c)
        store.append_call(calls[-2], base_hint="c10")
        store.append_call(calls[-1], base_hint="c5")
        log = store.call_log("s1")
        for c in calls:
            assert np.array_equal(log.prompt_ids(c.call_id), c.prompt_ids), c.call_id
            ctx = np.concatenate([c.prompt_ids, c.output_ids])
            assert np.array_equal(log.context_ids(c.call_id), ctx)
        assert log["branch"].prompt.base_call_id == "c10"
        assert log["branch"].prompt.suffix_ids.tolist() == [7, 7, 7]
        assert log["retry"].prompt.base_call_id == "c5"  # the hint wins a tie
        assert log["retry"].prompt.suffix_ids.size == 0
        st = store.stats()
    assert st["calls"] == 42
    assert st["prompt_tokens_total"] == sum(len(c.prompt_ids) for c in calls)
    # stored prompt tokens: only the suffixes (tool results), not whole prompts
    assert st["unique_tokens"] - st["output_tokens"] == 50 + 11 * 39 + 3 + 0
    assert st["unique_tokens"] < st["prompt_tokens_total"] / 5


def test_full_calls_round_trip_all_fields(tmp_path: Path) -> None:
    c = mk_call(
        raw_tool_calls='<tool_call>{"name": "f", "arguments": {"on": false}}</tool_call>',
        tool_calls=[{"id": "t1", "function": {"name": "f", "arguments": '{"on": false}'}}],
        task_id="task-1", sampling={"temperature": 1.0, "top_p": 1.0}, metadata={"k": [1, "é"]},
    )
    with LedgerStore(tmp_path / "l.db") as store:
        store.append_call(c)
    with LedgerStore(tmp_path / "l.db", readonly=True) as store:
        got = store.call_log("s1").full_call("c0")
    for field in ("raw_tool_calls", "tool_calls", "task_id", "sampling", "metadata",
                  "output_text", "policy_version", "started_at", "ended_at", "role"):
        assert getattr(got, field) == getattr(c, field), field
    assert got.output_logprobs.dtype == np.float32
    assert np.array_equal(got.output_logprobs, c.output_logprobs)


def test_append_only_enforced_by_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    with LedgerStore(path) as store:
        store.append_call(mk_call())
    db = sqlite3.connect(path)
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        db.execute("UPDATE calls SET role = 'subagent'")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        db.execute("DELETE FROM calls")
    db.close()


def _tamper(path: Path, sql: str) -> None:
    db = sqlite3.connect(path)
    db.execute("DROP TRIGGER calls_no_update")
    db.execute("DROP TRIGGER calls_no_delete")
    db.execute(sql)
    db.commit()
    db.close()


@pytest.mark.parametrize(
    ("sql", "expect"),
    [
        ("UPDATE calls SET output_ids = X'0100000002000000' WHERE call_id = 'c3'",
         "call 'c3' of session 's1' (seq 4): content hash mismatch"),
        ("UPDATE calls SET header = replace(header, '\"policy_version\":0', "
         "'\"policy_version\":9') WHERE call_id = 'c2'", "call 'c2'"),
        ("DELETE FROM calls WHERE call_id = 'c1'", "chain hash mismatch"),
        ("UPDATE calls SET base_call_id = 'nope' WHERE call_id = 'c4'", "call 'c4'"),
    ],
)
def test_check_names_the_corrupt_record(tmp_path: Path, sql: str, expect: str) -> None:
    path = tmp_path / "l.db"
    with LedgerStore(path) as store:
        for c in growing_session("s1", 6):
            store.append_call(c)
        assert store.check() == []
    _tamper(path, sql)
    with LedgerStore(path, readonly=True) as store:
        problems = store.check()
    assert problems, "corruption went unnoticed"
    assert any(expect in p for p in problems), problems


def test_duplicate_and_dangling_and_second_outcome(tmp_path: Path) -> None:
    with LedgerStore(tmp_path / "l.db") as store:
        store.append_call(mk_call())
        with pytest.raises(LedgerError, match="already in the ledger"):
            store.append_call(mk_call())
        with pytest.raises(LedgerError, match="dangling parent"):
            store.append_call(mk_call("sub", "x", parent_session_id="s1", parent_call_id="zz"))
        with pytest.raises(LedgerError, match="dangling parent"):
            store.append_call(mk_call("sub", "x", parent_session_id="nope"))
        store.append_call(mk_call("sub", "x", parent_session_id="s1", parent_call_id="c0"))
        store.append_outcome(make_outcome({"session_id": "s1", "status": "timeout",
                                           "reward": 0.0, "partial_score": 0.5}))
        with pytest.raises(LedgerError, match="already has an outcome"):
            store.append_outcome(make_outcome({"session_id": "s1", "status": "complete",
                                               "reward": 1.0}))
        o = store.outcome("s1")
        assert o is not None and o.status is Status.TIMEOUT and o.partial_score == 0.5
        assert store.count_calls() == 2
        info = {s.session_id: s for s in store.sessions()}
        assert info["sub"].parent_call_id == "c0" and info["sub"].parent_session_id == "s1"


def test_batch_append_is_all_or_nothing(tmp_path: Path) -> None:
    with LedgerStore(tmp_path / "l.db") as store:
        good = growing_session("s1", 3)
        bad = mk_call("s1", "c9", parent_call_id="missing")
        with pytest.raises(LedgerError):
            store.append_calls([*good, bad])
        assert store.count_calls() == 0
        store.append_calls(good)  # the writer's cache was reset: deltas stay correct
        log = store.call_log("s1")
        assert np.array_equal(log.prompt_ids("c2"), good[2].prompt_ids)


def test_not_a_store(tmp_path: Path) -> None:
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(LedgerError, match="not a readable tidal ledger"):
        LedgerStore(junk)
    with pytest.raises(LedgerError, match="no ledger store"):
        LedgerStore(tmp_path / "missing.db", readonly=True)


def test_second_process_continues_a_session(tmp_path: Path) -> None:
    calls = growing_session("s1", 6)
    with LedgerStore(tmp_path / "l.db") as a:
        for c in calls[:3]:
            a.append_call(c)
    with LedgerStore(tmp_path / "l.db") as b:  # fresh cache: seeds from the stored session
        for c in calls[3:]:
            sc = b.append_call(c)
            assert sc.prompt.base_call_id is not None
        assert b.check() == []
        log = b.call_log("s1")
        assert all(np.array_equal(log.prompt_ids(c.call_id), c.prompt_ids) for c in calls)


def test_common_prefix_len() -> None:
    a = np.array([1, 2, 3, 4], np.int32)
    assert common_prefix_len(a, a) == 4
    assert common_prefix_len(a, a[:2]) == 2
    assert common_prefix_len(a, np.array([1, 9], np.int32)) == 1
    assert common_prefix_len(a, np.zeros(0, np.int32)) == 0


def _reconstructs(store: LedgerStore, calls: list[Call]) -> bool:
    logs = {sid: store.call_log(sid) for sid in {c.session_id for c in calls}}
    return all(
        np.array_equal(logs[c.session_id].prompt_ids(c.call_id), c.prompt_ids) for c in calls
    )


def test_two_stores_on_one_file_interleave(tmp_path: Path) -> None:
    """Each store caches session rows and contexts; appends by the other must not break
    the chain, the deltas, the duplicate check or the session checks."""
    path = tmp_path / "l.db"
    shared = growing_session("shared", 8)
    own = {"a": growing_session("a", 4, seed=1), "b": growing_session("b", 4, seed=2)}
    with LedgerStore(path) as a, LedgerStore(path) as b:
        for i, c in enumerate(shared):
            store, name = (a, "a") if i % 2 == 0 else (b, "b")
            store.append_call(c, base_hint=f"c{i - 1}" if i else None)
            store.append_call(own[name][i // 2])
        a.append_call(mk_call("t", "c0", task_id="t1"))
        with pytest.raises(LedgerError, match="task_id"):  # b reads the row a wrote
            b.append_call(mk_call("t", "c1", task_id="t2"))
        b.append_call(mk_call("t", "c1", task_id="t1"))
        with pytest.raises(LedgerError, match="already in the ledger"):
            a.append_call(mk_call("t", "c1", task_id="t1"))
        a.append_call(mk_call("t", "c2", task_id="t1"))
        for store in (a, b):
            assert store.check() == []
            assert _reconstructs(store, [*shared, *own["a"], *own["b"]])
        assert b.count_calls() == 19


def test_branches_and_trims_reconstruct(tmp_path: Path) -> None:
    """Contexts share buffers: a regenerated prompt, a branch from an older call and a
    prompt that diverges inside the base context must each get its own exact delta, and
    no later write may alter an earlier call's cached context."""
    base = growing_session("s1", 4)
    p = base[3].prompt_ids
    extra = [
        mk_call("s1", "regen", prompt_ids=p, output_ids=[1, 2], output_logprobs=[-1.0, -1.0]),
        mk_call("s1", "old", prompt_ids=np.concatenate([base[1].prompt_ids, [5, 6]])),
        mk_call("s1", "trim", prompt_ids=np.concatenate([p[:-3], [9, 9, 9, 9]])),
        mk_call("s1", "next", prompt_ids=np.concatenate([p, base[3].output_ids, [4]])),
        mk_call("s1", "after-regen", prompt_ids=np.concatenate([p, [1, 2, 3]])),
    ]
    with LedgerStore(tmp_path / "l.db") as store:
        stored = [store.append_call(c) for c in base]
        stored += [store.append_call(c, base_hint="c3") for c in extra]
        bases = {sc.call_id: sc.prompt.base_call_id for sc in stored}
        assert bases["regen"] == "c3" and bases["next"] == "c3"
        assert bases["after-regen"] == "regen"
        assert store.check() == []
        assert _reconstructs(store, [*base, *extra])
        sc = stored[-1]
        assert not sc.prompt.suffix_ids.flags.writeable
        assert not sc.call.output_ids.flags.writeable


def test_caller_mutating_its_arrays_does_not_reach_the_cache(tmp_path: Path) -> None:
    calls = growing_session("s1", 3)
    prompt, out = calls[0].prompt_ids.copy(), calls[0].output_ids.copy()
    first = mk_call("s1", "c0", prompt_ids=prompt, output_ids=out,
                    output_logprobs=calls[0].output_logprobs)
    with LedgerStore(tmp_path / "l.db") as store:
        store.append_call(first)
        prompt[:] = 0
        out[:] = 0
        sc = store.append_call(calls[1], base_hint="c0")
        assert sc.prompt.base_call_id == "c0"
        assert sc.prompt.prefix_len == calls[0].context_len
        assert _reconstructs(store, calls[1:2])


def test_rollback_forgets_the_session_row_and_contexts(tmp_path: Path) -> None:
    with LedgerStore(tmp_path / "l.db") as store:
        good = mk_call("s9", "c0", task_id="t1")
        dup = mk_call("s9", "c0", task_id="t1")
        with pytest.raises(LedgerError, match="already in the ledger"):
            store.append_calls([good, dup])
        assert store.count_calls() == 0 and not store.has_session("s9")
        # nothing of the rolled-back batch may survive in the caches
        sc = store.append_call(mk_call("s9", "c1", task_id="t2", prompt_ids=[1, 2, 3, 4, 5]),
                               base_hint="c0")
        assert sc.prompt.base_call_id is None
        assert {s.task_id for s in store.sessions()} == {"t2"}
        assert store.check() == []


def test_episode_sessions_walks_every_linked_session_breadth_first(tmp_path: Path) -> None:
    with LedgerStore(tmp_path / "l.db") as store:
        store.append_calls([
            mk_call("main", "m0"),
            mk_call("sub1", "a0", parent_call_id="m0", parent_session_id="main"),
            mk_call("sub2", "b0", parent_call_id="m0", parent_session_id="main"),
            mk_call("sub1-sub1", "c0", parent_call_id="a0", parent_session_id="sub1"),
            mk_call("other", "o0"),
        ])
        assert store.episode_sessions("main") == ["main", "sub1", "sub2", "sub1-sub1"]
        assert store.episode_sessions("sub1") == ["sub1", "sub1-sub1"]
        assert store.episode_sessions("other") == ["other"]


def test_session_meta_is_recorded_once_and_read_back(tmp_path: Path) -> None:
    from tidal.ledger import SessionMeta

    path = tmp_path / "l.db"
    with LedgerStore(path) as store:
        assert store.session_meta() == {}
        a, b = SessionMeta("rl", 3, "t-1", 0), SessionMeta("rl", 3, "t-1", 1, parent="s-a")
        store.record_meta({"s-a": a, "s-b": b})
        store.record_meta({"s-a": SessionMeta("eval", 9, "other", 5)})  # kept as it was
        assert store.session_meta() == {"s-a": a, "s-b": b}
        assert store.session_meta(["s-b", "nope"]) == {"s-b": b}
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            store._db.execute("UPDATE session_meta SET step = 4")
    with LedgerStore(path, readonly=True) as store:
        assert store.session_meta(["s-a"]) == {"s-a": a}


def test_session_meta_of_a_ledger_without_the_table_is_empty(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with LedgerStore(path):
        pass
    db = sqlite3.connect(path)
    db.execute("DROP TABLE session_meta")  # as written before the table existed
    db.commit()
    db.close()
    with LedgerStore(path, readonly=True) as store:
        assert store.session_meta() == {}
