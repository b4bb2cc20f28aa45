"""`tidal ledger export --atif`: one Harbor ATIF trajectory per episode, with the
messages, tool calls and results, token ids and logprobs, the outcome, subagents and
compaction; validated by harbor's own `Trajectory` model (in .venv-harbor)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tidal.cli import app
from tidal.ledger import Call, LedgerStore, make_outcome
from tidal.ledger.atif import episode_trajectories

from .helpers import growing_session
from .test_requests import chat_session

ROOT = Path(__file__).resolve().parents[2]
HARBOR_PYTHON = ROOT / ".venv-harbor" / "bin" / "python"


def episode(store: LedgerStore,
            adjust: Callable[[list[Call]], list[Call]] | None = None) -> list[Call]:
    """A main session of 4 tool-calling turns whose third spawned a subagent, then a
    compaction: a fresh context carrying a summary (declared by its parent call); the
    calls passed through `adjust` before they are appended."""
    main = chat_session("ep", 4)
    sub = [replace(c, parent_session_id="ep", parent_call_id="c2", role="subagent",
                   started_at=10.0 + i, ended_at=10.5 + i)
           for i, c in enumerate(chat_session("ep-sub", 2))]
    last = main[-1]
    assert last.messages is not None
    fresh = replace(
        growing_session("ep", 1, seed=7)[0], call_id="c4", parent_call_id="c3",
        messages=[last.messages[0], {"role": "user", "content": "Summary: 3 files."}],
        tools=last.tools, started_at=20.0, ended_at=20.5)
    calls = [*main[:3], *sub, main[3], fresh]
    if adjust is not None:
        calls = adjust(calls)
    store.append_calls(calls)
    store.append_outcome(make_outcome({"session_id": "ep", "status": "complete",
                                       "reward": 0.75, "partial_score": 0.75,
                                       "details": {"grader": {"rewards": {"reward": 0.75}}}}))
    store.append_outcome(make_outcome({"session_id": "ep-sub", "status": "complete",
                                       "reward": 0.0}))
    return calls


def test_an_episode_becomes_a_trajectory_with_its_subagent_and_continuation(
        tmp_path: Path) -> None:
    with LedgerStore(tmp_path / "l.db") as store:
        calls = {c.call_id + c.session_id: c for c in episode(store)}
        docs = episode_trajectories(store, "ep")
    assert list(docs) == ["ep.json", "ep.cont-1.json"]
    head, cont = docs["ep.json"], docs["ep.cont-1.json"]
    assert head["continued_trajectory_ref"] == "ep.cont-1.json"
    assert head["extra"]["reward"] == 0.75 and head["extra"]["status"] == "complete"
    assert [s["source"] for s in head["steps"]] == ["system", "user"] + ["agent"] * 4
    assert [s["step_id"] for s in head["steps"]] == list(range(1, 7))
    c0 = head["steps"][2]
    assert c0["tool_calls"] == [{"tool_call_id": "t0", "function_name": "bash",
                                 "arguments": {"cmd": "ls 0"}}]
    assert c0["observation"]["results"] == [{"source_call_id": "t0",
                                             "content": "file-0\n" * 3}]
    sampled = calls["c0ep"]
    assert c0["metrics"]["completion_token_ids"] == sampled.output_ids.tolist()
    assert c0["metrics"]["prompt_token_ids"] == sampled.prompt_ids.tolist()
    assert c0["metrics"]["logprobs"] == pytest.approx(sampled.output_logprobs.tolist())
    assert head["agent"]["tool_definitions"][0]["function"]["name"] == "bash"
    # the subagent: embedded, named by the step that spawned it
    (sub,) = head["subagent_trajectories"]
    assert sub["trajectory_id"] == "ep-sub" and sub["extra"]["reward"] == 0.0
    spawner = head["steps"][4]
    assert spawner["extra"]["call_id"] == "c2"
    refs = [r for r in spawner["observation"]["results"] if "subagent_trajectory_ref" in r]
    assert refs == [{"subagent_trajectory_ref": [{"trajectory_id": "ep-sub",
                                                  "session_id": "ep-sub"}]}]
    # the compacted context: its system prompt repeated, the summary new
    assert [s.get("is_copied_context", False) for s in cont["steps"]] == [True, False, False]
    assert cont["steps"][1]["message"] == "Summary: 3 files."
    assert "a fresh context from call c3" in cont["notes"]


def test_calls_without_messages_still_give_their_agent_steps(tmp_path: Path) -> None:
    with LedgerStore(tmp_path / "l.db") as store:
        store.append_calls(growing_session("old", 3))
        (doc,) = episode_trajectories(store, "old").values()
    assert [s["source"] for s in doc["steps"]] == ["agent"] * 3
    assert "3 call(s) recorded no request messages" in doc["notes"]
    assert doc["extra"] == {"task_id": None, "status": None, "reward": None}


def _validate_with_harbor(files: list[Path]) -> subprocess.CompletedProcess[str]:
    code = ("import json, sys\n"
            "from harbor.models.trajectories import Trajectory\n"
            "for p in sys.argv[1:]:\n"
            "    t = Trajectory.model_validate(json.load(open(p)))\n"
            "    print(p, len(t.steps), len(t.subagent_trajectories or []))\n")
    return subprocess.run([str(HARBOR_PYTHON), "-c", code, *map(str, files)],
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(not HARBOR_PYTHON.exists(),
                    reason=".venv-harbor does not exist: run .ci/harbor-venv.sh")
def test_the_export_validates_against_harbors_own_model(tmp_path: Path) -> None:
    with LedgerStore(tmp_path / "l.db") as store:
        episode(store)
        store.append_calls(growing_session("old", 2))
    r = CliRunner().invoke(app, ["ledger", "export", str(tmp_path / "l.db"),
                                 "--atif", str(tmp_path / "atif")])
    assert r.exit_code == 0, r.output
    assert "wrote 2 episode trajectories" in r.output
    files = sorted((tmp_path / "atif").glob("*.json"))
    assert [f.name for f in files] == ["ep.cont-1.json", "ep.json", "old.json"]
    checked = _validate_with_harbor(files)
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert f"{tmp_path / 'atif' / 'ep.json'} 6 1" in checked.stdout  # steps, subagents
    # and harbor refuses what breaks its rules: the check can fail
    bad: dict[str, Any] = json.loads(files[1].read_text())
    bad["steps"][2]["observation"]["results"][0]["source_call_id"] = "nope"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    refused = _validate_with_harbor([tmp_path / "bad.json"])
    assert refused.returncode != 0 and "source_call_id 'nope'" in refused.stderr
