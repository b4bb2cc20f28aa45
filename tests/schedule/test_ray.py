"""The Ray backend on a local Ray cluster (one per module): actors in placement-group
bundles of a custom resource standing in for GPUs, role switches, and an actor killed
mid-rollout whose sessions are resumed (or end as infra_error), nothing lost."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")

from tests.schedule.sessions import sleep_session  # noqa: E402
from tidal.schedule.backend import Work  # noqa: E402
from tidal.schedule.policy import ElasticPolicy, FixedSplitPolicy  # noqa: E402
from tidal.schedule.ray_backend import RayBackend  # noqa: E402
from tidal.schedule.scheduler import Scheduler  # noqa: E402
from tidal.schedule.types import PoolConfig  # noqa: E402

from .test_local import assert_no_switch_interrupted_a_session  # noqa: E402

GPUS = 4
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    tmp = tempfile.mkdtemp(prefix="tray", dir="/tmp")  # short: Ray's socket paths
    ray.init(
        num_cpus=2,
        resources={"tidal_gpu": GPUS},
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=tmp,
    )
    yield
    ray.shutdown()


def backend(c: int = 2) -> RayBackend:
    return RayBackend(GPUS, c, resource="tidal_gpu", switch_delay_s=0.02)


def test_devices_are_placement_group_bundles_of_the_custom_resource(tmp_path: Path) -> None:
    cfg = PoolConfig(n_devices=GPUS, slots_per_device=2, batch_size=4, max_staleness=1,
                     rate_window_s=0.5)
    log = tmp_path / "sessions.log"
    be = backend()
    sched = Scheduler(be, ElasticPolicy.for_sessions(0.3), cfg, trace=True)
    with sched:
        assert ray.available_resources().get("tidal_gpu", 0) == 0  # all 4 held
        pids = ray.get([a.pid.remote() for a in be.actors])
        assert len(set(pids)) == GPUS  # one actor process per device
        sched.submit_many(
            Work(sleep_session, (0.1 + 0.1 * (i % 4), 7), {"log": str(log)}, pass_context=True)
            for i in range(16)
        )
        seen: list[int] = []
        sched.run_training(lambda mb: seen.extend(s.staleness for s in mb.samples), timeout=60)
        m = sched.metrics()
    assert m["backend"] == "ray"
    assert len(seen) + len(m["dropped_sessions"]) == 16 and all(s <= 1 for s in seen)
    assert m["role_switches"]["to_train"] >= 1
    assert_no_switch_interrupted_a_session(sched, log)
    time.sleep(0.5)
    assert ray.available_resources().get("tidal_gpu", 0) == GPUS  # released on close


def _run_and_kill(max_retries: int) -> tuple[Scheduler, dict[int, object], list[int]]:
    cfg = PoolConfig(n_devices=GPUS, slots_per_device=2, batch_size=4, max_staleness=2)
    be = backend()
    sched = Scheduler(be, FixedSplitPolicy(n_train=1), cfg, max_retries=max_retries)
    values: dict[int, object] = {}
    with sched:
        ids = sched.submit_many(Work(sleep_session, (1.0,), pass_context=True) for _ in range(8))
        # wait until device 0 runs sessions, then kill its actor mid-rollout
        sched.wait_until(lambda s: len(s.pool.view(0).sessions) == 2, timeout=60)
        victims = list(sched.pool.view(0).sessions)
        time.sleep(0.3)
        be.kill_device(0)
        sched.run_training(lambda mb: values.update({s.session: s.value for s in mb.samples}),
                           timeout=120)
    assert len(ids) == 8
    return sched, values, victims


def test_actor_killed_mid_rollout_its_sessions_are_resumed() -> None:
    sched, values, victims = _run_and_kill(max_retries=1)
    m = sched.metrics()
    assert m["sessions"]["requeued"] == len(victims) == 2
    assert set(values) == set(range(8))  # nothing lost: every session trained
    for v in victims:
        assert sched.pool.sessions[v].attempts == 2
    assert m["failed_sessions"] == []


def test_actor_killed_without_retries_its_sessions_end_as_infra_error() -> None:
    sched, values, victims = _run_and_kill(max_retries=0)
    failed = sched.failed()
    assert sorted(f.session for f in failed) == sorted(victims)
    assert all(f.status.value == "infra_error" and "died" in f.error for f in failed)
    assert set(values) | set(victims) == set(range(8))  # the rest trained, none lost
