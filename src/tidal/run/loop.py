"""`tidal run`: the whole RL loop in one place.

    warm start (SFT on generated demonstrations)
    evaluate on held-out tasks                      -> success_rate_start
    for each step:
        roll out task groups through the gateway    (sandbox + harness + engine -> ledger)
        rebuild trees, sample paths, advantages     (tidal.tree)
        tree-packed PPO/GRPO step                    (tidal.train)
        push weights to the engine, new version     (checkpoint, metrics)
    evaluate on held-out tasks                      -> success_rate_end, summary.json

The trainer's model and the engine's model are two copies of the same weights in one
process; after each update the engine receives the new state dict and version. Rollouts
and training alternate (colocated): on one small machine that keeps every core busy.
"""

from __future__ import annotations

import json
import os
import random
import resource
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from tidal.agent.harness import AgentConfig
from tidal.agent.tasks import Demonstration, Task, demonstrations, load_taskset
from tidal.engine.embedded import EmbeddedEngine
from tidal.engine.tiny import ensure_tiny, load_tokenizer, resolve_model
from tidal.gateway.server import GatewayServer
from tidal.gateway.verify import verify_store
from tidal.ledger import LedgerStore, Outcome, Status
from tidal.run.checkpoint import RunState, find_checkpoint, load_state, save_checkpoint
from tidal.run.config import RunConfig, dump_config
from tidal.run.progress import RunLog
from tidal.run.rollout import Episode, new_session_id, run_episodes, runtime_factory
from tidal.run.warmstart import render_all, warm_start
from tidal.train.loss import LossConfig
from tidal.train.trainer import TreeTrainer
from tidal.tree import process_store
from tidal.tree.html import render_episode_html


class RunError(RuntimeError):
    """The run cannot start or continue (bad run directory, missing checkpoint, ...)."""


def _device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(cfg: RunConfig, run_dir: Path, *, resume: bool = False) -> dict[str, Any]:
    t_start = time.time()
    ckpt = find_checkpoint(run_dir)
    if resume and ckpt is None and not (run_dir / "config.toml").exists():
        raise RunError(f"nothing to resume in {run_dir}")
    if not resume and (run_dir / "config.toml").exists():
        raise RunError(f"{run_dir} already holds a run: pass --resume or choose another --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_config(cfg))
    state = load_state(ckpt) if (resume and ckpt) else RunState()
    earlier_s = state.elapsed_s  # wall clock of attempts before this one (a resume)

    def checkpoint(st: RunState) -> RunState:
        st = st.advance(elapsed_s=earlier_s + time.time() - t_start)
        save_checkpoint(run_dir, policy, optimizer, st)
        return st
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = _device(cfg.model.device)

    # -- the pieces: model + tokenizer, engine, ledger, gateway, tasks, trainer ----------
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]

    base_dir = (ensure_tiny(seed=cfg.model.seed) if cfg.model.name == "tiny"
                else resolve_model(cfg.model.name))
    tokenizer = load_tokenizer(base_dir)
    weights_dir = ckpt if ckpt is not None else base_dir
    policy = AutoModelForCausalLM.from_pretrained(
        str(weights_dir), dtype=torch.float32, attn_implementation="sdpa"
    ).to(device)  # type: ignore[arg-type]
    model_name = cfg.model.name if cfg.model.name == "tiny" else base_dir.name
    engine = EmbeddedEngine(weights_dir, device=device, policy_version=state.policy_version,
                            model_name=model_name, seed=cfg.seed)
    store = LedgerStore(run_dir / "ledger.db")
    gateway = GatewayServer(engine, tokenizer, store)
    url = gateway.start()
    tasks = load_taskset(cfg.tasks.name, seed=cfg.seed)
    train_tasks = list(tasks.train[: cfg.tasks.train_size])
    heldout = list(tasks.heldout[: cfg.tasks.heldout_size])
    agent_cfg = AgentConfig(
        max_turns=cfg.rollout.max_turns, time_limit_s=cfg.tasks.time_limit_s,
        context_budget_tokens=cfg.rollout.context_budget, max_tokens=cfg.rollout.max_tokens,
        temperature=cfg.rollout.temperature, tools=cfg.rollout.tools,
    )
    eval_cfg = AgentConfig(**{**asdict(agent_cfg), "temperature": cfg.eval.temperature})
    new_runtime = runtime_factory(cfg.rollout.sandbox)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.rl.lr, weight_decay=0.0)
    if ckpt is not None and (ckpt / "optimizer.pt").exists() and state.warmstart_done:
        optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
    trainer = TreeTrainer(
        policy, optimizer,
        LossConfig(clip_low=cfg.rl.clip_eps, clip_high=cfg.rl.clip_eps,
                   correction=cfg.rl.correction),
        max_tokens=cfg.rl.max_tokens_per_stream,
    )
    log = RunLog(run_dir, total_steps=cfg.rl.steps)

    def sync_engine(version: int) -> None:
        engine.load_state_dict(policy.state_dict(), version)

    def evaluate(tag: str) -> float:
        t0 = time.perf_counter()
        jobs = [(t, new_session_id(f"eval{tag}", state.step, t.task_id, 0)) for t in heldout]
        eps = run_episodes(jobs, gateway_url=url, model=model_name, agent_cfg=eval_cfg,
                           new_runtime=new_runtime, store=store, workers=cfg.rollout.workers,
                           on_done=lambda _e: log.advance("eval"))
        rate = sum(e.reward >= 1.0 for e in eps) / max(len(eps), 1)
        log.metrics({"phase": "eval", "step": state.step, "success_rate": rate,
                     "partial_mean": sum(e.partial_score for e in eps) / max(len(eps), 1),
                     "seconds": time.perf_counter() - t0, "policy_version": engine.policy_version})
        return rate

    try:
        with log.live():
            # -- 1. warm start ----------------------------------------------------------
            if not state.warmstart_done:
                demos = [_offer(d, cfg.rollout.tools) for t in train_tasks
                         for d in demonstrations(t)]
                examples = render_all(tokenizer, demos)
                log.phase("warm start", cfg.warmstart.steps)
                t0 = time.perf_counter()
                losses = warm_start(
                    policy, examples, steps=cfg.warmstart.steps,
                    batch_size=cfg.warmstart.batch_size, lr=cfg.warmstart.lr,
                    pad_id=tokenizer.pad_token_id or 0, seed=cfg.seed,
                    on_step=lambda i, loss, _dt: log.advance("warm start", loss=loss),
                )
                log.metrics({"phase": "warmstart", "step": 0, "loss_first": losses[0] if
                             losses else None, "loss_last": losses[-1] if losses else None,
                             "seconds": time.perf_counter() - t0})
                state = state.advance(warmstart_done=True, policy_version=1)
                sync_engine(1)
                state = checkpoint(state)
            if state.success_rate_start is None:
                log.phase("eval", len(heldout))
                state = state.advance(success_rate_start=evaluate("start"))
                state = checkpoint(state)

            # -- 2. resume bookkeeping: finish what a killed attempt left ---------------
            carry = _recover(store, state)

            # -- 3. RL steps ------------------------------------------------------------
            rng = random.Random(cfg.seed * 1000 + state.step)
            sessions: list[str] = []  # the last step's sessions: sample trees for the report
            log.phase("rl", cfg.rl.steps, done=state.step)
            while state.step < cfg.rl.steps:
                t0, cpu0 = time.perf_counter(), _cpu_seconds()
                picked: list[Task] = rng.sample(train_tasks,
                                                min(cfg.rollout.tasks_per_step, len(train_tasks)))
                jobs = [(t, new_session_id("rl", state.step, t.task_id, k))
                        for t in picked for k in range(cfg.rollout.group_size)]
                eps = run_episodes(jobs, gateway_url=url, model=model_name, agent_cfg=agent_cfg,
                                   new_runtime=new_runtime, store=store,
                                   workers=cfg.rollout.workers)
                t_roll = time.perf_counter() - t0
                sessions = [s for e in eps for s in e.session_ids] + carry
                result = process_store(
                    store, sessions, max_paths=cfg.rl.max_paths,
                    incomplete=cfg.rl.timeout_reward, normalisation=cfg.rl.normalization,
                    strict=False,
                )
                t1 = time.perf_counter()
                version = state.policy_version
                fresh = [t for t in result.trees if _staleness(t, version) <= cfg.rl.max_staleness]
                metrics = trainer.step(fresh).as_dict() if fresh else {}
                t_train = time.perf_counter() - t1
                state = state.advance(
                    step=state.step + 1, policy_version=version + 1,
                    trained_sessions=(*state.trained_sessions, *sessions),
                    sessions=state.sessions + len(sessions),
                )
                sync_engine(state.policy_version)
                state = checkpoint(state)
                carry = []
                wall = time.perf_counter() - t0
                log.metrics(_step_row(
                    state, eps=eps, m=metrics, t_roll=t_roll, t_train=t_train, wall=wall,
                    cpu=_cpu_seconds() - cpu0, stale=len(result.trees) - len(fresh),
                ))
                log.advance("rl")
                if state.step % cfg.eval.every == 0 and state.step < cfg.rl.steps:
                    evaluate(f"s{state.step}")

            # -- 4. final evaluation and summary -----------------------------------------
            log.phase("eval", len(heldout))
            end = evaluate("end")
            _sample_trees(store, sessions, run_dir / "trees", tokenizer.decode)
    finally:
        gateway.stop()
        engine.close()
    report = verify_store(store)
    store.close()
    summary = {
        "success_rate_start": state.success_rate_start,
        "success_rate_end": end,
        "steps": state.step,
        "minutes": round((earlier_s + time.time() - t_start) / 60, 2),
        "sessions": state.sessions,
        "drift_tokens": report.model_tokens - report.model_tokens_verbatim,
        "verify_ok": report.ok,
        "policy_version": state.policy_version,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    log.close()
    return summary


def _offer(demo: Demonstration, tools: tuple[str, ...]) -> Demonstration:
    """The demonstration rendered with the tools the agent is offered in rollouts (a
    subagent is never offered spawn_subagent), so the warm start sees the same prompt."""
    allowed = tools if demo.role == "main" else tuple(t for t in tools if t != "spawn_subagent")
    return replace(demo, tools=allowed)


def _sample_trees(
    store: LedgerStore, session_ids: list[str], out: Path, decode: Any, n: int = 4
) -> None:
    """Tree pages of a few episodes of the last step, for `tidal report`."""
    if not session_ids:
        return
    out.mkdir(exist_ok=True)
    res = process_store(store, session_ids, keep_graphs=True, strict=False)
    reports = {r.episode_id: r for r in res.episodes}
    for g in res.graphs[:n]:
        rep = reports[g.episode_id]
        sids = {s.session_id for s in g.sessions}
        branches = [b for t in res.trees for b in t.branches if b.session_id in sids]
        page = render_episode_html(g, rep, branches, decode=decode)
        (out / f"{g.episode_id}.html").write_text(page, encoding="utf-8")


def _staleness(tree: Any, version: int) -> int:
    """How many versions behind the current policy the tree's oldest model token is."""
    lo = min((int(s.policy_versions[s.model_mask].min()) for s in tree.segments
              if s.model_mask.any()), default=version)
    return version - lo


def _recover(store: LedgerStore, state: RunState) -> list[str]:
    """After a kill: close sessions left without an outcome (infra_error: masked, not
    punished) and return committed RL sessions that were never trained."""
    trained = set(state.trained_sessions)
    outcomes = store.outcomes()
    carry = []
    for s in store.sessions():
        if s.parent_session_id is not None or not s.session_id.startswith("rl-"):
            continue
        if s.session_id not in outcomes:
            store.append_outcome(Outcome(s.session_id, Status.INFRA_ERROR, 0.0, 0.0,
                                         {"error": "the run was killed mid-session"}))
        elif s.session_id not in trained:
            carry.append(s.session_id)
    return carry


def _step_row(
    state: RunState, *, eps: list[Episode], m: dict[str, float], t_roll: float,
    t_train: float, wall: float, cpu: float, stale: int,
) -> dict[str, Any]:
    n = max(len(eps), 1)
    return {
        "phase": "rl", "step": state.step, "policy_version": state.policy_version,
        "reward_mean": sum(e.reward for e in eps) / n,
        "success_rate": sum(e.reward >= 1.0 for e in eps) / n,
        "partial_mean": sum(e.partial_score for e in eps) / n,
        "timeouts": sum(e.status == "timeout" for e in eps),
        "statuses": {s: sum(e.status == s for e in eps) for s in {e.status for e in eps}},
        "stale_trees_dropped": stale,
        "rollout_s": t_roll, "train_s": t_train,
        "train_tokens_per_s": m.get("tokens", 0.0) / t_train if t_train else 0.0,
        "device_utilization": cpu / (wall * (os.cpu_count() or 1)),
        **m,
    }
