"""Discrete-event simulator: the real `Pool` and the real policies on simulated time.

Deterministic given the workload seed: events at equal times are processed in the
order they were scheduled, device ids break ties in the policies, and session `i` has
the same duration and tokens under every policy.

Costs charged (all configurable):
- rollout: a session occupies one slot of a rollout device for its duration;
- training: a micro-batch takes `tokens * train_s_per_token + train_overhead_s` on one
  train device (data-parallel: devices train different samples of one batch);
- optimizer step: `step_overhead_s` on the devices that train when the batch completes;
- role switch: `config.rollout_to_train_s` / `config.train_to_rollout_s`;
- migration: `config.migrate_s` during which the session is paused (its end moves).
"""

from __future__ import annotations

import heapq
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

    def __post_init__(self) -> None:
        if self.target_samples < 1:
            raise ValueError("target_samples must be >= 1")
        if self.train_s_per_token < 0 or self.train_overhead_s < 0 or self.step_overhead_s < 0:
            raise ValueError("costs must be >= 0")


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


def simulate(
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
    paused: dict[int, float] = {}  # migrating session -> remaining duration
    now = 0.0
    events = 0
    target = config.target_samples
    spt = config.train_s_per_token
    tok = table.tokens

    def push(t: float, kind: int, arg: int) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, seq, kind, arg))
        seq += 1

    def carry_out(effects: list[Any]) -> None:
        for e in effects:
            if isinstance(e, Launch):
                sid = e.session
                t_end = now + float(table.durations[sid])
                end_at[sid] = t_end
                push(t_end, _END, sid)
            elif isinstance(e, RunTrain):
                work = sum(int(tok[s]) for s in e.sessions) * spt + config.train_overhead_s
                push(now + work, _TRAIN, e.device)
            elif isinstance(e, BeginSwitch):
                push(now + cfg.switch_cost(e.to), _SWITCH, e.device)
            elif isinstance(e, BeginMigrate):
                sid = e.session
                paused[sid] = end_at.pop(sid) - now
                push(now + cfg.migrate_s, _MIGRATED, sid)
            elif isinstance(e, StepReady):
                push(now + config.step_overhead_s, _STEP, e.version)

    def decide() -> None:
        carry_out(pool.run_policy(policy, now))

    decide()
    while heap and pool.trained < target:
        now = heap[0][0]
        if now > config.max_sim_s:
            break
        while heap and heap[0][0] == now:
            _, _, kind, arg = heapq.heappop(heap)
            events += 1
            if kind == _END:
                if end_at.get(arg) != now:
                    continue  # superseded by a migration
                del end_at[arg]
                pool.session_finished(arg, now, tokens=int(tok[arg]))
                if pool.queued < cfg.n_devices * cfg.slots_per_device:
                    refill()
                    tok = table.tokens
            elif kind == _TRAIN:
                ready = pool.train_done(arg, now)
                if ready is not None:
                    carry_out([ready])
            elif kind == _SWITCH:
                pool.switch_done(arg, now)
            elif kind == _STEP:
                pool.step_done(now)
            else:  # _MIGRATED
                pool.migrated(arg, now)
                t_end = now + paused.pop(arg)
                end_at[arg] = t_end
                push(t_end, _END, arg)
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
