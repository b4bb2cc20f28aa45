"""Sandboxes: a fresh isolated environment per episode that can be paused, snapshotted
and resumed elsewhere (see docs/sandbox.md).

    from tidal.sandbox import Sandbox, Limits
    with Sandbox(limits=Limits(memory_bytes=512 << 20)) as sb:
        print(sb.exec("python3 -c 'print(6*7)'").stdout)
"""

from tidal.sandbox.runtime import Box, Runtime
from tidal.sandbox.sandbox import Command, LogEntry, Sandbox, Snapshot, command_argv
from tidal.sandbox.types import (
    ExecResult,
    ExecStatus,
    FileEntry,
    ImageError,
    Limits,
    MemorySnapshotUnavailableError,
    MemorySnapshotWarning,
    ReplayDivergenceError,
    SandboxConfig,
    SandboxError,
    SandboxPathError,
    SandboxStateError,
    SandboxUnavailableError,
)

__all__ = [
    "Box",
    "Command",
    "ExecResult",
    "ExecStatus",
    "FileEntry",
    "ImageError",
    "Limits",
    "LogEntry",
    "MemorySnapshotUnavailableError",
    "MemorySnapshotWarning",
    "ReplayDivergenceError",
    "Runtime",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "SandboxPathError",
    "SandboxStateError",
    "SandboxUnavailableError",
    "Snapshot",
    "command_argv",
]
