"""What the harness and the graders need from an environment, and a local stand-in.

`ToolRuntime` is the seam between `tidal.agent` and whatever runs the agent's commands:
the bubblewrap sandbox (`tidal.sandbox`, adapted by the RL loop) in production, or
`LocalDirRuntime` in tests and trusted demos.

Deliberately simplified:
- `LocalDirRuntime` is NOT isolated. Commands run as the current user with
  `subprocess`, cwd set to the runtime's root directory; nothing stops a command from
  touching other files or the network. It exists so the harness and graders can be
  tested against real processes and real files; never give it untrusted model output
  outside tests.
- Paths are always interpreted relative to the runtime's root: an absolute path `/a/b`
  means `<root>/a/b`, and a path that resolves outside the root is refused.
- Output is captured whole and then capped (`output_cap` characters per stream), which
  is fine for the small commands agents run in tasks, not for gigabyte streams.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from tidal.sandbox.types import ExecResult, ExecStatus


class RuntimeToolError(ValueError):
    """A runtime request was refused (bad path, bad timeout, not a file, ...)."""


@runtime_checkable
class ToolRuntime(Protocol):
    """An environment the agent acts in: a shell and a file system.

    Contract: `exec` runs `command` with the runtime's shell in its working directory,
    with `env` added to the runtime's own variables, and returns the one result type of
    every runtime (`tidal.sandbox.ExecResult`; exit code 124 when it timed out); `read_file` raises
    `FileNotFoundError` when the file does not exist (the graders rely on that to fail a
    check instead of erroring); `list` returns the entry names of a directory, sorted,
    directories suffixed with "/"; `upload` copies a host file or directory tree (its
    contents, executable bits kept) to `dest` in the runtime (how a test.sh grader puts
    tests/ at /tests); `snapshot` saves the runtime's files and command log to `path` as
    a `tidal.sandbox` snapshot, which a restored sandbox continues from (a preempted
    episode's), and is called only when `can_snapshot` is True; `end_agent` is called
    once the agent is done, before the grader (see its docstring).
    """

    @property
    def can_snapshot(self) -> bool: ...

    def snapshot(self, path: Path) -> None: ...

    def exec(
        self, command: str, timeout_s: float, *, env: Mapping[str, str] | None = None
    ) -> ExecResult: ...

    def read_file(self, path: str) -> str: ...

    def write_file(self, path: str, text: str) -> None: ...

    def list(self, path: str) -> builtins.list[str]: ...

    def upload(self, src: Path, dest: str) -> None: ...

    def end_agent(self, carry: Sequence[str] | None) -> str:
        """The agent is done: kill every process it left running. With `carry` (paths;
        () for the working directory), the runtime goes on in a fresh environment from
        the task's pristine image that holds only those paths as the agent left them, so
        that nothing it did elsewhere (PATH, binaries, system files) reaches the
        verifier; None keeps the agent's environment (shared). Returns what the
        verifier runs in, for the verdict."""
        ...


def _cap(text: str, cap: int) -> tuple[str, bool]:
    if len(text) <= cap:
        return text, False
    return text[:cap] + f"\n[... {len(text) - cap} more characters cut]", True


class LocalDirRuntime:
    """A `ToolRuntime` over a plain local directory. NOT isolated: tests and demos only."""

    def __init__(self, root: Path, *, output_cap: int = 8000) -> None:
        root = Path(root)
        if not root.is_dir():
            raise RuntimeToolError(f"runtime root {root} is not a directory")
        if output_cap < 1:
            raise RuntimeToolError(f"output_cap must be >= 1, got {output_cap}")
        self.root = root.resolve()
        self.output_cap = output_cap
        self._groups: set[int] = set()  # the process group of every command started

    can_snapshot = False  # a plain directory: an episode resumes in a fresh one

    def snapshot(self, path: Path) -> None:
        raise RuntimeToolError("a local directory runtime takes no snapshots")

    def resolve(self, path: str) -> Path:
        """Map an agent-visible path to a host path under the root, refusing escapes."""
        if not isinstance(path, str) or not path.strip():
            raise RuntimeToolError(f"path must be a non-empty string, got {path!r}")
        if "\x00" in path:
            raise RuntimeToolError("path must not contain NUL bytes")
        host = (self.root / path.lstrip("/")).resolve()
        if host != self.root and self.root not in host.parents:
            raise RuntimeToolError(f"path {path!r} leaves the runtime's root directory")
        return host

    def exec(
        self, command: str, timeout_s: float, *, env: Mapping[str, str] | None = None
    ) -> ExecResult:
        if not isinstance(command, str) or not command.strip():
            raise RuntimeToolError("command must be a non-empty string")
        if not timeout_s > 0:
            raise RuntimeToolError(f"timeout_s must be > 0, got {timeout_s}")
        proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=self.root,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # own process group, so a timeout kills its children
            env={**os.environ, "HOME": str(self.root), "PWD": str(self.root), **(env or {})},
        )
        self._groups.add(proc.pid)
        timed_out, t0 = False, time.perf_counter()
        try:
            out_b, err_b = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out_b, err_b = proc.communicate()
        stdout, cut_out = _cap(out_b.decode("utf-8", "replace"), self.output_cap)
        stderr, cut_err = _cap(err_b.decode("utf-8", "replace"), self.output_cap)
        code = 124 if timed_out else proc.returncode
        status = (ExecStatus.TIMEOUT if timed_out
                  else ExecStatus.OK if code == 0 else ExecStatus.NONZERO_EXIT)
        return ExecResult(status, code, stdout, stderr, time.perf_counter() - t0,
                          truncated=cut_out or cut_err)

    def read_file(self, path: str) -> str:
        host = self.resolve(path)
        if host.is_dir():
            raise RuntimeToolError(f"{path!r} is a directory, not a file")
        if not host.exists():
            raise FileNotFoundError(f"no such file: {path}")
        return host.read_text(encoding="utf-8", errors="replace")

    def write_file(self, path: str, text: str) -> None:
        if not isinstance(text, str):
            raise RuntimeToolError(f"file content must be a string, got {type(text).__name__}")
        host = self.resolve(path)
        if host == self.root or host.is_dir():
            raise RuntimeToolError(f"{path!r} is a directory, not a file")
        host.parent.mkdir(parents=True, exist_ok=True)
        host.write_text(text, encoding="utf-8")

    def list(self, path: str) -> builtins.list[str]:
        host = self.resolve(path)
        if not host.exists():
            raise FileNotFoundError(f"no such directory: {path}")
        if not host.is_dir():
            raise RuntimeToolError(f"{path!r} is a file, not a directory")
        return sorted(p.name + ("/" if p.is_dir() else "") for p in host.iterdir())

    def upload(self, src: Path, dest: str) -> None:
        host = self.resolve(dest)
        src = Path(src)
        if src.is_dir():
            shutil.copytree(src, host, dirs_exist_ok=True, symlinks=True)
        elif src.is_file():
            host.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, host)
        else:
            raise FileNotFoundError(f"cannot upload {src}: no such file or directory")

    def end_agent(self, carry: Sequence[str] | None) -> str:
        """Kills the process group of every command it ran (what left it with setsid
        survives: this runtime is not isolated). There is no pristine image to start
        from, so the verifier always shares the directory."""
        for pgid in self._groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        self._groups.clear()
        return "shared (a local directory: no pristine image)"
