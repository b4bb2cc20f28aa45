"""Base images: a directory given by the user, or the default image built here.

An `Image` is a list of mounts, each an overlay of read-only lower directories under
the sandbox's writable layer. A user's image is one mount (its directory at /). The
default image is two:

    /      a small skeleton: /etc curated from the host (world-readable, allow-listed
           files only: no shadow, no keys, no credentials), a generated passwd/group/
           hosts, empty /root, /home, /tmp, /var, and /bin, /lib, ... as the host has them
    /usr   the host's /usr, with /usr/local masked by an empty opaque layer (host-local
           installs and configuration, e.g. /usr/local/etc, stay out)

so it carries the host's Debian python3 (/usr/bin/python3) and tools, and none of the
host's private files (nothing from /root, /home, /etc/shadow, /work, ...).

Prebuilt read-only layers (`SandboxConfig.layers`, what `tidal.sandbox.build` makes from a
Dockerfile) stack over an image: `stack_layers` puts each layer's `<mount key>`
subdirectory above that mount's own lower directories.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tidal.sandbox.types import ImageError

DEFAULT_IMAGE_VERSION = 1
OPAQUE_XATTR = "trusted.overlay.opaque"

# /etc entries copied from the host, when present and world-readable. Everything else
# of the host's /etc stays out (shadow, gshadow, ssh, ssl/private, sudoers, machine-id,
# credentials of any tool, ...).
ETC_ALLOW = (
    "nsswitch.conf", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives",
    "localtime", "timezone", "os-release", "debian_version", "profile", "profile.d",
    "bash.bashrc", "inputrc", "mime.types", "protocols", "services", "rpc", "shells",
    "login.defs", "magic", "magic.mime", "locale.alias", "environment.d", "skel",
    "python3", "python3.11", "python3.12", "python3.13", "ssl/openssl.cnf", "ssl/certs",
    "ca-certificates.conf", "gai.conf", "host.conf", "ethertypes",
)
TOP_SYMLINK_CANDIDATES = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
EMPTY_DIRS = {
    "root": 0o700, "home": 0o755, "tmp": 0o1777, "var": 0o755, "var/tmp": 0o1777,
    "var/lib": 0o755, "var/cache": 0o755, "var/log": 0o755, "run": 0o755, "mnt": 0o755,
    "opt": 0o755, "srv": 0o755, "proc": 0o555, "dev": 0o755, "usr": 0o755, "etc": 0o755,
}
USR_LOCAL_DIRS = ("bin", "etc", "games", "include", "lib", "libexec", "sbin", "share", "src")

PASSWD = ("root:x:0:0:root:/root:/bin/bash\n"
          "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
GROUP = "root:x:0:\nnogroup:x:65534:\n"
HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"


@dataclass(frozen=True)
class ImageMount:
    """An overlay at `target` (inside the sandbox) of `lowers` (host directories,
    uppermost first), under a writable layer named `key`."""

    target: str
    lowers: tuple[str, ...]
    key: str


@dataclass(frozen=True)
class Image:
    name: str  # "default" or the user's directory
    mounts: tuple[ImageMount, ...]
    path: str | None = None  # the user's directory

    @property
    def root(self) -> str:
        return self.mounts[0].lowers[0]


def stack_layers(image: Image, layers: Sequence[str]) -> Image:
    """`image` with `layers` (uppermost first) over its mounts: each layer's
    subdirectory named after a mount's key becomes one more lower directory of that
    mount, above the image's own. A layer with a subdirectory for a mount the image does
    not have was built on another image: ImageError."""
    if not layers:
        return image
    keys = {m.key for m in image.mounts}
    for lay in layers:
        p = Path(lay)
        if not p.is_dir():
            raise ImageError(f"layer {lay!r} is not a directory")
        extra = sorted(c.name for c in p.iterdir() if c.is_dir() and c.name not in keys)
        if extra:
            raise ImageError(
                f"layer {lay!r} has {extra}, which image {image.name!r} does not mount "
                f"(it mounts {sorted(keys)}): use the layer over the image it was built on")
    mounts = tuple(
        replace(m, lowers=tuple(str(Path(lay, m.key)) for lay in layers
                                if Path(lay, m.key).is_dir()) + m.lowers)
        for m in image.mounts)
    return replace(image, mounts=mounts)


def default_image_identity(images_dir: Path) -> str:
    """What the default image is made of, for cache keys of layers built on it: its
    version, the digest of its skeleton, and the identity of the host's /usr under it."""
    img = default_image(images_dir)
    skeleton = Path(img.mounts[0].lowers[0]).parent.name  # default-v<N>-<digest>
    return f"{skeleton};usr={directory_identity(Path(_host_usr()))}"


def directory_identity(path: Path) -> str:
    """A cheap fingerprint of a directory used as an image: its resolved path and the
    mtime_ns of it and of each top-level entry. Adding or removing a file at the top of
    it, or in one of its top-level directories, changes it; editing a file deeper down in
    place does not (change the directory's mtime, e.g. `touch DIR`, to invalidate)."""
    real = path.resolve()
    parts = [str(real), str(real.lstat().st_mtime_ns)]
    with os.scandir(real) as it:
        for e in sorted(it, key=lambda e: e.name):
            parts.append(f"{e.name}={e.stat(follow_symlinks=False).st_mtime_ns}")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def _host_usr() -> str:
    return "/usr"


def resolve_image(image: str | os.PathLike[str] | None, images_dir: Path) -> Image:
    """The Image for a user's directory, or the default image (built on first use)."""
    if image is None:
        return default_image(images_dir)
    if not isinstance(image, str | os.PathLike):
        raise ImageError(f"image must be a directory path or None, got {type(image).__name__}")
    p = Path(image)
    if not p.exists():
        raise ImageError(f"image {str(p)!r} does not exist")
    if not p.is_dir():
        raise ImageError(f"image {str(p)!r} is not a directory")
    real = p.resolve()
    if real == Path("/"):
        raise ImageError("the host's root directory cannot be an image: it holds the host's "
                         "private files; omit the image to get the default image")
    if not os.access(real, os.R_OK | os.X_OK):
        raise ImageError(f"image {str(real)!r} is not readable")
    return Image(name=str(real), mounts=(ImageMount("/", (str(real),), "root"),), path=str(real))


_lock = threading.Lock()
_cache: dict[Path, Image] = {}


def default_image(images_dir: Path) -> Image:
    """Build (once per process) and return the default image."""
    with _lock:
        img = _cache.get(images_dir)
        if img is not None and Path(img.root).is_dir():
            return img
        img = _build_default(images_dir)
        _cache[images_dir] = img
        return img


def _world_readable(st: os.stat_result) -> bool:
    if stat.S_ISLNK(st.st_mode):
        return True
    need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(st.st_mode) else 0)
    return st.st_mode & need == need


def _copy_allowed(src: Path, dst: Path) -> None:
    """Copy src to dst keeping symlinks as symlinks, skipping anything that is not
    world-readable (private files and directories stay out)."""
    st = src.lstat()
    if not _world_readable(st):
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    if stat.S_ISLNK(st.st_mode):
        dst.symlink_to(os.readlink(src))  # noqa: PTH115
    elif stat.S_ISDIR(st.st_mode):
        dst.mkdir(exist_ok=True)
        for child in sorted(src.iterdir()):
            _copy_allowed(child, dst / child.name)
        dst.chmod(stat.S_IMODE(st.st_mode))
    elif stat.S_ISREG(st.st_mode):
        shutil.copy2(src, dst, follow_symlinks=False)


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            st = p.lstat()
            h.update(f"{p.relative_to(root)}\0{st.st_mode}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(p).encode())  # noqa: PTH115
            elif stat.S_ISREG(st.st_mode):
                h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _build_default(images_dir: Path) -> Image:
    images_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    usr = _host_usr()
    if not Path(usr, "bin").is_dir():
        raise ImageError(f"the default image needs the host's {usr}; it is missing")
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=images_dir))
    try:
        root, mask = tmp / "root", tmp / "usrmask"
        root.mkdir()
        for rel, mode in EMPTY_DIRS.items():
            (root / rel).mkdir(parents=True, exist_ok=True)
            (root / rel).chmod(mode)
        extra: list[ImageMount] = []
        for name in TOP_SYMLINK_CANDIDATES:
            host = Path("/", name)
            if host.is_symlink():
                target = os.readlink(host)  # noqa: PTH115
                if target.lstrip("/").startswith("usr/"):
                    (root / name).symlink_to(target)
            elif host.is_dir():  # a host without merged /usr
                (root / name).mkdir()
                extra.append(ImageMount(f"/{name}", (str(host),), name))
        for rel in ETC_ALLOW:
            src = Path("/etc", rel)
            if src.exists() or src.is_symlink():
                _copy_allowed(src, root / "etc" / rel)
        etc = root / "etc"
        (etc / "passwd").write_text(PASSWD)
        (etc / "group").write_text(GROUP)
        (etc / "hosts").write_text(HOSTS)
        (etc / "hostname").write_text("sandbox\n")
        (etc / "resolv.conf").write_text("# no network in tidal sandboxes\n")
        (etc / "mtab").symlink_to("../proc/self/mounts")
        for f in ("passwd", "group", "hosts", "hostname", "resolv.conf"):
            (etc / f).chmod(0o644)
        # /usr/local: an empty opaque directory hides the host's /usr/local.
        local = mask / "local"
        local.mkdir(parents=True)
        for d in USR_LOCAL_DIRS:
            (local / d).mkdir()
        os.setxattr(local, OPAQUE_XATTR, b"y")
        digest = _tree_digest(tmp)
        final = images_dir / f"default-v{DEFAULT_IMAGE_VERSION}-{digest}"
        if not final.exists():
            with contextlib.suppress(OSError):  # another process won the race: fine
                tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    mounts = (
        ImageMount("/", (str(final / "root"),), "root"),
        ImageMount("/usr", (str(final / "usrmask"), usr), "usr"),
        *extra,
    )
    return Image(name="default", mounts=mounts)
