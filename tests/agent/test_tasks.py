"""Task sets, graders (partial credit) and demonstrations (rendered by the real template)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidal.agent.runtime import LocalDirRuntime
from tidal.agent.tasks import (
    TEACHERS,
    FileChecks,
    FileContains,
    FileEquals,
    FileExists,
    Task,
    TaskError,
    demonstrations,
    digits_taskset,
    files_taskset,
    grade,
    load_taskset,
    many_files_task,
    prepare,
    taught,
    tools_taskset,
)
from tidal.agent.tools import ALL_TOOLS, format_tool_call_text, tool_schemas


def test_digits_split_is_disjoint_by_number_and_answers_are_right() -> None:
    ts = digits_taskset(n_heldout_numbers=30)
    train_numbers = {t.task_id.split("-")[1] for t in ts.train}
    held_numbers = {t.task_id.split("-")[1] for t in ts.heldout}
    assert len(held_numbers) == 30 and not train_numbers & held_numbers
    assert len(ts.train) == 3 * 870 and len(ts.heldout) == 3 * 30
    by_id = {t.task_id: t for t in ts.train + ts.heldout}
    assert by_id["reverse-471"].prompt == "Write 471 reversed to answer.txt."
    assert by_id["reverse-471"].grader.checks[1] == FileEquals("answer.txt", "174")
    assert by_id["max-471"].grader.checks[1] == FileEquals("answer.txt", "7")
    assert by_id["copy-471"].grader.checks[1] == FileEquals("answer.txt", "471")
    assert digits_taskset(seed=1).heldout != ts.heldout


def test_unknown_task_set_or_family_is_a_clear_error() -> None:
    with pytest.raises(TaskError, match="unknown task set 'nope'"):
        load_taskset("nope")
    with pytest.raises(TaskError, match="unknown digits family 'sum'"):
        digits_taskset(families=("sum",))
    with pytest.raises(TaskError, match="at least one check"):
        Task("t", "p", FileChecks(()))
    with pytest.raises(TaskError, match="has no grade"):
        Task("t", "p", ())  # type: ignore[arg-type]


def test_grade_gives_partial_credit_from_the_files(runtime: LocalDirRuntime) -> None:
    task = Task(
        "t",
        "p",
        FileChecks((
            FileExists("a.txt"),
            FileEquals("a.txt", "42"),
            FileContains("log.txt", "ok"),
            FileExists("missing.txt"),
        )),
    )
    assert grade(task, runtime).reward == 0.0
    runtime.write_file("a.txt", "41\n")
    g = grade(task, runtime)
    assert g.reward == 0.25 and g.partial_score == 0.25 and not g.success
    assert g.details == {
        "a.txt exists": True,
        "a.txt == '42'": False,
        "log.txt contains 'ok'": False,
        "missing.txt exists": False,
    }
    assert g.by_kind == {"exists": 0.5, "equals": 0.0, "contains": 0.0}
    runtime.write_file("a.txt", " 42\n")  # surrounding whitespace is ignored
    runtime.write_file("log.txt", "all ok")
    assert grade(task, runtime).reward == 0.75
    runtime.write_file("missing.txt", "")
    assert grade(task, runtime).success
    # an agent that never called finish keeps its files' credit but does not succeed
    g = grade(task, runtime, finished=False)
    assert g.reward == 0.8 and not g.success and g.details["called finish"] is False
    assert g.by_kind == {"exists": 1.0, "equals": 1.0, "contains": 1.0, "finished": 0.0}
    assert grade(task, runtime, finished=True).success


def test_many_files_task_credits_each_file(runtime: LocalDirRuntime) -> None:
    task = many_files_task("m", 4)
    runtime.write_file("f1.txt", "1")
    runtime.write_file("f3.txt", "3")
    runtime.write_file("f4.txt", "5")
    assert grade(task, runtime).reward == 0.5


def test_every_demonstration_solves_its_task(runtime: LocalDirRuntime, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ts = tools_taskset()
    tasks = list(ts.train[:6]) + list(digits_taskset().heldout[::10])
    for i, task in enumerate(tasks):
        root = tmp_path / f"r{i}"
        root.mkdir()
        rt = LocalDirRuntime(root)
        prepare(task, rt)
        # replay the demonstration's tool calls in a fresh runtime
        for msg in demonstrations(task)[0].messages:
            for call in msg.get("tool_calls", []):
                fn = call["function"]
                if fn["name"] == "write_file":
                    rt.write_file(fn["arguments"]["path"], fn["arguments"]["content"])
        assert grade(task, rt).success, task.task_id


def test_demonstration_tool_results_are_real() -> None:
    task = next(t for t in tools_taskset().train if t.family == "bash")
    msgs = demonstrations(task)[0].messages
    n = task.grader.checks[1].expected  # type: ignore[union-attr]
    assert msgs[3] == {"role": "tool", "tool_call_id": "call_0", "content": f"exit code 0\n{n}"}
    assert msgs[-1]["tool_calls"][0]["function"] == {"name": "finish", "arguments": {"answer": n}}


def test_subagent_task_has_a_subagent_demonstration() -> None:
    task = next(t for t in tools_taskset().train if t.family == "subagent")
    main, sub = demonstrations(task)
    assert main.role == "main" and sub.role == "subagent"
    assert "spawn_subagent" not in sub.tools and "spawn_subagent" in main.tools
    answer = task.grader.checks[1].expected  # type: ignore[union-attr]
    assert main.messages[3]["content"] == answer  # the helper's answer is the tool result
    assert sub.messages[-1]["tool_calls"][0]["function"]["arguments"] == {"answer": answer}


def test_demonstrations_render_to_the_tool_call_text_the_gateway_parses() -> None:
    from tidal.engine.tiny import ensure_tiny, load_tokenizer

    tok = load_tokenizer(ensure_tiny())
    task = next(t for t in digits_taskset().train if t.task_id == "reverse-471")
    (demo,) = demonstrations(task)
    text = tok.apply_chat_template(
        list(demo.messages), tools=tool_schemas(demo.tools), tokenize=False
    )
    first = format_tool_call_text("write_file", {"path": "answer.txt", "content": "174"})
    last = format_tool_call_text("finish", {"answer": "174"})
    assert first == (
        '<tool_call>\n{"name": "write_file", "arguments": '
        '{"path": "answer.txt", "content": "174"}}\n</tool_call>'
    )
    assert f"<|im_start|>assistant\n{first}<|im_end|>" in text
    assert text.endswith(f"<|im_start|>assistant\n{last}<|im_end|>\n")
    assert "<tool_response>\nwrote 3 characters to answer.txt\n</tool_response>" in text
    # the rollout prompt (as the gateway renders the harness's request) is a prefix
    prompt = tok.apply_chat_template(
        list(demo.messages[:2]),
        tools=tool_schemas(ALL_TOOLS),
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text.startswith(prompt)
    body = first.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
    assert json.loads(body) == {
        "name": "write_file",
        "arguments": {"path": "answer.txt", "content": "174"},
    }


def test_files_set_holds_out_unseen_combinations_of_seen_parts() -> None:
    ts = load_taskset("files")
    combos = {t.prompt for t in ts.train}
    assert len(ts.train) == 128 and len(ts.heldout) == 32
    assert not combos & {t.prompt for t in ts.heldout}
    train_digits = {t.grader.checks[1].expected for t in ts.train}  # type: ignore[union-attr]
    train_paths = {t.grader.checks[0].path for t in ts.train}
    for t in ts.heldout:
        checks = t.grader.checks  # type: ignore[attr-defined]
        assert checks[1].expected in train_digits and checks[0].path in train_paths
    task = next(t for t in ts.train + ts.heldout if t.task_id == "file-cat-7")
    assert task.prompt == "Write 7 to cat.txt."
    assert task.grader.checks == (FileExists("cat.txt"), FileEquals("cat.txt", "7"))


def test_files_partial_credit_for_the_right_file_with_the_wrong_digit(
    runtime: LocalDirRuntime,
) -> None:
    task = load_taskset("files").heldout[0]
    path = task.grader.checks[0].path
    runtime.write_file("other.txt", task.grader.checks[1].expected)  # type: ignore[union-attr]
    assert grade(task, runtime).reward == 0.0
    runtime.write_file(path, "x")
    assert grade(task, runtime).reward == 0.5


def test_default_and_mixed_sets() -> None:
    assert load_taskset().name == "files"
    mixed = load_taskset("mixed")
    families = {t.family for t in mixed.train}
    assert families == {"file", "bash", "subagent", "steps"}
    assert {t.family for t in mixed.heldout} == {"file"}


def test_mixed_teacher_adds_a_sloppy_solution_the_grader_rejects(tmp_path: Path) -> None:
    """`mixed` demonstrates each task twice; the second writes "7." for "7", which
    earns the partial credit of a file that exists with the wrong text."""
    tasks = list(files_taskset().train[:3])
    assert taught(tasks, "exact") == tasks
    mixed = taught(tasks, "mixed")
    assert mixed[:3] == tasks and len(mixed) == 6
    for i, (task, sloppy) in enumerate(zip(tasks, mixed[3:], strict=True)):
        assert sloppy.prompt == task.prompt and sloppy.grader == task.grader
        want = task.grader.checks[1].expected  # type: ignore[union-attr]
        writes = [
            call["function"]["arguments"]
            for msg in demonstrations(sloppy)[0].messages
            for call in msg.get("tool_calls", [])
            if call["function"]["name"] == "write_file"
        ]
        assert [w["content"] for w in writes] == [want + "."]
        (tmp_path / f"r{i}").mkdir()
        rt = LocalDirRuntime(tmp_path / f"r{i}")
        rt.write_file(writes[0]["path"], writes[0]["content"])
        assert grade(task, rt, finished=True).reward == pytest.approx(2 / 3)
    with pytest.raises(TaskError, match="unknown teacher 'lazy'"):
        taught(tasks, "lazy")


def test_config_teachers_are_the_task_module_teachers() -> None:
    from typing import get_args

    from tidal.run.config import WarmstartConfig

    annotation = WarmstartConfig.model_fields["teacher"].annotation
    assert get_args(annotation) == TEACHERS
