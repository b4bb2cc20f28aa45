"""Resource controls for one sandbox: cgroup v1 where available, rlimits otherwise.

cgroup v1 (memory, pids, freezer, cpuacct) is what these machines have:

    memory/tidal/<box>          memory.limit_in_bytes   every command's processes
    pids/tidal/<box>/x<N>       pids.max on the parent; forks refused for command N
    freezer/tidal/<box>/x<N>    pause (the parent) and an atomic kill of command N
    cpuacct/tidal/<box>/x<N>    CPU time of command N and of what it started

A command's processes, and whatever they start, stay in its x<N> groups, so a fork
bomb, a CPU hog or a refused fork is charged to the command that caused it. Memory is
one limit for the whole sandbox (per-command memory groups would leave a dying memory
cgroup behind per command while its page cache lives).

Without cgroups (`RlimitControls`) the limits fall back to per-process rlimits
(RLIMIT_AS for memory, RLIMIT_CPU for CPU time), pause falls back to SIGSTOP/SIGCONT
of every process in the sandbox's pid namespace, and there is no process-count limit:
RLIMIT_NPROC does not apply to processes that map to the host's uid 0.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tidal.sandbox.types import Limits

CONTROLLERS = ("memory", "pids", "freezer", "cpuacct")
PARENT = "tidal"


class ExecControl(Protocol):
    """The controls of one running command."""

    def attach(self, pid: int) -> None: ...
    def cpu_s(self) -> float: ...
    def fork_failures(self) -> int: ...
    def has_procs(self) -> bool: ...
    def kill(self) -> None: ...
    def release(self) -> bool: ...


class BoxControls(Protocol):
    """The controls of one sandbox."""

    kind: str

    def new_exec(self, n: int) -> ExecControl: ...
    def counters(self) -> tuple[int, int]: ...
    def freeze(self) -> None: ...
    def thaw(self) -> None: ...
    def remove(self) -> None: ...


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: Path) -> str:
    return path.read_text()


def v1_mounts() -> dict[str, Path]:
    """Where each cgroup v1 controller is mounted (from /proc/self/mountinfo)."""
    out: dict[str, Path] = {}
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        parts, rparts = left.split(), right.split()
        if len(rparts) < 3 or rparts[0] != "cgroup":
            continue
        for opt in rparts[2].split(","):
            if opt in CONTROLLERS:
                out.setdefault(opt, Path(parts[4]))
    return out


def v1_available() -> tuple[bool, str]:
    """(True, "") when every controller we use is mounted and writable."""
    mounts = v1_mounts()
    missing = [c for c in CONTROLLERS if c not in mounts]
    if missing:
        return False, f"cgroup v1 controllers not mounted: {', '.join(missing)}"
    for c, p in mounts.items():
        if not os.access(p, os.W_OK):
            return False, f"cgroup v1 {c} hierarchy at {p} is not writable"
    return True, ""


def _procs(cg: Path) -> list[int]:
    try:
        return [int(x) for x in (cg / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _set_freezer(cg: Path, state: str, timeout_s: float = 5.0) -> None:
    _write(cg / "freezer.state", state)
    deadline = time.monotonic() + timeout_s
    while _read(cg / "freezer.state").strip() != state:
        if time.monotonic() > deadline:
            raise TimeoutError(f"cgroup freezer at {cg} did not reach {state}")
        time.sleep(0.0005)


def _rmdir(cg: Path) -> bool:
    try:
        cg.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def set_rlimits(pid: int, limits: Limits, *, fallback: bool) -> None:
    """rlimits on a process that has not yet exec'd; its children inherit them. No core
    dumps in any case; memory and CPU only as the fallback for missing cgroups."""
    resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))
    if fallback:
        cpu = max(1, round(limits.cpu_s))
        resource.prlimit(pid, resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.prlimit(pid, resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))


# --------------------------------------------------------------------------- cgroup v1


def _pids_events(cg: Path) -> int:
    try:
        return int(_read(cg / "pids.events").split()[1])
    except (OSError, ValueError, IndexError):
        return 0


@dataclass
class V1Exec:
    box: V1Box
    name: str

    @property
    def groups(self) -> tuple[Path, Path, Path]:
        d = self.box.dirs
        return d["pids"] / self.name, d["freezer"] / self.name, d["cpuacct"] / self.name

    @property
    def freezer(self) -> Path:
        return self.box.dirs["freezer"] / self.name

    def attach(self, pid: int) -> None:
        for cg in (self.box.dirs["memory"], *self.groups):
            _write(cg / "cgroup.procs", str(pid))

    def fork_failures(self) -> int:
        return _pids_events(self.box.dirs["pids"] / self.name)

    def has_procs(self) -> bool:
        return bool(_procs(self.freezer))

    def cpu_s(self) -> float:
        try:
            return int(_read(self.box.dirs["cpuacct"] / self.name / "cpuacct.usage")) / 1e9
        except (OSError, ValueError):
            return 0.0

    def kill(self) -> None:
        """Freeze, SIGKILL every process, thaw: nothing can fork its way out."""
        with contextlib.suppress(OSError, TimeoutError):
            _set_freezer(self.freezer, "FROZEN", timeout_s=1.0)
        for _ in range(100):
            pids = _procs(self.freezer)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                _write(self.freezer / "freezer.state", "THAWED")
            time.sleep(0.002)

    def release(self) -> bool:
        """Remove the command's cgroups if it left no process behind."""
        return all([_rmdir(cg) for cg in self.groups])  # noqa: C419 (try every one)


class V1Box:
    kind = "cgroup-v1"

    def __init__(self, name: str, limits: Limits | None, mounts: dict[str, Path] | None = None):
        """Create the sandbox's cgroups with `limits`, or (limits=None) take hold of
        existing ones to remove them."""
        mounts = mounts or v1_mounts()
        self.dirs = {c: mounts[c] / PARENT / name for c in CONTROLLERS}
        self._lingering: list[tuple[V1Exec, int]] = []
        self._lock = threading.Lock()
        self.incidents: list[str] = []
        if limits is None:
            return
        for c in CONTROLLERS:
            self.dirs[c].mkdir(parents=True, exist_ok=True)
        mem = self.dirs["memory"]
        _write(mem / "memory.limit_in_bytes", str(limits.memory_bytes))
        with contextlib.suppress(OSError):  # only with swap accounting
            _write(mem / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        _write(self.dirs["pids"] / "pids.max", str(limits.pids))

    def new_exec(self, n: int) -> V1Exec:
        self.sweep()
        ex = V1Exec(self, f"x{n}")
        for cg in ex.groups:
            cg.mkdir()
        return ex

    def keep(self, ex: V1Exec) -> None:
        """A command left processes behind: watch them (`sweep`), remove the command's
        cgroups once they are gone."""
        with self._lock:
            self._lingering.append((ex, ex.fork_failures()))

    @property
    def lingering(self) -> int:
        return len(self._lingering)

    def sweep(self) -> None:
        """Kill background processes that hit the process limit after their command
        ended (a fork bomb left running); drop the groups that emptied."""
        with self._lock:
            keep = []
            for ex, forks in self._lingering:
                if ex.fork_failures() > forks:
                    ex.kill()
                    self.incidents.append(
                        f"processes left running by command #{ex.name[1:]} hit the process "
                        f"limit and were killed")
                if not ex.release():
                    keep.append((ex, forks))
            self._lingering = keep

    def counters(self) -> tuple[int, int]:
        """(OOM kills, forks refused at pids.max) so far in this sandbox. Depending on the
        kernel, refused forks count where the limit is set or where the fork happened;
        commands watch both."""
        oom = pids = 0
        with contextlib.suppress(OSError, ValueError):
            for line in _read(self.dirs["memory"] / "memory.oom_control").splitlines():
                k, _, v = line.partition(" ")
                if k == "oom_kill":
                    oom = int(v)
        pids = _pids_events(self.dirs["pids"])
        return oom, pids

    def memory_usage(self) -> int:
        return int(_read(self.dirs["memory"] / "memory.usage_in_bytes"))

    def freeze(self) -> None:
        _set_freezer(self.dirs["freezer"], "FROZEN")

    def thaw(self) -> None:
        _set_freezer(self.dirs["freezer"], "THAWED")

    def remove(self) -> None:
        """Kill whatever is left and remove every cgroup of the sandbox."""
        fz = self.dirs["freezer"]
        with contextlib.suppress(OSError):
            for child in fz.iterdir():
                if child.is_dir():
                    V1Exec(self, child.name).kill()
        with contextlib.suppress(OSError):
            for pid in _procs(fz):
                os.kill(pid, signal.SIGKILL)
        for c in CONTROLLERS:
            d = self.dirs[c]
            with contextlib.suppress(OSError):
                for child in d.iterdir():
                    if child.is_dir():
                        _retry_rmdir(child)
            _retry_rmdir(d)


def _retry_rmdir(d: Path) -> None:
    for _ in range(200):
        if _rmdir(d):
            return
        time.sleep(0.005)


def remove_stale_v1(name: str) -> None:
    """Remove the cgroups of a sandbox whose owner died (see `local.collect_garbage`)."""
    mounts = v1_mounts()
    if all(c in mounts for c in CONTROLLERS) and (mounts["memory"] / PARENT / name).exists():
        V1Box(name, None, mounts).remove()


# --------------------------------------------------------------------------- fallback


def pidns_members(pidns_inode: int, exclude: set[int]) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):  # noqa: PTH208
        if not entry.isdigit() or int(entry) in exclude:
            continue
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{entry}/ns/pid").st_ino == pidns_inode:  # noqa: PTH116
                out.append(int(entry))
    return out


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):  # noqa: PTH208
                kids = Path(f"/proc/{p}/task/{task}/children").read_text().split()
                todo.extend(int(k) for k in kids)
    return out


@dataclass
class RlimitExec:
    box: RlimitControls
    session_pid: int | None = None

    def attach(self, pid: int) -> None:
        self.session_pid = pid
        set_rlimits(pid, self.box.limits, fallback=True)

    def cpu_s(self) -> float:
        return 0.0  # RLIMIT_CPU enforces per process; see the status classification

    def fork_failures(self) -> int:
        return 0

    def has_procs(self) -> bool:
        return False

    def kill(self) -> None:
        if self.session_pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.session_pid, signal.SIGKILL)  # bwrap --new-session: pgid = pid
        for pid in _descendants(self.session_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def release(self) -> bool:
        return True


class RlimitControls:
    """Fallback when cgroup v1 is unavailable: weaker, and documented as such."""

    kind = "rlimit"

    def __init__(self, limits: Limits, pidns_inode: int, init_pid: int):
        self.limits = limits
        self.pidns_inode = pidns_inode
        self.init_pid = init_pid
        self._stopped: list[int] = []

    def new_exec(self, n: int) -> RlimitExec:
        return RlimitExec(self)

    def counters(self) -> tuple[int, int]:
        return 0, 0

    def freeze(self) -> None:
        self._stopped = pidns_members(self.pidns_inode, {self.init_pid})
        for pid in self._stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self._stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self._stopped = []

    def remove(self) -> None:
        pass  # killing pid 1 (the runtime does) kills the whole pid namespace
