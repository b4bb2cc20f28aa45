"""Task environments from Dockerfiles, without Docker: build once, cache by content hash.

A Harbor-format task brings `environment/Dockerfile` and its build context. tidal turns
the supported subset (dockerfile.py) into one read-only layer: it starts a sandbox on
the base image (no network), applies the instructions in order (WORKDIR creates the
directory, COPY/ADD write through the sandbox's file API, RUN runs as a sandbox
command with the ENV and WORKDIR of its line), and exports the sandbox's writable layer
with the snapshot format of layer.py. Every episode then stacks that layer read-only
under its own writable layer (`SandboxConfig.layers`), so episodes start in
milliseconds and never see each other's changes.

    cache_dir/<key>/layer/<mount key>/...   the layer: root (/), usr (/usr), ...
    cache_dir/<key>/meta.json               workdir, env, base, created, the Dockerfile
    cache_dir/<key>/build.log               what each RUN printed
    cache_dir/<key>.lock                    flock held while building that key

The key is a sha256 of the builder version, the base image's identity, the instructions
that change files (after ARG/ENV substitution) and every file COPY/ADD select from the
context (path, mode, bytes). A hit does no work beyond hashing those files: no sandbox,
no copy. A build writes into a temporary directory renamed into place, under the lock,
so concurrent builders of one key (threads or processes) build it once.
"""
# ruff: noqa: PTH115

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import posixpath
import re
import shutil
import stat
import tarfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Any, TypeVar

from tidal.sandbox.dockerfile import (
    DEFAULT_IMAGE_REF,
    REMEDY_UNMAPPED,
    Copy,
    Dockerfile,
    DockerfileError,
    Run,
    Workdir,
    parse_dockerfile,
)
from tidal.sandbox.image import DEFAULT_IMAGE_VERSION, default_image_identity, directory_identity
from tidal.sandbox.layer import ArchiveReader
from tidal.sandbox.sandbox import Sandbox
from tidal.sandbox.types import (
    OVERLAY_BAD_CHARS,
    ImageError,
    Limits,
    SandboxConfig,
    SandboxError,
    SandboxPathError,
)

BUILDER_VERSION = 1
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2", ".tbz2")
OUTPUT_TAIL = 2000
REMEDY_RUN = ("fix the command; builds run without network, so anything it downloads must "
              "already be in the base image")
REMEDY_TOOLS = "the base image needs mkdir, chmod, ln and /bin/sh for this step"
MiB = 1 << 20
T = TypeVar("T")


class BuildError(SandboxError):
    """A build step failed: where, what, the end of its output, what to do."""

    def __init__(self, file: str, line: int, problem: str, remedy: str, *,
                 output: str = "", log: str | None = None) -> None:
        self.file, self.line, self.problem, self.remedy = file, line, problem, remedy
        self.output, self.log = output, log
        super().__init__(str(self))

    def __str__(self) -> str:
        text = f"{self.file} line {self.line}: {self.problem}. {self.remedy}"
        if self.output:
            text += f"\n--- last output ---\n{self.output}"
        if self.log:
            text += f"\n(full build log: {self.log})"
        return text

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_error, ({"file": self.file, "line": self.line, "problem": self.problem,
                                 "remedy": self.remedy, "output": self.output, "log": self.log},)


def _rebuild_error(d: dict[str, Any]) -> BuildError:
    return BuildError(d["file"], d["line"], d["problem"], d["remedy"], output=d["output"],
                      log=d["log"])


@dataclass(frozen=True)
class Environment:
    """What an episode of a task runs in: `SandboxConfig(image=, layers=, workdir=,
    env=)`. `built` is True when this call did the build, False on a cache hit (or when
    there was nothing to build)."""

    image: str | None  # None: the default image; else an image directory
    layers: tuple[str, ...]  # the built layer, if any RUN/COPY/ADD happened
    workdir: str | None  # the last WORKDIR
    env: Mapping[str, str] = field(hash=False)  # ENV at the end
    key: str
    built: bool
    seconds: float
    fallback_for: str | None = None  # the FROM / docker_image the fallback stood in for
    # the FROM that tidal's default image stood in for, as the Dockerfile declares
    # (`LABEL tidal.image="default"`) and the run did not map
    declared_for: str | None = None


# --------------------------------------------------------------------------- base


def resolve_base(ref: str, images: Mapping[str, str], fallback: str | None, *,
                 file: str = "", line: int = 0, declared_default: bool = False) -> str | None:
    """The image directory for a FROM / docker_image reference, None for tidal's default
    image. `images` maps references to directories or "default": the exact reference
    first, then without its tag or digest (`ubuntu:24.04` -> `ubuntu`).
    `tidal/default` is always the default image. An unmapped reference gets the default
    image when `declared_default` (the Dockerfile's `LABEL tidal.image="default"`), else
    `fallback` ("default", a directory), or, when that is None, a DockerfileError."""
    name = _without_tag(ref)
    if name == DEFAULT_IMAGE_REF:
        return None
    value = images.get(ref, images.get(name))
    if value is None and declared_default:
        return None
    if value is None:
        if fallback is None:
            raise DockerfileError(file, line, f"the image {ref!r} is not mapped to a local "
                                  "image directory", REMEDY_UNMAPPED)
        value = fallback
    if value == "default":
        return None
    path = Path(value).expanduser()
    if not path.is_dir():
        raise DockerfileError(file, line, f"the image directory {value!r} for {ref!r} does "
                              "not exist", "fix its path (`tidal tasks check --image "
                              "REF=DIR`; in a run, [environment] images)")
    return str(path.resolve())


def is_mapped(ref: str, images: Mapping[str, str]) -> bool:
    """Whether `resolve_base` finds `ref` itself (else the fallback stands in for it)."""
    name = _without_tag(ref)
    return name == DEFAULT_IMAGE_REF or ref in images or name in images


def _without_tag(ref: str) -> str:
    name = ref.split("@", 1)[0]
    colon = name.rfind(":")
    return name[:colon] if colon > name.rfind("/") else name


def _base_identity(base: str | None, state_dir: str | None, *, full: bool = True) -> str:
    if base is not None:
        return f"dir:{directory_identity(Path(base))}"
    if not full:
        return f"default-v{DEFAULT_IMAGE_VERSION}"
    from tidal.sandbox.local import state_root

    images_dir = state_root(SandboxConfig(state_dir=state_dir)) / "images"
    return f"default:{default_image_identity(images_dir)}"


# --------------------------------------------------------------------------- context


def _translate(pattern: str) -> re.Pattern[str]:
    """A .dockerignore / COPY glob as a regex: `*` and `?` stay within one path
    component, `**` crosses them, `[...]` is a class (`[!...]` negated)."""
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[" and pattern.find("]", i + 2) > 0:
            j = pattern.find("]", i + 2)
            body = pattern[i + 1:j]
            body = "^" + body[1:] if body.startswith("!") else body
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = j + 1
        elif c == "\\" and i + 1 < n:
            out.append(re.escape(pattern[i + 1]))
            i += 2
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out))


class DockerIgnore:
    """The context root's `.dockerignore`: one pattern a line (`#` comments), `!` to
    re-include; the last pattern that matches a path, or one of its parent
    directories, decides."""

    def __init__(self, patterns: Sequence[tuple[bool, re.Pattern[str]]] = ()) -> None:
        self.patterns = tuple(patterns)
        self.has_negations = any(neg for neg, _ in self.patterns)

    @classmethod
    def load(cls, context: Path) -> DockerIgnore:
        f = context / ".dockerignore"
        if not f.is_file():
            return cls()
        out: list[tuple[bool, re.Pattern[str]]] = []
        for raw in f.read_text(encoding="utf-8", errors="replace").splitlines():
            s = raw.strip()
            if not s or s.startswith("#"):
                continue
            neg = s.startswith("!")
            s = os.path.normpath(s[1:].strip() if neg else s).lstrip("/")
            if s and s != ".":
                out.append((neg, _translate(s)))
        return cls(out)

    def excluded(self, rel: str) -> bool:
        parts = rel.split("/")
        prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
        result = False
        for neg, rx in self.patterns:
            if any(rx.fullmatch(p) for p in prefixes):
                result = not neg
        return result


@dataclass(frozen=True)
class _Item:
    """One thing a COPY/ADD puts into the sandbox."""

    kind: str  # "file", "dir", "symlink", "tar"
    dest: str  # the sandbox path
    mode: int | None = None  # None for a dir: only make sure it exists
    rel: str = ""  # its path in the build context
    link: str = ""  # a symlink's target
    digest: str = ""  # sha256 of a file's bytes
    host: str = field(default="", compare=False)  # where to read it (not part of the key)

    def key(self) -> list[Any]:
        return [self.kind, self.dest, self.mode, self.rel, self.link, self.digest]


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _join(dest: str, name: str) -> str:
    return f"{dest.rstrip('/')}/{name}"


def _walk(top: str, rel: str, dest: str, *, chmod: int | None,
          excluded: Callable[[str], bool], descend_excluded: bool,
          digest: bool = True) -> Iterator[_Item]:
    """Items for the contents of directory `top` (context path `rel`) copied into
    `dest`: directories, files and symlinks (kept as symlinks), in name order."""
    with os.scandir(top) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        crel = e.name if rel in ("", ".") else f"{rel}/{e.name}"
        st = e.stat(follow_symlinks=False)
        cdest = _join(dest, e.name)
        if excluded(crel):
            if stat.S_ISDIR(st.st_mode) and descend_excluded:  # a `!` may re-include inside
                yield from _walk(e.path, crel, cdest, chmod=chmod, excluded=excluded,
                                 descend_excluded=descend_excluded, digest=digest)
            continue
        mode = chmod if chmod is not None else stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode):
            yield _Item("symlink", cdest, rel=crel, link=os.readlink(e.path))
        elif stat.S_ISDIR(st.st_mode):
            yield _Item("dir", cdest, mode, rel=crel)
            yield from _walk(e.path, crel, cdest, chmod=chmod, excluded=excluded,
                             descend_excluded=descend_excluded, digest=digest)
        elif stat.S_ISREG(st.st_mode):
            yield _Item("file", cdest, mode, rel=crel, host=e.path,
                        digest=_sha256(e.path) if digest else "")
        # sockets, fifos and devices are not copied


class _Context:
    """The build context of one Dockerfile: what COPY/ADD sources select from it."""

    def __init__(self, root: Path, df: Dockerfile, cache_dir: Path) -> None:
        self.root = root
        self.real = root.resolve()
        self.df = df
        self.ignore = DockerIgnore.load(self.real) if self.real.is_dir() else DockerIgnore()
        cache = cache_dir.resolve()  # a cache inside the context is never part of it
        self.cache_rel = str(cache.relative_to(self.real)) if cache.is_relative_to(
            self.real) and cache != self.real else None

    def excluded(self, rel: str) -> bool:
        if self.cache_rel is not None and (rel == self.cache_rel
                                           or rel.startswith(self.cache_rel + "/")):
            return True
        return self.ignore.excluded(rel)

    def error(self, ins: Copy, problem: str, remedy: str) -> DockerfileError:
        return DockerfileError(self.df.file, ins.line, problem, remedy)

    def plan(self, ins: Copy) -> tuple[_Item, ...]:
        if not self.real.is_dir():
            raise self.error(ins, f"the build context {str(self.root)!r} is not a directory",
                             "pass the directory that holds the files the Dockerfile copies")
        rels: list[str] = []
        for src in ins.sources:
            found = self._glob(src) if re.search(r"[*?\[]", src) else [src]
            if not found:
                raise self.error(ins, f"no file in the build context matches {src!r}",
                                 "fix the pattern or add the files to the context")
            rels += found
        into_dir = ins.dest_is_dir or len(rels) > 1
        if len(rels) > 1 and not ins.dest_is_dir:
            raise self.error(ins, f"{ins.op} sources match {len(rels)} files but the "
                             "destination is not a directory", f"end it with /: {ins.dest}/")
        items: list[_Item] = []
        for rel in rels:
            items += self._source(ins, rel, into_dir)
        return tuple(items)

    def _source(self, ins: Copy, rel: str, into_dir: bool) -> list[_Item]:
        host = self.real / rel if rel != "." else self.real
        if not os.path.lexists(host) or (rel != "." and self.excluded(rel)):
            why = " (excluded by .dockerignore)" if os.path.lexists(host) else ""
            raise self.error(ins, f"{ins.op} source {rel!r} is not in the build context "
                             f"{str(self.root)!r}{why}", "add it to the context or fix the path")
        real = Path(os.path.realpath(host))
        if real != self.real and not real.is_relative_to(self.real):
            raise self.error(ins, f"{ins.op} source {rel!r} leads outside the build context "
                             "through a symlink", "copy the files into the context instead")
        mode = ins.chmod
        if real.is_dir():
            return [_Item("dir", ins.dest), *_walk(
                str(real), rel, ins.dest, chmod=mode, excluded=self.excluded,
                descend_excluded=self.ignore.has_negations)]
        if not real.is_file():
            raise self.error(ins, f"{ins.op} source {rel!r} is not a file or a directory",
                             "copy regular files and directories")
        name = posixpath.basename(rel)
        digest = _sha256(str(real))
        if ins.op == "ADD" and rel.lower().endswith(TAR_SUFFIXES):
            return [_Item("tar", ins.dest, mode, rel=rel, digest=digest, host=str(real))]
        dest = _join(ins.dest, name) if into_dir else ins.dest
        file_mode = mode if mode is not None else stat.S_IMODE(real.stat().st_mode)
        return [_Item("file", dest, file_mode, rel=rel, digest=digest, host=str(real))]

    def _glob(self, pattern: str) -> list[str]:
        """Context paths matching `pattern` component by component (not through
        symlinked directories, not excluded by .dockerignore), sorted."""
        parts = [_translate(p) for p in pattern.split("/")]
        found: list[str] = []

        def visit(dir_path: Path, rel: str, k: int) -> None:
            with os.scandir(dir_path) as it:
                for e in sorted(it, key=lambda e: e.name):
                    crel = f"{rel}/{e.name}" if rel else e.name
                    if not parts[k].fullmatch(e.name) or self.excluded(crel):
                        continue
                    if k == len(parts) - 1:
                        found.append(crel)
                    elif e.is_dir(follow_symlinks=False):
                        visit(Path(e.path), crel, k + 1)

        visit(self.real, "", 0)
        return found


# --------------------------------------------------------------------------- key


def _cache_key(df: Dockerfile, base_id: str, plans: Mapping[int, tuple[_Item, ...]]) -> str:
    steps: list[Any] = []
    for ins in df.instructions:
        if isinstance(ins, Run | Workdir | Copy):
            d = asdict(ins)
            d.pop("line")
            d["type"] = type(ins).__name__
            if isinstance(ins, Copy):
                d["items"] = [it.key() for it in plans[ins.line]]
            steps.append(d)
    blob = json.dumps({"builder": BUILDER_VERSION, "base": base_id, "steps": steps},
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


# --------------------------------------------------------------------------- build


def build_limits(timeout_s: float) -> Limits:
    """The builder's sandbox limits: 2 GiB of memory, 4 GiB of layer, `timeout_s` of
    wall-clock and CPU time per RUN, 32 MiB of output per stream."""
    return Limits(memory_bytes=2048 * MiB, disk_bytes=4096 * MiB, wall_s=timeout_s,
                  cpu_s=timeout_s, pids=1024, output_bytes=32 * MiB)


class _Builder:
    """Applies a Dockerfile's instructions in one build sandbox."""

    def __init__(self, sb: Sandbox, df: Dockerfile, log: IO[str], timeout_s: float,
                 scratch: Path) -> None:
        self.sb, self.df, self.log, self.timeout_s, self.scratch = sb, df, log, timeout_s, scratch
        self.pending_dirs: list[str] = []  # WORKDIRs not yet created

    def error(self, line: int, problem: str, remedy: str, output: str = "") -> BuildError:
        return BuildError(self.df.file, line, problem, remedy, output=output[-OUTPUT_TAIL:])

    def exec(self, line: int, argv: Sequence[str], what: str, *, cwd: str = "/",
             env: Mapping[str, str] | None = None, remedy: str = REMEDY_TOOLS) -> None:
        r = self.sb.exec(list(argv), cwd=cwd, env=dict(env or {}), timeout=self.timeout_s)
        self.log.write(f"### line {line}: {what}\n{r.stdout}{r.stderr}"
                       f"### {r.status.value}, exit {r.exit_code}, {r.duration_s:.2f} s\n")
        self.log.flush()
        if not r.ok:
            detail = f" ({r.detail})" if r.detail else ""
            output = "\n".join(s for s in (r.stdout.rstrip(), r.stderr.rstrip()) if s)
            raise self.error(line, f"{what} failed with exit code {r.exit_code}{detail}", remedy,
                             output)

    def make_dirs(self, line: int) -> None:
        missing = [d for d in dict.fromkeys(self.pending_dirs) if not self.sb.box.is_dir(d)]
        self.pending_dirs = []
        for part in _chunks(missing):
            self.exec(line, ["mkdir", "-p", "--", *part], f"mkdir -p {' '.join(part)}")

    def workdir(self, ins: Workdir) -> None:
        self.pending_dirs.append(ins.path)  # made before the next RUN, or at the end

    def run(self, ins: Run) -> None:
        self.pending_dirs.append(ins.workdir)
        self.make_dirs(ins.line)
        what = "RUN " + (ins.argv[-1] if ins.shell_form else json.dumps(list(ins.argv)))
        self.exec(ins.line, ins.argv, what, cwd=ins.workdir, env=dict(ins.env), remedy=REMEDY_RUN)

    def copy(self, ins: Copy, items: Sequence[_Item]) -> None:
        if (len(items) == 1 and items[0].kind == "file" and not ins.dest_is_dir
                and self.sb.box.is_dir(ins.dest)):  # COPY file /existing-dir: into it
            items = [replace(items[0], dest=_join(ins.dest, posixpath.basename(items[0].rel)))]
        expanded: list[_Item] = []
        for it in items:
            expanded += self._untar(ins, it) if it.kind == "tar" else [it]
        try:
            for it in expanded:
                if it.kind == "file":
                    self.sb.write_file(it.dest, self._read(ins, it), mode=it.mode)
        except (OSError, SandboxPathError) as e:
            raise self.error(ins.line, f"{ins.op} could not write {it.dest}: {e}",
                             "fix the destination") from e
        self._fix_up(ins, expanded)

    def _read(self, ins: Copy, it: _Item) -> bytes:
        fd = os.open(it.host, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        if it.digest and hashlib.sha256(data).hexdigest() != it.digest:
            raise self.error(ins.line, f"{it.rel} changed during the build",
                             "build again once the context stops changing")
        return data

    def _untar(self, ins: Copy, it: _Item) -> list[_Item]:
        """ADD of a local archive: extracted on the host (no absolute paths, nothing
        outside, no devices), then copied in as a directory."""
        out = Path(self.scratch, f"tar-{ins.line}-{uuid.uuid4().hex[:8]}")
        out.mkdir(parents=True)
        try:
            with tarfile.open(it.host, "r:*") as tf:
                tf.extractall(out, filter=_tar_filter)
        except (tarfile.TarError, OSError) as e:
            raise self.error(ins.line, f"ADD could not extract {it.rel}: {e}",
                             "pass a valid tar archive (or COPY it to keep it packed)") from e
        return [_Item("dir", it.dest), *_walk(str(out), it.rel, it.dest, chmod=ins.chmod,
                                              excluded=lambda _: False, descend_excluded=False,
                                              digest=False)]

    def _fix_up(self, ins: Copy, items: Sequence[_Item]) -> None:
        """What the file API does not do: empty directories, directory modes, symlinks."""
        dirs = [it for it in items if it.kind == "dir"]
        self.pending_dirs += [it.dest for it in dirs]
        self.make_dirs(ins.line)
        by_mode: dict[int, list[str]] = {}
        for it in dirs:
            if it.mode is not None and it.mode != 0o755:
                by_mode.setdefault(it.mode, []).append(it.dest)
        for mode, paths in by_mode.items():
            for part in _chunks(paths):
                self.exec(ins.line, ["chmod", f"{mode:o}", "--", *part],
                          f"chmod {mode:o} (directories)")
        links = [it for it in items if it.kind == "symlink"]
        script = 'while [ $# -gt 0 ]; do ln -sfn -- "$1" "$2" || exit 1; shift 2; done'
        for group in _chunks(links):
            args = [x for it in group for x in (it.link, it.dest)]
            self.exec(ins.line, ["/bin/sh", "-c", script, "sh", *args],
                      f"{ins.op}: {len(group)} symlink(s)")


def _chunks(seq: Sequence[T], n: int = 500) -> Iterator[Sequence[T]]:
    """`seq` in slices of `n` (command lines stay far below ARG_MAX)."""
    for i in range(0, len(seq), n):
        yield seq[i:i + n]


def _tar_filter(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
    if member.isdev():
        return None
    return tarfile.tar_filter(member, path)


def _build(df: Dockerfile, plans: Mapping[int, tuple[_Item, ...]], base: str | None,
           tmp: Path, *, limits: Limits, timeout_s: float, state_dir: str | None) -> None:
    """Apply `df` in a sandbox on `base` and leave the layer in tmp/layer."""
    cfg = SandboxConfig(image=base, limits=limits, allow_ports=(), workdir="/",
                        state_dir=state_dir)
    snap_path = tmp / "layer.snap"
    with (tmp / "build.log").open("w", encoding="utf-8") as log, Sandbox(cfg) as sb:
        b = _Builder(sb, df, log, timeout_s, tmp / "scratch")
        last = df.base_line
        for ins in df.instructions:
            last = ins.line
            if isinstance(ins, Workdir):
                b.workdir(ins)
            elif isinstance(ins, Run):
                b.run(ins)
            elif isinstance(ins, Copy):
                b.copy(ins, plans[ins.line])
        if df.workdir:
            b.pending_dirs.append(df.workdir)
        b.make_dirs(last)
        sb.snapshot(snap_path)
    shutil.rmtree(tmp / "scratch", ignore_errors=True)
    reader = ArchiveReader(snap_path)
    (tmp / "layer").mkdir()
    for key, entries in reader.layers.items():
        if len(entries) > 1:  # more than the layer's root directory
            (tmp / "layer" / key).mkdir()
            reader.extract_layer(key, tmp / "layer" / key)
    snap_path.unlink()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _cache_root(cache_dir: Path) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    real = cache_dir.resolve()
    if any(c in str(real) for c in OVERLAY_BAD_CHARS):
        raise ImageError(f"cache_dir {str(real)!r} contains ',', ':' or '\\', which overlayfs "
                         "cannot take in a layer path; choose another directory")
    if _fs_type(real) == "overlay":
        raise ImageError(f"cache_dir {str(real)!r} is on overlayfs, which cannot hold a "
                         "layer's whiteouts; choose a directory on ext4, xfs or tmpfs")
    return real


def _fs_type(path: Path) -> str:
    """The filesystem type of the mount holding `path` ("" if unknown)."""
    best, kind = "", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) < 3:
                continue
            mnt = parts[1].replace("\\040", " ")
            if (str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")) and \
                    len(mnt) >= len(best):
                best, kind = mnt, parts[2]
    return kind


def _build_locked(df: Dockerfile, plans: Mapping[int, tuple[_Item, ...]], base: str | None,
                  cache: Path, key: str, *, dockerfile: Path, context: Path, limits: Limits,
                  timeout_s: float, state_dir: str | None) -> bool:
    """Build `key` into the cache unless it is there; True when this call built it."""
    final = cache / key
    with _locked(cache / f"{key}.lock"):
        if (final / "meta.json").is_file():
            return False
        for stale in cache.glob(f".tmp-{key}-*"):  # a crashed builder's (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = cache / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        t0 = time.monotonic()
        try:
            _build(df, plans, base, tmp, limits=limits, timeout_s=timeout_s, state_dir=state_dir)
            meta = {"key": key, "builder": BUILDER_VERSION, "from": df.base,
                    "base": base or "default", "workdir": df.workdir, "env": dict(df.env),
                    "created": time.time(), "seconds": round(time.monotonic() - t0, 3),
                    "dockerfile": str(dockerfile.resolve()), "context": str(context.resolve())}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
            shutil.rmtree(final, ignore_errors=True)  # an incomplete one, without meta.json
            tmp.rename(final)
        except BaseException as e:
            failed = cache / f"{key}.failed.log"
            with contextlib.suppress(OSError):
                shutil.copyfile(tmp / "build.log", failed)
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, BuildError) and failed.exists():
                e.log = str(failed)
            raise
    return True


def build_environment(dockerfile: Path, *, context: Path, images: Mapping[str, str],
                      fallback: str | None, cache_dir: Path, timeout_s: float = 600.0,
                      limits: Limits | None = None, state_dir: str | None = None) -> Environment:
    """The environment `dockerfile` describes, built into `cache_dir` unless it is there.

    `context` is the build context COPY/ADD read from; `images`/`fallback` map FROM to a
    base (see `resolve_base`; a Dockerfile with `LABEL tidal.image="default"` gets the
    default image where `images` does not map its FROM); `timeout_s` bounds each RUN
    (wall-clock and CPU); `limits` replaces the builder sandbox's limits (`build_limits`);
    `state_dir` is the sandbox state directory. DockerfileError for what cannot be built
    (before anything runs), BuildError when a step fails."""
    t0 = time.monotonic()
    dockerfile, context = Path(dockerfile), Path(context)
    df = parse_dockerfile(dockerfile.read_text(encoding="utf-8"), str(dockerfile))
    declared = df.declares_default_image
    base = resolve_base(df.base, images, fallback, file=df.file, line=df.base_line,
                        declared_default=declared)
    ctx = _Context(context, df, Path(cache_dir))
    plans = {ins.line: ctx.plan(ins) for ins in df.instructions if isinstance(ins, Copy)}
    built = False
    layers: tuple[str, ...] = ()
    if df.builds_layer:
        cache = _cache_root(Path(cache_dir))
        key = _cache_key(df, _base_identity(base, state_dir), plans)
        built = _build_locked(df, plans, base, cache, key, dockerfile=dockerfile,
                              context=context, limits=limits or build_limits(timeout_s),
                              timeout_s=timeout_s, state_dir=state_dir)
        layers = (str(cache / key / "layer"),)
    else:
        key = _cache_key(df, _base_identity(base, state_dir, full=False), plans)
    mapped = is_mapped(df.base, images)
    return Environment(image=base, layers=layers, workdir=df.workdir, env=dict(df.env),
                       key=key, built=built, seconds=time.monotonic() - t0,
                       fallback_for=None if mapped or declared else df.base,
                       declared_for=df.base if declared and not mapped else None)


def image_environment(ref: str, *, images: Mapping[str, str], fallback: str | None,
                      file: str = "") -> Environment:
    """The environment of a task that names a prebuilt image (`docker_image`) and has
    no Dockerfile: the mapped image directory (or the default image), no layer."""
    t0 = time.monotonic()
    base = resolve_base(ref, images, fallback, file=file)
    key = hashlib.sha256(f"image\0{_base_identity(base, None, full=False)}".encode())
    return Environment(image=base, layers=(), workdir=None, env={}, key=key.hexdigest()[:32],
                       built=False, seconds=time.monotonic() - t0,
                       fallback_for=None if is_mapped(ref, images) else ref)
