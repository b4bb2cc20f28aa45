"""What a scheduler backend is: the `Backend` protocol, work items and their results.

A backend owns the devices (CPU slots locally, placement-group bundles on Ray); the
`Scheduler` tells it what to run where and when a device changes role, and polls it
for what happened. Backends know nothing about policies, batches or staleness.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tidal.schedule.types import Role


@dataclass(frozen=True)
class SessionContext:
    """Handed to a work function that asks for it (`Work(..., pass_context=True)`).

    `policy_version` is the version the scheduler had published when the session
    started; a real session reports the version of its oldest token instead (the
    gateway records one per call)."""

    session: int
    device: int
    policy_version: int
    attempt: int


@dataclass(frozen=True)
class Work:
    """One rollout: `fn(*args, **kwargs)` runs one agent session.

    `fn` must be picklable (a module-level function) for the process and Ray backends.
    With `pass_context=True` it is called with `ctx=SessionContext(...)` as well.
    It returns a `RolloutResult`, or any value (then the policy version is the one at
    start and the token count 0).
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    pass_context: bool = False

    def __call__(self, ctx: SessionContext) -> Any:
        if self.pass_context:
            return self.fn(*self.args, ctx=ctx, **self.kwargs)
        return self.fn(*self.args, **self.kwargs)


@dataclass(frozen=True)
class RolloutResult:
    """What a work function returns: its value, the policy version of its oldest token
    and the number of tokens it will train (for metrics and train-cost estimates)."""

    value: Any
    policy_version: int | None = None
    tokens: int = 0


# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Finished:
    session: int
    result: Any  # what the work function returned


@dataclass(frozen=True)
class Failed:
    """The session did not end normally. `infra` is True when its worker died (actor
    killed, process crashed): then it may be retried; False for an exception raised by
    the work function itself."""

    session: int
    error: str
    infra: bool = True


@dataclass(frozen=True)
class SwitchDone:
    device: int
    role: Role
    seconds: float


@dataclass(frozen=True)
class Migrated:
    """A live session moved to `device` (`Backend.migrate`): stopped and saved where it
    ran, continuing there, in `seconds` (stop + save; the resumed work restores and
    fast-forwards itself on its new device)."""

    session: int
    device: int
    seconds: float


BackendEvent = Finished | Failed | SwitchDone | Migrated


class Migrator(Protocol):
    """What moving a live session needs from the one who made its work (`tidal run`'s
    rollouts: `tidal.run.live.RolloutMigrator`): stop it after saving its state, and
    the work that continues it from that state."""

    def preempt(self, work: Work) -> None:
        """Save the session's state and make its running `work` end soon (it raises)."""
        ...

    def resumed(self, work: Work) -> Work:
        """The work that continues `work` from its saved state, on any device."""
        ...


class Backend(Protocol):
    """The interface both backends implement (see `local.py`, `ray_backend.py`)."""

    @property
    def name(self) -> str: ...

    @property
    def n_devices(self) -> int: ...

    @property
    def slots_per_device(self) -> int: ...

    def start(self) -> None:
        """Acquire the devices (start workers, create the placement group)."""
        ...

    def launch(self, session: int, device: int, work: Work, ctx: SessionContext) -> None:
        """Run `work` on `device`, without blocking; report `Finished` or `Failed`."""
        ...

    def set_role(self, device: int, role: Role) -> None:
        """Switch `device` to `role`, without blocking; report `SwitchDone`. Called only
        on a device with no live session."""
        ...

    def poll(self, timeout: float) -> list[BackendEvent]:
        """Events since the last poll; waits up to `timeout` seconds for the first."""
        ...

    def close(self) -> None:
        """Release the devices; sessions still running are abandoned."""
        ...

    # A backend that can move live sessions also has `can_migrate = True` and
    # `migrate(session, src, dst)`: without blocking, stop the session on `src` and
    # continue it on `dst`; report `Migrated`, then its `Finished` or `Failed` as usual.


SwitchHook = Callable[[int, Role], None]
"""Called by a backend when a device changes role (e.g. free the inference engine's
memory before the trainer loads). Runs in a worker thread or actor."""
