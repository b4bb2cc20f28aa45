"""Small picklable rollout work for the scheduler's tests (no model needed).

Each function stands in for one agent session: it sleeps or computes, then returns a
`RolloutResult` tagged with the policy version it started under.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tidal.schedule.backend import RolloutResult, SessionContext


def sleep_session(
    seconds: float, tokens: int = 100, *, ctx: SessionContext, log: str | None = None
) -> RolloutResult:
    """Sleep `seconds` (an agent waiting on tools and the model). With `log`, append
    "session device start end pid" to that file, so tests can check placements."""
    t0 = time.time()
    time.sleep(seconds)
    t1 = time.time()
    if log is not None:
        with Path(log).open("a") as f:
            f.write(f"{ctx.session} {ctx.device} {t0:.6f} {t1:.6f} {os.getpid()}\n")
    return RolloutResult(
        value={"session": ctx.session, "device": ctx.device, "slept": seconds},
        policy_version=ctx.policy_version,
        tokens=tokens,
    )


def arith_session(n: int, *, ctx: SessionContext) -> RolloutResult:
    """Burn CPU: sum of squares below `n`, returned as the session's value."""
    total = sum(i * i for i in range(n))
    return RolloutResult(value=total, policy_version=ctx.policy_version, tokens=n // 100 + 1)


def crash_once_session(
    seconds: float, marker: str, *, ctx: SessionContext
) -> RolloutResult:
    """Die mid-session (the whole worker process exits) the first time it runs; run
    normally when resumed. `marker` is a file path used to remember the first try."""
    m = Path(marker)
    if not m.exists():
        m.write_text(str(ctx.session))
        time.sleep(seconds / 2)
        os._exit(17)  # a crash, not an exception: the worker process is gone
    time.sleep(seconds)
    return RolloutResult(value={"resumed": True, "attempt": ctx.attempt},
                         policy_version=ctx.policy_version, tokens=10)


def failing_session(*, ctx: SessionContext) -> RolloutResult:
    """Raise inside the work function (a harness bug, not an infrastructure failure)."""
    raise RuntimeError(f"session {ctx.session} failed on purpose")
