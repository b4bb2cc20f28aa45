"""Colocated scheduling as a plain loop: every device rolls out one batch, then every
device trains it, then all go back to rollout.

This is what `tidal run` uses for `schedule.policy = "colocated"` on the local backend.
The elastic and async policies need the scheduler's machinery (`Scheduler`: a policy
deciding over a shared `Pool`, a backend polled by a loop thread), because there rollouts
and training overlap and devices change roles one at a time. Colocated never overlaps
them, so it is only this: a FIFO of submitted work, a thread pool of
`n_devices * slots_per_device` slots that runs at most one batch of it at a time, the
role switches of all devices together (`on_switch(device, role)`: vLLM servers sleep
while their device trains), and the figures the scheduler reports (`PoolMetrics`),
counted as it goes.

Where the RL loop meets it, it keeps `Scheduler`'s contract (`RolloutScheduler`):
- a batch is the first `batch_size` groups to finish, started in submission order with
  at most `batch_size` running or finished at once (so work queued for later steps waits);
- a group whose oldest token is more than `max_staleness` versions behind the version
  being trained is dropped (`dropped()`), one whose work raised ends failed (`failed()`);
  either frees its place for the next queued group;
- a batch that cannot fill (nothing left queued or running) comes short;
- `iter_batches(steps=N)` ends after N `step_done()`s or when no work is left.
Work functions run in this process's threads (as the local backend's thread mode).
"""

from __future__ import annotations

import itertools
import time
import traceback
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from tidal.schedule.backend import RolloutResult, SessionContext, SwitchHook, Work
from tidal.schedule.pool import PoolMetrics
from tidal.schedule.scheduler import FailedSession, MiniBatch, Sample
from tidal.schedule.types import Role, ScheduleError


@dataclass
class _Running:
    session: int
    device: int
    version: int  # the version published when it started
    started_at: float


class Colocated:
    """`n_devices` devices x `slots_per_device` groups at once, `batch_size` groups a
    step, all devices rolling out or all training."""

    name = "colocated"

    def __init__(self, n_devices: int, slots_per_device: int, batch_size: int, *,
                 max_staleness: int, on_switch: SwitchHook | None = None) -> None:
        if n_devices < 1 or slots_per_device < 1 or batch_size < 1:
            raise ValueError("need at least one device, one slot per device and a batch of one")
        self._n, self._slots, self._b = n_devices, slots_per_device, batch_size
        self._k = max_staleness
        self._on_switch = on_switch
        self._queue: deque[int] = deque()
        self._work: dict[int, Work] = {}
        self._ids = itertools.count()
        self._mb_ids = itertools.count()
        self._pool: ThreadPoolExecutor | None = None
        self._t0 = time.monotonic()
        self.version = 0
        self._role = Role.ROLLOUT
        self._batch: tuple[Sample, ...] | None = None  # handed out, its step not done
        self._train_from = 0.0  # when the devices began training the batch
        # what metrics() reports
        self._busy = [0.0] * n_devices
        self._switching = [0.0] * n_devices
        self._role_time = {Role.ROLLOUT: [0.0] * n_devices, Role.TRAIN: [0.0] * n_devices}
        self._switches = {Role.ROLLOUT: 0, Role.TRAIN: 0}
        self._switch_seconds: list[float] = []
        self._switch_log: list[tuple[float, int, str]] = []
        self._started = self._finished = self._trained = self._steps = 0
        self._failed: list[FailedSession] = []
        self._dropped: list[int] = []
        self._staleness_trained: dict[int, int] = {}
        self._staleness_dropped: dict[int, int] = {}

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> Colocated:
        self._t0 = time.monotonic()
        self._pool = ThreadPoolExecutor(max_workers=self._n * self._slots,
                                        thread_name_prefix="tidal-rollout")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def now(self) -> float:
        return time.monotonic() - self._t0

    # ---------------------------------------------------------------- work in, batches out
    def submit_many(self, works: Iterable[Work]) -> list[int]:
        """Queue rollouts; returns their session ids."""
        ids = []
        for w in works:
            sid = next(self._ids)
            self._work[sid] = w
            self._queue.append(sid)
            ids.append(sid)
        return ids

    def iter_batches(self, *, steps: int | None = None,
                     flush: bool = True) -> Iterator[MiniBatch]:
        """Each step's batch, whole, as one mini-batch whose `done()` is True; call
        `step_done()` once it is trained. `flush` is accepted for `Scheduler`'s
        signature: a batch that cannot fill always comes short."""
        start = self.version
        while steps is None or self.version - start < steps:
            if self._batch is not None:
                raise ScheduleError("the next batch was asked for before step_done()")
            if not self._queue:
                return
            if self._role is Role.TRAIN:
                self._switch(Role.ROLLOUT)
            samples = self._roll()
            if not samples and not self._queue:
                return
            self._switch(Role.TRAIN)
            self._batch = samples
            self._train_from = self.now()
            yield MiniBatch(next(self._mb_ids), samples, tuple(range(self._n)), self.version,
                            lambda _mb: True)

    def step_done(self, version: int | None = None) -> int:
        """The batch is trained: publish the next policy version (returned)."""
        if self._batch is None:
            raise ScheduleError("step_done() without a batch handed out")
        if version is not None and version != self.version + 1:
            raise ScheduleError(f"step_done({version}): the next version is {self.version + 1}")
        spent = self.now() - self._train_from
        for d in range(self._n):
            self._busy[d] += spent
            self._role_time[Role.TRAIN][d] += spent
        for s in self._batch:
            self._staleness_trained[s.staleness] = self._staleness_trained.get(s.staleness, 0) + 1
        self._trained += len(self._batch)
        self._steps += 1
        self._batch = None
        self.version += 1
        return self.version

    def failed(self) -> list[FailedSession]:
        return list(self._failed)

    def dropped(self) -> list[int]:
        """Groups dropped as stale (their results discarded)."""
        return list(self._dropped)

    def metrics(self) -> dict[str, Any]:
        """The same figures as `Scheduler.metrics()`."""
        elapsed = self.now()
        idle = [max(0.0, elapsed - b - s)
                for b, s in zip(self._busy, self._switching, strict=True)]
        m = PoolMetrics(
            elapsed=elapsed, n_devices=self._n, busy_s=list(self._busy),
            switching_s=list(self._switching), idle_s=idle,
            rollout_s=list(self._role_time[Role.ROLLOUT]),
            train_s=list(self._role_time[Role.TRAIN]),
            switches_to_train=self._switches[Role.TRAIN],
            switches_to_rollout=self._switches[Role.ROLLOUT], migrations=0,
            sessions_started=self._started, sessions_finished=self._finished,
            sessions_failed=len(self._failed), sessions_requeued=0, trained=self._trained,
            steps=self._steps, dropped_stale=len(self._dropped), downweighted=0,
            staleness_trained=dict(self._staleness_trained),
            staleness_dropped=dict(self._staleness_dropped),
            switch_log=list(self._switch_log),
        ).to_dict()
        return {**m, "backend": "local", "policy": self.name, "policy_version": self.version,
                "switch_seconds": list(self._switch_seconds), "migrate_seconds": [],
                "failed_sessions": [f.session for f in self._failed],
                "dropped_sessions": list(self._dropped), "queued": len(self._queue),
                "in_flight": 0}

    # ---------------------------------------------------------------- internals
    def _roll(self) -> tuple[Sample, ...]:
        """Run queued work until `batch_size` groups have finished, or none is left."""
        assert self._pool is not None, "use Colocated as a context manager"
        t_roll = self.now()
        done: list[Sample] = []
        running: dict[Future[Any], _Running] = {}
        load = [0] * self._n
        while len(done) < self._b:
            while (self._queue and len(running) + len(done) < self._b
                   and len(running) < self._n * self._slots):
                sid = self._queue.popleft()
                d = min(range(self._n), key=lambda i: (load[i], i))  # spread over devices
                load[d] += 1
                run = _Running(sid, d, self.version, self.now())
                ctx = SessionContext(sid, d, self.version, attempt=1)
                running[self._pool.submit(self._work[sid], ctx)] = run
                self._started += 1
            if not running:
                break  # nothing left to fill the batch: it comes short
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in sorted(finished, key=lambda f: running[f].session):
                run = running.pop(fut)
                load[run.device] -= 1
                sample = self._ended(run, fut)
                if sample is not None:
                    done.append(sample)
        spent = self.now() - t_roll
        for d in range(self._n):
            self._role_time[Role.ROLLOUT][d] += spent
        return tuple(done)

    def _ended(self, run: _Running, fut: Future[Any]) -> Sample | None:
        """A group's end: its sample, or None when it failed or was dropped as stale."""
        now = self.now()
        self._busy[run.device] += (now - run.started_at) / self._slots
        self._work.pop(run.session)
        exc = fut.exception()
        if exc is not None:
            self._failed.append(FailedSession(
                run.session, "".join(traceback.format_exception(exc)), attempts=1))
            return None
        self._finished += 1
        result = fut.result()
        res = result if isinstance(result, RolloutResult) else RolloutResult(result)
        version = run.version if res.policy_version is None else res.policy_version
        staleness = self.version - version
        if staleness > self._k:
            self._dropped.append(run.session)
            self._staleness_dropped[staleness] = self._staleness_dropped.get(staleness, 0) + 1
            return None
        return Sample(session=run.session, value=res.value, policy_version=version,
                      tokens=res.tokens, staleness=staleness, weight=1.0, attempts=1,
                      device=run.device, started_at=run.started_at, finished_at=now)

    def _switch(self, role: Role) -> None:
        """Every device to `role` at once; the `on_switch` hooks run side by side."""
        assert self._pool is not None
        t0 = self.now()

        def one(d: int) -> float:
            t = time.perf_counter()
            if self._on_switch is not None:
                self._on_switch(d, role)
            return time.perf_counter() - t

        with ThreadPoolExecutor(max_workers=self._n, thread_name_prefix="tidal-switch") as ex:
            seconds = list(ex.map(one, range(self._n)))
        for d, s in enumerate(seconds):
            self._switching[d] += s
            self._switch_seconds.append(s)
            self._switch_log.append((t0, d, role.value))
        self._switches[role] += self._n
        self._role = role
