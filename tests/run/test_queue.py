"""The rollout queue's pure parts: task draws (run/queue.py)."""

from __future__ import annotations

from tidal.agent.tasks import FileChecks, FileExists, Task
from tidal.run.queue import TaskDraws


def _task(task_id: str, family: str) -> Task:
    return Task(task_id, "p", FileChecks((FileExists("a"),)), family=family)


POOL = [_task(f"{f}{i}", f) for f in ("a", "b", "c") for i in range(4)] + [_task("solo", "s")]


def test_draws_are_seeded_by_run_and_step() -> None:
    one, two = (TaskDraws(POOL, seed=3, batch=4, sampling="uniform") for _ in range(2))
    signal: dict[str, tuple[int, int]] = {}
    firsts = [one.next(2, signal).task_id for _ in range(6)]
    assert firsts == [two.next(2, signal).task_id for _ in range(6)]
    other = TaskDraws(POOL, seed=4, batch=4, sampling="uniform")
    assert [other.next(2, signal).task_id for _ in range(6)] != firsts


def test_a_fresh_task_is_of_the_same_family_and_drawn_apart() -> None:
    draws = TaskDraws(POOL, seed=0, batch=4, sampling="balanced")
    like = POOL[1]  # a1
    got = [draws.fresh(1, g, k, like) for g in range(5) for k in (1, 2)]
    assert all(t is not None and t.family == "a" and t.task_id != "a1" for t in got)
    assert len({t.task_id for t in got if t is not None}) > 1
    # the same (step, group, attempt) draws the same task whatever was drawn before
    again = TaskDraws(POOL, seed=0, batch=4, sampling="balanced")
    again.next(1, {})
    assert [again.fresh(1, g, k, like) for g in range(5) for k in (1, 2)] == got
    assert draws.fresh(1, 0, 1, POOL[-1]) is None  # its family has no other task


def test_signal_counts_replaced_groups_under_the_trained_reward() -> None:
    """The task statistics learn from every rolled group (the ones dynamic sampling
    replaced too), scored as trained: partial credit that differs among failures is no
    signal under rl.reward = "success"; informative_families then moves the slots."""
    from tidal.run.checkpoint import RunState
    from tidal.run.loop import _stepped
    from tidal.run.queue import Batch, Replaced
    from tidal.tree import TRAIN_REWARDS

    batch = Batch(step=1, groups=(), episodes=(), carry=(), gone=(), gone_sessions=(),
                  waited_s=0.0, started=0.0, cpu_started=0.0, replaced=(
                      Replaced("a0", (0.25, 0.0, 0.25), ("s1", "s2", "s3")),
                      Replaced("b0", (1.0, 1.0, 1.0), ("s4", "s5", "s6")),
                      Replaced("c0", (1.0, 0.5, 1.0), ("s7", "s8", "s9"))))
    state = RunState()
    score = _stepped(state, batch, TRAIN_REWARDS["score"])["task_signal"]
    success = _stepped(state, batch, TRAIN_REWARDS["success"])["task_signal"]
    assert score == {"a0": (1, 1), "b0": (1, 0), "c0": (1, 1)}
    assert success == {"a0": (1, 0), "b0": (1, 0), "c0": (1, 1)}
    draws = TaskDraws(POOL, seed=0, batch=6, sampling="informative_families")
    signal = {"a0": (20, 0), "b0": (20, 20)}  # a: 1/22, b: 21/22, c and s unseen: 1/2
    got = [draws.next(step, signal).family for step in range(1, 21) for _ in range(6)]
    # shares of 6 slots: b 2.86, c and s 1.5 (s has one task), a 0.14
    assert got.count("b") > 50 and got.count("a") < 8 and got.count("c") > 20
