"""One episode of the built-in harness in a process a test can SIGKILL, and resume.

    python -m tests.agent.preempt_driver DIR [--stall call:K|command:K|between:K] [--resume]

Everything is real (gateway over HTTP, ledger, bubblewrap sandbox, the built-in harness,
`LiveEpisodes` snapshotting after every model call) except the model: a deterministic
scripted policy (tests/gateway/scripted_engine.py) that answers from the prompt, so the
k-th turn gets the same tool call in every process. Its commands are not idempotent
(each appends to log.txt and prints it), so a command run twice shows.

`--stall` makes the process wait, after writing DIR/stalled, at one point of turn K:
inside the K-th model call (before it is recorded), inside the K-th command (the command
itself sleeps), or between the K-th command and the next call. The test kills it there.
`--resume` continues the episode DIR's live directory holds. The grade's `extra` keeps
every file of the work directory, so the test compares what the episode left.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.gateway.scripted_engine import ScriptedEngine
from tidal.agent.environment import SandboxRuntimes
from tidal.agent.harness import AgentConfig, BuiltinHarness
from tidal.agent.preempt import LiveEpisodes, SnapshotPolicy
from tidal.agent.runtime import ToolRuntime
from tidal.agent.sandboxed import SandboxRuntime
from tidal.agent.tasks import Grade, Task
from tidal.engine.base import Generation, SamplingParams
from tidal.engine.tiny import ensure_tiny, load_tokenizer
from tidal.gateway.server import GatewayServer
from tidal.ledger import LedgerStore
from tidal.run.live import LiveRollouts
from tidal.run.rollout import Rollouts
from tidal.sandbox import Sandbox, SandboxConfig
from tidal.sandbox.types import ExecResult

TURNS = 6
SESSION = "rl-1-count-0-abc123"


def command(k: int) -> str:
    slow = "sleep 3; " if k == 3 else ""  # the command a test kills in the middle of
    return f"echo start-{k} >> log.txt; {slow}echo end-{k} >> log.txt; cat log.txt"


def tool_call(name: str, args: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def policy(prompt: str) -> str:
    """Turn k (k tool results so far + 1): a bash command, then read the log, then finish."""
    k = len(re.findall(r"<tool_response>", prompt)) + 1
    if k <= TURNS:
        return tool_call("bash", {"command": command(k)})
    if k == TURNS + 1:
        return tool_call("read_file", {"path": "log.txt"})
    return tool_call("finish", {"answer": "done"})


class FilesGrader:
    """Reward 1; `extra.files`: every file of the work directory with its text."""

    def grade(self, runtime: ToolRuntime, *, finished: bool | None = None) -> Grade:
        names = [n for n in runtime.list(".") if not n.endswith("/")]
        files = {n: runtime.read_file(n) for n in sorted(names)}
        return Grade(1.0, 1.0, {"finished": bool(finished)}, extra={"files": files})


class StallingEngine(ScriptedEngine):
    def __init__(self, tokenizer: Any, stall: tuple[str, int] | None, marker: Path) -> None:
        super().__init__(tokenizer, policy=policy)
        self.stall, self.marker, self.calls = stall, marker, 0

    def generate(self, prompts: Any, params: SamplingParams, *,
                 session: str | None = None) -> list[Generation]:
        self.calls += 1
        if self.stall == ("call", self.calls):
            self.marker.write_text("call")
            time.sleep(600)
        return super().generate(prompts, params, session=session)


class StallingRuntime(SandboxRuntime):
    def __init__(self, sandbox: Sandbox, stall: tuple[str, int] | None, marker: Path) -> None:
        super().__init__(sandbox)
        self.stall, self.marker, self.commands = stall, marker, 0

    def exec(self, command: str, timeout_s: float, *, env: Any = None) -> ExecResult:
        if command.startswith("echo start-"):
            self.commands += 1
            if self.stall == ("command", self.commands):
                self.marker.write_text("command")
        r = super().exec(command, timeout_s, env=env)
        if self.stall == ("between", self.commands) and command.startswith("echo start-"):
            self.marker.write_text("between")
            time.sleep(600)
        return r


@dataclass
class Parts:
    engine: StallingEngine
    store: LedgerStore
    server: GatewayServer
    live: LiveEpisodes
    rollouts: LiveRollouts
    task: Task

    def close(self) -> None:
        self.live.close()
        self.server.stop()
        self.store.close()


def build(out: Path, stall: tuple[str, int] | None) -> Parts:
    """The gateway, ledger, live episodes and rollouts of one process, under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    marker = out / "stalled"
    tokenizer = load_tokenizer(ensure_tiny())
    engine = StallingEngine(tokenizer, stall, marker)
    store = LedgerStore(out / "ledger.db")
    srv = GatewayServer(engine, tokenizer, store, port=0)
    srv.start()

    @contextlib.contextmanager
    def runtime(config: SandboxConfig) -> Iterator[ToolRuntime]:
        with Sandbox(config) as sb:
            yield StallingRuntime(sb, stall, marker)

    runtimes = SandboxRuntimes(runtime)
    live = LiveEpisodes(out / "live", store, srv.gateway, runtimes,
                        SnapshotPolicy(every_calls=1, every_s=0))
    srv.gateway.on_record.append(live.note_call)

    cfg = AgentConfig(max_turns=TURNS + 3, tools=("bash", "read_file", "finish"), temperature=0)
    rollouts = LiveRollouts(Rollouts(srv.base_url, "scripted", BuiltinHarness(cfg), runtimes,
                                     store, forget=srv.gateway.forget_session), live)
    return Parts(engine, store, srv, live, rollouts,
                 Task("count", "Count to six in log.txt.", FilesGrader()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--stall", default=None)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args(argv)
    stall = None
    if a.stall:
        where, k = a.stall.split(":")
        stall = (where, int(k))
    out: Path = a.dir
    parts = build(out, stall)
    try:
        if a.resume:
            (group,) = parts.live.pending()
            result = parts.rollouts.group([(parts.task, sid) for _t, sid in group.jobs],
                                          base_version=0, resume=group.key)
        else:
            result = parts.rollouts.group([(parts.task, SESSION)], base_version=0)
        (ep,) = result.value
        json.dump({"status": ep.status, "reward": ep.reward, "n_calls": ep.n_calls,
                   "generated": parts.engine.calls, "snapshots": parts.live.snapshots},
                  (out / "result.json").open("w"))
    finally:
        parts.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
