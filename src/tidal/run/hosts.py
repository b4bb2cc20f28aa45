"""Rollout devices on a Ray cluster: `schedule.backend = "ray"` (docs/scale.md).

Each rollout device is a Ray actor, a `NodeHost`, in one bundle `{schedule.ray_resource:
1}` of a placement group spread over the cluster's nodes. A host is the rollout side of
a run on its node (`tidal.run.stack`): its own engine (the embedded engine on its
device), a gateway on its node's loopback that only its own sandboxes reach, the
sandboxes and harnesses of its sessions, and a ledger shard of its own
(`RUN_DIR/hosts/d<device>-<node>-<id>/ledger.db`; RUN_DIR is on a filesystem every node
sees).

The design is a gateway per node. Nothing a sandbox can reach is shared beyond its
node, and no model call crosses the network. When a task group ends, its host returns
the group's episodes with every call, outcome and session record, and the driver
appends them to the run's one ledger (`ClusterRollouts.group`). The ledger gets each
call once, when its group is done, before the step that trains it reads it. The driver
keeps the scheduler, the trainer (whose ranks may be Ray actors too, `train.nodes`) and
the held-out evaluation, on its own engine. After each optimizer step the trainer's
weights are written once to RUN_DIR/weights/vN and every host's engine loads them
(`ClusterEngine.update_weights`) before the next group starts.

Each session's node is recorded in its outcome's details (`node`), and every
`Episode` carries it, so each step's row counts sessions per node.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tidal.agent.preempt import GROUP_FILE
from tidal.agent.tasks import Task
from tidal.engine.base import Engine, Generation, SamplingParams, Weights, as_weights
from tidal.ledger import Call, LedgerStore, Outcome, SessionMeta
from tidal.run.cluster import ClusterError, connect
from tidal.run.config import RunConfig
from tidal.run.rollout import Episode, group_result
from tidal.schedule.backend import RolloutResult


@dataclass(frozen=True)
class HostSpec:
    """What a host builds on its node: the run's config and directory, the checkpoint
    its engine starts from and that checkpoint's policy version."""

    cfg: RunConfig
    run_dir: str
    weights_dir: str
    tokenizer_dir: str
    model_name: str
    policy_version: int
    device: int


@dataclass(frozen=True)
class GroupRecords:
    """A finished task group as a host returns it: its episodes, and every call, outcome
    and session record of their sessions (for the run's ledger)."""

    episodes: list[Episode]
    calls: list[Call]
    outcomes: list[Outcome]
    metas: dict[str, SessionMeta]


class NodeHost:
    """Body of one rollout device's Ray actor (wrapped with `ray.remote` by
    `ClusterRollouts.start`)."""

    def __init__(self, spec: HostSpec) -> None:
        import ray

        from tidal.engine.tiny import load_tokenizer
        from tidal.run import components
        from tidal.run.stack import build_stack

        cfg, run_dir = spec.cfg, Path(spec.run_dir)
        self.node = str(ray.get_runtime_context().get_node_id())
        self.engine = components.make_engine(
            cfg, Path(spec.weights_dir), device=components.resolve_device(cfg.model.device),
            policy_version=spec.policy_version, model_name=spec.model_name,
            tokenizer_dir=Path(spec.tokenizer_dir), run_dir=run_dir)
        self.shard = run_dir / "hosts" / f"d{spec.device}-{self.node[:8]}-{uuid.uuid4().hex[:6]}"
        self.shard.mkdir(parents=True, exist_ok=True)
        self.store = LedgerStore(self.shard / "ledger.db")
        agent = components.agent_config(cfg)
        self.stack = build_stack(
            cfg, engine=self.engine, tokenizer=load_tokenizer(Path(spec.tokenizer_dir)),
            store=self.store, run_dir=run_dir, harness=components.make_harness(cfg, agent),
            eval_harness=components.make_harness(cfg, replace(agent,
                                                              temperature=cfg.eval.temperature)),
            runtimes=components.make_runtimes(cfg), model_name=spec.model_name)

    def where(self) -> tuple[str, str, int]:
        """Its node's id, its ledger shard's directory and its process id."""
        return self.node, str(self.shard), os.getpid()

    def group(self, jobs: Sequence[tuple[Task, str]], metas: dict[str, SessionMeta],
              base_version: int, resume: str | None,
              adopt: Sequence[str] = ()) -> GroupRecords:
        """Run a task group here (`LiveRollouts.group`), and return its records. `adopt`:
        the shards of lost hosts that ran it before (`resume` is then its key): its
        records there are copied into this host's shard first, so the resumed episodes
        replay their recorded calls instead of sampling them again."""
        self.store.record_meta(metas)  # before it runs, as the driver recorded them
        if resume is not None and not (self.stack.live.episodes.root / resume / GROUP_FILE
                                       ).is_file():
            resume = None  # lost before it started: nothing of it was saved or recorded
        for shard in adopt:
            self._adopt(Path(shard), [sid for _t, sid in jobs])
        res = self.stack.live.group(jobs, base_version=base_version, resume=resume)
        episodes = [replace(e, node=self.node) for e in res.value]
        sids = [s for e in episodes for s in e.session_ids]
        calls = _calls_of(self.store, sids)
        got = self.store.outcomes(sids)
        outcomes = [replace(got[s], details={**got[s].details, "node": self.node})
                    for s in sids if s in got]
        return GroupRecords(episodes, calls, outcomes, self.store.session_meta(sids))

    def _adopt(self, shard: Path, mains: Sequence[str]) -> None:
        """The calls, outcomes and session records of `mains` and their subagents from a
        lost host's ledger shard (those this shard lacks)."""
        with LedgerStore(shard / "ledger.db", readonly=True) as old:
            sids = [s for m in mains if old.has_session(m) for s in old.episode_tree(m)]
            sids = [s for s in sids if not self.store.has_session(s)]
            calls = _calls_of(old, sids)
            outcomes = list(old.outcomes(sids).values())
            metas = old.session_meta(sids)
        self.store.record_meta(metas)
        self.store.append_records(calls, outcomes)

    def update_weights(self, directory: str, version: int) -> None:
        self.engine.update_weights(directory, version)

    def close(self) -> None:
        self.stack.close()
        self.engine.close()
        self.store.close()


def _calls_of(store: LedgerStore, session_ids: Sequence[str]) -> list[Call]:
    """Every call of the sessions, whole, in order (a main session before its subagents:
    a subagent's calls name its parent's)."""
    calls: list[Call] = []
    for sid in session_ids:
        log = store.call_log(sid)
        calls.extend(log.full_call(sc.call_id) for sc in log.calls)
    return calls


class ClusterRollouts:
    """The driver's side of the hosts: a `GroupRunner` (`tidal.run.live`) that runs each
    task group on the least busy host and appends what it returns to the run's ledger.
    Start with `start`; `close` stops the hosts (the cluster stays up)."""

    def __init__(self, hosts: list[Any], where: list[tuple[str, str, int]], store: LedgerStore,
                 placement: Any) -> None:
        self.hosts = hosts
        self.nodes = [w[0] for w in where]
        self.shards = [w[1] for w in where]
        self.store = store
        self._pg = placement
        self._busy = [0] * len(hosts)
        self._alive = [True] * len(hosts)
        self._lock = threading.Lock()
        self.lost: list[dict[str, Any]] = []  # one row per task group a lost host ran
        self._reported = 0

    @classmethod
    def start(cls, cfg: RunConfig, store: LedgerStore, spec: HostSpec) -> ClusterRollouts:
        """Start `schedule.devices` hosts spread over the nodes of the cluster at
        `schedule.ray_address`, each built from `spec` with its own device index. A
        `ClusterError` says what could not be placed."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        s = cfg.schedule
        connect(s.ray_address)  # checked before the run started (`check_run`)
        pg = placement_group([{s.ray_resource: 1}] * s.devices, strategy="SPREAD")
        ready, _ = ray.wait([pg.ready()], timeout=120)
        if not ready:
            raise ClusterError(f"Ray could not place {s.devices} rollout devices "
                               f"({{{s.ray_resource!r}: 1}} each) within 120 s")
        actor: Any = ray.remote(NodeHost)
        hosts = [actor.options(
            num_cpus=0, resources={s.ray_resource: 1}, max_concurrency=s.groups_per_device + 2,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=d)).remote(replace(spec, device=d))
            for d in range(s.devices)]
        return cls(hosts, ray.get([h.where.remote() for h in hosts]), store, pg)

    def group(self, jobs: Sequence[tuple[Task, str]], *, base_version: int,
              resume: str | None = None) -> RolloutResult:
        import ray
        from ray.exceptions import RayActorError

        metas = self.store.session_meta([sid for _t, sid in jobs])
        adopt: list[str] = []
        while True:
            d = self._take()
            t0 = time.perf_counter()
            try:
                rec: GroupRecords = ray.get(
                    self.hosts[d].group.remote(list(jobs), metas, base_version, resume, adopt))
                break
            except RayActorError as e:  # its node (or its process) is gone: resume elsewhere
                self._lose(d, e)
                resume = resume or jobs[0][1]  # a live group's key: its first session
                adopt.append(self.shards[d])
                self.lost.append({"node": self.nodes[d][:8], "group": resume,
                                  "ran_s": round(time.perf_counter() - t0, 3)})
            finally:
                with self._lock:
                    self._busy[d] -= 1
        self.store.record_meta(rec.metas)  # the subagents' (the driver's own stay)
        self.store.append_records(rec.calls, rec.outcomes)
        return group_result(rec.episodes, base_version)

    def _take(self) -> int:
        """The least busy live host, marked busy."""
        with self._lock:
            live = [i for i in range(len(self.hosts)) if self._alive[i]]
            if not live:
                raise ClusterError("every rollout host was lost: "
                                   + ", ".join(f"node {n[:8]}" for n in self.nodes))
            d = min(live, key=lambda i: self._busy[i])
            self._busy[d] += 1
            return d

    def _lose(self, d: int, error: Exception) -> None:
        """Host `d` is gone (once, however many of its groups report it): no group goes
        there again; the run goes on with the others."""
        import contextlib
        import warnings

        import ray

        with self._lock:
            if not self._alive[d]:
                return
            self._alive[d] = False
        warnings.warn(f"rollout host {d} on node {self.nodes[d][:8]} was lost "
                      f"({str(error).splitlines()[0][:200]}): its task groups resume on "
                      "the other hosts from their snapshots", stacklevel=2)
        with contextlib.suppress(Exception):
            ray.kill(self.hosts[d])

    def metrics(self) -> dict[str, Any]:
        """Hosts alive, and the task groups resumed elsewhere since the last call (each
        with the lost host's node and how long the group had run there)."""
        with self._lock:
            new, self._reported = self.lost[self._reported:], len(self.lost)
            alive = sum(self._alive)
        return {"hosts_alive": alive, **({"groups_resumed": new} if new else {})}

    def update_weights(self, directory: Path, version: int) -> None:
        import ray
        from ray.exceptions import RayActorError

        live = [i for i in range(len(self.hosts)) if self._alive[i]]
        refs = [self.hosts[i].update_weights.remote(str(directory), version) for i in live]
        for i, ref in zip(live, refs, strict=True):
            try:
                ray.get(ref)
            except RayActorError as e:
                self._lose(i, e)

    def close(self) -> None:
        import contextlib

        import ray
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):
            ray.get([h.close.remote() for h in self.hosts], timeout=60)
        for h in self.hosts:
            with contextlib.suppress(Exception):
                ray.kill(h)
        with contextlib.suppress(Exception):
            remove_placement_group(self._pg)


class ClusterEngine:
    """The driver's engine (held-out evaluation) and the hosts' engines as one `Engine`:
    sampling is the driver's; `update_weights` reaches every host too (the checkpoint
    written once under RUN_DIR/weights/, loaded by each host); `close` stops the hosts."""

    def __init__(self, local: Engine, cluster: ClusterRollouts) -> None:
        self.local, self.cluster = local, cluster

    @property
    def model_name(self) -> str:
        return self.local.model_name

    @property
    def policy_version(self) -> int:
        return self.local.policy_version

    @property
    def max_context(self) -> int:
        return self.local.max_context

    def generate(self, prompts: Sequence[Sequence[int] | npt.NDArray[np.int32]],
                 params: SamplingParams, *, session: str | None = None) -> list[Generation]:
        return self.local.generate(prompts, params, session=session)

    def forget(self, session: str) -> None:
        self.local.forget(session)

    def metrics(self) -> dict[str, Any]:
        return {**self.local.metrics(), **self.cluster.metrics()}

    def update_weights(self, source: Weights | str | Path, version: int) -> None:
        weights = as_weights(source)
        self.local.update_weights(weights, version)
        self.cluster.update_weights(weights.directory(), version)

    def close(self) -> None:
        try:
            self.cluster.close()
        finally:
            self.local.close()
