"""The Ray backend: one actor per device, pinned to a placement-group bundle.

Each device is a bundle `{resource: 1}` of one placement group (default resource
name "GPU" on a real cluster; tests use a custom resource such as "tidal_gpu" so a
CPU-only cluster can stand in). The device's `DeviceActor` runs up to
`slots_per_device` sessions at once (a threaded actor) and performs role switches.

An actor that dies (node lost, OOM, `ray.kill`) fails every session it was running
with `Failed(infra=True)`; the scheduler then resumes them elsewhere (or ends them
as infra_error once retries are spent), and the backend starts a fresh actor in the
same bundle. Ray is imported lazily: `import tidal.schedule` never needs it.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from tidal.schedule.backend import (
    BackendEvent,
    Failed,
    Finished,
    SessionContext,
    SwitchDone,
    SwitchHook,
    Work,
)
from tidal.schedule.types import Role


class _DeviceActor:
    """Body of the Ray actor (wrapped with `ray.remote` at start)."""

    def __init__(self, device: int, on_switch: SwitchHook | None, delay: float) -> None:
        self.device = device
        self.role = Role.ROLLOUT
        self.on_switch = on_switch
        self.delay = delay

    def run(self, work: Work, ctx: SessionContext) -> Any:
        return work(ctx)

    def set_role(self, role: Role) -> float:
        t = time.perf_counter()
        if self.on_switch is not None:
            self.on_switch(self.device, role)
        if self.delay:
            time.sleep(self.delay)
        self.role = role
        return time.perf_counter() - t

    def pid(self) -> int:
        return os.getpid()


class RayBackend:
    """`n_devices` placement-group bundles of `{resource: 1}`, one actor each.

    `address=None` connects to a running Ray (``ray.init()`` already called, or
    `RAY_ADDRESS`), else starts nothing and fails; pass `init_kwargs` to start a local
    one (the backend then shuts it down on close).
    """

    name = "ray"

    def __init__(
        self,
        n_devices: int,
        slots_per_device: int = 1,
        *,
        resource: str = "GPU",
        strategy: str = "PACK",
        address: str | None = None,
        init_kwargs: dict[str, Any] | None = None,
        on_switch: SwitchHook | None = None,
        switch_delay_s: float = 0.0,
        ready_timeout_s: float = 120.0,
    ) -> None:
        if n_devices < 1 or slots_per_device < 1:
            raise ValueError("need at least one device and one slot per device")
        self._n = n_devices
        self._c = slots_per_device
        self.resource = resource
        self.strategy = strategy
        self.address = address
        self.init_kwargs = init_kwargs
        self.on_switch = on_switch
        self.switch_delay_s = switch_delay_s
        self.ready_timeout_s = ready_timeout_s
        self._owns_ray = False
        self._pg: Any = None
        self._cls: Any = None
        self.actors: list[Any] = []
        # ref -> (kind, session or device, device, actor generation)
        self._refs: dict[Any, tuple[str, int, int, int]] = {}
        self._gen: list[int] = []
        self._role_wanted: dict[Any, Role] = {}

    @property
    def n_devices(self) -> int:
        return self._n

    @property
    def slots_per_device(self) -> int:
        return self._c

    def start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group

        if not ray.is_initialized():
            if self.init_kwargs is None and self.address is None:
                ray.init()
            else:
                ray.init(address=self.address, **(self.init_kwargs or {}))
                self._owns_ray = self.address is None
        self._pg = placement_group([{self.resource: 1}] * self._n, strategy=self.strategy)
        ready, _ = ray.wait([self._pg.ready()], timeout=self.ready_timeout_s)
        if not ready:
            raise RuntimeError(
                f"placement group of {self._n} x {{{self.resource!r}: 1}} not ready after "
                f"{self.ready_timeout_s}s: does the cluster have that many?"
            )
        self._cls = ray.remote(_DeviceActor)
        self.actors = [self._new_actor(d) for d in range(self._n)]
        self._gen = [0] * self._n

    def _new_actor(self, device: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return self._cls.options(
            num_cpus=0,
            resources={self.resource: 1},
            max_concurrency=self._c + 1,  # + 1 for set_role while sessions drain
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._pg, placement_group_bundle_index=device
            ),
        ).remote(device, self.on_switch, self.switch_delay_s)

    def launch(self, session: int, device: int, work: Work, ctx: SessionContext) -> None:
        ref = self.actors[device].run.remote(work, ctx)
        self._refs[ref] = ("run", session, device, self._gen[device])

    def set_role(self, device: int, role: Role) -> None:
        ref = self.actors[device].set_role.remote(role)
        self._refs[ref] = ("switch", device, device, self._gen[device])
        self._role_wanted[ref] = role

    def poll(self, timeout: float) -> list[BackendEvent]:
        import ray
        from ray.exceptions import RayActorError

        if not self._refs:
            time.sleep(timeout)
            return []
        ready, _ = ray.wait(list(self._refs), num_returns=len(self._refs), timeout=timeout)
        if not ready:
            return []
        out: list[BackendEvent] = []
        dead: set[int] = set()
        for ref in ready:
            kind, key, device, gen = self._refs.pop(ref)
            try:
                value = ray.get(ref)
            except RayActorError as e:
                if gen == self._gen[device]:
                    dead.add(device)
                if kind == "run":
                    out.append(Failed(key, f"actor of device {device} died: {e}", infra=True))
                else:  # the device is empty (switching): a fresh actor takes its role
                    out.append(SwitchDone(device, self._role_wanted.pop(ref), 0.0))
                continue
            except Exception as e:
                if kind == "run":
                    out.append(Failed(key, repr(e), infra=False))
                else:
                    out.append(SwitchDone(device, self._role_wanted.pop(ref), 0.0))
                continue
            if kind == "run":
                out.append(Finished(key, value))
            else:
                out.append(SwitchDone(device, self._role_wanted.pop(ref), float(value)))
        for d in dead:
            self._restart(d)
        return out

    def _restart(self, device: int) -> None:
        """A dead device gets a fresh actor in its bundle (once, however many of its
        sessions reported the death)."""
        import ray

        old = self.actors[device]
        with contextlib.suppress(Exception):
            ray.kill(old)
        self.actors[device] = self._new_actor(device)
        self._gen[device] += 1

    def kill_device(self, device: int) -> None:
        """Kill a device's actor now (tests and chaos drills): its sessions fail."""
        import ray

        ray.kill(self.actors[device], no_restart=True)

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
        self.actors = []
        self._refs.clear()
        if self._pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
            self._pg = None
        if self._owns_ray:
            ray.shutdown()
