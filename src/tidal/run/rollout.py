"""Rollouts for the RL loop: run task episodes through the gateway, grade, record outcomes.

Each episode gets a fresh runtime made from the task's environment (`TaskRuntimes`,
`tidal.agent.environment`: a bubblewrap sandbox, or a container), runs the configured
harness against its own session URL, is graded by the task's grader in the same
runtime, and has one outcome per session (main and subagents) appended to the ledger.
Episodes run on threads: harnesses wait on HTTP, and the embedded engine batches the
concurrent requests into one forward.

The unit of scheduled work is a task group (the GRPO group: `group_size` episodes of one
task, run together), so a trained mini-batch always holds whole groups and every
advantage has its full baseline.

What an episode's outcome says (docs/agent.md, "Statuses"):
- the harness's status, except that an episode whose main session made no model call is
  infra_error (nothing to train; not the policy's doing) and records no outcome;
- a grader error (a test.sh that wrote no reward) masks every session of the episode
  (status infra_error, `details.grader_error`) and is counted in the step's metrics;
- a runtime that fails (the sandbox, the environment build) is infra_error too.
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from tidal.agent.endpoint import API_KEY_PLACEHOLDER
from tidal.agent.environment import TaskRuntimes
from tidal.agent.episode import EpisodeContext, Harness, HarnessResult, run_task
from tidal.agent.preempt import Preempted
from tidal.agent.runtime import ToolRuntime
from tidal.agent.tasks import Demonstration, Grade, Task, demonstrations
from tidal.gateway.access import SessionKeys
from tidal.ledger import Call, LedgerStore, Outcome, Status
from tidal.schedule.backend import RolloutResult

LOG_TAIL = 1000  # characters of each harness stream kept in the outcome's details


@dataclass(frozen=True)
class Episode:
    """One graded episode: its main session id, every session id, status and grade
    (`checks`: the grade's fraction passed per kind of check, `Grade.by_kind`).
    `grader_error` says why the grader could not grade (then nothing is trained)."""

    task_id: str
    session_id: str
    session_ids: tuple[str, ...]
    status: str
    reward: float
    partial_score: float
    n_calls: int
    seconds: float
    checks: dict[str, float] = field(default_factory=dict)
    grader_error: str | None = None
    tool_parse_failures: int = 0  # calls whose text looked like a tool call none parsed
    # what its recorded calls sampled, read once when it ends (the step's figures and
    # the scheduler's staleness come from here, not from the ledger again)
    tokens: int = 0  # model tokens sampled
    tool_calls: int = 0  # tool calls its model turns made (subagents' included)
    oldest_version: int | None = None  # policy version of its oldest sampled token
    first_call_at: float | None = None  # its first call's start (time.time())
    last_call_at: float | None = None  # its last call's end
    node: str = ""  # the Ray node it ran on (`schedule.backend = "ray"`), else ""


def sampled_figures(calls: Sequence[Call]) -> dict[str, Any]:
    """An episode's sampled figures (`Episode.tokens` ...) from its recorded calls."""
    if not calls:
        return {}
    return {"tokens": sum(int(c.output_ids.shape[0]) for c in calls),
            "tool_calls": sum(len(c.tool_calls or ()) for c in calls),
            "oldest_version": min(c.policy_version for c in calls),
            "first_call_at": min(c.started_at for c in calls),
            "last_call_at": max(c.ended_at for c in calls)}


def new_session_id(phase: str, step: int, task_id: str, k: int) -> str:
    """`{phase}-{step}-{task}-{k}-{6 random hex}`: the random part keeps a session run
    again (an evaluation after a kill) apart from the first attempt in the ledger."""
    return f"{phase}-{step}-{task_id}-{k}-{uuid.uuid4().hex[:6]}"


_RANDOM_PART = re.compile(r"-[0-9a-f]{6}(?=(?:-sub\d+)*$)")


def seed_key(session_id: str) -> str:
    """What a session's sampling seeds derive from (`Gateway(seed_key=...)`): its id
    without the random part `new_session_id` adds (a subagent's `-subN` kept), so the
    session samples alike in every run of a seed, and when it runs again."""
    return _RANDOM_PART.sub("", session_id, count=1)


def _episode_sessions(tree: Mapping[str, str | None], known: Sequence[str]) -> list[str]:
    """The main session, then every recorded session below it (subagents: `tree`, from
    `LedgerStore.episode_tree`), then those the harness reported that the store does
    not link (kept for their statuses)."""
    out = list(tree)
    return out + [s for s in known if s not in tree]


def _outcomes(sessions: Sequence[str], main: str, result: HarnessResult,
              grade: Grade, abandoned: Mapping[str, list[str]]) -> list[Outcome]:
    """One outcome per session; subagents share the episode's reward; a grader error
    masks them all. `abandoned`: per resumed session, the recorded calls its resumed
    run did not ask for again (not trained: `tidal.tree.episode.abandoned`)."""
    out = []
    for sid in sessions:
        status, error = result.sessions.get(sid, (result.status, result.error))
        details: dict[str, object] = ({"checks": grade.details, "error": error} if sid == main
                                      else {"episode": main, "error": error})
        if abandoned.get(sid):
            details["abandoned_calls"] = abandoned[sid]
        if sid == main and result.log:
            details["harness_log"] = {k: v[-LOG_TAIL:] for k, v in result.log.items()}
        if sid == main and grade.extra:
            details["grader"] = grade.extra
        if grade.error is not None:
            details.update(grader_error=grade.error, harness_status=status)
            status = "infra_error"
        out.append(Outcome(session_id=sid, status=Status(status), reward=grade.reward,
                           partial_score=grade.partial_score, details=details))
    return out


class EpisodeHooks(Protocol):
    """What wraps each episode beyond the plain path: the seam preemption plugs into
    (`tidal.run.live.LiveRollouts`). The plain path's hooks do nothing."""

    def finished(self, task: Task, session_id: str) -> Episode | None:
        """An episode that already ended (a resumed group's), instead of running it."""
        ...

    def runtime(self, task: Task, session_id: str, limit_s: float
                ) -> contextlib.AbstractContextManager[tuple[ToolRuntime, float]]:
        """The episode's runtime (for `limit_s` seconds) and the wall clock the episode
        already used."""
        ...

    def abandoned(self, session_ids: Sequence[str]) -> dict[str, list[str]]:
        """Per session, recorded calls its run did not ask for again (not trained)."""
        ...

    def done(self, episode: Episode) -> None:
        """The episode ended and its outcomes are recorded."""
        ...


@dataclass(frozen=True)
class Plain:
    """The plain path: a fresh runtime of `runtimes`, nothing saved, nothing resumed."""

    runtimes: TaskRuntimes

    def finished(self, task: Task, session_id: str) -> Episode | None:
        return None

    @contextlib.contextmanager
    def runtime(self, task: Task, session_id: str, limit_s: float
                ) -> Iterator[tuple[ToolRuntime, float]]:
        with self.runtimes.runtime(task, limit_s) as runtime:
            yield runtime, 0.0

    def abandoned(self, session_ids: Sequence[str]) -> dict[str, list[str]]:
        return {}

    def done(self, episode: Episode) -> None:
        pass



@dataclass(frozen=True)
class Rollouts:
    """Where and how episodes run: the gateway's URL and model name, the harness, a
    fresh runtime per episode of the task's environment (`runtimes`), and the ledger
    that gets the outcomes. A task's time limit is `time_limit_s` when given
    (`agent.timeout_sec`), else its own, else `default_time_limit_s`. `log_dir`, when
    given, keeps each session's harness output (`<session>.stdout.txt`, `.stderr.txt`).
    `forget`, when given, is called with each session id of an episode once its
    outcomes are recorded (the in-process gateway's `forget_session`). `keys`, when
    given, is the gateway's `SessionKeys`: each episode gets a secret of its own as its
    harness's API key, good for its own sessions until the harness ends."""

    gateway_url: str
    model: str
    harness: Harness
    runtimes: TaskRuntimes
    store: LedgerStore
    default_time_limit_s: float = 60.0
    time_limit_s: float | None = None
    log_dir: Path | None = None
    forget: Callable[[str], object] | None = None
    keys: SessionKeys | None = None

    def limit(self, task: Task) -> float:
        return self.time_limit_s or task.time_limit_s or self.default_time_limit_s

    def one(self, task: Task, session_id: str, *, hooks: EpisodeHooks | None = None
            ) -> Episode:
        """Run, grade and record one episode (`hooks`: what wraps it, `EpisodeHooks`;
        None: the plain path)."""
        hooks = hooks or Plain(self.runtimes)
        t0 = time.perf_counter()
        ended = hooks.finished(task, session_id)
        if ended is not None:
            return ended
        try:
            with hooks.runtime(task, session_id, self.limit(task)) as (runtime, used), \
                    self._key(session_id) as key:
                ctx = EpisodeContext(self.gateway_url, session_id, self.model, task,
                                     runtime, self.limit(task),
                                     started=time.monotonic() - used, api_key=key)
                result, grade = run_task(self.harness, ctx)
        except Preempted:
            raise  # saved, to be resumed elsewhere: no outcome
        except Exception as e:  # the sandbox or the environment failed, not the agent
            self.store.append_outcome(Outcome(session_id, Status.INFRA_ERROR, 0.0, 0.0,
                                              {"error": f"{type(e).__name__}: {e}"}))
            self._forget([session_id])
            # a session that failed before its first call has nothing to train
            made = (session_id,) if self.store.has_session(session_id) else ()
            ep = Episode(task.task_id, session_id, made, "infra_error", 0.0, 0.0, 0,
                         time.perf_counter() - t0)
            hooks.done(ep)
            return ep
        self._keep_log(session_id, result)
        tree = self.store.episode_tree(session_id)  # one walk: metadata and outcomes
        self._note_subagents(session_id, tree)
        sessions = _episode_sessions(tree, list(result.sessions))
        status = result.status if self.store.has_session(session_id) else "infra_error"
        left = hooks.abandoned(sessions)
        # a session that failed before its first call has nothing to train: no outcome
        outcomes = [o for o in _outcomes(sessions, session_id, result, grade, left)
                    if self.store.has_session(o.session_id)]
        if outcomes:
            self.store.append_outcomes(outcomes)
        self._forget(sessions)
        logged = [sc.call for o in outcomes for sc in self.store.call_log(o.session_id).calls]
        ep = Episode(
            task_id=task.task_id, session_id=session_id,
            session_ids=tuple(o.session_id for o in outcomes), status=status,
            reward=grade.reward, partial_score=grade.partial_score, n_calls=len(logged),
            seconds=time.perf_counter() - t0, checks=grade.by_kind, grader_error=grade.error,
            tool_parse_failures=sum("tool_parse" in (c.metadata or {}) for c in logged),
            **sampled_figures(logged),
        )
        hooks.done(ep)
        return ep

    @contextlib.contextmanager
    def _key(self, session_id: str) -> Iterator[str]:
        """The episode's API key, closed when the episode ends."""
        if self.keys is None:
            yield API_KEY_PLACEHOLDER
            return
        key = self.keys.open(session_id)
        try:
            yield key
        finally:
            self.keys.close(key)

    def demonstrations(self, task: Task) -> list[Demonstration]:
        """The task's warm-start demonstrations. A task with an environment runs its
        solution in a fresh runtime made as its episodes' are, so the demonstrations hold
        the files, paths and tool outputs its rollouts will see."""
        if task.environment is None:
            return demonstrations(task)
        with self.runtimes.runtime(task, self.limit(task)) as runtime:
            return demonstrations(task, runtime=runtime)

    def _note_subagents(self, main: str, tree: Mapping[str, str | None]) -> None:
        """The episode's subagent sessions get its main session's metadata (the run
        recorded it before the episode started), each with its parent session."""
        root = self.store.session_meta([main]).get(main)
        if root is None:
            return
        below = {sid: replace(root, parent=parent)
                 for sid, parent in tree.items() if parent is not None}
        if below:
            self.store.record_meta(below)

    def _keep_log(self, session_id: str, result: HarnessResult) -> None:
        if self.log_dir is None or not result.log:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for stream, text in result.log.items():
            (self.log_dir / f"{session_id}.{stream}.txt").write_text(text, encoding="utf-8")

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
        hooks: EpisodeHooks | None = None,
    ) -> list[Episode]:
        """Run (task, session id) jobs on `workers` threads; results in job order. When
        an episode was preempted (`Preempted`), every other one ends first, then
        `Preempted` is raised. Any other exception here (a stop: `RunStopped`) starts no
        job that has not started; the running ones end before it propagates."""
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rollout") as pool:
            futures = [pool.submit(self.one, task, sid, hooks=hooks) for task, sid in jobs]
            episodes, preempted = [], None
            try:
                for f in futures:
                    try:  # every episode of a preempted group stops before the group does
                        ep = f.result()
                    except Preempted as e:
                        preempted = e
                        continue
                    if on_done is not None:
                        on_done(ep)
                    episodes.append(ep)
            except BaseException:
                for f in futures:
                    f.cancel()  # only those not started
                raise
        if preempted is not None:
            raise preempted
        return episodes

    def group(self, jobs: Sequence[tuple[Task, str]], *, base_version: int) -> RolloutResult:
        """One scheduled work item: a task group's episodes, all at once
        (`group_result`)."""
        return group_result(self.many(jobs, workers=len(jobs)), base_version)


def group_result(episodes: list[Episode], base_version: int) -> RolloutResult:
    """A task group's result for the scheduler: its episodes, the policy version of its
    oldest sampled token (relative to `base_version`, the engine's version when the
    scheduler started) and its model tokens."""
    versions = [e.oldest_version for e in episodes if e.oldest_version is not None]
    oldest = min(versions) - base_version if versions else None
    return RolloutResult(value=episodes, policy_version=oldest,
                         tokens=sum(e.tokens for e in episodes))
