"""The shared bookkeeping: invariants every driver (simulator, real scheduler) relies on."""

from __future__ import annotations

import pytest

from tidal.schedule.pool import BeginSwitch, Launch, Pool, RunTrain, SState, StepReady
from tidal.schedule.types import (
    Drain,
    Migrate,
    PoolConfig,
    Role,
    ScheduleError,
    StalenessRule,
    Start,
    Switch,
    Train,
    Undrain,
)

R, T = Role.ROLLOUT, Role.TRAIN


def make(n: int = 2, c: int = 2, b: int = 2, k: int = 1, roles: list[Role] | None = None, **kw):
    cfg = PoolConfig(n_devices=n, slots_per_device=c, batch_size=b, max_staleness=k, **kw)
    return Pool(cfg, roles or [R] * n, trace=True)


def test_switch_refuses_a_device_with_a_live_session() -> None:
    p = make()
    p.submit(1)
    p.apply([Start(0, 1)], 0.0)
    with pytest.raises(ScheduleError, match="live session"):
        p.apply([Switch(0, T)], 1.0)
    # draining does not interrupt it either; once it ends the switch is allowed
    p.apply([Drain(0)], 1.0)
    with pytest.raises(ScheduleError, match="draining"):
        p.submit(1)
        p.apply([Start(0, 1)], 1.0)
    p.session_finished(0, 5.0)
    (eff,) = p.apply([Switch(0, T)], 5.0)
    assert eff == BeginSwitch(0, T)
    assert p.view(0).switching and p.view(0).role is T


def test_admission_gate_keeps_at_most_k_plus_one_batches_in_flight() -> None:
    p = make(n=4, c=4, b=2, k=1)  # gate: (1 + 1) * 2 = 4
    p.submit(10)
    assert p.admissible == 4
    with pytest.raises(ScheduleError, match="only 0 sessions may start"):
        p.apply([Start(0, 4), Start(1, 1)], 0.0)
    p2 = make(n=4, c=4, b=2, k=1)
    p2.submit(10)
    effects = p2.apply([Start(0, 4)], 0.0)
    assert [type(e) for e in effects] == [Launch] * 4
    assert p2.admissible == 0
    p2.session_finished(0, 1.0)  # finished but untrained samples still count
    assert p2.in_flight == 4 and p2.admissible == 0


def test_staleness_drop_rule_counts_and_never_trains_stale_samples() -> None:
    p = make(n=2, c=2, b=1, k=1, roles=[R, T])
    p.submit(3)
    p.apply([Start(0, 2)], 0.0)  # sessions 0, 1 at version 0
    p.session_finished(0, 1.0)
    (rt,) = p.apply([Train(1, 1)], 1.0)
    assert isinstance(rt, RunTrain) and rt.sessions == (0,)
    assert isinstance(p.train_done(1, 2.0), StepReady)
    p.step_done(3.0)  # version 1
    p.apply([Start(0, 1)], 3.0)  # session 2 at version 1
    p.session_finished(2, 4.0)
    p.apply([Train(1, 1)], 4.0)
    p.train_done(1, 5.0)
    p.step_done(6.0)  # version 2: session 1 (version 0) is now 2 behind > K
    p.session_finished(1, 7.0)
    assert p.sessions[1].state is SState.DROPPED
    assert p.dropped_stale == 1 and p.staleness_dropped == {2: 1}
    assert p.staleness_trained == {0: 2}  # each trained by the version that made it
    assert p.snapshot(7.0).buffered == 0


def test_staleness_downweight_rule_trains_with_a_smaller_weight() -> None:
    p = make(n=2, c=2, b=1, k=0, roles=[R, T], staleness_rule=StalenessRule.DOWNWEIGHT)
    p.submit(2)
    p.apply([Start(0, 1)], 0.0)
    p.session_finished(0, 1.0)
    p.apply([Train(1, 1)], 1.0)
    p.train_done(1, 2.0)
    p.step_done(2.0)  # version 1
    p.apply([Start(0, 1)], 2.0)  # session 1 at version 1
    p.session_finished(1, 3.0, version=0)  # its oldest token came from version 0
    (rt,) = p.apply([Train(1, 1)], 3.0)
    assert rt.weights == (0.5,)  # 1 / (1 + 1 - 0)
    assert p.downweighted == 1 and p.dropped_stale == 0


def test_optimizer_step_waits_for_the_whole_batch() -> None:
    p = make(n=3, c=1, b=2, k=1, roles=[R, T, T])
    p.submit(2)
    p.apply([Start(0, 1)], 0.0)
    p.session_finished(0, 1.0)
    p.apply([Train(1, 1)], 1.0)
    assert p.train_done(1, 2.0) is None  # 1 of 2 samples
    p.apply([Start(0, 1)], 2.0)
    p.session_finished(1, 3.0)
    with pytest.raises(ScheduleError, match="not an idle train device"):
        p.apply([Train(0, 1)], 3.0)
    p.apply([Train(2, 1)], 3.0)
    ready = p.train_done(2, 4.0)
    assert isinstance(ready, StepReady) and set(ready.devices) == {1, 2}
    with pytest.raises(ScheduleError, match="optimizer step"):
        p.apply([Train(1, 1)], 4.0)
    p.step_done(5.0)
    assert p.version == 1 and p.trained == 2


def test_migration_moves_a_session_without_ending_it() -> None:
    p = make(n=2, c=2, b=4, k=1, migration=True)
    p.submit(2)
    p.apply([Start(0, 1), Start(1, 1)], 0.0)
    p.apply([Drain(1), Migrate(1, 0)], 1.0)
    assert p.view(1).sessions == () and p.view(0).arriving == (1,)
    assert p.sessions[1].state is SState.MIGRATING
    p.apply([Switch(1, T)], 1.0)  # empty now: allowed
    p.migrated(1, 2.0)
    assert p.view(0).sessions == (0, 1) and p.view(0).arriving == ()
    p.session_finished(1, 3.0)
    assert p.sessions[1].state is SState.BUFFERED


def test_migration_needs_backend_support() -> None:
    p = make()
    p.submit(1)
    p.apply([Start(0, 1)], 0.0)
    with pytest.raises(ScheduleError, match="no session migration"):
        p.apply([Migrate(0, 1)], 1.0)


def test_failed_session_is_requeued_first_or_ends_as_infra_error() -> None:
    p = make(n=1, c=2, b=2, k=0)
    p.submit(3)
    p.apply([Start(0, 2)], 0.0)
    p.session_failed(0, 1.0, requeue=True)
    assert p._queue[0] == 0 and p.requeued == 1
    p.session_failed(1, 1.0, requeue=False)
    assert p.sessions[1].state is SState.FAILED and p.failed == 1
    assert p.in_flight == 0


def test_flush_closes_a_short_final_step() -> None:
    p = make(n=2, c=1, b=4, k=0, roles=[R, T])
    p.submit(1)
    p.apply([Start(0, 1)], 0.0)
    assert p.flush(0.5) is None  # a session is still running
    p.session_finished(0, 1.0)
    assert p.flush(1.0) is None  # shortened to 1, not yet trained
    assert p.snapshot(1.0).step_open == 1
    p.apply([Train(1, 4)], 1.0)
    assert isinstance(p.train_done(1, 2.0), StepReady)
    p.step_done(2.0)
    assert p.trained == 1 and p.snapshot(2.0).step_size == 4


def test_undrain_and_metrics_account_time_per_device() -> None:
    p = make(n=2, c=2, b=2, k=1)
    p.submit(2)
    p.apply([Start(0, 2)], 0.0)
    p.apply([Drain(1)], 0.0)
    p.apply([Undrain(1)], 5.0)
    p.session_finished(0, 10.0)
    p.session_finished(1, 10.0)
    m = p.metrics(20.0)
    assert m.busy_s == [10.0, 0.0]  # two of two slots for 10 s
    assert m.idle_s == [10.0, 20.0]
    assert m.utilization == pytest.approx(10 / 40)
