"""`tidal run` on a real multi-node Ray cluster on this machine (`schedule.backend =
"ray"`, docs/scale.md): a head and two worker nodes, separate raylets started by Ray's
own `ray.cluster_utils.Cluster`, each worker with one `tidal_gpu` standing in for a GPU
and one CPU. The rollout devices are hosts on the worker nodes (their own engine,
gateway, sandboxes and ledger shard); every call lands once in the run's one ledger.
And the errors a user gets before anything starts."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from tests.run.clusters import (  # noqa: E402
    actor_nodes,
    hosts_running,
    start_cluster,
    stop_cluster,
)
from tests.run.loop_runs import small_config  # noqa: E402
from tidal.gateway.verify import verify_store  # noqa: E402
from tidal.ledger import LedgerStore  # noqa: E402
from tidal.run.cluster import (  # noqa: E402
    ClusterError,
    Layout,
    alive_nodes,
    check_cluster,
    node_problems,
)
from tidal.run.config import parse_config  # noqa: E402
from tidal.run.loop import RunError, run  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Cluster, list[str]]]:
    """A head (no tidal_gpu) and two workers with {tidal_gpu: 1, CPU: 1} each; this
    process is connected to it. Yields the cluster and the workers' node ids."""
    c, workers = start_cluster(workers=2)
    try:
        yield c, workers
    finally:
        stop_cluster(c)


def _config(**over: dict[str, object]) -> dict[str, Any]:
    cfg: dict[str, Any] = small_config(
        tasks={"name": "digits", "train_size": 4, "heldout_size": 1},
        rollout={"context_budget": 4096, "group_size": 2, "tasks_per_step": 2},
        warmstart={"steps": 4}, rl={"steps": 2},
        schedule={"backend": "ray", "ray_resource": "tidal_gpu", "devices": 2,
                  "policy": "colocated"})
    for k, v in over.items():
        cfg.setdefault(k, {}).update(v)
    return cfg


def test_sessions_run_on_both_worker_nodes_and_land_once_in_one_ledger(
        cluster: tuple[Cluster, list[str]], tmp_path: Path) -> None:
    _c, workers = cluster
    out = tmp_path / "run"
    # trainer rank 1 a Ray actor in a placement group of its own (`train.nodes = 2`)
    summary = run(parse_config(_config(train={"world_size": 2, "nodes": 2})), out)
    assert summary["verify_ok"] and summary["drift_tokens"] == 0, summary
    with LedgerStore(out / "ledger.db", readonly=True) as store:
        metas, outcomes = store.session_meta(), store.outcomes()
        rl = [s for s, m in metas.items() if m.phase == "rl"]
        # each RL session ran on a worker node, recorded in its outcome; both ran some
        nodes = {outcomes[s].details["node"] for s in rl}
        assert nodes == set(workers), (nodes, workers)
        calls = [sc.call.call_id for sc in store.iter_calls()]
        assert len(calls) == len(set(calls))  # each call once
        assert verify_store(store).ok
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["phase"] == "rl"]
    assert len(steps) == 2 and all(r["world_size"] == 2 for r in steps)
    for r in steps:  # the step row counts sessions per node
        per = r["sessions_per_node"]
        assert set(per) <= {w[:8] for w in workers} and sum(per.values()) == 4, per
    # each host kept a ledger shard of its own under RUN_DIR/hosts
    assert len(list((out / "hosts").glob("d*/ledger.db"))) == 2


def test_too_few_devices_is_named_before_anything_starts(
        cluster: tuple[Cluster, list[str]], tmp_path: Path) -> None:
    with pytest.raises(RunError, match=r"schedule.devices = 3 rollout devices need 3 x "
                       r"\{'tidal_gpu': 1\}: the cluster has 2 'tidal_gpu'"):
        run(parse_config(_config(schedule={"devices": 3})), tmp_path / "run")
    assert not (tmp_path / "run" / "config.toml").exists()


def test_a_node_without_the_model_is_named(cluster: tuple[Cluster, list[str]],
                                           tmp_path: Path) -> None:
    _c, workers = cluster
    layout = Layout(rollout_devices=2, resource="tidal_gpu", trainer_ranks=0,
                    trainer_resource="CPU", model_dir=tmp_path / "nowhere", needs_bwrap=True)
    with pytest.raises(ClusterError) as e:
        check_cluster(layout)
    for w in workers:  # each node that would run rollouts, by name
        assert f"node {w[:8]}" in str(e.value) and "no model at" in str(e.value)
    assert node_problems(str(tmp_path), needs_bwrap=False) != []
    assert len(alive_nodes()) == 3


def test_no_cluster_at_the_address_is_named(tmp_path: Path) -> None:
    """In a process of its own (this one is connected): a closed port."""
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("from tidal.run.cluster import connect, ClusterError\n"
            "try:\n"
            f"    connect('127.0.0.1:{port}')\n"
            "except ClusterError as e:\n"
            "    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False, timeout=120, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert f"schedule.ray_address = '127.0.0.1:{port}': no Ray cluster answers there" \
        in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_a_node_lost_mid_step_costs_no_session(cluster: tuple[Cluster, list[str]],
                                                tmp_path: Path) -> None:
    """The worker node holding trainer rank 1 (a Ray actor, `train.nodes = 2`) and a
    rollout host removed (its raylet and every process on it killed) while the host's
    task group runs: the group resumes on the other node from its snapshot, with the
    calls it had recorded replayed; the next step runs from the last checkpoint on the
    one rank left; the run finishes with every RL session trained once, each call
    recorded once, and `tidal verify` ok. Runs last in this module: it adds a worker back
    for whatever runs after."""
    import threading
    import time

    c, workers = cluster
    out = tmp_path / "run"
    cfg = parse_config(_config(rl={"steps": 3}, rollout={"snapshot_every": 1},
                               train={"world_size": 2, "nodes": 2}))
    got: dict[str, object] = {}

    def go() -> None:
        try:
            got["summary"] = run(cfg, out)
        except BaseException as e:  # the test thread reports it
            got["error"] = e

    t = threading.Thread(target=go)
    t.start()
    deadline, victim = time.time() + 600, None
    while time.time() < deadline and t.is_alive() and victim is None:
        ranks = actor_nodes("_RankActor")
        victim = next(iter(ranks & hosts_running(out)), None)
        time.sleep(0.05)
    assert victim is not None, got
    (node,) = [n for n in c.worker_nodes if n.node_id.startswith(victim)]
    c.remove_node(node, allow_graceful=False)
    t.join(timeout=900)
    c.add_node(num_cpus=1, resources={"tidal_gpu": 1})
    assert "error" not in got, got.get("error")
    summary = got["summary"]
    assert isinstance(summary, dict) and summary["verify_ok"] and summary["steps"] == 3
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # the engine's figures: flat in a step's row, under "engine" in an evaluation's
    engine = [r if r["phase"] == "rl" else r.get("engine", {}) for r in rows]
    resumed = [g for r in engine for g in r.get("groups_resumed", ())]
    assert resumed and {g["node"] for g in resumed} == {victim}, resumed
    steps = [r for r in rows if r["phase"] == "rl"]
    assert steps[-1]["hosts_alive"] == 1 and steps[-1]["world_size"] == 1
    (lost,) = [r for r in rows if r["phase"] == "trainer_lost"]
    assert lost["world_size_before"] == 2 and lost["world_size"] == 1, lost
    with LedgerStore(out / "ledger.db", readonly=True) as store:
        calls = [sc.call.call_id for sc in store.iter_calls()]
        assert len(calls) == len(set(calls))  # none twice
        metas, outcomes = store.session_meta(), store.outcomes()
        rl = [s for s, m in metas.items() if m.phase == "rl" and m.parent is None]
        assert all(s in outcomes for s in rl)  # none lost
        assert verify_store(store).ok
        # the resumed groups' sessions ended on the surviving node
        survivor = {w[:8] for w in workers} - {victim}
        for g in resumed:
            assert outcomes[g["group"]].details["node"][:8] in survivor
        state = json.loads((out / "checkpoint" / "state.json").read_text())
        trained = state["trained_sessions"]
        assert len(trained) == len(set(trained))  # each trained once
        assert set(rl) <= set(trained) | set(state["dropped_sessions"])
