"""tidal.schedule: the elastic scheduler, its local and Ray backends, and the simulator.

One policy codebase drives both: `policy.py` (pure decisions over a frozen `PoolState`)
and `pool.py` (the bookkeeping that applies them) are shared by `sim.simulate` and the
real `Scheduler`. See docs/scheduler.md.

Names are imported lazily, so `tidal --help` (which imports `tidal.schedule.cli`) does
not pay for numpy or the ledger.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Backend": "backend",
    "RolloutResult": "backend",
    "SessionContext": "backend",
    "Work": "backend",
    "LocalBackend": "local",
    "RayBackend": "ray_backend",
    "ColocatedPolicy": "policy",
    "ElasticPolicy": "policy",
    "FixedSplitPolicy": "policy",
    "Policy": "policy",
    "Pool": "pool",
    "PoolMetrics": "pool",
    "FailedSession": "scheduler",
    "MiniBatch": "scheduler",
    "Sample": "scheduler",
    "Scheduler": "scheduler",
    "SimConfig": "sim",
    "SimResult": "sim",
    "simulate": "sim",
    "Scenario": "compare",
    "compare": "compare",
    "EmpiricalWorkload": "workload",
    "LognormalWorkload": "workload",
    "Decision": "types",
    "DeviceView": "types",
    "Drain": "types",
    "Migrate": "types",
    "PoolConfig": "types",
    "PoolState": "types",
    "Role": "types",
    "ScheduleError": "types",
    "StalenessRule": "types",
    "Start": "types",
    "Switch": "types",
    "Train": "types",
    "Undrain": "types",
}

__all__ = [
    "Backend",
    "ColocatedPolicy",
    "Decision",
    "DeviceView",
    "Drain",
    "ElasticPolicy",
    "EmpiricalWorkload",
    "FailedSession",
    "FixedSplitPolicy",
    "LocalBackend",
    "LognormalWorkload",
    "Migrate",
    "MiniBatch",
    "Policy",
    "Pool",
    "PoolConfig",
    "PoolMetrics",
    "PoolState",
    "RayBackend",
    "Role",
    "RolloutResult",
    "Sample",
    "Scenario",
    "ScheduleError",
    "Scheduler",
    "SessionContext",
    "SimConfig",
    "SimResult",
    "StalenessRule",
    "Start",
    "Switch",
    "Train",
    "Undrain",
    "Work",
    "compare",
    "simulate",
]


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'tidal.schedule' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tidal.schedule.{mod}"), name)
