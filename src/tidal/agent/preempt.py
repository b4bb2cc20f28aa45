"""Preemption without loss: live episodes snapshotted, then resumed and fast-forwarded.

An hour-long session killed with its process (a preempted machine, a SIGKILLed `tidal
run`) is the expensive thing to lose. `LiveEpisodes` keeps, for every live episode of a
run, what it takes to continue it elsewhere, and resumes it:

- **Saved while it runs** (under one directory, `RUN_DIR/live/` in `tidal run`):
  `<group>/group.json` (the task group's (task, session) jobs), `<group>/<sid>.json` (an
  `EpisodeRecord`: wall clock used, model calls seen, snapshots taken) and, for a runtime
  that takes snapshots, `<group>/<sid>.tar`: its snapshot (a bubblewrap sandbox's
  writable layer, or a JSON file naming a container's committed image; either with the
  log of every operation and its result, `tidal.sandbox.oplog`), taken every
  `every_calls` model calls of the episode (its subagents' included) or `every_s`
  seconds, on a background thread. A snapshot waits for a running command to end; the
  harness never waits for it except there. A finished episode leaves
  `<group>/<sid>.done.json` until its group is done; its snapshot is discarded
  (`TaskRuntimes.discard`: a container snapshot's image too).
- **Resumed** (`runtime(..., resume=True)`): the runtime is restored from the snapshot
  (`TaskRuntimes.restored`; made fresh when there is none), the gateway puts the
  episode's sessions in replay mode (`tidal.gateway.replay`), and the harness runs
  again from the start. Its model calls already recorded come back from the ledger
  (same prompt ids, same answer, nothing recorded), its operations up to the snapshot
  from the runtime's log (nothing run twice: the files already hold their effects);
  operations after the snapshot run again, once, on the restored files; after the last
  recorded call the session is live. The episode's wall clock goes on from what it had
  used.

This is exact for harnesses that are deterministic given the same model answers and
operation results and whose tools all act through `ctx.runtime`: the built-in harness,
`module:attr` function harnesses, mini-swe-agent on `tidal.agent.minisweagent`. A
harness that runs inside the sandbox (`CommandHarness`; `Rollouts` takes no snapshots
between its tool calls) cannot be fast-forwarded without its process memory (no CRIU on
this kernel): its episode resumes in a fresh sandbox, its commands run again from the start, and its
model calls are replayed for as long as its prompts match the recorded ones.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import shutil
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from tidal.agent.environment import TaskRuntimes
from tidal.agent.runtime import RuntimeToolError, ToolRuntime
from tidal.agent.tasks import Task, TaskError
from tidal.ledger import LedgerStore
from tidal.ledger.types import Call
from tidal.sandbox.types import ExecResult, SandboxError

GROUP_FILE = "group.json"
SNAPSHOT_SUFFIX = ".tar"  # <group>/<sid>.tar: the runtime's snapshot file (its own format)


class Preempted(BaseException):
    """Raised in a preempted episode's thread at its next runtime operation, after its
    state was saved (`LiveEpisodes.preempt`). A BaseException, so that a harness's
    `except Exception` does not take it for a tool error."""


class _Guarded:
    """The episode's runtime, refusing every operation once the episode is preempted."""

    def __init__(self, runtime: ToolRuntime, live: _Live) -> None:
        self._rt, self._live = runtime, live

    def _check(self) -> None:
        if self._live.preempted:
            raise Preempted(self._live.record.session_id)

    def exec(self, command: str, timeout_s: float, *,
             env: Mapping[str, str] | None = None) -> ExecResult:
        self._check()
        return self._rt.exec(command, timeout_s, env=env)

    def read_file(self, path: str) -> str:
        self._check()
        return self._rt.read_file(path)

    def write_file(self, path: str, text: str) -> None:
        self._check()
        self._rt.write_file(path, text)

    def list(self, path: str) -> builtins.list[str]:
        self._check()
        return self._rt.list(path)

    def upload(self, src: Path, dest: str) -> None:
        self._check()
        self._rt.upload(src, dest)

    @property
    def can_snapshot(self) -> bool:
        return self._rt.can_snapshot

    def snapshot(self, path: Path) -> None:
        self._rt.snapshot(path)

    def end_agent(self, carry: Sequence[str] | None) -> str:
        """No snapshot after this: a preempted grade resumes from the agent's last one."""
        self._check()
        self._live.can_snapshot = False
        return self._rt.end_agent(carry)


class ReplayProgress(Protocol):
    """How far a replayed session got (`tidal.gateway.replay.ReplayStatus`)."""

    @property
    def left(self) -> tuple[str, ...]:
        """Its recorded calls never asked for again, in record order."""
        ...


class ReplayControl(Protocol):
    """What resuming needs of the gateway (`tidal.gateway.core.Gateway`)."""

    def replay(self, session_ids: Sequence[str]) -> int: ...

    def replay_status(self, session_id: str) -> ReplayProgress | None: ...


@dataclass(frozen=True)
class SnapshotPolicy:
    """When a live episode's sandbox is snapshotted: every `every_calls` model calls
    (0: not by count) and every `every_s` seconds (0: not by time)."""

    every_calls: int = 10
    every_s: float = 300.0

    def __post_init__(self) -> None:
        if self.every_calls < 0 or self.every_s < 0:
            raise ValueError("snapshot intervals must be >= 0 (0 turns one off)")


@dataclass(frozen=True)
class EpisodeRecord:
    """What a live episode has saved: its task, the wall clock it had used at the last
    save, the model calls seen, and how many snapshots were taken (the newest is
    `<sid>.tar`)."""

    session_id: str
    task_id: str
    elapsed_s: float = 0.0
    calls: int = 0
    snapshots: int = 0
    snapshot_s: float = 0.0  # seconds spent writing snapshots, all of them


@dataclass(frozen=True)
class LiveGroup:
    """A task group that was live when its run stopped: its jobs, the episodes that had
    finished (their `done` payloads), the records of the others, and those of them with
    a sandbox snapshot to continue from (a kill between writing a snapshot and its
    record leaves the record a snapshot short: the snapshot on disk is what counts)."""

    key: str
    jobs: tuple[tuple[str, str], ...]  # (task id, session id)
    done: dict[str, dict[str, Any]]
    records: dict[str, EpisodeRecord]
    snapshotted: frozenset[str] = frozenset()


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


@dataclass
class _Live:
    """One episode being watched: its runtime, its record, when it started."""

    group: str
    record: EpisodeRecord
    runtime: ToolRuntime
    started: float
    can_snapshot: bool
    since: int = 0  # calls since the last save
    last: float = field(default_factory=time.monotonic)
    busy: bool = False
    closed: bool = False
    preempted: bool = False


class LiveEpisodes:
    """The live episodes of one run, saved under `root` (see the module doc)."""

    def __init__(self, root: Path, store: LedgerStore, replay: ReplayControl | None,
                 runtimes: TaskRuntimes, policy: SnapshotPolicy | None = None) -> None:
        self.root = Path(root)
        self.store = store
        self.replay = replay
        self.runtimes = runtimes
        self.policy = policy or SnapshotPolicy()
        self._lock = threading.Condition()
        self._live: dict[str, _Live] = {}  # main session id -> episode
        self._owner: dict[str, str] = {}  # session id (main or subagent) -> main session id
        self._due: list[str] = []
        self._stopped: set[str] = set()  # preempted groups: episodes may not start
        self._halted = False  # stop_all: no episode may start
        self._stop = False
        self._thread: threading.Thread | None = None
        # seconds in snapshots in this process (waiting for a running command included)
        self.snapshot_s = 0.0
        self.snapshots = 0
        self.failures = 0  # snapshots that failed (warned; the episode goes on)

    # ---------------------------------------------------------------- groups

    def open_group(self, jobs: Sequence[tuple[str, str]]) -> str:
        """Start saving a task group; returns its key (its first session id)."""
        key = jobs[0][1]
        d = self.root / key
        d.mkdir(parents=True, exist_ok=True)
        _write_json(d / GROUP_FILE, {"jobs": [list(j) for j in jobs]})
        return key

    def close_group(self, key: str) -> None:
        """The group finished (every outcome recorded): nothing of it is live any more."""
        d = self.root / key
        if d.is_dir():
            for snap in d.glob(f"*{SNAPSHOT_SUFFIX}"):
                self._discard(snap)
        shutil.rmtree(d, ignore_errors=True)

    def done(self, key: str, session_id: str, payload: dict[str, Any]) -> None:
        """An episode of the group finished with `payload` (what the group returns)."""
        d = self.root / key
        if d.is_dir():
            _write_json(d / f"{session_id}.done.json", payload)
            self._discard(d / f"{session_id}{SNAPSHOT_SUFFIX}")
            (d / f"{session_id}.json").unlink(missing_ok=True)

    def pending(self) -> list[LiveGroup]:
        """Groups a stopped run left live, oldest first. A group directory without a
        readable group.json (killed while it was written) is removed: none of its
        episodes had started."""
        out: list[LiveGroup] = []
        if not self.root.is_dir():
            return out
        for d in sorted(self.root.iterdir(), key=lambda p: p.stat().st_mtime):
            try:
                jobs = tuple((str(t), str(s)) for t, s in
                             json.loads((d / GROUP_FILE).read_text())["jobs"])
            except (OSError, ValueError, KeyError, TypeError):
                shutil.rmtree(d, ignore_errors=True)
                continue
            done, records = {}, {}
            for _task, sid in jobs:
                with contextlib.suppress(OSError, ValueError):
                    done[sid] = json.loads((d / f"{sid}.done.json").read_text())
                    continue
                with contextlib.suppress(OSError, ValueError, TypeError):
                    records[sid] = EpisodeRecord(**json.loads((d / f"{sid}.json").read_text()))
            snapshotted = frozenset(
                sid for _task, sid in jobs
                if sid not in done and (d / f"{sid}{SNAPSHOT_SUFFIX}").is_file())
            out.append(LiveGroup(d.name, jobs, done, records, snapshotted))
        return out

    # ---------------------------------------------------------------- episodes

    @contextlib.contextmanager
    def runtime(
        self, group: str, task: Task, session_id: str, *, limit_s: float | None = None,
        resume: bool = False, snapshots: bool = True,
    ) -> Iterator[tuple[ToolRuntime, float]]:
        """The episode's runtime (`runtimes.runtime(task, limit_s)`) and the wall clock
        it already used, watched for snapshots while inside. `resume`: restore the saved
        runtime (a fresh one when there is none, or `snapshots` is False) and replay the
        recorded calls. `snapshots=False` for a harness whose tools do not all act
        through the runtime (see the module doc)."""
        d = self.root / group
        with self._lock:
            if self._halted or (group in self._stopped and not resume):
                raise Preempted(session_id)  # its group stopped before it started
        record = EpisodeRecord(session_id, task.task_id)
        saved = d / f"{session_id}{SNAPSHOT_SUFFIX}"
        if resume:
            with contextlib.suppress(OSError, ValueError, TypeError):
                record = EpisodeRecord(**json.loads((d / f"{session_id}.json").read_text()))
            if self.replay is not None:
                self.replay.replay(self.store.episode_sessions(session_id))
        with contextlib.ExitStack() as stack:
            rt: ToolRuntime | None = None
            if resume and snapshots and saved.exists():
                try:
                    rt = stack.enter_context(self.runtimes.restored(task, saved, limit_s))
                except (SandboxError, TaskError, RuntimeToolError, OSError) as e:
                    # e.g. a container snapshot taken on another node's engine: the episode
                    # starts again in a fresh runtime, its recorded model calls replayed
                    warnings.warn(f"live episode {session_id}: its snapshot {saved} cannot be "
                                  f"restored here ({e}); it starts in a fresh runtime",
                                  RuntimeWarning, stacklevel=3)
            if rt is None:
                self._discard(saved)
                record = replace(record, snapshots=0)
                rt = stack.enter_context(self.runtimes.runtime(task, limit_s))
            live = _Live(group, record, rt, time.monotonic() - record.elapsed_s,
                         can_snapshot=snapshots and rt.can_snapshot)
            if d.is_dir():
                self._save(live, snapshot=False)
            with self._lock:
                self._live[session_id] = live
                self._owner[session_id] = session_id
            self._ensure_thread()
            try:
                yield _Guarded(rt, live), record.elapsed_s
            finally:
                with self._lock:
                    live.closed = True
                    while live.busy:
                        self._lock.wait()
                    self._live.pop(session_id, None)
                    for k in [k for k, v in self._owner.items() if v == session_id]:
                        del self._owner[k]

    def note_call(self, call: Call) -> None:
        """A model call was recorded (the gateway's `on_record` hook): count it for its
        episode (a subagent's for its parent's) and ask for a snapshot when one is due."""
        n = self.policy.every_calls
        with self._lock:
            main = self._owner.get(call.session_id)
            if main is None and call.parent_session_id is not None:
                main = self._owner.get(call.parent_session_id)
                if main is not None:
                    self._owner[call.session_id] = main
            live = self._live.get(main) if main is not None else None
            if main is None or live is None or live.closed:
                return
            live.since += 1
            live.record = replace(live.record, calls=live.record.calls + 1)
            if n and live.since >= n and main not in self._due:
                self._due.append(main)
                self._lock.notify_all()

    def snapshot_now(self, session_id: str) -> bool:
        """Save a live episode now (its sandbox too, when it can); False when it is not
        live here."""
        with self._lock:
            live = self._live.get(session_id)
            if live is None or live.closed:
                return False
            while live.busy:
                self._lock.wait()
            live.busy = True
        try:
            self._save(live, snapshot=live.can_snapshot)
        finally:
            with self._lock:
                live.busy = False
                self._lock.notify_all()
        return True

    def preempt(self, group: str) -> int:
        """Save every live episode of `group` now (sandbox snapshot after any running
        operation) and stop it: its next runtime operation raises `Preempted`, and the
        episode ends without an outcome, to be resumed (`runtime(..., resume=True)`).
        Returns the number of episodes preempted."""
        with self._lock:
            self._stopped.add(group)
            lives = [lv for lv in self._live.values() if lv.group == group and not lv.closed]
            for lv in lives:
                lv.preempted = True
        for lv in lives:
            self.snapshot_now(lv.record.session_id)
        return len(lives)

    def stop_all(self) -> int:
        """The run is stopping: every live episode is saved as `preempt` saves it and
        stopped, and none may start from now on. An episode whose sandbox cannot be
        snapshotted (a command harness's) keeps its record only: it resumes in a fresh
        sandbox, its recorded calls replayed. Returns the episodes stopped."""
        with self._lock:
            self._halted = True
            lives = [lv for lv in self._live.values() if not lv.closed]
            for lv in lives:
                lv.preempted = True
                self._stopped.add(lv.group)
        for lv in lives:
            if lv.can_snapshot:
                self.snapshot_now(lv.record.session_id)
            else:
                self._save(lv, snapshot=False)
        return len(lives)

    def resuming(self, group: str) -> None:
        """`group` continues (after `preempt`, once its stopped work has ended)."""
        with self._lock:
            self._stopped.discard(group)

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)

    # ---------------------------------------------------------------- internals

    def _save(self, live: _Live, *, snapshot: bool) -> None:
        d = self.root / live.group
        if not d.is_dir():
            return  # the group is done
        sid = live.record.session_id
        took = 0.0
        if snapshot:
            t0 = time.perf_counter()
            # a closing runtime: skip (the episode ends; its last snapshot stands)
            with contextlib.suppress(SandboxError, RuntimeToolError, TaskError, OSError):
                live.runtime.snapshot(d / f"{sid}{SNAPSHOT_SUFFIX}")
                took = time.perf_counter() - t0
                self.snapshots += 1
                self.snapshot_s += took
        with self._lock:  # note_call updates the same record from the gateway's threads
            live.record = record = replace(
                live.record, elapsed_s=time.monotonic() - live.started,
                snapshots=live.record.snapshots + bool(took),
                snapshot_s=live.record.snapshot_s + took)
            live.since, live.last = 0, time.monotonic()
        if d.is_dir():
            _write_json(d / f"{sid}.json", asdict(record))

    def _discard(self, snapshot: Path) -> None:
        """A snapshot no longer needed, with what it holds outside its file (a container
        snapshot's image). A failure is warned, not raised (the episode is done), and
        the file is kept, so that closing the group tries again."""
        if not snapshot.exists():
            return
        try:
            self.runtimes.discard(snapshot)
        except Exception as e:
            warnings.warn(f"discarding snapshot {snapshot} failed: {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=2)
            return
        snapshot.unlink(missing_ok=True)

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None and (self.policy.every_calls or self.policy.every_s):
                self._thread = threading.Thread(target=self._run, name="tidal-snapshots",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        every_s = self.policy.every_s
        while True:
            with self._lock:
                if self._stop:
                    return
                if not self._due:
                    self._lock.wait(timeout=min(every_s, 5.0) if every_s else None)
                now = time.monotonic()
                due = list(self._due)
                self._due.clear()
                if every_s:
                    due += [s for s, lv in self._live.items()
                            if now - lv.last >= every_s and s not in due]
            for sid in due:
                try:
                    self.snapshot_now(sid)
                except Exception as e:  # a full disk, a broken sandbox: the next one may do
                    self.failures += 1
                    warnings.warn(f"snapshot of live episode {sid} failed: "
                                  f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=1)


def abandoned_calls(replay: ReplayControl | None, session_ids: Sequence[str]) -> list[str]:
    """Recorded calls of resumed sessions that the resumed run never asked for again (a
    branch it did not take), in record order."""
    if replay is None:
        return []
    out: list[str] = []
    for sid in session_ids:
        st = replay.replay_status(sid)
        if st is not None:
            out += list(st.left)
    return out
