"""The agent's `ToolRuntime` on a container engine (Docker, or podman's Docker API).

Harbor tasks are written for Docker: a Dockerfile whose RUN lines fetch packages, a
prebuilt `docker_image`. The bubblewrap sandbox (`tidal.sandbox`) builds only the subset
of Dockerfiles it can apply itself, offline; this module runs tasks as Harbor does, on a
real engine reached through the `docker` SDK:

- `connect` finds the engine (`DOCKER_HOST`, else the podman socket `.ci/podman.sh`
  starts) and checks that it answers.
- `ContainerEnvironments` builds a task's environment/Dockerfile with the engine's own
  builder, as written, into an image tagged by content hash (a cache), with FROM
  references mapped to local images; `spec_for` turns a task and its image into a
  `ContainerSpec` (image, working directory, variables, memory, CPUs, network). A
  separate verifier's own environment (Harbor's tests/Dockerfile or `[verifier.
  environment]`: `Task.separate_verifier`) is built and mapped the same way, into the
  spec its container starts from (`verifier_spec`).
- `ContainerRuntime` is one running container behind the `ToolRuntime` calls: commands
  run as engine execs with a wall-clock limit enforced from the host, files move as tar
  archives, `snapshot` commits the container to an image, `end_agent` kills what the
  agent left or moves the carried paths to a fresh container from the pristine spec
  (the verifier's, which a snapshot keeps).

Requirements and limits, said once here:
- The runtime must run on the engine's host with the right to signal its processes
  (root with rootful podman or Docker): neither API can kill an exec, so a timed-out
  command is killed by its host pid, after checking that the pid lives in the
  container's pid namespace. A runtime that cannot see the container's processes refuses
  to start (ContainerError), rather than run commands it could not stop.
- Isolation is the engine's defaults (root in the container, default capabilities,
  seccomp profile), plus the limits of the spec: memory (no swap), CPUs, process count,
  and network "none" or "bridge". `storage_mb` is not enforced: overlay storage without
  project quotas has no per-container size limit, so `spec_for` records it in the spec's
  `notes` instead of pretending. Harbor's `network_mode = "allowlist"` is refused.
- Output is read whole up to `output_bytes` per stream; a command that writes more is
  killed (status OUTPUT_TRUNCATED), as the bubblewrap sandbox does. Statuses MEMORY (the
  container's memory cgroup counted an OOM kill during the command) and TIMEOUT are
  reported; PIDS and CPU are not (a fork past the pids limit just fails, and there is no
  CPU-time limit, only the CPU share).
- A timeout kills the command's process group and every process still below it; a
  process that left both (setsid, then its parent exited: an orphan of the container's
  init) runs on until `end_agent`, which kills everything. podman closes an exec's
  output when its main process exits; Docker waits until every holder of the stream has
  closed it, so there a background job that keeps stdout open holds `exec` until the
  timeout.
- Exec output is read from the HTTP response through its buffered reader, not with the
  SDK's exec_start: the SDK reads the raw socket under the HTTP client's buffer and loses
  output that arrived with the response headers (docker/docker-py#3332; measured here:
  21 of 200 `echo` execs came back empty under CPU load).
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import hashlib
import io
import json
import math
import os
import posixpath
import re
import signal
import struct
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, Literal, TypeVar

import docker
import docker.errors
import psutil

from tidal.agent.harbor import HarborTaskError
from tidal.agent.runtime import RuntimeToolError
from tidal.agent.tasks import EnvironmentSpec, Task, TaskError
from tidal.sandbox.oplog import OpLog
from tidal.sandbox.types import (
    Bind,
    ExecResult,
    ExecStatus,
    Limits,
    check_env,
    truncation_marker,
)

PODMAN_SOCKET = "/run/tidal-podman/podman.sock"  # .ci/podman.sh's (TIDAL_PODMAN_SOCK overrides)
DEFAULT_MEMORY_MB = 2048  # Harbor's defaults for a task that names none
DEFAULT_CPUS = 1.0
DEFAULT_PIDS = 1024
MIN_MEMORY_MB = 64  # as the bubblewrap side floors a task's memory
KEEPALIVE = ("sleep", "infinity")  # the container's own command: it only keeps it running
LABEL = "tidal"  # every container this module starts carries tidal=1
OWNER = "tidal.owner"  # and the process that started it: "<host>:<pid>:<start time>"
VERIFIER_LABEL = "tidal.verifier"  # a separate verifier's spec: what its verdict says
SNAPSHOT_OF = "tidal.snapshot"  # a snapshot image's file (absolute path)
SNAPSHOT_REPO = "tidal-snapshot"
SNAPSHOT_FORMAT = "tidal.container-snapshot/1"
ENV_REPO = "tidal-env"
KILL_GRACE_S = 5.0  # after a kill, how long the command's output stream may take to close
INTERNAL_TIMEOUT_S = 120.0  # the runtime's own commands (mkdir, rm, list)
_DIR_BIT = 1 << 31  # Go's os.ModeDir and os.ModeSymlink, as the archive stat header says
_LINK_BIT = 1 << 27
_STAT_HEADER = "X-Docker-Container-Path-Stat"
_NETWORKS = ("none", "bridge")
T = TypeVar("T")
# what a logged operation's refusal is kept as, and raised as again when it is replayed
_LOGGED_ERRORS: dict[str, type[Exception]] = {"FileNotFoundError": FileNotFoundError,
                                              "RuntimeToolError": RuntimeToolError}
_HOSTNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,62}$")

# `list`: names NUL-separated, directories (not links to them) suffixed "/"; exit 2 when
# the path does not exist, 3 when it is not a directory. POSIX sh only, so any image works.
_LIST_SH = r"""[ -e "$1" ] || exit 2
[ -d "$1" ] || exit 3
cd -- "$1" || exit 4
for f in * .[!.]* ..?*; do
  if [ -L "$f" ] || [ -e "$f" ]; then
    if [ -d "$f" ] && [ ! -L "$f" ]; then printf '%s/\0' "$f"; else printf '%s\0' "$f"; fi
  fi
done
"""


class ContainerError(TaskError):
    """The container engine refused or failed something: names what and why."""


# --------------------------------------------------------------------------- the engine


def connect(url: str | None = None) -> docker.DockerClient:
    """A client of the engine at `url`, else `$DOCKER_HOST`, else the podman socket that
    `.ci/podman.sh` starts (`$TIDAL_PODMAN_SOCK` or /run/tidal-podman/podman.sock) when
    it exists. Pinged before it is returned: ContainerError says that no engine answers
    and how to start one."""
    sock = os.environ.get("TIDAL_PODMAN_SOCK", PODMAN_SOCKET)
    url = url or os.environ.get("DOCKER_HOST") or (
        f"unix://{sock}" if Path(sock).exists() else None)
    how = ("start one: `.ci/podman.sh` (as root: podman serving the Docker API on "
           f"{sock}) or a Docker daemon, or set DOCKER_HOST")
    if url is None:
        raise ContainerError(f"no container engine: DOCKER_HOST is unset and {sock} does not "
                             f"exist; {how}")
    try:
        client = docker.DockerClient(base_url=url)
        client.ping()
    except (docker.errors.DockerException, OSError) as e:
        raise ContainerError(f"the container engine at {url} does not answer ({e}); "
                             f"{how}") from None
    return client


def _owner() -> str:
    me = psutil.Process()
    return f"{os.uname().nodename}:{me.pid}:{me.create_time():.2f}"


def owner_alive(owner: str) -> bool:
    """Whether the process an OWNER label names still runs (a label of another host, or
    one that does not parse, counts as alive: it is not this host's to judge)."""
    host, _, rest = owner.partition(":")
    pid, _, started = rest.partition(":")
    if host != os.uname().nodename or not pid.isdigit():
        return True
    try:
        return f"{psutil.Process(int(pid)).create_time():.2f}" == started
    except psutil.Error:
        return False


def reap_orphans(client: docker.DockerClient) -> int:
    """Remove what a process of this host made and did not outlive (a SIGKILLed `tidal
    run` cannot clean up after itself): its containers, and its snapshot images that no
    snapshot file names (one committed as the process died, before its file was written;
    an image a file still names is kept for the run's resume, which discards it). Returns
    how many. Called whenever `ContainerRuntimes` are made, so a killed run's leftovers
    go when the next run starts."""
    n = 0
    for c in client.api.containers(all=True, filters={"label": [f"{LABEL}=1"]}):
        owner = (c.get("Labels") or {}).get(OWNER)
        if owner is not None and not owner_alive(str(owner)):
            with contextlib.suppress(docker.errors.NotFound):
                client.api.remove_container(c["Id"], force=True)
                n += 1
    for image in _snapshot_images(client):
        labels = image.get("Labels") or {}
        owner, path = labels.get(OWNER), labels.get(SNAPSHOT_OF)
        if owner is None or path is None or owner_alive(str(owner)):
            continue
        with contextlib.suppress(ContainerError):
            if read_snapshot(Path(str(path)))["image_id"] == image["Id"]:
                continue
        with contextlib.suppress(docker.errors.APIError):
            client.api.remove_image(image["Id"], force=False)
            n += 1
    return n


def is_podman(client: docker.DockerClient) -> bool:
    """Whether the engine is podman's Docker-compatible service: its builds take other
    network options (a Docker `network_mode="none"` is ignored there)."""
    components = client.version().get("Components") or []
    return any(c.get("Name") == "Podman Engine" for c in components)


def _engine_url(client: docker.DockerClient, path: str) -> str:
    """A full Engine API URL, for the calls the SDK has no method for."""
    return f"{client.api.base_url}/v{client.api.api_version}{path}"


def _why(e: docker.errors.APIError) -> str:
    return str(e.explanation or e)


# --------------------------------------------------------------------------- the spec


@dataclass(frozen=True)
class ContainerSpec:
    """What one container is made of. `image`: an engine reference or id. `binds`:
    (host path, container path) pairs, mounted read-only. `network`: "none" (loopback
    only) or "bridge" (the engine's default network, with the internet when the host has
    it). `notes`: what was asked for and is not enforced (see `spec_for`)."""

    image: str
    workdir: str = "/app"
    env: Mapping[str, str] = field(default_factory=dict)
    memory_mb: int = DEFAULT_MEMORY_MB
    cpus: float = DEFAULT_CPUS
    pids: int = DEFAULT_PIDS
    network: str = "none"
    binds: tuple[tuple[str, str], ...] = ()
    hostname: str = "tidal"
    labels: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.image, str) or not self.image.strip():
            raise ContainerError(f"ContainerSpec.image must name an image, got {self.image!r}")
        if not isinstance(self.workdir, str) or not self.workdir.startswith("/"):
            raise ContainerError(f"ContainerSpec.workdir must be absolute, got {self.workdir!r}")
        try:
            object.__setattr__(self, "env", check_env(self.env))
        except ValueError as e:
            raise ContainerError(f"ContainerSpec.{e}") from None
        if isinstance(self.memory_mb, bool) or not isinstance(self.memory_mb, int) \
                or self.memory_mb < 16:
            raise ContainerError(f"ContainerSpec.memory_mb must be an integer >= 16, "
                                 f"got {self.memory_mb!r}")
        if isinstance(self.cpus, bool) or not isinstance(self.cpus, int | float) \
                or not math.isfinite(self.cpus) or self.cpus < 0.01:
            raise ContainerError(f"ContainerSpec.cpus must be a number >= 0.01, got {self.cpus!r}")
        if isinstance(self.pids, bool) or not isinstance(self.pids, int) or self.pids < 8:
            raise ContainerError(f"ContainerSpec.pids must be an integer >= 8, got {self.pids!r}")
        if self.network not in _NETWORKS:
            raise ContainerError(f"ContainerSpec.network must be one of {_NETWORKS}, "
                                 f"got {self.network!r}")
        binds = tuple((os.fspath(h), os.fspath(c)) for h, c in self.binds)
        for host, ctr in binds:
            if not host.startswith("/") or not Path(host).exists():
                raise ContainerError(f"bind {host}:{ctr}: the host path must be absolute and "
                                     "exist")
            if not ctr.startswith("/") or posixpath.normpath(ctr) in ("/", "//"):
                raise ContainerError(f"bind {host}:{ctr}: the container path must be absolute "
                                     "and not /")
        object.__setattr__(self, "binds", binds)
        if not _HOSTNAME.match(self.hostname):
            raise ContainerError(f"ContainerSpec.hostname must be letters, digits and dashes, "
                                 f"got {self.hostname!r}")
        object.__setattr__(self, "labels", {str(k): str(v) for k, v in self.labels.items()})
        object.__setattr__(self, "notes", tuple(self.notes))

    def to_dict(self) -> dict[str, object]:
        return {"image": self.image, "workdir": self.workdir, "env": dict(self.env),
                "memory_mb": self.memory_mb, "cpus": self.cpus, "pids": self.pids,
                "network": self.network, "binds": [list(b) for b in self.binds],
                "hostname": self.hostname, "labels": dict(self.labels),
                "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> ContainerSpec:
        """The spec `to_dict` wrote; ContainerError names a missing or mistyped field."""
        try:
            return cls(
                image=str(d["image"]), workdir=str(d["workdir"]),
                env=_str_map(d.get("env", {})), memory_mb=_int(d["memory_mb"]),
                cpus=_float(d["cpus"]), pids=_int(d["pids"]), network=str(d["network"]),
                binds=tuple((str(h), str(c)) for h, c in _pairs(d.get("binds", []))),
                hostname=str(d.get("hostname", "tidal")), labels=_str_map(d.get("labels", {})),
                notes=tuple(str(n) for n in _items(d.get("notes", []))))
        except (KeyError, TypeError, ValueError) as e:
            raise ContainerError(f"not a container spec ({type(e).__name__}: {e})") from None


def _str_map(v: object) -> dict[str, str]:
    if not isinstance(v, dict):
        raise TypeError(f"expected an object, got {v!r}")
    return {str(k): str(x) for k, x in v.items()}


def _items(v: object) -> list[object]:
    if not isinstance(v, list):
        raise TypeError(f"expected a list, got {v!r}")
    return v


def _pairs(v: object) -> list[tuple[object, object]]:
    out = []
    for p in _items(v):
        if not isinstance(p, list) or len(p) != 2:
            raise TypeError(f"expected [host, container], got {p!r}")
        out.append((p[0], p[1]))
    return out


def _int(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an integer, got {v!r}")
    return v


def _float(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError(f"expected a number, got {v!r}")
    return float(v)


def spec_for(task: Task, image: str, client: docker.DockerClient,
             environment: EnvironmentSpec | None = None) -> ContainerSpec:
    """The container of one episode of `task` on `image` (its built or mapped image), or
    with `environment`, of that environment instead of the task's (its verifier's own).

    Working directory: the task's `[environment] workdir`, else the image's WORKDIR,
    else /app. Variables: the image's ENV, then the task's. Memory and CPUs: the task's,
    else Harbor's defaults (2048 MB, 1 CPU); CPUs are capped at this host's count (the
    engine's host: see the module docstring), memory floored at 64 MB. Network:
    "no-network" is "none", "public" is "bridge"; "allowlist" is refused. `storage_mb`
    is noted in `notes`, not enforced."""
    who = f"task {task.task_id!r}"
    if environment is not None:
        who += " (its verifier's environment)"
    env = environment or task.environment or EnvironmentSpec()
    if env.network_mode == "allowlist":
        raise ContainerError(f"{who}: network_mode = \"allowlist\" is not supported by the "
                             "container runtime yet")
    if env.network_mode not in ("no-network", "public"):
        raise ContainerError(f"{who}: unknown network_mode {env.network_mode!r}")
    try:
        config = client.images.get(image).attrs.get("Config") or {}
    except docker.errors.ImageNotFound:
        raise ContainerError(f"{who}: the engine has no image {image!r}") from None
    image_env = dict(e.split("=", 1) for e in config.get("Env") or [] if "=" in e)
    notes = []
    cpus = env.cpus or DEFAULT_CPUS
    host_cpus = os.cpu_count() or 1
    if cpus > host_cpus:
        notes.append(f"cpus = {cpus:g} capped at the engine host's {host_cpus}")
        cpus = float(host_cpus)
    if env.storage_mb:
        notes.append(f"storage_mb = {env.storage_mb} is not enforced: the engine's overlay "
                     "storage has no per-container quota")
    return ContainerSpec(
        image=image, workdir=env.workdir or config.get("WorkingDir") or "/app",
        env={**image_env, **env.env},
        memory_mb=max(env.memory_mb or DEFAULT_MEMORY_MB, MIN_MEMORY_MB), cpus=cpus,
        network="none" if env.network_mode == "no-network" else "bridge",
        notes=tuple(notes))


# --------------------------------------------------------------------------- host side


class _HostView:
    """The container as seen from the engine's host: its init's pid namespace (the test
    that a pid is the container's before it is signalled), the keepalive, and the
    memory cgroup's OOM-kill counter."""

    def __init__(self, init_pid: int, container_id: str) -> None:
        self.init_pid = init_pid
        try:
            self.pidns = str(Path(f"/proc/{init_pid}/ns/pid").readlink())
        except OSError as e:
            raise ContainerError(
                f"container {container_id[:12]}: its processes are not visible from this host "
                f"({e}): the container runtime must run on the engine's host, as root, to "
                "enforce exec timeouts") from None
        self.keepalive = self._keepalive(container_id)
        self.oom_file, self.oom_key = self._oom_counter()

    def _keepalive(self, container_id: str) -> int:
        """The host pid of the container's keepalive command (init's first child)."""
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                kids = psutil.Process(self.init_pid).children()
                if kids:
                    return int(min(kids, key=lambda p: p.create_time()).pid)
            time.sleep(0.01)
        raise ContainerError(f"container {container_id[:12]}: its init started no keepalive "
                             f"command ({' '.join(KEEPALIVE)}) within 5 s")

    def _oom_counter(self) -> tuple[Path | None, str]:
        """cgroup v1 memory.oom_control, else v2 memory.events (both count `oom_kill`)."""
        try:
            lines = Path(f"/proc/{self.init_pid}/cgroup").read_text().splitlines()
        except OSError:
            return None, ""
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                f = Path(f"/sys/fs/cgroup/memory{path}/memory.oom_control")
                return (f, "oom_kill") if f.exists() else (None, "")
        for line in lines:
            if line.startswith("0::"):
                f = Path(f"/sys/fs/cgroup{line[3:]}/memory.events")
                return (f, "oom_kill") if f.exists() else (None, "")
        return None, ""

    def oom_kills(self) -> int | None:
        """How many processes the kernel has OOM-killed in the container; None when this
        host cannot tell."""
        if self.oom_file is None:
            return None
        try:
            for line in self.oom_file.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == self.oom_key:
                    return int(value)
        except (OSError, ValueError):
            return None
        return None

    def owns(self, pid: int) -> bool:
        try:
            return str(Path(f"/proc/{pid}/ns/pid").readlink()) == self.pidns
        except OSError:
            return False

    def processes(self) -> list[int]:
        """Every live process in the container but its init and keepalive."""
        out = []
        for p in psutil.process_iter():
            if p.pid in (self.init_pid, self.keepalive) or not self.owns(p.pid):
                continue
            with contextlib.suppress(psutil.Error):
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(int(p.pid))
        return out

    def kill_tree(self, pid: int) -> None:
        """SIGKILL an exec's process group and every descendant still in the container
        (what left the group with setsid but is still its child)."""
        if not self.owns(pid):
            return
        try:
            kids = [int(k.pid) for k in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            kids = []
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        for k in kids:
            if self.owns(k):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(k, signal.SIGKILL)


# --------------------------------------------------------------------------- execs


class _Reader(threading.Thread):
    """Reads one exec's multiplexed output stream (8-byte frame headers: stream, size)
    through the HTTP response, keeping up to `limit` bytes a stream."""

    def __init__(self, raw: IO[bytes], limit: int, wake: threading.Event) -> None:
        super().__init__(daemon=True, name="tidal-container-exec")
        self.raw, self.limit, self.wake = raw, limit, wake
        self.bufs = {1: bytearray(), 2: bytearray()}
        self.over: set[str] = set()
        self.error: str | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            while True:
                head = self.raw.read(8)
                if len(head) < 8:
                    return
                kind, size = struct.unpack(">BxxxL", head)
                while size > 0:
                    chunk = self.raw.read(min(size, 1 << 16))
                    if not chunk:
                        return
                    size -= len(chunk)
                    if kind in self.bufs:
                        buf = self.bufs[kind]
                        room = max(self.limit - len(buf), 0)
                        buf += chunk[:room]
                        if len(chunk) > room:
                            self.over.add("stdout" if kind == 1 else "stderr")
                            self.wake.set()
        except Exception as e:  # a thread boundary: the caller reports it
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.done.set()
            self.wake.set()


@dataclass(frozen=True)
class _Ran:
    status: ExecStatus
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float
    truncated: bool
    detail: str


# --------------------------------------------------------------------------- the runtime


class ContainerRuntime:
    """`tidal.agent.runtime.ToolRuntime` over one running container (see the module
    docstring). `spec` is what runs now; `pristine` is what `end_agent` starts a fresh
    container from (the spec itself, unless this runtime was restored from a snapshot).
    `output_bytes` caps each stream of a command; `file_bytes` the files `read_file`
    returns (the bubblewrap sandbox's defaults)."""

    def __init__(self, spec: ContainerSpec, client: docker.DockerClient, *,
                 pristine: ContainerSpec | None = None,
                 output_bytes: int = Limits().output_bytes,
                 file_bytes: int = Limits().file_bytes) -> None:
        if output_bytes < 1 or file_bytes < 1:
            raise ContainerError("output_bytes and file_bytes must be >= 1")
        self.client = client
        self.spec = spec
        self.pristine = pristine or spec
        self.output_bytes = output_bytes
        self.file_bytes = file_bytes
        self.can_snapshot = True  # until the agent has ended
        self._lock = threading.Lock()
        self._closed = False
        self._oplog = OpLog()  # every operation with its result (replayed after a restore)
        self._ops = threading.Condition()  # operations share it; a snapshot excludes them
        self._active = 0
        self._exclusive = False
        self.container_id, self._host = self._start(spec)

    # ------------------------------------------------------------ lifecycle

    def _start(self, spec: ContainerSpec) -> tuple[str, _HostView]:
        """Create and start a container from `spec` (removed again if it fails)."""
        try:
            ct = self.client.containers.create(
                spec.image, entrypoint=[KEEPALIVE[0]], command=list(KEEPALIVE[1:]),
                init=True,  # reaps orphans; without it zombies fill the pids limit
                working_dir=spec.workdir, environment=dict(spec.env),
                mem_limit=f"{spec.memory_mb}m", memswap_limit=f"{spec.memory_mb}m",
                nano_cpus=round(spec.cpus * 1e9), pids_limit=spec.pids,
                network_mode=spec.network,  # never network_disabled: podman ignores it
                hostname=spec.hostname, labels={**spec.labels, LABEL: "1", OWNER: _owner()},
                volumes={h: {"bind": c, "mode": "ro"} for h, c in spec.binds})
        except docker.errors.ImageNotFound:
            raise ContainerError(f"the engine has no image {spec.image!r}") from None
        except docker.errors.APIError as e:
            raise ContainerError(f"the engine refused a container from {spec.image!r}: "
                                 f"{_why(e)}") from None
        try:
            ct.start()
            ct.reload()
            pid = int(ct.attrs["State"]["Pid"])
            if pid <= 0:
                raise ContainerError(f"container {ct.id[:12]} from {spec.image!r} is not "
                                     f"running: {ct.attrs['State'].get('Status')}")
            return ct.id, _HostView(pid, ct.id)
        except docker.errors.APIError as e:
            self._remove(ct.id)
            raise ContainerError(f"the engine could not start a container from "
                                 f"{spec.image!r}: {_why(e)}") from None
        except BaseException:
            self._remove(ct.id)
            raise

    def _remove(self, container_id: str) -> None:
        with contextlib.suppress(docker.errors.NotFound):
            self.client.api.remove_container(container_id, force=True)

    def close(self) -> None:
        """Force-remove the container (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._remove(self.container_id)

    def _check_open(self) -> None:
        if self._closed:
            raise ContainerError("the container runtime is closed")

    # ------------------------------------------------------------ commands

    def _run(self, argv: Sequence[str], timeout_s: float, *,
             env: Mapping[str, str] | None = None, user: str = "",
             limit: int | None = None, workdir: str | None = None) -> _Ran:
        """Run `argv` as an exec in `workdir` (the spec's by default), killed at
        `timeout_s` or when a stream passes `limit` bytes."""
        self._check_open()
        limit = limit or self.output_bytes
        api = self.client.api
        t0 = time.perf_counter()
        try:
            eid = api.exec_create(self.container_id, list(argv), stdout=True, stderr=True,
                                  environment=dict(env or {}),
                                  workdir=workdir or self.spec.workdir,
                                  user=user)["Id"]
            oom0 = self._host.oom_kills()
            res = api.post(_engine_url(self.client, f"/exec/{eid}/start"),
                           json={"Detach": False, "Tty": False}, stream=True, timeout=None)
        except docker.errors.APIError as e:
            raise ContainerError(f"container {self.container_id[:12]} refused a command: "
                                 f"{_why(e)}") from None
        except OSError as e:  # requests' errors: the engine went away
            raise ContainerError(f"container {self.container_id[:12]}: the engine did not "
                                 f"answer a command ({e})") from None
        if res.status_code >= 400:
            raise ContainerError(f"container {self.container_id[:12]} refused a command: "
                                 f"{res.status_code} {res.text.strip()}")
        wake = threading.Event()
        reader = _Reader(res.raw, limit, wake)
        reader.start()
        wake.wait(timeout_s)
        reason: ExecStatus | None = None
        detail = ""
        if not reader.done.is_set():
            if reader.over:
                reason = ExecStatus.OUTPUT_TRUNCATED
                detail = (f"{' and '.join(sorted(reader.over))} passed the output limit "
                          f"({limit} bytes); command killed")
            else:
                reason = ExecStatus.TIMEOUT
                detail = f"killed at the wall-clock limit ({timeout_s:g} s)"
            self._kill_exec(eid, reader.done)
            if not reader.done.wait(KILL_GRACE_S):
                res.close()
                detail += ("; its output stream stayed open after the kill (a process that "
                           "left its process group holds it)")
        res.close()
        code = self._exit_code(eid)
        over = bool(reader.over)
        if reason is None and over:
            reason = ExecStatus.OUTPUT_TRUNCATED
            detail = f"{' and '.join(sorted(reader.over))} passed the output limit ({limit} bytes)"
        oom1 = self._host.oom_kills()
        if reason is None and code != 0 and oom0 is not None and oom1 is not None \
                and oom1 > oom0:
            reason = ExecStatus.MEMORY
            detail = (f"the container reached its memory limit ({self.spec.memory_mb} MB); "
                      "the kernel killed a process")
        if reader.error is not None:
            why = f"reading its output failed: {reader.error}"
            detail = f"{detail}; {why}" if detail else why
        status = reason or (ExecStatus.OK if code == 0 else ExecStatus.NONZERO_EXIT)
        out, err = (_decode(reader.bufs[k], name in reader.over, limit)
                    for k, name in ((1, "stdout"), (2, "stderr")))
        return _Ran(status, code, out, err, time.perf_counter() - t0, over, detail)

    def _exit_code(self, eid: str) -> int:
        """The exec's exit code (137 when it never says: killed). The engine may mark
        the exec ended a moment after its stream closed, so a running one is asked again."""
        deadline = time.monotonic() + 2.0
        while True:
            try:
                info = self.client.api.exec_inspect(eid)
            except docker.errors.APIError as e:
                raise ContainerError(f"container {self.container_id[:12]}: the engine lost "
                                     f"track of a command: {_why(e)}") from None
            code = info.get("ExitCode")
            if not info.get("Running") and code is not None:
                return int(code)
            if time.monotonic() > deadline:
                return 137
            time.sleep(0.01)

    def _kill_exec(self, eid: str, done: threading.Event) -> None:
        """Kill a running exec by its host pid. An exec whose stream is open but that
        shows no pid yet (just starting) is asked again, for up to 2 s."""
        deadline = time.monotonic() + 2.0
        while not done.is_set() and time.monotonic() < deadline:
            info = self.client.api.exec_inspect(eid)
            pid = int(info.get("Pid") or 0)
            if info.get("Running") and pid > 0:
                self._host.kill_tree(pid)
                return
            time.sleep(0.01)

    def _exec(self, command: str, timeout_s: float, *,
              env: Mapping[str, str] | None = None) -> ExecResult:
        if not isinstance(command, str) or not command.strip():
            raise RuntimeToolError("command must be a non-empty string")
        if not isinstance(timeout_s, int | float) or not math.isfinite(timeout_s) \
                or timeout_s <= 0:
            raise RuntimeToolError(f"timeout_s must be > 0, got {timeout_s}")
        try:
            variables = check_env(env)
        except ValueError as e:
            raise RuntimeToolError(str(e)) from None
        r = self._run(["/bin/sh", "-c", command], timeout_s, env=variables)
        return ExecResult(r.status, 124 if r.status is ExecStatus.TIMEOUT else r.exit_code,
                          r.stdout, r.stderr + (f"\n[{r.detail}]" if r.detail else ""),
                          round(r.duration_s, 6), truncated=r.truncated, detail=r.detail)

    def _root(self, argv: Sequence[str], what: str) -> _Ran:
        """One of the runtime's own commands, as root, from / (the working directory may
        be gone); RuntimeToolError when a limit stops it."""
        r = self._run(argv, INTERNAL_TIMEOUT_S, user="0", limit=16 << 20, workdir="/")
        if r.status is not ExecStatus.OK and r.status is not ExecStatus.NONZERO_EXIT:
            raise RuntimeToolError(f"{what}: {r.status.value} ({r.detail})")
        return r

    # ------------------------------------------------------------ files

    def _abs(self, path: str) -> str:
        if not isinstance(path, str) or not path.strip():
            raise RuntimeToolError(f"path must be a non-empty string, got {path!r}")
        if "\x00" in path:
            raise RuntimeToolError("path must not contain NUL bytes")
        p = posixpath.normpath(posixpath.join(self.spec.workdir, path))
        return "/" + p.lstrip("/")

    def _stat(self, path: str) -> dict[str, object] | None:
        """The engine's stat of `path` (HEAD /containers/{id}/archive); None if missing."""
        self._check_open()
        res = self.client.api.head(
            _engine_url(self.client, f"/containers/{self.container_id}/archive"),
            params={"path": path}, timeout=self.client.api.timeout)
        if res.status_code == 404:
            return None
        header = res.headers.get(_STAT_HEADER)
        if res.status_code >= 400 or header is None:
            raise RuntimeToolError(f"cannot look at {path}: the engine answered "
                                   f"{res.status_code} {res.reason}")
        stat = json.loads(base64.b64decode(header))
        if not isinstance(stat, dict):
            raise ContainerError(f"the engine's stat of {path} is not an object: {stat!r}")
        return stat

    def _resolve(self, path: str) -> tuple[dict[str, object] | None, str]:
        """(stat, path) of what `path` names, symlinks followed (8 at most: both engines
        give a link's fully resolved target as `linkTarget`); the stat is None when it
        does not exist (a dangling link included)."""
        for _ in range(8):
            stat = self._stat(path)
            if stat is None:
                return None, path
            target = str(stat.get("linkTarget") or "")
            if not _int(stat.get("mode", 0)) & _LINK_BIT or not target or target == path:
                return stat, path
            path = posixpath.normpath(posixpath.join(posixpath.dirname(path), target))
        raise RuntimeToolError(f"{path}: too many levels of symbolic links")

    @staticmethod
    def _is_dir(stat: Mapping[str, object]) -> bool:
        if "isDir" in stat:
            return bool(stat["isDir"])
        return bool(_int(stat.get("mode", 0)) & _DIR_BIT)

    def _read_file(self, path: str) -> str:
        p = self._abs(path)
        stat, real = self._resolve(p)
        if stat is None:
            raise FileNotFoundError(f"no such file: {path}")
        if self._is_dir(stat):
            raise RuntimeToolError(f"{path!r} is a directory, not a file")
        if _int(stat.get("size", 0)) > self.file_bytes:
            raise RuntimeToolError(f"{path!r} is larger than {self.file_bytes} bytes")
        try:
            stream, _ = self.client.api.get_archive(self.container_id, real)
            data = bytearray()
            for chunk in stream:
                data += chunk
                if len(data) > self.file_bytes + (1 << 20):
                    raise RuntimeToolError(f"{path!r} is larger than {self.file_bytes} bytes")
        except docker.errors.NotFound:
            raise FileNotFoundError(f"no such file: {path}") from None
        except docker.errors.APIError as e:
            raise RuntimeToolError(f"cannot read {path!r}: {_why(e)}") from None
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            member = tar.next()
            f = tar.extractfile(member) if member is not None and member.isfile() else None
            if f is None:
                raise RuntimeToolError(f"{path!r} is not a regular file")
            return f.read().decode("utf-8", errors="replace")

    def _put(self, directory: str, archive: IO[bytes]) -> None:
        """Extract a tar into `directory`, created when missing (podman creates it
        itself; Docker answers 404, so it is made first there)."""
        self._check_open()
        try:
            try:
                self.client.api.put_archive(self.container_id, directory, archive)
            except docker.errors.NotFound:
                r = self._root(["mkdir", "-p", "--", directory], f"cannot create {directory}")
                if r.exit_code != 0:
                    raise RuntimeToolError(f"cannot create {directory}: "
                                           f"{r.stderr.strip()}") from None
                archive.seek(0)
                self.client.api.put_archive(self.container_id, directory, archive)
        except docker.errors.APIError as e:
            raise RuntimeToolError(f"cannot write into {directory}: {_why(e)}") from None

    def _write_file(self, path: str, text: str) -> None:
        if not isinstance(text, str):
            raise RuntimeToolError(f"file content must be a string, got {type(text).__name__}")
        p = self._abs(path)
        if p == "/":
            raise RuntimeToolError(f"{path!r} is a directory, not a file")
        stat, real = self._resolve(p)
        if stat is not None and self._is_dir(stat):
            # a file member would replace the whole directory: engines extract that way
            raise RuntimeToolError(f"{path!r} is a directory, not a file")
        mode = _int(stat.get("mode", 0o644)) & 0o7777 if stat is not None else 0o644
        target = real if stat is not None else p
        data = text.encode("utf-8")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.addfile(_member(posixpath.basename(target), len(data), mode), io.BytesIO(data))
        buf.seek(0)
        self._put(posixpath.dirname(target), buf)

    def _list(self, path: str) -> builtins.list[str]:
        p = self._abs(path)
        r = self._root(["/bin/sh", "-c", _LIST_SH, "sh", p], f"cannot list {path!r}")
        if r.exit_code == 2:
            raise FileNotFoundError(f"no such directory: {path}")
        if r.exit_code == 3:
            raise RuntimeToolError(f"{path!r} is a file, not a directory")
        if r.exit_code != 0 or r.truncated:
            raise RuntimeToolError(f"cannot list {path!r}: {r.stderr.strip() or r.detail}")
        return sorted(n for n in r.stdout.split("\0") if n)

    def _upload(self, src: Path, dest: str) -> None:
        src = Path(src)
        p = self._abs(dest)
        with tempfile.TemporaryFile() as archive:
            if src.is_file():
                stat, real = self._resolve(p)
                if stat is not None and self._is_dir(stat):
                    raise RuntimeToolError(f"cannot upload {src} to {dest!r}: a directory")
                with tarfile.open(fileobj=archive, mode="w") as tar, src.open("rb") as f:
                    st = src.stat()
                    tar.addfile(_member(posixpath.basename(real), st.st_size,
                                        st.st_mode & 0o7777, st.st_mtime), f)
                archive.seek(0)
                self._put(posixpath.dirname(real), archive)
                return
            if not src.is_dir():
                raise FileNotFoundError(f"cannot upload {src}: no such file or directory")
            with tarfile.open(fileobj=archive, mode="w") as tar:
                _add_tree(tar, src)
            archive.seek(0)
            self._put(p, archive)

    # ------------------------------------------------------------ the logged calls

    @contextlib.contextmanager
    def _op(self) -> Iterator[None]:
        """One of the agent's operations: waits while a snapshot is being taken."""
        with self._ops:
            while self._exclusive:
                self._ops.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._ops:
                self._active -= 1
                self._ops.notify_all()

    @contextlib.contextmanager
    def _alone(self) -> Iterator[None]:
        """No operation runs inside (a snapshot): waits for the running ones to end and
        holds new ones back until it is left."""
        with self._ops:
            while self._exclusive:
                self._ops.wait()
            self._exclusive = True
            try:
                while self._active:
                    self._ops.wait()
            except BaseException:
                self._exclusive = False
                self._ops.notify_all()
                raise
        try:
            yield
        finally:
            with self._ops:
                self._exclusive = False
                self._ops.notify_all()

    def _logged(self, op: str, args: Mapping[str, object], run: Callable[[], T],
                encode: Callable[[T], Mapping[str, object]],
                decode: Callable[[Mapping[str, Any]], T]) -> T:
        """Run an operation once (`OpLog.once`): answered from the command log while a
        restored runtime replays it, else run and logged with its result (a refusal
        too, as the type it raised)."""
        with self._op():
            return self._oplog.once(op, args, run, encode, decode,
                                   errors=_LOGGED_ERRORS)

    @property
    def replay_pending(self) -> int:
        """Logged operations of the snapshot not yet asked for again (0 when fresh)."""
        return self._oplog.pending

    def exec(self, command: str, timeout_s: float, *,
             env: Mapping[str, str] | None = None) -> ExecResult:
        """`/bin/sh -c command` in the working directory, with `env` added to the
        container's variables. Exit code 124 when it timed out (as `timeout(1)` says
        it); the reason a limit ended it is appended to stderr, as `SandboxRuntime`
        does."""
        return self._logged("exec", {"command": command, "env": dict(env or {})},
                            lambda: self._exec(command, timeout_s, env=env),
                            lambda r: r.to_dict(),
                            lambda d: ExecResult.from_dict(d, replayed=True))

    def read_file(self, path: str) -> str:
        return self._logged("read_file", {"path": path}, lambda: self._read_file(path),
                            lambda text: {"text": text}, lambda d: str(d["text"]))

    def write_file(self, path: str, text: str) -> None:
        """Create or replace a file (a link to a file is followed), its parent
        directories created; an existing file keeps its mode."""
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest() \
            if isinstance(text, str) else None
        self._logged("write_file", {"path": path, "sha256": digest},
                     lambda: self._write_file(path, text), lambda _: {}, lambda _: None)

    def list(self, path: str) -> builtins.list[str]:
        return self._logged("list", {"path": path}, lambda: self._list(path),
                            lambda names: {"names": names},
                            lambda d: [str(n) for n in d["names"]])

    def upload(self, src: Path, dest: str) -> None:
        """Copy a host file or directory tree to `dest` as one tar (modes kept, owned by
        root; symlinks are followed only when they stay inside `src`, links to
        directories are skipped, as `SandboxRuntime.upload` does)."""
        src = Path(src)
        digest = _tree_digest(src).hex() if src.is_dir() else (
            hashlib.sha256(src.read_bytes()).hexdigest() if src.is_file() else None)
        self._logged("upload", {"dest": dest, "sha256": digest},
                     lambda: self._upload(src, dest), lambda _: {}, lambda _: None)

    # ------------------------------------------------------------ snapshots

    def snapshot(self, path: Path) -> None:
        """Commit the container to an image `tidal-snapshot:<path hash>-<uuid>` and
        write, at `path` (a file), a JSON naming the image, the specs and the command
        log; `restore` continues from it, answering the logged operations from the log
        once each (`tidal.sandbox.oplog`), as a restored bubblewrap sandbox does.

        Kept: the container's files (its writable layer over the image) and the log.
        Not kept: running processes and their memory (a restored container starts with
        none: background servers must be started again), anything on tmpfs mounts or in
        volumes/binds (binds are mounted again from the spec's host paths), and the
        engine-managed /etc/hosts, /etc/hostname and /etc/resolv.conf. The snapshot
        waits for running operations to end and holds new ones back; the container is
        paused for the commit and goes on running. The image lives in this engine only
        (a snapshot resumes on the engine that took it) until `remove_snapshot`; a new
        snapshot at the same path removes the image of the one it replaces, unless a
        container still runs from it (`remove_snapshot` removes them all)."""
        if not self.can_snapshot:
            raise RuntimeToolError("the agent has ended: its container is gone, and the "
                                   "verifier's is not to be resumed")
        self._check_open()
        path = Path(path)
        if path.is_dir():
            raise RuntimeToolError(f"snapshot path {path} is a directory; name a file")
        prefix = _snapshot_prefix(path)
        tag = f"{prefix}-{uuid.uuid4().hex[:16]}"
        earlier = None  # the image the snapshot this one replaces committed
        with contextlib.suppress(ContainerError):
            earlier = str(read_snapshot(path)["image_id"]) if path.exists() else None
        with self._alone():
            try:
                image = self.client.containers.get(self.container_id).commit(
                    repository=SNAPSHOT_REPO, tag=tag, pause=True, changes=[
                        f"LABEL {SNAPSHOT_OF}={json.dumps(str(path.absolute()))}",
                        f"LABEL {OWNER}={json.dumps(_owner())}"])
            except docker.errors.APIError as e:
                raise ContainerError(f"committing container {self.container_id[:12]} failed: "
                                     f"{_why(e)}") from None
            log = [e.to_dict() for e in self._oplog.entries]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({
            "format": SNAPSHOT_FORMAT, "image": f"{SNAPSHOT_REPO}:{tag}", "image_id": image.id,
            "spec": self.spec.to_dict(), "pristine": self.pristine.to_dict(),
            "created": time.time(), "log": log}) + "\n")
        tmp.replace(path)
        if earlier is not None and earlier != image.id:
            # one a container still runs from (this runtime's, restored from it) stays,
            # until `remove_snapshot` takes every image of the path
            with contextlib.suppress(docker.errors.APIError):
                self.client.api.remove_image(earlier, force=False)

    @classmethod
    def restore(cls, path: Path, client: docker.DockerClient, *,
                output_bytes: int = Limits().output_bytes,
                file_bytes: int = Limits().file_bytes) -> ContainerRuntime:
        """A running container from the snapshot at `path`: the committed files, the
        spec's limits and variables, no processes, and its command log in replay mode
        (see `snapshot`)."""
        snap = read_snapshot(path)
        image = str(snap["image_id"])
        try:
            client.images.get(image)
        except docker.errors.ImageNotFound:
            raise ContainerError(f"snapshot {path}: its image {snap['image']} ({image[:19]}) "
                                 "is not in this engine (a snapshot resumes on the engine "
                                 "that took it)") from None
        entries = snap.get("log", [])
        if not isinstance(entries, builtins.list):
            raise ContainerError(f"snapshot {path}: its log is not a list")
        try:
            log = OpLog.restored(entries, where=f"snapshot {path}")
        except ValueError as e:
            raise ContainerError(str(e)) from None
        spec = replace(ContainerSpec.from_dict(_str_keys(snap["spec"])), image=image)
        pristine = ContainerSpec.from_dict(_str_keys(snap["pristine"]))
        rt = cls(spec, client, pristine=pristine, output_bytes=output_bytes,
                 file_bytes=file_bytes)
        rt._oplog = log
        return rt

    # ------------------------------------------------------------ the agent's end

    def end_agent(self, carry: Sequence[str] | None) -> str:
        """None: kill every process in the container but its init and keepalive (the
        container is paused meanwhile, so nothing forks past the kill) and go on in it:
        "shared". A sequence of paths (() for the working directory): a fresh container
        from the pristine image holding only those paths as the agent left them (each
        copied whole, so what the agent deleted inside one stays deleted; a path the
        agent removed is absent), the agent's container removed: "pristine, carrying
        ...", or what the pristine spec's `tidal.verifier` label says of a separate
        verifier ("separate (tests/Dockerfile), carrying ..."). Either way the agent's
        container takes no more snapshots."""
        self._check_open()
        self.can_snapshot = False
        if carry is None:
            self._kill_all()
            return "shared"
        paths = tuple(dict.fromkeys(self._abs(p) for p in carry)) or (self.spec.workdir,)
        if "/" in paths:
            raise RuntimeToolError("carrying / would carry everything: use the shared mode "
                                   "(environment_mode = \"shared\")")
        old = self.container_id
        with contextlib.ExitStack() as stack:
            try:
                self.client.api.kill(old)  # its init dies, and every process with it
            except docker.errors.APIError as e:
                raise ContainerError(f"could not stop the agent's container {old[:12]}: "
                                     f"{_why(e)}") from None
            archives: dict[str, IO[bytes] | None] = {}
            for p in paths:
                archives[p] = self._archive(old, p, stack)
            new_id, host = self._start(self.pristine)
            self.container_id, self._host, self.spec = new_id, host, self.pristine
            self._remove(old)
            r = self._root(["/bin/sh", "-c", 'for p; do rm -rf -- "$p" && mkdir -p -- '
                            '"$(dirname -- "$p")" || exit 1; done', "sh", *paths],
                           "clearing the carried paths")
            if r.exit_code != 0:
                raise ContainerError(f"preparing the verifier's container failed: "
                                     f"{r.stderr.strip()}")
            for p, archive in archives.items():
                if archive is not None:
                    self._put(posixpath.dirname(p), archive)
        kind = self.pristine.labels.get(VERIFIER_LABEL, "pristine")
        return f"{kind}, carrying " + ", ".join(paths)

    def _archive(self, container_id: str, path: str,
                 stack: contextlib.ExitStack) -> IO[bytes] | None:
        """`path` of a (stopped) container as a tar in a temporary file; None when the
        path does not exist there."""
        try:
            stream, _ = self.client.api.get_archive(container_id, path)
            # the caller's stack closes it, once the verifier's container holds it
            f = stack.enter_context(tempfile.TemporaryFile())  # noqa: SIM115
            for chunk in stream:
                f.write(chunk)
        except docker.errors.NotFound:
            return None
        except docker.errors.APIError as e:
            raise ContainerError(f"could not copy {path} out of the agent's container: "
                                 f"{_why(e)}") from None
        f.seek(0)
        return f

    def _kill_all(self) -> None:
        ct = self.client.containers.get(self.container_id)
        ct.pause()
        try:
            for pid in self._host.processes():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        finally:
            ct.unpause()
        deadline = time.monotonic() + 5.0
        while (left := self._host.processes()) and time.monotonic() < deadline:
            time.sleep(0.02)
        if left:
            raise ContainerError(f"container {self.container_id[:12]}: processes {left} "
                                 "survived SIGKILL")


def read_snapshot(path: Path) -> dict[str, object]:
    """A snapshot file's JSON; ContainerError says what is wrong with it."""
    try:
        snap = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ContainerError(f"snapshot {path}: cannot read it ({e})") from None
    if not isinstance(snap, dict) or snap.get("format") != SNAPSHOT_FORMAT:
        raise ContainerError(f"snapshot {path}: not a {SNAPSHOT_FORMAT} file")
    for key in ("image", "image_id", "spec", "pristine"):
        if key not in snap:
            raise ContainerError(f"snapshot {path}: no {key!r}")
    return snap


def _snapshot_prefix(path: Path) -> str:
    """The tag prefix of every snapshot image taken at `path` (its absolute path hashed)."""
    return hashlib.sha256(os.fsencode(Path(path).absolute())).hexdigest()[:16]


def _snapshot_images(client: docker.DockerClient) -> builtins.list[dict[str, Any]]:
    """The engine's snapshot images. The low-level list: one call, no per-image lookups
    that a concurrent removal fails; podman 4.3's list itself fails now and then while
    another image is being removed ("retrieving parent of image"): asked again."""
    for attempt in range(5):
        try:
            images: builtins.list[dict[str, Any]] = client.api.images(name=SNAPSHOT_REPO)
            return images
        except docker.errors.APIError as e:
            if attempt == 4:
                raise ContainerError(f"could not list the snapshot images: {_why(e)}") from None
            time.sleep(0.2)
    raise AssertionError("unreachable")


def _remove_snapshot_images(client: docker.DockerClient, prefix: str) -> None:
    """Remove the snapshot images tagged `prefix-*`; ContainerError for one that a
    container still runs from."""
    for image in _snapshot_images(client):
        refs = [str(t) for t in image.get("RepoTags") or ()]
        tags = [t.rsplit(":", 1)[1] for t in refs if t.rsplit(":", 1)[0].endswith(SNAPSHOT_REPO)]
        if not any(t.startswith(prefix + "-") for t in tags):
            continue
        for attempt in range(3):  # the engine's storage may be busy (another commit)
            try:
                client.api.remove_image(image["Id"], force=False)
                break
            except docker.errors.ImageNotFound:
                break
            except docker.errors.APIError as e:
                if attempt == 2:
                    raise ContainerError(f"could not remove snapshot image {refs[0]}: "
                                         f"{_why(e)}") from None
                time.sleep(0.2)


def remove_snapshot(path: Path, client: docker.DockerClient) -> None:
    """Delete a snapshot: its file and every image a snapshot at that path committed
    (ContainerError while a container still runs from one). A missing file is fine."""
    _remove_snapshot_images(client, _snapshot_prefix(path))
    Path(path).unlink(missing_ok=True)


def _str_keys(v: object) -> dict[str, object]:
    if not isinstance(v, dict):
        raise ContainerError(f"expected an object in the snapshot, got {v!r}")
    return {str(k): x for k, x in v.items()}


@contextlib.contextmanager
def container_runtime(spec: ContainerSpec, client: docker.DockerClient, *,
                      pristine: ContainerSpec | None = None,
                      output_bytes: int = Limits().output_bytes) -> Iterator[ContainerRuntime]:
    """A fresh container from `spec`, removed on exit (the verifier's too, when
    `end_agent` replaced the agent's with one from `pristine`, by default `spec`)."""
    rt = ContainerRuntime(spec, client, pristine=pristine, output_bytes=output_bytes)
    try:
        yield rt
    finally:
        rt.close()


def _member(name: str, size: int, mode: int, mtime: float | None = None) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode = size, mode
    info.mtime = time.time() if mtime is None else mtime
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _add_tree(tar: tarfile.TarFile, src: Path) -> None:
    """`src`'s contents into `tar`: files (symlinks followed only inside `src`) and empty
    directories (the others are implied by their files)."""
    root = src.resolve()
    for dirpath, dirnames, filenames in os.walk(src, followlinks=False):
        rel = Path(dirpath).relative_to(src)
        if not dirnames and not filenames and rel != Path():
            st = Path(dirpath).stat()
            info = _member(rel.as_posix(), 0, st.st_mode & 0o7777, st.st_mtime)
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        for name in sorted(filenames):
            real = (Path(dirpath) / name).resolve()
            if not real.is_relative_to(root) or not real.is_file():
                continue  # a link leading out of the tree, or to no file
            st = real.stat()
            with real.open("rb") as f:
                tar.addfile(_member((rel / name).as_posix(), st.st_size, st.st_mode & 0o7777,
                                    st.st_mtime), f)


def _decode(buf: bytearray, truncated: bool, limit: int) -> str:
    text = buf.decode("utf-8", errors="replace")
    return text + truncation_marker(limit) if truncated else text


# --------------------------------------------------------------------------- environments


def _logical_lines(text: str) -> Iterator[str]:
    """A Dockerfile's instructions: continuation lines joined, comments dropped."""
    cur = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not cur and (not stripped or stripped.startswith("#")):
            continue
        if cur and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            cur += stripped[:-1] + " "
            continue
        yield cur + stripped
        cur = ""
    if cur.strip():
        yield cur


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def from_references(text: str) -> builtins.list[str]:
    """The images a Dockerfile's FROM lines name (earlier stages and `scratch` left out;
    ARGs declared before the first FROM substituted with their defaults). ContainerError
    when a reference stays unresolved."""
    args: dict[str, str] = {}
    stages: set[str] = set()
    refs: list[str] = []
    seen_from = False
    for line in _logical_lines(text):
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "ARG" and not seen_from:
            name, _, default = rest.strip().partition("=")
            args[name.strip()] = default.strip().strip("\"'")
        if op != "FROM":
            continue
        seen_from = True
        words = [w for w in rest.split() if not w.startswith("--")]
        if not words:
            raise ContainerError(f"a FROM line names no image: {line!r}")

        def sub(m: re.Match[str]) -> str:
            name = m.group(1) or m.group(3)
            return args.get(name) or (m.group(2) or "")

        ref = _VAR.sub(sub, words[0])
        if not ref or "$" in ref:
            raise ContainerError(f"FROM {words[0]}: cannot resolve the image reference")
        if ref.lower() not in stages and ref != "scratch" and ref not in refs:
            refs.append(ref)
        if len(words) >= 3 and words[1].lower() == "as":
            stages.add(words[2].lower())
    return refs


def _split_ref(ref: str) -> tuple[str, str]:
    """(repository, tag) of a tag reference; a digest cannot be tagged."""
    if "@" in ref:
        raise ContainerError(f"{ref} pins a digest: a local image cannot be tagged with it; "
                             "name it by tag in the Dockerfile to map it")
    name, _, tag = ref.rpartition(":")
    if name and "/" not in tag:
        return name, tag
    return ref, "latest"


def _tree_digest(root: Path) -> bytes:
    """A digest of a build context: every entry's relative path and mode, a file's
    content, a link's target."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in sorted(filenames + dirnames):
            p = Path(dirpath) / name
            st = p.lstat()
            h.update(f"{p.relative_to(root).as_posix()}\0{st.st_mode:o}\0".encode())
            if p.is_symlink():
                h.update(str(p.readlink()).encode())
            elif p.is_file():
                with p.open("rb") as f:
                    while block := f.read(1 << 20):
                        h.update(block)
            h.update(b"\0")
    return h.digest()


@dataclass
class ContainerEnvironments:
    """Builds task environments with the engine and gives each episode its
    `ContainerSpec` (the engine-side counterpart of `tidal.agent.environment.Environments`).

    A task's environment/Dockerfile is built as written, by the engine's own builder, from
    its context directory; its RUN lines run on the engine, with the engine's default
    build network as Harbor builds them (podman 4's compat builder: the host's network;
    Docker: its default bridge), unless `build_network = "none"` (no network: podman is
    told `NetworkDisabled`, which its compat API needs, Docker `none`). The image is
    tagged `tidal-env:<hash>` where the hash covers the context's files, the Dockerfile,
    the FROM mapping (with the mapped images' ids) and the build network, and a build is
    skipped when that image exists, in this process or any earlier one.

    `images` maps the references a Dockerfile's FROM (or a task's `docker_image`) names,
    e.g. `ubuntu:24.04`, to local engine images, e.g. `localhost/tidal-base:bookworm`:
    the local image is tagged with the reference before a build, so FROM resolves
    locally (builds never pull). Note that this tag is the engine's: other users of the
    engine see `ubuntu:24.04` as the mapped image afterwards. An unmapped reference the
    engine does not have is refused by name. `default_image` is what a task without an
    environment runs in (None: refused)."""

    client: docker.DockerClient
    images: Mapping[str, str] = field(default_factory=dict)
    default_image: str | None = None
    build_network: Literal["default", "none"] = "default"
    _built: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    _fresh: set[str] = field(default_factory=set, init=False, repr=False)
    # (task id, "task" | "verifier") -> its spec: made once (each is an image inspect)
    _specs: dict[tuple[str, str], ContainerSpec] = field(default_factory=dict, init=False,
                                                         repr=False)
    _locks: dict[str, threading.Lock] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _podman: bool | None = field(default=None, init=False, repr=False)

    def image(self, task: Task) -> str:
        """The task's image reference (built now unless cached); ContainerError says
        which task and what failed."""
        who = f"task {task.task_id!r}"
        if task.environment is not None:
            return self._image(task.task_id, task.environment, f"{who}: environment/Dockerfile",
                               f"{who}: docker_image")
        if self.default_image is None:
            raise ContainerError(f"{who} has no environment and no default image was given")
        return self._local(self.default_image, who)

    def verifier_image(self, task: Task) -> str:
        """The image the task's verifier starts from: that of its own environment
        (`Task.separate_verifier`: a tests/Dockerfile, built as the task's is, or a
        `[verifier.environment] docker_image`, mapped as the task's is), else the task's.
        A failure is a HarborTaskError naming the file that declares it."""
        sep = task.separate_verifier
        if sep is None or sep.environment is None:
            return self.image(task)
        who = f"task {task.task_id!r}: {sep.file}"
        try:
            return self._image(f"{task.task_id}\0verifier", sep.environment, who,
                               f"{who}: docker_image")
        except ContainerError as e:
            raise HarborTaskError(task.task_id, sep.file,
                                  str(e).removeprefix(f"{who}: ")) from None

    def spec(self, task: Task) -> ContainerSpec:
        """The container of one episode of `task` (see `spec_for`), made once."""
        key = (task.task_id, "task")
        if key not in self._specs:
            self._specs[key] = spec_for(task, self.image(task), self.client)
        return self._specs[key]

    def verifier_spec(self, task: Task) -> ContainerSpec:
        """The container the task's verifier starts from (`ContainerRuntime.pristine`): the
        episode's, unless the verifier is separate: then that of its own environment (or
        a copy of the task's), labelled `tidal.verifier` with what its verdict says."""
        sep = task.separate_verifier
        if sep is None:
            return self.spec(task)
        key = (task.task_id, "verifier")
        if key not in self._specs:
            spec = self.spec(task) if sep.environment is None else spec_for(
                task, self.verifier_image(task), self.client, sep.environment)
            self._specs[key] = replace(spec, labels={**spec.labels,
                                                     VERIFIER_LABEL: sep.describe()})
        return self._specs[key]

    def prepare(self, tasks: Iterable[Task]) -> int:
        """Build every task's images now, its verifier's too (a broken one stops a run
        before it starts); returns how many tasks needed a build, not found in the
        engine."""
        return sum(self.built(t) for t in tasks)

    def built(self, task: Task) -> bool:
        """Whether getting the task's images (its own and its verifier's) ran a build
        (False: cache hits, or no Dockerfile)."""
        return bool({self.image(task), self.verifier_image(task)} & self._fresh)

    def _image(self, key: str, spec: EnvironmentSpec, build_who: str, image_who: str) -> str:
        """The image of `spec` (built now unless this process has it under `key`);
        errors begin with `build_who` (a Dockerfile) or `image_who` (a docker_image)."""
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            found = self._built.get(key)
            if found is not None:
                return found
            if spec.dockerfile is not None:
                image = self._build(build_who, spec, spec.dockerfile)
            else:
                assert spec.docker_image is not None
                image = self._resolve(spec.docker_image, image_who)
            self._built[key] = image
            return image

    def _local(self, image: str, who: str) -> str:
        try:
            self.client.images.get(image)
        except docker.errors.ImageNotFound:
            raise ContainerError(f"{who}: the engine has no image {image!r}") from None
        return image

    def _resolve(self, ref: str, who: str) -> str:
        """What `ref` runs as: its mapped local image, else `ref` when the engine has it."""
        if ref in self.images:
            return self._local(self.images[ref], f"{who}: --image {ref}={self.images[ref]}")
        try:
            self.client.images.get(ref)
        except docker.errors.ImageNotFound:
            raise ContainerError(
                f"{who}: {ref} is not in the engine and not mapped: map it to a local engine "
                f"image (`--image {ref}=IMAGE`; in a run, [environment] images), or load it "
                "into the engine") from None
        return ref

    def _bases(self, who: str, dockerfile: Path) -> dict[str, str]:
        """FROM reference -> the id of the image it will resolve to."""
        try:
            refs = from_references(dockerfile.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise ContainerError(f"{who}: cannot read it ({e})") from None
        except ContainerError as e:
            raise ContainerError(f"{who}: {e}") from None
        return {ref: self.client.images.get(self._resolve(ref, f"{who}: FROM")).id
                for ref in refs}

    def _build(self, who: str, spec: EnvironmentSpec, dockerfile: Path) -> str:
        context = spec.context or dockerfile.parent
        bases = self._bases(who, dockerfile)
        h = hashlib.sha256(b"tidal-env/1\0")
        h.update(dockerfile.read_bytes() + b"\0")
        for ref, image_id in sorted(bases.items()):
            h.update(f"FROM {ref}={image_id}\0".encode())
        h.update(f"network={self.build_network}\0".encode())
        h.update(_tree_digest(context))
        tag = f"{ENV_REPO}:{h.hexdigest()[:24]}"
        with self._lock:  # two tasks with one environment: one build
            lock = self._locks.setdefault(tag, threading.Lock())
        with lock:
            with contextlib.suppress(docker.errors.ImageNotFound):
                self.client.images.get(tag)
                return tag
            self._run_build(who, spec, dockerfile, context=context, bases=bases, tag=tag)
        return tag

    def _run_build(self, who: str, spec: EnvironmentSpec, dockerfile: Path, *, context: Path,
                   bases: Mapping[str, str], tag: str) -> None:
        for ref, local in self.images.items():
            if ref in bases:
                try:
                    self.client.images.get(local).tag(*_split_ref(ref))
                except docker.errors.APIError as e:
                    raise ContainerError(f"{who}: could not tag {local} as {ref}: "
                                         f"{_why(e)}") from None
        options: dict[str, str] = {}
        if self.build_network == "none":
            if self._podman is None:
                self._podman = is_podman(self.client)
            options["network_mode"] = "NetworkDisabled" if self._podman else "none"
        log: list[str] = []
        deadline = time.monotonic() + spec.build_timeout_s
        try:
            for chunk in self.client.api.build(
                    path=str(context), dockerfile=str(dockerfile.resolve()), tag=tag,
                    rm=True, forcerm=True, pull=False, decode=True,
                    timeout=spec.build_timeout_s, **options):
                log.extend(str(chunk.get("stream", "")).splitlines())
                if "error" in chunk:
                    tail = "\n".join(line for line in log[-20:] if line.strip())
                    raise ContainerError(f"{who}: the build failed: "
                                         f"{str(chunk['error']).strip()}\n{tail}")
                if time.monotonic() > deadline:
                    raise ContainerError(f"{who}: the build ran past build_timeout_sec "
                                         f"({spec.build_timeout_s:g} s)")
        except docker.errors.APIError as e:
            raise ContainerError(f"{who}: the engine refused the build: {_why(e)}") from None
        except OSError as e:  # the HTTP read timed out, or the engine went away
            raise ContainerError(f"{who}: the build did not finish ({e})") from None
        self._local(tag, f"{who}: the build finished without its image")
        self._fresh.add(tag)


@dataclass(frozen=True)
class ContainerRuntimes:
    """`tidal.agent.environment.TaskRuntimes` on a container engine: each episode (and
    each `tidal tasks check` check) in a fresh container of the task's image, restored
    ones from the image a snapshot committed. `binds`: the run's read-only mounts
    ((host path, container path) pairs). A verdict notes what the spec does not
    enforce."""

    environments: ContainerEnvironments
    binds: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        reap_orphans(self.environments.client)

    def prepare(self, tasks: Iterable[Task]) -> int:
        return self.environments.prepare(tasks)

    def notes(self, task: Task) -> list[str]:
        notes = list(self.environments.spec(task).notes)
        sep = task.separate_verifier
        if sep is not None and sep.environment is not None:
            notes += [f"verifier: {n}" for n in self.environments.verifier_spec(task).notes]
        return notes

    def spec(self, task: Task) -> ContainerSpec:
        return self._bound(self.environments.spec(task))

    def verifier_spec(self, task: Task) -> ContainerSpec:
        return self._bound(self.environments.verifier_spec(task))

    def _bound(self, spec: ContainerSpec) -> ContainerSpec:
        return replace(spec, binds=spec.binds + self.binds) if self.binds else spec

    def runtime(self, task: Task, limit_s: float | None = None
                ) -> contextlib.AbstractContextManager[ContainerRuntime]:
        """A fresh container whose `end_agent` starts the verifier's (`limit_s` is not
        needed: a container has no CPU-time limit, only its CPU share)."""
        return container_runtime(self.spec(task), self.environments.client,
                                 pristine=self.verifier_spec(task))

    @contextlib.contextmanager
    def restored(self, task: Task, snapshot: Path, limit_s: float | None = None
                 ) -> Iterator[ContainerRuntime]:
        """The snapshot's container; its `end_agent` starts the verifier's container from
        the spec the snapshot kept (`pristine`: the verifier's, as `runtime` gave it)."""
        rt = ContainerRuntime.restore(snapshot, self.environments.client)
        try:
            yield rt
        finally:
            rt.close()

    def discard(self, snapshot: Path) -> None:
        remove_snapshot(snapshot, self.environments.client)

    def with_access(self, ports: tuple[int, ...], binds: tuple[Bind, ...]) -> ContainerRuntimes:
        """The run's mounts, bound read-only. A gateway port is refused: containers run
        with network "none" (or the engine's bridge) and cannot reach the host's
        loopback, where the gateway listens, so a harness that runs inside the
        container cannot call the model."""
        if ports:
            raise ContainerError(
                f"a harness that runs inside the sandbox needs the gateway's port {ports[0]} "
                "there, and rollout.sandbox = \"docker\" cannot give a container the host's "
                "loopback: use agent.harness = \"builtin\" (its tools run in the container, "
                "the harness outside), or rollout.sandbox = \"bwrap\"")
        return replace(self, binds=tuple((b.host, b.target) for b in binds))
