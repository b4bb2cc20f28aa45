"""The built-in agent harness: a tool-calling loop over any OpenAI-compatible endpoint.

`run_agent` runs one session (and the subagent sessions it spawns) with the stock
`openai` client. Per turn: one chat-completions call with `tools=`, then every tool call
of the reply runs in order and its result is appended with the call's id (parallel
tool calls). `finish(answer)` ends the session as complete. `spawn_subagent` runs the
same loop in a new session, linked to the spawning call through its base URL, with a
smaller budget and role "subagent"; its final answer is the tool result.

Compaction: when the last response's usage (prompt + completion tokens) exceeds
`context_budget_tokens`, the harness asks the model to summarise its progress (a call
with role main_summary / subagent_summary that extends the current context), then
continues from a fresh context [system, task, summary]; the first call of that context
names the summary call as its parent (`endpoint.request_headers`).

Every session ends with an explicit status:
- complete: the model called finish;
- truncated: out of turns, out of compactions, or no tool call twice in a row (the
  first time the model is nudged);
- timeout: the per-session wall-clock limit passed (checked before each call, bounding
  each request and each command by the time left);
- aborted: the endpoint refused a request (4xx, e.g. a context that is too long);
- infra_error: the endpoint or the runtime failed (connection error, 5xx, a runtime
  exception other than a refused request).
Malformed tool calls never end a session: they get an "error: ..." tool result.

Deliberately simplified: tool calls of one turn run sequentially (results in call
order); a subagent's own budget is `subagent_max_turns` / `subagent_time_limit_s`,
capped by its parent's remaining time; no retries (a retried request would be a new
recorded call, so retrying is the caller's decision).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import openai
from openai import OpenAI
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionMessage,
    ChatCompletionMessageFunctionToolCall,
)

from tidal.agent.endpoint import (
    API_KEY_PLACEHOLDER,
    SpawnLink,
    call_id_of,
    default_client_factory,
    new_session_id,
    request_headers,
    session_base_url,
)
from tidal.agent.episode import EpisodeContext, HarnessResult, SessionStatus, run_task
from tidal.agent.runtime import ToolRuntime
from tidal.agent.tasks import DEFAULT_SYSTEM_PROMPT, Grade, Task
from tidal.agent.tools import (
    ALL_TOOLS,
    FINISH,
    SPAWN_SUBAGENT,
    ToolCall,
    parse_tool_calls,
    run_runtime_tool,
    tool_schemas,
)

ClientFactory = Callable[[str, str], OpenAI]  # (base URL, API key) -> client

NUDGE = "Call a tool. When the task is done, call finish with your answer."
SUMMARY_REQUEST = (
    "Your context is full. Summarise your progress on the task so far: what is done, "
    "what you found, and what remains. Reply with the summary only."
)
SUMMARY_PREFIX = "Summary of your progress so far:\n"


@dataclass(frozen=True)
class AgentConfig:
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    tools: tuple[str, ...] = ALL_TOOLS
    max_turns: int = 12  # model calls per context chain, summary calls excluded
    time_limit_s: float = 300.0  # per main session, wall clock
    context_budget_tokens: int = 8192  # compaction threshold (prompt + completion)
    max_compactions: int = 2
    max_tokens: int = 256  # per call
    temperature: float = 1.0
    command_timeout_s: float = 30.0
    tool_output_cap: int = 4000  # characters of a read_file result
    subagent_max_turns: int = 6
    subagent_time_limit_s: float = 120.0
    max_subagent_depth: int = 1  # subagents of depth >= this cannot spawn
    request_timeout_s: float = 600.0  # per call, further capped by the time left
    extra_body: Mapping[str, Any] = field(default_factory=dict)  # e.g. {"seed": 1}

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens", "subagent_max_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"AgentConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("time_limit_s", "command_timeout_s", "subagent_time_limit_s",
                     "request_timeout_s"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"AgentConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.context_budget_tokens < 1 or self.max_compactions < 0:
            raise ValueError("context_budget_tokens must be >= 1 and max_compactions >= 0")
        if FINISH not in self.tools:
            raise ValueError("AgentConfig.tools must include finish")
        tool_schemas(self.tools)  # refuses unknown tool names


@dataclass(frozen=True)
class AgentResult:
    """How one session went. `subagents` are the results of the sessions it spawned."""

    session_id: str
    role: str
    status: SessionStatus
    final_answer: str | None
    n_calls: int  # model calls made by this session, summary calls included
    n_tool_calls: int
    n_compactions: int
    call_ids: tuple[str, ...]
    subagents: tuple[AgentResult, ...]
    elapsed_s: float
    last_context_tokens: int
    error: str | None = None

    @property
    def subagent_session_ids(self) -> tuple[str, ...]:
        """Ids of all sessions spawned below this one, depth first."""
        ids: list[str] = []
        for sub in self.subagents:
            ids.append(sub.session_id)
            ids.extend(sub.subagent_session_ids)
        return tuple(ids)

    def all_sessions(self) -> list[AgentResult]:
        """This session and every session below it (to record one outcome each)."""
        out = [self]
        for sub in self.subagents:
            out.extend(sub.all_sessions())
        return out


class _EndSession(Exception):  # noqa: N818 - control flow, not an error
    def __init__(self, status: SessionStatus, error: str | None = None) -> None:
        super().__init__(error or status)
        self.status = status
        self.error = error


def _assistant_message(message: ChatCompletionMessage) -> dict[str, Any]:
    """The assistant turn as a stock client sends it back."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    calls = [
        tc
        for tc in message.tool_calls or []
        if isinstance(tc, ChatCompletionMessageFunctionToolCall)
    ]
    if calls:
        out["tool_calls"] = [
            {
                "id": tc.id,
                "type": "function",
                "function": {"name": tc.function.name, "arguments": tc.function.arguments},
            }
            for tc in calls
        ]
    return out


class _Session:
    """Runs one session to its end; spawns subagent sessions through the same class."""

    def __init__(
        self,
        *,
        gateway_url: str,
        model: str,
        prompt: str,
        runtime: ToolRuntime,
        config: AgentConfig,
        client_factory: ClientFactory,
        api_key: str,
        session_id: str,
        role: str,
        task_id: str | None,
        depth: int,
        deadline: float,
        max_turns: int,
        spawn: SpawnLink | None,
    ) -> None:
        self.gateway_url, self.model, self.prompt = gateway_url, model, prompt
        self.runtime, self.config, self.client_factory = runtime, config, client_factory
        self.api_key = api_key
        self.session_id, self.role, self.task_id = session_id, role, task_id
        self.depth, self.deadline, self.max_turns = depth, deadline, max_turns
        can_spawn = depth < config.max_subagent_depth
        self.tools = tuple(t for t in config.tools if can_spawn or t != SPAWN_SUBAGENT)
        self.schemas = tool_schemas(self.tools)
        self.client = client_factory(session_base_url(gateway_url, session_id, spawn), api_key)
        self.call_ids: list[str] = []
        self.subagents: list[AgentResult] = []
        self.n_tool_calls = 0
        self.n_compactions = 0
        self.last_tokens = 0
        self.final_answer: str | None = None

    # ---------------------------------------------------------------- model calls

    def _remaining(self) -> float:
        return self.deadline - time.monotonic()

    def _call(
        self, messages: list[dict[str, Any]], role: str, parent: str | None
    ) -> ChatCompletion:
        remaining = self._remaining()
        if remaining <= 0:
            raise _EndSession("timeout", "time limit reached before a model call")
        try:
            response = self.client.chat.completions.create(
                model=self.model,
                messages=messages,  # type: ignore[arg-type]
                tools=self.schemas,  # type: ignore[arg-type]
                max_tokens=self.config.max_tokens,
                temperature=self.config.temperature,
                extra_headers=request_headers(role, self.task_id, parent),
                extra_body=dict(self.config.extra_body) or None,
                timeout=min(remaining, self.config.request_timeout_s),
            )
        except openai.APITimeoutError as e:
            if self._remaining() <= 0:
                raise _EndSession("timeout", "time limit reached during a model call") from e
            raise _EndSession("infra_error", f"model call timed out: {e}") from e
        except openai.APIStatusError as e:
            status: SessionStatus = "infra_error" if e.status_code >= 500 else "aborted"
            raise _EndSession(status, f"endpoint answered {e.status_code}: {e.message}") from e
        except openai.APIError as e:  # connection errors, unparsable responses
            raise _EndSession("infra_error", f"model call failed: {e}") from e
        if not response.choices:
            raise _EndSession("infra_error", "endpoint returned a response without choices")
        self.call_ids.append(call_id_of(response))
        if response.usage is not None:
            self.last_tokens = response.usage.prompt_tokens + response.usage.completion_tokens
        return response

    # ---------------------------------------------------------------- tools

    def _spawn(self, call: ToolCall, parent_call_id: str) -> str:
        # named by its parent and its place there, so that a resumed session spawns the
        # same ids again and the gateway replays their recorded calls (tidal.agent.preempt)
        sub_id = f"{self.session_id}-sub{len(self.subagents) + 1}"
        deadline = min(self.deadline, time.monotonic() + self.config.subagent_time_limit_s)
        sub = _Session(
            gateway_url=self.gateway_url,
            model=self.model,
            prompt=call.arguments["task_description"],
            runtime=self.runtime,
            config=self.config,
            client_factory=self.client_factory,
            api_key=self.api_key,
            session_id=sub_id,
            role="subagent",
            task_id=self.task_id,
            depth=self.depth + 1,
            deadline=deadline,
            max_turns=self.config.subagent_max_turns,
            spawn=SpawnLink(self.session_id, parent_call_id),
        ).run()
        self.subagents.append(sub)
        if sub.final_answer is not None:
            return sub.final_answer
        return f"error: the helper ended with status {sub.status} and no answer"

    def _run_tool(self, call: ToolCall, parent_call_id: str) -> str:
        self.n_tool_calls += 1
        if call.error is None and call.name not in self.tools:
            return f"error: tool {call.name!r} is not available here"
        if call.error is None and call.name == SPAWN_SUBAGENT:
            return self._spawn(call, parent_call_id)
        timeout = max(0.001, min(self.config.command_timeout_s, self._remaining()))
        try:
            return run_runtime_tool(call, self.runtime, timeout, self.config.tool_output_cap)
        except Exception as e:  # the runtime broke: the session cannot go on
            raise _EndSession("infra_error", f"runtime failed on {call.name}: {e!r}") from e

    # ---------------------------------------------------------------- the loop

    def _fresh_context(self, summary: str | None) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": self.config.system_prompt},
            {"role": "user", "content": self.prompt},
        ]
        if summary is not None:
            messages.append({"role": "user", "content": SUMMARY_PREFIX + summary})
        return messages

    def _compact(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
        if self.n_compactions >= self.config.max_compactions:
            raise _EndSession("truncated", "context budget exceeded and no compactions left")
        summary_role = "subagent_summary" if self.depth > 0 else "main_summary"
        request = [*messages, {"role": "user", "content": SUMMARY_REQUEST}]
        response = self._call(request, summary_role, None)
        self.n_compactions += 1
        summary = (response.choices[0].message.content or "").strip() or "(no summary)"
        return self._fresh_context(summary), call_id_of(response)

    def _loop(self) -> None:
        messages = self._fresh_context(None)
        parent: str | None = None  # the summary call the next call follows
        nudged = False
        turns = 0
        while True:
            if turns >= self.max_turns:
                raise _EndSession("truncated", f"no finish within {self.max_turns} turns")
            response = self._call(messages, self.role, parent)
            parent = None
            turns += 1
            call_id = call_id_of(response)
            message = response.choices[0].message
            calls = parse_tool_calls(message, fallback_prefix=f"{call_id}-text")
            messages.append(_assistant_message(message))
            if not calls:
                if nudged:
                    raise _EndSession("truncated", "the model called no tool after a nudge")
                nudged = True
                messages.append({"role": "user", "content": NUDGE})
                continue
            for call in calls:
                if call.name == FINISH and call.error is None:
                    self.n_tool_calls += 1
                    self.final_answer = call.arguments["answer"]
                    return
                result = self._run_tool(call, call_id)
                messages.append({"role": "tool", "tool_call_id": call.call_id, "content": result})
            if self._remaining() <= 0:
                raise _EndSession("timeout", "time limit reached while running tools")
            if self.last_tokens > self.config.context_budget_tokens:
                messages, parent = self._compact(messages)

    def run(self) -> AgentResult:
        start = time.monotonic()
        status: SessionStatus = "complete"
        error: str | None = None
        try:
            self._loop()
        except _EndSession as end:
            status, error = end.status, end.error
        return AgentResult(
            session_id=self.session_id,
            role=self.role,
            status=status,
            final_answer=self.final_answer,
            n_calls=len(self.call_ids),
            n_tool_calls=self.n_tool_calls,
            n_compactions=self.n_compactions,
            call_ids=tuple(self.call_ids),
            subagents=tuple(self.subagents),
            elapsed_s=time.monotonic() - start,
            last_context_tokens=self.last_tokens,
            error=error,
        )


def run_agent(
    gateway_url: str,
    model: str,
    prompt: str,
    runtime: ToolRuntime,
    config: AgentConfig | None = None,
    *,
    task_id: str | None = None,
    session_id: str | None = None,
    client_factory: ClientFactory | None = None,
    api_key: str = API_KEY_PLACEHOLDER,
) -> AgentResult:
    """Run one main session against `gateway_url` (the gateway root; the session's base
    URL is built by `endpoint.session_base_url`). Never raises for model or tool
    misbehaviour: the result's status says how the session ended. `api_key` is sent with
    every call (an episode's key in `tidal run`: `tidal.gateway.access`)."""
    config = config or AgentConfig()
    if client_factory is None:
        timeout = config.request_timeout_s

        def client_factory(base_url: str, api_key: str) -> OpenAI:
            return default_client_factory(base_url, api_key, timeout)

    return _Session(
        gateway_url=gateway_url,
        model=model,
        prompt=prompt,
        runtime=runtime,
        config=config,
        client_factory=client_factory,
        api_key=api_key,
        session_id=session_id or new_session_id(),
        role="main",
        task_id=task_id,
        depth=0,
        deadline=time.monotonic() + config.time_limit_s,
        max_turns=config.max_turns,
        spawn=None,
    ).run()


@dataclass(frozen=True)
class BuiltinHarness:
    """The built-in loop as a `Harness` (`[agent] harness = "builtin"`): the episode's
    time limit replaces `config.time_limit_s`; every session it runs (subagents too)
    reports its own status."""

    config: AgentConfig = field(default_factory=AgentConfig)
    client_factory: ClientFactory | None = None

    def run(self, ctx: EpisodeContext) -> HarnessResult:
        result = run_agent(
            ctx.gateway_url, ctx.model, ctx.task.prompt, ctx.runtime,
            replace(self.config, time_limit_s=max(ctx.remaining(), 1e-3)),
            task_id=ctx.task.task_id, session_id=ctx.session_id,
            client_factory=self.client_factory, api_key=ctx.api_key,
        )
        return HarnessResult(
            status=result.status, error=result.error,
            sessions={r.session_id: (r.status, r.error) for r in result.all_sessions()},
            finished=result.status == "complete",
        )


def run_episode(
    gateway_url: str,
    model: str,
    task: Task,
    runtime: ToolRuntime,
    config: AgentConfig | None = None,
    *,
    session_id: str | None = None,
    client_factory: ClientFactory | None = None,
) -> tuple[HarnessResult, Grade]:
    """The built-in harness on one task: prepare a fresh runtime for `task`, run the
    agent, grade what it left (and, for file checks, whether it called finish)."""
    config = config or AgentConfig()
    ctx = EpisodeContext(gateway_url, session_id or new_session_id(), model, task, runtime,
                         task.time_limit_s or config.time_limit_s)
    return run_task(BuiltinHarness(config, client_factory), ctx)
