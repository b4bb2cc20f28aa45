"""Rollouts: one graded episode through the real gateway, harness and ledger, and what the
gateway keeps in memory afterwards. The engine is the scripted one (tests/gateway), so the
episode's tool calls are known; everything between it and the ledger is real."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.scripted_engine import ScriptedEngine
from tidal.agent.environment import SandboxRuntimes
from tidal.agent.harness import AgentConfig, BuiltinHarness
from tidal.agent.runtime import ToolRuntime
from tidal.agent.tasks import files_taskset
from tidal.engine.tiny import ensure_tiny, load_tokenizer
from tidal.gateway.server import GatewayServer
from tidal.ledger import LedgerStore
from tidal.run.components import local_runtime
from tidal.run.rollout import Rollouts
from tidal.run.stop import RunStopped
from tidal.sandbox import SandboxConfig
from tidal.tree.process import process_store

SOLVE = (
    '<tool_call>\n{{"name": "write_file", "arguments": {{"path": "{path}", "content": "{d}"}}}}'
    '\n</tool_call>'
)
FINISH = '<tool_call>\n{"name": "finish", "arguments": {"answer": "done"}}\n</tool_call>'


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[GatewayServer, ScriptedEngine, LedgerStore]]:
    tokenizer = load_tokenizer(ensure_tiny())
    engine = ScriptedEngine(tokenizer)
    store = LedgerStore(tmp_path / "ledger.db")
    srv = GatewayServer(engine, tokenizer, store, port=0)
    srv.start()
    yield srv, engine, store
    srv.stop()
    store.close()


def _rollouts(srv: GatewayServer, store: LedgerStore, **kw: Any) -> Rollouts:
    cfg = AgentConfig(max_turns=4, tools=("write_file", "finish"))
    return Rollouts(srv.base_url, "scripted", BuiltinHarness(cfg), SandboxRuntimes(local_runtime),
                    store, **kw)


@pytest.mark.parametrize("forget", [True, False])
def test_an_episode_is_graded_recorded_and_then_forgotten_by_the_gateway(
    live: tuple[GatewayServer, ScriptedEngine, LedgerStore], forget: bool
) -> None:
    srv, engine, store = live
    task = files_taskset().train[0]  # "Write D to WORD.txt."
    word, digit = task.task_id.split("-")[1:3]
    engine.push(SOLVE.format(path=f"{word}.txt", d=digit), FINISH)
    rollouts = _rollouts(srv, store, forget=srv.gateway.forget_session if forget else None)

    ep = rollouts.one(task, "ep-0")

    assert (ep.status, ep.reward, ep.n_calls) == ("complete", 1.0, 2)
    assert ep.session_ids == ("ep-0",) and store.has_session("ep-0")
    assert len(store.call_log("ep-0")) == 2
    outcome = store.outcome("ep-0")
    assert outcome is not None and outcome.reward == 1.0
    # the finished session's turns stay in memory only when nothing forgets them
    assert srv.gateway.live_sessions == (0 if forget else 1)


def test_a_sandbox_that_fails_before_the_first_call_leaves_nothing_to_train(
    live: tuple[GatewayServer, ScriptedEngine, LedgerStore],
) -> None:
    """The episode is infra_error (recorded, masked) and names no session to train: a
    batch holding it still builds its trees (a resumed run once died here)."""
    srv, _engine, store = live

    def broken(_config: SandboxConfig) -> contextlib.AbstractContextManager[ToolRuntime]:
        raise FileNotFoundError("/run/tidal-sandbox/boxes/gone")

    task = files_taskset().train[0]
    rollouts = Rollouts(srv.base_url, "scripted", BuiltinHarness(AgentConfig(max_turns=4)),
                        SandboxRuntimes(broken), store)
    ep = rollouts.one(task, "ep-broken")
    assert (ep.status, ep.session_ids, ep.n_calls) == ("infra_error", (), 0)
    outcome = store.outcome("ep-broken")
    assert outcome is not None and outcome.status.value == "infra_error"
    assert "boxes/gone" in str(outcome.details)
    assert not store.has_session("ep-broken")
    assert list(process_store(store, ep.session_ids, strict=False).trees) == []


def test_a_stop_while_episodes_run_starts_no_queued_one(
    live: tuple[GatewayServer, ScriptedEngine, LedgerStore],
) -> None:
    """A stop (`RunStopped`, raised in the thread that waits for the episodes) lets the
    running episode end and starts none of those still queued: an evaluation of 64
    sessions once held a SIGTERM for minutes by running every one of them."""
    srv, engine, store = live
    tasks = files_taskset().train[:6]
    for t in tasks:
        word, digit = t.task_id.split("-")[1:3]
        engine.push(SOLVE.format(path=f"{word}.txt", d=digit), FINISH)
    rollouts = _rollouts(srv, store)

    def stop(_ep: object) -> None:
        raise RunStopped(signal.SIGTERM)

    jobs = [(t, f"q-{i}") for i, t in enumerate(tasks)]
    with pytest.raises(RunStopped):
        rollouts.many(jobs, workers=1, on_done=stop)
    ran = [sid for _t, sid in jobs if store.has_session(sid)]
    assert ran[0] == "q-0" and len(ran) <= 2  # the first, and the one running beside it
