"""A multi-node Ray cluster on this machine, for tests/run/test_cluster.py and
bench/cluster.py: a head and worker nodes, separate raylets started by Ray's own
`ray.cluster_utils.Cluster`, each worker with one `tidal_gpu` standing in for a GPU and
one CPU; and which node runs a live task group of a `tidal run` on it."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from tidal.ledger import LedgerStore

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray
from ray.cluster_utils import Cluster

_saved_tmpdir: list[str | None] = []


def start_cluster(workers: int) -> tuple[Cluster, list[str]]:
    """A head (no CPU, no tidal_gpu) and `workers` nodes of {tidal_gpu: 1, CPU: 1}; this
    process connected to it. Returns the cluster and the workers' node ids."""
    tmp = tempfile.mkdtemp(prefix="tcl", dir="/tmp")  # short: Ray's socket paths
    # Ray writes the cluster's address to $RAY_TMPDIR/ray/ray_current_cluster, where a
    # plain `ray.init()` finds it: here, not in /tmp/ray, where another test's would
    _saved_tmpdir.append(os.environ.get("RAY_TMPDIR"))
    os.environ["RAY_TMPDIR"] = tmp
    (Path(tmp) / "ray").mkdir()
    c = Cluster(initialize_head=True, head_node_args={  # no CPU: Ray actors go to workers
        "num_cpus": 0, "include_dashboard": False, "temp_dir": tmp})
    nodes = [c.add_node(num_cpus=1, resources={"tidal_gpu": 1}) for _ in range(workers)]
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    return c, [n.node_id for n in nodes]


def stop_cluster(c: Cluster) -> None:
    ray.shutdown()
    c.shutdown()  # type: ignore[no-untyped-call]
    old = _saved_tmpdir.pop()
    if old is None:
        os.environ.pop("RAY_TMPDIR", None)
    else:
        os.environ["RAY_TMPDIR"] = old


def hosts_running(out: Path) -> set[str]:
    """The nodes (8 characters of each id) of hosts whose live task group has a sandbox
    snapshot, once a step is checkpointed; empty before then."""
    state = out / "checkpoint" / "state.json"
    try:
        if not state.exists() or json.loads(state.read_text())["step"] < 1:
            return set()
        keys = [d.name for d in (out / "live").iterdir() if any(d.glob("*.tar"))]
    except (OSError, ValueError):
        return set()  # a file replaced or a group closed while it was read
    nodes = set()
    for shard in (out / "hosts").glob("d*/ledger.db"):
        with LedgerStore(shard, readonly=True) as store:
            if any(store.has_session(k) for k in keys):
                nodes.add(shard.parent.name.split("-")[1])
    return nodes


def actor_nodes(class_name: str) -> set[str]:
    """The nodes (8 characters of each id) of the alive actors of `class_name`."""
    actors = ray.state.actors()
    return {a["Address"]["NodeID"][:8] for a in actors.values()
            if a["ActorClassName"].endswith(class_name) and a["State"] == "ALIVE"}
