"""tidal.agent: harnesses, their runtimes, tasks and graders.

- `Harness`, `EpisodeContext`, `HarnessResult`, `run_task` (episode.py): the seam any
  harness fills; `CommandHarness` (command.py): any program, run in the sandbox.
- `run_agent` / `run_episode` / `BuiltinHarness` (harness.py): the built-in tool-calling
  loop over an OpenAI-compatible endpoint (the gateway), with subagents, parallel tool
  calls, compaction and explicit end statuses.
- `harbor.py`: tasks in the Harbor format (Terminal-Bench 2) and their test.sh grader;
  `environment.py`: a task's environment built into its episodes' sandbox config;
  `taskcheck.py` / `cli.py`: `tidal tasks check`.
- `ToolRuntime` / `LocalDirRuntime` (runtime.py): what harnesses and graders need from
  an environment, and an unisolated local stand-in for tests and demos;
  `SandboxRuntime` (sandboxed.py): the same on a real sandbox.
- `endpoint.py`: the session URL and headers (the only wire format the gateway needs).
- `tasks.py`: `Task`, the `Grader` seam and `FileChecks`, built-in task sets
  (`load_taskset`), `demonstrations` (and `taught`: which solutions the warm start
  imitates).
"""

from tidal.agent.endpoint import SpawnLink, new_session_id, request_headers, session_base_url
from tidal.agent.episode import (
    EpisodeContext,
    FunctionHarness,
    Harness,
    HarnessResult,
    SessionStatus,
    run_task,
)
from tidal.agent.harness import AgentConfig, AgentResult, BuiltinHarness, run_agent, run_episode
from tidal.agent.runtime import LocalDirRuntime, RuntimeToolError, ToolRuntime
from tidal.agent.tasks import (
    DEFAULT_SYSTEM_PROMPT,
    DEFAULT_TASKSET,
    Demonstration,
    FileChecks,
    Grade,
    Grader,
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
from tidal.sandbox.types import ExecResult

__all__ = [
    "ALL_TOOLS",
    "DEFAULT_SYSTEM_PROMPT",
    "DEFAULT_TASKSET",
    "AgentConfig",
    "AgentResult",
    "BuiltinHarness",
    "Demonstration",
    "EpisodeContext",
    "ExecResult",
    "FileChecks",
    "FunctionHarness",
    "Grade",
    "Grader",
    "Harness",
    "HarnessResult",
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
    "run_task",
    "session_base_url",
    "taught",
    "tool_schemas",
]
