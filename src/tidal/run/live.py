"""Preemption behind one seam: task groups saved as they run, resumed, migrated.

`LiveRollouts` wraps the plain `Rollouts` (`tidal.run.rollout`) with
`tidal.agent.preempt.LiveEpisodes`: each task group is saved while it runs (its jobs,
each episode's record and sandbox snapshots), so a run stopped mid-session resumes the
group where it was (`group(..., resume=key)`), and a live group can be stopped and moved
to another scheduler device (`preempt`, `RolloutMigrator`). The episodes themselves run
on the plain path; what preemption adds enters through `EpisodeHooks`: a resumed group's
finished episodes read back instead of run, the runtime restored from its snapshot with
the gateway replaying recorded calls, the calls a resumed session did not ask for again
left out of training, and each finished episode saved.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

from tidal.agent.command import CommandHarness
from tidal.agent.preempt import LiveEpisodes, Preempted, abandoned_calls
from tidal.agent.runtime import ToolRuntime
from tidal.agent.tasks import Task
from tidal.run.rollout import Episode, Rollouts, group_result, sampled_figures
from tidal.schedule.backend import RolloutResult, Work


class GroupPreempted(Exception):  # noqa: N818 - it names an event, as Preempted does
    """A task group stopped by `LiveRollouts.preempt`: `key` resumes it (`group(...,
    resume=key)`); its finished episodes are kept, the others continue from their
    snapshots."""

    def __init__(self, key: str) -> None:
        super().__init__(f"task group {key} was preempted")
        self.key = key


@dataclass(frozen=True)
class _GroupHooks:
    """The `EpisodeHooks` of one live task group (`key`), resumed or not."""

    rollouts: Rollouts
    live: LiveEpisodes
    key: str
    resume: bool

    def finished(self, task: Task, session_id: str) -> Episode | None:
        """A resumed group's episode that had finished: from its done file, else (killed
        between its outcomes and that file) from the ledger; None when it had not."""
        if not self.resume:
            return None
        f = self.live.root / self.key / f"{session_id}.done.json"
        with contextlib.suppress(OSError, ValueError, TypeError):
            d = json.loads(f.read_text())
            return Episode(**{**d, "session_ids": tuple(d["session_ids"])})
        store = self.rollouts.store
        o = store.outcome(session_id)
        if o is None:
            return None
        sessions = [s for s in store.episode_sessions(session_id) if store.outcome(s) is not None]
        calls = [sc.call for s in sessions for sc in store.call_log(s).calls]
        return Episode(task.task_id, session_id, tuple(sessions), o.status.value, o.reward,
                       o.partial_score, len(calls), 0.0, **sampled_figures(calls))

    def runtime(self, task: Task, session_id: str, limit_s: float
                ) -> contextlib.AbstractContextManager[tuple[ToolRuntime, float]]:
        # a harness whose tools run inside the sandbox cannot be snapshotted between its
        # tool calls: its resumed episode starts in a fresh sandbox
        return self.live.runtime(
            self.key, task, session_id, limit_s=limit_s, resume=self.resume,
            snapshots=not isinstance(self.rollouts.harness, CommandHarness))

    def abandoned(self, session_ids: Sequence[str]) -> dict[str, list[str]]:
        replay = self.live.replay if self.resume else None
        return {sid: abandoned_calls(replay, [sid]) for sid in session_ids}

    def done(self, episode: Episode) -> None:
        self.live.done(self.key, episode.session_id, asdict(episode))


class GroupRunner(Protocol):
    """Where the RL loop's task groups run (`tidal.run.queue.RolloutQueue`): in this
    process (`LiveRollouts`), or on a Ray cluster's rollout devices
    (`tidal.run.hosts.ClusterRollouts`). Every call and outcome of the group is in the
    run's ledger when `group` returns."""

    def group(self, jobs: Sequence[tuple[Task, str]], *, base_version: int,
              resume: str | None = None) -> RolloutResult:
        """Run a task group's episodes (`resume`: continue the live group of that key)."""
        ...


@dataclass(frozen=True)
class LiveRollouts:
    """`rollouts` whose task groups `episodes` saves as they run. `keep`: a group stays
    saved when it ends (its finished episodes are read back on resume) until its owner
    closes it (`episodes.close_group`), once what it trained is checkpointed."""

    rollouts: Rollouts
    episodes: LiveEpisodes
    keep: bool = False

    def group(self, jobs: Sequence[tuple[Task, str]], *, base_version: int,
              resume: str | None = None) -> RolloutResult:
        """A task group's episodes, all at once, saved while they run (`Rollouts.group`);
        `resume` (its key) continues one that a stopped run left live."""
        if resume is None:
            key = self.episodes.open_group([(t.task_id, sid) for t, sid in jobs])
        else:
            key = resume
            self.episodes.resuming(key)
        hooks = _GroupHooks(self.rollouts, self.episodes, key, resume is not None)
        try:
            eps = self.rollouts.many(jobs, workers=len(jobs), hooks=hooks)
        except Preempted:
            raise GroupPreempted(key) from None
        if not self.keep:
            self.episodes.close_group(key)
        return group_result(eps, base_version)

    def preempt(self, key: str) -> int:
        """Stop the live group `key` where it is: its episodes are saved and end at their
        next runtime operation; `group(...)` then raises `GroupPreempted`, and
        `group(..., resume=key)` continues it, here or in another process. Returns the
        episodes stopped."""
        return self.episodes.preempt(key)


class PreemptibleGroups(GroupRunner, Protocol):
    """A `GroupRunner` whose live groups can be stopped where they are (`LiveRollouts`)."""

    def preempt(self, key: str) -> int:
        """Stop the live group `key`: its `group(...)` raises `GroupPreempted`, and
        `group(..., resume=key)` continues it. Returns the episodes stopped."""
        ...


@dataclass(frozen=True)
class RolloutMigrator:
    """Moves a live task group between scheduler devices (`tidal.schedule.backend.
    Migrator`): `preempt` saves and stops it (`LiveRollouts.preempt`), `resumed` is the
    work that continues it (`LiveRollouts.group(..., resume=key)`). A group's key is its
    first session id (`LiveEpisodes.open_group`): the first of the jobs its work runs
    (`work.args[0]`; the dynamic sampling's work keeps them on the roll it is on)."""

    rollouts: PreemptibleGroups

    @staticmethod
    def key(work: Work) -> str:
        jobs = work.args[0]
        return str(jobs[0][1])

    def preempt(self, work: Work) -> None:
        self.rollouts.preempt(self.key(work))

    def resumed(self, work: Work) -> Work:
        return Work(work.fn, work.args, {**work.kwargs, "resume": self.key(work)},
                    pass_context=work.pass_context)
