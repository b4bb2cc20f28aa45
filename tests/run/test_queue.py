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
