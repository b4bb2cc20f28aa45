"""The sandbox's public data model: limits, configuration, exec results, errors.

Pure Python; the only I/O is checking that configured layer and bind paths exist.
Every runtime (the local bubblewrap one, a future Docker, Kubernetes or microVM one)
speaks these types, and the command log that snapshots carry is made of their
`to_dict()` forms.
"""

from __future__ import annotations

import enum
import math
import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

# --------------------------------------------------------------------------- errors


class SandboxError(Exception):
    """Base class of every sandbox error."""


class SandboxUnavailableError(SandboxError):
    """The runtime cannot run on this machine (not root, bubblewrap missing, ...)."""


class ImageError(SandboxError, ValueError):
    """The base image is missing or unusable."""


class SandboxPathError(SandboxError, ValueError):
    """A file-API path is malformed or would escape the sandbox."""


class SandboxStateError(SandboxError):
    """The operation does not fit the sandbox's state (closed, paused, busy)."""


class ReplayDivergenceError(SandboxError):
    """A restored sandbox was asked for an operation its command log does not hold."""


class MemorySnapshotUnavailableError(SandboxError):
    """Process memory cannot be snapshotted here (CRIU missing or failing)."""


class MemorySnapshotWarning(UserWarning):
    """A memory snapshot was asked for and fell back to layer + command log."""


# --------------------------------------------------------------------------- results


class ExecStatus(enum.StrEnum):
    """How a command ended. Every limit has its own status; none of them hangs."""

    OK = "ok"
    NONZERO_EXIT = "nonzero_exit"
    TIMEOUT = "timeout"  # wall-clock limit per command
    MEMORY = "memory"  # the sandbox's memory limit (the kernel OOM-killed a process)
    PIDS = "pids"  # the sandbox's process-count limit (a fork failed)
    CPU = "cpu"  # CPU-time limit per command
    OUTPUT_TRUNCATED = "output_truncated"  # stdout or stderr passed the output limit


LIMIT_STATUSES = frozenset(
    {ExecStatus.TIMEOUT, ExecStatus.MEMORY, ExecStatus.PIDS, ExecStatus.CPU,
     ExecStatus.OUTPUT_TRUNCATED}
)


def truncation_marker(limit_bytes: int) -> str:
    """The line appended to a stream cut at the output limit."""
    return f"\n[tidal sandbox: output truncated at {limit_bytes} bytes]\n"


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one command.

    `exit_code` follows shell conventions: 128 + N when a signal N ended the command
    (137 when a limit made tidal kill it). `truncated` says whether stdout or stderr was
    cut at the output limit (the cut stream ends with `truncation_marker`). `replayed`
    marks a result answered from a restored command log; it does not take part in
    equality, so a replayed result equals the original one.
    """

    status: ExecStatus
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float = field(compare=False)
    truncated: bool = False
    detail: str = ""
    replayed: bool = field(default=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.status is ExecStatus.OK

    @property
    def limit_hit(self) -> bool:
        return self.status in LIMIT_STATUSES

    @property
    def timed_out(self) -> bool:
        """The command ran past its wall-clock limit (and was killed)."""
        return self.status is ExecStatus.TIMEOUT

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status.value, "exit_code": self.exit_code,
            "stdout": self.stdout, "stderr": self.stderr,
            "duration_s": self.duration_s, "truncated": self.truncated,
            "detail": self.detail,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, replayed: bool = False) -> ExecResult:
        return cls(
            status=ExecStatus(d["status"]), exit_code=int(d["exit_code"]),
            stdout=str(d["stdout"]), stderr=str(d["stderr"]),
            duration_s=float(d["duration_s"]), truncated=bool(d["truncated"]),
            detail=str(d.get("detail", "")), replayed=replayed,
        )


FileKind = Literal["file", "dir", "symlink", "other"]


@dataclass(frozen=True)
class FileEntry:
    """One entry of `Sandbox.list`: the name, its kind (symlinks are not followed), its
    size in bytes and its permission bits."""

    name: str
    kind: FileKind
    size: int
    mode: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "size": self.size, "mode": self.mode}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FileEntry:
        return cls(name=d["name"], kind=d["kind"], size=int(d["size"]), mode=int(d["mode"]))


# --------------------------------------------------------------------------- config

MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """Resource limits. Memory, processes and disk hold for the whole sandbox; CPU
    time, wall-clock time and output size hold for each command."""

    memory_bytes: int = 1024 * MiB
    pids: int = 256
    cpu_s: float = 60.0
    wall_s: float = 120.0
    output_bytes: int = 256 * 1024  # per stream (stdout, stderr)
    disk_bytes: int = 1024 * MiB  # the writable layer
    file_bytes: int = 16 * MiB  # the largest file read_file returns

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise TypeError(f"Limits.{f.name} must be a number, got {v!r}")
            if not math.isfinite(v) or v <= 0:
                raise ValueError(f"Limits.{f.name} must be positive and finite, got {v!r}")
        if self.pids < 4:
            raise ValueError(f"Limits.pids must be at least 4, got {self.pids}")
        if self.memory_bytes < 8 * MiB:
            raise ValueError(f"Limits.memory_bytes must be at least 8 MiB, got {self.memory_bytes}")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Limits:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def default_env() -> dict[str, str]:
    """The environment every command starts from (nothing of the host's leaks in)."""
    return {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root",
        "USER": "root",
        "LOGNAME": "root",
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "PYTHONUNBUFFERED": "1",
    }


def check_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """A copy of `env`, or ValueError naming the first bad variable."""
    out = dict(env or {})
    for k, v in out.items():
        if not isinstance(k, str) or not isinstance(v, str) or not k or "=" in k or "\0" in k + v:
            raise ValueError(f"env: bad variable {k!r}={v!r}")
    return out


OVERLAY_BAD_CHARS = ",:\\"  # overlayfs's mount options cannot carry these in a path
NOT_BINDABLE = ("/proc", "/dev")


@dataclass(frozen=True)
class Bind:
    """A host directory or file made visible read-only at `target` inside the sandbox,
    for every command (a harness's code or virtualenv). `host` must exist; `target` is
    an absolute, normalized sandbox path, not `/`, not under /proc or /dev. Binds are
    seen by commands only: the file API (`read_file`, `list`) sees the empty mount point
    in the sandbox's own files."""

    host: str
    target: str

    def __post_init__(self) -> None:
        host, target = os.fspath(self.host), os.fspath(self.target)
        object.__setattr__(self, "host", host)
        object.__setattr__(self, "target", target)
        if not isinstance(host, str) or not host.startswith("/") or "\0" in host:
            raise ValueError(f"bind host path must be absolute, got {host!r}")
        if not Path(host).exists():
            raise ValueError(f"bind host path {host!r} does not exist")
        if not isinstance(target, str) or not target.startswith("/") or "\0" in target:
            raise ValueError(f"bind target must be an absolute sandbox path, got {target!r}")
        if posixpath.normpath(target) != target or target.startswith("//"):
            raise ValueError(f"bind target {target!r} is not normalized "
                             f"(write {posixpath.normpath(target)!r})")
        if target == "/":
            raise ValueError("bind target cannot be /: it would hide the whole image")
        for hidden in NOT_BINDABLE:
            if target == hidden or target.startswith(hidden + "/"):
                raise ValueError(f"bind target {target!r} is under {hidden}, which the sandbox "
                                 "mounts itself")

    @classmethod
    def parse(cls, entry: str) -> Bind:
        """A bind from "HOST:SANDBOX" (a trailing ":ro" is accepted: binds are read-only
        anyway), or ValueError naming the entry."""
        if not isinstance(entry, str):
            raise ValueError(f"mount {entry!r}: expected a string \"HOST:SANDBOX\"")
        parts = entry.split(":")
        if len(parts) == 3 and parts[2] == "ro":
            parts = parts[:2]
        elif len(parts) == 3 and parts[2] == "rw":
            raise ValueError(f"mount {entry!r}: binds are read-only; drop \":rw\"")
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"mount {entry!r}: expected \"HOST:SANDBOX\", two absolute paths "
                             "separated by one ':'")
        try:
            return cls(parts[0], parts[1])
        except ValueError as e:
            raise ValueError(f"mount {entry!r}: {e}") from None

    def to_dict(self) -> dict[str, str]:
        return {"host": self.host, "target": self.target}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Bind:
        return cls(host=d["host"], target=d["target"])


def check_layers(layers: Any) -> tuple[str, ...]:
    """`layers` as a tuple of absolute directory paths, or ValueError naming the bad one."""
    if isinstance(layers, str | os.PathLike):
        raise TypeError("layers must be a sequence of directories, not one path")
    out = tuple(os.fspath(x) for x in layers)
    for lay in out:
        if not isinstance(lay, str) or not lay.startswith("/"):
            raise ValueError(f"layer {lay!r} must be an absolute directory path")
        if any(c in lay for c in OVERLAY_BAD_CHARS):
            raise ValueError(f"layer {lay!r} contains ',', ':' or '\\', which overlayfs "
                             "cannot take in a path; move it")
        if not Path(lay).is_dir():
            raise ValueError(f"layer {lay!r} is not an existing directory")
    return out


@dataclass(frozen=True)
class SandboxConfig:
    """What a sandbox is made of.

    `image`: a directory used as the read-only base image, or None for the default
    image (a read-only view of the host's system directories with python3, and none of
    the host's private files). `allow_ports`: loopback TCP ports that commands inside
    may reach on the host's 127.0.0.1 (for a harness that must reach the gateway);
    nothing else of any network is reachable. `workdir`: the default working directory
    of commands and the base of relative file-API paths. `state_dir`: where the runtime
    keeps per-sandbox state (default `$TIDAL_SANDBOX_DIR` or /run/tidal-sandbox).
    `layers`: prebuilt read-only layer directories stacked over the image, uppermost
    first (what `tidal.sandbox.build` makes from a Dockerfile); each holds one
    subdirectory per mount of the image (`root`, `usr`), overlayfs-style (whiteouts and
    opaque directories hide what is below). `binds`: host paths bound read-only inside
    (see `Bind`).
    """

    image: str | None = None
    limits: Limits = field(default_factory=Limits)
    allow_ports: tuple[int, ...] = ()
    workdir: str = "/root"
    env: Mapping[str, str] = field(default_factory=dict)
    hostname: str = "sandbox"
    state_dir: str | None = None
    layers: tuple[str, ...] = ()
    binds: tuple[Bind, ...] = ()

    def __post_init__(self) -> None:
        if self.image is not None:
            object.__setattr__(self, "image", os.fspath(self.image))  # accept a Path
        object.__setattr__(self, "layers", check_layers(self.layers))
        binds = tuple(self.binds)
        for b in binds:
            if not isinstance(b, Bind):
                raise TypeError(f"binds must hold Bind objects, got {type(b).__name__}: {b!r}")
        targets = [b.target for b in binds]
        if len(set(targets)) != len(targets):
            raise ValueError(f"binds: two binds share a target: {sorted(targets)}")
        object.__setattr__(self, "binds", binds)
        if not isinstance(self.limits, Limits):
            raise TypeError(f"limits must be a Limits, got {type(self.limits).__name__}")
        ports = tuple(self.allow_ports)
        for p in ports:
            if isinstance(p, bool) or not isinstance(p, int) or not 0 < p < 65536:
                raise ValueError(f"allow_ports: {p!r} is not a TCP port number")
        object.__setattr__(self, "allow_ports", tuple(sorted(set(ports))))
        if not isinstance(self.workdir, str) or not self.workdir.startswith("/"):
            raise ValueError(f"workdir must be an absolute path, got {self.workdir!r}")
        object.__setattr__(self, "env", check_env(self.env))
        if not self.hostname.replace("-", "").isalnum() or len(self.hostname) > 63:
            raise ValueError(
                f"hostname must be alphanumeric (dashes allowed), got {self.hostname!r}")

    def with_limits(self, **changes: Any) -> SandboxConfig:
        return replace(self, limits=replace(self.limits, **changes))

    def to_dict(self) -> dict[str, Any]:
        return {
            "image": self.image, "limits": self.limits.to_dict(),
            "allow_ports": list(self.allow_ports), "workdir": self.workdir,
            "env": dict(self.env), "hostname": self.hostname, "state_dir": self.state_dir,
            "layers": list(self.layers), "binds": [b.to_dict() for b in self.binds],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SandboxConfig:
        return cls(
            image=d.get("image"), limits=Limits.from_dict(d.get("limits", {})),
            allow_ports=tuple(d.get("allow_ports", ())), workdir=d.get("workdir", "/root"),
            env=dict(d.get("env", {})), hostname=d.get("hostname", "sandbox"),
            state_dir=d.get("state_dir"), layers=tuple(d.get("layers", ())),
            binds=tuple(Bind.from_dict(b) for b in d.get("binds", ())),
        )
