"""A Ray cluster for `tidal run` (`schedule.backend = "ray"`): connect, then check the
layout asked for before anything starts (docs/scale.md).

- no cluster at `schedule.ray_address`: `ClusterError` naming the address and how to
  start one;
- too few resources: `schedule.devices` rollout devices need that many bundles of
  `{schedule.ray_resource: 1}`, and trainer ranks placed on Ray (`train.nodes > 1`) need
  `train.world_size - 1` more (`GPU` on CUDA, else `CPU`); the error lists what each node
  has;
- every node that can hold a rollout device must have what its sessions need: bubblewrap
  (when `rollout.sandbox = "bwrap"`) and the model's checkpoint at the path the run
  loads it from (a filesystem every node sees, or the same path on each). Each node is
  asked by a Ray task pinned to it, so what is checked is that node's own view.

Ray is imported here only: `import tidal.run` never needs it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tidal.run.config import RunConfig


class ClusterError(RuntimeError):
    """The cluster cannot run the layout asked for; the message names what is missing."""


@dataclass(frozen=True)
class Node:
    """One alive node of the cluster: its id, address and resources."""

    node_id: str
    address: str
    resources: dict[str, float]

    @property
    def name(self) -> str:
        return f"{self.node_id[:8]} ({self.address})"


@dataclass(frozen=True)
class Layout:
    """What a run asks of the cluster. `trainer_ranks`: ranks placed as Ray actors (0
    when the trainer stays in the driver's process or on this machine)."""

    rollout_devices: int
    resource: str
    trainer_ranks: int
    trainer_resource: str
    model_dir: Path
    needs_bwrap: bool


def connect(address: str) -> None:
    """Join the Ray cluster at `address` ("auto": the one this machine belongs to),
    unless this process is connected already. The connection lasts as long as the
    process (the cluster stays up)."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    _reachable(address)  # ray.init waits on a dead address for minutes
    try:
        ray.init(address=address, log_to_driver=False, include_dashboard=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ClusterError(
            f"schedule.ray_address = {address!r}: no Ray cluster answers there "
            f"({str(e).splitlines()[0][:200]}); start one with `ray start --head` "
            "(docs/scale.md, \"A Ray cluster\")") from None


def _reachable(address: str, timeout_s: float = 5.0) -> None:
    """A HOST:PORT address (or ray://HOST:PORT) must accept a connection; "auto" is left
    to Ray (it fails at once when this machine is in no cluster)."""
    import socket

    if address == "auto":
        return
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(f"schedule.ray_address = {address!r} is neither \"auto\" nor "
                           "HOST:PORT (or ray://HOST:PORT)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ClusterError(
            f"schedule.ray_address = {address!r}: no Ray cluster answers there ({e}); start "
            "one with `ray start --head` (docs/scale.md, \"A Ray cluster\")") from None


def alive_nodes() -> list[Node]:
    import ray

    return [Node(n["NodeID"], n.get("NodeManagerAddress", "?"), dict(n["Resources"]))
            for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]


def check_resources(layout: Layout, nodes: list[Node]) -> None:
    """Enough of each resource for the layout, summed over alive nodes (a bundle of 1
    fits any node with 1 left), else `ClusterError` with each node's share."""
    need: dict[str, float] = {layout.resource: float(layout.rollout_devices)}
    if layout.trainer_ranks:
        res = layout.trainer_resource
        need[res] = need.get(res, 0.0) + layout.trainer_ranks
    for res, n in need.items():
        have = sum(int(node.resources.get(res, 0)) for node in nodes)
        if have < n:
            what = [f"schedule.devices = {layout.rollout_devices} rollout devices need "
                    f"{layout.rollout_devices} x {{{layout.resource!r}: 1}}"]
            if layout.trainer_ranks and layout.trainer_resource == res:
                what.append(f"{layout.trainer_ranks} trainer ranks on Ray need "
                            f"{layout.trainer_ranks} x {{{res!r}: 1}}")
            shares = ", ".join(f"{node.name}: {int(node.resources.get(res, 0))}"
                               for node in nodes)
            raise ClusterError(f"{'; '.join(what)}: the cluster has {have} {res!r} in all "
                               f"({shares}). Add nodes, or give them the resource "
                               f"(`ray start --resources='{{\"{res}\": N}}'`)")


def node_problems(model_dir: str, needs_bwrap: bool) -> list[str]:
    """What this node lacks for a rollout device (run on the node itself)."""
    problems = []
    if needs_bwrap:
        from tidal.sandbox.local import require_available
        from tidal.sandbox.types import SandboxUnavailableError

        try:
            require_available()
        except SandboxUnavailableError as e:
            problems.append(f"no sandbox: {e}")
    d = Path(model_dir)
    if not (d / "config.json").is_file() or not any(d.glob("*.safetensors")):
        problems.append(f"no model at {d} (config.json and *.safetensors): put the run's "
                        "model on a filesystem every node sees, or at the same path on each")
    return problems


def check_nodes(layout: Layout, nodes: list[Node], timeout_s: float = 120.0) -> None:
    """Ask every node that holds `layout.resource` what it lacks (`node_problems`, by a
    task pinned to it); `ClusterError` naming each node and what it lacks."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    hosts = [n for n in nodes if n.resources.get(layout.resource, 0) >= 1]
    task: Any = ray.remote(num_cpus=0)(node_problems)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                n.node_id, soft=False)).remote(str(layout.model_dir), layout.needs_bwrap)
            for n in hosts]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if len(ready) < len(refs):
        raise ClusterError(f"{len(refs) - len(ready)} of the cluster's nodes did not answer a "
                           f"check within {timeout_s:.0f} s")
    found = [f"node {n.name}: {p}" for n, ps in zip(hosts, ray.get(refs), strict=True)
             for p in ps]
    if found:
        raise ClusterError("nodes that would run rollouts lack what they need:\n  "
                           + "\n  ".join(found))


def check_cluster(layout: Layout) -> list[Node]:
    """The alive nodes, once the layout fits them and every rollout node has what it
    needs; `ClusterError` otherwise. Call after `connect`."""
    nodes = alive_nodes()
    check_resources(layout, nodes)
    check_nodes(layout, nodes)
    return nodes


def layout_of(cfg: RunConfig, model_dir: Path) -> Layout:
    """What `cfg` asks of the cluster (`schedule.devices` hosts, trainer ranks on Ray
    when `train.nodes > 1`), with the model every host loads."""
    from tidal.run.components import resolve_device

    s, t = cfg.schedule, cfg.train
    on_cuda = resolve_device(cfg.model.device).startswith("cuda")
    return Layout(rollout_devices=s.devices, resource=s.ray_resource,
                  trainer_ranks=t.world_size - 1 if t.nodes > 1 else 0,
                  trainer_resource="GPU" if on_cuda else "CPU",
                  model_dir=model_dir.resolve(), needs_bwrap=cfg.rollout.sandbox == "bwrap")


def check_run(cfg: RunConfig, model_dir: Path) -> list[Node]:
    """Before a run on a cluster starts: connect to `schedule.ray_address` and check
    the layout (`check_cluster`)."""
    connect(cfg.schedule.ray_address)
    return check_cluster(layout_of(cfg, model_dir))
