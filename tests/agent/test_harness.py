"""The harness against a real HTTP server (scripted replies), with real files and processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.agent.scripted_server import Reply, ScriptedServer, Seen, tc
from tidal.agent.endpoint import PARENT_CALL_HEADER
from tidal.agent.harness import (
    NUDGE,
    SUMMARY_PREFIX,
    SUMMARY_REQUEST,
    AgentConfig,
    run_agent,
    run_episode,
)
from tidal.agent.runtime import LocalDirRuntime
from tidal.agent.tasks import demonstrations, digits_taskset, tools_taskset

Server = tuple[ScriptedServer, str]


def script(*replies: Reply) -> object:
    """Answer the n-th call of the main session with replies[n]."""

    def responder(seen: Seen, history: list[Seen]) -> Reply:
        return replies[len(history)]

    return responder


def tool_messages(seen: Seen) -> list[dict[str, object]]:
    return [m for m in seen.messages if m["role"] == "tool"]


def test_tools_run_in_the_runtime_and_results_flow_back(
    scripted: Server, runtime: LocalDirRuntime
) -> None:
    server, url = scripted
    server.reset(
        script(
            Reply(tool_calls=[tc("bash", command="echo hello > out.txt; cat out.txt; exit 3")]),
            Reply(tool_calls=[tc("read_file", path="out.txt")]),
            Reply(tool_calls=[tc("write_file", path="sub/answer.txt", content="42")]),
            Reply(tool_calls=[tc("finish", answer="42")]),
        )  # type: ignore[arg-type]
    )
    result = run_agent(url, "m", "do it", runtime, AgentConfig(), task_id="t-1", session_id="s-a")
    assert result.status == "complete" and result.final_answer == "42"
    assert result.n_calls == 4 and result.n_tool_calls == 4
    assert result.call_ids == tuple(s.call_id for s in server.seen)
    assert [s.session_id for s in server.seen] == ["s-a"] * 4
    assert all(s.role == "main" and s.headers["x-tidal-task"] == "t-1" for s in server.seen)
    assert server.seen[0].tool_names == [
        "bash",
        "read_file",
        "write_file",
        "spawn_subagent",
        "finish",
    ]
    assert server.seen[0].messages[1] == {"role": "user", "content": "do it"}
    assert tool_messages(server.seen[1])[0]["content"] == "exit code 3\nhello"
    assert tool_messages(server.seen[2])[1]["content"] == "hello\n"
    assert tool_messages(server.seen[3])[2]["content"] == "wrote 2 characters to sub/answer.txt"
    assert (runtime.root / "sub" / "answer.txt").read_text() == "42"
    # the assistant turn is sent back as the stock client returned it
    sent = server.seen[1].messages[2]
    assert sent["role"] == "assistant"
    assert sent["tool_calls"][0]["id"] == f"{server.seen[0].call_id}-tc0"
    assert json.loads(sent["tool_calls"][0]["function"]["arguments"])["command"].startswith("echo")


def test_parallel_tool_calls_all_run_and_results_keep_order_and_ids(
    scripted: Server, runtime: LocalDirRuntime
) -> None:
    server, url = scripted
    server.reset(
        script(
            Reply(
                tool_calls=[
                    tc("write_file", path="a.txt", content="A"),
                    tc("write_file", path="b.txt", content="BB"),
                    tc("bash", command="cat a.txt b.txt"),
                ]
            ),
            Reply(tool_calls=[tc("finish", answer="ok")]),
        )  # type: ignore[arg-type]
    )
    result = run_agent(url, "m", "files", runtime)
    assert result.status == "complete"
    tools = tool_messages(server.seen[1])
    first = server.seen[0].call_id
    assert [t["tool_call_id"] for t in tools] == [f"{first}-tc0", f"{first}-tc1", f"{first}-tc2"]
    assert [t["content"] for t in tools] == [
        "wrote 1 characters to a.txt",
        "wrote 2 characters to b.txt",
        "exit code 0\nABB",
    ]


def test_subagent_runs_in_its_own_session_linked_to_the_spawning_call(
    scripted: Server, runtime: LocalDirRuntime
) -> None:
    server, url = scripted

    def responder(seen: Seen, history: list[Seen]) -> Reply:
        if seen.role == "subagent":
            if not history:
                return Reply(tool_calls=[tc("bash", command="echo 74")])
            return Reply(tool_calls=[tc("finish", answer="74")])
        if not history:
            return Reply(
                tool_calls=[tc("spawn_subagent", task_description="Reply with 47 reversed")]
            )
        if len(history) == 1:
            return Reply(tool_calls=[tc("write_file", path="answer.txt", content="74")])
        return Reply(tool_calls=[tc("finish", answer="done")])

    server.reset(responder)
    result = run_agent(url, "m", "ask a helper", runtime, session_id="s-main", task_id="t-9")
    assert result.status == "complete"
    assert len(result.subagents) == 1
    sub = result.subagents[0]
    assert sub.status == "complete" and sub.final_answer == "74" and sub.role == "subagent"
    assert result.subagent_session_ids == (sub.session_id,)
    assert [s.session_id for s in result.all_sessions()] == ["s-main", sub.session_id]
    spawn_call = server.seen[0].call_id
    sub_seen = [s for s in server.seen if s.session_id == sub.session_id]
    assert len(sub_seen) == 2 == sub.n_calls
    for s in sub_seen:
        assert (s.parent_session_id, s.parent_call_id) == ("s-main", spawn_call)
        assert s.role == "subagent" and s.headers["x-tidal-task"] == "t-9"
        assert "spawn_subagent" not in s.tool_names  # depth limit 1
    assert sub_seen[0].messages[1] == {"role": "user", "content": "Reply with 47 reversed"}
    main_after = [s for s in server.seen if s.session_id == "s-main"][1]
    assert main_after.parent_call_id is None
    assert tool_messages(main_after)[0]["content"] == "74"


def test_compaction_summarises_then_restarts_from_a_fresh_context_linked_to_the_summary(
    scripted: Server, runtime: LocalDirRuntime
) -> None:
    server, url = scripted
    server.reset(
        script(
            Reply(tool_calls=[tc("bash", command="echo step1")], prompt_tokens=900),
            Reply(tool_calls=[tc("bash", command="echo step2")], prompt_tokens=2000),
            Reply(content="I ran step1 and step2.", prompt_tokens=2100),
            Reply(tool_calls=[tc("finish", answer="done")], prompt_tokens=50),
        )  # type: ignore[arg-type]
    )
    config = AgentConfig(context_budget_tokens=1000)
    result = run_agent(url, "m", "long task", runtime, config)
    assert result.status == "complete" and result.n_compactions == 1 and result.n_calls == 4
    before, summary, after = server.seen[1], server.seen[2], server.seen[3]
    assert summary.role == "main_summary" and after.role == "main"
    # the summary call extends the context it summarises
    assert summary.messages[:-1] == [*before.messages, *summary.messages[len(before.messages) : -1]]
    assert summary.messages[-1] == {"role": "user", "content": SUMMARY_REQUEST}
    assert after.messages == [
        before.messages[0],
        before.messages[1],
        {"role": "user", "content": SUMMARY_PREFIX + "I ran step1 and step2."},
    ]
    assert after.headers[PARENT_CALL_HEADER.lower()] == summary.call_id
    assert all(PARENT_CALL_HEADER.lower() not in s.headers for s in server.seen[:3])


def test_subagent_compaction_uses_the_subagent_summary_role(
    scripted: Server, runtime: LocalDirRuntime
) -> None:
    server, url = scripted

    def responder(seen: Seen, history: list[Seen]) -> Reply:
        if seen.role.startswith("subagent"):
            replies = [
                Reply(tool_calls=[tc("bash", command="true")], prompt_tokens=5000),
                Reply(content="summary"),
                Reply(tool_calls=[tc("finish", answer="x")]),
            ]
            return replies[len(history)]
        if not history:
            return Reply(tool_calls=[tc("spawn_subagent", task_description="sub")])
        return Reply(tool_calls=[tc("finish", answer="y")])

    server.reset(responder)
    result = run_agent(url, "m", "t", runtime, AgentConfig(context_budget_tokens=1000))
    assert result.status == "complete" and result.subagents[0].n_compactions == 1
    roles = [s.role for s in server.seen if s.parent_call_id is not None]
    assert roles == ["subagent", "subagent_summary", "subagent"]


def test_model_call_past_the_time_limit_ends_as_timeout(
    scripted: Server, runtime: LocalDirRuntime
) -> None:
    server, url = scripted
    server.reset(
        script(
            Reply(tool_calls=[tc("write_file", path="answer.txt", content="1")]),
            Reply(tool_calls=[tc("finish", answer="1")], delay_s=5.0),
        )  # type: ignore[arg-type]
    )
    result = run_agent(url, "m", "slow", runtime, AgentConfig(time_limit_s=1.0))
    assert result.status == "timeout" and result.final_answer is None
    assert (runtime.root / "answer.txt").read_text() == "1"  # partial progress is kept


def test_command_past_the_time_limit_ends_as_timeout(
    scripted: Server, runtime: LocalDirRuntime
) -> None:
    server, url = scripted
    server.reset(script(Reply(tool_calls=[tc("bash", command="sleep 30")])))  # type: ignore[arg-type]
    result = run_agent(url, "m", "slow", runtime, AgentConfig(time_limit_s=1.0))
    assert result.status == "timeout" and result.n_calls == 1


def test_malformed_tool_calls_get_error_results_and_the_session_goes_on(
    scripted: Server, runtime: LocalDirRuntime
) -> None:
    server, url = scripted
    server.reset(
        script(
            Reply(
                tool_calls=[
                    ("bash", '{"command": "echo hi"'),  # truncated JSON
                    ("launch_rockets", {"n": 1}),
                    ("write_file", {"path": "a.txt"}),
                    ("read_file", {"path": 7}),
                    ("bash", "[1, 2]"),
                    ("bash", {"command": "echo fine"}),
                ]
            ),
            Reply(tool_calls=[("finish", {"answer": 3})]),  # wrong type: not a finish
            Reply(tool_calls=[tc("finish", answer="3")]),
        )  # type: ignore[arg-type]
    )
    result = run_agent(url, "m", "t", runtime)
    assert result.status == "complete" and result.final_answer == "3"
    results = [t["content"] for t in tool_messages(server.seen[1])]
    assert len(results) == 6
    assert results[0].startswith("error: arguments of bash are not valid JSON")
    assert results[1].startswith("error: unknown tool 'launch_rockets'")
    assert results[2].startswith("error: bad arguments for write_file: missing ['content']")
    assert results[3] == "error: arguments ['path'] of read_file must be strings"
    assert results[4] == "error: arguments of bash must be a JSON object, got list"
    assert results[5] == "exit code 0\nfine"
    assert tool_messages(server.seen[2])[-1]["content"].startswith("error: arguments ['answer']")


def test_runtime_errors_become_tool_results(scripted: Server, runtime: LocalDirRuntime) -> None:
    server, url = scripted
    server.reset(
        script(
            Reply(
                tool_calls=[
                    tc("read_file", path="missing.txt"),
                    tc("write_file", path="../escape.txt", content="x"),
                ]
            ),
            Reply(tool_calls=[tc("finish", answer="")]),
        )  # type: ignore[arg-type]
    )
    result = run_agent(url, "m", "t", runtime)
    assert result.status == "complete" and result.final_answer == ""
    results = [t["content"] for t in tool_messages(server.seen[1])]
    assert results[0] == "error: no such file: missing.txt"
    assert results[1].startswith("error: path '../escape.txt' leaves the runtime's root")
    assert not (runtime.root.parent / "escape.txt").exists()


def test_no_tool_call_is_nudged_once_then_truncated(
    scripted: Server, runtime: LocalDirRuntime
) -> None:
    server, url = scripted
    server.reset(script(Reply(content="hmm"), Reply(content="still thinking")))  # type: ignore[arg-type]
    result = run_agent(url, "m", "t", runtime)
    assert result.status == "truncated" and result.n_calls == 2
    assert server.seen[1].messages[-1] == {"role": "user", "content": NUDGE}
    assert server.seen[1].messages[-2] == {"role": "assistant", "content": "hmm"}


def test_a_nudge_that_works_lets_the_session_complete(
    scripted: Server, runtime: LocalDirRuntime
) -> None:
    server, url = scripted
    server.reset(script(Reply(content="hmm"), Reply(tool_calls=[tc("finish", answer="a")])))  # type: ignore[arg-type]
    assert run_agent(url, "m", "t", runtime).status == "complete"


def test_max_turns_ends_as_truncated(scripted: Server, runtime: LocalDirRuntime) -> None:
    server, url = scripted
    server.reset(lambda seen, history: Reply(tool_calls=[tc("bash", command="true")]))
    result = run_agent(url, "m", "t", runtime, AgentConfig(max_turns=3))
    assert result.status == "truncated" and result.n_calls == 3 and result.n_tool_calls == 3


def test_tool_calls_written_as_text_are_read_as_a_fallback(
    scripted: Server, runtime: LocalDirRuntime
) -> None:
    server, url = scripted
    text = (
        '<tool_call>\n{"name": "write_file", "arguments": {"path": "t.txt", "content": "9"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "finish", "arguments": {"answer": "9"}}\n'
        "</tool_call>"
    )
    server.reset(script(Reply(content=text)))  # type: ignore[arg-type]
    result = run_agent(url, "m", "t", runtime)
    assert result.status == "complete" and result.final_answer == "9"
    assert (runtime.root / "t.txt").read_text() == "9"


@pytest.mark.parametrize(("code", "status"), [(500, "infra_error"), (400, "aborted")])
def test_endpoint_errors_end_with_an_explicit_status(
    scripted: Server, runtime: LocalDirRuntime, code: int, status: str
) -> None:
    server, url = scripted
    server.reset(script(Reply(status_code=code)))  # type: ignore[arg-type]
    result = run_agent(url, "m", "t", runtime)
    assert result.status == status and str(code) in (result.error or "")


def test_unreachable_endpoint_is_an_infra_error(runtime: LocalDirRuntime) -> None:
    result = run_agent("http://127.0.0.1:9", "m", "t", runtime)
    assert result.status == "infra_error" and result.n_calls == 0


def test_run_episode_prepares_runs_and_grades_with_partial_credit(
    scripted: Server, runtime: LocalDirRuntime
) -> None:
    server, url = scripted
    task = next(t for t in digits_taskset().heldout if t.family == "reverse")
    wrong = task.grader.checks[1].expected[::-1] + "0"  # type: ignore[union-attr]
    server.reset(
        script(
            Reply(tool_calls=[tc("write_file", path="answer.txt", content=wrong)]),
            Reply(tool_calls=[tc("finish", answer=wrong)]),
        )  # type: ignore[arg-type]
    )
    result, grade = run_episode(url, "m", task, runtime)
    assert result.status == "complete"
    assert server.seen[0].headers["x-tidal-task"] == task.task_id
    # the file exists and the agent finished, but the content is wrong: 2 of 3 checks
    assert grade.reward == pytest.approx(2 / 3) and not grade.success
    assert grade.details["called finish"]


def test_replaying_demonstrations_through_the_harness_solves_every_tools_task(
    scripted: Server, tmp_path: Path
) -> None:
    """A server that answers with each task's demonstration turns: the harness must reach
    full credit, and see exactly the tool results the demonstrations were built with."""
    server, url = scripted
    tasks = tools_taskset().heldout
    for i, task in enumerate(tasks):
        demos = {d.role: d for d in demonstrations(task)}

        def responder(seen: Seen, history: list[Seen], demos=demos) -> Reply:  # type: ignore[no-untyped-def]
            turns = [m for m in demos[seen.role].messages if m["role"] == "assistant"]
            calls = turns[len(history)]["tool_calls"]
            return Reply(
                tool_calls=[(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            )

        server.reset(responder)
        root = tmp_path / f"ep{i}"
        root.mkdir()
        result, grade = run_episode(url, "m", task, LocalDirRuntime(root), AgentConfig())
        assert result.status == "complete" and grade.success, task.task_id
        assert len(result.sessions) == (2 if task.family == "subagent" else 1)
        last_main = [s for s in server.seen if s.role == "main"][-1]
        sent = [m.get("content") for m in last_main.messages if m["role"] in ("user", "tool")]
        want = [
            m.get("content") for m in demos["main"].messages[:-1] if m["role"] in ("user", "tool")
        ]
        assert sent == want
