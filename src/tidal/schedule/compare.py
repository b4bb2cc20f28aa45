"""A fair comparison of the three policies on one workload (`tidal simulate`).

Fairness rules, all enforced here:
- one workload: session `i` has the same duration and tokens under every policy (same
  seed); the same devices, slots per device, costs, batch size and staleness bound;
- every policy runs until the same number of samples is trained (`steps * batch`);
- the async baseline is the *best* fixed split for the workload: the simulator tries
  the fluid-optimal split (train share t / (r + t), r and t the rollout and training
  device-seconds per sample) and its neighbours, and the common 50/50 and 25/75
  splits, and keeps the fastest. The 50/50 split and the batch-synchronous
  (one-step-off-policy) split are reported beside it;
- colocated is synchronous (staleness 0), the others share the bound `max_staleness`.

With `refine_split=True` the best split is searched further with hindsight, a hill
climb: the best split's neighbours at the candidates' spacing are tried, then at half
that spacing, and so on down to `n_devices / 256` devices (moving whenever a neighbour
is faster), so that the baseline is the best split even when the workload drifts away
from the fluid estimate. For a
non-stationary workload (`IndexedWorkloadModel`) the per-sample costs behind the
estimate and the fluid bound are averaged over the sessions the run trains (the first
`steps * batch`), not over a fixed 4096.

`tidal.schedule.types.MIGRATE_S` is the per-session migration cost measured on this machine
(`Scenario.migrate_s` keeps the older 60 s default, so earlier results stand).

Speedups are ratios of samples per hour (the same as ratios of time to the target).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tidal.schedule.policy import ColocatedPolicy, ElasticPolicy, FixedSplitPolicy, Policy
from tidal.schedule.sim import SimConfig, SimResult, simulate
from tidal.schedule.types import PoolConfig, StalenessRule
from tidal.schedule.workload import (
    IndexedWorkloadModel,
    LognormalWorkload,
    SessionTable,
    WorkloadModel,
)

TARGETS = {"speedup_vs_colocated": 1.85, "speedup_vs_async": 1.78, "utilization": 0.90}


@dataclass(frozen=True)
class Scenario:
    """Everything one comparison depends on. `batch_size=None` means one slot-full of
    the pool (`n_devices * slots_per_device`), the natural batch for colocated."""

    n_devices: int = 256
    slots_per_device: int = 4
    batch_size: int | None = None
    steps: int = 8
    max_staleness: int = 2
    staleness_rule: StalenessRule = StalenessRule.DROP
    train_s_per_token: float = 4.5e-4
    train_overhead_s: float = 0.0
    step_overhead_s: float = 30.0
    rollout_to_train_s: float = 8.5
    train_to_rollout_s: float = 3.5
    migration: bool = True
    migrate_s: float = 60.0
    micro_batch: int = 1
    seed: int = 0
    async_train: int | None = None  # fix the async split instead of searching
    workload: WorkloadModel = field(default_factory=LognormalWorkload)
    decode_speedup: float = 0.0  # SimConfig.decode_speedup: sessions speed up as a device empties
    refine_split: bool = False  # hill-climb the best fixed split further (see the module doc)

    @property
    def batch(self) -> int:
        return self.batch_size or self.n_devices * self.slots_per_device

    def pool_config(
        self, *, max_staleness: int | None = None, migration: bool | None = None
    ) -> PoolConfig:
        return PoolConfig(
            n_devices=self.n_devices,
            batch_size=self.batch,
            slots_per_device=self.slots_per_device,
            max_staleness=self.max_staleness if max_staleness is None else max_staleness,
            staleness_rule=self.staleness_rule,
            micro_batch=self.micro_batch,
            migration=self.migration if migration is None else migration,
            rollout_to_train_s=self.rollout_to_train_s,
            train_to_rollout_s=self.train_to_rollout_s,
            migrate_s=self.migrate_s,
        )

    def sim_config(self, pool: PoolConfig) -> SimConfig:
        return SimConfig(
            pool=pool,
            target_samples=self.steps * self.batch,
            train_s_per_token=self.train_s_per_token,
            train_overhead_s=self.train_overhead_s,
            step_overhead_s=self.step_overhead_s,
            decode_speedup=self.decode_speedup,
        )

    def describe(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "workload"}
        d["staleness_rule"] = self.staleness_rule.value
        d["batch_size"] = self.batch
        d["target_samples"] = self.steps * self.batch
        return d


def _per_sample_costs(sc: Scenario, table: SessionTable) -> tuple[float, float]:
    """(rollout, train) device-seconds per sample, averaged over the first sessions."""
    n = max(4096, 4 * sc.batch)
    if isinstance(sc.workload, IndexedWorkloadModel):
        n = sc.steps * sc.batch  # it drifts: average over the sessions the run trains
    table.ensure(n)
    r = float(table.durations[:n].mean()) / sc.slots_per_device
    t = float(table.tokens[:n].mean()) * sc.train_s_per_token
    t += sc.train_overhead_s / sc.micro_batch
    return r, t


def fluid_bound(sc: Scenario, table: SessionTable) -> float:
    """Samples per hour if every device were busy all the time with no switch,
    migration, step or tail cost, training sessions as they come: N / (r + t). The
    long-run bound; in a finite run an async policy can exceed it slightly, because the
    samples it trained are biased towards short sessions (long ones are still running
    at the end or were dropped as stale; see `trained_mean_duration_h`)."""
    r, t = _per_sample_costs(sc, table)
    return sc.n_devices / (r + t) * 3600.0


def _run(policy: Policy, sc: Scenario, table: SessionTable, **pool_kw: Any) -> SimResult:
    return simulate(policy, table, sc.sim_config(sc.pool_config(**pool_kw)), seed=sc.seed)


def split_candidates(sc: Scenario, table: SessionTable) -> list[int]:
    """Train-device counts to try for the best fixed split."""
    n = sc.n_devices
    r, t = _per_sample_costs(sc, table)
    opt = n * t / (r + t)
    step = max(1, round(n / 64))
    cands = {round(opt) + k * step for k in range(-3, 4)}
    cands |= {math.floor(opt), math.ceil(opt), n // 2, n // 4}
    return sorted(x for x in cands if 0 < x < n)


# long by design: the simulator's comparison table: each policy run and summarised in turn
def compare(sc: Scenario, *, progress: Any = None) -> dict[str, Any]:  # noqa: PLR0915
    """Run colocated, the async baselines and elastic on one workload; JSON-ready."""
    t0 = time.perf_counter()
    table = SessionTable(sc.workload, sc.seed)
    say = progress or (lambda _msg: None)
    results: dict[str, SimResult] = {}

    say("colocated")
    results["colocated"] = _run(ColocatedPolicy(), sc, table, max_staleness=0, migration=False)

    runs: dict[int, SimResult] = {}
    cands = [sc.async_train] if sc.async_train is not None else split_candidates(sc, table)
    half = sc.n_devices // 2
    for k in [*cands, half]:
        if k not in runs:
            say(f"async split {sc.n_devices - k} rollout / {k} train")
            runs[k] = _run(FixedSplitPolicy(n_train=k), sc, table, migration=False)
    def fastest(ks: list[int]) -> int:
        return max(ks, key=lambda k: (runs[k].samples_per_hour, -k))

    best_n = fastest(cands)
    if sc.refine_split and sc.async_train is None:
        searched = set(cands)
        step = max(1, round(sc.n_devices / 64))
        finest = max(1, sc.n_devices // 256)
        while True:
            for k in (best_n - step, best_n + step):
                if 0 < k < sc.n_devices and k not in searched:
                    searched.add(k)
                    if k not in runs:
                        say(f"async split {sc.n_devices - k} rollout / {k} train (refine)")
                        runs[k] = _run(FixedSplitPolicy(n_train=k), sc, table, migration=False)
            better = fastest(sorted(searched))
            if better != best_n:
                best_n = better
            elif step <= finest:
                break
            else:
                step = max(finest, step // 2)
        cands = sorted(searched)
    tried = {str(k): runs[k].samples_per_hour for k in sorted(cands)}
    def split(k: int) -> dict[str, Any]:
        return {"n_train": k, "split": f"{sc.n_devices - k}/{k}"}

    results["async"] = replace(
        runs[best_n], extra={**runs[best_n].extra, **split(best_n), "splits_tried": tried}
    )
    results["async_50_50"] = replace(
        runs[half], policy="async_50_50", extra={**runs[half].extra, **split(half)}
    )

    say("async batch-synchronous (one-step off-policy)")
    rb = _run(
        FixedSplitPolicy(n_train=best_n, batch_sync=True, name="async_batch"),
        sc,
        table,
        migration=False,
    )
    rb.extra.update(split(best_n))
    results["async_batch"] = rb

    say("elastic")
    results["elastic"] = _run(ElasticPolicy(), sc, table)
    results["elastic"].extra["migration"] = sc.migration
    if sc.migration:
        say("elastic, drain only")
        rd = _run(ElasticPolicy(name="elastic_drain_only"), sc, table, migration=False)
        rd.extra["migration"] = False
        results["elastic_drain_only"] = rd

    e = results["elastic"].samples_per_hour

    def speedup(name: str) -> float:
        base = results[name].samples_per_hour
        return e / base if base > 0 else math.inf

    out: dict[str, Any] = {
        "scenario": sc.describe(),
        "workload": sc.workload.describe(),
        "fluid_bound_samples_per_hour": fluid_bound(sc, table),
        "policies": {k: v.summary() for k, v in results.items()},
        "speedup_vs_colocated": speedup("colocated"),
        "speedup_vs_async": speedup("async"),
        "speedup_vs_async_50_50": speedup("async_50_50"),
        "speedup_vs_async_batch": speedup("async_batch"),
    }
    util = results["elastic"].utilization
    out["targets"] = {
        **TARGETS,
        "met": {
            "speedup_vs_colocated": out["speedup_vs_colocated"] >= TARGETS["speedup_vs_colocated"],
            "speedup_vs_async": out["speedup_vs_async"] >= TARGETS["speedup_vs_async"],
            "utilization": util >= TARGETS["utilization"],
        },
    }
    out["wall_s"] = time.perf_counter() - t0
    return out
