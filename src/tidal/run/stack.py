"""The rollout side of a run on one machine: engine -> gateway -> sandboxes -> ledger.

`build_stack` wires what episodes run through, given an engine and a ledger: the gateway
(every request seeded from the run's seed, each episode's harness with a key of its own),
the live-episode saver (`RUN_DIR/live`: snapshots, so a killed run resumes its groups),
and the `Rollouts` of RL and of evaluation. `tidal run` builds one in its own process
(`tidal.run.loop`); on a Ray cluster every rollout device builds one on its node
(`tidal.run.hosts`), with a ledger shard of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from tidal.agent.environment import TaskRuntimes
from tidal.agent.episode import Harness
from tidal.agent.preempt import LiveEpisodes, SnapshotPolicy
from tidal.engine.base import Engine
from tidal.gateway.access import SessionKeys
from tidal.gateway.server import GatewayServer
from tidal.ledger import LedgerStore
from tidal.run.config import RunConfig
from tidal.run.live import LiveRollouts
from tidal.run.rollout import Rollouts, seed_key
from tidal.sandbox.types import Bind


@dataclass(frozen=True)
class Stack:
    """A started gateway and what runs episodes through it. `live`: RL's task groups,
    saved as they run; `evals`: held-out episodes (the evaluation harness)."""

    gateway: GatewayServer
    rollouts: Rollouts
    live: LiveRollouts
    evals: Rollouts

    def close(self) -> None:
        self.live.episodes.close()
        self.gateway.stop()


def build_stack(cfg: RunConfig, *, engine: Engine, tokenizer: PreTrainedTokenizerBase,
                store: LedgerStore, run_dir: Path, harness: Harness, eval_harness: Harness,
                runtimes: TaskRuntimes, model_name: str) -> Stack:
    """The gateway on `engine` recording into `store`, started, and the rollouts that run
    episodes through it (harness logs in RUN_DIR/harness, live groups in RUN_DIR/live)."""
    # every request seeded from (run seed, session, call): `tidal.gateway.core.call_seed`
    # each episode's harness gets a key of its own, good for its own sessions only
    keys = SessionKeys()
    gateway = GatewayServer(engine, tokenizer, store, tool_parsers=cfg.engine.tool_parser or None,
                            lenient_tool_parsing=not cfg.engine.tool_parser_strict,
                            seed=cfg.seed, seed_key=seed_key, access=keys)
    url = gateway.start()
    outside = cfg.agent.harness == "builtin"  # harnesses inside the sandbox reach the gateway
    try:
        runtimes = runtimes.with_access(() if outside else (gateway.port,),
                                        tuple(Bind.parse(m) for m in cfg.agent.mounts))
    except BaseException:
        gateway.stop()
        raise
    # live task groups saved as they run, so a killed run resumes their episodes
    live = LiveEpisodes(run_dir / "live", store, gateway.gateway, runtimes,
                        SnapshotPolicy(cfg.rollout.snapshot_every, cfg.rollout.snapshot_every_s))
    gateway.gateway.on_record.append(live.note_call)
    gateway.gateway.on_forget.append(engine.forget)  # a server pool drops the session's pin
    rollouts = Rollouts(
        url, model_name, harness, runtimes, store, default_time_limit_s=cfg.tasks.time_limit_s,
        time_limit_s=cfg.agent.timeout_sec or None, log_dir=run_dir / "harness",
        forget=gateway.gateway.forget_session, keys=keys,
    )
    return Stack(gateway, rollouts, LiveRollouts(rollouts, live, keep=True),
                 replace(rollouts, harness=eval_harness))
