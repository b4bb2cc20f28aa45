"""The embedded runtime: bubblewrap + overlayfs + cgroup v1, as root on the host.

One sandbox ("box") is:

    <state>/boxes/<id>/layer        a tmpfs of `disk_bytes` holding the writable layer(s)
    <state>/boxes/<id>/mnt/<key>    overlay: config.layers' <key>/ and the image (read-only)
                                    under layer/<key>/upper
    pid 1                           a tiny static program (see _linux.init_elf) in its
                                    own user, pid, network, IPC and UTS namespaces,
                                    started by bubblewrap; it reaps orphans and dies
                                    (taking every process of the box with it) when the
                                    owning Python process closes its lifeline pipe
    cgroups                         memory, pids, freezer, cpuacct (cgroups.py)

Each command is one more bubblewrap run that joins pid 1's namespaces (--userns,
--userns2, --pidns; the calling thread enters the network, IPC and UTS namespaces for
the fork), binds the overlays at / and /usr (their lower directories: the config's
prebuilt layers, then the image), then the config's host binds read-only, mounts a
fresh /proc (with /proc/sys read-only and the sensitive files masked) and /dev, drops
every capability, sets no_new_privs, and waits on --block-fd until the host has put it
into the box's cgroups.
Output, wall-clock and CPU limits are enforced from the host, so nothing inside can
tamper with them, and no image has to contain anything but what the agent runs.

Inside, commands run as uid 0 of a user namespace that maps to the host's uid 0, with
no capabilities; they can change anything in their own layer (like root in a
container) and nothing else. Nested user namespaces are disabled.
"""
# ruff: noqa: PTH116

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tidal.sandbox import _linux, cgroups, layer
from tidal.sandbox.image import Image, resolve_image, stack_layers
from tidal.sandbox.netfwd import PortForwarder
from tidal.sandbox.paths import Resolver
from tidal.sandbox.types import (
    ExecResult,
    ExecStatus,
    FileEntry,
    ImageError,
    SandboxConfig,
    SandboxError,
    SandboxStateError,
    SandboxUnavailableError,
    truncation_marker,
)

STATE_DIR_ENV = "TIDAL_SANDBOX_DIR"
DEFAULT_STATE_DIR = "/run/tidal-sandbox"
POLL_S = 0.02
GRACE_S = 0.25  # how long processes a command left running may still write its output
WATCHDOG_S = 0.1  # how often processes left running are checked against the process limit
# /proc entries Docker also hides: kernel memory, keys, timers, scheduler internals.
PROC_MASK_FILES = ("kcore", "keys", "timer_list", "timer_stats", "sched_debug", "latency_stats")
PROC_MASK_DIRS = ("acpi", "scsi")


def state_root(config: SandboxConfig | None = None) -> Path:
    if config is not None and config.state_dir:
        return Path(config.state_dir)
    return Path(os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR)


def bwrap_path() -> str | None:
    return shutil.which("bwrap") or (
        "/usr/bin/bwrap" if Path("/usr/bin/bwrap").exists() else None)


# --------------------------------------------------------------------------- checks

_check_lock = threading.Lock()
_gc_done: set[Path] = set()


def require_available() -> str:
    """The bwrap binary, or SandboxUnavailableError saying what is missing."""
    if os.name != "posix" or not Path("/proc/self/ns/user").exists():
        raise SandboxUnavailableError("the local sandbox runtime needs Linux with user namespaces")
    if os.geteuid() != 0:
        raise SandboxUnavailableError(
            "the local sandbox runtime needs root (it mounts overlayfs and manages cgroups); "
            "run as root or use another runtime")
    bw = bwrap_path()
    if bw is None:
        raise SandboxUnavailableError(
            "bubblewrap is not installed: apt-get install bubblewrap (see .ci/sandbox-deps.sh)")
    return bw


def environment_report() -> dict[str, str]:
    """What works here, for `tidal sandbox check` and the docs."""
    from tidal.sandbox.memory import criu_status

    rep: dict[str, str] = {}
    try:
        bw = require_available()
        out = subprocess.run([bw, "--version"], capture_output=True, text=True, check=False)
        rep["bubblewrap"] = f"ok: {out.stdout.strip()} at {bw}"
    except SandboxUnavailableError as e:
        rep["bubblewrap"] = f"unavailable: {e}"
    fs = Path("/proc/filesystems").read_text() if Path("/proc/filesystems").exists() else ""
    rep["overlayfs"] = "ok" if "\toverlay\n" in fs else "missing (modprobe overlay)"
    ok, why = cgroups.v1_available()
    rep["cgroups"] = "ok: cgroup v1 memory, pids, freezer, cpuacct" if ok else (
        f"fallback to rlimits + SIGSTOP ({why}); no process-count limit")
    rep["pid1"] = "ok: static x86-64 init" if _linux.init_elf() else (
        "fallback: host /usr/bin/cat as pid 2 under bubblewrap's init")
    rep["default_python3"] = ("ok: /usr/bin/python3" if Path("/usr/bin/python3").exists()
                              else "missing: apt-get install python3")
    mem_ok, mem_why = criu_status()
    rep["memory_snapshot"] = "ok: criu" if mem_ok else f"unavailable ({mem_why}); layer + log only"
    return rep


def collect_garbage(root: Path) -> int:
    """Remove boxes whose owning process is gone (mounts, cgroups, directories). Other
    processes' boxes come and go while it looks: one that vanishes is skipped."""
    boxes = root / "boxes"
    removed = 0
    if not boxes.is_dir():
        return 0
    for d in boxes.iterdir():
        try:
            owner = json.loads((d / "owner.json").read_text())
        except (OSError, ValueError):
            try:
                if time.time() - d.stat().st_mtime < 60:
                    continue  # being created right now
            except FileNotFoundError:
                continue  # its owner closed it while we looked (another process's box)
            owner = {}
        pid, start = owner.get("pid"), owner.get("starttime")
        if pid and _linux.proc_starttime(pid) == start:
            continue
        init = owner.get("init_pid")
        if init and _linux.proc_starttime(init) == owner.get("init_starttime"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(init, signal.SIGKILL)
        cgroups.remove_stale_v1(d.name)
        _teardown_dir(d)
        removed += 1
    return removed


def _teardown_dir(d: Path) -> None:
    mnt = d / "mnt"
    if mnt.is_dir():
        for m in mnt.iterdir():
            _linux.umount(str(m))
    _linux.umount(str(d / "layer"))
    shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------- runtime


class LocalRuntime:
    """Makes `LocalBox`es. Cheap to construct; holds no resources."""

    name = "local-bwrap"

    def __init__(self) -> None:
        self.bwrap = require_available()

    def image_id(self, config: SandboxConfig) -> str:
        """The image and the layers stacked over it (a snapshot restores on the same)."""
        base = "default" if config.image is None else str(Path(config.image).resolve())
        return "+".join([base, *(str(Path(lay).resolve()) for lay in config.layers)])

    def create(self, config: SandboxConfig, layers: layer.ArchiveReader | None = None) -> LocalBox:
        root = state_root(config)
        with _check_lock:
            if root not in _gc_done:
                root.mkdir(parents=True, exist_ok=True, mode=0o700)
                collect_garbage(root)
                _gc_done.add(root)
        image = stack_layers(resolve_image(config.image, root / "images"), config.layers)
        return LocalBox(config, image, root, self.bwrap, layers)


class LocalBox:
    """One running sandbox. Thread-safe: commands may run concurrently."""

    def __init__(self, config: SandboxConfig, image: Image, root: Path, bwrap: str,
                 layers: layer.ArchiveReader | None = None):
        self.config = config
        self.image = image
        self.bwrap = bwrap
        self.id = uuid.uuid4().hex[:12]
        self.dir = root / "boxes" / self.id
        self.capabilities: dict[str, str] = {}
        self._lock = threading.Lock()
        self._exec_n = 0
        self._closed = False
        self._paused_since: float | None = None
        self._paused_total = 0.0
        self._ns_fds: list[int] = []
        self._lifeline: int | None = None
        self._holder: subprocess.Popen[bytes] | None = None
        self._fwd: PortForwarder | None = None
        self._ctl: cgroups.BoxControls | None = None
        self._watchdog: threading.Thread | None = None
        self._stop = threading.Event()
        self.init_pid = 0
        self._pidns_ino = 0
        try:
            self._start(layers)
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------- start

    def _start(self, layers: layer.ArchiveReader | None) -> None:
        for m in self.image.mounts:
            for low in m.lowers:
                if any(c in low for c in ",:\\"):
                    raise ImageError(f"image path {low!r} contains ',', ':' or '\\' "
                                     "which overlayfs cannot take")
        self.dir.mkdir(parents=True, mode=0o700)
        me = os.getpid()
        self._write_owner({"pid": me, "starttime": _linux.proc_starttime(me)})
        lay, mnt = self.dir / "layer", self.dir / "mnt"
        lay.mkdir()
        mnt.mkdir()
        _linux.mount("tidal-layer", str(lay), "tmpfs", _linux.MS_NOSUID | _linux.MS_NODEV,
                     f"size={self.config.limits.disk_bytes},mode=0700")
        (lay / "shm").mkdir(mode=0o1777)
        (lay / "shm").chmod(0o1777)
        unknown = set(layers.layers if layers is not None else ()) - {
            m.key for m in self.image.mounts}
        if unknown:
            raise SandboxError(f"snapshot has layers {sorted(unknown)} that image "
                               f"{self.image.name!r} does not: restore it on the same image")
        self.mounts: dict[str, str] = {}
        for m in self.image.mounts:
            upper, work, merged = lay / m.key / "upper", lay / m.key / "work", mnt / m.key
            upper.mkdir(parents=True)
            work.mkdir()
            merged.mkdir()
            if layers is not None:
                layers.extract_layer(m.key, upper)
            _mount_overlay(m.lowers, upper, work, merged)
            self.mounts[m.target] = str(merged)
        self.resolver = Resolver(self.mounts, self.config.workdir)
        self.resolver.ensure_dir(self.config.workdir)
        self._make_mount_points()
        self.shell = next((s for s in ("/bin/bash", "/bin/sh") if self.resolver.exists(s)), None)

        ok, why = cgroups.v1_available()
        self._start_init()
        self._pidns_ino = pidns_ino = os.stat(f"/proc/{self.init_pid}/ns/pid").st_ino
        if ok:
            self._ctl = cgroups.V1Box(self.id, self.config.limits)
            self.capabilities["limits"] = "cgroup-v1"
        else:
            self._ctl = cgroups.RlimitControls(self.config.limits, pidns_ino, self.init_pid)
            self.capabilities["limits"] = f"rlimit fallback ({why}); no process-count limit"
        if self.config.allow_ports:
            self._fwd = PortForwarder(self._net_fd, self.config.allow_ports)

    def _make_mount_points(self) -> None:
        """Create each bind's mount point in the sandbox's own files (walked safely, as
        the file API does), so bubblewrap finds it and never creates one itself."""
        for b in self.config.binds:
            is_dir = Path(b.host).is_dir()
            if not self.resolver.exists(b.target):
                if is_dir:
                    self.resolver.ensure_dir(b.target)
                else:
                    self.resolver.write(b.target, b"", 0o644, True)
            elif self.resolver.is_dir(b.target) != is_dir:
                kind = "directory" if is_dir else "file"
                raise SandboxError(f"bind {b.host!r}:{b.target!r}: the host path is a {kind} "
                                   f"but {b.target} in the image is not")

    def _write_owner(self, extra: dict[str, Any]) -> None:
        path = self.dir / "owner.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        data.update(extra)
        tmp = self.dir / "owner.json.tmp"
        tmp.write_text(json.dumps(data))
        tmp.replace(path)

    # long by design: the init process's pipes and fds, set up in the order the child reads them
    def _start_init(self) -> None:  # noqa: PLR0915
        elf = _linux.init_elf()
        life_r, self._lifeline = os.pipe()
        info_r, info_w = os.pipe()
        prog_r, prog_w = os.pipe()
        args = [
            self.bwrap, "--unshare-user", "--uid", "0", "--gid", "0", "--disable-userns",
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--cap-drop", "ALL", "--hostname", self.config.hostname,
            "--info-fd", str(info_w),
        ]
        if elf is not None:
            os.write(prog_w, elf)
            args += ["--as-pid-1", "--perms", "0111", "--file", str(prog_r), "/init", "--", "/init"]
        else:  # another architecture: the host's cat blocks on the lifeline instead
            with open("/usr/bin/cat", "rb") as f:  # noqa: PTH123
                data = f.read()
            threading.Thread(target=_write_all, args=(prog_w, data), daemon=True).start()
            prog_w = -1
            args += ["--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib",
                     "--symlink", "usr/lib64", "/lib64", "--perms", "0111", "--file",
                     str(prog_r), "/init", "--", "/init"]
        if prog_w >= 0:
            os.close(prog_w)
        try:
            self._holder = subprocess.Popen(
                args, stdin=life_r, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(info_w, prog_r), env={}, start_new_session=True)
        finally:
            for fd in (life_r, info_w, prog_r):
                os.close(fd)
        info = _read_all(info_r, timeout_s=10)
        os.close(info_r)
        assert self._holder.stdout is not None
        ready = b""
        if info:
            if elf is None:
                os.write(self._lifeline, b"\x01")  # cat echoes it once it runs
            ready = _read_all(self._holder.stdout.fileno(), timeout_s=10, n=1)
        if not info or not ready:
            err = b""
            if self._holder.stderr is not None and self._holder.poll() is not None:
                err = self._holder.stderr.read()
            raise SandboxError(
                f"sandbox init failed to start: {err.decode(errors='replace').strip()}")
        self._holder.stdout.close()
        if self._holder.stderr is not None:
            self._holder.stderr.close()
        self.init_pid = int(json.loads(info)["child-pid"])
        self._write_owner({"init_pid": self.init_pid,
                           "init_starttime": _linux.proc_starttime(self.init_pid)})
        user_b = os.open(f"/proc/{self.init_pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        self._ns_fds.append(user_b)
        user_a = _linux.ns_parent(user_b)
        os.set_inheritable(user_a, False)
        self._ns_fds.append(user_a)
        self._user_a, self._user_b = user_a, user_b
        fds = {}
        for ns in ("pid", "net", "ipc", "uts"):
            fds[ns] = os.open(f"/proc/{self.init_pid}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
            self._ns_fds.append(fds[ns])
        self._pid_fd, self._net_fd = fds["pid"], fds["net"]
        self._thread_ns = [(fds["net"], _linux.CLONE_NEWNET), (fds["ipc"], _linux.CLONE_NEWIPC),
                           (fds["uts"], _linux.CLONE_NEWUTS)]
        self._proc_masks = [f for f in PROC_MASK_FILES if Path("/proc", f).exists()]
        self._proc_mask_dirs = [d for d in PROC_MASK_DIRS if Path("/proc", d).is_dir()]

    # ----------------------------------------------------------------- exec

    def _bwrap_args(self, argv: Sequence[str], cwd: str, env: Mapping[str, str], block_fd: int,
                    info_fd: int) -> list[str]:
        # bwrap itself runs as the host's root with an empty environment: the command's
        # variables (LD_PRELOAD included) are set only for the command, inside.
        a = [self.bwrap, "--clearenv"]
        for k, v in env.items():
            a += ["--setenv", k, v]
        a += ["--userns", str(self._user_a), "--userns2", str(self._user_b),
             "--pidns", str(self._pid_fd), "--uid", "0", "--gid", "0", "--cap-drop", "ALL",
             "--bind", self.mounts["/"], "/"]
        for target, merged in self.mounts.items():
            if target != "/":
                a += ["--bind", merged, target]
        for b in self.config.binds:
            a += ["--ro-bind", b.host, b.target]
        a += ["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys"]
        for f in self._proc_masks:
            a += ["--ro-bind", "/dev/null", f"/proc/{f}"]
        for d in self._proc_mask_dirs:
            a += ["--tmpfs", f"/proc/{d}", "--remount-ro", f"/proc/{d}"]
        a += ["--dev", "/dev", "--bind", str(self.dir / "layer" / "shm"), "/dev/shm",
              "--chdir", cwd, "--new-session", "--die-with-parent",
              "--block-fd", str(block_fd), "--info-fd", str(info_fd), "--", *argv]
        return a

    def _active_time(self, since: float, paused_at_start: float) -> float:
        with self._lock:
            paused = self._paused_total - paused_at_start
            if self._paused_since is not None:
                paused += time.monotonic() - max(self._paused_since, since)
        return time.monotonic() - since - paused

    # long by design: one exec under the sandbox lock: argv, cgroup, pipes and spawn in order
    def exec(self, argv: Sequence[str], *, cwd: str, env: Mapping[str, str],  # noqa: PLR0915
             stdin: bytes | None, wall_s: float) -> ExecResult:
        with self._lock:
            if self._closed:
                raise SandboxStateError("sandbox is closed")
            if self._holder is not None and self._holder.poll() is not None:
                raise SandboxStateError(
                    f"the sandbox's pid 1 is gone (exit {self._holder.returncode}); close it")
            self._exec_n += 1
            n = self._exec_n
        assert self._ctl is not None
        lim = self.config.limits
        ctl = self._ctl.new_exec(n)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        block_r, block_w = os.pipe()
        info_r, info_w = os.pipe()
        in_r, in_w = os.pipe() if stdin else (None, None)
        child_fds = [out_w, err_w, block_r, info_w] + ([in_r] if in_r is not None else [])
        try:
            with _linux.thread_in_namespaces(self._thread_ns):
                proc = subprocess.Popen(
                    self._bwrap_args(argv, cwd, env, block_r, info_w),
                    stdin=in_r if in_r is not None else subprocess.DEVNULL,
                    stdout=out_w, stderr=err_w, env={}, start_new_session=True,
                    pass_fds=(self._user_a, self._user_b, self._pid_fd, block_r, info_w))
        except BaseException:
            for fd in [*child_fds, out_r, err_r, block_w, info_r] + ([in_w] if in_w else []):
                os.close(fd)
            raise
        for fd in child_fds:
            os.close(fd)
        monitored = False
        try:
            info = _read_all(info_r, timeout_s=10)
            os.close(info_r)
            if not info:  # bwrap failed before the command existed
                proc.wait(timeout=10)
                err = _read_all(err_r, timeout_s=1).decode(errors="replace").strip()
                raise SandboxError(f"the command could not start in the sandbox: {err}")
            child = int(json.loads(info)["child-pid"])
            try:
                ctl.attach(child)
                cgroups.set_rlimits(child, lim, fallback=isinstance(ctl, cgroups.RlimitExec))
            except ProcessLookupError:
                pass  # it died during set-up; bwrap's message is on its stderr
            except OSError as e:  # never run a command outside its limits
                raise SandboxError(f"could not apply the sandbox's limits: {e}") from e
            os.write(block_w, b"1")
            os.close(block_w)
            block_w = -1
            monitored = True
            return self._monitor(proc, ctl, out_r=out_r, err_r=err_r, in_w=in_w, stdin=stdin,
                                 wall_s=wall_s)
        finally:
            if block_w >= 0:
                os.close(block_w)
            if not monitored:
                for fd in (out_r, err_r) + ((in_w,) if in_w is not None else ()):
                    os.close(fd)
            if proc.poll() is None:
                ctl.kill()
                proc.kill()
                proc.wait()
            if not ctl.release() and isinstance(self._ctl, cgroups.V1Box):
                assert isinstance(ctl, cgroups.V1Exec)
                self._ctl.keep(ctl)
                self._start_watchdog()

    # long by design: one poll loop over a command's pipes, limits and deadline (a state machine)
    def _monitor(self, proc: subprocess.Popen[bytes], ctl: cgroups.ExecControl, *, out_r: int,  # noqa: PLR0915
                 err_r: int, in_w: int | None, stdin: bytes | None, wall_s: float) -> ExecResult:
        """Pump stdin/stdout/stderr and enforce the limits until the command ends.

        The command ends when its main process exits. Processes it left running may hold
        its output pipes: they get GRACE_S more to write (and are watched for limits, so
        a fork bomb whose first shell returns at once is still caught and reported),
        then the pipes are closed and they run on in the background."""
        lim = self.config.limits
        w = _Watch(self, ctl, wall_s)
        bufs: dict[int, bytearray] = {out_r: bytearray(), err_r: bytearray()}
        pidfd = os.pidfd_open(proc.pid)
        sel = selectors.DefaultSelector()
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        sel.register(pidfd, selectors.EVENT_READ)
        pending = memoryview(stdin or b"")
        if in_w is not None:
            os.set_blocking(in_w, False)
            sel.register(in_w, selectors.EVENT_WRITE)
        code: int | None = None
        grace_end = 0.0
        kill_at: float | None = None

        def read_into(fd: int) -> str:
            """Read what is there: "data", "empty" (would block) or "eof"."""
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                return "empty"
            if not chunk:
                sel.unregister(fd)
                return "eof"
            room = lim.output_bytes - len(bufs[fd])
            bufs[fd] += chunk[:max(room, 0)]
            if len(chunk) > room:
                w.over.add(_STREAMS[fd == err_r])
            return "data"

        try:
            while True:
                for key, _ in sel.select(POLL_S):
                    if key.fd == pidfd:
                        sel.unregister(pidfd)
                        code = proc.wait()
                        grace_end = time.monotonic() + GRACE_S
                    elif key.fd == in_w:
                        try:
                            pending = pending[os.write(in_w, pending[:1 << 16]):]
                        except BlockingIOError:
                            continue
                        except BrokenPipeError:
                            pending = pending[:0]
                        if not pending:
                            sel.unregister(in_w)
                            os.close(in_w)
                            in_w = None
                    else:
                        read_into(key.fd)
                if w.reason is None and w.check(running=code is None):
                    ctl.kill()
                    kill_at = time.monotonic()
                if code is not None:
                    # Drain what the command wrote before it exited.
                    for fd in (out_r, err_r):
                        while fd in sel.get_map() and read_into(fd) == "data":
                            pass
                    if w.reason is not None or not (sel.get_map().keys() & {out_r, err_r}):
                        break
                    if time.monotonic() > grace_end or not ctl.has_procs():
                        break
                elif kill_at is not None and time.monotonic() - kill_at > 2:
                    proc.kill()  # the bwrap monitor: its child dies with it (--die-with-parent)
                    kill_at = None
        finally:
            sel.close()
            os.close(pidfd)
            for fd in (out_r, err_r) + ((in_w,) if in_w is not None else ()):
                with contextlib.suppress(OSError):
                    os.close(fd)
        assert code is not None
        if w.reason is None and w.check(running=False, final=True, code=code):
            ctl.kill()
        if code == 1 and w.reason is None and bufs[err_r].startswith(b"bwrap: execvp "):
            # as a shell says it: 127 not found, 126 found but not executable
            code = 127 if b"No such file" in bufs[err_r] else 126
        stdout = _decode(bufs[out_r], "stdout" in w.over, lim.output_bytes)
        stderr = _decode(bufs[err_r], "stderr" in w.over, lim.output_bytes)
        status = w.reason or (ExecStatus.OK if code == 0 else ExecStatus.NONZERO_EXIT)
        return ExecResult(status=status, exit_code=code, stdout=stdout, stderr=stderr,
                          duration_s=round(w.active(), 6), truncated=bool(w.over),
                          detail=w.detail)

    def _start_watchdog(self) -> None:
        with self._lock:
            if self._watchdog is not None or self._closed:
                return
            self._watchdog = threading.Thread(target=self._watch_lingering, daemon=True,
                                              name=f"tidal-sandbox-{self.id}-watchdog")
            self._watchdog.start()

    def _watch_lingering(self) -> None:
        """Every WATCHDOG_S, check what commands left running (see V1Box.sweep)."""
        ctl = self._ctl
        assert isinstance(ctl, cgroups.V1Box)
        while not self._stop.wait(WATCHDOG_S):
            if self._paused_since is None:
                with contextlib.suppress(OSError):
                    ctl.sweep()
            with self._lock:  # keep() + _start_watchdog() may race with this: both lock
                if not ctl.lingering:
                    self._watchdog = None
                    return

    @property
    def incidents(self) -> list[str]:
        return list(getattr(self._ctl, "incidents", []))

    # ----------------------------------------------------------------- files

    def read_file(self, path: str) -> bytes:
        self._check_open()
        return self.resolver.read(path, self.config.limits.file_bytes)

    def write_file(self, path: str, data: bytes, *, mode: int | None, mkdirs: bool) -> int:
        self._check_open()
        return self.resolver.write(path, data, mode, mkdirs)

    def list(self, path: str) -> list[FileEntry]:
        self._check_open()
        return self.resolver.list(path)

    def is_dir(self, path: str) -> bool:
        return self.resolver.is_dir(path)

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxStateError("sandbox is closed")

    # ----------------------------------------------------------------- pause, layers

    def pause(self) -> None:
        assert self._ctl is not None
        with self._lock:
            if self._paused_since is not None:
                return
            self._ctl.freeze()
            self._paused_since = time.monotonic()

    def resume(self) -> None:
        assert self._ctl is not None
        with self._lock:
            if self._paused_since is None:
                return
            self._ctl.thaw()
            self._paused_total += time.monotonic() - self._paused_since
            self._paused_since = None

    @property
    def paused(self) -> bool:
        return self._paused_since is not None

    def export_layers(self, out: layer.ArchiveWriter, only: Sequence[str] | None = None) -> int:
        if only is None:
            return sum(out.add_layer(m.key, self.dir / "layer" / m.key / "upper")
                       for m in self.image.mounts)
        by_key: dict[str, list[str]] = {m.key: [] for m in self.image.mounts}
        deepest = sorted(self.image.mounts, key=lambda m: -len(m.target))
        for path in only:
            inside = next(m for m in deepest if _under(path, m.target))
            by_key[inside.key].append(path[len(inside.target):].strip("/"))
            for m in self.image.mounts:  # a mount under a kept path is kept whole
                if m.target != path and _under(m.target, path):
                    by_key[m.key].append("")
        return sum(out.add_layer(m.key, self.dir / "layer" / m.key / "upper", only=by_key[m.key],
                                 merged=Path(self.mounts[m.target]))
                   for m in self.image.mounts)

    def kill_processes(self) -> int:
        """SIGKILL every process in the box but its init, frozen between rounds so that
        nothing forks its way out; returns how many were killed."""
        assert self._ctl is not None
        killed = 0
        for _ in range(200):
            pids = cgroups.pidns_members(self._pidns_ino, {self.init_pid})
            if not pids:
                return killed
            with contextlib.suppress(OSError, TimeoutError):
                self._ctl.freeze()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError, TimeoutError):
                self._ctl.thaw()
            killed += len(pids)
            time.sleep(0.005)
        raise SandboxError("processes in the sandbox kept appearing after 200 rounds of SIGKILL")

    def memory_usage(self) -> int | None:
        if isinstance(self._ctl, cgroups.V1Box):
            return self._ctl.memory_usage()
        return None

    # ----------------------------------------------------------------- close

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            paused = self._paused_since is not None
            self._paused_since = None
            watchdog = self._watchdog
        self._stop.set()
        if watchdog is not None:
            watchdog.join(timeout=5)
        if self._fwd is not None:
            self._fwd.close()
        if paused and self._ctl is not None:
            with contextlib.suppress(OSError, TimeoutError):
                self._ctl.thaw()
        if self._lifeline is not None:
            os.close(self._lifeline)  # pid 1 exits: the kernel kills the pid namespace
            self._lifeline = None
        if self.init_pid and _linux.proc_starttime(self.init_pid) is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.init_pid, signal.SIGKILL)
        if self._holder is not None:
            try:
                self._holder.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._holder.kill()
                self._holder.wait()
            for stream in (self._holder.stdout, self._holder.stderr):
                if stream is not None:
                    stream.close()
        if self._ctl is not None:
            self._ctl.remove()
        for fd in self._ns_fds:
            os.close(fd)
        self._ns_fds = []
        if self.dir.exists():
            _teardown_dir(self.dir)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if not getattr(self, "_closed", True):
                self.close()


_STREAMS = ("stdout", "stderr")


class _Watch:
    """The limit checks of one running command (cheap: a few small cgroup files)."""

    def __init__(self, box: LocalBox, ctl: cgroups.ExecControl, wall_s: float):
        assert box._ctl is not None
        self.box, self.ctl, self.wall_s = box, ctl, wall_s
        self.t0 = time.monotonic()
        with box._lock:
            self.paused0 = box._paused_total
        self.oom0, self.pids0 = box._ctl.counters()
        self.forks0 = ctl.fork_failures()
        self.over: set[str] = set()
        self.reason: ExecStatus | None = None
        self.detail = ""

    def active(self) -> float:
        return self.box._active_time(self.t0, self.paused0)

    def check(self, *, running: bool, final: bool = False, code: int = 0) -> bool:
        """Set `reason` and return True when a limit is hit."""
        assert self.box._ctl is not None
        lim = self.box.config.limits
        if self.over:
            which = " and ".join(s for s in _STREAMS if s in self.over)
            return self._hit(ExecStatus.OUTPUT_TRUNCATED,
                             f"{which} passed the output limit ({lim.output_bytes} bytes); "
                             "command killed")
        if self.box._paused_since is not None:
            return False
        if running and self.active() > self.wall_s:
            return self._hit(ExecStatus.TIMEOUT,
                             f"killed at the wall-clock limit ({self.wall_s:g} s)")
        cpu = self.ctl.cpu_s()
        if cpu > lim.cpu_s:
            return self._hit(ExecStatus.CPU,
                             f"killed after {cpu:.2f} s of CPU time (limit {lim.cpu_s:g} s)")
        oom, pids = self.box._ctl.counters()
        if pids > self.pids0 or self.ctl.fork_failures() > self.forks0:
            return self._hit(ExecStatus.PIDS,
                             f"a fork failed at the sandbox's process limit ({lim.pids}); "
                             "tidal killed the command and everything it started")
        if oom > self.oom0 and (running or code != 0):
            return self._hit(ExecStatus.MEMORY,
                             f"the sandbox reached its memory limit ({lim.memory_bytes} bytes); "
                             "the kernel killed a process and tidal killed the command")
        if final and code == 128 + signal.SIGXCPU:
            return self._hit(ExecStatus.CPU, f"CPU-time limit ({lim.cpu_s:g} s) reached")
        return False

    def _hit(self, reason: ExecStatus, detail: str) -> bool:
        self.reason, self.detail = reason, detail
        return True


# --------------------------------------------------------------------------- helpers


def _mount_overlay(lowers: tuple[str, ...], upper: Path, work: Path, merged: Path) -> None:
    base = f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work}"
    flags = _linux.MS_NOSUID | _linux.MS_NODEV
    try:
        _linux.mount("tidal-overlay", str(merged), "overlay", flags,
                     base + ",index=off,redirect_dir=off,metacopy=off,xino=off,uuid=off")
    except OSError:
        _linux.mount("tidal-overlay", str(merged), "overlay", flags, base)


def _write_all(fd: int, data: bytes) -> None:
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        pass
    finally:
        os.close(fd)


def _read_all(fd: int, timeout_s: float, n: int | None = None) -> bytes:
    """Read until EOF, or until `n` bytes, or until the deadline."""
    out = bytearray()
    deadline = time.monotonic() + timeout_s
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    try:
        while (n is None or len(out) < n) and sel.select(max(0.0, deadline - time.monotonic())):
            chunk = os.read(fd, 4096 if n is None else n - len(out))
            if not chunk:
                break
            out += chunk
    finally:
        sel.close()
    return bytes(out)


def _decode(buf: bytearray, truncated: bool, limit: int) -> str:
    text = buf.decode("utf-8", errors="replace")
    return text + truncation_marker(limit) if truncated else text


def _under(path: str, top: str) -> bool:
    """Whether sandbox path `path` is `top` or inside it."""
    return top in ("/", path) or path.startswith(top.rstrip("/") + "/")
