"""mini-swe-agent on the host, its commands in tidal's sandbox: a resumable harness.

Why: tidal preempts live sessions (snapshot, later fast-forward). A resumed session runs
its harness again from the start; the gateway answers the model calls already recorded
(same prompt ids -> the recorded answer) and a restored `tidal.sandbox.Sandbox` answers
the commands already logged (`Sandbox.snapshot` / `Sandbox.restore`). That works for any
harness that is deterministic given the same answers and outputs and whose commands go
through `ctx.runtime`. mini-swe-agent run as a command *inside* the sandbox
(`[agent] harness = "command"`) is not one: its process memory is lost at preemption (no
CRIU here) and nothing of it can be fast-forwarded. Run here, on the host, it is:

    [agent]
    harness = "tidal.agent.minisweagent:run"

What:
- `TidalEnvironment`: mini-swe-agent 2.4.6's `Environment` protocol (`execute`,
  `get_template_vars`, `serialize`; the dicts of its `LocalEnvironment`) over a
  `ToolRuntime`. Deterministic: the same action sends the same command string, env and
  working directory to the runtime (no timestamps, no random ids), so a restored sandbox
  answers it from its log. Output is stdout and stderr merged, in order, as mini's own
  environments report it (the command runs after `exec 2>&1`); a working directory other
  than the runtime's is `cd DIR || exit 1` before the command. The template variables
  describing the system (`system`, `release`, `version`, `machine`, `node`) are the
  sandbox's (one `uname` command, logged like any other), not the host's, so a session
  resumed on another machine renders the same prompt.
- `TidalModel`: mini's `Model` protocol over the stock `openai` client (no litellm):
  one chat-completions call per step to the session URL with mini's `bash` tool,
  `max_retries=0` (a retry would be a new recorded call), each request bounded by the
  episode's time left; tool calls parsed by mini's own `parse_toolcall_actions`.
- `MiniSweAgent` / `run`: mini's `DefaultAgent` on those two, configured from mini's
  `mini.yaml` (its prompts, observation and format-error templates, environment
  variables) with `agent.step_limit` 30, run on the task's prompt. Ends: mini's
  `Submitted` (`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`) -> complete (finished);
  its step limit or three replies in a row without a valid tool call -> truncated; the
  episode's time limit -> timeout; a 4xx from the gateway -> aborted; a connection
  error, a 5xx, a broken sandbox or a replay divergence -> infra_error.

mini-swe-agent is imported lazily: importing this module needs only tidal. Installing it
into tidal's venv without litellm: jinja2, python-dotenv, platformdirs and pyyaml (the
`mini` extra), then `pip install --no-deps mini-swe-agent==2.4.6` (what `make setup` does).

Deliberately simplified: the model's cost is 0 (the gateway has no prices), so mini's
cost limit never ends a session; multimodal content is off; one session (mini has no
subagents).
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import openai
from pydantic import BaseModel

from tidal.agent.endpoint import API_KEY_PLACEHOLDER, request_headers
from tidal.agent.episode import DeadlineRuntime, EpisodeContext, HarnessResult, SessionStatus
from tidal.agent.runtime import RuntimeToolError, ToolRuntime
from tidal.sandbox.types import ReplayDivergenceError, SandboxError

MINI_VERSION = "2.4.6"
INSTALL_HINT = (
    "mini-swe-agent is not installed in this Python: `pip install jinja2 python-dotenv "
    f"platformdirs pyyaml && pip install --no-deps mini-swe-agent=={MINI_VERSION}` "
    "(tidal's `make setup` does it; a plain `pip install mini-swe-agent` works too but "
    "pulls litellm)"
)
DEFAULT_STEP_LIMIT = 30
SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
# mini's LitellmModelConfig defaults (not importable without litellm)
DEFAULT_OBSERVATION_TEMPLATE = (
    "{% if output.exception_info %}<exception>{{output.exception_info}}</exception>\n{% endif %}"
    "<returncode>{{output.returncode}}</returncode>\n<output>\n{{output.output}}</output>"
)
DEFAULT_FORMAT_ERROR_TEMPLATE = "{{ error }}"
# what the sandbox is, for mini's {{system}} {{release}} {{version}} {{machine}}
_UNAME = "uname -s; uname -n; uname -r; uname -v; uname -m"
_UNAME_KEYS = ("system", "node", "release", "version", "machine")


def _mini() -> None:
    """Import mini-swe-agent (quietly) or raise an ImportError that says what to install."""
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    try:
        import minisweagent
        import minisweagent.agents.default
        import minisweagent.exceptions
        import minisweagent.models.utils.actions_toolcall
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({type(e).__name__}: {e})") from e
    if minisweagent.__version__ != MINI_VERSION:
        import warnings

        warnings.warn(f"tidal.agent.minisweagent is written against mini-swe-agent "
                      f"{MINI_VERSION}, this is {minisweagent.__version__}", stacklevel=3)


def _exit(status: str) -> dict[str, Any]:
    return {"role": "exit", "content": status, "extra": {"exit_status": status, "submission": ""}}


# --------------------------------------------------------------------------- environment


class TidalEnvironmentConfig(BaseModel):
    """As mini's `LocalEnvironmentConfig`: `cwd` ("" is the runtime's working directory),
    `env` added to each command's environment, `timeout` per command (seconds)."""

    cwd: str = ""
    env: dict[str, str] = {}
    timeout: int = 30


class TidalEnvironment:
    """mini-swe-agent's `Environment` on a tidal `ToolRuntime` (in `tidal run`, the
    episode's sandbox). `execute` returns mini's dict: `output` (stdout and stderr
    merged), `returncode`, `exception_info` (and `extra` on a timeout or a refused
    command); it raises mini's `Submitted` when the output's first line is
    COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT and the command succeeded. A failing runtime
    (the sandbox broke, a restored sandbox asked for something its log does not hold)
    raises: that is tidal's failure, not something to show the model."""

    def __init__(self, runtime: ToolRuntime, *, config_class: type = TidalEnvironmentConfig,
                 **kwargs: Any) -> None:
        self.runtime = runtime
        self.config = config_class(**kwargs)
        self._system: dict[str, str] | None = None

    def command_for(self, command: str, cwd: str = "") -> str:
        """The exact string the runtime runs for `command` (a pure function of its
        arguments and the config: what makes a restored sandbox answer it from its log)."""
        lines = ["exec 2>&1"]
        where = cwd or self.config.cwd
        if where:
            lines.append(f"cd {shlex.quote(where)} || exit 1")
        return "\n".join([*lines, command])

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None
                ) -> dict[str, Any]:
        command = action.get("command", "")
        limit = timeout or self.config.timeout
        try:
            r = self.runtime.exec(self.command_for(command, cwd), float(limit),
                                  env=self.config.env or None)
        except SandboxError:
            raise
        except (RuntimeToolError, ValueError, TypeError) as e:  # a refused command (NUL, ...)
            output: dict[str, Any] = {
                "output": "", "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {e}",
                "extra": {"exception_type": type(e).__name__, "exception": str(e)},
            }
        else:
            text = r.stdout + r.stderr  # stderr: only what the runtime itself adds
            if r.timed_out:
                why = f"Command '{command}' timed out after {limit} seconds"
                output = {
                    "output": text, "returncode": -1,
                    "exception_info": f"An error occurred while executing the command: {why}",
                    "extra": {"exception_type": "TimeoutExpired", "exception": why},
                }
            else:
                output = {"output": text, "returncode": r.exit_code, "exception_info": ""}
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict[str, Any]) -> None:
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            _mini()
            from minisweagent.exceptions import Submitted

            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def system_info(self) -> dict[str, str]:
        """The sandbox's uname (asked once, by a command the log replays)."""
        if self._system is None:
            try:
                r = self.runtime.exec(_UNAME, float(self.config.timeout),
                                      env=self.config.env or None)
                values = r.stdout.splitlines() if r.exit_code == 0 else []
            except SandboxError:
                raise
            except (RuntimeToolError, ValueError):
                values = []
            if len(values) != len(_UNAME_KEYS):
                values = [""] * len(_UNAME_KEYS)
            self._system = dict(zip(_UNAME_KEYS, values, strict=True))
        return self._system

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {**self.config.model_dump(), **self.system_info(), **kwargs}

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {
            "environment": self.config.model_dump(mode="json"),
            "environment_type": f"{type(self).__module__}.{type(self).__name__}",
        }}}


# --------------------------------------------------------------------------- model


class TidalModelConfig(BaseModel):
    """`model_name` the gateway's model; `model_kwargs` extra arguments of
    `chat.completions.create` (max_tokens, temperature, extra_body, ...); the templates
    are mini's (`observation_template`, `format_error_template`); `request_timeout_s`
    bounds each request (the episode's time left bounds it too)."""

    model_name: str
    model_kwargs: dict[str, Any] = {}
    observation_template: str = DEFAULT_OBSERVATION_TEMPLATE
    format_error_template: str = DEFAULT_FORMAT_ERROR_TEMPLATE
    request_timeout_s: float = 600.0


class TidalModel:
    """mini-swe-agent's `Model` over an OpenAI-compatible session URL (the gateway).
    `deadline` (time.monotonic()) ends the session with mini's TimeExceeded before a
    request that would start past it. `client` overrides the stock client."""

    def __init__(self, base_url: str, *, deadline: float | None = None,
                 task_id: str | None = None, client: openai.OpenAI | None = None,
                 api_key: str = API_KEY_PLACEHOLDER,
                 config_class: type = TidalModelConfig, **kwargs: Any) -> None:
        _mini()
        self.config = config_class(**kwargs)
        self.deadline = deadline
        self.client = client or openai.OpenAI(
            base_url=base_url, api_key=api_key, max_retries=0,
            timeout=self.config.request_timeout_s,
            default_headers=request_headers("main", task_id))

    def query(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        from minisweagent.exceptions import FormatError, TimeExceeded
        from minisweagent.models.utils.actions_toolcall import BASH_TOOL, parse_toolcall_actions

        timeout = self.config.request_timeout_s
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeExceeded(_exit("TimeExceeded"))
            timeout = min(timeout, left)
        prepared = [{k: v for k, v in m.items() if k != "extra"} for m in messages]
        response = self.client.chat.completions.create(
            model=self.config.model_name, messages=prepared,  # type: ignore[arg-type]
            tools=[BASH_TOOL], timeout=timeout,  # type: ignore[list-item]
            **(self.config.model_kwargs | kwargs))
        choice = response.choices[0]
        try:
            actions = parse_toolcall_actions(
                list(choice.message.tool_calls or []),
                format_error_template=self.config.format_error_template,
                template_kwargs={"finish_reason": choice.finish_reason})
        except FormatError as e:
            e.messages[0]["extra"].update(cost=0.0, response=response.model_dump(mode="json"))
            raise
        message: dict[str, Any] = choice.message.model_dump(mode="json", exclude_none=True)
        message.setdefault("content", None)
        message["extra"] = {"actions": actions, "response": response.model_dump(mode="json"),
                            "cost": 0.0}
        return message

    def format_message(self, **kwargs: Any) -> dict[str, Any]:
        return dict(kwargs)

    def format_observation_messages(self, message: dict[str, Any], outputs: list[dict[str, Any]],
                                    template_vars: dict[str, Any] | None = None
                                    ) -> list[dict[str, Any]]:
        from minisweagent.models.utils.actions_toolcall import format_toolcall_observation_messages

        return format_toolcall_observation_messages(
            actions=message.get("extra", {}).get("actions", []), outputs=outputs,
            observation_template=self.config.observation_template,
            template_vars=template_vars, multimodal_regex="")

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {**self.config.model_dump(), **kwargs}

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {
            "model": self.config.model_dump(mode="json"),
            "model_type": f"{type(self).__module__}.{type(self).__name__}",
        }}}


# --------------------------------------------------------------------------- harness


_STATUS: Mapping[str, SessionStatus] = {
    "Submitted": "complete", "LimitsExceeded": "truncated", "RepeatedFormatError": "truncated",
    "TimeExceeded": "timeout",
}


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(
            out.get(k), Mapping) else v
    return out


@dataclass(frozen=True)
class MiniSweAgent:
    """mini-swe-agent's DefaultAgent as a tidal harness function (`fn(ctx)`).

    `base_config`: a mini config by name or path (its built-in `mini.yaml` by default;
    None for none), of which the `agent` section, the environment's `cwd` / `env` /
    `timeout` and the model's templates are used (litellm's `model_kwargs` are not);
    `config`: overrides in the same layout (`{"agent": {"step_limit": 10}, "model":
    {"model_kwargs": {"max_tokens": 512}}}`). For another configuration in `tidal run`,
    name an instance: `harness = "mypkg.agents:mini"` with `mini = MiniSweAgent(config=...)`.
    """

    config: Mapping[str, Any] = field(default_factory=dict)
    base_config: str | None = "mini.yaml"

    def resolved_config(self) -> dict[str, dict[str, Any]]:
        """The agent, environment and model sections this harness builds mini from."""
        _mini()
        from minisweagent.config import get_config_from_spec

        base: dict[str, Any] = (get_config_from_spec(self.base_config)
                                if self.base_config else {})
        agent = {k: v for k, v in base.get("agent", {}).items() if k != "agent_class"}
        if not agent.get("step_limit"):  # mini.yaml's 0 is no limit: bounded by time only
            agent["step_limit"] = DEFAULT_STEP_LIMIT
        env = {k: v for k, v in base.get("environment", {}).items()
               if k in TidalEnvironmentConfig.model_fields}
        model = {k: v for k, v in base.get("model", {}).items()
                 if k in ("observation_template", "format_error_template")}
        return _merge({"agent": agent, "environment": env, "model": model},
                      {k: self.config.get(k, {}) for k in ("agent", "environment", "model")})

    def __call__(self, ctx: EpisodeContext) -> HarnessResult:
        cfg = self.resolved_config()
        from minisweagent.agents.default import DefaultAgent

        deadline = ctx.started + ctx.time_limit_s
        # commands end by the deadline even when called outside FunctionHarness (which
        # bounds them too); the timeout is not part of a logged command's identity
        env = TidalEnvironment(DeadlineRuntime(ctx.runtime, deadline), **cfg["environment"])
        model = TidalModel(ctx.session_url, deadline=deadline,
                           task_id=ctx.task.task_id, api_key=ctx.api_key,
                           **{"model_name": ctx.model, **cfg["model"]})
        agent = DefaultAgent(model, env, **cfg["agent"])
        try:
            info = agent.run(ctx.task.prompt)
        except openai.APIStatusError as e:
            status: SessionStatus = "aborted" if e.status_code < 500 else "infra_error"
            return HarnessResult(status, error=f"the gateway answered {e.status_code}: {e}",
                                 finished=False, log=_log(agent))
        except openai.APITimeoutError as e:
            status = "timeout" if ctx.remaining() <= 0 else "infra_error"
            return HarnessResult(status, error=f"model request timed out: {e}", finished=False,
                                 log=_log(agent))
        except openai.APIConnectionError as e:
            return HarnessResult("infra_error", error=f"cannot reach the gateway: {e}",
                                 finished=False, log=_log(agent))
        except ReplayDivergenceError as e:
            return HarnessResult("infra_error", error=f"replay diverged: {e}", finished=False,
                                 log=_log(agent))
        except (SandboxError, OSError) as e:
            return HarnessResult("infra_error", error=f"the runtime failed: "
                                 f"{type(e).__name__}: {e}", finished=False, log=_log(agent))
        exit_status = str(info.get("exit_status", ""))
        status = _STATUS.get(exit_status, "aborted")
        if status != "complete" and ctx.remaining() <= 0:
            status = "timeout"
        error = None if status == "complete" else f"mini-swe-agent ended: {exit_status}"
        return HarnessResult(status, error=error, finished=status == "complete",
                             log=_log(agent))


def _log(agent: Any) -> dict[str, str]:
    """A short account of the run (the ledger holds every call)."""
    last = agent.messages[-1] if agent.messages else {}
    extra = last.get("extra", {}) if isinstance(last, dict) else {}
    return {"mini": f"exit_status: {extra.get('exit_status', '')}\n"
                    f"model calls: {agent.n_calls}\n"
                    f"submission: {str(extra.get('submission', ''))[-2000:]}\n"}


def run(ctx: EpisodeContext) -> HarnessResult:
    """`[agent] harness = "tidal.agent.minisweagent:run"`: mini-swe-agent with mini's
    `mini.yaml` and a step limit of 30, its commands in the episode's runtime."""
    return MiniSweAgent()(ctx)
