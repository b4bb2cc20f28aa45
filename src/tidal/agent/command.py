"""Any agent as a black box: a command run inside the episode's sandbox.

`[agent] harness = "command"` runs `[agent] command` with /bin/sh in the task's working
directory, inside the same sandbox the task's tools and grader use. The program learns
everything from its environment, the way OpenAI-compatible clients expect it:

    OPENAI_BASE_URL, OPENAI_API_BASE   the session's gateway URL (.../sessions/{id}/task/{task}/v1)
    OPENAI_API_KEY                     the episode's secret: the gateway takes it for this
                                       episode's sessions only (tidal.gateway.access)
    ANTHROPIC_BASE_URL                 the same session for Anthropic clients (no /v1: the
                                       SDK adds /v1/messages); ANTHROPIC_API_KEY the same key
    TIDAL_GATEWAY_URL                  the gateway's root, for other URL forms (subagents)
    TIDAL_MODEL, TIDAL_SESSION_ID, TIDAL_TASK_ID
    TIDAL_INSTRUCTION                  the task's instruction (omitted above 100 KB)
    TIDAL_INSTRUCTION_FILE             a file holding it (/logs/agent/instruction.md)

plus the task's environment variables and `[agent] env` (which cannot replace the two
keys). The gateway is all it can reach
on the network (the sandbox relays its port and nothing else). Its stdout and stderr go
to /logs/agent/stdout.txt and stderr.txt inside the sandbox (so a chatty harness is
never killed for its output), and their last `log_bytes` come back in the result.

How it ends (the caller turns any end before the first model call into infra_error):
- exit 0: complete;
- still running at the time limit: killed with everything it started, timeout (graded
  on what it left);
- any other exit, or killed by a limit (memory, processes, CPU): aborted, graded, with
  the exit code and the sandbox's reason as the error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tidal.agent.episode import EpisodeContext, HarnessResult

LOG_DIR = "/logs/agent"
INSTRUCTION_FILE = f"{LOG_DIR}/instruction.md"
MAX_ENV_INSTRUCTION = 100_000  # bytes; Linux caps one environment string at 128 KiB
# The command travels in a variable, so no quoting of the user's text is ever needed.
_RUN = (f'mkdir -p {LOG_DIR} && exec /bin/sh -c "$TIDAL_HARNESS_COMMAND" '
        f">{LOG_DIR}/stdout.txt 2>{LOG_DIR}/stderr.txt </dev/null")


def harness_env(ctx: EpisodeContext) -> dict[str, str]:
    """The variables a command harness (or any program the user runs) is given."""
    url = ctx.session_url
    env = {
        "OPENAI_BASE_URL": url, "OPENAI_API_BASE": url,
        "ANTHROPIC_BASE_URL": url.removesuffix("/v1"),
        "TIDAL_GATEWAY_URL": ctx.gateway_url.rstrip("/"), "TIDAL_MODEL": ctx.model,
        "TIDAL_SESSION_ID": ctx.session_id, "TIDAL_TASK_ID": ctx.task.task_id,
        "TIDAL_INSTRUCTION_FILE": INSTRUCTION_FILE,
    }
    if len(ctx.task.prompt.encode()) <= MAX_ENV_INSTRUCTION:
        env["TIDAL_INSTRUCTION"] = ctx.task.prompt
    return env


def key_env(ctx: EpisodeContext) -> dict[str, str]:
    """The episode's API key, under the names the openai and anthropic SDKs read."""
    return {"OPENAI_API_KEY": ctx.api_key, "ANTHROPIC_API_KEY": ctx.api_key}


@dataclass(frozen=True)
class CommandHarness:
    """`command` run by /bin/sh in the sandbox; `env` added to its variables (after
    tidal's, so a user may override them); `log_bytes` of each stream kept."""

    command: str
    env: Mapping[str, str] = field(default_factory=dict)
    log_bytes: int = 65536

    def __post_init__(self) -> None:
        if not self.command.strip():
            raise ValueError("[agent] command is empty: name the program to run")

    def run(self, ctx: EpisodeContext) -> HarnessResult:
        rt = ctx.runtime
        rt.write_file(INSTRUCTION_FILE, ctx.task.prompt)
        env = {**harness_env(ctx), **self.env, **key_env(ctx),
               "TIDAL_HARNESS_COMMAND": self.command}
        left = ctx.remaining()
        if left <= 0:
            return HarnessResult("timeout", error="no time left to start the harness")
        r = rt.exec(_RUN, left, env=env)
        log = {s: rt.exec(f"tail -c {self.log_bytes} {LOG_DIR}/{s}.txt 2>/dev/null", 30).stdout
               for s in ("stdout", "stderr")}
        if r.timed_out:
            return HarnessResult(
                "timeout", error=f"killed at the time limit ({ctx.time_limit_s:g} s)", log=log)
        if r.exit_code == 0:
            return HarnessResult("complete", log=log)
        why = r.stderr.strip().splitlines()[-1:] if r.stderr.strip() else []
        detail = f": {why[0]}" if why else ""
        return HarnessResult("aborted", error=f"the harness exited with code {r.exit_code}{detail}",
                             log=log)
