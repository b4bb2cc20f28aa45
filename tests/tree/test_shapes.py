"""Generated sessions of every shape: exact trees, edge kinds, weights and rewards."""

from __future__ import annotations

import numpy as np
import pytest

from tests.tree.synth import (
    LongSessionSpec,
    SynthWriter,
    context,
    write_compaction,
    write_fanout,
    write_linear,
    write_long_session,
    write_retries,
    write_subagents,
)
from tidal.ledger.store import LedgerStore
from tidal.ledger.types import Status
from tidal.tree.episode import Edge
from tidal.tree.process import ProcessResult, process_store
from tidal.tree.types import TrainTree
from tidal.tree.weights import group_weight_sums, token_weights


def _tree(res: ProcessResult, tree_id: str) -> TrainTree:
    (t,) = [t for t in res.trees if t.tree_id == tree_id]
    return t


def _branch_ids(t: TrainTree, b_index: int) -> list[int]:
    b = t.branches[b_index]
    return np.concatenate([t.segments[s].token_ids for s in t.path_segments(b)]).tolist()


def _branch_mask(t: TrainTree, b_index: int) -> list[bool]:
    b = t.branches[b_index]
    return np.concatenate([t.segments[s].model_mask for s in t.path_segments(b)]).tolist()


def _ctx_mask(*pieces: tuple[int, bool]) -> list[bool]:
    return [m for n, m in pieces for _ in range(n)]


def test_linear(store: LedgerStore, writer: SynthWriter) -> None:
    calls = write_linear(writer, "lin", n_calls=4)
    writer.outcome("lin", Status.COMPLETE, 1.0)
    res = process_store(store, keep_graphs=True)
    (rep,) = res.episodes
    assert (rep.nodes, rep.leaves, rep.unique_tokens, rep.path_tokens) == (8, 1, 56, 56)
    assert rep.edges == {"continuation": 3}
    assert (rep.redundant_identical, rep.redundant_prefix) == (0, 3)
    assert [e.src_call for e in res.graphs[0].edges] == ["lin-c0", "lin-c1", "lin-c2"]
    t = _tree(res, "lin")
    assert len(t.segments) == 1 and t.segments[0].parent == -1
    (b,) = t.branches
    assert (b.call_id, b.role, b.coef, b.norm_group) == ("lin-c3", "main", 1.0, "lin")
    assert b.reward == 1.0
    assert b.advantage == 0.0  # a GRPO group of one: no baseline signal
    seg = t.segments[0]
    assert seg.token_ids.tolist() == context(calls[-1]).tolist()
    expect = _ctx_mask((16, False), (4, True), (8, False), (4, True), (8, False), (4, True),
                       (8, False), (4, True))
    assert seg.model_mask.tolist() == expect
    lps = np.concatenate([c.output_logprobs for c in calls])
    assert np.array_equal(seg.logprobs[seg.model_mask], lps)
    assert (seg.logprobs[~seg.model_mask] == 0).all()
    assert set(seg.policy_versions[seg.model_mask].tolist()) == {0}
    assert set(seg.policy_versions[~seg.model_mask].tolist()) == {-1}
    assert token_weights(t)[0].tolist() == [1.0 if m else 0.0 for m in expect]


def test_parallel_fanout(store: LedgerStore, writer: SynthWriter) -> None:
    calls = write_fanout(writer, "fan", width=3)
    writer.outcome("fan")
    res = process_store(store, keep_graphs=True)
    (rep,) = res.episodes
    assert rep.edges == {"continuation": 3, "parallel": 3}
    assert (rep.nodes, rep.leaves, rep.unique_tokens, rep.path_tokens) == (14, 3, 92, 132)
    assert rep.dedup_ratio == pytest.approx(132 / 92)
    kinds = {(e.src_call, e.dst_call): e.kind for e in res.graphs[0].edges}
    assert kinds == {
        ("fan-c0", "fan-p0"): "parallel", ("fan-c0", "fan-p1"): "parallel",
        ("fan-c0", "fan-p2"): "parallel", ("fan-p0", "fan-f0"): "continuation",
        ("fan-p1", "fan-f1"): "continuation", ("fan-p2", "fan-f2"): "continuation",
    }
    t = _tree(res, "fan")
    assert [s.parent for s in t.segments] == [-1, 0, 0, 0]
    assert [len(s) for s in t.segments] == [20, 24, 24, 24]
    assert [b.call_id for b in t.branches] == ["fan-f0", "fan-f1", "fan-f2"]
    assert all(b.coef == pytest.approx(1 / 3) for b in t.branches)
    for i, f in enumerate(calls[4:]):
        assert _branch_ids(t, i) == context(f).tolist()
    w = token_weights(t)
    # c0's output is in all 3 sampled histories: weight 3/3; a branch's own tokens 1/3.
    assert w[0].tolist() == [0.0] * 16 + [1.0] * 4
    for s in (1, 2, 3):
        assert w[s].tolist() == pytest.approx(
            [0.0] * 8 + [1 / 3] * 4 + [0.0] * 8 + [1 / 3] * 4
        )


def test_nested_subagents_and_the_j_cap(store: LedgerStore, writer: SynthWriter) -> None:
    sessions = write_subagents(writer, "sub", width=2, depth=2)
    writer.outcome("sub", Status.COMPLETE, 1.0)
    assert len(sessions) == 7
    res = process_store(store, keep_graphs=True)
    (rep,) = res.episodes
    assert rep.sessions == 7
    assert rep.edges == {"continuation": 7, "subagent": 6}
    g = res.graphs[0]
    assert g.depth == (0, 1, 1, 2, 2, 2, 2)
    sub_edges = sorted((e.src_session, e.src_call, e.dst_session) for e in g.edges
                       if e.kind == "subagent")
    assert sub_edges == [
        ("sub", "sub-c0", "sub/s0"), ("sub", "sub-c0", "sub/s1"),
        ("sub/s0", "sub.s0-c0", "sub/s0/s0"), ("sub/s0", "sub.s0-c0", "sub/s0/s1"),
        ("sub/s1", "sub.s1-c0", "sub/s1/s0"), ("sub/s1", "sub.s1-c0", "sub/s1/s1"),
    ]
    # J=5: the main path first, then subagent paths (all 32 tokens) by earliest commit.
    got = sorted((t.tree_id, b.role, b.call_id) for t in res.trees for b in t.branches)
    assert got == [
        ("sub", "main", "sub-c1"),
        ("sub/sub/s0", "subagent", "sub.s0-c1"),
        ("sub/sub/s0/s0", "subagent", "sub.s0.s0-c1"),
        ("sub/sub/s0/s1", "subagent", "sub.s0.s1-c1"),
        ("sub/sub/s1/s0", "subagent", "sub.s1.s0-c1"),
    ]
    assert [b.coef for t in res.trees for b in t.branches] == [pytest.approx(0.2)] * 5
    assert {b.norm_group for t in res.trees for b in t.branches} == {"sub"}
    # Two-level: the episode's weight sums to 1 over branches however many helpers it has.
    assert sum(b.coef for t in res.trees for b in t.branches) == pytest.approx(1.0)
    assert group_weight_sums(list(res.trees)) == {"sub": pytest.approx(8.0)}
    for t in res.trees:  # every tree is one linear path here: w = 1/5 on model tokens
        (seg,) = t.segments
        assert token_weights(t)[0].tolist() == pytest.approx((seg.model_mask * 0.2).tolist())
        assert int(seg.model_mask.sum()) == 8
    uncapped = process_store(store, max_paths=None)
    assert sum(len(t.branches) for t in uncapped.trees) == 7
    assert [b.coef for t in uncapped.trees for b in t.branches] == [pytest.approx(1 / 7)] * 7
    one = process_store(store, max_paths=1)
    assert [(t.tree_id, t.branches[0].role) for t in one.trees] == [("sub", "main")]


def test_repeated_compaction(store: LedgerStore, writer: SynthWriter) -> None:
    calls = write_compaction(writer, "cmp", n_compactions=2, calls_per_context=3)
    writer.outcome("cmp", Status.COMPLETE, 1.0)
    by_id = {c.call_id: c for c in calls}
    res = process_store(store, keep_graphs=True)
    (rep,) = res.episodes
    assert rep.edges == {"continuation": 8, "compaction": 2}
    assert (rep.leaves, rep.unique_tokens, rep.path_tokens) == (3, 148, 164)
    comp = [e for e in res.graphs[0].edges if e.kind == "compaction"]
    assert comp == [
        Edge("compaction", "cmp", "cmp-x0sum", "cmp", "cmp-x1c0", replaced="cmp-x0c2"),
        Edge("compaction", "cmp", "cmp-x1sum", "cmp", "cmp-x2c0", replaced="cmp-x1c2"),
    ]
    # Off (default): summaries stay in the session tree as main_summary paths.
    t = _tree(res, "cmp")
    assert sorted((b.role, b.call_id) for b in t.branches) == [
        ("main", "cmp-x2c2"), ("main_summary", "cmp-x0sum"), ("main_summary", "cmp-x1sum"),
    ]
    assert len(t.segments[0]) == 8  # the system prompt all three contexts share
    assert [s.parent for s in t.segments] == [-1, 0, 0, 0]
    for i, b in enumerate(t.branches):
        assert _branch_ids(t, i) == context(by_id[b.call_id]).tolist()
        assert (b.reward, b.norm_group) == (1.0, "cmp")
        assert b.coef == pytest.approx(1 / 3)
    w = token_weights(t)
    assert w[0].tolist() == [0.0] * 8  # the shared system prompt is not trained
    for seg, ws in zip(t.segments[1:], w[1:], strict=True):
        assert ws.tolist() == pytest.approx((seg.model_mask / 3).tolist())
    # On: each summary is its own sample: prompt untrained, summary trained.
    res2 = process_store(store, compaction_samples=True)
    main = _tree(res2, "cmp")
    assert [b.call_id for b in main.branches] == ["cmp-x0c2", "cmp-x1c2", "cmp-x2c2"]
    for n, sid in enumerate(("cmp-x0sum", "cmp-x1sum")):
        st = _tree(res2, f"cmp/compaction/{n}")
        (b,) = st.branches
        assert (b.role, b.call_id, b.reward, b.norm_group) == ("main_summary", sid, 1.0, "cmp")
        assert b.coef == pytest.approx(1 / 5)
        s = by_id[sid]
        assert st.segments[0].token_ids.tolist() == context(s).tolist()
        assert st.segments[0].model_mask.tolist() == [False] * len(s.prompt_ids) + [True] * 6
        assert np.array_equal(st.segments[0].logprobs[-6:], s.output_logprobs)


def test_retries_and_identical_paths(store: LedgerStore, writer: SynthWriter) -> None:
    write_retries(writer, "ret", n_retries=2)
    writer.outcome("ret")
    res = process_store(store, keep_graphs=True)
    (rep,) = res.episodes
    assert rep.edges == {"continuation": 1, "retry": 3}
    assert (rep.nodes, rep.leaves) == (6, 3)
    assert (rep.redundant_identical, rep.redundant_prefix) == (1, 1)
    retry_src = {e.dst_call: e.src_call for e in res.graphs[0].edges if e.kind == "retry"}
    assert retry_src == {"ret-r0": "ret-c1", "ret-r1": "ret-c1", "ret-dup": "ret-c1"}
    t = _tree(res, "ret")
    assert [len(s) for s in t.segments] == [28, 4, 4, 4]
    assert [b.call_id for b in t.branches] == ["ret-c1", "ret-r0", "ret-r1"]
    w = token_weights(t)
    assert w[0].tolist() == [0.0] * 16 + [1.0] * 4 + [0.0] * 8
    assert all(wi.tolist() == pytest.approx([1 / 3] * 4) for wi in w[1:])


@pytest.mark.parametrize(
    ("policy", "status", "reward", "masked"),
    [
        ("partial", Status.TIMEOUT, 0.4, False),
        ("zero", Status.TIMEOUT, 0.0, False),
        ("mask", Status.TIMEOUT, None, True),
        ("partial", Status.TRUNCATED, 0.4, False),
        ("partial", Status.ABORTED, -1.0, False),
        ("partial", Status.INFRA_ERROR, None, True),
        ("partial", Status.COMPLETE, -1.0, False),
    ],
)
def test_timeouts_keep_partial_progress(  # noqa: PLR0917
    store: LedgerStore, writer: SynthWriter, policy: str, status: Status, reward: float | None,
    masked: bool,
) -> None:
    write_linear(writer, "t", task_id="task")
    writer.outcome("t", status, reward=-1.0, partial_score=0.4)
    write_linear(writer, "ok", task_id="task")
    writer.outcome("ok", Status.COMPLETE, reward=1.0)
    res = process_store(store, incomplete=policy)
    rep = {e.episode_id: e for e in res.episodes}["t"]
    assert (rep.status, rep.reward, rep.masked) == (status.value, reward, masked)
    trees = [t for t in res.trees if t.tree_id == "t"]
    if masked:
        assert trees == [] and rep.sampled_paths == 0
        ok = _tree(res, "ok").branches[0]
        assert ok.advantage == 0.0  # the masked episode does not enter the baseline
    else:
        assert reward is not None
        (b,) = trees[0].branches
        assert b.reward == reward
        assert b.advantage == pytest.approx(reward - (reward + 1.0) / 2)


def test_missing_outcome_is_pending_and_masked(store: LedgerStore, writer: SynthWriter) -> None:
    write_linear(writer, "p")
    res = process_store(store)
    assert (res.episodes[0].status, res.episodes[0].masked, res.trees) == ("pending", True, ())


def test_infra_error_subagent_is_masked_not_the_episode(
    store: LedgerStore, writer: SynthWriter
) -> None:
    write_subagents(writer, "e", width=2, depth=1)
    writer.outcome("e", Status.COMPLETE, 1.0)
    writer.outcome("e/s1", Status.INFRA_ERROR, 0.0)
    res = process_store(store, max_paths=None)
    (rep,) = res.episodes
    assert rep.masked_sessions == 1
    assert sorted(b.session_id for t in res.trees for b in t.branches) == ["e", "e/s0"]


def test_mixed_long_session(store: LedgerStore, writer: SynthWriter) -> None:
    spec = LongSessionSpec(
        n_calls=60, tokens=12000, out_tokens=20, subagent_every=10, subagent_calls=3,
        parallel_every=5, parallel_width=3, compaction_every=20,
    )
    assert write_long_session(writer, "mix", spec) == 60
    assert store.check() == []  # the generator writes a sound ledger
    res = process_store(store, max_paths=None, keep_graphs=True)
    (rep,) = res.episodes
    assert rep.calls == 60 and rep.sessions == 4
    assert rep.edges == {"continuation": 34, "parallel": 21, "subagent": 3, "compaction": 1}
    assert sum(rep.edges.values()) == 59  # every call but the first has one incoming edge
    # Each sampled branch is exactly its call's context, tokens and model mask.
    for t in res.trees:
        assert all(s.parent < i for i, s in enumerate(t.segments))
        for i, b in enumerate(t.branches):
            log = store.call_log(b.session_id)
            assert _branch_ids(t, i) == log.context_ids(b.call_id).tolist()
    assert sum(b.coef for t in res.trees for b in t.branches) == pytest.approx(1.0)
    assert (rep.status, rep.reward) == ("complete", 1.0)
    assert {(b.reward, b.advantage) for t in res.trees for b in t.branches} == {(1.0, 0.0)}
    # Shared model tokens weigh the share of branches through them; weights sum to D_g.
    n_branches = sum(len(t.branches) for t in res.trees)
    for t in res.trees:
        for seg, ws in zip(t.segments, token_weights(t), strict=True):
            assert (ws[~seg.model_mask] == 0).all()
            assert ((ws[seg.model_mask] * n_branches).round(9) % 1 == 0).all()
    assert sum(float(ws.sum()) for t in res.trees for ws in token_weights(t)) == pytest.approx(
        group_weight_sums(list(res.trees))["mix"])
    capped = process_store(store)
    roles = [b.role for t in capped.trees for b in t.branches]
    assert len(roles) == 5 and set(roles) == {"main"}


def test_model_tokens_keep_their_sampler(store: LedgerStore, writer: SynthWriter) -> None:
    """A later call's prompt holds earlier outputs: trained once, with the logprobs and
    policy version of the call that sampled them."""
    w = writer
    c0 = w.call("v", "v0", "main", w.tokens(5), 3)
    w.policy_version = 1
    c1 = w.call("v", "v1", "main", np.concatenate([context(c0), w.tokens(2)]), 3)
    w.outcome("v")
    t = process_store(store).trees[0]
    seg = t.segments[0]
    assert seg.policy_versions.tolist() == [-1] * 5 + [0] * 3 + [-1] * 2 + [1] * 3
    assert np.array_equal(seg.logprobs[5:8], c0.output_logprobs)
    assert np.array_equal(seg.logprobs[10:], c1.output_logprobs)

