"""Safe file access to a sandbox's filesystem from the host.

`read_file`, `write_file` and `list` run on the host (fast, and no binary needs to
exist in the image), so a path chosen by the agent must never reach a host file. The
resolver walks the path one component at a time with `openat`-style calls relative to
directory file descriptors, never through a host path string built from agent input:

- absolute paths and absolute symlink targets are sandbox paths (`/etc/shadow` is the
  sandbox's /etc/shadow, as for a process inside);
- `..` that would climb above the sandbox's root, written in the path or reached
  through a symlink, is a `SandboxPathError`;
- symlinks are followed inside the sandbox (at most 40), each component is opened
  with O_NOFOLLOW, so a symlink swapped in meanwhile cannot redirect the walk;
- mounts of the sandbox (/usr of the default image) are crossed as inside;
  /proc and /dev are not part of the layer and are refused.
"""
# ruff: noqa: PTH116, PTH208

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from tidal.sandbox.types import FileEntry, FileKind, SandboxPathError

MAX_SYMLINKS = 40
NOT_IN_LAYER = ("/proc", "/dev")
_O_PATH_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def normalize(path: object, workdir: str) -> str:
    """The absolute sandbox path for an API path (relative ones start at `workdir`).
    Purely lexical; raises SandboxPathError for a bad type, NUL, or `..` above /."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if isinstance(path, bytes):
        raise SandboxPathError("sandbox paths must be str, not bytes")
    if not isinstance(path, str):
        raise SandboxPathError(f"a sandbox path must be a str, got {type(path).__name__}")
    if not path:
        raise SandboxPathError("empty sandbox path")
    if "\0" in path:
        raise SandboxPathError(f"sandbox path contains NUL: {path!r}")
    full = path if path.startswith("/") else f"{workdir.rstrip('/')}/{path}"
    parts: list[str] = []
    for comp in full.split("/"):
        if comp in ("", "."):
            continue
        if comp == "..":
            if not parts:
                raise SandboxPathError(f"path {path!r} escapes the sandbox root")
            parts.pop()
        else:
            parts.append(comp)
    return "/" + "/".join(parts)


@dataclass
class _Found:
    parent_fd: int  # O_PATH fd of the directory holding `name` (owned by the resolver)
    name: str | None  # None: the path is a directory itself (parent_fd is it)
    logical: str
    st: os.stat_result | None  # None: does not exist


class Resolver:
    """Resolves sandbox paths against the host directories that back its mounts."""

    def __init__(self, mounts: dict[str, str], workdir: str):
        if "/" not in mounts:
            raise ValueError("mounts must include /")
        self.mounts = dict(mounts)
        self.workdir = workdir

    # ----------------------------------------------------------------- resolution

    @contextlib.contextmanager
    # long by design: an openat walk resolving symlinks: one loop over a shared stack of fds
    def _resolve(self, api_path: object, *, mkdirs: bool = False) -> Iterator[_Found]:  # noqa: PLR0915
        path = normalize(api_path, self.workdir)
        self._check_reachable(path, path)
        root_fd = os.open(self.mounts["/"], _O_PATH_DIR)
        stack: list[tuple[str, int]] = [("", root_fd)]
        todo: deque[tuple[str, str | None]] = deque((c, None) for c in path.split("/") if c)
        links = 0
        try:
            while todo:
                comp, via = todo.popleft()
                if comp in ("", "."):
                    continue
                if comp == "..":
                    if len(stack) == 1:
                        raise SandboxPathError(
                            f"path {api_path!r} escapes the sandbox root through symlink {via}")
                    os.close(stack.pop()[1])
                    continue
                logical = "/".join([n for n, _ in stack] + [comp])
                self._check_reachable(logical, api_path)
                last = not todo
                if logical in self.mounts:
                    stack.append((comp, os.open(self.mounts[logical], _O_PATH_DIR)))
                    if last:
                        break
                    continue
                cur = stack[-1][1]
                try:
                    st = os.stat(comp, dir_fd=cur, follow_symlinks=False)
                except FileNotFoundError:
                    if last:
                        yield _Found(cur, comp, logical, None)
                        return
                    if not mkdirs:
                        raise FileNotFoundError(
                            errno.ENOENT, f"no such directory in the sandbox: {logical}") from None
                    os.mkdir(comp, 0o755, dir_fd=cur)
                    st = os.stat(comp, dir_fd=cur, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    links += 1
                    if links > MAX_SYMLINKS:
                        raise SandboxPathError(f"too many symlinks resolving {api_path!r}")
                    target = os.readlink(comp, dir_fd=cur)
                    if target.startswith("/"):
                        while len(stack) > 1:
                            os.close(stack.pop()[1])
                    note = f"{logical} -> {target}"
                    todo.extendleft((c, note) for c in reversed(target.split("/")))
                    continue
                if last:
                    yield _Found(cur, comp, logical, st)
                    return
                if not stat.S_ISDIR(st.st_mode):
                    raise NotADirectoryError(errno.ENOTDIR,
                                             f"not a directory in the sandbox: {logical}")
                stack.append((comp, os.open(comp, _O_PATH_DIR, dir_fd=cur)))
            top = stack[-1][1]
            yield _Found(top, None, "/".join(n for n, _ in stack) or "/", os.stat(top))
        finally:
            for _, fd in stack:
                os.close(fd)

    def _check_reachable(self, logical: str, api_path: object) -> None:
        for hidden in NOT_IN_LAYER:
            if logical == hidden or logical.startswith(hidden + "/"):
                raise SandboxPathError(
                    f"{api_path!r}: {hidden} is not part of the sandbox's files; "
                    "read it with a command instead")

    # ----------------------------------------------------------------- operations

    def read(self, api_path: object, max_bytes: int) -> bytes:
        with self._resolve(api_path) as f:
            if f.st is None:
                raise FileNotFoundError(errno.ENOENT, f"no such file in the sandbox: {f.logical}")
            if f.name is None or stat.S_ISDIR(f.st.st_mode):
                raise IsADirectoryError(errno.EISDIR, f"is a directory in the sandbox: {f.logical}")
            fd = os.open(f.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=f.parent_fd)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise SandboxPathError(f"not a regular file in the sandbox: {f.logical}")
                if st.st_size > max_bytes:
                    raise SandboxPathError(
                        f"{f.logical} is {st.st_size} bytes, over the {max_bytes}-byte read limit")
                chunks, total = [], 0
                while chunk := os.read(fd, 1 << 20):
                    chunks.append(chunk)
                    total += len(chunk)
                    if total > max_bytes:
                        raise SandboxPathError(f"{f.logical} grew over the {max_bytes}-byte limit")
                return b"".join(chunks)
            finally:
                os.close(fd)

    def write(self, api_path: object, data: bytes, mode: int | None, mkdirs: bool) -> int:
        with self._resolve(api_path, mkdirs=mkdirs) as f:
            if f.name is None or (f.st is not None and stat.S_ISDIR(f.st.st_mode)):
                raise IsADirectoryError(errno.EISDIR, f"is a directory in the sandbox: {f.logical}")
            flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC)
            fd = os.open(f.name, flags, 0o644 if mode is None else mode, dir_fd=f.parent_fd)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise SandboxPathError(f"not a regular file in the sandbox: {f.logical}")
                if mode is not None:
                    os.fchmod(fd, mode)
                view, written = memoryview(data), 0
                while written < len(data):
                    written += os.write(fd, view[written:])
                return written
            finally:
                os.close(fd)

    def list(self, api_path: object) -> list[FileEntry]:
        with self._resolve(api_path) as f:
            if f.st is None:
                raise FileNotFoundError(errno.ENOENT,
                                        f"no such directory in the sandbox: {f.logical}")
            if not stat.S_ISDIR(f.st.st_mode):
                raise NotADirectoryError(errno.ENOTDIR,
                                         f"not a directory in the sandbox: {f.logical}")
            if f.name is None:
                fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=f.parent_fd)
            else:
                fd = os.open(f.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                             dir_fd=f.parent_fd)
            try:
                out = []
                for name in os.listdir(fd):
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    out.append(FileEntry(name=name, kind=_kind(st.st_mode), size=st.st_size,
                                         mode=stat.S_IMODE(st.st_mode)))
                return sorted(out, key=lambda e: e.name)
            finally:
                os.close(fd)

    def ensure_dir(self, api_path: str, mode: int = 0o755) -> None:
        with self._resolve(api_path, mkdirs=True) as f:
            if f.st is None and f.name is not None:
                os.mkdir(f.name, mode, dir_fd=f.parent_fd)
            elif f.st is not None and not stat.S_ISDIR(f.st.st_mode):
                raise NotADirectoryError(errno.ENOTDIR,
                                         f"not a directory in the sandbox: {f.logical}")

    def is_dir(self, api_path: str) -> bool:
        try:
            with self._resolve(api_path) as f:
                return f.st is not None and stat.S_ISDIR(f.st.st_mode)
        except (OSError, SandboxPathError):
            return False

    def exists(self, api_path: str) -> bool:
        try:
            with self._resolve(api_path) as f:
                return f.st is not None
        except (OSError, SandboxPathError):
            return False


def _kind(mode: int) -> FileKind:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"
