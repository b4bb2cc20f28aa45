"""The colocated plain loop (`tidal.schedule.colocated.Colocated`): the scheduler's
contract where the RL loop meets it, with real threads."""

from __future__ import annotations

import threading
import time

import pytest

from tidal.schedule.backend import RolloutResult, Work
from tidal.schedule.colocated import Colocated
from tidal.schedule.local import LocalBackend
from tidal.schedule.policy import ColocatedPolicy
from tidal.schedule.scheduler import RolloutScheduler, Scheduler
from tidal.schedule.types import PoolConfig, Role, ScheduleError


def _value(x: int, version: int | None = None, sleep: float = 0.0) -> RolloutResult:
    time.sleep(sleep)
    return RolloutResult(value=x, policy_version=version, tokens=x)


def _raise(x: int) -> RolloutResult:
    raise ValueError(f"group {x} broke")


def _works(n: int, sleep: float = 0.0) -> list[Work]:
    return [Work(_value, (i,), {"sleep": sleep}) for i in range(n)]


def test_batches_in_submission_order_one_at_a_time() -> None:
    running, peak, lock = [0], [0], threading.Lock()

    def tracked(x: int) -> RolloutResult:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        return RolloutResult(value=x, tokens=1)

    sched = Colocated(2, 2, 3, max_staleness=1)
    with sched:
        sched.submit_many(Work(tracked, (i,)) for i in range(9))
        got = []
        for mb in sched.iter_batches(steps=3):
            assert mb.done()
            got.append(sorted(s.value for s in mb.samples))
            assert all(s.staleness == 0 and s.weight == 1.0 for s in mb.samples)
            sched.step_done()
    # a batch runs only its own groups (3 of the 4 slots), queued work waits its step
    assert got == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert peak[0] == 3
    m = sched.metrics()
    assert m["policy"] == "colocated" and m["policy_version"] == 3
    assert m["staleness"]["trained"] == {"0": 9}
    assert m["role_switches"] == {"to_train": 6, "to_rollout": 4}  # not after the last
    assert 0.0 < m["utilization"] <= 1.0


def test_switch_hook_every_device_each_way() -> None:
    calls: list[tuple[int, Role]] = []
    sched = Colocated(2, 1, 2, max_staleness=0, on_switch=lambda d, r: calls.append((d, r)))
    with sched:
        sched.submit_many(_works(4))
        for _mb in sched.iter_batches(steps=2):
            sched.step_done()
    assert sorted(calls) == sorted([(0, Role.TRAIN), (1, Role.TRAIN)] * 2
                                   + [(0, Role.ROLLOUT), (1, Role.ROLLOUT)])
    assert len(sched.metrics()["switch_seconds"]) == 6


def test_a_failed_group_gives_its_place_to_the_next() -> None:
    sched = Colocated(1, 2, 2, max_staleness=1)
    with sched:
        ids = sched.submit_many([Work(_raise, (0,)), *_works(3)])
        mb = next(sched.iter_batches(steps=1))
        assert sorted(s.value for s in mb.samples) == [0, 1]  # groups 1 and 2 of _works
        sched.step_done()
    failed = sched.failed()
    assert [f.session for f in failed] == [ids[0]] and "group 0 broke" in failed[0].error
    assert sched.metrics()["sessions"]["failed"] == 1


def test_stale_groups_are_dropped() -> None:
    sched = Colocated(1, 1, 1, max_staleness=1)
    with sched:
        # a resumed group whose oldest token is from 2 versions before the run's start
        ids = sched.submit_many([Work(_value, (7, -2)), Work(_value, (8, 0))])
        mb = next(sched.iter_batches(steps=1))
        assert [s.value for s in mb.samples] == [8]
    assert sched.dropped() == [ids[0]]
    assert sched.metrics()["staleness"]["dropped"] == {"2": 1}


def test_a_batch_that_cannot_fill_comes_short_then_the_loop_ends() -> None:
    sched = Colocated(2, 1, 3, max_staleness=1)
    with sched:
        sched.submit_many(_works(4))
        sizes = []
        for mb in sched.iter_batches(steps=5):
            sizes.append(len(mb))
            sched.step_done()
    assert sizes == [3, 1]


def test_misuse_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one device"):
        Colocated(0, 1, 1, max_staleness=0)
    sched = Colocated(1, 1, 1, max_staleness=0)
    with sched:
        with pytest.raises(ScheduleError, match="without a batch"):
            sched.step_done()
        sched.submit_many(_works(2))
        it = sched.iter_batches()
        next(it)
        with pytest.raises(ScheduleError, match="before step_done"):
            next(it)
        with pytest.raises(ScheduleError, match="next version is 1"):
            sched.step_done(5)


def test_reports_what_the_scheduler_reports() -> None:
    """Same metric keys as the elastic scheduler running the colocated policy, so a
    run's rows and report read either."""
    plain: RolloutScheduler = Colocated(2, 1, 2, max_staleness=1)
    full: RolloutScheduler = Scheduler(
        LocalBackend(2, 1, mode="thread"), ColocatedPolicy(),
        PoolConfig(n_devices=2, slots_per_device=1, batch_size=2, max_staleness=1))
    results = []
    for sched in (plain, full):
        with sched:
            sched.submit_many(_works(4))
            values = []
            for mb in sched.iter_batches(steps=2, flush=False):
                values.extend(s.value for s in mb.samples)
                if mb.done():
                    sched.step_done()
            results.append((sorted(values), sched.metrics()))
    (v1, m1), (v2, m2) = results
    assert v1 == v2 == [0, 1, 2, 3]
    assert set(m1) == set(m2)
    for key in ("policy", "policy_version", "role_switches", "staleness", "sessions",
                "trained", "steps", "migrations"):
        assert m1[key] == m2[key], key
