"""Live-session migration on the local backend: `migrate` stops a session where it runs
(its migrator saves it), continues it on another device from what was saved, and reports
`Migrated` before the session's own end; the scheduler accepts migration only from a
backend that can."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tidal.schedule.backend import Finished, Migrated, SessionContext, Work
from tidal.schedule.local import LocalBackend
from tidal.schedule.policy import ElasticPolicy
from tidal.schedule.scheduler import Scheduler
from tidal.schedule.types import PoolConfig


class Stopped(Exception):  # noqa: N818 - what a stopped work raises
    pass


class Counter:
    """Work that counts to `n`, saving its count; a preempted one raises at its next
    step, and the resumed one goes on from the saved count."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.saved: dict[str, int] = {}
        self.stop: set[str] = set()
        self.steps: list[tuple[str, int, str]] = []  # (key, i, thread)
        self.lock = threading.Lock()

    def run(self, key: str, resume: bool = False) -> int:
        i = self.saved.get(key, 0) if resume else 0
        while i < self.n:
            with self.lock:
                if key in self.stop:
                    self.saved[key] = i
                    raise Stopped(key)
                self.steps.append((key, i, threading.current_thread().name))
            i += 1
            time.sleep(0.01)
        return i

    # the Migrator protocol
    def preempt(self, work: Work) -> None:
        with self.lock:
            self.stop.add(work.args[0])

    def resumed(self, work: Work) -> Work:
        with self.lock:
            self.stop.discard(work.args[0])
        return Work(self.run, work.args, {"resume": True})


def _events(backend: LocalBackend, want: int, timeout: float = 30.0) -> list[Any]:
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(out) < want and time.monotonic() < deadline:
        out += backend.poll(0.1)
    return out


def test_a_migrated_session_continues_on_its_new_device_from_what_it_saved() -> None:
    counter = Counter(60)
    backend = LocalBackend(2, 1, mode="thread", migrator=counter)
    backend.start()
    try:
        work = Work(counter.run, ("g0",))
        backend.launch(7, 0, work, SessionContext(7, 0, 0, 1))
        while len(counter.steps) < 10:
            time.sleep(0.01)
        backend.migrate(7, 0, 1)
        events = _events(backend, 2)
    finally:
        backend.close()
    assert [type(e) for e in events] == [Migrated, Finished]
    assert events[0].session == 7 and events[0].device == 1 and events[0].seconds >= 0
    assert events[1].result == 60
    counts = [i for _k, i, _t in counter.steps]
    assert counts == list(range(60))  # every step once: nothing redone, nothing skipped
    threads = [t for _k, _i, t in counter.steps]
    assert len(set(threads)) == 2  # it ran on two devices' workers


def test_a_session_that_ends_before_it_can_be_stopped_is_reported_once() -> None:
    counter = Counter(1)
    backend = LocalBackend(2, 1, mode="thread", migrator=counter)
    backend.start()
    try:
        backend.launch(3, 0, Work(counter.run, ("g1",)), SessionContext(3, 0, 0, 1))
        time.sleep(0.2)  # long finished
        events = _events(backend, 1)
    finally:
        backend.close()
    assert [type(e) for e in events] == [Finished]


def test_migration_needs_a_backend_that_can_and_thread_mode() -> None:
    with pytest.raises(ValueError, match="cannot migrate live sessions"):
        Scheduler(LocalBackend(2, 1, mode="thread"), ElasticPolicy(),
                  PoolConfig(n_devices=2, batch_size=2, slots_per_device=1, migration=True))
    with pytest.raises(ValueError, match="mode='thread'"):
        LocalBackend(2, 1, mode="process", migrator=Counter(1))
    ok = Scheduler(LocalBackend(2, 1, mode="thread", migrator=Counter(1)), ElasticPolicy(),
                   PoolConfig(n_devices=2, batch_size=2, slots_per_device=1, migration=True))
    assert ok.config.migration
