"""The snapshot file: writable layers, command log and meta in one portable file.

    "TIDAL-SANDBOX-SNAPSHOT\\n"          magic
    file data, back to back            each regular file's bytes, copied with sendfile(2)
    index (JSON, UTF-8)                {"meta": {...}, "log": [...], "layers": {key: [entry]}}
    u64 little-endian index length, "TIDALEND"

An entry is one inode of an overlayfs upper directory, parents before children:
{"path": "etc/hosts", "type": "file"|"dir"|"symlink"|"hardlink"|"whiteout"|"fifo",
 "mode", "uid", "gid", "mtime_ns", and "offset"/"size" (file), "link" (symlink target or
hardlink's first path), "xattrs" {name: base64} (the overlay's opaque marker, user.*)}.
Deletions travel as overlayfs whiteouts (0/0 character devices) and opaque directories.
A tar file would do the same job, but Python's tarfile spends ~0.2 ms per member on
headers: this format keeps a 10 MB layer's snapshot and restore within their targets.

Reading trusts nothing: paths must stay inside their layer, the only device is the 0/0
whiteout, and symlinks are created last, so nothing is written through a symlink the
file itself planted.
"""

from __future__ import annotations

import base64
import json
import os
import stat
import struct
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from tidal.sandbox.types import SandboxError

MAGIC = b"TIDAL-SANDBOX-SNAPSHOT\n"
END = b"TIDALEND"
FOOTER = struct.Struct("<Q8s")
KEPT_XATTRS = ("trusted.overlay.opaque",)


class LayerArchiveError(SandboxError, ValueError):
    """A snapshot file is malformed or unsafe."""


def _xattrs(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return out
    for name in names:
        if name in KEPT_XATTRS or name.startswith("user."):
            try:
                value = os.getxattr(path, name, follow_symlinks=False)
            except OSError:
                continue
            out[name] = base64.b64encode(value).decode()
    return out


def _sendfile_all(out_fd: int, in_fd: int, offset: int, size: int) -> None:
    done = 0
    while done < size:
        n = os.sendfile(out_fd, in_fd, offset + done, size - done)
        if n == 0:
            raise LayerArchiveError("a file shrank while it was being copied")
        done += n


class ArchiveWriter:
    """Writes a snapshot file: `add_layer` for each layer, then `finish`."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        os.write(self.fd, MAGIC)
        self.offset = len(MAGIC)
        self.layers: dict[str, list[dict[str, Any]]] = {}

    def add_layer(self, key: str, upper: Path, *, only: Sequence[str] | None = None,
                  merged: Path | None = None) -> int:
        """Add the overlayfs upper directory `upper` as layer `key`; returns data bytes.

        With `only` (paths relative to the layer's mount, "" for all of it), just those
        subtrees as the upper holds them (deletions and opaque directories included) and
        the directories above them, without their opaque marks, so that everything else
        shows the layers below: `merged` (the mount's merged view) gives the attributes
        of a directory above that the upper does not hold. A path whose directory above
        is no longer a directory (deleted, or replaced by a file or a symlink) is left
        out: nothing is ever read through a symlink the upper holds."""
        entries: list[dict[str, Any]] = []
        seen: dict[tuple[int, int], str] = {}
        total = 0
        walk = (((rel, full, st, True) for rel, full, st in _walk(str(upper))) if only is None
                else _walk_only(str(upper), str(merged or upper), only))
        for rel, full, st, marks in walk:
            e: dict[str, Any] = {"path": rel, "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid,
                                 "gid": st.st_gid, "mtime_ns": st.st_mtime_ns}
            m = st.st_mode
            if stat.S_ISREG(m) and st.st_nlink > 1 and (st.st_dev, st.st_ino) in seen:
                e.update(type="hardlink", link=seen[(st.st_dev, st.st_ino)])
            elif stat.S_ISREG(m):
                seen[(st.st_dev, st.st_ino)] = rel
                fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    _sendfile_all(self.fd, fd, 0, st.st_size)
                finally:
                    os.close(fd)
                e.update(type="file", offset=self.offset, size=st.st_size)
                self.offset += st.st_size
                total += st.st_size
            elif stat.S_ISDIR(m):
                e["type"] = "dir"
            elif stat.S_ISLNK(m):
                e.update(type="symlink", link=os.readlink(full))  # noqa: PTH115
            elif stat.S_ISCHR(m) and st.st_rdev == 0:
                e["type"] = "whiteout"
            elif stat.S_ISFIFO(m):
                e["type"] = "fifo"
            else:
                continue  # sockets and devices do not survive a restore
            xattrs = _xattrs(full) if marks else {}
            if xattrs:
                e["xattrs"] = xattrs
            entries.append(e)
        self.layers[key] = entries
        return total

    def finish(self, meta: Mapping[str, Any], log: Sequence[Mapping[str, Any]],
               *, durable: bool = False) -> None:
        index = json.dumps({"meta": meta, "log": list(log), "layers": self.layers},
                           separators=(",", ":")).encode()
        _write_all(self.fd, index + FOOTER.pack(len(index), END))
        if durable:
            os.fsync(self.fd)
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _walk(top: str) -> Iterator[tuple[str, str, os.stat_result]]:
    """(relative path, full path, lstat) for top ("") and everything under it, parents
    first, in name order."""
    yield "", top, os.lstat(top)
    stack = [("", top)]
    while stack:
        rel, full = stack.pop()
        with os.scandir(full) as it:
            children = sorted(it, key=lambda d: d.name)
        subdirs = []
        for d in children:
            crel = f"{rel}/{d.name}" if rel else d.name
            st = d.stat(follow_symlinks=False)
            yield crel, d.path, st
            if stat.S_ISDIR(st.st_mode):
                subdirs.append((crel, d.path))
        stack.extend(reversed(subdirs))


def _walk_only(upper: str, merged: str, only: Sequence[str]
               ) -> Iterator[tuple[str, str, os.stat_result, bool]]:
    """`_walk` of the subtrees `only` of `upper` and the directories above them
    (see `ArchiveWriter.add_layer`), with whether each entry keeps its xattrs."""
    rels = sorted({r.strip("/") for r in only})
    if "" in rels:
        yield from ((rel, full, st, True) for rel, full, st in _walk(upper))
        return
    yield "", upper, os.lstat(upper), False
    done: set[str] = {""}  # directories above a kept path, already yielded
    kept: list[str] = []
    for rel in rels:  # sorted: a path comes before those under it
        parts = rel.split("/")
        if any(c in ("", ".", "..") for c in parts):
            raise LayerArchiveError(f"unsafe path to keep: {rel!r}")
        if any(rel.startswith(k + "/") for k in kept):
            continue  # under a path already kept
        above = []
        for i in range(1, len(parts)):
            anc = "/".join(parts[:i])
            try:
                st, full = os.lstat(f"{upper}/{anc}"), f"{upper}/{anc}"
            except FileNotFoundError:
                try:
                    st, full = os.lstat(f"{merged}/{anc}"), f"{merged}/{anc}"
                except FileNotFoundError:
                    break
            if not stat.S_ISDIR(st.st_mode):
                break
            above.append((anc, full, st))
        else:
            top = f"{upper}/{rel}"
            try:
                top_st = os.lstat(top)
            except FileNotFoundError:
                continue  # untouched: the layers below have it as it was
            for anc, full, st in above:
                if anc not in done:
                    done.add(anc)
                    yield anc, full, st, False
            kept.append(rel)
            if not stat.S_ISDIR(top_st.st_mode):
                yield rel, top, top_st, True
                continue
            for sub, full, st in _walk(top):
                yield (f"{rel}/{sub}" if sub else rel), full, st, True


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class ArchiveReader:
    """Reads a snapshot file's index; extracts layers."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        with path.open("rb") as f:
            if size < len(MAGIC) + FOOTER.size or f.read(len(MAGIC)) != MAGIC:
                raise LayerArchiveError(f"{str(path)!r} is not a tidal sandbox snapshot")
            f.seek(size - FOOTER.size)
            n, end = FOOTER.unpack(f.read(FOOTER.size))
            if end != END or n > size - FOOTER.size - len(MAGIC):
                raise LayerArchiveError(f"{str(path)!r} is truncated or damaged")
            f.seek(size - FOOTER.size - n)
            try:
                index = json.loads(f.read(n))
            except ValueError as e:
                raise LayerArchiveError(f"{str(path)!r} has a damaged index: {e}") from e
        if not isinstance(index, dict) or not {"meta", "log", "layers"} <= index.keys():
            raise LayerArchiveError(f"{str(path)!r} has a damaged index")
        self.meta: dict[str, Any] = index["meta"]
        self.log: list[dict[str, Any]] = index["log"]
        self.layers: dict[str, list[dict[str, Any]]] = index["layers"]
        self.data_end = size - FOOTER.size - n

    def extract_layer(self, key: str, upper: Path) -> None:
        """Recreate layer `key` in the (empty) directory `upper`."""
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._extract(self.layers.get(key, []), upper, fd)
        except LayerArchiveError:
            raise
        except (KeyError, TypeError, ValueError, OSError) as e:
            raise LayerArchiveError(f"snapshot layer {key!r} is damaged: {e!r}") from e
        finally:
            os.close(fd)

    def _extract(self, entries: list[dict[str, Any]], upper: Path, src: int) -> None:
        symlinks: list[tuple[dict[str, Any], Path]] = []
        dirs: list[tuple[dict[str, Any], Path]] = []
        for e in entries:
            rel = _safe_rel(e["path"])
            dest = upper / rel if rel else upper
            t = e["type"]
            if rel and not dest.parent.is_dir():
                raise LayerArchiveError(f"{e['path']!r} comes before its directory")
            if t == "dir":
                if rel:
                    dest.mkdir()
                dirs.append((e, dest))
                continue
            if not rel:
                raise LayerArchiveError("the layer root must be a directory")
            if t == "symlink":
                symlinks.append((e, dest))
                continue
            if t == "file":
                off, size = int(e["offset"]), int(e["size"])
                if off < len(MAGIC) or size < 0 or off + size > self.data_end:
                    raise LayerArchiveError(f"{e['path']!r} points outside the data")
                out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                              | os.O_CLOEXEC, 0o600)
                try:
                    _sendfile_all(out, src, off, size)
                finally:
                    os.close(out)
            elif t == "hardlink":
                target = upper / _safe_rel(e["link"])
                if not stat.S_ISREG(target.lstat().st_mode):
                    raise LayerArchiveError(f"hardlink {e['path']!r} does not point at a file")
                os.link(target, dest, follow_symlinks=False)
                continue  # shares the target's attributes
            elif t == "whiteout":
                os.mknod(dest, stat.S_IFCHR, os.makedev(0, 0))
            elif t == "fifo":
                os.mkfifo(dest)
            else:
                raise LayerArchiveError(f"unknown entry type {t!r} for {e['path']!r}")
            _set_attrs(e, dest)
        for e, dest in symlinks:
            dest.symlink_to(str(e["link"]))
            _set_attrs(e, dest, symlink=True)
        for e, dest in reversed(dirs):
            _set_attrs(e, dest)


def _safe_rel(path: object) -> str:
    if not isinstance(path, str) or "\0" in path:
        raise LayerArchiveError(f"bad path in snapshot: {path!r}")
    if path == "":
        return ""
    p = PurePosixPath(path)
    if p.is_absolute() or any(c in ("..", ".", "") for c in path.split("/")):
        raise LayerArchiveError(f"unsafe path in snapshot: {path!r}")
    return path


def _set_attrs(e: Mapping[str, Any], dest: Path, *, symlink: bool = False) -> None:
    os.chown(dest, int(e["uid"]), int(e["gid"]), follow_symlinks=False)
    if not symlink:
        dest.chmod(int(e["mode"]) & 0o7777)
    for name, value in e.get("xattrs", {}).items():
        if name in KEPT_XATTRS or name.startswith("user."):
            os.setxattr(dest, name, base64.b64decode(value), follow_symlinks=False)
    ns = int(e["mtime_ns"])
    os.utime(dest, ns=(ns, ns), follow_symlinks=False)
