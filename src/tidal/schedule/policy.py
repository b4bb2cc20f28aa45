"""Scheduling policies: pure functions of a `PoolState`, shared by simulator and scheduler.

A policy has two methods: `initial_roles(config)` (each device's role at time 0) and
`decide(state) -> list[Decision]`. It keeps no mutable state: everything it needs
(measured train cost, finish rate, buffer, gate) is in the `PoolState`. The same
objects drive `tidal.schedule.sim.simulate` and `tidal.schedule.scheduler.Scheduler`.

- `ColocatedPolicy`: synchronous on-policy RL on one set of devices. All devices roll
  out one batch; when its last session ends, all switch to training, train the batch,
  and switch back. Staleness is always 0.
- `FixedSplitPolicy`: asynchronous RL on a fixed split (`n_train` devices train, the
  rest roll out), never switching. Rollouts stream into the buffer under the same
  admission gate and staleness rule as elastic; the trainer consumes them in
  micro-batches as they arrive. `batch_sync=True` gives the common one-step-off-policy
  variant instead: a rollout batch starts only when the previous one has fully ended.
- `ElasticPolicy`: devices move between roles. The number of train devices follows
  the measured demand (finish rate x train cost per sample, plus the backlog cleared
  over `horizon_s`); a device leaves rollout by draining (no new sessions; it switches
  when its last session ends) or, where the backend can migrate, by moving its
  sessions to free slots elsewhere. It never switches a device that holds a session.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from tidal.schedule.types import (
    Decision,
    Drain,
    Migrate,
    PoolConfig,
    PoolState,
    Role,
    Start,
    Switch,
    Train,
    Undrain,
)


class Policy(Protocol):
    """What the simulator and the real scheduler need from a policy."""

    @property
    def name(self) -> str: ...

    def initial_roles(self, config: PoolConfig) -> list[Role]: ...

    def decide(self, state: PoolState) -> list[Decision]: ...


# ----------------------------------------------------------------------------- helpers


def train_pulls(state: PoolState, devices: tuple[int, ...] | None = None) -> list[Train]:
    """Hand buffered samples of the open step to idle train devices, `micro_batch` each."""
    if state.stepping:
        return []
    left = min(state.buffered, state.step_open)
    out: list[Train] = []
    mb = state.config.micro_batch
    for d in state.train_idle if devices is None else devices:
        if left <= 0:
            break
        n = min(mb, left)
        out.append(Train(d, n))
        left -= n
    return out


def place_sessions(
    state: PoolState, n: int, *, exclude: frozenset[int] = frozenset(), pack: bool = True
) -> list[Start]:
    """Start up to `n` sessions on ready, non-draining rollout devices.

    `pack=True` fills the fullest devices first, which leaves other devices emptier
    and so cheaper to move to training; `pack=False` fills the emptiest first.
    Within one load level, lower device ids go first.
    """
    c = state.config.slots_per_device
    out: list[Start] = []
    if n <= 0:
        return out
    levels = range(c - 1, -1, -1) if pack else range(c)
    for load in levels:
        free = c - load
        for d in state.rollout_by_load[load]:
            if d in exclude:
                continue
            k = min(free, n)
            out.append(Start(d, k))
            n -= k
            if n == 0:
                return out
    return out


# ----------------------------------------------------------------------------- policies


@dataclass(frozen=True)
class ColocatedPolicy:
    """Synchronous: all devices roll out a batch, then all train it, then all go back.

    Whatever `max_staleness` the config says, at most one batch is in flight, so every
    sample is trained by the version that generated it (staleness 0).
    """

    name: str = "colocated"

    def initial_roles(self, config: PoolConfig) -> list[Role]:
        return [Role.ROLLOUT] * config.n_devices

    def decide(self, state: PoolState) -> list[Decision]:
        if state.stepping:
            return []
        out: list[Decision] = []
        in_train = state.n_train + state.to_train
        if in_train:
            # training phase: once the batch is trained (the version moved and nothing
            # is left), every device goes back to rollout
            if state.taken == 0 and state.buffered == 0 and state.to_train == 0:
                out.extend(Switch(d, Role.ROLLOUT) for d in state.train_idle)
                return out
            out.extend(train_pulls(state))
            return out
        if state.to_rollout:
            return out  # wait until every device is back
        in_flight = state.running + state.buffered + state.taken
        budget = min(state.admissible, state.step_size - in_flight)
        out.extend(place_sessions(state, budget, pack=False))
        if state.running == 0 and state.buffered >= state.step_size - state.taken and not out:
            # the whole batch is in: everyone switches to training together
            for load_level in state.rollout_by_load:
                out.extend(Switch(d, Role.TRAIN) for d in load_level)
            out.extend(Switch(d, Role.TRAIN) for d in state.draining)
        return out


@dataclass(frozen=True)
class FixedSplitPolicy:
    """Asynchronous on a fixed split: the last `n_train` devices train, the rest roll out.

    With `batch_sync=False` (default, the strong baseline) rollouts stream: a freed slot
    takes the next session whenever the admission gate allows. With `batch_sync=True`
    rollouts go in whole batches (one-step-off-policy style): batch g+1 starts only once
    every session of batch g has ended, and at most `max_staleness` batches ahead of
    the trainer.
    """

    n_train: int
    batch_sync: bool = False
    name: str = "async"

    def initial_roles(self, config: PoolConfig) -> list[Role]:
        if not 0 < self.n_train < config.n_devices:
            raise ValueError(
                f"a fixed split needs 1..{config.n_devices - 1} train devices, got {self.n_train}"
            )
        n_roll = config.n_devices - self.n_train
        return [Role.ROLLOUT] * n_roll + [Role.TRAIN] * self.n_train

    def decide(self, state: PoolState) -> list[Decision]:
        out: list[Decision] = list(train_pulls(state))
        n = state.admissible
        if self.batch_sync:
            b = state.config.batch_size
            gen, part = divmod(state.started, b)
            if part == 0:  # at a batch boundary: wait for the batch and the trainer
                ahead = gen - state.version
                if state.running > 0 or ahead > state.config.max_staleness:
                    n = 0
                n = min(n, b)
            else:
                n = min(n, b - part)
        out.extend(place_sessions(state, n, pack=False))
        return out


@dataclass(frozen=True)
class ElasticPolicy:
    """Devices follow the work: train devices = measured demand, the rest roll out.

    Demand for train devices is `finish_rate * train_s_per_sample` (what keeps up with
    arriving samples) plus `backlog * train_s_per_sample / horizon_s` (what clears the
    current backlog within the horizon), rounded up. Until the first micro-batch has
    been measured, any backlog asks for one train device. A device joins training
    when it is empty (no refill), else by draining the least loaded rollout device, or
    -- where the backend supports it -- by migrating its sessions to free slots.
    Devices return to rollout when training has no work and rollout does.
    """

    horizon_s: float = 7200.0
    hysteresis: int = 1
    idle_return_s: float = 300.0
    min_train: int = 0
    migrate: bool = True
    name: str = "elastic"

    @classmethod
    def for_sessions(cls, mean_session_s: float, **kw: object) -> ElasticPolicy:
        """Time constants scaled to the sessions' mean length (the defaults are for 2 h
        sessions: horizon = mean, idle return = mean / 24). Pair it with
        `PoolConfig(rate_window_s=mean_session_s / 4)`."""
        return cls(
            horizon_s=mean_session_s, idle_return_s=mean_session_s / 24, **kw  # type: ignore[arg-type]
        )

    def initial_roles(self, config: PoolConfig) -> list[Role]:
        return [Role.ROLLOUT] * config.n_devices

    def train_demand(self, state: PoolState, backlog: int) -> int:
        t = state.train_s_per_sample
        if t <= 0.0:
            return 1 if backlog > 0 or state.taken > 0 else 0
        want = state.finish_rate * t + backlog * t / self.horizon_s
        return math.ceil(want - 1e-9)

    # long by design: the elastic policy's one decision pass (a pure core with its own tests)
    def decide(self, state: PoolState) -> list[Decision]:  # noqa: PLR0915
        cfg = state.config
        c = cfg.slots_per_device
        devs = state.devices
        out: list[Decision] = []
        pulls = train_pulls(state)
        out.extend(pulls)
        pulled = sum(p.n for p in pulls)
        just_busy = {p.device for p in pulls}
        backlog = max(0, state.buffered - pulled)
        want = max(self.min_train, min(cfg.n_devices, self.train_demand(state, backlog)))
        have = state.n_train + state.to_train + state.n_draining
        # drained devices switch as soon as they are empty
        out.extend(Switch(d, Role.TRAIN) for d in state.draining_by_load[0])
        leaving: set[int] = set()
        to_drain: list[int] = []
        undrained: list[int] = []
        if want > have:
            deficit = want - have
            # empty rollout devices switch at once, then the least loaded drain
            for load in range(c + 1):
                for d in state.rollout_by_load[load]:
                    if deficit <= 0:
                        break
                    if load == 0:
                        out.append(Switch(d, Role.TRAIN))
                    else:
                        out.append(Drain(d))
                        to_drain.append(d)
                    leaving.add(d)
                    deficit -= 1
        elif backlog == 0 and not state.stepping and want < have - self.hysteresis:
            # training keeps up with nothing waiting: give devices back to rollout,
            # cancelling drains first (no switch needed), most loaded first
            surplus = have - want - self.hysteresis
            for load in range(c, 0, -1):
                for d in state.draining_by_load[load]:
                    if surplus <= 0:
                        break
                    out.append(Undrain(d))
                    undrained.append(d)
                    surplus -= 1
            # then train devices idle for `idle_return_s`, if rollout has work for them
            waiting = state.admissible - state.free_slots
            for d in state.train_idle:
                if surplus <= 0 or waiting <= 0:
                    break
                if d in just_busy or state.now - devs[d].since < self.idle_return_s:
                    continue
                out.append(Switch(d, Role.ROLLOUT))
                surplus -= 1
                waiting -= c
        # free slots on devices that stay in rollout, fullest first
        free: dict[int, int] = {}
        for load in range(c - 1, -1, -1):
            for d in state.rollout_by_load[load]:
                if d not in leaving:
                    free[d] = c - load
        for d in undrained:
            if devs[d].load < c:
                free[d] = c - devs[d].load
        if cfg.migration and self.migrate and free:
            # a freed slot takes a session from a draining device before a new one: the
            # same number of sessions runs, and the draining device empties sooner
            back = set(undrained)
            sources = [d for b in state.draining_by_load[1:] for d in b if d not in back]
            sources += to_drain
            out.extend(self._migrate(state, sources, free))
        n = state.admissible
        for d, k in free.items():
            if n <= 0:
                break
            if k <= 0:
                continue
            m = min(k, n)
            out.append(Start(d, m))
            n -= m
        return out

    def _migrate(
        self, state: PoolState, sources: list[int], free: dict[int, int]
    ) -> list[Decision]:
        """Move sessions of draining devices into free slots, emptiest source first;
        a source emptied this way switches at once. Updates `free` in place."""
        slots = [d for d, k in free.items() for _ in range(k)]
        if not slots:
            return []
        devs = state.devices
        out: list[Decision] = []
        i = 0
        for d in sources:  # emptiest first: draining ones by load, then new drains
            v = devs[d]
            moved = 0
            for sid in v.sessions:
                if i >= len(slots):
                    break
                if sid in v.arriving:
                    continue
                out.append(Migrate(sid, slots[i]))
                free[slots[i]] -= 1
                i += 1
                moved += 1
            if moved == len(v.sessions):
                out.append(Switch(d, Role.TRAIN))
            if i >= len(slots):
                break
        return out


POLICIES = ("colocated", "elastic", "async")


def policy_named(name: str, *, train_devices: int = 1, mean_group_s: float = 10.0) -> Policy:
    """The policy a config names: `colocated`, `elastic` (time constants scaled by the
    mean seconds of a work item) or `async` (`train_devices` fixed to training)."""
    if name == "colocated":
        return ColocatedPolicy()
    if name == "elastic":
        return ElasticPolicy.for_sessions(mean_group_s)
    if name == "async":
        return FixedSplitPolicy(n_train=train_devices)
    raise ValueError(f"unknown schedule policy {name!r} ({', '.join(POLICIES)})")
