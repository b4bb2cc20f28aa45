"""Discrete-event simulator: the real `Pool` and the real policies on simulated time.

Deterministic given the workload seed: events at equal times are processed in the
order they were scheduled, device ids break ties in the policies, and session `i` has
the same duration and tokens under every policy.

Costs charged (all configurable):
- rollout: a session occupies one slot of a rollout device for its duration. Its drawn
  duration is measured at full load; with `decode_speedup = s > 0` a device running
  `k` of its `S` slots decodes each of its sessions at `speed(k) = 1 / (1 - s + s k/S)`
  times the full-load rate (a decode step costs a fixed part, `1 - s`, plus a part that
  grows with the batch), so a session's remaining work (full-load seconds) runs faster
  as its device empties. The simulation is exact: whenever `k` changes on a device,
  the end events of its sessions are rescheduled (stale heap entries are skipped by a
  per-session event number). `s = 0` (the default) is the plain slot model;
- training: a micro-batch takes `tokens * train_s_per_token + train_overhead_s` on one
  train device (data-parallel: devices train different samples of one batch);
- optimizer step: `step_overhead_s` on the devices that train when the batch completes;
- role switch: `config.rollout_to_train_s` / `config.train_to_rollout_s`;
- migration: `config.migrate_s` during which the session is paused (its end moves).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Any

from tidal.schedule.policy import Policy
from tidal.schedule.pool import (
    BeginMigrate,
    BeginSwitch,
    Launch,
    Pool,
    PoolMetrics,
    RunTrain,
    SState,
    StepReady,
)
from tidal.schedule.types import PoolConfig
from tidal.schedule.workload import SessionTable, WorkloadModel

_END, _SWITCH, _TRAIN, _STEP, _MIGRATED = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class SimConfig:
    """What a simulated run costs and when it stops."""

    pool: PoolConfig
    target_samples: int
    train_s_per_token: float = 4.5e-4
    train_overhead_s: float = 0.0
    step_overhead_s: float = 30.0
    max_sim_s: float = 1e9
    # share of a full device's decode step that grows with the batch (0: no speedup as
    # the device empties; 1: a lone session runs `slots_per_device` times faster)
    decode_speedup: float = 0.0

    def __post_init__(self) -> None:
        if self.target_samples < 1:
            raise ValueError("target_samples must be >= 1")
        if self.train_s_per_token < 0 or self.train_overhead_s < 0 or self.step_overhead_s < 0:
            raise ValueError("costs must be >= 0")
        s = self.decode_speedup
        if not (isinstance(s, int | float) and math.isfinite(s) and 0.0 <= s <= 1.0):
            raise ValueError(f"decode_speedup must be a number in [0, 1], got {s!r}")

    def decode_speed(self, k: int) -> float:
        """How much faster than at full load a device with `k` busy slots decodes."""
        c = self.pool.slots_per_device
        s = self.decode_speedup
        if s == 0.0 or k <= 0:
            return 1.0
        return 1.0 / (1.0 - s + s * min(k, c) / c)


@dataclass
class SimResult:
    policy: str
    makespan_s: float  # time until `target_samples` were trained
    trained: int
    metrics: PoolMetrics
    events: int
    wall_s: float
    trace: list[tuple[Any, ...]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def samples_per_hour(self) -> float:
        return self.trained / self.makespan_s * 3600.0 if self.makespan_s > 0 else 0.0

    @property
    def utilization(self) -> float:
        return self.metrics.utilization

    def staleness_hist(self) -> dict[int, int]:
        return dict(sorted(self.metrics.staleness_trained.items()))

    def summary(self) -> dict[str, Any]:
        m = self.metrics
        hist = self.staleness_hist()
        n = sum(hist.values())
        mean_st = sum(k * v for k, v in hist.items()) / n if n else 0.0
        d = {
            "samples_per_hour": self.samples_per_hour,
            "utilization": self.utilization,
            "time_to_target_h": self.makespan_s / 3600.0,
            "trained": self.trained,
            "steps": m.steps,
            "role_switches": m.switches_to_train + m.switches_to_rollout,
            "migrations": m.migrations,
            "staleness": {
                "trained": {str(k): v for k, v in hist.items()},
                "mean": mean_st,
                "max": max(hist) if hist else 0,
                "dropped": m.dropped_stale,
                "dropped_by_staleness": {
                    str(k): v for k, v in sorted(m.staleness_dropped.items())
                },
            },
            "sessions_started": m.sessions_started,
            "idle_device_h_mean": sum(m.idle_s) / max(1, m.n_devices) / 3600.0,
            "switching_device_s_mean": sum(m.switching_s) / max(1, m.n_devices),
            "events": self.events,
            "wall_s": self.wall_s,
        }
        d.update(self.extra)
        return d


# long by design: the simulator's event loop: every event kind handled in one loop
def simulate(  # noqa: PLR0915
    policy: Policy,
    workload: WorkloadModel | SessionTable,
    config: SimConfig,
    *,
    seed: int = 0,
    trace: bool = False,
) -> SimResult:
    """Run `policy` until `config.target_samples` samples are trained."""
    t_wall = time.perf_counter()
    cfg = config.pool
    table = workload if isinstance(workload, SessionTable) else SessionTable(workload, seed)
    pool = Pool(cfg, policy.initial_roles(cfg), trace=trace)
    # enough queued sessions that the gate, never the queue, limits rollouts (a fixed
    # table supplies only the sessions it has)
    supply = cfg.max_in_flight + cfg.n_devices * cfg.slots_per_device
    limit = table.durations.shape[0] if table.model is None else None

    def refill() -> None:
        n = supply if limit is None else min(supply, limit - pool.n_submitted)
        if n > 0:
            ids = pool.submit(n)
            table.ensure(ids[-1] + 1)

    refill()

    heap: list[tuple[float, int, int, int]] = []
    seq = 0
    end_at: dict[int, float] = {}  # live session -> scheduled end time
    end_seq: dict[int, int] = {}  # live session -> the heap entry of its end that counts
    rate: dict[int, float] = {}  # live session -> full-load seconds done per second
    paused: dict[int, float] = {}  # migrating session -> remaining work (full-load s)
    # decode speedup: running sessions per device, and devices whose count changed
    speedup = config.decode_speedup > 0.0
    speeds = [config.decode_speed(k) for k in range(cfg.slots_per_device + 1)]
    on_dev: list[dict[int, None]] = [{} for _ in range(cfg.n_devices)]
    dev_of: dict[int, int] = {}
    dirty: dict[int, None] = {}
    now = 0.0
    events = 0
    target = config.target_samples
    spt = config.train_s_per_token
    tok = table.tokens

    def push(t: float, kind: int, arg: int) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, seq, kind, arg))
        if kind == _END:
            end_seq[arg] = seq
        seq += 1

    def run_on(sid: int, d: int, work: float) -> None:
        """`sid` decodes on `d` from now with `work` full-load seconds left."""
        if speedup:
            on_dev[d][sid] = None
            dev_of[sid] = d
            dirty[d] = None
            r = speeds[len(on_dev[d])]
        else:
            r = 1.0
        rate[sid] = r
        t_end = now + work / r
        end_at[sid] = t_end
        push(t_end, _END, sid)

    def leave(sid: int) -> None:
        """`sid` stops decoding on its device (ended, or paused to migrate)."""
        if speedup:
            d = dev_of.pop(sid)
            del on_dev[d][sid]
            dirty[d] = None

    def reschedule() -> None:
        """Devices whose number of running sessions changed: their sessions go on at
        the new speed from now (exact: work done so far at the old speed)."""
        for d in sorted(dirty):
            r_new = speeds[len(on_dev[d])]
            for sid in on_dev[d]:
                r_old = rate[sid]
                if r_old == r_new:
                    continue
                work = (end_at[sid] - now) * r_old
                rate[sid] = r_new
                t_end = now + work / r_new
                end_at[sid] = t_end
                push(t_end, _END, sid)
        dirty.clear()

    def carry_out(effects: list[Any]) -> None:
        for e in effects:
            if isinstance(e, Launch):
                run_on(e.session, e.device, float(table.durations[e.session]))
            elif isinstance(e, RunTrain):
                work = sum(int(tok[s]) for s in e.sessions) * spt + config.train_overhead_s
                push(now + work, _TRAIN, e.device)
            elif isinstance(e, BeginSwitch):
                push(now + cfg.switch_cost(e.to), _SWITCH, e.device)
            elif isinstance(e, BeginMigrate):
                sid = e.session
                paused[sid] = (end_at.pop(sid) - now) * rate.pop(sid)
                del end_seq[sid]
                leave(sid)
                push(now + cfg.migrate_s, _MIGRATED, sid)
            elif isinstance(e, StepReady):
                push(now + config.step_overhead_s, _STEP, e.version)

    def decide() -> None:
        carry_out(pool.run_policy(policy, now))
        if dirty:
            reschedule()

    decide()
    while heap and pool.trained < target:
        now = heap[0][0]
        if now > config.max_sim_s:
            break
        while heap and heap[0][0] == now:
            _, k_seq, kind, arg = heapq.heappop(heap)
            events += 1
            if kind == _END:
                if end_seq.get(arg) != k_seq:
                    continue  # superseded by a migration or a change of speed
                del end_at[arg], end_seq[arg], rate[arg]
                leave(arg)
                pool.session_finished(arg, now, tokens=int(tok[arg]))
                if pool.queued < cfg.n_devices * cfg.slots_per_device:
                    refill()
                    tok = table.tokens
                continue
            if kind == _TRAIN:
                ready = pool.train_done(arg, now)
                if ready is not None:
                    carry_out([ready])
            elif kind == _SWITCH:
                pool.switch_done(arg, now)
            elif kind == _STEP:
                pool.step_done(now)
            else:  # _MIGRATED
                pool.migrated(arg, now)
                s_mig = pool.sessions[arg]
                run_on(arg, s_mig.device, paused.pop(arg))
        if pool.trained >= target:
            break
        decide()
    metrics = pool.metrics(now)
    # which sessions got trained: async policies favour short ones (long ones are still
    # running at the end, or dropped as stale), so report the bias next to throughput
    trained_ids = [sid for sid, rec in pool.sessions.items() if rec.state is SState.TRAINED]
    started = [sid for sid, rec in pool.sessions.items() if rec.state is not SState.QUEUED]
    extra: dict[str, Any] = {}
    if trained_ids:
        extra["trained_mean_duration_h"] = float(table.durations[trained_ids].mean()) / 3600
        extra["started_mean_duration_h"] = float(table.durations[started].mean()) / 3600
    return SimResult(
        policy=policy.name,
        makespan_s=now,
        trained=pool.trained,
        metrics=metrics,
        events=events,
        wall_s=time.perf_counter() - t_wall,
        trace=pool.trace,
        extra=extra,
    )
