"""`Sandbox`: the API the agent harness uses, and snapshots with exactly-once replay.

    with Sandbox() as sb:                       # fresh layer over the default image
        r = sb.exec("echo hi >> notes.txt; cat notes.txt")
        sb.write_file("task.py", "print(1)")
        snap = sb.snapshot("/ckpt/ep17.tar")    # layer + log of every operation

    sb2 = Sandbox.restore("/ckpt/ep17.tar")     # another process or machine
    sb2.exec("echo hi >> notes.txt; cat notes.txt")   # answered from the log, not run
    sb2.exec("wc -l notes.txt")                       # past the log: runs, prints 1

Every operation (exec, read_file, write_file, list) is appended to the command log with
its result. A restored sandbox starts from the snapshot's layer, which already holds the
effect of every logged operation, and answers the logged operations from the log as
the harness repeats them (in any order among identical ones), so nothing non-idempotent
runs twice and every earlier observation comes back unchanged. An operation that is
not in the log while logged ones are still waiting is a `ReplayDivergenceError` (strict
mode) rather than a silent re-run. Once the log is used up, operations run live.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import math
import os
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tidal.sandbox.layer import ArchiveReader, ArchiveWriter
from tidal.sandbox.memory import criu_status
from tidal.sandbox.oplog import LogEntry, OpLog, op_key
from tidal.sandbox.paths import normalize
from tidal.sandbox.runtime import Box, Runtime
from tidal.sandbox.types import (
    ExecResult,
    FileEntry,
    MemorySnapshotUnavailableError,
    MemorySnapshotWarning,
    SandboxConfig,
    SandboxError,
    SandboxPathError,
    SandboxStateError,
    check_env,
    default_env,
)

SNAPSHOT_FORMAT = "tidal-sandbox-snapshot"
SNAPSHOT_VERSION = 1

Command = str | Sequence[str]


def command_argv(command: object, shell: str | None) -> list[str]:
    """argv for a command: a str runs in the image's shell (bash, else sh), a list or
    tuple of str is the argv itself. Anything else is a TypeError."""
    if isinstance(command, str):
        if not command.strip():
            raise ValueError("empty command")
        if "\0" in command:
            raise ValueError("command contains NUL")
        if shell is None:
            raise SandboxError("the image has neither /bin/bash nor /bin/sh: pass the command "
                               "as a list (argv) instead of a string")
        return [shell, "-c", command]
    if isinstance(command, list | tuple):
        if not command:
            raise ValueError("empty command list")
        for i, a in enumerate(command):
            if not isinstance(a, str):
                raise TypeError(f"command[{i}] must be a str, got {type(a).__name__}: {a!r}")
            if "\0" in a:
                raise ValueError(f"command[{i}] contains NUL")
        if not command[0]:
            raise ValueError("command[0] is empty")
        return list(command)
    raise TypeError("a command must be a str (run by the shell) or a list of str (argv), "
                    f"got {type(command).__name__}: {command!r}")


# --------------------------------------------------------------------------- log


_ERRORS: dict[str, type[Exception]] = {
    "FileNotFoundError": FileNotFoundError, "IsADirectoryError": IsADirectoryError,
    "NotADirectoryError": NotADirectoryError, "PermissionError": PermissionError,
    "FileExistsError": FileExistsError, "SandboxPathError": SandboxPathError,
    "OSError": OSError,
}


# --------------------------------------------------------------------------- snapshot


@dataclass(frozen=True)
class Snapshot:
    """A snapshot file (format in layer.py): meta, the command log and the writable layer.
    Portable: copy the file to another machine and `Sandbox.restore` it there."""

    path: Path
    meta: Mapping[str, Any]

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Snapshot:
        return cls._open(path)[0]

    @classmethod
    def _open(cls, path: str | os.PathLike[str]) -> tuple[Snapshot, ArchiveReader]:
        p = Path(path)
        if not p.is_file():
            raise SandboxError(f"snapshot {str(p)!r} does not exist")
        reader = ArchiveReader(p)
        meta = reader.meta
        if not isinstance(meta, dict) or meta.get("format") != SNAPSHOT_FORMAT:
            raise SandboxError(f"{str(p)!r} is not a tidal sandbox snapshot")
        if meta.get("version") != SNAPSHOT_VERSION:
            raise SandboxError(f"snapshot version {meta.get('version')} is not supported "
                               f"(this tidal reads version {SNAPSHOT_VERSION})")
        return cls(p, meta), reader

    @property
    def log_len(self) -> int:
        return int(self.meta["log_len"])

    @property
    def config(self) -> SandboxConfig:
        return SandboxConfig.from_dict(self.meta["config"])

    @property
    def memory(self) -> Mapping[str, Any]:
        return self.meta.get("memory", {"captured": False})

    def read_log(self) -> list[LogEntry]:
        return [LogEntry.from_dict(d) for d in ArchiveReader(self.path).log]

    def delete(self) -> None:
        self.path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- sandbox


class Sandbox:
    """A fresh isolated environment for one episode.

    `Sandbox(config)` or `Sandbox(image=..., limits=..., allow_ports=...)`; `start()` (or
    `with Sandbox(...) as sb:`) creates it. Thread-safe: commands may run in parallel.
    """

    def __init__(self, config: SandboxConfig | None = None, *, runtime: Runtime | None = None,
                 **overrides: Any):
        cfg = config or SandboxConfig()
        if overrides:
            cfg = replace(cfg, **overrides)
        self.config = cfg
        self._runtime = runtime
        self._box: Box | None = None
        self._closed = False
        self._cv = threading.Condition()
        self._active = 0
        self._active_unpaused = 0
        self._exclusive = False
        self._paused = False
        self._oplog = OpLog()
        self._snap_n = 0

    # ----------------------------------------------------------------- lifecycle

    @property
    def runtime(self) -> Runtime:
        if self._runtime is None:
            from tidal.sandbox.local import LocalRuntime

            self._runtime = LocalRuntime()
        return self._runtime

    def start(self, *, _layers: ArchiveReader | None = None) -> Sandbox:
        if self._closed:
            raise SandboxStateError("sandbox is closed; make a new one")
        if self._box is None:
            self._box = self.runtime.create(self.config, _layers)
        return self

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        if self._box is not None:
            self._box.close()

    def __enter__(self) -> Sandbox:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def started(self) -> bool:
        return self._box is not None and not self._closed

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def incidents(self) -> list[str]:
        """What the runtime did on its own, e.g. killed processes a command left running
        that then hit the process limit (a fork bomb that outlived its shell)."""
        return self._box.incidents if self._box is not None else []

    @property
    def box(self) -> Box:
        if self._closed:
            raise SandboxStateError("sandbox is closed")
        if self._box is None:
            raise SandboxStateError("sandbox is not started: call start() or use `with`")
        return self._box

    # ----------------------------------------------------------------- gating

    @contextlib.contextmanager
    def _op(self, *, allow_paused: bool = False) -> Iterator[Box]:
        """Run one operation; many may run at once, not during a snapshot. Operations that
        cannot run paused (exec, write_file) are counted in `_active_unpaused`."""
        with self._cv:
            while self._exclusive and not self._closed:
                self._cv.wait()
            box = self.box
            if self._paused and not allow_paused:
                raise SandboxStateError("sandbox is paused; resume() it first")
            self._active += 1
            self._active_unpaused += not allow_paused
        try:
            yield box
        finally:
            with self._cv:
                self._active -= 1
                self._active_unpaused -= not allow_paused
                self._cv.notify_all()

    @contextlib.contextmanager
    def _exclusive_op(self) -> Iterator[Box]:
        with self._cv:
            while self._exclusive and not self._closed:
                self._cv.wait()
            box = self.box
            if self._paused and self._active_unpaused:  # waiting would never end
                raise SandboxStateError("a command is running in the paused sandbox; resume() it "
                                        "and let the command finish before a snapshot")
            self._exclusive = True
            try:
                while self._active and not self._closed:
                    self._cv.wait()
            except BaseException:
                self._exclusive = False
                self._cv.notify_all()
                raise
        try:
            yield box
        finally:
            with self._cv:
                self._exclusive = False
                self._cv.notify_all()

    # ----------------------------------------------------------------- log/replay

    @property
    def log(self) -> tuple[LogEntry, ...]:
        return self._oplog.entries

    @property
    def replay_pending(self) -> int:
        """Logged operations not yet asked for again since the restore."""
        return self._oplog.pending

    # ----------------------------------------------------------------- operations

    def exec(self, command: Command, *, timeout: float | None = None, cwd: str | None = None,
             env: Mapping[str, str] | None = None, stdin: str | bytes | None = None) -> ExecResult:
        """Run a command to completion: a str runs in the shell, a list is argv.

        `timeout` (seconds) overrides the config's per-command wall-clock limit. Limits
        end the command with a typed status (see `ExecStatus`); they never raise."""
        box = self.box
        argv = command_argv(command, box.shell)
        wall = self.config.limits.wall_s if timeout is None else timeout
        if isinstance(wall, bool) or not isinstance(wall, int | float) or not (
                math.isfinite(wall) and wall > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        workdir = self.config.workdir if cwd is None else normalize(cwd, self.config.workdir)
        call_env = check_env(env)
        if isinstance(stdin, str):
            stdin = stdin.encode()
        if stdin is not None and not isinstance(stdin, bytes):
            raise TypeError(f"stdin must be str or bytes, got {type(stdin).__name__}")
        args: dict[str, Any] = {
            "argv": argv, "cwd": workdir, "env": call_env,
            "stdin_sha256": hashlib.sha256(stdin).hexdigest() if stdin else None}
        key = op_key("exec", args)
        with self._op() as box:
            hit = self._oplog.replayed("exec", key, args)
            if hit is not None:
                return ExecResult.from_dict(hit.result, replayed=True)
            if cwd is not None and not box.is_dir(workdir):
                raise SandboxPathError(f"cwd {cwd!r} is not a directory in the sandbox")
            full_env = {**default_env(), **self.config.env, **call_env}
            result = box.exec(argv, cwd=workdir, env=full_env, stdin=stdin, wall_s=float(wall))
            self._oplog.append("exec", key, args, result.to_dict())
            return result

    def _file_op(self, op: str, args: dict[str, Any], run: Any, encode: Any, decode: Any,
                 *, allow_paused: bool) -> Any:
        with self._op(allow_paused=allow_paused):
            return self._oplog.once(op, args, run, encode, decode, errors=_ERRORS)

    def read_file(self, path: str | os.PathLike[str]) -> bytes:
        """The bytes of a file in the sandbox (at most `limits.file_bytes`)."""
        p = normalize(path, self.config.workdir)
        return self._file_op(
            "read_file", {"path": p}, lambda: self.box.read_file(p),
            lambda v: {"data_b64": base64.b64encode(v).decode()},
            lambda r: base64.b64decode(r["data_b64"]), allow_paused=True)

    def read_text(self, path: str | os.PathLike[str], encoding: str = "utf-8") -> str:
        return self.read_file(path).decode(encoding, errors="replace")

    def write_file(self, path: str | os.PathLike[str], data: str | bytes, *,
                   mode: int | None = None, mkdirs: bool = True) -> int:
        """Write (create or replace) a file; parent directories are created unless
        mkdirs=False. Returns the number of bytes written."""
        p = normalize(path, self.config.workdir)
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"data must be str or bytes, got {type(data).__name__}")
        data = bytes(data)
        if mode is not None and (not isinstance(mode, int) or not 0 <= mode <= 0o7777):
            raise ValueError(f"mode must be a permission integer such as 0o644, got {mode!r}")
        args = {"path": p, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                "mode": mode, "mkdirs": mkdirs}
        return self._file_op(
            "write_file", args, lambda: self.box.write_file(p, data, mode=mode, mkdirs=mkdirs),
            lambda v: {"written": v}, lambda r: r["written"], allow_paused=False)

    def list(self, path: str | os.PathLike[str] = ".") -> list[FileEntry]:
        """The entries of a directory, sorted by name (symlinks are not followed)."""
        p = normalize(path, self.config.workdir)
        return self._file_op(
            "list", {"path": p}, lambda: self.box.list(p),
            lambda v: {"entries": [e.to_dict() for e in v]},
            lambda r: [FileEntry.from_dict(e) for e in r["entries"]], allow_paused=True)

    # ----------------------------------------------------------------- pause

    def pause(self) -> None:
        """Freeze every process of the sandbox in place (a running command included;
        its wall-clock limit does not run while paused)."""
        with self._cv:
            while self._exclusive and not self._closed:
                self._cv.wait()
            box = self.box
            if not self._paused:
                box.pause()
                self._paused = True

    def resume(self) -> None:
        with self._cv:
            while self._exclusive and not self._closed:
                self._cv.wait()
            box = self.box
            if self._paused:
                box.resume()
                self._paused = False
                self._cv.notify_all()

    # ----------------------------------------------------------------- snapshot

    def snapshot(self, path: str | os.PathLike[str] | None = None, *, memory: bool = False,
                 require_memory: bool = False, durable: bool = False) -> Snapshot:
        """Write a snapshot (writable layer + command log) and return it.

        Taken between operations: it waits for running commands to finish. Processes
        are frozen while the layer is copied and keep running afterwards. `memory=True`
        asks for process memory too; where that is unavailable (see memory.py) it warns
        and falls back, or raises with `require_memory=True`. `durable=True` fsyncs the
        file before returning."""
        mem: dict[str, Any] = {"captured": False}
        if memory or require_memory:
            _ok, why = criu_status()
            mem["reason"] = why
            if require_memory:
                raise MemorySnapshotUnavailableError(f"process memory cannot be snapshotted: {why}")
            warnings.warn(f"process memory is not captured ({why}); the snapshot holds the "
                          "writable layer and the command log only", MemorySnapshotWarning,
                          stacklevel=2)
        with self._exclusive_op() as box:
            if path is None:
                self._snap_n += 1
                dest = _snapshot_dir(self.config) / f"{box.id}-{self._snap_n}.tar"
            else:
                dest = Path(path)
            log = self.log
            meta = {
                "format": SNAPSHOT_FORMAT, "version": SNAPSHOT_VERSION,
                "created_at": time.time(), "runtime": self.runtime.name,
                "image": self.runtime.image_id(self.config), "config": self.config.to_dict(),
                "log_len": len(log), "memory": mem,
            }
            tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
            was_paused = self._paused
            if not was_paused:
                box.pause()
            try:
                _write_archive(box, tmp, meta, [e.to_dict() for e in log], durable=durable)
                tmp.replace(dest)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            finally:
                if not was_paused:
                    box.resume()
        return Snapshot(dest, meta)

    # ----------------------------------------------------------------- grading

    def kill_processes(self) -> int:
        """Kill every process running in the sandbox (commands still running and what
        they left in the background); the sandbox stays usable. Returns how many."""
        with self._op() as box:
            return box.kill_processes()

    def fresh(self, keep: Sequence[str | os.PathLike[str]]) -> Sandbox:
        """Close this sandbox, every process in it killed first, and return a new one on
        the same image and config that holds, of everything written here, only `keep`
        (sandbox paths; their deletions too) and the directories above them. Everything
        else is as the image has it: what the verifier of a task runs in, so that nothing
        done to PATH, binaries or system files reaches it. The new sandbox's log starts
        empty. Raises SandboxError if the sandbox cannot be exported (this one is closed
        all the same)."""
        paths = [normalize(p, self.config.workdir) for p in keep]
        tmp = _snapshot_dir(self.config) / (
            f".carry-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}.tmp")
        try:
            try:
                with self._exclusive_op() as box:
                    box.kill_processes()
                    box.pause()
                    _write_archive(box, tmp, {"carried": paths}, [], only=paths)
            finally:
                self.close()
            return type(self)(self.config, runtime=self.runtime).start(_layers=ArchiveReader(tmp))
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def restore(cls, snapshot: Snapshot | str | os.PathLike[str], *,
                runtime: Runtime | None = None, strict: bool = True,
                **overrides: Any) -> Sandbox:
        """A started sandbox with the snapshot's layer and log, in replay mode.

        `overrides` change config fields (e.g. `image=` where the image lives at another
        path on this machine, `state_dir=`). With strict=False an operation that is not
        in the log runs live instead of raising `ReplayDivergenceError`."""
        snap, reader = Snapshot._open(
            snapshot.path if isinstance(snapshot, Snapshot) else snapshot)
        config = snap.config
        if overrides:
            config = replace(config, **overrides)
        sb = cls(config, runtime=runtime)
        try:
            log = OpLog.restored(reader.log, strict=strict, where=f"snapshot {str(snap.path)!r}")
        except ValueError as err:
            raise SandboxError(str(err)) from err
        sb.start(_layers=reader)
        sb._oplog = log
        return sb

    def __repr__(self) -> str:
        state = "closed" if self._closed else "paused" if self._paused else (
            "running" if self._box is not None else "new")
        return f"Sandbox(image={self.config.image or 'default'!r}, {state})"


def _snapshot_dir(config: SandboxConfig) -> Path:
    """Where snapshot files go when no path is given (and the verifier's carry files)."""
    from tidal.sandbox.local import state_root

    d = state_root(config) / "snapshots"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


def _write_archive(box: Box, path: Path, meta: Mapping[str, Any],
                   log: Sequence[Mapping[str, Any]], *, only: Sequence[str] | None = None,
                   durable: bool = False) -> None:
    """A snapshot file of the (quiescent) box's writable layers, or of `only` those paths."""
    out = ArchiveWriter(path)
    try:
        box.export_layers(out, only)
        out.finish(meta, log, durable=durable)
    finally:
        out.close()
