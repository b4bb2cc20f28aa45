"""The RL step's input: task draws, and the rollout queue that turns them into batches.

`TaskDraws` says which task each scheduled group runs: each step draws its batch with a
generator of its own, seeded by (run seed, step), so a resumed run draws what the
uninterrupted one did. `RolloutQueue` owns everything between those draws and a trained
step: it queues task groups on the scheduler as late as the staleness bound allows,
resumes the groups a killed attempt left live, replaces groups dropped as stale or
failed, rolls again on a fresh task a group whose samples all scored alike (DAPO's
dynamic sampling, `rollout.dynamic_sampling`), and yields each step's `Batch` of
finished groups, in memory. The ledger is the
durable record of what the groups sampled, not the channel the batch comes through.
"""

from __future__ import annotations

import random
import resource
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

from tidal.agent.preempt import LiveEpisodes, LiveGroup
from tidal.agent.tasks import Task
from tidal.ledger import LedgerStore, Outcome, SessionMeta, Status
from tidal.run.live import GroupRunner
from tidal.run.progress import RunLog
from tidal.run.rollout import Episode, new_session_id, seed_key
from tidal.schedule.backend import RolloutResult, Work
from tidal.schedule.curriculum import TaskSignal, sample_batch
from tidal.schedule.scheduler import RolloutScheduler, Sample


def cpu_seconds() -> float:
    """The process's user and system CPU seconds so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class TaskDraws:
    """The tasks of each RL step's groups, drawn batch by batch from `pool`
    (`rollout.task_sampling`) with a generator seeded by (seed, step). A task whose group
    a killed attempt left live for a step is skipped once in that step's draws (`skip`):
    the group resumes instead."""

    def __init__(self, pool: Sequence[Task], *, seed: int, batch: int, sampling: str) -> None:
        self._pool = list(pool)
        self._ids = [t.task_id for t in pool]
        self._families = [t.family for t in pool]
        self._seed, self._batch, self._sampling = seed, batch, sampling
        self._plans: dict[int, tuple[random.Random, deque[Task]]] = {}
        self._skip: dict[int, set[str]] = {}

    def skip(self, step: int, task_id: str) -> None:
        self._skip.setdefault(step, set()).add(task_id)

    def next(self, step: int, signal: TaskSignal) -> Task:
        """The step's next task, weighted by what the steps so far taught (`signal`)."""
        rng, left = self._plans.setdefault(
            step, (random.Random(f"{self._seed}/rl/{step}"), deque()))
        while True:
            if not left:
                left.extend(sample_batch(rng, self._pool, self._ids, self._batch,
                                         sampling=self._sampling, signal=signal,
                                         families=self._families))
            task = left.popleft()
            if task.task_id in self._skip.get(step, set()):
                self._skip[step].discard(task.task_id)
                continue
            return task

    def fresh(self, step: int, group: int, attempt: int, like: Task) -> Task | None:
        """Another task of `like`'s family, for the `attempt`-th roll again of the step's
        `group`-th group (dynamic sampling), drawn with a generator of its own: what it
        draws does not depend on which group finished first. None when the family has
        no other task."""
        same = [t for t in self._pool if t.family == like.family and t.task_id != like.task_id]
        if not same:
            return None
        return random.Random(f"{self._seed}/rl/{step}/{group}/{attempt}").choice(same)


@dataclass(frozen=True)
class Batch:
    """One RL step's finished task groups. `episodes` in seed-key order (a seed trains
    alike whatever finished first); `carry`: sessions a killed attempt committed and never
    trained; `gone`: every group dropped as stale or failed so far in this run, with
    `gone_sessions` their main sessions; `replaced`: groups whose samples all scored
    alike, rolled again on a fresh task since the last batch (dynamic sampling: their
    task, rewards and sessions, recorded and never trained); `waited_s`: how long the
    trainer waited for the batch, from the end of the last step."""

    step: int
    groups: tuple[Sample, ...]
    episodes: tuple[Episode, ...]
    carry: tuple[str, ...]
    gone: tuple[int, ...]
    gone_sessions: tuple[str, ...]
    waited_s: float
    started: float  # perf_counter() when the wait began
    cpu_started: float  # the process's CPU seconds then
    replaced: tuple[Replaced, ...] = ()

    @property
    def sessions(self) -> list[str]:
        """What the step trains: every session of its episodes, then the carried ones."""
        return [s for e in self.episodes for s in e.session_ids] + list(self.carry)

    @property
    def group_rewards(self) -> list[tuple[str, list[float]]]:
        """Each group's task and rewards, the replaced ones' too (what the task
        statistics learn from)."""
        return [(g.value[0].task_id, [e.reward for e in g.value]) for g in self.groups
                if g.value] + [(r.task_id, list(r.rewards)) for r in self.replaced]

    @property
    def untrained(self) -> tuple[str, ...]:
        """Sessions recorded for this batch and never to be trained: the dropped groups'
        main sessions and the replaced groups' sessions."""
        return self.gone_sessions + tuple(s for r in self.replaced for s in r.sessions)


@dataclass(frozen=True)
class Replaced:
    """A task group that dynamic sampling rolled again: all its samples scored alike."""

    task_id: str
    rewards: tuple[float, ...]
    sessions: tuple[str, ...]


class RolloutQueue:
    """Task groups on the scheduler, batch by batch, for `steps` RL steps from
    `first_step`. Groups are queued as late as the staleness bound allows (K + 1 batches
    ahead), so each batch's tasks are drawn with the latest task statistics; a batch is
    never closed early. Use as a context manager (it runs the scheduler), iterate the
    batches, and call `trained` once a batch's step is checkpointed and `refill` once
    the step is over."""

    def __init__(self, sched: RolloutScheduler, groups: GroupRunner, live: LiveEpisodes,
                 store: LedgerStore, draws: TaskDraws, *,
                 steps: int, first_step: int, tasks_per_step: int, group_size: int,
                 max_staleness: int, base_version: int, trained: set[str],
                 carry: Sequence[str], tasks: Sequence[Task], log: RunLog,
                 resample: int = 0,
                 train_reward: Callable[[float], float] = float) -> None:
        self._sched, self._draws = sched, draws
        self._store, self._live = store, live
        self._roll = partial(groups.group, base_version=base_version)
        self._b, self._g, self._k = tasks_per_step, group_size, max_staleness
        self._origin = first_step  # the step this attempt starts from
        self._step, self._steps = first_step, steps
        self._trained = trained
        self._carry = tuple(sorted(carry, key=seed_key))
        self._tasks = {t.task_id: t for t in tasks}
        self._log = log
        # scheduled group -> its sessions (the last roll's, under dynamic sampling)
        self._group_sids: dict[int, list[str]] = {}
        self._resample = resample
        self._train_reward = train_reward  # what RL trains on (rl.reward): alike under it
        self._lock = threading.Lock()  # rolls again run in the scheduler's threads
        self._replaced: list[Replaced] = []
        self._attempts: dict[int, int] = {}  # scheduled group -> times rolled again
        self._todo = steps * tasks_per_step  # groups still to queue
        self._lost = 0  # groups dropped as stale or failed, replaced so far

    def __enter__(self) -> RolloutQueue:
        self._sched.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._sched.__exit__(*exc)

    def start(self, resumed: list[LiveGroup], signal: TaskSignal) -> None:
        """Queue the groups a killed attempt left live, then the first batches."""
        self._todo -= self._resume(resumed)
        self._queue(max(0, (self._k + 1) * self._b - len(self._group_sids)), signal)

    def batches(self) -> Iterator[Batch]:
        groups: list[Sample] = []
        t0, cpu0 = time.perf_counter(), cpu_seconds()
        for mb in self._sched.iter_batches(steps=self._steps, flush=False):
            groups.extend(mb.samples)
            if not mb.done():
                continue  # the batch fills as groups finish (streaming)
            waited = time.perf_counter() - t0
            gone = tuple(self._sched.dropped() + [f.session for f in self._sched.failed()])
            with self._lock:
                replaced, self._replaced = tuple(self._replaced), []
            yield Batch(
                step=self._step + 1, groups=tuple(groups),
                episodes=tuple(sorted((e for grp in groups for e in grp.value),
                                      key=lambda e: seed_key(e.session_id))),
                carry=self._carry, gone=gone,
                gone_sessions=tuple(s for i in gone for s in self._group_sids[i]),
                waited_s=waited, started=t0, cpu_started=cpu0, replaced=replaced)
            self._step += 1
            groups, self._carry = [], ()
            t0, cpu0 = time.perf_counter(), cpu_seconds()

    def trained(self, batch: Batch) -> None:
        """The batch's step is checkpointed: its groups (and the dropped ones) need no
        resuming."""
        for i in [grp.session for grp in batch.groups] + list(batch.gone):
            self._live.close_group(self._group_sids[i][0])

    def refill(self, batch: Batch, signal: TaskSignal) -> None:
        """The step is over: publish the version, queue the next batch, and replace the
        groups dropped since the last step, so every remaining step's batch is full."""
        self._sched.step_done()
        self._queue(self._b, signal)
        if len(batch.gone) > self._lost:
            self._submit(len(batch.gone) - self._lost, signal)
            self._lost = len(batch.gone)

    def summary(self) -> dict[str, object]:
        return self._sched.metrics()

    # ------------------------------------------------------------------ internals

    def _queue(self, n: int, signal: TaskSignal) -> None:
        k = min(n, self._todo)
        self._todo -= k
        if k:
            self._submit(k, signal)

    def _submit(self, n: int, signal: TaskSignal) -> None:
        """Queue n task groups; each session is recorded with the step its group was
        planned for, its task and sample index (`SessionMeta`)."""
        works: list[list[tuple[Task, str]]] = []
        metas: dict[str, SessionMeta] = {}
        done = len(self._group_sids)
        for i in range(done, done + n):
            step = self._origin + i // self._b + 1
            task = self._draws.next(step, signal)
            jobs = [(task, new_session_id("rl", step, task.task_id, k)) for k in range(self._g)]
            metas.update((sid, SessionMeta("rl", step, task.task_id, k))
                         for k, (_t, sid) in enumerate(jobs))
            works.append(jobs)
        self._store.record_meta(metas)  # before any of them runs
        held = [[sid for _, sid in jobs] for jobs in works]
        if self._resample:
            steps = [self._origin + i // self._b + 1 for i in range(done, done + n)]
            ids = self._sched.submit_many(
                Work(self._informative, (jobs, step, i, sids))
                for jobs, step, i, sids in zip(works, steps, range(done, done + n), held,
                                               strict=True))
        else:
            ids = self._sched.submit_many(Work(self._roll, (jobs,)) for jobs in works)
        self._group_sids.update(zip(ids, held, strict=True))

    def _informative(self, jobs: list[tuple[Task, str]], step: int, group: int,
                     sids: list[str], resume: str | None = None) -> RolloutResult:
        """One scheduled group under dynamic sampling: rolled again on a fresh task of
        the same family while all its samples score alike, `rollout.dynamic_sampling`
        times at most (then the last roll stands). `jobs` and `sids` follow the roll the
        group is on, in place: a live group moved to another device
        (`tidal.run.live.RolloutMigrator`, whose key is `jobs`' first session) continues
        that roll (`resume`, its key), and its rolls again go on from there. A kill
        between a roll again and the step's checkpoint leaves the replaced sessions
        committed and untrained: the resumed run carries them into its first batch."""
        res = self._roll(list(jobs), resume=resume)
        while (attempt := self._attempts.get(group, 0) + 1) <= self._resample:
            episodes: list[Episode] = res.value
            task = self._draws.fresh(step, group, attempt, like=jobs[0][0])
            if len({self._train_reward(e.reward) for e in episodes}) > 1 or task is None:
                break
            self._live.close_group(jobs[0][1])  # finished: nothing of it to resume
            with self._lock:
                self._attempts[group] = attempt
                self._replaced.append(Replaced(
                    jobs[0][0].task_id, tuple(e.reward for e in episodes),
                    tuple(s for e in episodes for s in e.session_ids)))
            jobs[:] = [(task, new_session_id("rl", step, task.task_id, k))
                       for k in range(self._g)]
            self._store.record_meta({sid: SessionMeta("rl", step, task.task_id, k)
                                     for k, (_t, sid) in enumerate(jobs)})
            sids[:] = [sid for _, sid in jobs]
            res = self._roll(list(jobs))
        return res

    def _resume(self, pending: list[LiveGroup]) -> int:
        """Queue the groups a killed attempt left live, first: their episodes continue
        from their snapshots (`tidal.agent.preempt`). A group whose task this run does
        not have is closed (infra_error)."""
        works, keys = [], []
        for grp in pending:
            if all(sid in self._trained for _t, sid in grp.jobs):  # trained before the kill
                self._live.close_group(grp.key)
                continue
            if any(t not in self._tasks for t, _sid in grp.jobs):
                close_sessions(self._store, [sid for _t, sid in grp.jobs],
                               "its task is not in this run")
                self._live.close_group(grp.key)
                continue
            works.append([(self._tasks[t], sid) for t, sid in grp.jobs])
            keys.append(grp.key)
            meta = self._store.session_meta([grp.jobs[0][1]]).get(grp.jobs[0][1])
            if meta is not None and meta.phase == "rl":
                self._draws.skip(meta.step, grp.jobs[0][0])
        ids = self._sched.submit_many(Work(self._roll, (jobs,), {"resume": key})
                                      for jobs, key in zip(works, keys, strict=True))
        self._group_sids.update((i, [sid for _, sid in jobs])
                                for i, jobs in zip(ids, works, strict=True))
        if works:  # what was resumed, and how many episodes continue from a snapshot
            self._log.metrics({"phase": "resume", "step": self._origin, "groups": len(works),
                               "episodes": sum(len(j) for j in works),
                               "episodes_done": sum(len(g.done) for g in pending),
                               "snapshots": sum(len(g.snapshotted) for g in pending)})
        return len(works)


def close_sessions(store: LedgerStore, session_ids: Sequence[str], why: str) -> None:
    """infra_error outcomes for recorded sessions that have none (masked, not punished)."""
    have = store.outcomes(session_ids)
    store.append_outcomes([Outcome(sid, Status.INFRA_ERROR, 0.0, 0.0, {"error": why})
                           for sid in session_ids
                           if store.has_session(sid) and sid not in have])
