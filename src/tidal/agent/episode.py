"""The harness seam: what a harness gets for one episode, what it returns, and the episode.

tidal trains any agent. Whatever drives the model (the built-in loop, a command run
inside the sandbox, a user's Python function), it is a `Harness`: given an
`EpisodeContext` (the session's gateway URL, the model name, the task, the runtime its
tools act in and its time limit) it runs one episode and returns a `HarnessResult` (how
the sessions it knows ended). Every model call it makes through `ctx.session_url` is
recorded by the gateway; the harness itself needs to know nothing about tidal.

    result, grade = run_task(harness, ctx)      # prepare the runtime, run, grade

Built-in harnesses: `tidal.agent.harness.BuiltinHarness` (the tool-calling loop),
`tidal.agent.command.CommandHarness` (any program, run inside the sandbox). A plain
function `fn(ctx) -> HarnessResult | None` becomes one with `FunctionHarness(fn)`: it
runs outside the sandbox and executes its tools through `ctx.runtime`, whose commands
are bounded by the episode's time left.

Statuses (the same five as the built-in harness, docs/agent.md): complete, truncated,
timeout (past the time limit; graded on what it left), aborted (the harness failed or
gave up after the model had been called; graded), infra_error (masked). The caller
(`tidal.run.rollout`) turns any end before the first model call into infra_error:
there is nothing to train, and it is not the policy's doing.
"""

from __future__ import annotations

import builtins
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from tidal.agent.endpoint import API_KEY_PLACEHOLDER, session_base_url
from tidal.agent.runtime import ToolRuntime
from tidal.agent.tasks import Grade, Task, prepare
from tidal.sandbox.types import ExecResult, ExecStatus

SessionStatus = Literal["complete", "truncated", "timeout", "aborted", "infra_error"]
SESSION_STATUSES: tuple[str, ...] = ("complete", "truncated", "timeout", "aborted", "infra_error")


@dataclass(frozen=True)
class EpisodeContext:
    """What a harness gets for one episode. `gateway_url` is the gateway's root as the
    harness reaches it; `session_url` the base URL to give an OpenAI-compatible client
    (it names the session and the task). `time_limit_s` is the wall clock the episode
    has, counted from `started` (time.monotonic()). `api_key` is the key to send with
    every call: in `tidal run` the episode's own secret, which the gateway accepts only for
    this episode's sessions (`tidal.gateway.access`)."""

    gateway_url: str
    session_id: str
    model: str
    task: Task
    runtime: ToolRuntime
    time_limit_s: float
    started: float = field(default_factory=time.monotonic)
    api_key: str = API_KEY_PLACEHOLDER

    @property
    def session_url(self) -> str:
        return session_base_url(self.gateway_url, self.session_id, task_id=self.task.task_id)

    def remaining(self) -> float:
        return self.started + self.time_limit_s - time.monotonic()


@dataclass(frozen=True)
class HarnessResult:
    """How an episode ended. `status` is the main session's; `sessions` the status and
    error of other sessions the harness ran (subagents), by id; `finished` whether the
    agent declared itself done (the built-in `finish`; None when the harness cannot
    tell); `log` what the harness printed (stdout/stderr tails), kept per session."""

    status: SessionStatus
    error: str | None = None
    sessions: Mapping[str, tuple[SessionStatus, str | None]] = field(default_factory=dict)
    finished: bool | None = None
    log: Mapping[str, str] = field(default_factory=dict)


@runtime_checkable
class Harness(Protocol):
    """Runs one episode. Must not raise for what the model does; an exception is an
    `aborted` episode (infra_error if no model call was made)."""

    def run(self, ctx: EpisodeContext) -> HarnessResult: ...


def run_task(harness: Harness, ctx: EpisodeContext) -> tuple[HarnessResult, Grade]:
    """Prepare the runtime for `ctx.task` (its setup files), run the harness, end the
    agent (`ToolRuntime.end_agent` with the task's `verifier_carry`: its processes
    killed and, for a Harbor task, a fresh environment from the pristine image with only
    the working directory carried over) and grade what the episode left with the task's
    grader; the grade's `extra["verifier_env"]` says what the verifier ran in."""
    prepare(ctx.task, ctx.runtime)
    try:
        result = harness.run(ctx)
    except Exception as e:  # a harness bug or a crash: graded, not trained if no call
        result = HarnessResult("aborted", error=_describe(e))
    if result.status not in SESSION_STATUSES:
        result = HarnessResult("aborted", error=f"harness returned status {result.status!r}")
    verifier_env = ctx.runtime.end_agent(ctx.task.verifier_carry)
    grade = ctx.task.grader.grade(ctx.runtime, finished=result.finished)
    return result, replace(grade, extra={**grade.extra, "verifier_env": verifier_env})


def _describe(e: BaseException) -> str:
    tb = "".join(traceback.format_exception(e)[-3:])
    return f"{type(e).__name__}: {e}\n{tb}"[-2000:]


class DeadlineRuntime:
    """A runtime whose commands end by the episode's deadline (for harnesses that run
    outside the sandbox, where nothing else bounds them)."""

    def __init__(self, runtime: ToolRuntime, deadline: float) -> None:
        self.runtime, self.deadline = runtime, deadline

    def exec(
        self, command: str, timeout_s: float, *, env: Mapping[str, str] | None = None
    ) -> ExecResult:
        left = self.deadline - time.monotonic()
        if left <= 0:
            return ExecResult(ExecStatus.TIMEOUT, 124, "", "the episode's time limit has passed",
                              0.0)
        return self.runtime.exec(command, min(timeout_s, left), env=env)

    def read_file(self, path: str) -> str:
        return self.runtime.read_file(path)

    def write_file(self, path: str, text: str) -> None:
        self.runtime.write_file(path, text)

    def list(self, path: str) -> builtins.list[str]:
        return self.runtime.list(path)

    def upload(self, src: Path, dest: str) -> None:
        self.runtime.upload(src, dest)

    def end_agent(self, carry: Sequence[str] | None) -> str:
        return self.runtime.end_agent(carry)

    @property
    def can_snapshot(self) -> bool:
        return self.runtime.can_snapshot

    def snapshot(self, path: Path) -> None:
        self.runtime.snapshot(path)


HarnessFunction = Callable[[EpisodeContext], "HarnessResult | None"]


@dataclass(frozen=True)
class FunctionHarness:
    """A user's function as a harness (`[agent] harness = "module:attr"`): called with
    the episode's context, its tools acting through `ctx.runtime` (bounded by the time
    left). Returning None means complete; past the time limit the episode is a timeout
    whatever it returned; an exception is aborted, with the traceback's tail as error."""

    fn: HarnessFunction

    def run(self, ctx: EpisodeContext) -> HarnessResult:
        bounded = replace(
            ctx, runtime=DeadlineRuntime(ctx.runtime, ctx.started + ctx.time_limit_s))
        try:
            got: object = self.fn(bounded)  # a user's function: its return is checked
        except Exception as e:
            return HarnessResult("timeout" if ctx.remaining() <= 0 else "aborted",
                                 error=_describe(e))
        if got is None:
            got = HarnessResult("complete")
        if not isinstance(got, HarnessResult):
            return HarnessResult("aborted", error=f"the harness returned {type(got).__name__}, "
                                 "expected a HarnessResult or None")
        out = got
        if ctx.remaining() <= 0 and out.status != "infra_error":
            return HarnessResult("timeout", error="past the episode's time limit",
                                 sessions=out.sessions, finished=out.finished, log=out.log)
        return out
