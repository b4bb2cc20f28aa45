"""Preemption benchmark: what snapshotting and resuming a long agent session costs.

Issue 24 asks for the price of preemption without loss (`tidal.agent.preempt`): the
seconds to snapshot, restore and fast-forward a 200-call session, and what periodic
snapshots add to a run. This bench measures them on the real stack: the built-in harness
talks to a `GatewayServer` on loopback, calls are recorded in a real ledger, commands run
in a real bubblewrap sandbox, `LiveEpisodes` snapshots it on its background thread, and
`LiveRollouts.group(..., resume=key)` resumes it. Only the model is scripted
(tests/gateway/scripted_engine.py, temperature 0): a deterministic policy whose call k
(k <= N) is the k-th bash command and whose call N+1 is finish. Command k appends to
log.txt a line that counts the lines before it, writes a 3.6 KB file, every 5th command
edits an earlier file with sed and every 7th greps them all; the commands are not
idempotent, and the grader gives reward 1 only when log.txt holds exactly one run of each.
The context budget is past the session's length (about 150 tokens a turn): no
compaction, the N+1 calls are one context chain.

Figures (seconds; the median of --repeats runs, with min and max; `meaning` in the JSON
says what each one is):
- live: the whole episode with `LiveEpisodes` but no snapshots (every_calls=0,
  every_s=0), wall and CPU, and where the seconds go (harness client, HTTP, gateway,
  sandbox); with --no-live also the episode without `LiveEpisodes` at all;
- periodic: the same episode with a snapshot every 10 and every 1 model calls: the added
  wall and CPU time and fraction, `LiveEpisodes.snapshots` / `snapshot_s`, and how much of
  snapshot_s is waiting for a running command versus holding the sandbox frozen;
- snapshot / restore: `Sandbox.snapshot` of the episode's sandbox after grading (bytes,
  log length) and `Sandbox.restore` of it, then the episode's operations answered from
  its log;
- fast_forward: a child process runs the episode (a snapshot every 10 calls) and, inside
  the engine's call N+1 (before it is recorded), takes one more snapshot and sleeps; it
  is SIGKILLed there. Each repeat resumes a copy of its ledger and live directory in this
  process: the time from `LiveRollouts.group(..., resume=key)` until the engine is first asked
  for a call (all N recorded calls replayed), the whole resumed episode, the calls the
  engine generated (1: the unrecorded finish) and the calls recorded twice (0);
- tidal_run (--tidal-run, about 2 minutes more): two short `tidal run`s of the tiny
  model with rollout.snapshot_every=1 and 0.

The model being free, the live episode's seconds are the stack's own (sandbox commands,
the harness's client, HTTP, gateway); with a real model each call would add its
generation time to live and to nothing in fast_forward.

Run (needs bubblewrap and overlayfs, as bench/sandbox.py):

    .venv/bin/python bench/preempt.py --json                         # 200 calls, 3 repeats
    .venv/bin/python bench/preempt.py --json --no-live --tidal-run   # everything (~20 min)
    .venv/bin/python bench/preempt.py --quick --json                 # 20 calls, < 1 min

Without --json it prints the headline figures. Timings on a shared machine are noisy: the
CPU count and load average are printed with them, and CPU seconds beside wall seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # tests.gateway.scripted_engine

import openai._base_client  # noqa: E402
import openai.resources.chat.completions  # noqa: E402
from tests.gateway.scripted_engine import ScriptedEngine  # noqa: E402

from tidal.agent.environment import SandboxRuntimes  # noqa: E402
from tidal.agent.harness import AgentConfig, BuiltinHarness  # noqa: E402
from tidal.agent.preempt import LiveEpisodes, SnapshotPolicy  # noqa: E402
from tidal.agent.runtime import ToolRuntime  # noqa: E402
from tidal.agent.sandboxed import SandboxRuntime  # noqa: E402
from tidal.agent.tasks import Grade, Task  # noqa: E402
from tidal.engine.base import Generation, SamplingParams  # noqa: E402
from tidal.engine.tiny import ensure_tiny, load_tokenizer  # noqa: E402
from tidal.gateway.core import Gateway  # noqa: E402
from tidal.gateway.server import GatewayServer  # noqa: E402
from tidal.gateway.verify import verify_store  # noqa: E402
from tidal.ledger import LedgerStore  # noqa: E402
from tidal.run.config import dump_config, parse_config  # noqa: E402
from tidal.run.live import LiveRollouts  # noqa: E402
from tidal.run.rollout import Episode, Rollouts  # noqa: E402
from tidal.sandbox import Sandbox, SandboxConfig, Snapshot  # noqa: E402

SESSION = "rl-1-preempt-0-bench0"
TASK_ID = "preempt"
MEANING = {
    "first_sandbox_in_process_s": "the first sandbox of a process: builds the default image "
                                  "(once per process; a resumed run pays it once too)",
    "live": "the whole episode (Rollouts.group: sandbox start, N bash calls + finish, "
            "grading, outcome) with LiveEpisodes but snapshot_every=0, every_s=0: wall and "
            "CPU seconds (CPU: this process's threads and its reaped children), and where "
            "the median run's seconds went (breakdown)",
    "no_live": "the same episode on plain Rollouts (no LiveRollouts): nothing saved at all",
    "periodic": "the same episode snapshotting every 10 / every 1 model calls (every_s=0): "
                "wall and CPU seconds, added over live (medians); LiveEpisodes.snapshots and "
                "snapshot_s of the median run, and how snapshot_s splits: snapshot_wait_s "
                "(waiting for the command running when the snapshot was asked for; the "
                "harness does not wait for it) and snapshot_hold_s (the sandbox frozen and "
                "exclusive while the layer and the log are written); op_wait_s: harness "
                "operations held up by a snapshot",
    "breakdown": "summed over threads: client_s the harness's model calls as its OpenAI "
                 "client sees them, http_s their HTTP round trips, client_own_s the rest "
                 "(the client building each request from the whole message list and reading "
                 "the answer), gateway_s Gateway.chat (rendering, replay lookup or engine, "
                 "recording), sandbox_ops_s the harness's and the grader's sandbox operations "
                 "(answered from the log after a restore), restore_s Sandbox.restore",
    "snapshot": "Sandbox.snapshot of the episode's sandbox after the N commands and the "
                "grading (the writable layer + the command log): seconds, file bytes, log "
                "entries",
    "restore": "Sandbox.restore of that snapshot (a started sandbox with the layer and the "
               "log in replay mode); replay_log_s: the N commands and the grader's read "
               "answered from the log; first_live_exec_s: one command past the log, run on "
               "the restored layer; close_s: its close",
    "fast_forward": "resume of an episode SIGKILLed inside its call N+1 (N calls recorded, "
                    "no outcome, a snapshot taken after command N): to_last_recorded_s is "
                    "from LiveRollouts.group(resume=key) until the engine is first asked for a "
                    "call (sandbox restored, the N calls answered from the ledger, the N "
                    "commands from the snapshot's log); episode_s the whole resumed episode; "
                    "generated the engine's calls during the resume (1: the unrecorded "
                    "finish); recorded_twice the calls in the ledger more than once (0), "
                    "ledger_calls all of them (N+1); "
                    "killed_process_s the killed process from its start to the kill",
    "tidal_run": "two `tidal run`s (config below: tiny untrained model, rl.steps=2, "
                 "warmstart.steps=0) with rollout.snapshot_every=1 and 0: wall clock, the rl "
                 "rows' rollout_s summed, and their snapshots and snapshot_s (cumulative: "
                 "the last row's)",
}


# --------------------------------------------------------------------------- the session


def command(k: int) -> str:
    """The k-th bash command: appends a line that counts the lines before it (so running
    it twice shows), writes a 3.6 KB file, sometimes edits an earlier one or greps them."""
    parts = [f'echo "step {k} after $(cat log.txt 2>/dev/null | wc -l) lines" >> log.txt',
             f"mkdir -p work && seq -f 'k{k} row %03g' 300 > work/f{k}.txt"]
    if k % 5 == 0 and k > 3:
        parts.append(f"sed -i 's/row 0/ROW 0/' work/f{k - 3}.txt")
    if k % 7 == 0:
        parts.append("grep -c ROW work/*.txt | awk -F: '{s+=$2} END {print s}'")
    parts.append("tail -n 1 log.txt")
    return "; ".join(parts)


def expected_log(n: int) -> str:
    return "".join(f"step {k} after {k - 1} lines\n" for k in range(1, n + 1))


def tool_call(name: str, args: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


class Policy:
    """Call k (k - 1 tool results so far): the k-th command for k <= n, then finish."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, prompt: str) -> str:
        k = len(re.findall(r"<tool_response>", prompt)) + 1
        if k <= self.n:
            return tool_call("bash", {"command": command(k)})
        return tool_call("finish", {"answer": "done"})


class LogGrader:
    """Reward 1 when log.txt is exactly one run of each of the n commands."""

    def __init__(self, n: int) -> None:
        self.n = n

    def grade(self, runtime: ToolRuntime, *, finished: bool | None = None) -> Grade:
        log = runtime.read_file("log.txt")
        ok = log == expected_log(self.n)
        return Grade(float(ok), float(ok), {"log": ok, "finished": bool(finished)},
                     extra={"log_lines": log.count("\n")})


class BenchEngine(ScriptedEngine):
    """The scripted policy; counts its calls, notes when it was first asked, and can
    stop inside call `stall_at` (before it is recorded) after `on_stall` ran."""

    def __init__(self, tokenizer: Any, n: int) -> None:
        super().__init__(tokenizer, policy=Policy(n), max_context=1 << 20)
        self.calls = 0
        self.first_call: float | None = None
        self.stall_at: int | None = None
        self.on_stall: Any = None

    def generate(self, prompts: Any, params: SamplingParams, *,
                 session: str | None = None) -> list[Generation]:
        self.calls += 1
        if self.first_call is None:
            self.first_call = time.perf_counter()
        if self.stall_at == self.calls:
            if self.on_stall is not None:
                self.on_stall()
            time.sleep(3600)  # the parent SIGKILLs the process here
        return super().generate(prompts, params, session=session)


def cpu_s() -> float:
    """CPU seconds of this process (all threads) and of its reaped children (a
    sandbox's processes count once it closed)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class Breakdown:
    """Where an episode's seconds go, summed over threads: the harness's model calls as
    its OpenAI client sees them (`client_s`), of which the HTTP round trip (`http_s`, the
    rest is the client building the request and reading the answer), the gateway's
    handling of them (`gateway_s`), the sandbox operations as the harness sees them
    (`sandbox_ops_s`: exec and file calls, those answered from a restored log included),
    `Sandbox.restore`, and snapshots: waiting for running operations to end
    (`snapshot_wait_s`), holding the sandbox frozen and exclusive while the layer and log
    are written (`snapshot_hold_s`), and the harness's operations held up meanwhile
    (`op_wait_s`). Patches the classes while inside; timers cost microseconds a call."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}
        self.n: dict[str, int] = {}
        self._lock = threading.Lock()
        self._undo: list[tuple[Any, str, Any]] = []
        self.paused = False

    def add(self, key: str, dt: float) -> None:
        if self.paused:
            return
        with self._lock:
            self.s[key] = self.s.get(key, 0.0) + dt
            self.n[key] = self.n.get(key, 0) + 1

    def _wrap(self, owner: Any, name: str, key: str) -> None:
        orig = vars(owner).get(name)
        if orig is None:  # another openai version: that figure is left out
            return
        fn = orig.__func__ if isinstance(orig, classmethod) else orig

        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.add(key, time.perf_counter() - t)

        setattr(owner, name, classmethod(timed) if isinstance(orig, classmethod) else timed)
        self._undo.append((owner, name, orig))

    def _wrap_cm(self, owner: Any, name: str, wait_key: str, hold_key: str | None) -> None:
        orig = owner.__dict__[name]
        add = self.add

        @contextlib.contextmanager
        def timed(*a: Any, **k: Any) -> Iterator[Any]:
            t = time.perf_counter()
            with orig(*a, **k) as got:
                t1 = time.perf_counter()
                add(wait_key, t1 - t)
                try:
                    yield got
                finally:
                    if hold_key is not None:
                        add(hold_key, time.perf_counter() - t1)

        setattr(owner, name, timed)
        self._undo.append((owner, name, orig))

    def __enter__(self) -> Breakdown:
        self._wrap(openai.resources.chat.completions.Completions, "create", "client_s")
        self._wrap(openai._base_client.SyncAPIClient, "post", "http_s")
        self._wrap(Gateway, "chat", "gateway_s")
        for op in ("exec", "read_file", "write_file", "list"):
            self._wrap(Sandbox, op, "sandbox_ops_s")
        self._wrap(Sandbox, "restore", "restore_s")
        self._wrap_cm(Sandbox, "_exclusive_op", "snapshot_wait_s", "snapshot_hold_s")
        self._wrap_cm(Sandbox, "_op", "op_wait_s", None)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)
        self._undo.clear()

    def figures(self) -> dict[str, Any]:
        out = {k: round(v, 3) for k, v in sorted(self.s.items())}
        if "client_s" in out and "http_s" in out:
            out["client_own_s"] = round(self.s["client_s"] - self.s["http_s"], 3)
        out["model_calls"] = self.n.get("client_s", 0)
        out["sandbox_ops"] = self.n.get("sandbox_ops_s", 0)
        return out


@dataclass
class Result:
    """One episode run by `Bench.episode`."""

    wall_s: float
    cpu_s: float
    episode: Episode
    generated: int
    first_call: float | None
    started: float
    snapshots: int
    snapshot_s: float
    end_snapshots: list[float]
    end_snapshot: Path | None
    breakdown: dict[str, Any]


class Bench:
    """Everything one process needs to run the scripted episode (the tokenizer is
    loaded once)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tokenizer = load_tokenizer(ensure_tiny())
        self.harness = BuiltinHarness(AgentConfig(
            max_turns=n + 5, tools=("bash", "finish"), temperature=0, max_tokens=256,
            context_budget_tokens=1 << 24, time_limit_s=3600.0))
        self.task = Task(TASK_ID, f"Run the {n} steps, then finish.", LogGrader(n),
                         time_limit_s=3600.0)

    def episode(self, work: Path, policy: SnapshotPolicy | None, *, resume: bool = False,
                end_snapshots: int = 0, stall: bool = False) -> Result:
        """Run (or resume, from `work`) the episode with ledger and live directory under
        `work`. `policy` None: no LiveEpisodes. `end_snapshots`: snapshot the sandbox that
        many times after grading. `stall`: stop inside call n+1 (see the module doc)."""
        with Breakdown() as timers:  # before the server: it binds the gateway's methods
            return self._episode(work, policy, timers, resume=resume,
                                 end_snapshots=end_snapshots, stall=stall)

    def _episode(self, work: Path, policy: SnapshotPolicy | None, timers: Breakdown, *,
                 resume: bool, end_snapshots: int, stall: bool) -> Result:
        work.mkdir(parents=True, exist_ok=True)
        engine = BenchEngine(self.tokenizer, self.n)
        store = LedgerStore(work / "ledger.db")
        srv = GatewayServer(engine, self.tokenizer, store, port=0)
        srv.start()
        snaps: list[float] = []
        snap_path = work / "end.tar"

        @contextlib.contextmanager
        def runtime(config: SandboxConfig) -> Iterator[ToolRuntime]:
            with Sandbox(config) as sb:
                yield SandboxRuntime(sb)
                timers.paused = True  # not the episode's: the `snapshot` figure
                for _ in range(end_snapshots):
                    t = time.perf_counter()
                    sb.snapshot(snap_path)
                    snaps.append(time.perf_counter() - t)
                timers.paused = False

        runtimes = SandboxRuntimes(runtime)
        live = (LiveEpisodes(work / "live", store, srv.gateway, runtimes, policy)
                if policy is not None else None)
        if live is not None:
            srv.gateway.on_record.append(live.note_call)
        if stall:
            assert live is not None
            engine.stall_at = self.n + 1

            def on_stall() -> None:
                live.snapshot_now(SESSION)
                (work / "stalled").write_text(json.dumps(
                    {"snapshots": live.snapshots, "snapshot_s": live.snapshot_s}))
            engine.on_stall = on_stall

        plain = Rollouts(srv.base_url, "scripted", self.harness, runtimes, store,
                         time_limit_s=3600.0, forget=srv.gateway.forget_session)
        rollouts = plain if live is None else LiveRollouts(plain, live)
        try:
            c0, t0 = cpu_s(), time.perf_counter()
            wall, cpu, result = self._group(rollouts, live, resume, t0, c0)
            (ep,) = result.value
        finally:
            if live is not None:
                live.close()
            srv.stop()
            store.close()
        return Result(wall, cpu, ep, engine.calls, engine.first_call, t0,
                      live.snapshots if live else 0, live.snapshot_s if live else 0.0,
                      snaps, snap_path if snaps else None, timers.figures())

    def _group(self, rollouts: Rollouts | LiveRollouts, live: LiveEpisodes | None,
               resume: bool, t0: float, c0: float) -> tuple[float, float, Any]:
        if resume:
            assert live is not None and isinstance(rollouts, LiveRollouts)
            (group,) = live.pending()
            result = rollouts.group([(self.task, sid) for _t, sid in group.jobs],
                                    base_version=0, resume=group.key)
        else:
            result = rollouts.group([(self.task, SESSION)], base_version=0)
        return time.perf_counter() - t0, cpu_s() - c0, result

    def check(self, r: Result, work: Path) -> dict[str, Any]:
        """The episode went as it should: complete, reward 1 (each command ran once),
        every call in the ledger once, the ledger verifies."""
        with LedgerStore(work / "ledger.db") as store:
            log = store.call_log(SESSION)
            n_calls = len(log)
            distinct = len({tuple(log.prompt_ids(sc.call_id).tolist()) for sc in log.calls})
            outcome = store.outcome(SESSION)
            ok = verify_store(store).ok
        assert outcome is not None
        good = (r.episode.status == "complete" and r.episode.reward == 1.0 and ok
                and n_calls == self.n + 1 and distinct == n_calls
                and outcome.details.get("abandoned_calls") is None)
        return {"ok": good, "status": r.episode.status, "reward": r.episode.reward,
                "ledger_calls": n_calls, "recorded_twice": n_calls - distinct,
                "verify_ok": ok}


# --------------------------------------------------------------------------- figures


def spread(xs: Sequence[float]) -> dict[str, Any]:
    s = sorted(xs)
    return {"median": round(statistics.median(s), 4), "min": round(s[0], 4),
            "max": round(s[-1], 4), "n": len(s)}


def median_run(rs: Sequence[Result]) -> Result:
    return sorted(rs, key=lambda r: r.wall_s)[len(rs) // 2]


POLICIES: dict[str, SnapshotPolicy | None] = {
    "every_0": SnapshotPolicy(every_calls=0, every_s=0),
    "every_10": SnapshotPolicy(every_calls=10, every_s=0),
    "every_1": SnapshotPolicy(every_calls=1, every_s=0),
}


def periodic(bench: Bench, tmp: Path, repeats: int, no_live: bool
             ) -> tuple[dict[str, Any], Result]:
    """Live episodes without, and with periodic, snapshots, interleaved across repeats
    (a shared machine's load drifts); the first one without also snapshots its sandbox
    at the end (for `snapshot_restore`)."""
    policies = dict(POLICIES)
    if no_live:
        policies["no_live"] = None
    runs: dict[str, list[Result]] = {k: [] for k in policies}
    bad: list[str] = []
    end: Result | None = None
    for i in range(repeats):
        for name, pol in policies.items():
            work = tmp / f"{name}-{i}"
            first = name == "every_0" and i == 0
            r = bench.episode(work, pol, end_snapshots=max(3, repeats) if first else 0)
            if not bench.check(r, work)["ok"]:
                bad.append(f"{name}-{i}")
            runs[name].append(r)
            if first:
                end = r
            else:
                shutil.rmtree(work, ignore_errors=True)
    assert end is not None
    base = runs["every_0"]
    wall0 = statistics.median(r.wall_s for r in base)
    cpu0 = statistics.median(r.cpu_s for r in base)
    out: dict[str, Any] = {"live": {"wall_s": spread([r.wall_s for r in base]),
                                    "cpu_s": spread([r.cpu_s for r in base]),
                                    "breakdown": median_run(base).breakdown}}
    if no_live:
        out["no_live"] = {"wall_s": spread([r.wall_s for r in runs["no_live"]]),
                          "cpu_s": spread([r.cpu_s for r in runs["no_live"]])}
    per: dict[str, Any] = {}
    for name in ("every_10", "every_1"):
        rs = runs[name]
        wall = statistics.median(r.wall_s for r in rs)
        cpu = statistics.median(r.cpu_s for r in rs)
        mid = median_run(rs)
        b = mid.breakdown
        per[name] = {
            "wall_s": spread([r.wall_s for r in rs]),
            "added_wall_s": round(wall - wall0, 3),
            "added_wall_fraction": round((wall - wall0) / wall0, 4),
            "cpu_s": spread([r.cpu_s for r in rs]),
            "added_cpu_s": round(cpu - cpu0, 3),
            "added_cpu_fraction": round((cpu - cpu0) / cpu0, 4),
            "snapshots": mid.snapshots,
            "snapshot_s": round(mid.snapshot_s, 3),
            "snapshot_s_each": round(mid.snapshot_s / max(1, mid.snapshots), 4),
            "snapshot_wait_s": b.get("snapshot_wait_s", 0.0),
            "snapshot_hold_s": b.get("snapshot_hold_s", 0.0),
            "op_wait_s": b.get("op_wait_s", 0.0),
        }
    out["periodic"] = per
    out["episodes_ok"] = not bad
    if bad:
        out["episodes_bad"] = bad
    return out, end


def snapshot_restore(end: Result, repeats: int) -> dict[str, Any]:
    """The end-of-episode snapshot's figures, and restores of it: the restore, the
    episode's N commands and the grader's read answered from its log, one live exec on
    the restored layer, the close."""
    assert end.end_snapshot is not None
    path = end.end_snapshot
    n = end.episode.n_calls - 1
    restores, replays, firsts, closes = [], [], [], []
    for _ in range(max(3, repeats)):
        t = time.perf_counter()
        sb = Sandbox.restore(path)
        restores.append(time.perf_counter() - t)
        rt = SandboxRuntime(sb)
        t = time.perf_counter()
        for k in range(1, n + 1):
            rt.exec(command(k), 30.0)
        rt.read_file("log.txt")
        replays.append(time.perf_counter() - t)
        assert sb.replay_pending == 0, sb.replay_pending
        t = time.perf_counter()
        r = sb.exec("cat log.txt | wc -l")  # past the log: runs live on the layer
        firsts.append(time.perf_counter() - t)
        assert r.stdout.strip() == str(n), r
        t = time.perf_counter()
        sb.close()
        closes.append(time.perf_counter() - t)
    return {
        "snapshot": {"s": spread(end.end_snapshots), "bytes": path.stat().st_size,
                     "log_len": Snapshot.load(path).log_len},
        "restore": {"s": spread(restores), "replay_log_s": spread(replays),
                    "first_live_exec_s": spread(firsts), "close_s": spread(closes)},
    }


def child(work: Path, n: int) -> int:
    """The process the bench kills (see the module doc)."""
    with Sandbox(SandboxConfig()):
        pass  # the default image, before the episode as in the parent
    Bench(n).episode(work, SnapshotPolicy(every_calls=10, every_s=0), stall=True)
    return 1  # not reached: the parent kills it in the episode's last call


def fast_forward(bench: Bench, tmp: Path, repeats: int) -> dict[str, Any]:
    killed = tmp / "killed"
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(killed),
                          "--calls", str(bench.n)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, start_new_session=True)
    marker = killed / "stalled"
    deadline = time.monotonic() + 1800
    try:
        while not marker.exists():
            if p.poll() is not None:
                raise RuntimeError(f"the child died: {p.communicate()[0].decode()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("the child never reached its last call")
            time.sleep(0.05)
        time.sleep(0.1)  # the marker is written; the engine is asleep in call n+1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    child_s = time.perf_counter() - t0
    at_kill = json.loads(marker.read_text())
    with LedgerStore(killed / "ledger.db") as store:
        recorded = len(store.call_log(SESSION))
        assert store.outcome(SESSION) is None, "the child finished its episode"
    runs: list[Result] = []
    checks: list[dict[str, Any]] = []
    for i in range(repeats):
        work = tmp / f"resume-{i}"
        shutil.copytree(killed, work)
        r = bench.episode(work, SnapshotPolicy(every_calls=10, every_s=0), resume=True)
        checks.append(bench.check(r, work))
        runs.append(r)
        shutil.rmtree(work, ignore_errors=True)
    ffs = []
    for r in runs:
        assert r.first_call is not None, "the resumed episode never reached the engine"
        ffs.append(r.first_call - r.started)
    return {"to_last_recorded_s": spread(ffs),
            "episode_s": spread([r.wall_s for r in runs]),
            "episode_cpu_s": spread([r.cpu_s for r in runs]),
            "breakdown": median_run(runs).breakdown,
            "generated": [r.generated for r in runs],
            "recorded_twice": [c["recorded_twice"] for c in checks],
            "ledger_calls": [c["ledger_calls"] for c in checks],
            "episodes_ok": all(c["ok"] for c in checks),
            "recorded_at_kill": recorded, "snapshots_at_kill": at_kill["snapshots"],
            "killed_process_s": round(child_s, 2)}


TIDAL_RUN: dict[str, Any] = {
    "tasks": {"name": "tools", "train_size": 3, "heldout_size": 1, "time_limit_s": 120},
    "rollout": {"group_size": 2, "tasks_per_step": 3, "max_turns": 4, "max_tokens": 64,
                "temperature": 0.2, "sandbox": "bwrap", "snapshot_every_s": 0},
    "warmstart": {"steps": 0},
    "rl": {"steps": 2},
    "eval": {"every": 5},
}


def tidal_run(tmp: Path) -> dict[str, Any]:
    """`tidal run` of a small config (the tiny model, untrained: short sessions) with a
    snapshot after every model call and with none, one after the other."""
    out: dict[str, Any] = {"config": TIDAL_RUN}
    for every in (1, 0):
        cfg = json.loads(json.dumps(TIDAL_RUN))
        cfg["rollout"]["snapshot_every"] = every
        conf, run_dir = tmp / f"run-{every}.toml", tmp / f"run-{every}"
        conf.write_text(dump_config(parse_config(cfg)))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "tidal.cli", "run", str(conf), "--out",
                               str(run_dir)], capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"tidal run failed:\n{proc.stderr[-3000:]}")
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rl = [r for r in rows if r.get("phase") == "rl"]
        summary = json.loads((run_dir / "summary.json").read_text())
        out[f"snapshot_every_{every}"] = {
            "wall_s": round(wall, 2), "minutes": summary["minutes"],
            "sessions": summary["sessions"], "verify_ok": summary["verify_ok"],
            "rollout_s": round(sum(r["rollout_s"] for r in rl), 3),
            "rollout_tokens": sum(r["rollout_tokens"] for r in rl),
            "snapshots": rl[-1].get("snapshots"), "snapshot_s": rl[-1].get("snapshot_s")}
    on, off = out["snapshot_every_1"], out["snapshot_every_0"]
    out["added_wall_s"] = round(on["wall_s"] - off["wall_s"], 2)
    out["added_rollout_s"] = round(on["rollout_s"] - off["rollout_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=None, help="bash calls (default 200)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per figure (default 3)")
    ap.add_argument("--quick", action="store_true", help="20 calls, 1 repeat")
    ap.add_argument("--no-live", action="store_true",
                    help="also time the episode on plain Rollouts (no LiveEpisodes)")
    ap.add_argument("--tidal-run", action="store_true",
                    help="also time two short `tidal run`s (snapshot_every 1 vs 0)")
    ap.add_argument("--json", action="store_true",
                    help="print the JSON only (nothing else is printed either way)")
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    n = a.calls or (20 if a.quick else 200)
    if a.child is not None:
        return child(a.child, n)
    repeats = a.repeats or (1 if a.quick else 3)
    tmp = Path(tempfile.mkdtemp(prefix="tidal-bench-preempt-"))
    t_all = time.perf_counter()
    out: dict[str, Any] = {"calls": n, "model_calls": n + 1, "repeats": repeats,
                           "cpu_count": os.cpu_count(), "loadavg_before": os.getloadavg()}
    try:
        bench = Bench(n)
        t = time.perf_counter()
        with Sandbox(SandboxConfig()):
            pass  # the default image, once per process: outside the other timings
        out["first_sandbox_in_process_s"] = round(time.perf_counter() - t, 3)
        figures, end = periodic(bench, tmp, repeats, a.no_live)
        out.update(figures)
        out.update(snapshot_restore(end, repeats))
        out["fast_forward"] = fast_forward(bench, tmp, repeats)
        if a.tidal_run:
            out["tidal_run"] = tidal_run(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out["loadavg_after"] = os.getloadavg()
    out["bench_s"] = round(time.perf_counter() - t_all, 1)
    out["meaning"] = MEANING
    print(json.dumps(out, indent=1) if a.json else summary(out))
    return 0


def summary(out: dict[str, Any]) -> str:
    """The headline figures, for a person (--json prints everything)."""
    per, ff = out["periodic"], out["fast_forward"]
    lines = [f"{out['model_calls']}-call session, {out['repeats']} repeat(s), "
             f"{out['cpu_count']} CPUs, load {out['loadavg_before'][0]:.1f}",
             f"live episode          {out['live']['wall_s']['median']:.2f} s wall, "
             f"{out['live']['cpu_s']['median']:.2f} s CPU"]
    for name, p in per.items():
        lines.append(f"snapshot {name:12s} {p['wall_s']['median']:.2f} s wall "
                     f"({p['added_wall_fraction']:+.1%}), CPU {p['added_cpu_fraction']:+.1%}; "
                     f"{p['snapshots']} snapshots, {p['snapshot_hold_s']:.3f} s held")
    lines += [
        f"snapshot at the end   {out['snapshot']['s']['median'] * 1e3:.1f} ms, "
        f"{out['snapshot']['bytes'] / 1024:.0f} KiB, {out['snapshot']['log_len']} log entries",
        f"restore               {out['restore']['s']['median'] * 1e3:.1f} ms",
        f"fast-forward          {ff['to_last_recorded_s']['median']:.2f} s to past the last "
        f"recorded call; resumed episode {ff['episode_s']['median']:.2f} s; generated "
        f"{ff['generated']}, recorded twice {ff['recorded_twice']}",
        f"all episodes correct  {out['episodes_ok'] and ff['episodes_ok']}"]
    if "tidal_run" in out:
        t = out["tidal_run"]
        lines.append(f"tidal run             {t['snapshot_every_1']['wall_s']:.1f} s with a "
                     f"snapshot per call ({t['snapshot_every_1']['snapshots']} snapshots, "
                     f"{t['snapshot_every_1']['snapshot_s']} s), "
                     f"{t['snapshot_every_0']['wall_s']:.1f} s without")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
