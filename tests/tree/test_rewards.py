"""GRPO advantages, normalisation options and the path order."""

from __future__ import annotations

import math

import pytest

from tests.tree.synth import SynthWriter, write_fanout, write_linear
from tidal.ledger.store import LedgerStore
from tidal.ledger.types import Status
from tidal.tree.episode import load_sessions
from tidal.tree.process import (
    BATCH_GROUP,
    TRAIN_REWARDS,
    ProcessResult,
    balance_advantages,
    process_sessions,
    process_store,
    select_paths,
    with_rewards,
)
from tidal.tree.weights import group_weight_sums


def _three_rollouts(writer: SynthWriter) -> None:
    for sid, r in (("a", 1.0), ("b", 0.0), ("c", 0.5)):
        write_linear(writer, sid, task_id="t1")
        writer.outcome(sid, Status.COMPLETE, r)
    write_linear(writer, "solo", task_id="t2")
    writer.outcome("solo", Status.COMPLETE, 0.7)


def _adv(res: ProcessResult) -> dict[str, float]:
    return {t.tree_id: t.branches[0].advantage for t in res.trees}


def test_grpo_groups_by_task(store: LedgerStore, writer: SynthWriter) -> None:
    _three_rollouts(writer)
    assert _adv(process_store(store)) == pytest.approx({"a": 0.5, "b": -0.5, "c": 0.0, "solo": 0.0})
    std = math.sqrt((0.25 + 0.25 + 0.0) / 3) + 1e-6
    assert _adv(process_store(store, advantage="mean_std")) == pytest.approx(
        {"a": 0.5 / std, "b": -0.5 / std, "c": 0.0, "solo": 0.0}
    )
    assert _adv(process_store(store, advantage="none")) == pytest.approx(
        {"a": 1.0, "b": 0.0, "c": 0.5, "solo": 0.7}
    )
    batch = (1.0 + 0.0 + 0.5 + 0.7) / 4  # one baseline over both groups
    assert _adv(process_store(store, advantage="batch_mean")) == pytest.approx(
        {"a": 1.0 - batch, "b": -batch, "c": 0.5 - batch, "solo": 0.7 - batch}
    )


def test_batch_mean_leaves_masked_episodes_out(store: LedgerStore, writer: SynthWriter) -> None:
    for sid, r in (("a", 1.0), ("b", 1.0)):  # a group that all succeeds: 0 under "mean"
        write_linear(writer, sid, task_id="t1")
        writer.outcome(sid, Status.COMPLETE, r)
    write_linear(writer, "lost", task_id="t2")
    writer.outcome("lost", Status.INFRA_ERROR, 0.0)
    write_linear(writer, "z", task_id="t3")
    writer.outcome("z", Status.COMPLETE, 0.0)
    assert _adv(process_store(store)) == pytest.approx({"a": 0.0, "b": 0.0, "z": 0.0})
    assert _adv(process_store(store, advantage="batch_mean")) == pytest.approx(
        {"a": 1 / 3, "b": 1 / 3, "z": -2 / 3}
    )


def test_own_reward_keeps_a_prefix_path(store: LedgerStore, writer: SynthWriter) -> None:
    w = writer
    c0 = w.call("o", "o0", "main", w.tokens(4), 2, task_id="t", metadata={"reward": 0.25})
    import numpy as np

    from tests.tree.synth import context

    w.call("o", "o1", "main", np.concatenate([context(c0), w.tokens(3)]), 2)
    w.outcome("o", Status.COMPLETE, 1.0)
    res = process_store(store, advantage="none")
    (t,) = res.trees
    assert sorted((b.call_id, b.reward) for b in t.branches) == [("o0", 0.25), ("o1", 1.0)]
    assert res.episodes[0].redundant_prefix == 0


def test_normalisations(store: LedgerStore, writer: SynthWriter) -> None:
    write_fanout(writer, "f", width=2)  # 2 branches
    writer.outcome("f", Status.COMPLETE, 1.0)
    write_linear(writer, "l")  # 1 branch
    writer.outcome("l", Status.COMPLETE, 0.0)
    two = process_store(store)
    assert {(b.norm_group, b.coef) for t in two.trees for b in t.branches} == {
        ("f", 0.5), ("l", 1.0)
    }
    # f: 2 branches each with 4+4+4 model tokens over 0.5 coef: 4*1 + 8*0.5*2 = 12
    assert group_weight_sums(list(two.trees)) == {"f": pytest.approx(12.0), "l": 16.0}
    tok = process_store(store, normalisation="token")
    assert {b.norm_group for t in tok.trees for b in t.branches} == {BATCH_GROUP}
    assert group_weight_sums(list(tok.trees)) == {BATCH_GROUP: pytest.approx(28.0)}
    path = process_store(store, normalisation="path")
    groups = [b.norm_group for t in path.trees for b in t.branches]
    assert len(set(groups)) == 3 and {b.coef for t in path.trees for b in t.branches} == {1.0}


def test_random_order_is_seeded_and_respects_roles(store: LedgerStore, writer: SynthWriter) -> None:
    write_fanout(writer, "f", width=6)
    writer.outcome("f")
    a = process_store(store, max_paths=3, order="random", seed=1)
    b = process_store(store, max_paths=3, order="random", seed=1)
    pick = [x.call_id for x in a.trees[0].branches]
    assert pick == [x.call_id for x in b.trees[0].branches]
    picks = {
        tuple(x.call_id for x in process_store(store, max_paths=3, order="random",
                                               seed=s).trees[0].branches)
        for s in range(6)
    }
    assert len(picks) > 1  # different seeds pick different paths
    longest = process_store(store, max_paths=3)
    assert [x.call_id for x in longest.trees[0].branches] == ["f-f0", "f-f1", "f-f2"]


def test_bad_option_is_refused(store: LedgerStore) -> None:
    with pytest.raises(ValueError, match="order must be one of"):
        select_paths([], max_paths=1, order="best", seed=0, episode_id="e")
    with pytest.raises(ValueError, match="incomplete must be one of"):
        process_store(store, incomplete="drop")


def test_coverage_order_prefers_new_model_tokens() -> None:
    from tidal.ledger.types import Outcome
    from tidal.tree.episode import SessionData
    from tidal.tree.process import process_sessions

    from .conftest import stored

    a_out = list(range(100, 120))  # 20 model tokens
    ctx_a = [1, 2, 3, 4, *a_out]
    c_out = list(range(200, 230))  # 30
    ctx_c = [*ctx_a, 7, *c_out]
    calls = (
        stored(1, "s", "a", None, 0, [1, 2, 3, 4], a_out),
        stored(2, "s", "b", "a", 24, [8, 9], list(range(300, 310))),  # early branch, 10 new
        stored(3, "s", "c", "a", 24, [7], c_out),
        stored(4, "s", "p0", "c", 55, [5], [400, 401]),
        stored(5, "s", "p1", "c", 55, [6], [500, 501]),
    )
    assert len(ctx_c) == 55
    sess = [SessionData("s", calls, Outcome("s", Status.COMPLETE, 1.0))]
    longest = process_sessions(sess, max_paths=2, order="longest")
    assert [b.call_id for b in longest.trees[0].branches] == ["p0", "p1"]
    cover = process_sessions(sess, max_paths=2)  # coverage is the default
    assert [b.call_id for b in cover.trees[0].branches] == ["b", "p0"]

    def model_tokens(res: ProcessResult) -> int:
        return sum(int(s.model_mask.sum()) for t in res.trees for s in t.segments)

    assert (model_tokens(longest), model_tokens(cover)) == (20 + 30 + 2 + 2, 20 + 10 + 30 + 2)


def test_skills_balanced_carry_equal_signal(store: LedgerStore, writer: SynthWriter) -> None:
    # skill x: two groups that disagree (|A| mass 2 x 1.0); skill y: one group of 0.5 mass
    for sid, task, r in (("a", "t1", 1.0), ("b", "t1", 0.0), ("c", "t2", 1.0),
                         ("d", "t2", 0.0), ("e", "t3", 0.75), ("f", "t3", 0.25),
                         ("g", "t4", 1.0), ("h", "t4", 1.0)):
        write_linear(writer, sid, task_id=task)
        writer.outcome(sid, Status.COMPLETE, r)
    trees = process_store(store).trees
    skill = {"a": "x", "b": "x", "c": "x", "d": "x", "e": "y", "f": "y", "g": "z", "h": "z"}
    out = balance_advantages(trees, skill)
    adv = {t.tree_id: t.branches[0].advantage for t in out}

    def mass(k: str, a: dict[str, float]) -> float:
        return sum(abs(v) for s, v in a.items() if skill[s] == k)

    before = {t.tree_id: t.branches[0].advantage for t in trees}
    assert mass("x", before) == pytest.approx(2.0) and mass("y", before) == pytest.approx(0.5)
    assert mass("x", adv) == pytest.approx(mass("y", adv)) == pytest.approx(1.25)
    assert mass("x", adv) + mass("y", adv) == pytest.approx(2.5)  # the total is kept
    assert adv["g"] == adv["h"] == 0.0  # a skill with no signal stays at 0
    assert adv["a"] == pytest.approx(0.5 * 1.25 / 2.0) and adv["e"] == pytest.approx(0.25 * 2.5)
    # one skill only (or none with signal): nothing changes
    assert balance_advantages(trees, dict.fromkeys(skill, "x")) == list(trees)


def test_success_rewards_train_only_solved_tasks(store: LedgerStore, writer: SynthWriter) -> None:
    """rl.reward = "success": partial credit (0.25 for any answer, say) no longer ranks a
    wrong command above a failed one; the ledger's rewards are untouched."""
    for sid, status, r in (("right", Status.COMPLETE, 1.0), ("any-answer", Status.COMPLETE, 0.25),
                           ("broken", Status.COMPLETE, 0.0), ("cut", Status.TRUNCATED, 0.5)):
        write_linear(writer, sid, task_id="t1")
        writer.outcome(sid, status, r, partial_score=r)
    sessions = load_sessions(store)
    by_score = _adv(process_sessions(with_rewards(sessions, TRAIN_REWARDS["score"])))
    assert by_score == _adv(process_sessions(sessions))  # score keeps the graded rewards
    assert by_score["any-answer"] > by_score["broken"]  # what drew other skills to `grep -c`
    solved = _adv(process_sessions(with_rewards(sessions, TRAIN_REWARDS["success"])))
    assert solved == pytest.approx({"right": 0.75, "any-answer": -0.25, "broken": -0.25,
                                    "cut": -0.25})
    assert [s.outcome.reward for s in load_sessions(store) if s.outcome] == [1.0, 0.25, 0.0, 0.5]
    assert (TRAIN_REWARDS["success"](0.999), TRAIN_REWARDS["success"](1.0),
            TRAIN_REWARDS["score"](0.25)) == (0.0, 1.0, 0.25)
