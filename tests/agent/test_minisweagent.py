"""mini-swe-agent on the host, its commands in tidal's sandbox (`tidal.agent.minisweagent`).

Everything is real: mini-swe-agent 2.4.6's own DefaultAgent and tool-call parsing, the
gateway over HTTP with a scripted engine (a deterministic policy: it answers with the
text the test queues) and a SQLite ledger, bubblewrap sandboxes and their snapshots. The
replay test is the point of the module: a session snapshotted after k commands and
driven again through the same model answers gets those k commands from the sandbox's
log (nothing runs twice) and ends with the files of the uninterrupted run, and every
prompt it sends equals the uninterrupted run's (so the gateway's ledger replay can
answer it too)."""

from __future__ import annotations

import builtins
import importlib.util
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")  # no banner (tidal's import sets it too)
pytest.importorskip("minisweagent", reason="mini-swe-agent is not installed (make setup)")

from tests.gateway.scripted_engine import ScriptedEngine
from tidal.agent import minisweagent as minisweagent_module
from tidal.agent.environment import SandboxRuntimes
from tidal.agent.episode import EpisodeContext, FunctionHarness, HarnessResult, run_task
from tidal.agent.harness import AgentConfig
from tidal.agent.minisweagent import MiniSweAgent, TidalEnvironment, run
from tidal.agent.runtime import LocalDirRuntime, ToolRuntime
from tidal.agent.sandboxed import SandboxRuntime, sandboxed_runtime
from tidal.agent.tasks import FileChecks, FileEquals, Task
from tidal.engine.tiny import ensure_tiny, load_tokenizer
from tidal.gateway.server import GatewayServer
from tidal.ledger import LedgerStore, Status
from tidal.run.components import make_harness
from tidal.run.config import parse_config
from tidal.run.rollout import Rollouts
from tidal.sandbox import Sandbox, SandboxConfig
from tidal.sandbox.types import ExecResult

ROOT = Path(__file__).resolve().parents[2]
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
TASK = Task("answer-42", "Write 42 to answer.txt.",
            FileChecks((FileEquals("answer.txt", "42"),)))


def bash(command: str) -> str:
    """A model reply calling mini's bash tool, as Qwen2.5 writes it."""
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"I will run a command.\n<tool_call>\n{call}\n</tool_call>"


@dataclass(frozen=True)
class Live:
    """A gateway on 127.0.0.1 over a scripted engine, and its ledger."""

    srv: GatewayServer
    engine: ScriptedEngine
    store: LedgerStore
    tokenizer: Any

    def script(self, *replies: str) -> None:
        self.engine.replies.clear()
        self.engine.push(*replies)

    def prompts(self, session_id: str) -> list[list[int]]:
        log = self.store.call_log(session_id)
        return [log.prompt_ids(sc.call_id).tolist() for sc in log.calls]

    def texts(self, session_id: str) -> list[str]:
        return [self.tokenizer.decode(p) for p in self.prompts(session_id)]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tokenizer = load_tokenizer(ensure_tiny())
    store = LedgerStore(tmp_path_factory.mktemp("ledger") / "ledger.db")
    engine = ScriptedEngine(tokenizer)
    srv = GatewayServer(engine, tokenizer, store, port=0)
    srv.start()
    yield Live(srv, engine, store, tokenizer)
    srv.stop()
    store.close()


# --------------------------------------------------------------------------- environment


def test_the_environment_reports_as_mini_does_on_a_real_sandbox() -> None:
    from minisweagent.exceptions import Submitted

    with sandboxed_runtime(SandboxConfig(workdir="/work")) as rt:
        env = TidalEnvironment(rt, env={"GREETING": "hello"})
        out = env.execute({"command": "echo out; echo err >&2; echo $GREETING; exit 3"})
        assert out == {"output": "out\nerr\nhello\n", "returncode": 3, "exception_info": ""}
        assert env.execute({"command": "pwd"})["output"] == "/work\n"  # the runtime's cwd

        rt.exec("mkdir -p /work/sub/dir", 10)
        assert env.execute({"command": "pwd"}, cwd="/work/sub")["output"] == "/work/sub\n"
        inside = TidalEnvironment(rt, cwd="/work/sub/dir")
        assert inside.execute({"command": "pwd"})["output"] == "/work/sub/dir\n"
        missing = env.execute({"command": "echo never"}, cwd="/nowhere")
        assert missing["returncode"] == 1 and "never" not in missing["output"]
        assert "/nowhere" in missing["output"]

        t0 = time.monotonic()
        slow = env.execute({"command": "echo started; sleep 30; echo finished"}, timeout=1)
        assert time.monotonic() - t0 < 10
        assert slow["returncode"] == -1 and slow["output"].startswith("started\n")
        assert "finished" not in slow["output"]
        assert "timed out after 1 seconds" in slow["exception_info"]
        assert slow["extra"]["exception_type"] == "TimeoutExpired"
        refused = env.execute({"command": "echo a\0b"})  # NUL: refused, reported, no raise
        assert refused["returncode"] == -1 and "NUL" in refused["exception_info"]

        with pytest.raises(Submitted) as done:
            env.execute({"command": f"{SUBMIT}; echo the patch"})
        assert done.value.messages[0]["extra"] == {"exit_status": "Submitted",
                                                   "submission": "the patch\n"}
        not_done = env.execute({"command": f"{SUBMIT}; exit 1"})  # failed: not a submission
        assert not_done["returncode"] == 1

        tv = env.get_template_vars(extra=1)
        assert (tv["system"], tv["node"], tv["extra"]) == ("Linux", "sandbox", 1)  # the sandbox's
        assert tv["release"] and tv["machine"] and tv["env"] == {"GREETING": "hello"}
        assert env.serialize()["info"]["config"]["environment"]["timeout"] == 30
        assert isinstance(rt, SandboxRuntime)
        execs = [e for e in rt.sandbox.log if e.op == "exec"]
        assert sum("uname" in e.args["argv"][-1] for e in execs) == 1  # asked once, logged
        for _ in range(2):  # the same action twice: the same operation for the log
            env.execute({"command": "ls"}, cwd="/work/sub")
        last, before = rt.sandbox.log[-1], rt.sandbox.log[-2]
        assert last.key == before.key
        assert last.args["argv"][-1] == "exec 2>&1\ncd /work/sub || exit 1\nls"


def test_importing_needs_no_mini_swe_agent_and_running_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "minisweagent", None)  # as if it were not installed
    name = "tidal_agent_minisweagent_without_mini"
    spec = importlib.util.spec_from_file_location(name, minisweagent_module.__file__)
    assert spec is not None and spec.loader is not None
    fresh = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, fresh)
    spec.loader.exec_module(fresh)  # the module itself imports without mini-swe-agent
    assert isinstance(fresh.TidalEnvironment(LocalDirRuntime(ROOT)).command_for("ls"), str)
    with pytest.raises(ImportError, match=r"pip install --no-deps mini-swe-agent==2\.4\.6"):
        fresh.MiniSweAgent().resolved_config()


# --------------------------------------------------------------------------- end to end


def test_mini_swe_agent_solves_a_task_through_the_gateway_in_a_sandbox(
    live: Live
) -> None:
    srv, store = live.srv, live.store
    live.script(bash("printf 42 > answer.txt && cat answer.txt"), bash(SUBMIT))
    cfg = parse_config({"agent": {"harness": "tidal.agent.minisweagent:run"},
                        "warmstart": {"steps": 0}})
    harness = make_harness(cfg, AgentConfig())  # as `tidal run` makes it
    assert harness == FunctionHarness(run)
    ro = Rollouts(srv.base_url, "scripted", harness, SandboxRuntimes(sandboxed_runtime), store)
    ep = ro.one(TASK, "mini-e2e")
    assert (ep.status, ep.reward, ep.n_calls) == ("complete", 1.0, 2)
    outcome = store.outcome("mini-e2e")
    assert outcome is not None and outcome.status is Status.COMPLETE
    assert "exit_status: Submitted" in outcome.details["harness_log"]["mini"]
    calls = store.call_log("mini-e2e").calls
    assert all(sc.call.task_id == "answer-42" for sc in calls)
    first, second = live.texts("mini-e2e")
    assert "Please solve this issue: Write 42 to answer.txt." in first  # mini.yaml's prompt
    assert '"name": "bash"' in first  # mini's tool, sent as tools=
    assert '"returncode": 0' in second and '"output": "42"' in second  # mini.yaml's template


def _episode(srv: GatewayServer, session_id: str, rt: ToolRuntime,
             harness: Any = run, time_limit_s: float = 60.0) -> HarnessResult:
    ctx = EpisodeContext(srv.base_url, session_id, "scripted", TASK, rt, time_limit_s)
    result, _ = run_task(FunctionHarness(harness), ctx)
    return result


def test_limits_and_replies_without_tool_calls_end_as_tidal_statuses(
    live: Live, runtime: LocalDirRuntime
) -> None:
    srv, store = live.srv, live.store
    live.script(bash("echo one"), bash("echo two"))
    capped = MiniSweAgent(config={"agent": {"step_limit": 1}})
    r = _episode(srv, "mini-steps", runtime, capped)
    assert (r.status, r.finished) == ("truncated", False) and "LimitsExceeded" in (r.error or "")
    assert len(store.call_log("mini-steps").calls) == 1

    live.script("no tool call", "still none", "none again")
    r = _episode(srv, "mini-format", runtime)
    assert r.status == "truncated" and "RepeatedFormatError" in (r.error or "")
    texts = live.texts("mini-format")
    assert len(texts) == 3 and "Tool call error" in texts[1]  # mini's format-error template

    live.script(bash("sleep 30"), bash(SUBMIT))
    t0 = time.monotonic()
    r = _episode(srv, "mini-slow", runtime, time_limit_s=2.0)
    assert r.status == "timeout" and time.monotonic() - t0 < 15
    assert len(store.call_log("mini-slow").calls) == 1  # no call after the time limit


# --------------------------------------------------------------------------- replay


class Watched:
    """A sandbox's runtime that notes the sandbox's `replay_pending` after each command
    and snapshots the sandbox after its `snapshot_after`-th command."""

    def __init__(self, rt: SandboxRuntime, snapshot_after: int = 0, path: Path | None = None):
        self.rt, self.sandbox = rt, rt.sandbox
        self.snapshot_after, self.path = snapshot_after, path
        self.pending: list[int] = []
        self.commands = 0

    def exec(self, command: str, timeout_s: float, *, env: Mapping[str, str] | None = None
             ) -> ExecResult:
        r = self.rt.exec(command, timeout_s, env=env)
        self.commands += 1
        self.pending.append(self.sandbox.replay_pending)
        if self.commands == self.snapshot_after and self.path is not None:
            self.sandbox.snapshot(self.path)
        return r

    def read_file(self, path: str) -> str:
        return self.rt.read_file(path)

    def write_file(self, path: str, text: str) -> None:
        self.rt.write_file(path, text)

    def list(self, path: str) -> builtins.list[str]:
        return self.rt.list(path)

    def upload(self, src: Path, dest: str) -> None:
        self.rt.upload(src, dest)

    @property
    def can_snapshot(self) -> bool:
        return self.rt.can_snapshot

    def snapshot(self, path: Path) -> None:
        self.rt.snapshot(path)

    def end_agent(self, carry: Sequence[str] | None) -> str:
        return self.rt.end_agent(carry)


REPLAYED = (  # not idempotent: a command run twice shows in the files
    bash("echo one >> log.txt && cat log.txt"),
    bash("echo two >> log.txt && wc -l < log.txt"),
    bash("printf 42 > answer.txt; date +%s%N > stamp.txt; cat log.txt"),
    bash(SUBMIT),
)
K = 3  # commands before the snapshot: mini's uname (its template vars) and two actions


def _files(rt: ToolRuntime) -> dict[str, str]:
    return {p: rt.read_file(p) for p in ("log.txt", "answer.txt", "stamp.txt")}


def test_a_snapshotted_session_resumes_from_the_sandbox_log_and_ends_the_same(
    live: Live, tmp_path: Path
) -> None:
    srv = live.srv
    snap = tmp_path / "midway.tar"
    live.script(*REPLAYED)
    with Sandbox() as sb:
        first = Watched(SandboxRuntime(sb), snapshot_after=K, path=snap)
        assert _episode(srv, "mini-a", first).status == "complete"
        log_a = [(e.op, e.key) for e in sb.log]
        files_a = _files(first)
    assert files_a["log.txt"] == "one\ntwo\n" and files_a["answer.txt"] == "42"

    live.script(*REPLAYED)  # the same episode again, on a fresh sandbox
    with Sandbox() as sb:
        again = Watched(SandboxRuntime(sb))
        assert _episode(srv, "mini-b", again).status == "complete"
        log_b = [(e.op, e.key) for e in sb.log]
    assert log_b == log_a  # the same operations, byte for byte, in the same order
    assert live.prompts("mini-b") == live.prompts("mini-a")  # and the same prompts

    live.script(*REPLAYED)  # preempted after K commands: restore, drive a fresh agent
    restored = Sandbox.restore(snap)
    try:
        assert restored.replay_pending == K
        resumed = Watched(SandboxRuntime(restored))
        assert _episode(srv, "mini-c", resumed).status == "complete"
        assert resumed.pending[:K] == list(range(K - 1, -1, -1))  # each answered from the log
        assert resumed.pending[K:] == [0] * (resumed.commands - K)  # the rest ran live
        assert resumed.commands == first.commands
        log_c = [(e.op, e.key) for e in restored.log]
        files_c = _files(resumed)
    finally:
        restored.close()
    # nothing ran twice: one "one", and the stamp written after the snapshot is a new one
    assert files_c["log.txt"] == files_a["log.txt"] and files_c["answer.txt"] == "42"
    assert files_c["stamp.txt"] != files_a["stamp.txt"]
    assert log_c == log_a  # the logged operations, then the same ones live
    assert live.prompts("mini-c") == live.prompts("mini-a")  # the gateway could replay it
