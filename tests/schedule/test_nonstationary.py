"""Non-stationary workloads and decode that speeds up as a device empties (issue 24).

Drift: later sessions really are longer, by exactly the documented factor, and session
`i` is the same under every policy. Decode speedup: hand-computed timelines, and on
random runs with migrations every finished session's work, integrated over the speed
its device had at each moment (rebuilt from the trace), equals its drawn duration.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from typer.main import get_command

from tests.benches import load_bench
from tidal.cli import app
from tidal.schedule.compare import Scenario, compare
from tidal.schedule.policy import ColocatedPolicy, ElasticPolicy, FixedSplitPolicy
from tidal.schedule.sim import SimConfig, simulate
from tidal.schedule.types import MIGRATE_S, PoolConfig
from tidal.schedule.workload import (
    DriftingWorkload,
    EmpiricalWorkload,
    LognormalWorkload,
    SessionTable,
)

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------- drift


def test_drift_scales_session_i_by_its_progress() -> None:
    base = LognormalWorkload(sigma=0.6)
    wl = DriftingWorkload(base, growth=3.0, over_sessions=10_000)
    drifting, plain = SessionTable(wl, 5), SessionTable(base, 5)
    drifting.ensure(12_000)
    plain.ensure(12_000)
    n = 12_000
    i = np.arange(n)
    expect = 1 + 2 * np.minimum(1, i / 10_000)
    # the same base draw for session i, times its factor: 1x first, 2x half way, 3x after
    ratio = drifting.durations[:n] / plain.durations[:n]
    np.testing.assert_allclose(ratio, expect, rtol=1e-12)
    assert np.array_equal(drifting.tokens[:n], np.maximum(1, np.rint(plain.tokens[:n] * expect)))
    assert expect[0] == 1 and expect[5000] == 2 and (expect[10_000:] == 3).all()
    # really longer: the first 1000 average 1.1x, those past 10,000 3x (2.7x as long)
    early, late = drifting.durations[:1000].mean(), drifting.durations[10_000:n].mean()
    assert 2.4 < late / early < 3.0
    assert 2.4 < drifting.tokens[10_000:n].mean() / drifting.tokens[:1000].mean() < 3.0


def test_geometric_drift_and_separate_token_growth() -> None:
    base = LognormalWorkload()
    wl = DriftingWorkload(base, growth=4.0, token_growth=1.5, over_sessions=8192,
                          shape="geometric")
    assert wl.factor(4096) == pytest.approx(2.0)  # 4 ** 0.5
    assert wl.factor(4096, wl.tokens_growth) == pytest.approx(math.sqrt(1.5))
    d, tok = wl.draw_at(np.random.default_rng([0, 2]), 8192, 10)
    d0, tok0 = base.draw(np.random.default_rng([0, 2]), 10)
    np.testing.assert_allclose(d, d0 * 4.0)
    assert np.array_equal(tok, np.rint(tok0 * 1.5))
    desc = wl.describe()
    assert desc["kind"] == "drifting" and desc["token_growth"] == 1.5
    assert desc["last"] == {"mean_s": 7200 * 4.0, "mean_tokens": 864_000 * 1.5}
    assert "durations x4, tokens x1.5 (geometric)" in str(desc["summary"])
    # over the run, the mean lies between the first and the last sessions'
    assert 7200 * 1.5 < float(desc["mean_s"]) < 7200 * 3  # type: ignore[arg-type]


def test_drift_wraps_a_recorded_workload_too() -> None:
    wl = DriftingWorkload(EmpiricalWorkload((100.0, 200.0), (10, 20)), growth=2.0,
                          over_sessions=4)
    t = SessionTable(wl, 0)
    t.ensure(8)
    base = SessionTable(wl.base, 0)
    base.ensure(8)
    np.testing.assert_allclose(t.durations[:8] / base.durations[:8],
                               [1, 1.25, 1.5, 1.75, 2, 2, 2, 2])


def _lasted(trace: list[tuple[Any, ...]]) -> dict[int, float]:
    start, lasted = {}, {}
    for ev in trace:
        if ev[1] == "start":
            start[ev[2]] = ev[0]
        elif ev[1] == "end":
            lasted[ev[2]] = ev[0] - start[ev[2]]
    return lasted


def test_session_i_is_the_same_under_every_policy() -> None:
    """Two policies consume the lazily drawn table differently; session i still has the
    same draw, and (no migration, no speedup) lasts exactly that long under both."""
    wl = DriftingWorkload(LognormalWorkload(sigma=0.8), growth=3.0, over_sessions=96)
    pool = PoolConfig(n_devices=4, batch_size=16, slots_per_device=4, max_staleness=1)
    cfg = SimConfig(pool=pool, target_samples=96, train_s_per_token=3e-4)
    tables = [SessionTable(wl, 11), SessionTable(wl, 11)]
    runs = [
        simulate(FixedSplitPolicy(n_train=1), tables[0], cfg, trace=True),
        simulate(ColocatedPolicy(), tables[1], SimConfig(
            pool=PoolConfig(n_devices=4, batch_size=16, slots_per_device=4, max_staleness=0),
            target_samples=96, train_s_per_token=3e-4), trace=True),
    ]
    fresh = SessionTable(wl, 11)
    fresh.ensure(10_000)  # in one go; the runs drew one chunk, and tables[0] grows later
    tables[0].ensure(9000)
    for t in tables:
        m = t.durations.shape[0]
        assert np.array_equal(t.durations, fresh.durations[:m])
        assert np.array_equal(t.tokens, fresh.tokens[:m])
    a, b = (_lasted(r.trace or []) for r in runs)
    common = sorted(set(a) & set(b))
    assert len(common) >= 90
    for sid in common:
        assert a[sid] == pytest.approx(b[sid], rel=1e-12)
        assert a[sid] == pytest.approx(fresh.durations[sid], rel=1e-12)
    assert max(a[s] for s in common[-10:]) > min(a[s] for s in common[:10])


# ----------------------------------------------------------------------- decode speedup


def _three_on_one(speedup: float) -> Any:
    """d0 rolls out 3 sessions at once (3 slots), d1 trains; batch 3, K=0 (nothing else
    starts); 10 tokens at 1 s/token; step 5 s."""
    pool = PoolConfig(n_devices=2, batch_size=3, slots_per_device=3, max_staleness=0)
    cfg = SimConfig(pool=pool, target_samples=3, train_s_per_token=1.0, step_overhead_s=5,
                    decode_speedup=speedup)
    return simulate(FixedSplitPolicy(n_train=1), SessionTable.fixed([30, 60, 120], 10), cfg,
                    trace=True)


def test_decode_speedup_hand_computed() -> None:
    """speedup 0.6 on 3 slots: speed(3) = 1, speed(2) = 1 / (0.4 + 0.4) = 1.25,
    speed(1) = 1 / (0.4 + 0.2) = 5/3.

    0   s0, s1, s2 start (work 30, 60, 120 full-load seconds), all at speed 1
    30  s0 ends; s1 has 30 left, s2 90; both at 1.25 -> s1 ends at 30 + 24 = 54
    54  s2 has 90 - 24 x 1.25 = 60 left, alone at 5/3 -> ends at 54 + 36 = 90
    90  trained (10 s) -> 100, step -> 105.  Without speedup: ends 30, 60, 120 -> 135.
    """
    fast, slow = _three_on_one(0.6), _three_on_one(0.0)
    ends = {ev[2]: ev[0] for ev in fast.trace or [] if ev[1] == "end"}
    assert ends[0] == pytest.approx(30) and ends[1] == pytest.approx(54)
    assert ends[2] == pytest.approx(90)
    assert fast.makespan_s == pytest.approx(105)
    assert slow.makespan_s == pytest.approx(135)
    assert {ev[2]: ev[0] for ev in slow.trace or [] if ev[1] == "end"} == {0: 30, 1: 60, 2: 120}


def test_decode_speed_curve_and_default() -> None:
    pool = PoolConfig(n_devices=2, batch_size=1, slots_per_device=4)
    cfg = SimConfig(pool=pool, target_samples=1, decode_speedup=0.3)
    assert cfg.decode_speed(4) == 1.0
    assert cfg.decode_speed(1) == pytest.approx(1 / (0.7 + 0.075))
    assert SimConfig(pool=pool, target_samples=1).decode_speedup == 0.0
    assert all(SimConfig(pool=pool, target_samples=1).decode_speed(k) == 1.0 for k in range(5))
    full = SimConfig(pool=pool, target_samples=1, decode_speedup=1.0)
    assert full.decode_speed(1) == 4.0


def _work_done(trace: list[tuple[Any, ...]], speed: Any) -> dict[int, float]:
    """Each ended session's work: the integral of its device's speed over the time it
    ran there (paused while migrating), rebuilt from the trace alone."""
    running: dict[int, set[int]] = defaultdict(set)
    where: dict[int, int] = {}
    work: dict[int, float] = defaultdict(float)
    done: dict[int, float] = {}
    last = 0.0
    for ev in trace:
        t, what = ev[0], ev[1]
        if t > last:
            for sids in running.values():
                for sid in sids:
                    work[sid] += (t - last) * speed(len(sids))
            last = t
        if what == "start":
            running[ev[3]].add(ev[2])
            where[ev[2]] = ev[3]
        elif what == "end":
            running[where.pop(ev[2])].discard(ev[2])
            done[ev[2]] = work[ev[2]]
        elif what == "migrate":
            running[ev[3]].discard(ev[2])
        elif what == "migrated":
            running[ev[3]].add(ev[2])
            where[ev[2]] = ev[3]
    return done


@pytest.mark.parametrize("policy", ["elastic", "colocated"])
def test_decode_speedup_is_exact_with_migrations(policy: str) -> None:
    wl = DriftingWorkload(LognormalWorkload(sigma=0.9), growth=2.0, token_growth=3.0,
                          over_sessions=90)
    pool = PoolConfig(n_devices=5, batch_size=15, slots_per_device=3,
                      max_staleness=0 if policy == "colocated" else 2,
                      migration=policy == "elastic", migrate_s=120.0)
    cfg = SimConfig(pool=pool, target_samples=90, train_s_per_token=3e-4, decode_speedup=0.5)
    pol = ElasticPolicy() if policy == "elastic" else ColocatedPolicy()
    table = SessionTable(wl, 4)
    r = simulate(pol, table, cfg, trace=True)
    assert r.trained == 90
    if policy == "elastic":
        assert r.metrics.migrations > 0
    done = _work_done(r.trace or [], cfg.decode_speed)
    assert len(done) >= 90
    for sid, w in done.items():
        assert w == pytest.approx(table.durations[sid], rel=1e-9), sid
    # and a partly empty device did speed its sessions up: faster than the slot model
    plain = simulate(pol, SessionTable(wl, 4), SimConfig(
        pool=pool, target_samples=90, train_s_per_token=3e-4))
    assert r.makespan_s < plain.makespan_s


def test_deterministic_with_drift_speedup_and_migration() -> None:
    wl = DriftingWorkload(LognormalWorkload(sigma=1.0), growth=3.0, over_sessions=120)
    pool = PoolConfig(n_devices=6, batch_size=24, slots_per_device=4, max_staleness=1,
                      migration=True, migrate_s=MIGRATE_S)
    cfg = SimConfig(pool=pool, target_samples=120, train_s_per_token=3e-4,
                    decode_speedup=0.3)
    a = simulate(ElasticPolicy(), wl, cfg, seed=9, trace=True)
    b = simulate(ElasticPolicy(), wl, cfg, seed=9, trace=True)
    assert a.trace == b.trace and a.makespan_s == b.makespan_s and a.events == b.events
    assert a.summary()["staleness"] == b.summary()["staleness"]


# ----------------------------------------------------------------------- the comparison


def test_refined_best_split_has_no_faster_neighbour() -> None:
    wl = DriftingWorkload(LognormalWorkload(), growth=1.5, token_growth=4.0, over_sessions=96)
    r = compare(Scenario(n_devices=12, steps=2, workload=wl, decode_speedup=0.3,
                         migrate_s=MIGRATE_S, refine_split=True))
    a = r["policies"]["async"]
    tried = {int(k): v for k, v in a["splits_tried"].items()}
    best = a["n_train"]
    assert a["samples_per_hour"] == max(tried.values())
    for k in (best - 1, best + 1):
        if 0 < k < 12:
            assert k in tried and tried[k] <= tried[best]
    assert r["scenario"]["decode_speedup"] == 0.3
    assert r["workload"]["kind"] == "drifting"
    # the fluid bound averages the run's own sessions (the first steps x batch = 96)
    t = SessionTable(wl, 0)
    t.ensure(96)
    per = t.durations[:96].mean() / 4 + t.tokens[:96].mean() * 4.5e-4
    assert r["fluid_bound_samples_per_hour"] == pytest.approx(12 / per * 3600)


def test_bench_prints_json_and_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("nonstationary")
    assert bench.main(["--devices", "6", "--steps", "1", "--drifts", "stationary",
                       "tokens-outgrow", "--json"]) == 0
    out = capsys.readouterr()
    doc = json.loads(out.out)
    still, row = doc["rows"]
    assert row["n_devices"] == 6 and row["drift"] == "tokens-outgrow"
    assert set(row["samples_per_hour"]) == {"async", "elastic", "elastic_drain_only",
                                            "colocated"}
    assert row["speedup_vs_best_fixed"]["elastic"] == pytest.approx(
        row["samples_per_hour"]["elastic"] / row["samples_per_hour"]["async"])
    # "fixed at start": the stationary row's best split, run on the drifting workload
    start = row["fixed_at_start"]
    assert start["split"] == still["best_split"]
    assert start["samples_per_hour"] <= row["samples_per_hour"]["async"] or (
        str(start["n_train"]) not in row["compare"]["policies"]["async"]["splits_tried"])
    assert doc["settings"]["migrate_s"] == MIGRATE_S
    assert "| 6 | tokens-outgrow |" in out.err  # with --json the table goes to stderr


# ----------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(("kw", "name"), [
    ({"growth": 0.0}, "growth"),
    ({"growth": float("nan")}, "growth"),
    ({"growth": -2.0}, "growth"),
    ({"token_growth": -1.0}, "token_growth"),
    ({"token_growth": float("inf")}, "token_growth"),
    ({"over_sessions": 0}, "over_sessions"),
    ({"over_sessions": 2.5}, "over_sessions"),
    ({"shape": "cubic"}, "shape"),
    ({"base": object()}, "base"),
])
def test_bad_drift_arguments_name_themselves(kw: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must"):
        DriftingWorkload(**kw)


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan")])
def test_bad_decode_speedup(value: float) -> None:
    pool = PoolConfig(n_devices=2, batch_size=1)
    with pytest.raises(ValueError, match="decode_speedup must be a number in"):
        SimConfig(pool=pool, target_samples=1, decode_speedup=value)


SMALL = ["simulate", "--json", "-n", "8", "--slots", "2", "--steps", "2"]


@pytest.mark.parametrize(("args", "option", "message"), [
    (["--growth", "0"], "--growth", "must be a finite number > 0, got 0.0"),
    (["--growth", "nan"], "--growth", "got nan"),
    (["--token-growth", "-1"], "--token-growth", ">= 0"),
    (["--decode-speedup", "1.5"], "--decode-speedup", "must be in [0, 1], got 1.5"),
    (["--decode-speedup", "-0.5"], "--decode-speedup", ">= 0"),
])
def test_cli_bad_drift_options(args: list[str], option: str, message: str) -> None:
    res = CliRunner().invoke(get_command(app), [*SMALL, *args])
    text = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2, res.output
    assert f"Invalid value for {option}" in text and message in text


def test_cli_simulates_a_drifting_workload() -> None:
    res = CliRunner().invoke(get_command(app), [*SMALL, "--growth", "3", "--token-growth", "2",
                                                "--decode-speedup", "0.3"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    w = r["workload"]
    assert w["kind"] == "drifting" and w["growth"] == 3.0 and w["token_growth"] == 2.0
    assert w["over_sessions"] == 2 * 16  # steps x batch (8 devices x 2 slots)
    assert r["scenario"]["decode_speedup"] == 0.3
    for p in r["policies"].values():
        assert p["trained"] == 32
