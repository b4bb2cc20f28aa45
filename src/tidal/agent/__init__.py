"""tidal.agent: the built-in agent harness, its tools, and task sets with graders.

- `run_agent` / `run_episode` (harness.py): the tool-calling loop over an
  OpenAI-compatible endpoint (the gateway), with subagents, parallel tool calls,
  compaction and explicit end statuses.
- `ToolRuntime` / `LocalDirRuntime` (runtime.py): what the harness needs from an
  environment, and an unisolated local stand-in for tests and demos.
- `endpoint.py`: the session URL and headers (the only wire format the gateway needs).
- `tasks.py`: task sets (`load_taskset`), `grade` (partial credit), `demonstrations`
  (and `taught`: which solutions the warm start imitates).
"""

from tidal.agent.endpoint import SpawnLink, new_session_id, request_headers, session_base_url
from tidal.agent.harness import AgentConfig, AgentResult, SessionStatus, run_agent, run_episode
from tidal.agent.runtime import ExecResult, LocalDirRuntime, RuntimeToolError, ToolRuntime
from tidal.agent.tasks import (
    DEFAULT_SYSTEM_PROMPT,
    DEFAULT_TASKSET,
    Demonstration,
    Grade,
    Task,
    TaskError,
    TaskSet,
    demonstrations,
    grade,
    load_taskset,
    prepare,
    taught,
)
from tidal.agent.tools import ALL_TOOLS, format_tool_call_text, tool_schemas

__all__ = [
    "ALL_TOOLS",
    "DEFAULT_SYSTEM_PROMPT",
    "DEFAULT_TASKSET",
    "AgentConfig",
    "AgentResult",
    "Demonstration",
    "ExecResult",
    "Grade",
    "LocalDirRuntime",
    "RuntimeToolError",
    "SessionStatus",
    "SpawnLink",
    "Task",
    "TaskError",
    "TaskSet",
    "ToolRuntime",
    "demonstrations",
    "format_tool_call_text",
    "grade",
    "load_taskset",
    "new_session_id",
    "prepare",
    "request_headers",
    "run_agent",
    "run_episode",
    "session_base_url",
    "taught",
    "tool_schemas",
]
