"""The real scheduler: a policy, the shared `Pool` bookkeeping and a backend.

The RL loop hands it rollout work and consumes finished sessions as streaming
mini-batches::

    sched = Scheduler(LocalBackend(4, 2), ElasticPolicy(),
                      PoolConfig(n_devices=4, slots_per_device=2, batch_size=8,
                                 max_staleness=1))
    with sched:
        for task in tasks:
            sched.submit(Work(run_session, (task,), pass_context=True))
        for mb in sched.iter_batches():
            trainer.accumulate(mb.samples)       # forward/backward on this mini-batch
            if mb.done():                        # True: the batch of B samples is done
                trainer.optimizer_step()
                sched.step_done()                # publishes policy version + 1
        print(sched.metrics())

Or `sched.run_training(train_fn, step_fn)`, which does exactly that loop.

Rules (all in `Pool`, shared with the simulator): sessions never get interrupted by a
role switch (devices drain first); at most `(K + 1) * B` samples are in flight; a
sample more than K versions behind the version being trained is handled by the
staleness rule (dropped by default) and counted; a session whose worker dies is
resumed (restarted on another device, from its sandbox snapshot once that is wired)
up to `max_retries` times, then ends as infra_error. Nothing is lost silently: every
submitted session ends trained, dropped (stale) or failed, and `metrics()` counts each.

Threads: one loop thread polls the backend and runs the policy; the caller's thread
iterates mini-batches. All pool access holds one lock.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from tidal.ledger import Status
from tidal.schedule.backend import (
    Backend,
    BackendEvent,
    Failed,
    Finished,
    Migrated,
    RolloutResult,
    SessionContext,
    SwitchDone,
    Work,
)
from tidal.schedule.policy import Policy
from tidal.schedule.pool import (
    BeginMigrate,
    BeginSwitch,
    Effect,
    Launch,
    Pool,
    RunTrain,
    SState,
)
from tidal.schedule.types import PoolConfig, ScheduleError


@dataclass(frozen=True)
class Sample:
    """One finished session, as the trainer receives it."""

    session: int
    value: Any  # what the work function returned (RolloutResult.value)
    policy_version: int  # version of its oldest token
    tokens: int
    staleness: int  # versions behind the version being trained
    weight: float  # 1.0, or < 1 under the downweight staleness rule
    attempts: int
    device: int
    started_at: float
    finished_at: float


@dataclass(frozen=True)
class FailedSession:
    """A session that ended without a result: its worker died `attempts` times (or its
    work function raised); status infra_error."""

    session: int
    error: str
    attempts: int
    status: Status = Status.INFRA_ERROR


@dataclass
class MiniBatch:
    """Samples for the train devices `devices`, part of the step training `version`.

    Call `done()` once trained: it returns True when that completed the batch (then
    run the optimizer step and call `Scheduler.step_done()`). A final flushed step
    that has nothing left to train arrives as an empty mini-batch whose `done()` is
    True.
    """

    id: int
    samples: tuple[Sample, ...]
    devices: tuple[int, ...]
    version: int
    _train_done: Callable[[MiniBatch], bool] = field(repr=False)
    _done: bool | None = field(default=None, repr=False)

    def done(self) -> bool:
        if self._done is None:
            self._done = self._train_done(self)
        return self._done

    def __len__(self) -> int:
        return len(self.samples)


class RolloutScheduler(Protocol):
    """Where the RL loop (`tidal.run.queue.RolloutQueue`) meets a scheduler: `Scheduler`
    (the elastic and async policies, any backend) or `tidal.schedule.colocated.Colocated`
    (colocated on this machine, a plain loop). Used as a context manager while it runs."""

    def __enter__(self) -> RolloutScheduler: ...

    def __exit__(self, *exc: object) -> None: ...

    def submit_many(self, works: Iterable[Work]) -> list[int]:
        """Queue rollouts; their session ids."""
        ...

    def iter_batches(self, *, steps: int | None = None,
                     flush: bool = True) -> Iterator[MiniBatch]: ...

    def step_done(self, version: int | None = None) -> int:
        """The batch is trained: publish the next policy version."""
        ...

    def failed(self) -> list[FailedSession]: ...

    def dropped(self) -> list[int]: ...

    def metrics(self) -> dict[str, Any]: ...


class Scheduler:
    """Runs rollout work on a backend's devices under a policy; streams samples out."""

    def __init__(
        self,
        backend: Backend,
        policy: Policy,
        config: PoolConfig,
        *,
        max_retries: int = 1,
        tick_s: float = 0.02,
        trace: bool = False,
    ) -> None:
        if backend.n_devices != config.n_devices:
            raise ValueError(
                f"backend has {backend.n_devices} devices, config says {config.n_devices}"
            )
        if backend.slots_per_device != config.slots_per_device:
            raise ValueError(
                f"backend has {backend.slots_per_device} slots per device, config says "
                f"{config.slots_per_device}"
            )
        if config.migration and not getattr(backend, "can_migrate", False):
            raise ValueError(
                f"the {backend.name} backend cannot migrate live sessions (it needs a "
                "migrator: tidal.schedule.backend.Migrator; see docs/scheduler.md), so "
                "config.migration must be False"
            )
        self.backend = backend
        self.policy = policy
        self.config = config
        self.max_retries = max_retries
        self.tick_s = tick_s
        self._trace = trace
        self.pool = Pool(config, policy.initial_roles(config), trace=trace)
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._wake = threading.Event()
        self._t0 = time.monotonic()
        self.t0_wall = time.time()
        self._work: dict[int, Work] = {}
        self._results: dict[int, RolloutResult] = {}
        self._devices_of: dict[int, int] = {}
        self._failed: list[FailedSession] = []
        self._dropped: list[int] = []
        self._ready: deque[MiniBatch] = deque()
        self._open: dict[int, MiniBatch] = {}  # handed out, not done
        self._mb_ids = itertools.count()
        self._step_ready = False
        self._pending_step_done = False  # the caller owes a step_done()
        self._flush = False
        self._switch_seconds: list[float] = []
        self._migrate_seconds: list[float] = []
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stop = False

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> Scheduler:
        if self._thread is not None:
            return self
        self.backend.start()
        # scheduler time t is wall time t0_wall + t; work submitted before start() stays
        # queued (submissions carry no time)
        self._t0 = time.monotonic()
        self.t0_wall = time.time()
        self._thread = threading.Thread(target=self._loop, name="tidal-scheduler", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.backend.close()

    def __enter__(self) -> Scheduler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def now(self) -> float:
        return time.monotonic() - self._t0

    # ---------------------------------------------------------------- work in
    def submit(self, work: Work) -> int:
        """Queue one rollout; returns its session id."""
        return self.submit_many([work])[0]

    def submit_many(self, works: Iterable[Work]) -> list[int]:
        works = list(works)
        with self._lock:
            ids = self.pool.submit(len(works))
            for sid, w in zip(ids, works, strict=True):
                self._work[sid] = w
        self._wake.set()
        return ids

    # ---------------------------------------------------------------- samples out
    @property
    def policy_version(self) -> int:
        return self.pool.version

    def iter_batches(
        self,
        *,
        steps: int | None = None,
        flush: bool = True,
        timeout: float | None = None,
    ) -> Iterator[MiniBatch]:
        """Mini-batches of finished sessions as they arrive (streaming training).

        Stops after `steps` optimizer steps, or when no work is left (with `flush`, a
        final partial batch is trained first). `timeout` bounds the wait for any
        single mini-batch (TimeoutError).
        """
        start_version = self.pool.version
        with self._lock:
            self._flush = flush
        self._wake.set()
        while True:
            with self._cv:
                deadline = None if timeout is None else time.monotonic() + timeout
                while True:
                    self._raise_if_failed()
                    if steps is not None and self.pool.version - start_version >= steps:
                        return
                    if self._ready:
                        mb = self._ready.popleft()
                        self._open[mb.id] = mb
                        break
                    if self._step_ready and not self._open and not self._pending_step_done:
                        # a flushed step with nothing left to train
                        mb = MiniBatch(next(self._mb_ids), (), (), self.pool.version,
                                       self._train_done)
                        mb._done = True
                        self._pending_step_done = True
                        break
                    if self._exhausted():
                        return
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(
                            f"no mini-batch within {timeout}s (queued {self.pool.queued}, "
                            f"running {self.pool.in_flight})"
                        )
                    self._cv.wait(timeout=0.5 if left is None else min(left, 0.5))
            yield mb

    def _exhausted(self) -> bool:
        p = self.pool
        return (
            p.queued == 0
            and p.in_flight == 0
            and not p.stepping
            and not self._ready
            and not self._open
        )

    def _train_done(self, mb: MiniBatch) -> bool:
        with self._lock:
            if self._open.pop(mb.id, None) is None:
                raise ScheduleError(f"mini-batch {mb.id} is not open")
            now = self.now()
            ready = None
            for d in mb.devices:
                r = self.pool.train_done(d, now)
                ready = ready or r
            if ready is not None:
                self._step_ready = True
                self._pending_step_done = True
        self._wake.set()
        return ready is not None

    def step_done(self, version: int | None = None) -> int:
        """The optimizer step finished: publish the next policy version (returned)."""
        with self._lock:
            if not self._step_ready:
                raise ScheduleError("step_done() without a completed batch (mb.done() was False)")
            if version is not None and version != self.pool.version + 1:
                raise ScheduleError(
                    f"step_done({version}): the next version is {self.pool.version + 1}"
                )
            self.pool.step_done(self.now())
            self._step_ready = False
            self._pending_step_done = False
            self._note_drops()
            self._cv.notify_all()
        self._wake.set()
        return self.pool.version

    def set_policy_version(self, version: int) -> int:
        """Alias of `step_done(version)` for loops that count versions themselves."""
        return self.step_done(version)

    def run_training(
        self,
        train_fn: Callable[[MiniBatch], object],
        step_fn: Callable[[int], object] | None = None,
        *,
        steps: int | None = None,
        timeout: float | None = None,
    ) -> int:
        """Consume mini-batches with `train_fn`; after each completed batch call
        `step_fn(version)` (the optimizer step) and publish the next version. Returns
        the number of steps taken."""
        n = 0
        for mb in self.iter_batches(steps=steps, timeout=timeout):
            if mb.samples:
                train_fn(mb)
            if mb.done():
                if step_fn is not None:
                    step_fn(self.pool.version)
                self.step_done()
                n += 1
        return n

    def failed(self) -> list[FailedSession]:
        with self._lock:
            return list(self._failed)

    def dropped(self) -> list[int]:
        """Sessions dropped by the staleness rule (their results were discarded)."""
        with self._lock:
            return list(self._dropped)

    def wait_until(self, cond: Callable[[Scheduler], bool], timeout: float = 60.0) -> None:
        """Block until `cond(self)` holds (checked under the lock after every event)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not cond(self):
                self._raise_if_failed()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("condition not reached")
                self._cv.wait(timeout=min(left, 0.5))

    def metrics(self) -> dict[str, Any]:
        """Utilisation, idle time per device, role switches (count and measured
        seconds), staleness histogram, dropped, failed and resumed sessions."""
        with self._lock:
            m = self.pool.metrics(self.now()).to_dict()
            m["backend"] = self.backend.name
            m["policy"] = self.policy.name
            m["policy_version"] = self.pool.version
            m["switch_seconds"] = list(self._switch_seconds)
            m["migrate_seconds"] = list(self._migrate_seconds)
            m["failed_sessions"] = [f.session for f in self._failed]
            m["dropped_sessions"] = list(self._dropped)
            m["queued"] = self.pool.queued
            m["in_flight"] = self.pool.in_flight
            return m

    # ---------------------------------------------------------------- the loop
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("the scheduler loop failed") from self._error

    def _loop(self) -> None:
        try:
            while not self._stop:
                events = self.backend.poll(0.0 if self._wake.is_set() else self.tick_s)
                self._wake.clear()
                with self._cv:
                    now = self.now()
                    for ev in events:
                        self._on_event(ev, now)
                    self._decide(now)
                    self._cv.notify_all()
        except BaseException as e:  # surfaced to the caller's thread
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _on_event(self, ev: BackendEvent, now: float) -> None:
        pool = self.pool
        if isinstance(ev, Finished):
            res = ev.result if isinstance(ev.result, RolloutResult) else RolloutResult(ev.result)
            rec = pool.sessions[ev.session]
            self._results[ev.session] = res
            pool.session_finished(
                ev.session, now, version=res.policy_version, tokens=res.tokens
            )
            if rec.state is SState.DROPPED:
                self._dropped.append(ev.session)
                self._results.pop(ev.session, None)
        elif isinstance(ev, Failed):
            rec = pool.sessions[ev.session]
            retry = ev.infra and rec.attempts <= self.max_retries
            pool.session_failed(ev.session, now, requeue=retry)
            if not retry:
                self._failed.append(FailedSession(ev.session, ev.error, rec.attempts))
                self._work.pop(ev.session, None)
        elif isinstance(ev, SwitchDone):
            pool.switch_done(ev.device, now)
            self._switch_seconds.append(ev.seconds)
        elif isinstance(ev, Migrated):
            pool.migrated(ev.session, now)
            self._migrate_seconds.append(ev.seconds)

    def _note_drops(self) -> None:
        for sid in list(self._results):
            if self.pool.sessions[sid].state is SState.DROPPED:
                self._dropped.append(sid)
                del self._results[sid]

    def _decide(self, now: float) -> None:
        if self._flush and not self.pool.stepping:
            ready = self.pool.flush(now)
            if ready is not None:
                self._step_ready = True
        self._carry_out(self.pool.run_policy(self.policy, now), now)

    def _carry_out(self, effects: list[Effect], now: float) -> None:
        pool = self.pool
        trains: list[RunTrain] = []
        for e in effects:
            if isinstance(e, Launch):
                rec = pool.sessions[e.session]
                ctx = SessionContext(e.session, e.device, rec.version, rec.attempts)
                self._devices_of[e.session] = e.device
                self.backend.launch(e.session, e.device, self._work[e.session], ctx)
            elif isinstance(e, BeginSwitch):
                self.backend.set_role(e.device, e.to)
            elif isinstance(e, RunTrain):
                trains.append(e)
            elif isinstance(e, BeginMigrate):  # only with a backend that can (__init__)
                self._devices_of[e.session] = e.dst
                self.backend.migrate(e.session, e.src, e.dst)  # type: ignore[attr-defined]
        if trains:
            # one mini-batch per decision pass: the trainer runs it data-parallel over
            # the devices that took part
            self._ready.append(
                MiniBatch(
                    next(self._mb_ids),
                    tuple(
                        self._sample(sid, w)
                        for e in trains
                        for sid, w in zip(e.sessions, e.weights, strict=True)
                    ),
                    tuple(e.device for e in trains),
                    pool.version,
                    self._train_done,
                )
            )

    def _sample(self, sid: int, weight: float) -> Sample:
        rec = self.pool.sessions[sid]
        res = self._results.pop(sid)
        self._work.pop(sid, None)
        return Sample(
            session=sid,
            value=res.value,
            policy_version=rec.version,
            tokens=rec.tokens,
            staleness=rec.staleness,
            weight=weight,
            attempts=rec.attempts,
            device=self._devices_of.get(sid, -1),
            started_at=rec.started_at,
            finished_at=rec.finished_at,
        )
