"""`tidal run`: the whole RL loop as one recipe.

    build        model + tokenizer, engine, ledger, gateway, tasks, harness, trainer
    warm start   SFT on the tasks' demonstrations (when there are any)
    reference    rl.kl_coef > 0: the warm-started policy, frozen, for the KL term
    evaluate     held-out tasks                           -> success_rate_start
    RL           for each step:
                   roll out task groups through the gateway   (sandbox + harness + engine -> ledger)
                   rebuild trees, sample paths, advantages    (tidal.tree)
                   tree-packed PPO/GRPO step                   (tidal.train)
                   push weights to the engine, new version    (checkpoint, metrics)
    summary      held-out again -> success_rate_end, `tidal verify`, summary.json

Every component is chosen by name in `tidal.run.components` (task source, harness,
sandbox runtime, engine, scheduler backend, trainer); this file only wires them. The
trainer (`tidal.train.group.TrainerGroup`: one rank in this process, or FSDP2 ranks)
and the engine hold two copies of the same weights; after each update the engine gets
the trainer's full weights (gathered from the ranks, LoRA merged) and version through
`Engine.update_weights` (in process for the embedded engine; a checkpoint for vLLM
servers, which restart on it). Rollouts go through the
elastic scheduler (`tidal.schedule`): task groups are its work items, a full batch of
groups is one step, and the policy (`schedule.policy`) decides whether rollouts and
training overlap (elastic, the default; async) within the staleness bound
`rl.max_staleness`, or alternate (colocated).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from tidal.agent.environment import TaskRuntimes
from tidal.agent.episode import Harness
from tidal.agent.preempt import LiveEpisodes, LiveGroup
from tidal.agent.tasks import Demonstration, Task, TaskError, taught
from tidal.engine.base import Engine
from tidal.engine.tiny import ensure_tiny, load_tokenizer, resolve_model
from tidal.gateway.server import GatewayServer
from tidal.gateway.verify import verify_store
from tidal.ledger import LedgerStore, SessionMeta
from tidal.run import components
from tidal.run.checkpoint import RunState, find_checkpoint, load_state, save_checkpoint
from tidal.run.cluster import ClusterError
from tidal.run.config import RunConfig, dump_config
from tidal.run.live import GroupRunner, LiveRollouts, RolloutMigrator
from tidal.run.loggers import LoggerError, LogStart
from tidal.run.names import ComponentError, is_attr, load_attr
from tidal.run.progress import RunLog
from tidal.run.queue import Batch, RolloutQueue, TaskDraws, close_sessions, cpu_seconds
from tidal.run.rollout import (
    Episode,
    Rollouts,
    new_session_id,
)
from tidal.run.stack import build_stack
from tidal.run.stop import deferred
from tidal.schedule.curriculum import record_groups, sample_batch
from tidal.schedule.scheduler import Sample
from tidal.train.distributed import peak_memory_mb
from tidal.train.group import TrainerGroup, TrainerRankError, WarmStartPlan, write_checkpoint
from tidal.train.warmstart import render_all
from tidal.tree import (
    TRAIN_REWARDS,
    TrainTree,
    balance_advantages,
    load_sessions,
    process_sessions,
    process_store,
    with_rewards,
)
from tidal.tree.html import render_episode_html


class RunError(RuntimeError):
    """The run cannot start or continue (bad run directory, missing checkpoint, ...)."""


# --------------------------------------------------------------------------- build


@dataclass
class Parts:
    """What `build` wires for one run; `close()` stops the gateway and the engine."""

    cfg: RunConfig
    run_dir: Path
    tokenizer: PreTrainedTokenizerBase
    engine: Engine
    store: LedgerStore
    gateway: GatewayServer
    train_tasks: list[Task]
    heldout: list[Task]
    rollouts: Rollouts
    live: LiveRollouts  # RL's task groups, saved as they run (preemption)
    groups: GroupRunner  # where RL's task groups run: `live` here, or hosts on a Ray cluster
    evals: Rollouts
    trainer: TrainerGroup
    log: RunLog
    t_start: float
    earlier_s: float  # wall clock of attempts before this one (a resume)
    rows_seen: int = 0  # the ledger's rows read as of the last `ledger_rows_read`

    def checkpoint(self, st: RunState) -> RunState:
        """A checkpoint of `st`, written whole: a stop waits for it (`deferred`)."""
        st = st.advance(elapsed_s=self.earlier_s + time.time() - self.t_start)
        with deferred():
            save_checkpoint(self.run_dir, self.trainer, st)
        return st

    def sync_engine(self, version: int) -> float:
        """The trainer's weights to the engine as `version` (`Engine.update_weights`: in
        process for the embedded engine; a checkpoint under RUN_DIR/weights/ for servers,
        written once); older checkpoints there are removed. Returns the seconds taken."""
        t0 = time.perf_counter()
        out = self.run_dir / "weights" / f"v{version}"
        # gathered from the ranks, LoRA merged (and its adapters, for vLLM servers)
        self.engine.update_weights(self.trainer.weights(out), version)
        for old in (self.run_dir / "weights").glob("v*"):
            if old != out:
                shutil.rmtree(old, ignore_errors=True)
        return time.perf_counter() - t0

    def train(self, trees: list[TrainTree], step: int) -> dict[str, float]:
        """The trainer's step on `trees`. Trainer ranks that were Ray actors (`train.nodes
        > 1`) and were lost with their node: the step runs again from the last checkpoint
        on the ranks left (`TrainerGroup.shrunk`), and a `trainer_lost` row says so."""
        if not trees:
            return {}
        try:
            return self.trainer.step(trees).as_dict()
        except TrainerRankError as e:
            if self.trainer.launch != "ray":
                raise
            t0, before = time.perf_counter(), self.trainer.world_size
            self.trainer = self.trainer.shrunk(find_checkpoint(self.run_dir))
            self.log.metrics({"phase": "trainer_lost", "step": step, "error": str(e)[:300],
                              "world_size_before": before,
                              "world_size": self.trainer.world_size,
                              "restart_s": round(time.perf_counter() - t0, 2)})
            return self.trainer.step(trees).as_dict()

    def ledger_rows_read(self) -> int:
        """Call and outcome rows read back from the ledger since the last call (the
        step's rollouts and trees: proportional to its sessions, not to the run)."""
        before, self.rows_seen = self.rows_seen, self.store.rows_read
        return self.rows_seen - before

    def engine_metrics(self) -> dict[str, Any]:
        """What the engine reports per step (servers: tokens/s, sessions, prefix cache)."""
        return self.engine.metrics()

    def evaluate(self, tag: str, state: RunState) -> float:
        cfg = self.cfg
        t0 = time.perf_counter()
        jobs: list[tuple[Task, str]] = []
        metas: dict[str, SessionMeta] = {}
        for t in self.heldout:
            for k in range(cfg.eval.samples):
                jobs.append((t, new_session_id(f"eval{tag}", state.step, t.task_id, k)))
                metas[jobs[-1][1]] = SessionMeta(f"eval{tag}", state.step, t.task_id, k)
        self.store.record_meta(metas)
        self.log.phase("eval", len(jobs))
        # evaluation runs as many sessions at once as the rollout devices can
        workers = cfg.schedule.devices * cfg.schedule.groups_per_device * cfg.rollout.group_size
        eps = self.evals.many(jobs, workers=workers, on_done=lambda _e: self.log.advance("eval"))
        rate = sum(e.reward >= 1.0 for e in eps) / max(len(eps), 1)
        self.log.metrics({"phase": "eval", "step": state.step, "success_rate": rate,
                          "partial_mean": sum(e.partial_score for e in eps) / max(len(eps), 1),
                          "checks": _check_rates(eps),
                          "families": _family_rates(eps, self.heldout),
                          "grader_errors": _grader_errors(eps),
                          "tool_parse_failures": sum(e.tool_parse_failures for e in eps),
                          # beside success: a rise that came from skipping the tools shows
                          "tool_calls_per_episode": _tool_calls(eps),
                          "seconds": time.perf_counter() - t0,
                          "policy_version": self.engine.policy_version,
                          # since the last step's row: this evaluation's calls
                          "engine": self.engine_metrics()})
        return rate

    def close(self) -> None:
        self.live.episodes.close()
        self.gateway.stop()
        self.engine.close()
        self.trainer.close()


@dataclass(frozen=True)
class Resolved:
    """Every component a config names, resolved (nothing heavy loaded yet)."""

    tasks: components.Tasks
    harness: Harness
    eval_harness: Harness
    runtimes: TaskRuntimes  # where episodes run
    base_dir: Path  # the model's checkpoint directory


def resolve(cfg: RunConfig) -> Resolved:
    """Every component by name (`tidal.run.components`), checked before anything starts:
    the tasks, the harnesses, the sandbox runtime, the scheduler backend, the engine and
    the trainer's layout. A bad name or an impossible layout is a `RunError` naming it."""
    agent_cfg = components.agent_config(cfg)
    try:
        tasks = components.select_tasks(cfg.tasks, cfg.seed)
        harness = components.make_harness(cfg, agent_cfg)
        eval_harness = components.make_harness(
            cfg, replace(agent_cfg, temperature=cfg.eval.temperature))
        runtimes = components.make_runtimes(cfg)
        for key, value in (("schedule.backend", cfg.schedule.backend),
                           ("engine.kind", cfg.engine.kind)):
            if is_attr(value):
                load_attr(value, key)
        components.check_engine(cfg)
        base_dir = (ensure_tiny(seed=cfg.model.seed) if cfg.model.name == "tiny"
                    else resolve_model(cfg.model.name))
        components.check_trainer(cfg, base_dir, device=components.resolve_device(cfg.model.device))
        if cfg.schedule.backend == "ray":  # the cluster has room and every node the model
            from tidal.run.cluster import check_run

            check_run(cfg, base_dir)
    except (TaskError, ComponentError, ClusterError) as e:
        raise RunError(str(e)) from e
    return Resolved(tasks, harness, eval_harness, runtimes, base_dir)


def build(cfg: RunConfig, run_dir: Path, state: RunState, ckpt: Path | None) -> Parts:
    """Every component of the run, resolved by name (`tidal.run.components`)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    t_start = time.time()
    got = resolve(cfg)  # a bad name fails before anything starts
    log = _open_log(cfg, run_dir, resume=ckpt is not None or state.step > 0)
    try:
        return _build(cfg, run_dir, state, ckpt, t_start=t_start, tasks=got.tasks,
                      harness=got.harness, eval_harness=got.eval_harness,
                      runtimes=got.runtimes, log=log, base_dir=got.base_dir)
    except BaseException:
        log.close(failed=True)
        raise


def _open_log(cfg: RunConfig, run_dir: Path, *, resume: bool) -> RunLog:
    """metrics.jsonl and the `[log] backends`, started before anything else runs."""
    start = LogStart.load(run_dir, name=run_dir.name, project=cfg.log.project,
                          config=cfg.model_dump(mode="json"), resume=resume,
                          mlflow_uri=cfg.log.mlflow_uri)
    try:
        return RunLog(run_dir, total_steps=cfg.rl.steps, backends=cfg.log.backends, start=start)
    except LoggerError as e:
        raise RunError(str(e)) from e


def _build(cfg: RunConfig, run_dir: Path, state: RunState, ckpt: Path | None, *,
           t_start: float, tasks: components.Tasks, harness: Harness, eval_harness: Harness,
           runtimes: TaskRuntimes, log: RunLog, base_dir: Path) -> Parts:
    """The heavy parts, once every name resolved and the loggers started."""
    if cfg.rollout.sandbox == "local" and any(
            t.environment for t in (*tasks.train, *tasks.heldout)):
        raise RunError("rollout.sandbox = \"local\" cannot build the tasks' environments: use "
                       "\"bwrap\"")
    try:
        runtimes.prepare((*tasks.train, *tasks.heldout))
    except TaskError as e:
        raise RunError(str(e)) from e
    device = components.resolve_device(cfg.model.device)
    tokenizer = load_tokenizer(base_dir)
    weights_dir = ckpt if ckpt is not None else base_dir
    # the trainer's ranks first (each loads its copy as the engine loads its own, eval
    # mode: no dropout, as the engine samples), so a layout that fails stops here
    try:
        trainer = components.make_trainer(
            components.trainer_spec(cfg, weights_dir, ckpt, device=device), run_dir=run_dir)
    except (ComponentError, TrainerRankError) as e:
        raise RunError(str(e)) from e
    model_name = cfg.model.name if cfg.model.name == "tiny" else base_dir.name
    try:
        engine = components.make_engine(cfg, weights_dir, device=device,
                                         policy_version=state.policy_version,
                                         model_name=model_name, tokenizer_dir=base_dir,
                                         run_dir=run_dir)
    except ComponentError as e:
        raise RunError(str(e)) from e
    store = LedgerStore(run_dir / "ledger.db")
    stack = build_stack(cfg, engine=engine, tokenizer=tokenizer, store=store, run_dir=run_dir,
                        harness=harness, eval_harness=eval_harness, runtimes=runtimes,
                        model_name=model_name)
    groups: GroupRunner = stack.live
    if cfg.schedule.backend == "ray":  # rollout devices on the cluster's nodes
        from tidal.run.hosts import ClusterEngine, ClusterRollouts, HostSpec

        spec = HostSpec(cfg, str(run_dir.resolve()), str(weights_dir.resolve()),
                        str(base_dir.resolve()), model_name, state.policy_version, device=0)
        try:
            cluster = ClusterRollouts.start(cfg, store, spec)
        except BaseException as e:
            stack.close()
            engine.close()
            trainer.close()
            if isinstance(e, ClusterError):
                raise RunError(str(e)) from e
            raise
        engine, groups = ClusterEngine(engine, cluster), cluster
    return Parts(cfg, run_dir, tokenizer, engine, store, stack.gateway,
                 list(tasks.train), list(tasks.heldout), stack.rollouts, stack.live, groups,
                 stack.evals, trainer, log, t_start, state.elapsed_s)


# --------------------------------------------------------------------------- the recipe


def run(cfg: RunConfig, run_dir: Path, *, resume: bool = False) -> dict[str, Any]:
    ckpt = find_checkpoint(run_dir)
    if resume and ckpt is None and not (run_dir / "config.toml").exists():
        raise RunError(f"nothing to resume in {run_dir}")
    if not resume and (run_dir / "config.toml").exists():
        raise RunError(f"{run_dir} already holds a run: pass --resume or choose another --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    state = load_state(ckpt) if (resume and ckpt) else RunState()
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    parts = build(cfg, run_dir, state, ckpt)  # a run that cannot start leaves no config
    (run_dir / "config.toml").write_text(dump_config(cfg))
    try:
        with parts.log.live():
            state = warm_start_phase(parts, state)
            reference_phase(parts, state)
            if state.success_rate_start is None:
                state = parts.checkpoint(state.advance(success_rate_start=parts.evaluate("start",
                                                                                       state)))
            state, sessions, schedule = rl_phase(parts, state)
            end = parts.evaluate("end", state)
            _sample_trees(parts.store, sessions, run_dir / "trees",
                          lambda ids: str(parts.tokenizer.decode(list(ids))))
    except TrainerRankError as e:  # a rank died: the last checkpoint is whole
        parts.live.episodes.stop_all()
        parts.log.close(failed=True)
        raise RunError(str(e)) from e
    except BaseException:  # a stop (tidal.run.stop) or a failure: live episodes saved
        parts.live.episodes.stop_all()
        parts.log.close(failed=True)
        raise
    finally:
        parts.close()
    return summarize(parts, state, end, schedule)


def warm_start_phase(parts: Parts, state: RunState) -> RunState:
    """Supervised steps on the training tasks' demonstrations (`warmstart.steps`);
    then the engine gets the weights as the next version (none when nothing trained:
    the base weights stay version 0)."""
    cfg = parts.cfg
    if state.warmstart_done:
        return state
    pairs = [(t, _offer(d, cfg.rollout.tools))
             for t in taught([t for t in parts.train_tasks if t.solution], cfg.warmstart.teacher)
             for d in parts.rollouts.demonstrations(t)] if cfg.warmstart.steps else []
    families, demos = [t.family for t, _ in pairs], [d for _, d in pairs]
    if cfg.warmstart.steps and not demos:
        raise RunError("warmstart.steps > 0 but no training task has a demonstration (tasks "
                       "from a directory or module:attr usually have none): set "
                       "warmstart.steps = 0")
    parts.log.phase("warm start", cfg.warmstart.steps)
    t0 = time.perf_counter()
    batches = warm_start_batches(families, cfg)
    imitated = tuple(sorted({pairs[i][0].task_id for b in batches for i in b}))
    losses = parts.trainer.warm_start(
        render_all(parts.tokenizer, demos),
        WarmStartPlan(batches=batches,
                      lr=cfg.warmstart.lr, pad_id=parts.tokenizer.pad_token_id or 0),
        on_step=lambda i, loss, _dt: parts.log.advance("warm start", loss=loss),
    ) if demos else []
    parts.log.metrics({"phase": "warmstart", "step": 0,
                       "loss_first": losses[0] if losses else None,
                       "loss_last": losses[-1] if losses else None,
                       "seconds": time.perf_counter() - t0})
    if not losses:  # nothing trained: the engine already has these weights (version 0)
        return parts.checkpoint(state.advance(warmstart_done=True))
    state = state.advance(warmstart_done=True, policy_version=state.policy_version + 1,
                          demonstrated=imitated)
    parts.sync_engine(state.policy_version)
    return parts.checkpoint(state)


def warm_start_batches(families: Sequence[str], cfg: RunConfig) -> tuple[tuple[int, ...], ...]:
    """`warmstart.steps` batches of `warmstart.batch_size` demonstration indices (all of
    them when fewer), drawn from one generator seeded by `seed`: uniformly, or spread over
    the demonstrations' task `families` (`warmstart.sampling`)."""
    rng, pool = random.Random(cfg.seed), range(len(families))
    return tuple(tuple(sample_batch(rng, pool, (), cfg.warmstart.batch_size,
                                    sampling=cfg.warmstart.sampling, signal={},
                                    families=families))
                 for _ in range(cfg.warmstart.steps))


def rl_task_pool(tasks: Sequence[Task], demonstrated: Sequence[str], which: str) -> list[Task]:
    """The training tasks RL draws from (`rollout.task_pool`): all, or those whose
    solutions the warm start did not imitate (`demonstrated`)."""
    if which == "all":
        return list(tasks)
    seen = set(demonstrated)
    left = [t for t in tasks if t.task_id not in seen]
    if not left:
        raise RunError(f'rollout.task_pool = "undemonstrated": the warm start imitated all '
                       f"{len(tasks)} training tasks; add tasks or set it to \"all\"")
    return left


def reference_phase(parts: Parts, state: RunState) -> None:
    """`rl.kl_coef > 0`: the KL term's reference is the policy RL starts from (the
    warm-started one), written once to RUN_DIR/reference before the first RL step and
    read back by every resume."""
    if not parts.cfg.rl.kl_coef:
        return
    ref = parts.run_dir / "reference"
    if not ref.exists():
        if state.step > 0:
            raise RunError(f"{ref} is missing: the KL reference (the policy at RL step 0) "
                           f"cannot be rebuilt at step {state.step}")
        tmp = ref.with_name("reference.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        write_checkpoint(tmp, parts.trainer.state_dict(), parts.trainer.config)
        tmp.rename(ref)
    parts.trainer.set_reference(ref)


def rl_phase(parts: Parts, state: RunState) -> tuple[RunState, list[str], dict[str, Any]]:
    """`rl.steps` steps, each: a batch of finished task groups -> trees -> a trainer step
    -> the engine's new weights -> a checkpoint -> the step's row (and an evaluation every
    `eval.every` steps). Returns the state, the last step's sessions (for the report's
    sample trees) and the schedule's summary."""
    cfg, log = parts.cfg, parts.log
    queue, resumed = rollout_queue(parts, state)
    sessions: list[str] = []
    log.phase("rl", cfg.rl.steps, done=state.step)
    with queue:
        queue.start(resumed, state.task_signal)
        for batch in queue.batches():
            sessions = batch.sessions
            t1 = time.perf_counter()
            trees = batch_trees(parts, batch)
            metrics = parts.train(trees, state.step + 1)
            t_train = time.perf_counter() - t1
            state = state.advance(**_stepped(state, batch, TRAIN_REWARDS[cfg.rl.reward]))
            sync_s = parts.sync_engine(state.policy_version)
            state = parts.checkpoint(state)
            queue.trained(batch)  # what it trained is safe: nothing left to resume
            log.metrics(_step_row(
                state, eps=list(batch.episodes), m=metrics, t_wait=batch.waited_s,
                t_train=t_train, wall=time.perf_counter() - batch.started,
                cpu=cpu_seconds() - batch.cpu_started, groups=list(batch.groups),
                sched=queue.summary(),
                sampled=_sampled(batch.episodes),
                engine={"weight_sync_s": sync_s, **parts.engine_metrics()},
                trainer={**parts.trainer.metrics(), **_snapshot_figures(parts.live.episodes)},
                ledger_rows_read=parts.ledger_rows_read(), replaced=len(batch.replaced),
            ))
            log.advance("rl")
            if state.step % cfg.eval.every == 0 and state.step < cfg.rl.steps:
                parts.evaluate(f"s{state.step}", state)
            queue.refill(batch, state.task_signal)
        schedule = _schedule_summary(queue.summary())
    return state, sessions, schedule


def batch_trees(parts: Parts, batch: Batch) -> list[TrainTree]:
    """The batch's sessions as trees to train (docs/trees.md), read from the ledger; with
    `rl.reward = "success"` the rewards trained are 1 for a solved task and 0 otherwise
    (`with_rewards`); with `rl.advantage_balance = "family"` each task family's
    advantages are rescaled to an equal share of the batch's signal
    (`balance_advantages`)."""
    rl = parts.cfg.rl
    sessions = with_rewards(load_sessions(parts.store, batch.sessions),
                            TRAIN_REWARDS[rl.reward])
    trees = list(process_sessions(sessions, max_paths=rl.max_paths,
                                  incomplete=rl.timeout_reward, advantage=rl.advantage,
                                  normalisation=rl.normalization, strict=False).trees)
    if rl.advantage_balance == "family":
        family = {t.task_id: t.family or "(none)" for t in parts.train_tasks}
        trees = balance_advantages(trees, {
            sid: family.get(e.task_id, "(none)") for e in batch.episodes for sid in e.session_ids
        })
    return trees


def rollout_queue(parts: Parts, state: RunState) -> tuple[RolloutQueue, list[LiveGroup]]:
    """The queue of the RL steps left, and the task groups a killed attempt left live
    (they resume first). Sessions of that attempt that will not resume and have no
    outcome are closed; those committed and never trained are carried into the first
    batch."""
    cfg = parts.cfg
    resumed = parts.live.episodes.pending()
    carry = _recover(parts.store, state, {sid for grp in resumed for _t, sid in grp.jobs})
    sched = components.make_scheduler(cfg, **_switching(parts.engine, cfg),
                                      migrator=RolloutMigrator(parts.live))
    pool = rl_task_pool(parts.train_tasks, state.demonstrated, cfg.rollout.task_pool)
    draws = TaskDraws(pool, seed=cfg.seed, batch=cfg.rollout.tasks_per_step,
                      sampling=cfg.rollout.task_sampling)
    queue = RolloutQueue(
        sched, parts.groups, parts.live.episodes, parts.store, draws,
        steps=cfg.rl.steps - state.step, first_step=state.step,
        tasks_per_step=cfg.rollout.tasks_per_step, group_size=cfg.rollout.group_size,
        max_staleness=cfg.rl.max_staleness, base_version=state.policy_version,
        trained=set(state.trained_sessions) | set(state.dropped_sessions), carry=carry,
        tasks=parts.train_tasks, log=parts.log, resample=cfg.rollout.dynamic_sampling,
        train_reward=TRAIN_REWARDS[cfg.rl.reward])
    return queue, resumed


def _stepped(state: RunState, batch: Batch, reward: Callable[[float], float]) -> dict[str, Any]:
    """What a trained batch changes in the run's state. The task statistics count a
    group's rewards as trained (`reward`: rl.reward), so a group that differs only in
    partial credit has no signal under `rl.reward = "success"`."""
    return {
        "step": state.step + 1, "policy_version": state.policy_version + 1,
        "trained_sessions": (*state.trained_sessions, *batch.sessions),
        "dropped_sessions": tuple(dict.fromkeys((*state.dropped_sessions,
                                                 *batch.untrained))),
        "sessions": state.sessions + len(batch.sessions),
        "task_signal": record_groups(state.task_signal, [
            (task_id, [reward(r) for r in rewards]) for task_id, rewards in batch.group_rewards]),
    }


def summarize(parts: Parts, state: RunState, end: float,
              schedule: dict[str, Any]) -> dict[str, Any]:
    """`tidal verify` over the ledger, then summary.json."""
    report = verify_store(parts.store)
    parts.store.close()
    summary = {
        "success_rate_start": state.success_rate_start,
        "success_rate_end": end,
        "steps": state.step,
        "minutes": round((parts.earlier_s + time.time() - parts.t_start) / 60, 2),
        "sessions": state.sessions,
        "drift_tokens": report.model_tokens - report.model_tokens_verbatim,
        "verify_ok": report.ok,
        "policy_version": state.policy_version,
        "heldout_curve": _heldout_curve(parts.run_dir / "metrics.jsonl"),
        "schedule": schedule,
        # this process's peak resident memory (this attempt's: a resume starts again)
        "peak_rss_mb": round(peak_memory_mb(torch.device("cpu")), 1),
    }
    (parts.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    parts.log.close()
    return summary


# --------------------------------------------------------------------------- helpers


def _heldout_curve(metrics: Path) -> list[tuple[int, float]]:
    """(RL step, held-out success) of every evaluation, in order, resumes included."""
    rows = (json.loads(line) for line in metrics.read_text().splitlines() if line)
    return [(r["step"], r["success_rate"]) for r in rows if r.get("phase") == "eval"]


def _check_rates(episodes: list[Episode]) -> dict[str, float]:
    """Per kind of check, the fraction passed over the episodes that have one."""
    kinds: dict[str, list[float]] = {}
    for e in episodes:
        for kind, rate in e.checks.items():
            kinds.setdefault(kind, []).append(rate)
    return {k: round(sum(v) / len(v), 4) for k, v in sorted(kinds.items())}


def _family_rates(episodes: list[Episode], tasks: list[Task]) -> dict[str, float]:
    """Success rate per task family (a built-in set's family, a Harbor task's
    `[metadata] category`: shell-skills' skill) over `episodes` of `tasks`."""
    family = {t.task_id: t.family or "(none)" for t in tasks}
    by: dict[str, list[bool]] = {}
    for e in episodes:
        by.setdefault(family.get(e.task_id, "(none)"), []).append(e.reward >= 1.0)
    return {k: round(sum(v) / len(v), 4) for k, v in sorted(by.items())}


def _tool_calls(episodes: list[Episode]) -> float:
    """Tool calls per episode (its subagents' included)."""
    return sum(e.tool_calls for e in episodes) / max(len(episodes), 1)


def _per_node(episodes: Sequence[Episode]) -> dict[str, int]:
    """Sessions per Ray node (the first 8 characters of its id) that ran them."""
    out: dict[str, int] = {}
    for e in episodes:
        out[e.node[:8]] = out.get(e.node[:8], 0) + len(e.session_ids)
    return out


def _grader_errors(episodes: list[Episode]) -> int:
    return sum(e.grader_error is not None for e in episodes)


def _offer(demo: Demonstration, tools: tuple[str, ...]) -> Demonstration:
    """The demonstration rendered with the tools the agent is offered in rollouts (a
    subagent is never offered spawn_subagent), so the warm start sees the same prompt."""
    allowed = tools if demo.role == "main" else tuple(t for t in tools if t != "spawn_subagent")
    return replace(demo, tools=allowed)


def _sample_trees(
    store: LedgerStore, session_ids: list[str], out: Path,
    decode: Callable[[Sequence[int]], str], n: int = 4
) -> None:
    """Tree pages of a few episodes of the last step, and `index.json` (each one's
    status, reward, sessions, calls and edges), for `tidal report`."""
    if not session_ids:
        return
    out.mkdir(exist_ok=True)
    res = process_store(store, session_ids, keep_graphs=True, strict=False)
    reports = {r.episode_id: r for r in res.episodes}
    index = {}
    for g in res.graphs[:n]:
        rep = reports[g.episode_id]
        sids = {s.session_id for s in g.sessions}
        branches = [b for t in res.trees for b in t.branches if b.session_id in sids]
        page = render_episode_html(g, rep, branches, decode=decode)
        (out / f"{g.episode_id}.html").write_text(page, encoding="utf-8")
        index[g.episode_id] = {"status": rep.status, "reward": rep.reward,
                               "sessions": rep.sessions, "calls": rep.calls, "edges": rep.edges}
    (out / "index.json").write_text(json.dumps(index, indent=1))  # the report's tree table


def _recover(store: LedgerStore, state: RunState, resumed: set[str]) -> list[str]:
    """After a kill: close sessions left without an outcome that will not be resumed
    (`resumed`: those of live groups; infra_error: masked, not punished) and return
    committed RL sessions that were never trained (nor dropped as stale)."""
    trained = set(state.trained_sessions) | set(state.dropped_sessions)
    outcomes, metas = store.outcomes(), store.session_meta()
    carry = []
    for s in store.sessions():
        meta = metas.get(s.session_id)
        if s.parent_session_id is not None or meta is None or meta.phase != "rl":
            continue
        if s.session_id in resumed:
            continue
        if s.session_id not in outcomes:
            close_sessions(store, [s.session_id], "the run was killed mid-session")
        elif s.session_id not in trained:
            carry.append(s.session_id)
    return carry


def _sampled(episodes: Sequence[Episode]) -> tuple[int, float]:
    """Tokens the engine sampled for these episodes, and the wall clock from their
    first call's start to their last call's end."""
    first = min((e.first_call_at for e in episodes if e.first_call_at is not None),
                default=float("inf"))
    last = max((e.last_call_at for e in episodes if e.last_call_at is not None), default=0.0)
    return sum(e.tokens for e in episodes), max(last - first, 0.0)


def _step_row(
    state: RunState, *, eps: list[Episode], m: dict[str, float], t_wait: float,
    t_train: float, wall: float, cpu: float, groups: list[Sample], sched: dict[str, Any],
    sampled: tuple[int, float] = (0, 0.0), engine: dict[str, Any] | None = None,
    trainer: dict[str, Any] | None = None, ledger_rows_read: int = 0, replaced: int = 0,
) -> dict[str, Any]:
    """One RL step's metrics row. `rollout_s` is how long the trainer waited for its
    batch (rollouts of other batches may overlap training under elastic/async);
    `rollout_tokens_per_s` is the batch's sampled tokens over the span of its calls;
    the scheduler's figures (utilisation, role switches, idle time, staleness) are
    cumulative over the run so far."""
    n = max(len(eps), 1)
    sampled_tokens, span = sampled
    return {
        "phase": "rl", "step": state.step, "policy_version": state.policy_version,
        "reward_mean": sum(e.reward for e in eps) / n,
        "success_rate": sum(e.reward >= 1.0 for e in eps) / n,
        "partial_mean": sum(e.partial_score for e in eps) / n,
        "timeouts": sum(e.status == "timeout" for e in eps),
        "statuses": {s: sum(e.status == s for e in eps) for s in {e.status for e in eps}},
        "grader_errors": _grader_errors(eps),
        # calls whose text looked like a tool call no parser accepted (docs/gateway.md)
        "tool_parse_failures": sum(e.tool_parse_failures for e in eps),
        "tool_calls_per_episode": _tool_calls(eps),
        **({"sessions_per_node": _per_node(eps)} if any(e.node for e in eps) else {}),
        "staleness": [grp.staleness for grp in groups],
        # groups rolled again on a fresh task since the last row: their samples all
        # scored alike (rollout.dynamic_sampling)
        "groups_replaced": replaced,
        "rollout_s": t_wait, "train_s": t_train,
        # tokens trained (summed over paths, as per-path training would count them)
        "train_tokens_per_s": m.get("path_tokens", 0.0) / t_train if t_train else 0.0,
        # tokens the engine sampled for this batch (subagents included), per second of
        # the span from its first call's start to its last call's end
        "rollout_tokens": sampled_tokens,
        "rollout_tokens_per_s": sampled_tokens / span if span else 0.0,
        # call and outcome rows read back from the ledger since the last step's row
        "ledger_rows_read": ledger_rows_read,
        "cpu_utilization": cpu / (wall * (os.cpu_count() or 1)),
        **_schedule_summary(sched),
        # the engine's: weight_sync_s (trainer -> engine), per-server figures (vLLM)
        **(engine or {}),
        # the trainer's: world_size, peak_memory_mb_per_rank
        **(trainer or {}),
        **m,
    }


def _snapshot_figures(live: LiveEpisodes) -> dict[str, Any]:
    """Live-episode snapshots so far in this process: how many, and the seconds they took
    (waiting for a running command to end included; a snapshot holds up only a harness
    operation that starts while it is written)."""
    return {"snapshots": live.snapshots, "snapshot_s": round(live.snapshot_s, 3)}


def _switching(engine: Engine, cfg: RunConfig) -> dict[str, Any]:
    """Role switches that act on the engine: vLLM servers started here, one per device,
    sleep while their device trains and wake on the newest weights (a start's seconds)."""
    from tidal.engine.servers import ServerPool

    if (not isinstance(engine, ServerPool) or cfg.engine.urls
            or cfg.engine.servers != cfg.schedule.devices):
        return {}
    return {"on_switch": engine.on_switch, "switch_s": engine.start_s}


def _schedule_summary(m: dict[str, Any]) -> dict[str, Any]:
    """The scheduler's metrics that a run reports (docs/scheduler.md has them all)."""
    return {
        "schedule_policy": m["policy"],
        "device_utilization": m["utilization"],
        "role_switches": m["role_switches"],
        "idle_s_per_device": m["idle_s_per_device"],
        "stale_groups_dropped": m["staleness"]["dropped_total"],
        "staleness_trained": m["staleness"]["trained"],
        # seconds of every role switch so far (a vLLM server's stop or start among them)
        "switch_s": [round(x, 3) for x in m.get("switch_seconds", ())],
        # live task groups moved off a device instead of draining it (schedule.migration),
        # and the seconds each took to stop and save
        "migrations": m.get("migrations", 0),
        "migrate_s": [round(x, 3) for x in m.get("migrate_seconds", ())],
    }
