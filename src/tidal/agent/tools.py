"""The built-in tools: their schemas, how calls are read from a response, and how the
runtime-backed ones run.

Tools: `bash(command)`, `read_file(path)`, `write_file(path, content)`,
`spawn_subagent(task_description)` and `finish(answer)`. The last two are control flow
and are handled by the harness; the first three run in a `ToolRuntime` here.

Tool calls are read from the OpenAI `tool_calls` field that the gateway fills by
parsing the model's raw text. If a response has no `tool_calls` but its text holds
Qwen-style `<tool_call>{...}</tool_call>` blocks (e.g. an endpoint that does not parse
them), those are read instead: a trivial fallback, not a second parser to maintain.

Every problem with a call (unknown tool, arguments that are not a JSON object, missing
or mistyped arguments) becomes a `ToolCall` with `error` set; the harness answers it
with an error tool result, never an exception.

Deliberately simplified: tools run one after another even when a turn holds several
calls (results keep the calls' order and ids, as the model expects); concurrent
execution would only matter for slow commands.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from openai.types.chat import ChatCompletionMessage

from tidal.agent.runtime import RuntimeToolError, ToolRuntime
from tidal.sandbox.types import ExecResult

BASH, READ_FILE, WRITE_FILE, SPAWN_SUBAGENT, FINISH = (
    "bash", "read_file", "write_file", "spawn_subagent", "finish",
)  # fmt: skip
ALL_TOOLS: tuple[str, ...] = (BASH, READ_FILE, WRITE_FILE, SPAWN_SUBAGENT, FINISH)

# name -> (description, {argument: description}); every argument is a required string.
_TOOL_SPECS: dict[str, tuple[str, dict[str, str]]] = {
    BASH: ("Run a bash command.", {"command": "The command."}),
    READ_FILE: ("Read a file.", {"path": "File path."}),
    WRITE_FILE: ("Write text to a file.", {"path": "File path.", "content": "The text."}),
    SPAWN_SUBAGENT: (
        "Give a subtask to a helper agent; returns its answer.",
        {"task_description": "The subtask."},
    ),
    FINISH: ("End the task.", {"answer": "Final answer."}),
}

_TOOL_CALL_TEXT = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def tool_schemas(names: tuple[str, ...] = ALL_TOOLS) -> list[dict[str, Any]]:
    """OpenAI `tools=` entries for the named built-in tools, in the order given."""
    unknown = [n for n in names if n not in _TOOL_SPECS]
    if unknown:
        raise ValueError(f"unknown tool(s) {unknown}; built-in tools are {list(ALL_TOOLS)}")
    schemas = []
    for name in names:
        description, args = _TOOL_SPECS[name]
        schemas.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": description,
                    "parameters": {
                        "type": "object",
                        "properties": {
                            a: {"type": "string", "description": d} for a, d in args.items()
                        },
                        "required": list(args),
                    },
                },
            }
        )
    return schemas


def format_tool_call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """A tool call exactly as Qwen2.5's chat template renders it and the gateway parses it."""
    return (
        '<tool_call>\n{"name": "'
        + name
        + '", "arguments": '
        + json.dumps(dict(arguments), ensure_ascii=False)
        + "}\n</tool_call>"
    )


@dataclass(frozen=True)
class ToolCall:
    """One tool call as read from a response. `error` is set when it cannot be run."""

    call_id: str
    name: str
    arguments: dict[str, str]
    error: str | None = None


def _check_arguments(name: str, raw: object) -> tuple[dict[str, str], str | None]:
    if name not in _TOOL_SPECS:
        return {}, f"unknown tool {name!r}; available tools: {', '.join(ALL_TOOLS)}"
    args: object = raw
    if isinstance(raw, str):
        try:
            args = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as e:
            return {}, f"arguments of {name} are not valid JSON ({e.msg} at {e.pos})"
    if not isinstance(args, dict):
        return {}, f"arguments of {name} must be a JSON object, got {type(args).__name__}"
    expected = _TOOL_SPECS[name][1]
    missing = [a for a in expected if a not in args]
    extra = [a for a in args if a not in expected]
    if missing or extra:
        problems = [f"missing {missing}" if missing else "", f"unexpected {extra}" if extra else ""]
        return {}, (
            f"bad arguments for {name}: {'; '.join(p for p in problems if p)}; "
            f"expected {list(expected)}"
        )
    wrong = [a for a, v in args.items() if not isinstance(v, str)]
    if wrong:
        return {}, f"arguments {wrong} of {name} must be strings"
    return dict(args), None


def parse_tool_calls(message: ChatCompletionMessage, fallback_prefix: str) -> list[ToolCall]:
    """The tool calls of an assistant message, in order; malformed ones carry an error.

    `fallback_prefix` names the ids of calls read from text (no `tool_calls` field).
    """
    calls: list[ToolCall] = []
    for tc in message.tool_calls or []:
        function = getattr(tc, "function", None)
        if function is None:  # a custom (non-function) tool call
            calls.append(ToolCall(tc.id, "?", {}, "only function tool calls are supported"))
            continue
        args, error = _check_arguments(function.name, function.arguments)
        calls.append(ToolCall(tc.id, function.name, args, error))
    if calls or not message.content:
        return calls
    for i, block in enumerate(_TOOL_CALL_TEXT.findall(message.content)):
        call_id = f"{fallback_prefix}-{i}"
        try:
            obj = json.loads(block)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(call_id, "?", {}, f"tool call is not valid JSON ({e.msg})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(call_id, "?", {}, 'tool call needs a "name" string'))
            continue
        args, error = _check_arguments(obj["name"], obj.get("arguments", {}))
        calls.append(ToolCall(call_id, obj["name"], args, error))
    return calls


# ------------------------------------------------------------------ runtime-backed tools


def format_exec_result(result: ExecResult) -> str:
    """The bash tool's result text."""
    text = f"exit code {result.exit_code}"
    if result.timed_out:
        text += " (timed out)"
    if result.stdout:
        text += "\n" + result.stdout.rstrip("\n")
    if result.stderr:
        text += "\n[stderr]\n" + result.stderr.rstrip("\n")
    return text


def format_write_result(path: str, content: str) -> str:
    """The write_file tool's result text."""
    return f"wrote {len(content)} characters to {path}"


def run_runtime_tool(
    call: ToolCall, runtime: ToolRuntime, timeout_s: float, output_cap: int
) -> str:
    """Run bash/read_file/write_file; errors become "error: ..." result text."""
    if call.error is not None:
        return f"error: {call.error}"
    try:
        if call.name == BASH:
            return format_exec_result(runtime.exec(call.arguments["command"], timeout_s))
        if call.name == READ_FILE:
            text = runtime.read_file(call.arguments["path"])
            if len(text) > output_cap:
                text = text[:output_cap] + f"\n[... {len(text) - output_cap} more characters cut]"
            return text
        if call.name == WRITE_FILE:
            runtime.write_file(call.arguments["path"], call.arguments["content"])
            return format_write_result(call.arguments["path"], call.arguments["content"])
    except (OSError, RuntimeToolError) as e:
        return f"error: {e}"
    raise ValueError(f"{call.name!r} is not a runtime tool")
