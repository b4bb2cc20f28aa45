"""`Pool`: the bookkeeping that applies policy decisions and backend events.

One class, used unchanged by the simulator and by the real scheduler, so that both run
the same rules:

- a decision that would interrupt a live session (switching a device that still holds
  one) raises `ScheduleError`; role changes happen only on drained devices, or after
  the session was migrated away (pause, snapshot, resume elsewhere);
- the admission gate: at most `(K + 1) * B` samples in flight;
- the staleness rule, applied when a sample arrives and whenever the version moves;
- streaming training: train devices take `micro_batch` samples at a time from the
  buffer; the optimizer step happens when the open batch's B samples are done;
- metrics: per-device busy/idle/switching time, role switches, staleness histogram.

The pool never looks at a clock: every call takes `now`. It returns `Effect`s that
the driver (simulator or backend loop) carries out and reports back as events.
"""

from __future__ import annotations

import enum
import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tidal.schedule.types import (
    Decision,
    DeviceView,
    Drain,
    Migrate,
    PoolConfig,
    PoolState,
    Role,
    ScheduleError,
    StalenessRule,
    Start,
    Switch,
    Train,
    Undrain,
)

if TYPE_CHECKING:
    from tidal.schedule.policy import Policy


def _dv(
    v: DeviceView,
    *,
    sessions: tuple[int, ...] | None = None,
    draining: bool | None = None,
    training: int | None = None,
    since: float | None = None,
    switching: bool | None = None,
    arriving: tuple[int, ...] | None = None,
) -> DeviceView:
    """`dataclasses.replace` for DeviceView, several times faster (a hot path)."""
    return DeviceView(
        v.id,
        v.role,
        v.switching if switching is None else switching,
        v.sessions if sessions is None else sessions,
        v.draining if draining is None else draining,
        v.training if training is None else training,
        v.since if since is None else since,
        v.arriving if arriving is None else arriving,
    )


_RESHAPE = (Drain, Undrain, Switch, Migrate)

# ----------------------------------------------------------------------------- effects


@dataclass(frozen=True, slots=True)
class Launch:
    """Run session `session` on `device` (the driver reports `session_finished`)."""

    session: int
    device: int


@dataclass(frozen=True, slots=True)
class BeginSwitch:
    """Switch `device` to `to` (the driver reports `switch_done`)."""

    device: int
    to: Role


@dataclass(frozen=True, slots=True)
class BeginMigrate:
    """Pause `session` on `src`, snapshot it, resume it on `dst` (report `migrated`)."""

    session: int
    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class RunTrain:
    """Train `device` on `sessions` (weights alongside) (report `train_done`)."""

    device: int
    sessions: tuple[int, ...]
    weights: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class StepReady:
    """The open batch is fully processed: run the optimizer step (report `step_done`)."""

    version: int
    devices: tuple[int, ...]


Effect = Launch | BeginSwitch | BeginMigrate | RunTrain | StepReady


class SState(enum.IntEnum):
    QUEUED = 0
    RUNNING = 1
    MIGRATING = 2
    BUFFERED = 3
    TAKEN = 4
    TRAINED = 5
    DROPPED = 6
    FAILED = 7


@dataclass(slots=True)
class SessionRecord:
    id: int
    state: SState = SState.QUEUED
    device: int = -1
    version: int = -1  # policy version of its oldest token
    tokens: int = 0
    attempts: int = 0
    started_at: float = 0.0
    finished_at: float = 0.0
    staleness: int = -1  # versions behind when trained (or dropped)
    weight: float = 1.0


@dataclass
class PoolMetrics:
    """What a run did, per device and in total (times in seconds)."""

    elapsed: float
    n_devices: int
    busy_s: list[float]
    switching_s: list[float]
    idle_s: list[float]
    rollout_s: list[float]  # time spent in the rollout role (switches excluded)
    train_s: list[float]
    switches_to_train: int
    switches_to_rollout: int
    migrations: int
    sessions_started: int
    sessions_finished: int
    sessions_failed: int  # ended as infra_error (retries exhausted)
    sessions_requeued: int  # failed and resumed / restarted
    trained: int
    steps: int
    dropped_stale: int
    downweighted: int
    staleness_trained: dict[int, int]
    staleness_dropped: dict[int, int]
    switch_log: list[tuple[float, int, str]] = field(default_factory=list)

    @property
    def utilization(self) -> float:
        total = self.elapsed * self.n_devices
        return sum(self.busy_s) / total if total > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        n = max(1, self.n_devices)
        return {
            "elapsed_s": self.elapsed,
            "n_devices": self.n_devices,
            "utilization": self.utilization,
            "busy_s_mean": sum(self.busy_s) / n,
            "idle_s_mean": sum(self.idle_s) / n,
            "switching_s_mean": sum(self.switching_s) / n,
            "idle_s_per_device": list(self.idle_s),
            "busy_s_per_device": list(self.busy_s),
            "rollout_s_per_device": list(self.rollout_s),
            "train_s_per_device": list(self.train_s),
            "role_switches": {
                "to_train": self.switches_to_train,
                "to_rollout": self.switches_to_rollout,
            },
            "migrations": self.migrations,
            "sessions": {
                "started": self.sessions_started,
                "finished": self.sessions_finished,
                "failed": self.sessions_failed,
                "requeued": self.sessions_requeued,
            },
            "trained": self.trained,
            "steps": self.steps,
            "staleness": {
                "trained": {str(k): v for k, v in sorted(self.staleness_trained.items())},
                "dropped": {str(k): v for k, v in sorted(self.staleness_dropped.items())},
                "dropped_total": self.dropped_stale,
                "downweighted": self.downweighted,
            },
        }


class Pool:
    """Devices, sessions, the sample buffer and the open training step.

    `initial_roles` gives each device's role at time 0 (no switch cost is charged).
    Set `trace=True` to keep a list of (time, what, ...) tuples, handy in tests.
    """

    def __init__(
        self,
        config: PoolConfig,
        initial_roles: Sequence[Role],
        *,
        now: float = 0.0,
        trace: bool = False,
    ) -> None:
        if len(initial_roles) != config.n_devices:
            raise ValueError(
                f"initial_roles has {len(initial_roles)} entries for {config.n_devices} devices"
            )
        self.cfg = config
        self.version = 0
        self.t0 = now
        n, c = config.n_devices, config.slots_per_device
        self._views: list[DeviceView] = [
            DeviceView(id=d, role=Role(r), since=now) for d, r in enumerate(initial_roles)
        ]
        self._by_load: list[list[int]] = [[] for _ in range(c + 1)]
        self._draining: list[list[int]] = [[] for _ in range(c + 1)]
        self._dirty = True
        self._snap: tuple[Any, ...] = ()
        self._train_idle: list[int] = []
        self._train_busy = 0
        self._to_train = 0
        self._to_rollout = 0
        self._stepping: frozenset[int] | None = None
        for v in self._views:
            self._index(v)
        self.sessions: dict[int, SessionRecord] = {}
        self._queue: deque[int] = deque()
        self._next_id = 0
        self._buffer: deque[int] = deque()
        self._buffered_tokens = 0
        self._running = 0
        self._migrating = 0
        self._taken = 0
        self._done_in_step = 0
        self._step_size = config.batch_size
        self._step_sids: list[int] = []
        self._train_s_per_sample = 0.0
        self._rate = 0.0  # EWMA of finished sessions per second, as of self._rate_t
        self._rate_t = now
        # metrics
        self._last = [now] * n
        self._occ = [0.0] * n  # current busy fraction of each device
        self._busy = [0.0] * n
        self._switching = [0.0] * n
        self._role_time = {Role.ROLLOUT: [0.0] * n, Role.TRAIN: [0.0] * n}
        self.switches = {Role.TRAIN: 0, Role.ROLLOUT: 0}
        self.migrations = 0
        self.started = 0
        self.finished = 0
        self.failed = 0
        self.requeued = 0
        self.trained = 0
        self.steps = 0
        self.dropped_stale = 0
        self.downweighted = 0
        self.staleness_trained: dict[int, int] = {}
        self.staleness_dropped: dict[int, int] = {}
        self.switch_log: list[tuple[float, int, str]] = []
        self.trace: list[tuple[Any, ...]] | None = [] if trace else None

    # ------------------------------------------------------------------ indexing
    def _index(self, v: DeviceView) -> None:
        if v.switching:
            if v.role is Role.TRAIN:
                self._to_train += 1
            else:
                self._to_rollout += 1
        elif v.role is Role.ROLLOUT:
            idx = self._draining if v.draining else self._by_load
            insort(idx[len(v.sessions)], v.id)
        elif v.training or (self._stepping is not None and v.id in self._stepping):
            self._train_busy += 1
        else:
            insort(self._train_idle, v.id)

    def _unindex(self, v: DeviceView) -> None:
        if v.switching:
            if v.role is Role.TRAIN:
                self._to_train -= 1
            else:
                self._to_rollout -= 1
        elif v.role is Role.ROLLOUT:
            lst = (self._draining if v.draining else self._by_load)[len(v.sessions)]
            del lst[bisect_left(lst, v.id)]
        elif v.training or (self._stepping is not None and v.id in self._stepping):
            self._train_busy -= 1
        else:
            del self._train_idle[bisect_left(self._train_idle, v.id)]

    def _occupancy(self, v: DeviceView) -> float:
        if v.switching:
            return 0.0
        if v.role is Role.ROLLOUT:
            if not v.sessions:
                return 0.0
            ss = self.sessions
            live = sum(1 for s in v.sessions if ss[s].state is SState.RUNNING)
            return live / self.cfg.slots_per_device
        if v.training or (self._stepping is not None and v.id in self._stepping):
            return 1.0
        return 0.0

    def _account(self, d: int, now: float) -> None:
        dt = now - self._last[d]
        if dt > 0:
            v = self._views[d]
            if v.switching:
                self._switching[d] += dt
            else:
                self._busy[d] += dt * self._occ[d]
                self._role_time[v.role][d] += dt
        self._last[d] = now

    def _set(self, d: int, new: DeviceView, now: float) -> None:
        """Every device change goes through here: accounting, then re-indexing."""
        self._account(d, now)
        self._unindex(self._views[d])
        self._views[d] = new
        self._index(new)
        self._occ[d] = self._occupancy(new)
        self._dirty = True

    def _touch(self, d: int, now: float) -> None:
        """A session on `d` changed state without the view changing (occupancy did)."""
        self._account(d, now)
        self._occ[d] = self._occupancy(self._views[d])

    def _log(self, *item: Any) -> None:
        if self.trace is not None:
            self.trace.append(item)

    # ------------------------------------------------------------------ queries
    @property
    def in_flight(self) -> int:
        return self._running + len(self._buffer) + self._taken

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def n_submitted(self) -> int:
        return self._next_id

    @property
    def admissible(self) -> int:
        return max(0, min(len(self._queue), self.cfg.max_in_flight - self.in_flight))

    def view(self, d: int) -> DeviceView:
        return self._views[d]

    @property
    def stepping(self) -> bool:
        return self._stepping is not None

    def finish_rate(self, now: float) -> float:
        """Finished sessions per second, exponentially averaged over `rate_window_s`."""
        return self._rate * math.exp(-(now - self._rate_t) / self.cfg.rate_window_s)

    def snapshot(self, now: float) -> PoolState:
        if self._dirty:
            self._snap = (
                tuple(self._views),
                tuple(tuple(b) for b in self._by_load),
                tuple(tuple(b) for b in self._draining),
                tuple(self._train_idle),
            )
            self._dirty = False
        views, by_load, draining, train_idle = self._snap
        return PoolState(
            now=now,
            version=self.version,
            config=self.cfg,
            devices=views,
            rollout_by_load=by_load,
            draining_by_load=draining,
            train_idle=train_idle,
            train_busy=self._train_busy,
            to_train=self._to_train,
            to_rollout=self._to_rollout,
            queued=len(self._queue),
            admissible=self.admissible,
            running=self._running,
            migrating=self._migrating,
            buffered=len(self._buffer),
            buffered_tokens=self._buffered_tokens,
            taken=self._taken,
            step_size=self._step_size,
            stepping=self._stepping is not None,
            trained=self.trained,
            dropped_stale=self.dropped_stale,
            train_s_per_sample=self._train_s_per_sample,
            finish_rate=self.finish_rate(now),
            started=self.started,
        )

    # ------------------------------------------------------------------ queue
    def submit(self, n: int = 1) -> list[int]:
        """Queue `n` new sessions; returns their ids (0, 1, 2, ... in submission order)."""
        ids = list(range(self._next_id, self._next_id + n))
        self._next_id += n
        for sid in ids:
            self.sessions[sid] = SessionRecord(id=sid)
        self._queue.extend(ids)
        return ids

    # ------------------------------------------------------------------ decisions
    def run_policy(self, policy: Policy, now: float) -> list[Effect]:
        """Ask `policy` for decisions and apply them; ask again only after a change of
        roles, drains or migrations (which can open new options: a pass is complete
        for starts and training). Returns every effect for the driver to carry out."""
        out: list[Effect] = []
        for _ in range(8):
            decisions = policy.decide(self.snapshot(now))
            if not decisions:
                break
            out.extend(self.apply(decisions, now))
            if not any(isinstance(d, _RESHAPE) for d in decisions):
                break
        return out

    def apply(self, decisions: Iterable[Decision], now: float) -> list[Effect]:
        """Validate and apply decisions in order; returns what the driver must do."""
        out: list[Effect] = []
        for dec in decisions:
            if isinstance(dec, Start):
                self._start(dec, now, out)
            elif isinstance(dec, Train):
                self._train(dec, now, out)
            elif isinstance(dec, Switch):
                self._switch(dec, now, out)
            elif isinstance(dec, Drain):
                v = self._rollout_view(dec.device, dec)
                if not v.draining:
                    self._set(dec.device, _dv(v, draining=True, since=now), now)
                    self._log(now, "drain", dec.device)
            elif isinstance(dec, Undrain):
                v = self._rollout_view(dec.device, dec)
                if v.draining:
                    self._set(dec.device, _dv(v, draining=False, since=now), now)
                    self._log(now, "undrain", dec.device)
            elif isinstance(dec, Migrate):
                self._migrate(dec, now, out)
            else:  # pragma: no cover - typing guards this
                raise ScheduleError(f"unknown decision {dec!r}")
        return out

    def _rollout_view(self, d: int, dec: Decision) -> DeviceView:
        if not 0 <= d < len(self._views):
            raise ScheduleError(f"{dec}: no device {d}")
        v = self._views[d]
        if v.role is not Role.ROLLOUT or v.switching:
            raise ScheduleError(f"{dec}: device {d} is not a ready rollout device ({v})")
        return v

    def _start(self, dec: Start, now: float, out: list[Effect]) -> None:
        v = self._rollout_view(dec.device, dec)
        if v.draining:
            raise ScheduleError(f"{dec}: device {dec.device} is draining")
        if dec.n < 1 or v.load + dec.n > self.cfg.slots_per_device:
            raise ScheduleError(
                f"{dec}: device {dec.device} has {self.cfg.slots_per_device - v.load} free slots"
            )
        if dec.n > self.admissible:
            raise ScheduleError(
                f"{dec}: only {self.admissible} sessions may start now "
                f"(queued {len(self._queue)}, in flight {self.in_flight}, "
                f"gate {self.cfg.max_in_flight})"
            )
        new: list[int] = []
        for _ in range(dec.n):
            sid = self._queue.popleft()
            s = self.sessions[sid]
            s.state = SState.RUNNING
            s.device = dec.device
            s.version = self.version
            s.started_at = now
            s.attempts += 1
            new.append(sid)
            self._running += 1
            self.started += 1
            out.append(Launch(sid, dec.device))
            self._log(now, "start", sid, dec.device, self.version)
        self._set(dec.device, _dv(v, sessions=v.sessions + tuple(new)), now)

    def _switch(self, dec: Switch, now: float, out: list[Effect]) -> None:
        d = dec.device
        if not 0 <= d < len(self._views):
            raise ScheduleError(f"{dec}: no device {d}")
        v = self._views[d]
        if v.switching:
            raise ScheduleError(f"{dec}: device {d} is already switching")
        if v.role is dec.to:
            raise ScheduleError(f"{dec}: device {d} already has role {dec.to}")
        if v.sessions:
            raise ScheduleError(
                f"{dec}: device {d} still holds live session(s) {list(v.sessions)}; "
                "drain it or migrate them first (a switch never interrupts a session)"
            )
        if v.training or (self._stepping is not None and d in self._stepping):
            raise ScheduleError(f"{dec}: device {d} is training")
        self._set(
            d, DeviceView(id=d, role=dec.to, switching=True, since=now), now
        )
        self.switches[dec.to] += 1
        self.switch_log.append((now, d, dec.to.value))
        self._log(now, "switch", d, dec.to.value)
        out.append(BeginSwitch(d, dec.to))

    def _migrate(self, dec: Migrate, now: float, out: list[Effect]) -> None:
        if not self.cfg.migration:
            raise ScheduleError(f"{dec}: this pool has no session migration")
        s = self.sessions.get(dec.session)
        if s is None or s.state is not SState.RUNNING:
            raise ScheduleError(f"{dec}: session is not running")
        src = s.device
        if src == dec.dst:
            raise ScheduleError(f"{dec}: session already on device {src}")
        dv = self._rollout_view(dec.dst, dec)
        if dv.draining or dv.load >= self.cfg.slots_per_device:
            raise ScheduleError(f"{dec}: device {dec.dst} has no free slot")
        sv = self._views[src]
        s.state = SState.MIGRATING
        s.device = dec.dst
        self._migrating += 1
        self.migrations += 1
        self._set(src, _dv(sv, sessions=tuple(x for x in sv.sessions if x != s.id)), now)
        self._set(
            dec.dst,
            _dv(dv, sessions=(*dv.sessions, s.id), arriving=(*dv.arriving, s.id)),
            now,
        )
        self._log(now, "migrate", s.id, src, dec.dst)
        out.append(BeginMigrate(s.id, src, dec.dst))

    def _staleness_of(self, s: SessionRecord) -> int:
        return self.version - s.version

    def _train(self, dec: Train, now: float, out: list[Effect]) -> None:
        d = dec.device
        if not 0 <= d < len(self._views):
            raise ScheduleError(f"{dec}: no device {d}")
        v = self._views[d]
        if v.role is not Role.TRAIN or v.switching or v.training:
            raise ScheduleError(f"{dec}: device {d} is not an idle train device ({v})")
        if self._stepping is not None:
            raise ScheduleError(f"{dec}: the optimizer step is under way")
        k = self.cfg.max_staleness
        got: list[int] = []
        weights: list[float] = []
        while len(got) < dec.n and self._taken < self._step_size and self._buffer:
            sid = self._buffer.popleft()
            s = self.sessions[sid]
            self._buffered_tokens -= s.tokens
            st = self._staleness_of(s)
            w = 1.0
            if st > k:
                if self.cfg.staleness_rule is StalenessRule.DROP:
                    self._drop(s, st, now)
                    continue
                w = 1.0 / (1 + st - k)
                self.downweighted += 1
            s.state = SState.TAKEN
            s.staleness = st
            s.weight = w
            got.append(sid)
            weights.append(w)
            self._step_sids.append(sid)
            self._taken += 1
        if not got:
            return
        self._set(d, _dv(v, training=len(got), since=now), now)
        self._log(now, "train", d, tuple(got))
        out.append(RunTrain(d, tuple(got), tuple(weights)))

    def _drop(self, s: SessionRecord, staleness: int, now: float) -> None:
        s.state = SState.DROPPED
        s.staleness = staleness
        self.dropped_stale += 1
        self.staleness_dropped[staleness] = self.staleness_dropped.get(staleness, 0) + 1
        self._log(now, "drop", s.id, staleness)

    # ------------------------------------------------------------------ events
    def session_finished(
        self, sid: int, now: float, *, version: int | None = None, tokens: int = 0
    ) -> None:
        """A session ended with a result. `version` is the policy version of its oldest
        token (default: the version when it started); `tokens` is its trained length."""
        s = self.sessions[sid]
        if s.state is not SState.RUNNING:
            raise ScheduleError(f"session {sid} finished while {s.state.name}")
        d = s.device
        v = self._views[d]
        self._running -= 1
        self.finished += 1
        s.finished_at = now
        s.tokens = int(tokens)
        self._rate = self.finish_rate(now) + 1.0 / self.cfg.rate_window_s
        self._rate_t = now
        if version is not None:
            s.version = int(version)
        self._set(d, _dv(v, sessions=tuple(x for x in v.sessions if x != sid)), now)
        self._log(now, "end", sid, d)
        st = self._staleness_of(s)
        if st > self.cfg.max_staleness and self.cfg.staleness_rule is StalenessRule.DROP:
            self._drop(s, st, now)
            return
        s.state = SState.BUFFERED
        self._buffer.append(sid)
        self._buffered_tokens += s.tokens

    def session_failed(self, sid: int, now: float, *, requeue: bool) -> None:
        """A session died with its worker. With `requeue` it goes back to the head of the
        queue (restarted, or resumed from its snapshot by the backend); otherwise it ends
        as infra_error."""
        s = self.sessions[sid]
        if s.state not in (SState.RUNNING, SState.MIGRATING):
            raise ScheduleError(f"session {sid} failed while {s.state.name}")
        if s.state is SState.MIGRATING:
            self._migrating -= 1
        d = s.device
        v = self._views[d]
        self._running -= 1
        self._set(
            d,
            _dv(
                v,
                sessions=tuple(x for x in v.sessions if x != sid),
                arriving=tuple(x for x in v.arriving if x != sid),
            ),
            now,
        )
        if requeue:
            s.state = SState.QUEUED
            s.device = -1
            self._queue.appendleft(sid)
            self.requeued += 1
            self._log(now, "requeue", sid, d)
        else:
            s.state = SState.FAILED
            self.failed += 1
            self._log(now, "failed", sid, d)

    def migrated(self, sid: int, now: float) -> None:
        s = self.sessions[sid]
        if s.state is not SState.MIGRATING:
            raise ScheduleError(f"session {sid} is not migrating")
        s.state = SState.RUNNING
        self._migrating -= 1
        v = self._views[s.device]
        self._set(s.device, _dv(v, arriving=tuple(x for x in v.arriving if x != sid)), now)
        self._log(now, "migrated", sid, s.device)

    def switch_done(self, d: int, now: float) -> None:
        v = self._views[d]
        if not v.switching:
            raise ScheduleError(f"device {d} is not switching")
        self._set(d, _dv(v, switching=False, since=now), now)
        self._log(now, "ready", d, v.role.value)

    def train_done(self, d: int, now: float, *, seconds: float | None = None) -> StepReady | None:
        """Device `d` finished its micro-batch. Returns `StepReady` when that completed
        the open batch (the driver then runs the optimizer step)."""
        v = self._views[d]
        if not v.training:
            raise ScheduleError(f"device {d} is not training")
        n = v.training
        if seconds is None:
            seconds = now - v.since
        if seconds > 0:
            per = seconds / n
            old = self._train_s_per_sample
            self._train_s_per_sample = per if old == 0 else 0.8 * old + 0.2 * per
        self._done_in_step += n
        self._set(d, _dv(v, training=0, since=now), now)
        self._log(now, "trained", d, n)
        if self._done_in_step < self._step_size:
            return None
        return self._begin_step(now)

    def _begin_step(self, now: float) -> StepReady:
        """Every sample of the open step is done: all ready train devices join the
        optimizer step."""
        devs = tuple(self._train_idle)
        for x in devs:
            self._account(x, now)
            self._unindex(self._views[x])
        self._stepping = frozenset(devs)
        for x in devs:
            self._index(self._views[x])
            self._occ[x] = 1.0
        self._dirty = True
        self._log(now, "step", self.version)
        return StepReady(self.version, devs)

    def step_done(self, now: float) -> None:
        """The optimizer step finished: the version moves and stale samples are handled."""
        if self._stepping is None:
            raise ScheduleError("no optimizer step is under way")
        devs = self._stepping
        for x in devs:
            self._account(x, now)
            self._unindex(self._views[x])
        self._stepping = None
        for x in devs:
            self._index(self._views[x])
            self._occ[x] = 0.0
        self._dirty = True
        # the batch's samples are trained
        for sid in self._step_sids:
            rec = self.sessions[sid]
            rec.state = SState.TRAINED
            st = rec.staleness
            self.staleness_trained[st] = self.staleness_trained.get(st, 0) + 1
        self.trained += self._taken
        self.steps += 1
        self._step_sids = []
        self._taken = 0
        self._done_in_step = 0
        self._step_size = self.cfg.batch_size
        self.version += 1
        self._log(now, "version", self.version)
        if self.cfg.staleness_rule is StalenessRule.DROP and self._buffer:
            k = self.cfg.max_staleness
            keep: deque[int] = deque()
            for sid in self._buffer:
                s = self.sessions[sid]
                st = self._staleness_of(s)
                if st > k:
                    self._buffered_tokens -= s.tokens
                    self._drop(s, st, now)
                else:
                    keep.append(sid)
            self._buffer = keep

    def flush(self, now: float) -> StepReady | None:
        """Close the open step early when no more samples can come (nothing queued or
        running): it then trains only what is taken or buffered. Returns `StepReady`
        if that is already all done (the driver runs the optimizer step)."""
        if self._stepping is not None or self._queue or self._running:
            return None
        n = self._taken + len(self._buffer)
        if n == 0 or n >= self._step_size:
            return None
        self._step_size = n
        self._dirty = True
        self._log(now, "flush", n)
        if self._done_in_step == n:
            return self._begin_step(now)
        return None

    # ------------------------------------------------------------------ metrics
    def metrics(self, now: float) -> PoolMetrics:
        for d in range(len(self._views)):
            self._account(d, now)
        elapsed = now - self.t0
        idle = [
            max(0.0, elapsed - b - s) for b, s in zip(self._busy, self._switching, strict=True)
        ]
        return PoolMetrics(
            elapsed=elapsed,
            n_devices=len(self._views),
            busy_s=list(self._busy),
            switching_s=list(self._switching),
            idle_s=idle,
            rollout_s=list(self._role_time[Role.ROLLOUT]),
            train_s=list(self._role_time[Role.TRAIN]),
            switches_to_train=self.switches[Role.TRAIN],
            switches_to_rollout=self.switches[Role.ROLLOUT],
            migrations=self.migrations,
            sessions_started=self.started,
            sessions_finished=self.finished,
            sessions_failed=self.failed,
            sessions_requeued=self.requeued,
            trained=self.trained,
            steps=self.steps,
            dropped_stale=self.dropped_stale,
            downweighted=self.downweighted,
            staleness_trained=dict(self.staleness_trained),
            staleness_dropped=dict(self.staleness_dropped),
            switch_log=list(self.switch_log),
        )
