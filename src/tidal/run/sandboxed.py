"""The harness's `ToolRuntime` on a real sandbox: each episode gets a fresh bubblewrap
sandbox (read-only default image, private writable layer, no network), adapted to the
four calls the harness makes. Sandbox path errors become the harness's tool errors, so
an agent that tries `../../etc/shadow` gets an error message, never the host file."""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Iterator

from tidal.agent.runtime import ExecResult, RuntimeToolError, ToolRuntime
from tidal.sandbox import Sandbox, SandboxConfig
from tidal.sandbox.types import ExecStatus, SandboxPathError


class SandboxRuntime:
    """Adapts `tidal.sandbox.Sandbox` to `tidal.agent.runtime.ToolRuntime`."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    def exec(self, command: str, timeout_s: float) -> ExecResult:
        r = self.sandbox.exec(command, timeout=timeout_s)
        return ExecResult(
            exit_code=124 if r.status is ExecStatus.TIMEOUT else r.exit_code,
            stdout=r.stdout, stderr=r.stderr + (f"\n[{r.detail}]" if r.detail else ""),
            timed_out=r.status is ExecStatus.TIMEOUT, truncated=r.truncated,
        )

    def read_file(self, path: str) -> str:
        try:
            return self.sandbox.read_text(path)
        except SandboxPathError as e:
            raise RuntimeToolError(str(e)) from e
        except IsADirectoryError as e:
            raise RuntimeToolError(f"{path} is a directory") from e

    def write_file(self, path: str, text: str) -> None:
        try:
            self.sandbox.write_file(path, text)
        except SandboxPathError as e:
            raise RuntimeToolError(str(e)) from e

    def list(self, path: str) -> builtins.list[str]:
        try:
            entries = self.sandbox.list(path)
        except SandboxPathError as e:
            raise RuntimeToolError(str(e)) from e
        return sorted(e.name + ("/" if e.kind == "dir" else "") for e in entries)


@contextlib.contextmanager
def sandboxed_runtime(config: SandboxConfig | None = None) -> Iterator[ToolRuntime]:
    with Sandbox(config or SandboxConfig()) as sb:
        yield SandboxRuntime(sb)
