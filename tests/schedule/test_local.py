"""The real scheduler on the local backend: real (sleep-based) rollouts, a train step in
between, role switches, a staleness-bounded stream, crashes and failures."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from tests.schedule.sessions import crash_once_session, failing_session, sleep_session
from tidal.schedule.backend import Work
from tidal.schedule.local import LocalBackend
from tidal.schedule.policy import ColocatedPolicy, ElasticPolicy, FixedSplitPolicy
from tidal.schedule.scheduler import MiniBatch, Scheduler
from tidal.schedule.types import PoolConfig, Role

from .test_sim import check_trace


def work_log(path: Path) -> list[tuple[int, int, float, float]]:
    rows = []
    for line in path.read_text().splitlines():
        sid, dev, t0, t1, _pid = line.split()
        rows.append((int(sid), int(dev), float(t0), float(t1)))
    return rows


def assert_no_switch_interrupted_a_session(sched: Scheduler, log: Path) -> None:
    """Independent of the pool: the workers' own wall-clock log of each session against
    the scheduler's switch log."""
    rows = work_log(log)
    switches = sched.metrics()["role_switches"]
    assert switches["to_train"] + switches["to_rollout"] == len(sched.pool.switch_log)
    for t, dev, _to in sched.pool.switch_log:
        tw = sched.t0_wall + t
        for sid, d, t0, t1 in rows:
            if d == dev:
                assert not (t0 + 0.005 < tw < t1 - 0.005), (
                    f"switch of device {dev} at {tw:.3f} inside session {sid} [{t0:.3f}, {t1:.3f}]"
                )


def test_streaming_training_with_role_switches_and_bounded_staleness(tmp_path: Path) -> None:
    log = tmp_path / "sessions.log"
    n, c, b, k = 3, 2, 4, 1
    cfg = PoolConfig(n_devices=n, slots_per_device=c, batch_size=b, max_staleness=k,
                     rate_window_s=0.5)
    rng = random.Random(1)
    durations = [min(0.6, rng.lognormvariate(-2.3, 0.8)) for _ in range(28)]
    sched = Scheduler(
        LocalBackend(n, c, mode="thread", switch_delay_s=0.02),
        ElasticPolicy.for_sessions(0.15),
        cfg,
        trace=True,
    )
    trained: list[tuple[int, int, int]] = []  # (version trained, sample version, staleness)
    first_batch_at = None
    steps = 0
    with sched:
        ids = sched.submit_many(
            Work(sleep_session, (d, 50), {"log": str(log)}, pass_context=True) for d in durations
        )
        for mb in sched.iter_batches(timeout=30):
            assert isinstance(mb, MiniBatch)
            first_batch_at = first_batch_at or time.time()
            time.sleep(0.01 * len(mb))  # the "train step" on this mini-batch
            for s in mb.samples:
                trained.append((mb.version, s.policy_version, s.staleness))
                assert s.value["session"] == s.session and s.tokens == 50
            if mb.done():
                sched.step_done()
                steps += 1
        m = sched.metrics()
    # every session is accounted for: trained, dropped as stale, or failed
    assert len(trained) + len(m["dropped_sessions"]) + len(m["failed_sessions"]) == len(ids)
    assert m["trained"] == len(trained) and not m["failed_sessions"]
    # the staleness bound holds for every trained sample, and is measured right
    assert trained and all(st <= k for _, _, st in trained)
    assert all(v - pv == st for v, pv, st in trained)
    assert m["staleness"]["dropped_total"] == len(m["dropped_sessions"])
    # streaming: training started before the last session ended
    last_end = max(t1 for _, _, _, t1 in work_log(log))
    assert first_batch_at is not None and first_batch_at < last_end
    # devices changed roles, and never under a live session
    assert m["role_switches"]["to_train"] >= 1
    assert_no_switch_interrupted_a_session(sched, log)
    check_trace(sched.pool.trace or [], k=k, hist={st: 1 for _, _, st in trained})
    # metrics a run report needs
    assert 0 < m["utilization"] <= 1 and len(m["idle_s_per_device"]) == n
    assert steps == m["steps"] == sched.policy_version


def test_colocated_switches_all_devices_together_and_trains_on_policy(tmp_path: Path) -> None:
    log = tmp_path / "sessions.log"
    n, c = 2, 2
    cfg = PoolConfig(n_devices=n, slots_per_device=c, batch_size=n * c, max_staleness=0)
    sched = Scheduler(LocalBackend(n, c, mode="thread"), ColocatedPolicy(), cfg, trace=True)
    with sched:
        sched.submit_many(
            Work(sleep_session, (0.05 * (i % 3 + 1),), {"log": str(log)}, pass_context=True)
            for i in range(12)
        )
        seen: list[int] = []
        steps = sched.run_training(lambda mb: seen.extend(s.staleness for s in mb.samples),
                                   timeout=30)
        m = sched.metrics()
    assert steps == 3 and seen == [0] * 12
    assert m["role_switches"] == {"to_train": 6, "to_rollout": 4}
    assert_no_switch_interrupted_a_session(sched, log)


def test_fixed_split_keeps_its_roles() -> None:
    cfg = PoolConfig(n_devices=3, slots_per_device=1, batch_size=2, max_staleness=1)
    sched = Scheduler(LocalBackend(3, 1, mode="thread"), FixedSplitPolicy(n_train=1), cfg)
    with sched:
        sched.submit_many(Work(sleep_session, (0.02,), pass_context=True) for _ in range(6))
        assert sched.run_training(lambda mb: None, timeout=30) == 3
        m = sched.metrics()
    assert m["role_switches"] == {"to_train": 0, "to_rollout": 0}
    assert m["train_s_per_device"][2] > 0 and m["rollout_s_per_device"][2] == 0


def test_a_crashed_worker_process_is_resumed_and_nothing_is_lost(tmp_path: Path) -> None:
    marker = tmp_path / "crashed"
    cfg = PoolConfig(n_devices=2, slots_per_device=1, batch_size=2, max_staleness=1)
    sched = Scheduler(LocalBackend(2, 1, mode="process"), FixedSplitPolicy(n_train=1), cfg)
    with sched:
        crash = sched.submit(Work(crash_once_session, (0.4, str(marker)), pass_context=True))
        ok = sched.submit(Work(sleep_session, (0.05,), pass_context=True))
        values: dict[int, object] = {}
        sched.run_training(lambda mb: values.update({s.session: s.value for s in mb.samples}),
                           timeout=120)
        m = sched.metrics()
    assert marker.exists()  # it did crash once
    assert values[crash] == {"resumed": True, "attempt": 2}
    assert ok in values
    assert m["sessions"]["requeued"] == 1 and m["failed_sessions"] == []


def test_retries_spent_or_a_raising_session_ends_as_infra_error(tmp_path: Path) -> None:
    cfg = PoolConfig(n_devices=1, slots_per_device=2, batch_size=2, max_staleness=0)
    sched = Scheduler(LocalBackend(1, 2, mode="thread"), ColocatedPolicy(), cfg, max_retries=0)
    with sched:
        bad = sched.submit(Work(failing_session, pass_context=True))
        good = sched.submit(Work(sleep_session, (0.02,), pass_context=True))
        got: list[int] = []
        steps = sched.run_training(lambda mb: got.extend(s.session for s in mb.samples),
                                   timeout=30)
        failed = sched.failed()
    assert got == [good] and steps == 1  # the short final batch was flushed
    assert [f.session for f in failed] == [bad]
    assert failed[0].status.value == "infra_error" and "on purpose" in failed[0].error


def test_backend_and_config_must_agree() -> None:
    with pytest.raises(ValueError, match="devices"):
        Scheduler(LocalBackend(2, 1, mode="thread"), ElasticPolicy(),
                  PoolConfig(n_devices=3, batch_size=2))
    with pytest.raises(ValueError, match="migration"):
        Scheduler(LocalBackend(2, 1, mode="thread"), ElasticPolicy(),
                  PoolConfig(n_devices=2, batch_size=2, migration=True))
    assert Role.TRAIN.value == "train"
