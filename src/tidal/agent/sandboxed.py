"""The harness's `ToolRuntime` on a real sandbox: each episode gets a fresh bubblewrap
sandbox (read-only image and environment layers, a private writable layer, no network),
adapted to the calls the harness and the graders make. Sandbox path errors become the
harness's tool errors, so an agent that tries `../../etc/shadow` gets an error message,
never the host file."""

from __future__ import annotations

import builtins
import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path, PurePosixPath

from tidal.agent.runtime import RuntimeToolError, ToolRuntime
from tidal.sandbox import Sandbox, SandboxConfig
from tidal.sandbox.types import ExecResult, SandboxPathError


class SandboxRuntime:
    """Adapts `tidal.sandbox.Sandbox` to `tidal.agent.runtime.ToolRuntime`. `sandbox` is
    the sandbox itself, for what only a sandbox does (a command harness's long exec with
    its own limits, snapshots)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self.can_snapshot = True  # until the agent has ended: the verifier's box is not its

    def exec(
        self, command: str, timeout_s: float, *, env: Mapping[str, str] | None = None
    ) -> ExecResult:
        r = self.sandbox.exec(command, timeout=timeout_s, env=env)
        # what the agent sees: 124 for a timeout (as `timeout(1)` says it), the reason a
        # limit ended the command after its stderr
        return replace(r, exit_code=124 if r.timed_out else r.exit_code,
                       stderr=r.stderr + (f"\n[{r.detail}]" if r.detail else ""))

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

    def snapshot(self, path: Path) -> None:
        if not self.can_snapshot:
            raise RuntimeToolError("the agent has ended: its sandbox is gone, and the "
                                   "verifier's is not to be resumed")
        self.sandbox.snapshot(path)

    def end_agent(self, carry: Sequence[str] | None) -> str:
        if carry is None:
            self.sandbox.kill_processes()
            return "shared"
        paths = tuple(carry) or (self.sandbox.config.workdir,)
        self.can_snapshot = False
        self.sandbox = self.sandbox.fresh(paths)
        return "pristine, carrying " + ", ".join(paths)

    def close(self) -> None:
        self.sandbox.close()

    def upload(self, src: Path, dest: str) -> None:
        """Copy a host file or directory tree into the sandbox through its file API
        (modes kept; symlinks are followed only when they stay inside `src`)."""
        src = Path(src)
        if src.is_file():
            self.sandbox.write_file(dest, src.read_bytes(), mode=src.stat().st_mode & 0o7777)
            return
        if not src.is_dir():
            raise FileNotFoundError(f"cannot upload {src}: no such file or directory")
        root = src.resolve()
        empty: builtins.list[str] = []
        for dirpath, dirnames, filenames in os.walk(src, followlinks=False):
            rel = Path(dirpath).relative_to(src)
            if not dirnames and not filenames:
                empty.append(str(PurePosixPath(dest) / rel.as_posix()))
            for name in sorted(filenames):
                host = Path(dirpath) / name
                real = host.resolve()
                if not real.is_relative_to(root) or not real.is_file():
                    continue  # a link leading out of the tree, or to no file
                target = str(PurePosixPath(dest) / (rel / name).as_posix())
                self.sandbox.write_file(target, real.read_bytes(),
                                        mode=real.stat().st_mode & 0o7777)
        if empty:
            self.sandbox.exec(["mkdir", "-p", *empty], timeout=30)


@contextlib.contextmanager
def sandboxed_runtime(config: SandboxConfig | None = None) -> Iterator[ToolRuntime]:
    """A fresh sandbox made from `config` (the default image when None)."""
    with Sandbox(config or SandboxConfig()) as sb:
        rt = SandboxRuntime(sb)
        try:
            yield rt
        finally:
            rt.close()  # the verifier's sandbox, when the agent's was replaced
