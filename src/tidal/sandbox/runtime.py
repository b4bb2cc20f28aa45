"""The runtime interface: what a sandbox backend implements.

`Sandbox` (sandbox.py) owns everything that does not depend on how isolation is done:
argument checking, the command log, snapshots as files, replay after restore, the
paused/closed state machine. A backend only has to provide a `Runtime` that makes
`Box`es. The embedded one is `tidal.sandbox.local.LocalRuntime` (bubblewrap +
overlayfs + cgroup v1). A Docker, Kubernetes or microVM backend implements the same
two protocols; docs/sandbox.md maps each method onto those systems.

Contract, per method (all paths are sandbox paths, already normalized to absolute):

- `Runtime.create(config, layers)`: a started box on a fresh writable layer over the
  config's image; `layers`, if given, is an open snapshot file (layer.py) whose layers
  become the writable layer first.
- `Box.exec(argv, cwd, env, stdin, wall_s)`: run argv to completion under the config's
  limits and return an `ExecResult`; a hit limit ends the command with its status, never
  a hang and never an exception. Background processes a command starts may outlive it.
- `Box.read_file / write_file / list`: file access that cannot leave the sandbox.
- `Box.pause / resume`: freeze and thaw every process in place.
- `Box.export_layers(out)`: add the writable layer(s) to a snapshot file being written,
  as overlayfs upper directories (`out.add_layer(key, upper_dir)`): the box is quiescent
  (paused, and no operation running). A backend without overlayfs produces the same
  entries (whiteouts for deletions).
  With `only` (sandbox paths), just those subtrees and the directories above them
  (`ArchiveWriter.add_layer`): what a fresh box for the verifier carries over.
- `Box.kill_processes()`: kill every process in the box but the runtime's own init,
  so that none survives (a fork bomb included); the box stays usable.
- `Box.close()`: kill everything, release every resource; idempotent.
- `Box.capabilities`: what the backend can and cannot do here (for diagnostics and
  snapshots), e.g. {"limits": "cgroup-v1"}.
- `Box.shell`, `Box.incidents`: see their docstrings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from tidal.sandbox.layer import ArchiveReader, ArchiveWriter
from tidal.sandbox.types import ExecResult, FileEntry, SandboxConfig


@runtime_checkable
class Box(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def config(self) -> SandboxConfig: ...

    @property
    def capabilities(self) -> Mapping[str, str]: ...

    @property
    def shell(self) -> str | None:
        """The shell that runs str commands (/bin/bash, else /bin/sh), None if neither."""

    @property
    def incidents(self) -> list[str]:
        """What the runtime did on its own (e.g. killed a fork bomb left running)."""

    def exec(self, argv: Sequence[str], *, cwd: str, env: Mapping[str, str],
             stdin: bytes | None, wall_s: float) -> ExecResult: ...

    def read_file(self, path: str) -> bytes: ...

    def write_file(self, path: str, data: bytes, *, mode: int | None, mkdirs: bool) -> int: ...

    def list(self, path: str) -> list[FileEntry]: ...

    def is_dir(self, path: str) -> bool: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def export_layers(self, out: ArchiveWriter, only: Sequence[str] | None = None) -> int: ...

    def kill_processes(self) -> int: ...

    def close(self) -> None: ...


@runtime_checkable
class Runtime(Protocol):
    name: str

    def create(self, config: SandboxConfig, layers: ArchiveReader | None = None) -> Box: ...

    def image_id(self, config: SandboxConfig) -> str: ...
