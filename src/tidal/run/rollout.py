"""Rollouts for the RL loop: run task sessions through the gateway, grade, record outcomes.

Each episode gets a fresh runtime (a bubblewrap sandbox by default), runs the built-in
harness against its own session URL, is graded on the files it left, and has one
outcome per session (main and subagents) appended to the ledger. Episodes run on
threads: the harness waits on HTTP, and the embedded engine batches the concurrent
requests into one forward pass.

The unit of scheduled work is a task group (the GRPO group: `group_size` episodes of
one task, run together), so a trained mini-batch always holds whole groups and every
advantage has its full baseline. `make_scheduler` builds the elastic scheduler's local
backend for `tidal run`: devices are logical CPU slots in this process (thread mode),
each rolling out `groups_per_device` groups at once or training; the engine and the
trainer hold separate copies of the weights, so both roles can run at the same time.
Deliberately simplified: a role switch moves no model (both live in this process), so
its cost is what the bookkeeping takes.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tidal.agent.harness import AgentConfig, AgentResult, run_episode
from tidal.agent.runtime import LocalDirRuntime, ToolRuntime
from tidal.agent.tasks import Grade, Task
from tidal.ledger import LedgerStore, Outcome, Status
from tidal.schedule.backend import RolloutResult
from tidal.schedule.local import LocalBackend
from tidal.schedule.policy import ColocatedPolicy, ElasticPolicy, FixedSplitPolicy, Policy
from tidal.schedule.scheduler import Scheduler
from tidal.schedule.types import PoolConfig

RuntimeFactory = Callable[[], contextlib.AbstractContextManager[ToolRuntime]]


@dataclass(frozen=True)
class Episode:
    """One graded episode: its main session id, every session id, status and grade
    (`checks`: the grade's fraction passed per kind of check, `Grade.by_kind`)."""

    task_id: str
    session_id: str
    session_ids: tuple[str, ...]
    status: str
    reward: float
    partial_score: float
    n_calls: int
    seconds: float
    checks: dict[str, float] = field(default_factory=dict)


@contextlib.contextmanager
def local_runtime() -> Iterator[ToolRuntime]:
    """A plain temporary directory: NOT isolated; for trusted tasks and tests only."""
    with tempfile.TemporaryDirectory(prefix="tidal-ep-") as d:
        yield LocalDirRuntime(Path(d))


def sandbox_runtime() -> contextlib.AbstractContextManager[ToolRuntime]:
    """A fresh bubblewrap sandbox on the default image, adapted to the harness."""
    from tidal.run.sandboxed import sandboxed_runtime

    return sandboxed_runtime()


def runtime_factory(kind: str) -> RuntimeFactory:
    if kind == "local":
        return local_runtime
    if kind == "bwrap":
        return sandbox_runtime
    raise ValueError(f"unknown sandbox kind {kind!r} (expected 'bwrap' or 'local')")


def new_session_id(phase: str, step: int, task_id: str, k: int) -> str:
    return f"{phase}-{step}-{task_id}-{k}-{uuid.uuid4().hex[:6]}"


def _outcomes(result: AgentResult, grade: Grade) -> list[Outcome]:
    """One outcome per session; subagents share the episode's reward."""
    out = []
    for r in result.all_sessions():
        out.append(Outcome(
            session_id=r.session_id, status=Status(r.status), reward=grade.reward,
            partial_score=grade.partial_score,
            details={"checks": grade.details, "error": r.error} if r is result
            else {"episode": result.session_id, "error": r.error},
        ))
    return out


@dataclass(frozen=True)
class Rollouts:
    """Where and how episodes run: the gateway's URL and model name, the harness
    config, a fresh runtime per episode, and the ledger that gets the outcomes.
    `forget`, when given, is called with each session id of an episode once its
    outcomes are recorded (the in-process gateway's `forget_session`: a finished session's
    turns are not kept in memory for the rest of the run)."""

    gateway_url: str
    model: str
    agent_cfg: AgentConfig
    new_runtime: RuntimeFactory
    store: LedgerStore
    forget: Callable[[str], object] | None = None

    def one(self, task: Task, session_id: str) -> Episode:
        """Run, grade and record one episode."""
        t0 = time.perf_counter()
        try:
            with self.new_runtime() as runtime:
                result, grade = run_episode(self.gateway_url, self.model, task, runtime,
                                            self.agent_cfg, session_id=session_id)
        except Exception as e:  # the sandbox failed, not the agent: mask, don't punish
            self.store.append_outcome(Outcome(session_id, Status.INFRA_ERROR, 0.0, 0.0,
                                              {"error": f"{type(e).__name__}: {e}"}))
            self._forget([session_id])
            return Episode(task.task_id, session_id, (session_id,), "infra_error", 0.0, 0.0,
                           0, time.perf_counter() - t0)
        # a session that failed before its first call has nothing to train: no outcome
        outcomes = [o for o in _outcomes(result, grade) if self.store.has_session(o.session_id)]
        if outcomes:
            self.store.append_outcomes(outcomes)
        self._forget([r.session_id for r in result.all_sessions()])
        return Episode(
            task_id=task.task_id, session_id=session_id,
            session_ids=tuple(o.session_id for o in outcomes), status=result.status,
            reward=grade.reward, partial_score=grade.partial_score, n_calls=result.n_calls,
            seconds=time.perf_counter() - t0, checks=grade.by_kind,
        )

    def _forget(self, session_ids: Sequence[str]) -> None:
        if self.forget is not None:
            for sid in session_ids:
                self.forget(sid)

    def many(
        self,
        jobs: Sequence[tuple[Task, str]],
        *,
        workers: int,
        on_done: Callable[[Episode], None] | None = None,
    ) -> list[Episode]:
        """Run (task, session id) jobs on `workers` threads; results in job order."""
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rollout") as pool:
            futures = [pool.submit(self.one, task, sid) for task, sid in jobs]
            episodes = []
            for f in futures:
                ep = f.result()
                if on_done is not None:
                    on_done(ep)
                episodes.append(ep)
        return episodes

    def group(self, jobs: Sequence[tuple[Task, str]], *, base_version: int) -> RolloutResult:
        """One scheduled work item: a task group's episodes, all at once. Reports the
        policy version of the group's oldest recorded token (relative to `base_version`,
        the engine's version when the scheduler started) and its model tokens."""
        eps = self.many(jobs, workers=len(jobs))
        versions, tokens = [], 0
        for e in eps:
            for sid in e.session_ids:
                for sc in self.store.call_log(sid).calls:
                    versions.append(sc.call.policy_version)
                    tokens += len(sc.call.output_ids)
        oldest = min(versions) - base_version if versions else None
        return RolloutResult(value=eps, policy_version=oldest, tokens=tokens)


def make_scheduler(
    policy: str, *, devices: int, groups_per_device: int, train_devices: int,
    batch_groups: int, max_staleness: int, mean_group_s: float = 10.0,
) -> Scheduler:
    """The scheduler `tidal run` uses: `devices` logical devices on the local backend
    (threads), `batch_groups` groups per optimizer step, staleness bound K (stale groups
    are dropped and counted). Switches cost nothing to move here, so the policy is told
    they are free; `mean_group_s` scales the elastic policy's time constants."""
    chosen: Policy
    if policy == "colocated":
        chosen = ColocatedPolicy()
    elif policy == "elastic":
        chosen = ElasticPolicy.for_sessions(mean_group_s)
    elif policy == "async":
        chosen = FixedSplitPolicy(n_train=train_devices)
    else:
        raise ValueError(f"unknown schedule policy {policy!r} (colocated, elastic, async)")
    config = PoolConfig(
        n_devices=devices, batch_size=batch_groups, slots_per_device=groups_per_device,
        max_staleness=max_staleness, rollout_to_train_s=0.0, train_to_rollout_s=0.0,
        rate_window_s=mean_group_s / 4,
    )
    return Scheduler(LocalBackend(devices, groups_per_device, mode="thread"), chosen, config)
