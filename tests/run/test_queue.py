"""The rollout queue (run/queue.py): task draws, and a group moved while dynamic
sampling rolls it again."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tidal.agent.preempt import LiveEpisodes
from tidal.agent.tasks import FileChecks, FileExists, Task
from tidal.ledger import LedgerStore
from tidal.run.live import GroupPreempted, RolloutMigrator
from tidal.run.queue import RolloutQueue, TaskDraws
from tidal.run.rollout import Episode, group_result
from tidal.schedule.backend import Finished, Migrated, RolloutResult, SessionContext, Work
from tidal.schedule.local import LocalBackend
from tidal.schedule.scheduler import MiniBatch, Sample


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


class _Groups:
    """The task groups' runner (`GroupRunner`, `PreemptibleGroups`) as a script: each
    roll's samples score the next rewards of `scores`; the roll of `stop` blocks until
    its group is preempted, then raises `GroupPreempted` as `LiveRollouts` does. Every
    call is recorded: (task, the group's key, resume)."""

    def __init__(self, scores: list[list[float]], stop: str) -> None:
        self.scores, self.stop = scores, stop
        self.calls: list[tuple[str, str, str | None]] = []
        self.running = threading.Event()
        self._preempted: set[str] = set()

    def group(self, jobs: Sequence[tuple[Task, str]], *, base_version: int,
              resume: str | None = None) -> RolloutResult:
        task, key = jobs[0][0].task_id, jobs[0][1]
        self.calls.append((task, key, resume))
        if task == self.stop and resume is None:
            self.running.set()
            deadline = time.monotonic() + 30
            while key not in self._preempted and time.monotonic() < deadline:
                time.sleep(0.01)
            raise GroupPreempted(key)
        rewards = self.scores.pop(0)
        return group_result([Episode(t.task_id, sid, (sid,), "complete", r, r, 1, 0.0)
                             for (t, sid), r in zip(jobs, rewards, strict=True)], base_version)

    def preempt(self, key: str) -> int:
        self._preempted.add(key)
        return 1


class _Submitted:
    """The scheduler side of the queue (`RolloutScheduler`) reduced to what this test
    drives by hand: it keeps the work submitted and hands back the samples given."""

    def __init__(self) -> None:
        self.works: list[Work] = []
        self.samples: list[Sample] = []

    def submit_many(self, works: Iterable[Work]) -> list[int]:
        self.works += works
        return list(range(len(self.works)))

    def iter_batches(self, *, steps: int | None = None, flush: bool = True
                     ) -> Iterator[MiniBatch]:
        yield MiniBatch(0, tuple(self.samples), (0,), 0, lambda _mb: True)

    def dropped(self) -> list[int]:
        return []

    def failed(self) -> list[object]:
        return []


def test_a_group_moved_under_dynamic_sampling_continues_the_roll_it_was_on(
        tmp_path: Path) -> None:
    """Elastic scheduling with `schedule.migration` and `rollout.dynamic_sampling`: a
    group moved to another device (the local backend's `migrate`, `RolloutMigrator`)
    while it is rolled again continues that roll, not the first one, and goes on
    rolling again from there; what it replaced stays replaced."""
    from tidal.run.progress import RunLog

    step, group = 1, 0
    draws = TaskDraws(POOL, seed=5, batch=1, sampling="uniform")
    first = TaskDraws(POOL, seed=5, batch=1, sampling="uniform").next(step, {})
    second = draws.fresh(step, group, 1, like=first)
    assert second is not None
    third = draws.fresh(step, group, 2, like=second)
    assert third is not None
    # first alike, second (moved, then resumed) alike, third informative
    groups = _Groups([[0.0] * 4, [1.0] * 4, [0.0, 1.0, 1.0, 0.0]], stop=second.task_id)
    sched = _Submitted()
    with LedgerStore(tmp_path / "ledger.db") as store:
        queue = RolloutQueue(
            sched, groups, LiveEpisodes(tmp_path / "live", store, None, None), store,  # type: ignore[arg-type]
            draws, steps=1, first_step=0, tasks_per_step=1, group_size=4, max_staleness=0,
            base_version=0, trained=set(), carry=(), tasks=POOL,
            log=RunLog(tmp_path, total_steps=1, quiet=True, backends=()), resample=2)
        queue.start([], {})
        (work,) = sched.works
        backend = LocalBackend(2, 1, mode="thread", migrator=RolloutMigrator(groups))
        backend.start()
        try:
            backend.launch(0, 0, work, SessionContext(0, 0, 0, 1))
            assert groups.running.wait(30)
            backend.migrate(0, 0, 1)
            events: list[object] = []
            deadline = time.monotonic() + 30
            while len(events) < 2 and time.monotonic() < deadline:
                events += backend.poll(0.1)
        finally:
            backend.close()
        assert [type(e) for e in events] == [Migrated, Finished], events
        tasks = [(task, resume is not None) for task, _key, resume in groups.calls]
        assert tasks == [(first.task_id, False), (second.task_id, False),
                         (second.task_id, True), (third.task_id, False)]
        assert groups.calls[2][2] == groups.calls[1][1]  # the second roll's own key
        result = events[1]
        assert isinstance(result, Finished)
        sched.samples = [Sample(0, result.result.value, 0, 0, 0, 1.0, 1, 1, 0.0, 0.0)]
        (batch,) = queue.batches()
        assert [r.task_id for r in batch.replaced] == [first.task_id, second.task_id]
        assert [e.reward for e in batch.episodes] == [0.0, 1.0, 1.0, 0.0]
        assert {e.task_id for e in batch.episodes} == {third.task_id}
        meta = store.session_meta()
        assert sorted(m.task_id for m in meta.values()) == sorted(
            [t.task_id for t in (first, second, third) for _ in range(4)])
