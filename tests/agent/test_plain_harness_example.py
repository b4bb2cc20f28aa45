"""The any-harness example (examples/plain_openai_agent.py) works against a real server."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from tests.agent.scripted_server import Reply, ScriptedServer, Seen, tc

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plain_openai_agent.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("plain_openai_agent", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plain_harness_uses_one_session_url_and_writes_the_answer(
    scripted: tuple[ScriptedServer, str], tmp_path: Path
) -> None:
    server, url = scripted

    def responder(seen: Seen, history: list[Seen]) -> Reply:
        if not history:
            return Reply(tool_calls=[tc("write_file", path="answer.txt", content="174")])
        return Reply(tool_calls=[tc("finish", answer="174")])

    server.reset(responder)
    session_id = "plain-1"
    answer = load_example().run(f"{url}/sessions/{session_id}/v1", "tiny",
                                "Write 471 reversed.", tmp_path)
    assert answer == "174"
    assert (tmp_path / "answer.txt").read_text() == "174"
    assert [s.session_id for s in server.seen] == [session_id, session_id]
    assert server.seen[1].messages[-1]["content"] == "ok"
    assert all(s.role == "main" for s in server.seen)
