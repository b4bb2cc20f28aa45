"""Harnesses as black boxes: a command inside the sandbox and a user's function, each run
through the real rollout path (gateway over HTTP, scripted engine, ledger, bubblewrap).

The in-sandbox harness is a small stdlib-only python script (the sandbox's own
/usr/bin/python3 has no packages), bound read-only into the sandbox as `[agent] mounts`
would: it reads what `tidal.agent.command` promises from its environment and calls the
gateway's chat completions with urllib."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.scripted_engine import ScriptedEngine
from tidal.agent.command import CommandHarness
from tidal.agent.environment import SandboxRuntimes
from tidal.agent.episode import EpisodeContext, FunctionHarness, HarnessResult
from tidal.agent.runtime import ToolRuntime
from tidal.agent.sandboxed import sandboxed_runtime
from tidal.agent.tasks import FileChecks, FileEquals, FileExists, Task
from tidal.engine.tiny import ensure_tiny, load_tokenizer
from tidal.gateway.server import GatewayServer
from tidal.ledger import LedgerStore, Status
from tidal.run.rollout import Rollouts
from tidal.sandbox import Limits, SandboxConfig
from tidal.sandbox.types import Bind
from tidal.tree import process_store

AGENT = r'''
import json, os, sys, urllib.request
url = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
body = {"model": os.environ["TIDAL_MODEL"], "max_tokens": 16,
        "messages": [{"role": "user", "content": os.environ["TIDAL_INSTRUCTION"]}]}
mode = sys.argv[1]
if mode != "no-call":
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    reply = json.load(urllib.request.urlopen(req, timeout=30))
    print("model said:", reply["choices"][0]["message"]["content"])
with open("answer.txt", "w") as f:
    f.write("42")
import socket
try:  # a host port that is not the gateway's: unreachable from the sandbox
    socket.create_connection(("127.0.0.1", int(os.environ["OTHER_PORT"])), timeout=2).recv(8)
    other = "reached"
except OSError as e:
    other = type(e).__name__
keys = ["OPENAI_BASE_URL", "OPENAI_API_BASE", "OPENAI_API_KEY", "TIDAL_MODEL",
        "TIDAL_SESSION_ID", "TIDAL_TASK_ID", "TIDAL_INSTRUCTION", "TIDAL_INSTRUCTION_FILE",
        "TIDAL_GATEWAY_URL", "ANTHROPIC_BASE_URL", "EXTRA"]
json.dump({k: os.environ.get(k) for k in keys} | {"cwd": os.getcwd(), "other": other,
          "instruction_file": open(os.environ["TIDAL_INSTRUCTION_FILE"]).read()},
          open("/tmp/env.json", "w"))
print("to stderr", file=sys.stderr)
if mode == "fail":
    sys.exit(3)
if mode == "hang":
    import time; time.sleep(600)
'''

TASK = Task("answer-42", "Write 42 to answer.txt.",
            FileChecks((FileExists("answer.txt"), FileEquals("answer.txt", "42"))))


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[GatewayServer, LedgerStore, Path]]:
    tokenizer = load_tokenizer(ensure_tiny())
    store = LedgerStore(tmp_path / "ledger.db")
    srv = GatewayServer(ScriptedEngine(tokenizer), tokenizer, store, port=0)
    srv.start()
    agent = tmp_path / "agent"
    agent.mkdir()
    (agent / "agent.py").write_text(AGENT)
    yield srv, store, agent
    srv.stop()
    store.close()


OTHER_PORT = 0  # set by the `other_service` fixture: a host service the harness must not reach


@pytest.fixture(autouse=True)
def other_service() -> Iterator[None]:
    """A real TCP service on the host's loopback, answering every connection."""
    global OTHER_PORT
    srv = socket.create_server(("127.0.0.1", 0))
    OTHER_PORT = srv.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = srv.accept()
                conn.sendall(b"hello")
                conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield
    stop.set()
    t.join()
    srv.close()


def _rollouts(srv: GatewayServer, store: LedgerStore, agent: Path, mode: str, *,
              time_limit_s: float = 60.0, log_dir: Path | None = None) -> Rollouts:
    harness = CommandHarness(f"python3 /opt/agent/agent.py {mode}",
                             env={"EXTRA": "1", "OTHER_PORT": str(OTHER_PORT)})
    base = SandboxConfig(allow_ports=(srv.port,), binds=(Bind(str(agent), "/opt/agent"),),
                         workdir="/work", limits=Limits(memory_bytes=256 << 20))
    return Rollouts(srv.base_url, "scripted", harness, SandboxRuntimes(sandboxed_runtime, base),
                    store, time_limit_s=time_limit_s, log_dir=log_dir)


def test_a_command_harness_is_told_everything_by_its_environment(
    live: tuple[GatewayServer, LedgerStore, Path], tmp_path: Path
) -> None:
    srv, store, agent = live
    seen: dict[str, Any] = {}

    @contextlib.contextmanager
    def spy(config: SandboxConfig) -> Iterator[ToolRuntime]:  # the real sandbox, read last
        with sandboxed_runtime(config) as rt:
            yield rt
            seen.update(json.loads(rt.read_file("/tmp/env.json")))

    ro = _rollouts(srv, store, agent, "ok", log_dir=tmp_path / "logs")
    assert isinstance(ro.runtimes, SandboxRuntimes)
    ep = replace(ro, runtimes=replace(ro.runtimes, new_runtime=spy)).one(TASK, "cmd-ok")
    assert (ep.status, ep.reward, ep.n_calls) == ("complete", 1.0, 1)
    url = f"{srv.base_url}/sessions/cmd-ok/task/answer-42/v1"
    assert seen["OPENAI_BASE_URL"] == seen["OPENAI_API_BASE"] == url
    assert seen["ANTHROPIC_BASE_URL"] == url.removesuffix("/v1")  # the SDK adds /v1/messages
    assert (seen["TIDAL_SESSION_ID"], seen["TIDAL_TASK_ID"]) == ("cmd-ok", "answer-42")
    assert seen["TIDAL_INSTRUCTION"] == seen["instruction_file"] == TASK.prompt
    assert (seen["TIDAL_MODEL"], seen["EXTRA"], seen["cwd"]) == ("scripted", "1", "/work")
    assert seen["OPENAI_API_KEY"] and seen["TIDAL_GATEWAY_URL"] == srv.base_url
    with socket.create_connection(("127.0.0.1", OTHER_PORT), timeout=5) as host:
        assert host.recv(8) == b"hello"  # the host reaches that service...
    assert seen["other"] == "ConnectionRefusedError"  # ...the harness only the gateway
    calls = store.call_log("cmd-ok").calls
    assert len(calls) == 1 and calls[0].call.task_id == "answer-42"  # grouped with no header
    outcome = store.outcome("cmd-ok")
    assert outcome is not None and outcome.status is Status.COMPLETE and outcome.reward == 1.0
    assert (tmp_path / "logs" / "cmd-ok.stdout.txt").read_text() == "model said: ok\n"
    assert (tmp_path / "logs" / "cmd-ok.stderr.txt").read_text() == "to stderr\n"
    assert outcome.details["harness_log"]["stderr"] == "to stderr\n"


def test_exit_codes_and_limits_map_to_statuses(
    live: tuple[GatewayServer, LedgerStore, Path]
) -> None:
    srv, store, agent = live
    failed = _rollouts(srv, store, agent, "fail").one(TASK, "cmd-fail")
    assert failed.status == "aborted" and failed.reward == 1.0  # graded all the same
    out = store.outcome("cmd-fail")
    assert out is not None and out.status is Status.ABORTED and "code 3" in out.details["error"]
    silent = _rollouts(srv, store, agent, "no-call").one(TASK, "cmd-silent")
    assert silent.status == "infra_error" and silent.session_ids == ()
    assert not store.has_session("cmd-silent") and store.outcome("cmd-silent") is None


def test_a_hanging_harness_is_ended_at_its_time_limit_and_graded(
    live: tuple[GatewayServer, LedgerStore, Path]
) -> None:
    srv, store, agent = live
    ep = _rollouts(srv, store, agent, "hang", time_limit_s=4.0).one(TASK, "cmd-hang")
    assert ep.status == "timeout" and ep.seconds < 30
    assert ep.reward == 1.0  # graded on what it left: it wrote the answer before hanging
    out = store.outcome("cmd-hang")
    assert out is not None and out.status is Status.TIMEOUT


def test_a_function_harness_runs_its_tools_through_the_runtime(
    live: tuple[GatewayServer, LedgerStore, Path]
) -> None:
    """`[agent] harness = "module:attr"`: outside the sandbox, its commands inside."""
    srv, store, _ = live
    from openai import OpenAI

    def harness(ctx: EpisodeContext) -> HarnessResult | None:
        client = OpenAI(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)
        client.chat.completions.create(model=ctx.model, max_tokens=8,
                                       messages=[{"role": "user", "content": ctx.task.prompt}])
        r = ctx.runtime.exec("printf 42 > answer.txt && cat /etc/hostname", 10)
        assert r.stdout.strip() == "sandbox"  # the command ran inside
        return None

    ro = Rollouts(srv.base_url, "scripted", FunctionHarness(harness),
                  SandboxRuntimes(sandboxed_runtime), store)
    ep = ro.one(TASK, "fn-ok")
    assert (ep.status, ep.reward, ep.n_calls) == ("complete", 1.0, 1)

    def crashes(ctx: EpisodeContext) -> HarnessResult | None:
        raise RuntimeError("harness bug")

    ep = Rollouts(srv.base_url, "scripted", FunctionHarness(crashes),
                  SandboxRuntimes(sandboxed_runtime), store).one(TASK, "fn-crash")
    assert ep.status == "infra_error"  # before any model call: masked, not punished


COMPACTING_AGENT = r'''
import json, os, urllib.request
url = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
def ask(messages):
    body = {"model": os.environ["TIDAL_MODEL"], "max_tokens": 64, "messages": messages}
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=30))["choices"][0]["message"]["content"]
task = os.environ["TIDAL_INSTRUCTION"]
ask([{"role": "user", "content": task}])
summary = ask([{"role": "user", "content": task}, {"role": "assistant", "content": "working"},
               {"role": "user", "content": "Summarise your progress."}])
# a fresh context that carries the summary, and no tidal header: a silent compaction
ask([{"role": "user", "content": task + "\n\nWhere you are: " + summary}])
'''


def test_a_harness_that_compacts_silently_gets_a_compaction_edge(
    live: tuple[GatewayServer, LedgerStore, Path]
) -> None:
    srv, store, agent = live
    (agent / "compacting.py").write_text(COMPACTING_AGENT)
    summary = ("I read the repository, found the off-by-one in paginate.py and fixed the "
               "range; the tests in tests/test_pages.py remain to be run.")
    engine = srv.gateway.engine
    assert isinstance(engine, ScriptedEngine)
    engine.push("working", summary, "done")
    ro = _rollouts(srv, store, agent, "")
    ro = replace(ro, harness=CommandHarness("python3 /opt/agent/compacting.py"))
    ep = ro.one(TASK, "silent-1")
    assert ep.status == "complete" and ep.n_calls == 3
    result = process_store(store, ["silent-1"], compaction_samples=True)
    (report,) = result.episodes
    assert report.edges.get("compaction") == 1 and report.inferred_edges == {"compaction": 1}
    assert any("compaction" in t.tree_id for t in result.trees)  # the summary is its own sample


def test_unparsed_tool_calls_are_counted_per_episode(
    live: tuple[GatewayServer, LedgerStore, Path]
) -> None:
    """A call whose text looks like a tool call that no parser accepts is counted in the
    episode (the step's `tool_parse_failures`); one that parses is not."""
    srv, store, _ = live
    from openai import OpenAI

    engine = srv.gateway.engine
    assert isinstance(engine, ScriptedEngine)
    tools = [{"type": "function", "function": {"name": "write_file", "parameters": {}}}]
    engine.push('<tool_call>\n{"name": "write_file", "arguments": {"path": }\n</tool_call>',
                '<tool_call>\n{"name": "write_file", "arguments": {}}\n</tool_call>')

    def harness(ctx: EpisodeContext) -> HarnessResult | None:
        client = OpenAI(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)
        for _ in range(2):
            client.chat.completions.create(model=ctx.model, tools=tools,  # type: ignore[arg-type]
                                           messages=[{"role": "user", "content": "go"}])
        ctx.runtime.exec("printf 42 > answer.txt", 10)
        return None

    ep = Rollouts(srv.base_url, "scripted", FunctionHarness(harness),
                  SandboxRuntimes(sandboxed_runtime), store).one(TASK, "fn-parse")
    assert (ep.n_calls, ep.tool_parse_failures) == (2, 1)
