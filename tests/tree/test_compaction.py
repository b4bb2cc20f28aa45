"""Inferred compaction: a fresh context that carries an earlier call's summary, with no
parent link (`tidal.tree.compaction`), typed like a declared one, and its edge cases."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.tree.synth import LongSessionSpec, SynthWriter, write_compaction, write_long_session
from tidal.cli import app
from tidal.ledger.store import LedgerStore
from tidal.ledger.types import Outcome, Status, StoredCall
from tidal.tree.compaction import required_run, summary_text
from tidal.tree.episode import Edge, SessionData, build_episode
from tidal.tree.process import ProcessResult, process_sessions

from .conftest import stored

SYS = list(range(1, 9))  # the system prompt every context starts with
TASK = list(range(10, 20))
OUT0 = list(range(100, 120))
TOOL = list(range(200, 208))
ASK = list(range(210, 214))  # "summarise your progress"
SUMMARY = list(range(300, 320))  # the summary text: 20 tokens
END = 9999  # the model's end token ("stop" outputs end with it)
USER = list(range(400, 410))  # "Summary of your progress so far:"
MORE = list(range(500, 506))
OUT2 = [600, 601, 602, 603, END]
OK = Outcome("s", Status.COMPLETE, 1.0)

CONT = Edge("continuation", "s", "c0", "s", "c1")
INFERRED = Edge("compaction", "s", "c1", "s", "c2", replaced="c0", inferred=True)


def _calls(
    carried: Sequence[int], *, parent: str | None = None, role: str = "main",
    summary: Sequence[int] = SUMMARY, head: Sequence[int] = SYS,
) -> list[StoredCall]:
    """c0 on [system, task]; c1 (the summary call) continues it with a summarise
    request; c2 is a fresh context [head, user text, carried, more]."""
    ctx0 = [*SYS, *TASK, *OUT0, END]
    return [
        stored(1, "s", "c0", None, 0, [*SYS, *TASK], [*OUT0, END]),
        stored(2, "s", "c1", "c0", len(ctx0), [*TOOL, *ASK], [*summary, END], role=role),
        stored(3, "s", "c2", None, 0, [*head, *USER, *carried, *MORE], OUT2,
               parent_call=parent),
    ]


def _then(*later: StoredCall) -> list[StoredCall]:
    """c0 and the summary call c1 of `_calls`, then other calls."""
    return [*_calls(SUMMARY)[:2], *later]


def _edges(calls: Sequence[StoredCall], **kw: Any) -> list[Edge]:
    return list(build_episode([SessionData("s", tuple(calls), OK)], **kw).edges)


def _changed(ids: Sequence[int], first: int, last: int) -> list[int]:
    """ids with its first `first` and last `last` tokens replaced by other ids."""
    out = list(ids)
    for i in range(first):
        out[i] = 7000 + i
    for i in range(last):
        out[-1 - i] = 8000 + i
    return out


def test_silent_compaction_is_inferred() -> None:
    assert _edges(_calls(SUMMARY)) == [CONT, INFERRED]
    # The end token may be re-sent too, or not; either way the summary is carried.
    assert _edges(_calls([*SUMMARY, END])) == [CONT, INFERRED]
    res = process_sessions([SessionData("s", tuple(_calls(SUMMARY)), OK)])
    (rep,) = res.episodes
    assert (rep.edges, rep.inferred_edges) == ({"continuation": 1, "compaction": 1},
                                               {"compaction": 1})
    assert rep.to_json()["inferred_edges"] == {"compaction": 1}


def test_declared_compaction_is_not_inferred() -> None:
    declared = Edge("compaction", "s", "c1", "s", "c2", replaced="c0")
    assert _edges(_calls(SUMMARY, parent="c1")) == [CONT, declared]
    assert not declared.inferred
    # the link wins even where the prompt carries nothing
    assert _edges(_calls(MORE, parent="c1")) == [CONT, declared]


def test_inference_can_be_turned_off() -> None:
    fork = Edge("fork", "s", "c0", "s", "c2")  # shares the system prompt with c0
    assert _edges(_calls(SUMMARY), infer_compaction=False) == [CONT, fork]
    root = _calls(SUMMARY, head=[900, *SYS[1:]])  # shares no token: a new root
    assert _edges(root, infer_compaction=False) == [CONT]
    assert _edges(root) == [CONT, INFERRED]
    res = process_sessions([SessionData("s", tuple(_calls(SUMMARY)), OK)],
                           infer_compaction=False)
    assert (res.episodes[0].edges, res.episodes[0].inferred_edges) == (
        {"continuation": 1, "fork": 1}, {})


@pytest.mark.parametrize(
    ("m", "first", "last", "inferred"),
    [
        (20, 1, 1, True),  # re-tokenised at both edges
        (20, 2, 2, True),  # TRIM = 2 at each end: a run of 16 = 80% of 20
        (20, 3, 0, False),  # 3 changed at one end: past TRIM
        (20, 0, 3, False),
        (40, 3, 0, False),  # TRIM is a count, not a share: long summaries alike
        (40, 2, 2, True),
        (15, 2, 1, True),  # run 12 = ceil(80% of 15)
        (15, 2, 2, False),  # run 11 < 12
        (10, 1, 1, True),  # run 8: the minimum
        (10, 2, 1, False),  # run 7
        (8, 0, 0, True),  # an 8-token summary verbatim
        (7, 0, 0, False),  # a 7-token one is too short
        (5, 0, 0, False),  # "ok"-sized outputs (5 tokens + end) never compact
    ],
)
def test_boundary_retokenisation_and_length(m: int, first: int, last: int,
                                            inferred: bool) -> None:
    summary = list(range(300, 300 + m))
    calls = _calls(_changed(summary, first, last), summary=summary)
    kinds = [e.kind for e in _edges(calls)]
    assert kinds == ["continuation", "compaction" if inferred else "fork"]


def test_required_run_and_summary_text() -> None:
    assert [required_run(m) for m in (5, 8, 10, 15, 20, 21, 100)] == [8, 8, 8, 12, 16, 17, 80]
    stop = stored(1, "s", "a", None, 0, [1], [5, 6, 7]).call
    assert summary_text(stop).tolist() == [5, 6]  # the end token is not summary text
    cut = replace(stop, finish_reason="length")
    assert summary_text(cut).tolist() == [5, 6, 7]  # a truncated output has none


def test_a_continuation_carrying_an_output_stays_a_continuation() -> None:
    ctx1 = [*SYS, *TASK, *OUT0, END, *TOOL, *ASK, *SUMMARY, END]
    calls = _then(
        stored(3, "s", "c2", "c1", len(ctx1), MORE, OUT2),
        # a parallel sibling and a retry: never re-typed either
        stored(4, "s", "c3", "c1", len(ctx1), USER, OUT2),
        stored(5, "s", "c4", "c1", len(ctx1), USER, [*SUMMARY, END]),
    )
    assert _edges(calls) == [
        CONT, Edge("parallel", "s", "c1", "s", "c2"), Edge("parallel", "s", "c1", "s", "c3"),
        Edge("retry", "s", "c3", "s", "c4"),
    ]


def test_a_re_rendered_history_is_a_fork_not_a_compaction() -> None:
    """A harness that edits its history re-sends every earlier turn: the newest output
    follows its own prompt there, so it is history, not a summary, and decides."""
    ctx1 = [*SYS, *TASK, *OUT0, END, *TOOL, *ASK, *SUMMARY, END]
    stamped = [900, *ctx1[1:], *MORE]  # a changed first token (a timestamp): a root
    calls = _then(stored(3, "s", "c2", None, 0, stamped, OUT2))
    assert _edges(calls) == [CONT]
    # The message before c0's output masked ("[output omitted]"): c0's output no longer
    # follows its own prompt, yet the newest carried output (c1's, intact) says
    # history, and decides: a fork.
    masked = [*SYS, 950, 951, *TASK[-2:], *OUT0, END, *TOOL, *ASK, *SUMMARY, END, *MORE]
    calls = _then(stored(3, "s", "c2", None, 0, masked, OUT2))
    assert _edges(calls) == [CONT, Edge("fork", "s", "c0", "s", "c2")]
    # The own-turn probe is c1's prompt tokens [27, 43): 16 tokens ending 8 before its
    # end. An edit inside it makes the newest output pass for a summary (docs:
    # deliberately simplified); before it, it is history again. (An edit after c0's
    # context, position 39 on, extends c0: parallel.)
    for pos, kind in ((26, "fork"), (27, "compaction"), (38, "compaction")):
        edited = [*ctx1[:pos], 960, *ctx1[pos + 1 :], *MORE]
        calls = _then(stored(3, "s", "c2", None, 0, edited, OUT2))
        assert [e.kind for e in _edges(calls)] == ["continuation", kind], pos


def test_a_template_that_renders_history_differently_is_no_compaction() -> None:
    """Each call's prompt ends with a generation prompt that the re-rendered history
    leaves out (as Qwen3's empty think block): every call is a fork, none a summary."""
    gen = [9001, 9002, 9003]  # e.g. <think>\n\n</think>\n\n
    hist = [*SYS, *TASK]
    calls = []
    for i in range(6):
        out = list(range(1000 + 20 * i, 1020 + 20 * i))
        calls.append(stored(i + 1, "s", f"c{i}", None, 0, [*hist, *gen], [*out, END]))
        hist = [*hist, *out, END, *range(2000 + 10 * i, 2010 + 10 * i)]
    assert [e.kind for e in _edges(calls)] == ["fork"] * 5


def test_one_summary_starts_one_fresh_context() -> None:
    """Re-sending the compacted context (edited, so it is no retry and no continuation)
    does not make a second compaction from the same summary."""
    calls = _calls(SUMMARY)
    ctx2 = [*SYS, *USER, *SUMMARY, *MORE, *OUT2]
    calls.append(stored(4, "s", "c3", None, 0, [902, *ctx2[1:], *TOOL], OUT2))
    assert _edges(calls) == [CONT, INFERRED]


def test_the_latest_carried_output_is_the_summary() -> None:
    """A fresh context that keeps an earlier turn's output too (as OpenHands' condenser
    keeps recent events) compacts from the newest carried output, the summary."""
    both = [*OUT0, 450, 451, *SUMMARY]
    assert _edges(_calls(both)) == [CONT, INFERRED]
    only_first = _calls(OUT0)
    assert _edges(only_first) == [
        CONT, Edge("compaction", "s", "c0", "s", "c2", replaced=None, inferred=True),
    ]


def test_a_silently_compacting_subagent_is_not_spawned_twice() -> None:
    """A helper session that repeats its session link on every call: its fresh context
    carrying its own summary is a compaction, its first call a subagent."""
    parent = SessionData("p", (stored(1, "p", "p0", None, 0, [1, 2, 3], [4, 5]),), OK)
    link = {"parent_session": "p", "parent_call": "p0"}
    ctx0 = [*SYS, *TASK, *OUT0, END]
    helper = SessionData("h", (
        stored(2, "h", "h0", None, 0, [*SYS, *TASK], [*OUT0, END], role="subagent", **link),
        stored(3, "h", "h1", "h0", len(ctx0), [*TOOL, *ASK], [*SUMMARY, END],
               role="subagent", **link),
        stored(4, "h", "h2", None, 0, [*SYS, *USER, *SUMMARY, *MORE], OUT2,
               role="subagent", **link),
    ), None)
    g = build_episode([parent, helper])
    assert [(e.kind, e.src_call, e.dst_call, e.inferred) for e in g.edges] == [
        ("subagent", "p0", "h0", False), ("continuation", "h0", "h1", False),
        ("compaction", "h1", "h2", True),
    ]


def _trees(res: ProcessResult) -> list[Any]:
    """Everything of the TrainTrees that training sees, as plain lists."""
    return [
        (t.tree_id,
         [(s.parent, s.token_ids.tolist(), s.model_mask.tolist(), s.logprobs.tolist(),
           s.policy_versions.tolist()) for s in t.segments],
         [(b.leaf, b.role, b.call_id, b.coef, b.reward, b.advantage, b.norm_group)
          for b in t.branches])
        for t in res.trees
    ]


def test_inferred_compaction_samples_match_declared_ones() -> None:
    declared = SessionData("s", tuple(_calls(SUMMARY, parent="c1", role="main_summary")), OK)
    silent = SessionData("s", tuple(_calls(SUMMARY)), OK)  # no link, summary role "main"
    for samples in (True, False):
        a = process_sessions([declared], compaction_samples=samples)
        b = process_sessions([silent], compaction_samples=samples)
        assert _trees(a) == _trees(b)
    on = process_sessions([silent], compaction_samples=True)
    assert [t.tree_id for t in on.trees] == ["s", "s/compaction/0"]
    (b,) = on.trees[1].branches
    assert (b.role, b.call_id, b.reward) == ("main_summary", "c1", 1.0)
    seg = on.trees[1].segments[0]
    assert seg.token_ids.tolist() == [*SYS, *TASK, *OUT0, END, *TOOL, *ASK, *SUMMARY, END]
    assert seg.model_mask.tolist() == [False] * 51 + [True] * 21
    # a declared compaction whose harness recorded the summary as "main" ranks alike
    plain = SessionData("s", tuple(_calls(SUMMARY, parent="c1")), OK)
    assert _trees(process_sessions([plain], compaction_samples=True)) == _trees(on)


def test_the_summary_call_ranks_as_main_summary() -> None:
    """J-path priority: an inferred compaction's summary call ranks after the main
    paths (as the built-in harness's main_summary call does); inference off, it is an
    ordinary main path, and coverage prefers its 42 model tokens over c2's 5."""
    sess = [SessionData("s", tuple(_calls(SUMMARY)), OK)]
    both = process_sessions(sess)
    assert sorted((b.role, b.call_id) for b in both.trees[0].branches) == [
        ("main", "c2"), ("main_summary", "c1")]
    assert [b.call_id for t in process_sessions(sess, max_paths=1).trees
            for b in t.branches] == ["c2"]
    off = process_sessions(sess, max_paths=1, infer_compaction=False)
    assert [(b.role, b.call_id) for t in off.trees for b in t.branches] == [("main", "c1")]


def test_a_silent_harness_through_a_real_ledger(store: LedgerStore, writer: SynthWriter,
                                               tmp_path: Path) -> None:
    """The generators' silent mode, read back from SQLite, gives the declared shape."""
    write_compaction(writer, "cmp", n_compactions=2, calls_per_context=3, summary_tokens=12,
                     declared=False)
    writer.outcome("cmp", Status.COMPLETE, 1.0)
    spec = LongSessionSpec(n_calls=60, tokens=12000, out_tokens=20, subagent_every=10,
                           subagent_calls=3, parallel_every=5, parallel_width=3,
                           compaction_every=20, declared=False)
    write_long_session(writer, "mix", spec)
    runner = CliRunner()
    db = str(tmp_path / "ledger.db")
    res = runner.invoke(app, ["trees", db, "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["cmp"]["edges"] == {"continuation": 8, "compaction": 2}
    assert data["cmp"]["inferred_edges"] == {"compaction": 2}
    assert data["mix"]["edges"] == {"continuation": 34, "parallel": 21, "subagent": 3,
                                    "compaction": 1}
    assert data["mix"]["inferred_edges"] == {"compaction": 1}
    off = json.loads(runner.invoke(app, ["trees", db, "--json",
                                         "--no-infer-compaction"]).output)
    assert off["cmp"]["edges"] == {"continuation": 8, "fork": 2}
    assert off["cmp"]["inferred_edges"] == {}
    table = runner.invoke(app, ["trees", db], env={"COLUMNS": "250"})
    assert "compaction=2 (2 inferred)" in table.output
    page = tmp_path / "cmp.html"
    assert runner.invoke(app, ["inspect", db, "--session", "cmp", "--html",
                               str(page)]).exit_code == 0
    assert page.read_text().count("compaction (inferred)") >= 2
