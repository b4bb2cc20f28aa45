"""Sandboxes: a fresh isolated environment per episode that can be paused, snapshotted
and resumed elsewhere (see docs/sandbox.md).

    from tidal.sandbox import Sandbox, Limits
    with Sandbox(limits=Limits(memory_bytes=512 << 20)) as sb:
        print(sb.exec("python3 -c 'print(6*7)'").stdout)

A task's Dockerfile becomes a cached read-only layer with `build_environment`
(tidal.sandbox.build); episodes stack it under their own writable layer.
"""

from tidal.sandbox.build import (
    BuildError,
    Environment,
    build_environment,
    image_environment,
    resolve_base,
)
from tidal.sandbox.dockerfile import Dockerfile, DockerfileError, needs_network, parse_dockerfile
from tidal.sandbox.oplog import LogEntry
from tidal.sandbox.runtime import Box, Runtime
from tidal.sandbox.sandbox import Command, Sandbox, Snapshot, command_argv
from tidal.sandbox.types import (
    Bind,
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
    "Bind",
    "Box",
    "BuildError",
    "Command",
    "Dockerfile",
    "DockerfileError",
    "Environment",
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
    "build_environment",
    "command_argv",
    "image_environment",
    "needs_network",
    "parse_dockerfile",
    "resolve_base",
]
