"""The local backend: devices are CPU slots on this machine.

Each device has `slots_per_device` workers. With `mode="process"` (the default) every
device owns a small process pool (forkserver), so a session that crashes its process
takes down only that device's pool: its sessions are reported `Failed(infra=True)` and
the device gets a fresh pool. With `mode="thread"` sessions run in threads of this
process (cheapest; use it when the work is I/O-bound, e.g. HTTP calls to a gateway).

A role switch runs the optional `on_switch(device, role)` hook in a thread (free or
load models there), then waits `switch_delay_s` (to emulate switch costs in demos).

With a `migrator` (thread mode), a live session can move to another device instead of
the scheduler draining its device (`migrate`): the migrator saves the session and stops
it, and the work it gives back continues it on the new device.
"""

from __future__ import annotations

import functools
import multiprocessing
import queue
import threading
import time
import traceback
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Literal

from tidal.schedule.backend import (
    BackendEvent,
    Failed,
    Finished,
    Migrated,
    Migrator,
    SessionContext,
    SwitchDone,
    SwitchHook,
    Work,
)
from tidal.schedule.types import Role


def _run_work(work: Work, ctx: SessionContext) -> Any:
    return work(ctx)


class LocalBackend:
    """`n_devices` devices x `slots_per_device` workers on this machine."""

    name = "local"

    def __init__(
        self,
        n_devices: int,
        slots_per_device: int = 1,
        *,
        mode: Literal["process", "thread"] = "process",
        on_switch: SwitchHook | None = None,
        switch_delay_s: float = 0.0,
        mp_context: str = "forkserver",
        migrator: Migrator | None = None,
    ) -> None:
        if n_devices < 1 or slots_per_device < 1:
            raise ValueError("need at least one device and one slot per device")
        if mode not in ("process", "thread"):
            raise ValueError(f"mode must be 'process' or 'thread', got {mode!r}")
        self._n = n_devices
        self._c = slots_per_device
        self.mode = mode
        self.on_switch = on_switch
        self.switch_delay_s = switch_delay_s
        self._ctx = multiprocessing.get_context(mp_context) if mode == "process" else None
        self._events: queue.Queue[BackendEvent] = queue.Queue()
        self._pools: list[Executor | None] = [None] * n_devices
        self._lock = threading.Lock()
        self._switcher: ThreadPoolExecutor | None = None
        self._live: dict[int, tuple[int, Future[Any]]] = {}  # session -> (device, future)
        self._works: dict[int, tuple[Work, SessionContext]] = {}
        self._moving: set[int] = set()  # sessions being migrated: their end is not theirs
        self.migrator = migrator
        if migrator is not None and mode != "thread":
            raise ValueError("migrating sessions needs mode='thread' (the migrator stops "
                             "work running in this process)")
        self._closed = False

    @property
    def can_migrate(self) -> bool:
        return self.migrator is not None

    @property
    def n_devices(self) -> int:
        return self._n

    @property
    def slots_per_device(self) -> int:
        return self._c

    def _new_pool(self, device: int) -> Executor:
        if self.mode == "thread":
            return ThreadPoolExecutor(max_workers=self._c,
                                      thread_name_prefix=f"tidal-device{device}")
        return ProcessPoolExecutor(max_workers=self._c, mp_context=self._ctx)

    def start(self) -> None:
        self._switcher = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tidal-switch")

    def _pool(self, device: int) -> Executor:
        with self._lock:
            p = self._pools[device]
            if p is None:
                p = self._pools[device] = self._new_pool(device)
            return p

    def launch(self, session: int, device: int, work: Work, ctx: SessionContext) -> None:
        if self._closed:
            raise RuntimeError("backend is closed")
        pool = self._pool(device)
        try:
            fut = pool.submit(_run_work, work, ctx)
        except BrokenProcessPool:
            self._replace_pool(device, pool)
            fut = self._pool(device).submit(_run_work, work, ctx)
        with self._lock:
            self._live[session] = (device, fut)
            self._works[session] = (work, ctx)
        fut.add_done_callback(functools.partial(self._done, session, device, pool))

    def migrate(self, session: int, src: int, dst: int) -> None:
        """Stop `session` on `src` (the migrator saves it) and continue it on `dst`."""
        assert self._switcher is not None, "start() the backend first"
        if self.migrator is None:
            raise RuntimeError("this backend has no migrator")
        migrator = self.migrator
        with self._lock:
            got = self._live.get(session)
            work, ctx = self._works[session]
            self._moving.add(session)
        if got is None:
            raise RuntimeError(f"session {session} is not running")

        def move() -> None:
            t = time.perf_counter()
            fut = got[1]
            migrator.preempt(work)
            exc = None
            try:
                fut.result()
            except BaseException as e:  # the preempted work's end, expected
                exc = e
            with self._lock:
                self._moving.discard(session)
                if exc is None:
                    self._live.pop(session, None)
                    self._works.pop(session, None)
            if exc is None:  # it had finished before it could be stopped
                self._events.put(Migrated(session, dst, time.perf_counter() - t))
                self._events.put(Finished(session, fut.result()))
                return
            resumed = migrator.resumed(work)
            self._events.put(Migrated(session, dst, time.perf_counter() - t))
            self.launch(session, dst, resumed, ctx)

        self._switcher.submit(move)

    def _replace_pool(self, device: int, broken: Executor) -> None:
        with self._lock:
            if self._pools[device] is broken:
                self._pools[device] = None
        broken.shutdown(wait=False, cancel_futures=True)

    def _done(self, session: int, device: int, pool: Executor, fut: Future[Any]) -> None:
        with self._lock:
            if session in self._moving:
                return  # `migrate` reports it
            if self._live.get(session, (None, None))[1] is fut:
                self._live.pop(session, None)
                self._works.pop(session, None)
        if fut.cancelled():
            self._events.put(Failed(session, "cancelled", infra=True))
            return
        exc = fut.exception()
        if exc is None:
            self._events.put(Finished(session, fut.result()))
        elif isinstance(exc, BrokenProcessPool):
            # the worker process died: every session on this device's pool fails
            self._replace_pool(device, pool)
            self._events.put(Failed(session, f"worker process died: {exc}", infra=True))
        else:
            tb = "".join(traceback.format_exception(exc))
            self._events.put(Failed(session, tb, infra=False))

    def set_role(self, device: int, role: Role) -> None:
        assert self._switcher is not None, "start() the backend first"

        def switch() -> None:
            t = time.perf_counter()
            try:
                if role is Role.TRAIN:
                    # the device leaves rollout: its worker processes are released
                    with self._lock:
                        pool, self._pools[device] = self._pools[device], None
                    if pool is not None:
                        pool.shutdown(wait=True)
                if self.on_switch is not None:
                    self.on_switch(device, role)
                if self.switch_delay_s:
                    time.sleep(self.switch_delay_s)
            finally:
                self._events.put(SwitchDone(device, role, time.perf_counter() - t))

        self._switcher.submit(switch)

    def poll(self, timeout: float) -> list[BackendEvent]:
        out: list[BackendEvent] = []
        try:
            first = self._events.get(timeout=timeout) if timeout > 0 else self._events.get_nowait()
            out.append(first)
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._closed = True
        with self._lock:
            pools, self._pools = self._pools, [None] * self._n
        for p in pools:
            if p is not None:
                p.shutdown(wait=False, cancel_futures=True)
        if self._switcher is not None:
            self._switcher.shutdown(wait=False, cancel_futures=True)
