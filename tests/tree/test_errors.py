"""Malformed input gets a clear error naming the session and the call."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from tests.tree.synth import SynthWriter, write_linear
from tidal.ledger.store import LedgerStore
from tidal.ledger.types import Outcome, Status
from tidal.tree.episode import SessionData
from tidal.tree.process import process_sessions, process_store
from tidal.tree.trie import TreeError

from .conftest import stored


def test_cycle_in_session_links() -> None:
    a = SessionData("A", (stored(1, "A", "a0", None, 0, [1], [2], parent_session="B",
                                 parent_call="b0"),), None)
    b = SessionData("B", (stored(2, "B", "b0", None, 0, [3], [4], parent_session="A",
                                 parent_call="a0"),), None)
    with pytest.raises(TreeError, match=r"session 'B', call 'b0': parent links form a cycle "
                                        r"\(A -> B -> A\)"):
        process_sessions([a, b])


def test_cycle_in_call_links() -> None:
    s = SessionData("S", (
        stored(1, "S", "c0", None, 0, [1], [2], parent_call="c1"),
        stored(2, "S", "c1", None, 0, [3], [4], parent_call="c0"),
    ), None)
    with pytest.raises(TreeError, match=r"session 'S', call 'c0': parent call 'c1' is not an "
                                        r"earlier call.*cycle"):
        process_sessions([s])


def test_missing_prefix_reference() -> None:
    s = SessionData("S", (stored(1, "S", "c0", None, 0, [1], [2]),
                          stored(2, "S", "c1", "gone", 1, [3], [4])), None)
    with pytest.raises(TreeError, match=r"session 'S', call 'c1': prefix reference to call "
                                        r"'gone'"):
        process_sessions([s])
    # Not strict: the episode is reported with its error and masked; others go on.
    ok = SessionData("T", (stored(3, "T", "t0", None, 0, [1], [2]),),
                     Outcome("T", Status.COMPLETE, 1.0))
    res = process_sessions([s, ok], strict=False)
    reps = {e.episode_id: e for e in res.episodes}
    assert reps["S"].masked and reps["S"].error is not None and "'c1'" in reps["S"].error
    assert [t.tree_id for t in res.trees] == ["T"]


def test_dangling_subagent_link() -> None:
    s = SessionData("S", (stored(1, "S", "c0", None, 0, [1], [2], parent_session="P",
                                 parent_call="p0"),), None)
    with pytest.raises(TreeError, match=r"session 'S', call 'c0': parent session 'P' is not"):
        process_sessions([s])
    p = SessionData("P", (stored(2, "P", "p9", None, 0, [1], [2]),), None)
    with pytest.raises(TreeError, match=r"session 'S', call 'c0': parent call 'p0' of session "
                                        r"'P' is not in the input"):
        process_sessions([p, s])


def test_session_with_no_calls(store: LedgerStore, writer: SynthWriter) -> None:
    write_linear(writer, "x")
    writer.outcome("x")
    store.append_outcome(Outcome("ghost", Status.COMPLETE, 1.0))
    with pytest.raises(TreeError, match=r"session 'ghost' has no calls"):
        process_store(store)
    with pytest.raises(TreeError, match=r"session 'empty' has no calls"):
        process_sessions([SessionData("empty", (), None)])


def test_tree_package_stays_light() -> None:
    """tidal.tree is pure Python + numpy: importing it pulls in no torch and no HTTP."""
    import subprocess
    import sys

    code = (
        "import sys, tidal.tree, tidal.tree.cli, tidal.tree.html; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'fastapi', 'httpx', 'uvicorn', 'openai')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_abandoned_calls_are_left_out_and_later_calls_stored_against_them_kept(
    tmp_path: Path,
) -> None:
    """A resumed session's outcome lists the recorded calls of a branch it did not take
    (`details.abandoned_calls`): they are not trained, and a kept call whose prompt the
    store wrote against one of them keeps its whole prompt."""
    from tests.ledger.helpers import growing_session
    from tidal.ledger import LedgerStore, Outcome, Status
    from tidal.tree.episode import load_sessions

    calls = growing_session("s", 4)
    # a branch: call 3 continues call 1 (a different observation than call 2 saw), and
    # the store keeps call 3's prompt as a delta against call 1 or 2
    c0, c1, c2 = calls[0], calls[1], calls[2]
    ctx = np.concatenate([c1.prompt_ids, c1.output_ids, np.array([9, 9, 9], np.int32)])
    c3 = dataclasses.replace(calls[3], call_id="c3b", prompt_ids=ctx)
    with LedgerStore(tmp_path / "l.db") as store:
        store.append_calls([c0, c1, c2, c3])
        store.append_outcome(Outcome("s", Status.COMPLETE, 1.0, 1.0,
                                     {"abandoned_calls": [c2.call_id]}))
        (sd,) = load_sessions(store, ["s"])
        log = store.call_log("s")
        assert log["c3b"].prompt.base_call_id == c2.call_id  # stored against the dropped call
        assert [sc.call_id for sc in sd.calls] == [c0.call_id, c1.call_id, "c3b"]
        for sc in sd.calls:
            assert sc.prompt.base_call_id != c2.call_id
        result = process_store(store, ["s"])
        full = process_store(store, ["s"], max_paths=None)
    assert np.array_equal(log.prompt_ids("c3b"), ctx)
    # the tree holds c3b's branch and nothing of the abandoned call (its tool result
    # and output would add tokens)
    (tree,) = result.trees
    assert tree.unique_tokens == len(ctx) + len(c3.output_ids)
    assert full.trees[0].unique_tokens == tree.unique_tokens
