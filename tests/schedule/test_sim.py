"""The simulator: hand-computed timelines, invariants on random workloads, determinism,
speed at 1024 devices."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace
from typing import Any

import pytest

from tidal.schedule.policy import ColocatedPolicy, ElasticPolicy, FixedSplitPolicy, Policy
from tidal.schedule.sim import SimConfig, simulate
from tidal.schedule.types import PoolConfig
from tidal.schedule.workload import LognormalWorkload, SessionTable


def sim_cfg(pool: PoolConfig, target: int) -> SimConfig:
    # every sample has 10 tokens at 1 s/token: a micro-batch of one takes 10 s
    return SimConfig(pool=pool, target_samples=target, train_s_per_token=1.0, step_overhead_s=5)


def test_colocated_hand_computed_timeline() -> None:
    """2 devices, 1 slot, batch 2, durations 100, 300 | 50, 60.

    0      start s0 on d0, s1 on d1
    100    s0 ends (d0 idles: synchronous)
    300    s1 ends -> both switch to train (8.5 s)
    308.5  each trains one sample (10 s) -> 318.5 optimizer step (5 s) -> 323.5 v1
    323.5  both switch back (3.5 s) -> 327 start s2 (50 s), s3 (60 s)
    387    s3 ends -> switch -> 395.5 train -> 405.5 step -> 410.5 v2
    busy: d0 100+10+5+50+10+5 = 180, d1 300+10+5+60+10+5 = 390 of 2 x 410.5
    """
    pool = PoolConfig(n_devices=2, batch_size=2, slots_per_device=1, max_staleness=0)
    r = simulate(
        ColocatedPolicy(), SessionTable.fixed([100, 300, 50, 60], 10), sim_cfg(pool, 4), trace=True
    )
    assert r.makespan_s == pytest.approx(410.5)
    assert r.utilization == pytest.approx(570 / 821)
    assert r.staleness_hist() == {0: 4}
    events = [(t, what, *rest) for t, what, *rest in r.trace or []]
    assert (300.0, "switch", 0, "train") in events
    assert (308.5, "train", 0, (0,)) in events and (308.5, "train", 1, (1,)) in events
    assert (323.5, "version", 1) in events
    assert (327.0, "start", 2, 0, 1) in events and (327.0, "start", 3, 1, 1) in events
    assert r.metrics.switches_to_train == 4 and r.metrics.switches_to_rollout == 2


def test_fixed_split_hand_computed_timeline() -> None:
    """d0 rolls out, d1 trains; batch 1, staleness <= 1 (two samples in flight).

    0    s0 starts (v0)
    100  s0 ends: d1 trains it (-> 110, step -> 115 v1); s1 starts (v0)
    150  s1 ends: d1 trains it, 1 version behind (-> 160, step -> 165 v2); s2 starts (v1)
    350  s2 ends: trained (v1 at step 2: 1 behind) -> 360, step -> 365 v3; s3 runs 350-365
    busy: d0 365 (always a session), d1 3 x 15 = 45, of 2 x 365
    """
    pool = PoolConfig(n_devices=2, batch_size=1, slots_per_device=1, max_staleness=1)
    r = simulate(
        FixedSplitPolicy(n_train=1),
        SessionTable.fixed([100, 50, 200, 1000], 10),
        sim_cfg(pool, 3),
        trace=True,
    )
    assert r.makespan_s == pytest.approx(365)
    assert r.utilization == pytest.approx(410 / 730)
    assert r.staleness_hist() == {0: 1, 1: 2}
    assert r.metrics.switches_to_train == r.metrics.switches_to_rollout == 0
    events = r.trace or []
    assert (100.0, "start", 1, 0, 0) in events and (150.0, "start", 2, 0, 1) in events


def test_elastic_hand_computed_timeline() -> None:
    """2 devices, both roll out first; batch 1, staleness <= 1.

    0      s0 on d0, s1 on d1
    100    s0 ends: training needs a device, d0 is empty -> switch (8.5 s); the gate
           (2 in flight: s1 + s0) admits nothing
    108.5  d0 trains s0 -> 118.5 step -> 123.5 v1; measured 10 s/sample, finish rate
           ~1/1800 s: demand 0.006 devices -> keep 1 train device (never below demand)
    300    s1 ends: d0 trains it (1 behind) -> 310 -> 315 v2; d1 takes s2 (v1)
    400    s2 ends: d0 trains it -> 410 -> 415 v3; d1 takes s3
    busy: d0 100 + 3 x 15 = 145, d1 415, of 2 x 415
    """
    pool = PoolConfig(n_devices=2, batch_size=1, slots_per_device=1, max_staleness=1)
    r = simulate(
        ElasticPolicy(),
        SessionTable.fixed([100, 300, 100, 1000], 10),
        sim_cfg(pool, 3),
        trace=True,
    )
    assert r.makespan_s == pytest.approx(415)
    assert r.utilization == pytest.approx(560 / 830)
    assert r.staleness_hist() == {0: 1, 1: 2}
    assert r.metrics.switch_log == [(100.0, 0, "train")]
    events = r.trace or []
    assert (108.5, "train", 0, (0,)) in events
    assert (300.0, "start", 2, 1, 1) in events and (400.0, "start", 3, 1, 2) in events


def test_elastic_migration_empties_a_draining_device() -> None:
    """2 devices x 2 slots, batch 2, staleness <= 1 (4 in flight).

    0      s0, s1 on d0; s2, s3 on d1 (packed, fullest first)
    100    s0 ends: training needs a device, none is empty -> drain d0 (s1 left)
    200    s2 ends, freeing a slot on d1: with migration s1 moves there (paused 30 s),
           d0 is empty and switches (8.5 s) -> trains s0, s2 (10 s each) -> step 5 s
           -> v1 at 233.5; s1 resumes on d1 at 230 with its remaining 4800 s.
    Without migration d0 must wait for s1 (5000 s) before it can train.
    """
    durations = [100, 5000, 200, 5000, 9000, 9000, 9000]

    def run(migration: bool):
        pool = PoolConfig(
            n_devices=2, batch_size=2, slots_per_device=2, max_staleness=1,
            migration=migration, migrate_s=30.0,
        )
        return simulate(
            ElasticPolicy(), SessionTable.fixed(durations, 10), sim_cfg(pool, 2), trace=True
        )

    r = run(True)
    events = r.trace or []
    assert (100.0, "drain", 0) in events
    assert (200.0, "migrate", 1, 0, 1) in events
    assert (200.0, "switch", 0, "train") in events
    assert (230.0, "migrated", 1, 1) in events
    assert r.makespan_s == pytest.approx(233.5)
    check_trace(events, k=1, hist=r.staleness_hist())
    slow = run(False)
    assert slow.makespan_s == pytest.approx(5000 + 8.5 + 10 + 10 + 5)
    assert slow.metrics.migrations == 0


# ----------------------------------------------------------------------- invariants


def check_trace(trace: list[tuple[Any, ...]], *, k: int, hist: dict[int, int]) -> None:
    """Replay a trace: no switch ever happens on a device holding a live session, and
    no trained sample is more than k versions behind."""
    live: dict[int, set[int]] = defaultdict(set)
    where: dict[int, int] = {}
    for ev in trace:
        t, what = ev[0], ev[1]
        if what == "start":
            sid, d = ev[2], ev[3]
            live[d].add(sid)
            where[sid] = d
        elif what in ("end", "failed", "requeue"):
            sid = ev[2]
            live[where.pop(sid)].discard(sid)
        elif what == "migrate":
            sid, src, dst = ev[2], ev[3], ev[4]
            live[src].discard(sid)
            live[dst].add(sid)
            where[sid] = dst
        elif what == "switch":
            d = ev[2]
            assert not live[d], f"t={t}: device {d} switched with live sessions {live[d]}"
    assert all(s <= k for s in hist), hist


POLICIES: list[tuple[str, Any]] = [
    ("colocated", lambda n: ColocatedPolicy()),
    ("async", lambda n: FixedSplitPolicy(n_train=max(1, n // 4))),
    ("async_batch", lambda n: FixedSplitPolicy(n_train=max(1, n // 4), batch_sync=True)),
    ("elastic", lambda n: ElasticPolicy()),
]


CASES = [(name, make, False) for name, make in POLICIES] + [
    ("elastic", lambda n: ElasticPolicy(), True)
]


@pytest.mark.parametrize(
    "name,make,migration", CASES, ids=[c[0] + ("+migrate" if c[2] else "") for c in CASES]
)
@pytest.mark.parametrize("n,c,k,sigma", [(3, 1, 1, 0.5), (8, 3, 2, 1.0), (5, 2, 0, 0.8)])
def test_invariants_on_random_workloads(  # noqa: PLR0917
    name: str, make: Any, migration: bool, n: int, c: int, k: int, sigma: float
) -> None:
    kk = 0 if name == "colocated" else k
    pool = PoolConfig(
        n_devices=n, batch_size=n * c, slots_per_device=c, max_staleness=kk, migration=migration
    )
    cfg = SimConfig(pool=pool, target_samples=6 * n * c, train_s_per_token=3e-4)
    policy: Policy = make(n)
    r = simulate(policy, LognormalWorkload(sigma=sigma), cfg, seed=7, trace=True)
    assert r.trained == 6 * n * c
    check_trace(r.trace or [], k=kk, hist=r.staleness_hist())
    m = r.metrics
    assert m.sessions_started >= m.sessions_finished >= m.trained + m.dropped_stale
    assert 0 < m.utilization <= 1
    for d in range(n):
        total = m.busy_s[d] + m.idle_s[d] + m.switching_s[d]
        assert total == pytest.approx(m.elapsed, rel=1e-9, abs=1e-6)
    # deterministic given the seed
    r2 = simulate(policy, LognormalWorkload(sigma=sigma), cfg, seed=7, trace=True)
    assert r2.trace == r.trace and r2.makespan_s == r.makespan_s


def test_sessions_are_the_same_under_every_policy() -> None:
    wl = LognormalWorkload(sigma=0.7)
    a, b = SessionTable(wl, 3), SessionTable(wl, 3)
    a.ensure(10_000)
    b.ensure(5000)
    b.ensure(10_000)
    assert (a.durations[:10_000] == b.durations[:10_000]).all()
    assert (a.tokens[:10_000] == b.tokens[:10_000]).all()


def test_1024_devices_thousands_of_rollouts_in_seconds() -> None:
    n, c = 1024, 4
    pool = PoolConfig(n_devices=n, batch_size=n * c, slots_per_device=c, max_staleness=2,
                      migration=True)
    cfg = SimConfig(pool=pool, target_samples=2 * n * c)  # 8192 trained rollouts
    timings = {}
    for name, policy in [
        ("colocated", ColocatedPolicy()),
        ("async", FixedSplitPolicy(n_train=n // 5)),
        ("elastic", ElasticPolicy()),
    ]:
        p = pool if name == "elastic" else PoolConfig(
            n_devices=n, batch_size=n * c, slots_per_device=c,
            max_staleness=0 if name == "colocated" else 2,
        )
        t = time.perf_counter()
        r = simulate(policy, LognormalWorkload(), replace(cfg, pool=p))
        timings[name] = time.perf_counter() - t
        assert r.trained == cfg.target_samples
    # a couple of seconds each here; generous for a loaded 2-core CI machine
    assert max(timings.values()) < 60, timings
