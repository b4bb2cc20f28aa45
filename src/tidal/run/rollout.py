"""Rollouts for the RL loop: run task sessions through the gateway, grade, record outcomes.

Each episode gets a fresh runtime (a bubblewrap sandbox by default), runs the built-in
harness against its own session URL, is graded on the files it left, and has one
outcome per session (main and subagents) appended to the ledger. Episodes run on a
thread pool: the harness waits on HTTP, and the embedded engine batches the concurrent
requests into one forward pass.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tidal.agent.harness import AgentConfig, AgentResult, run_episode
from tidal.agent.runtime import LocalDirRuntime, ToolRuntime
from tidal.agent.tasks import Grade, Task
from tidal.ledger import LedgerStore, Outcome, Status

RuntimeFactory = Callable[[], contextlib.AbstractContextManager[ToolRuntime]]


@dataclass(frozen=True)
class Episode:
    """One graded episode: its main session id, every session id, status and grade."""

    task_id: str
    session_id: str
    session_ids: tuple[str, ...]
    status: str
    reward: float
    partial_score: float
    n_calls: int
    seconds: float


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


def run_one(
    *,
    gateway_url: str,
    model: str,
    task: Task,
    session_id: str,
    agent_cfg: AgentConfig,
    new_runtime: RuntimeFactory,
    store: LedgerStore,
) -> Episode:
    t0 = time.perf_counter()
    try:
        with new_runtime() as runtime:
            result, grade = run_episode(
                gateway_url, model, task, runtime, agent_cfg, session_id=session_id
            )
    except Exception as e:  # the sandbox failed, not the agent: mask, don't punish
        store.append_outcome(Outcome(session_id, Status.INFRA_ERROR, 0.0, 0.0,
                                     {"error": f"{type(e).__name__}: {e}"}))
        return Episode(task.task_id, session_id, (session_id,), "infra_error", 0.0, 0.0, 0,
                       time.perf_counter() - t0)
    # a session that failed before its first call has nothing to train: no outcome either
    outcomes = [o for o in _outcomes(result, grade) if store.has_session(o.session_id)]
    if outcomes:
        store.append_outcomes(outcomes)
    return Episode(
        task_id=task.task_id, session_id=session_id,
        session_ids=tuple(o.session_id for o in outcomes), status=result.status,
        reward=grade.reward, partial_score=grade.partial_score, n_calls=result.n_calls,
        seconds=time.perf_counter() - t0,
    )


def run_episodes(
    jobs: Sequence[tuple[Task, str]],
    *,
    gateway_url: str,
    model: str,
    agent_cfg: AgentConfig,
    new_runtime: RuntimeFactory,
    store: LedgerStore,
    workers: int,
    on_done: Callable[[Episode], None] | None = None,
) -> list[Episode]:
    """Run (task, session id) jobs on `workers` threads; results in job order."""
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rollout") as pool:
        futures = [
            pool.submit(run_one, gateway_url=gateway_url, model=model, task=task,
                        session_id=sid, agent_cfg=agent_cfg, new_runtime=new_runtime,
                        store=store)
            for task, sid in jobs
        ]
        episodes = []
        for f in futures:
            ep = f.result()
            if on_done is not None:
                on_done(ep)
            episodes.append(ep)
    return episodes
