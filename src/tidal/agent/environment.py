"""From a task's environment to the runtime its episodes run in.

`TaskRuntimes` is the seam every episode's runtime comes through (an RL rollout, an
evaluation, a warm-start demonstration, `tidal tasks check`): it builds the tasks'
environments, gives each episode a fresh runtime or one restored from a snapshot that
an earlier run of it took (preemption, `tidal.agent.preempt`), and discards snapshots.
Two implementations: `SandboxRuntimes` here (bubblewrap sandboxes of the environments
tidal builds, `rollout.sandbox = "bwrap"`) and `tidal.agent.containers.ContainerRuntimes`
(containers on a Docker-API engine, `rollout.sandbox = "docker"`).

A task in the Harbor format says what it runs in: a Dockerfile and its context, or a
prebuilt `docker_image` reference. `Environments` builds each one once with
`tidal.sandbox.build` (a read-only layer cached by content hash, so a later run or
process finds it built), remembers the result for the rest of the process, and gives
every episode its `SandboxConfig`: the base image and the layer, the working directory,
the variables, and the task's memory and disk as the sandbox's limits. A task without an
environment (the built-in sets) runs on the run's base config unchanged.

Precedence: the task.toml `[environment] workdir`, else the Dockerfile's last WORKDIR,
else /app; variables from the Dockerfile's ENV, then task.toml's `[environment] env`.
`cpus` is not enforced (the sandbox has no CPU-share limit); `network_mode` is never
granted (sandboxes have no network but the gateway's port).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Protocol

from tidal.agent.harbor import HarborTaskError
from tidal.agent.runtime import ToolRuntime
from tidal.agent.sandboxed import SandboxRuntime
from tidal.agent.tasks import Task, TaskError
from tidal.sandbox import Sandbox, SandboxConfig, SandboxError
from tidal.sandbox.build import Environment, build_environment, image_environment
from tidal.sandbox.dockerfile import DockerfileError
from tidal.sandbox.types import Bind

MiB = 1 << 20
# a sandbox runtime from a config: `tidal.agent.sandboxed.sandboxed_runtime` (bwrap),
# `tidal.run.components.local_runtime`, or a user's `module:attr`
RuntimeFactory = Callable[[SandboxConfig], contextlib.AbstractContextManager[ToolRuntime]]


class TaskRuntimes(Protocol):
    """Where a task's episodes run.

    `prepare` builds every task's environment now (a broken one stops a run before it
    starts; a TaskError names it) and returns how many were built rather than found.
    `notes` says what a verdict must: what this runtime does not do as the task asks.
    `runtime` is a fresh runtime of the task's environment for an episode that may run
    `limit_s` seconds (None: the runtimes' own limits). `restored` continues from a
    snapshot that one of its runtimes wrote (`ToolRuntime.snapshot`), its command log
    replayed exactly once (`tidal.sandbox.oplog`); `discard` deletes one, with what it
    holds outside the file. `with_access` is these runtimes with the run's gateway port
    reachable from inside (for a harness that runs there) and the run's read-only
    mounts; a runtime that cannot give them raises TaskError saying so."""

    def prepare(self, tasks: Iterable[Task]) -> int: ...

    def notes(self, task: Task) -> list[str]: ...

    def runtime(self, task: Task, limit_s: float | None = None
                ) -> contextlib.AbstractContextManager[ToolRuntime]: ...

    def restored(self, task: Task, snapshot: Path, limit_s: float | None = None
                 ) -> contextlib.AbstractContextManager[ToolRuntime]: ...

    def discard(self, snapshot: Path) -> None: ...

    def with_access(self, ports: tuple[int, ...], binds: tuple[Bind, ...]) -> TaskRuntimes: ...


@dataclass
class Environments:
    """Builds and remembers task environments. `images` maps FROM / docker_image
    references to local image directories (or "default"); `fallback` is what an
    unmapped reference gets ("default", a directory, or None to refuse it)."""

    images: Mapping[str, str]
    fallback: str | None
    cache_dir: Path
    state_dir: str | None = None
    _built: dict[str, Environment] = field(default_factory=dict, init=False, repr=False)
    _locks: dict[str, threading.Lock] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def environment(self, task: Task) -> Environment | None:
        """The task's built environment (built now if this process has not yet)."""
        spec = task.environment
        if spec is None:
            return None
        with self._lock:
            lock = self._locks.setdefault(task.task_id, threading.Lock())
        with lock:
            env = self._built.get(task.task_id)
            if env is not None:
                return env
            try:
                if spec.dockerfile is not None:
                    env = build_environment(
                        spec.dockerfile, context=spec.context or spec.dockerfile.parent,
                        images=self.images, fallback=self.fallback, cache_dir=self.cache_dir,
                        timeout_s=spec.build_timeout_s, state_dir=self.state_dir)
                else:
                    assert spec.docker_image is not None
                    env = image_environment(spec.docker_image, images=self.images,
                                            fallback=self.fallback)
            except (DockerfileError, SandboxError, OSError) as e:
                raise TaskError(f"task {task.task_id!r}: {e}") from e
            self._built[task.task_id] = env
            return env

    def prepare(self, tasks: Iterable[Task]) -> int:
        """Build every task's environment now (so a broken one stops a run before it
        starts); returns how many were built (not found in the cache)."""
        return sum(bool(env and env.built) for env in map(self.environment, tasks))

    def sandbox_config(self, task: Task, base: SandboxConfig) -> SandboxConfig:
        """The config of one episode of `task`: `base` (limits, ports, binds, state
        directory) with the task's image, layer, working directory, variables and
        memory/disk."""
        env = self.environment(task)
        spec = task.environment
        if env is None or spec is None:
            return base
        limits = base.limits
        if spec.memory_mb:
            limits = replace(limits, memory_bytes=max(spec.memory_mb * MiB, 64 * MiB))
        if spec.storage_mb:
            limits = replace(limits, disk_bytes=spec.storage_mb * MiB)
        return replace(
            base, image=env.image, layers=env.layers,
            workdir=spec.workdir or env.workdir or "/app",
            env={**env.env, **spec.env, **base.env}, limits=limits,
        )


def _refuse_own_verifier(task: Task) -> None:
    """A verifier environment of its own (Harbor's separate mode with tests/Dockerfile or
    `[verifier.environment]`) is refused by name: a sandbox is made from one config, and
    its verifier's sandbox from the same (a separate verifier without an environment of
    its own runs, in a fresh copy of the task's)."""
    sep = task.separate_verifier
    if sep is not None and sep.environment is not None:
        raise HarborTaskError(
            task.task_id, sep.file, f"the verifier has an environment of its own "
            f"({sep.origin}), which tidal's bubblewrap sandboxes cannot give: use the "
            "container runtime (`tidal tasks check --sandbox docker`; in a run, "
            "rollout.sandbox = \"docker\")")


@dataclass(frozen=True)
class SandboxRuntimes:
    """`TaskRuntimes` of sandboxes made by `new_runtime` from `base` (limits, ports,
    mounts) and the task's environment (`environments`; None: every task runs on `base`
    as it is). An episode that may run `limit_s` seconds gets CPU time enough for a
    harness that runs as long: (limit_s + 600) s on every core."""

    new_runtime: RuntimeFactory
    base: SandboxConfig = field(default_factory=SandboxConfig)
    environments: Environments | None = None

    def prepare(self, tasks: Iterable[Task]) -> int:
        tasks = list(tasks)
        for task in tasks:
            _refuse_own_verifier(task)
        return 0 if self.environments is None else self.environments.prepare(tasks)

    def notes(self, task: Task) -> list[str]:
        _refuse_own_verifier(task)
        env = None if self.environments is None else self.environments.environment(task)
        notes = []
        if task.environment is not None and task.environment.network_mode != "no-network":
            notes.append(f"network_mode is {task.environment.network_mode!r}: tidal's "
                         "bubblewrap sandboxes have no network")
        if env is not None and env.fallback_for is not None:
            assert self.environments is not None
            notes.append(f"checked on --fallback {self.environments.fallback}, not on "
                         f"{env.fallback_for!r} (not mapped): this verdict is not the named "
                         "image's")
        if env is not None and env.declared_for is not None:
            notes.append(f"built on tidal's default image for {env.declared_for!r}, as its "
                         "Dockerfile declares (LABEL tidal.image=\"default\")")
        return notes

    def config(self, task: Task, limit_s: float | None = None) -> SandboxConfig:
        """The sandbox of one episode of `task`."""
        base = self.base
        if limit_s is not None:
            cpu = (limit_s + 600.0) * (os.cpu_count() or 1)
            base = replace(base, limits=replace(base.limits, cpu_s=max(base.limits.cpu_s, cpu)))
        return base if self.environments is None else self.environments.sandbox_config(task, base)

    def runtime(self, task: Task, limit_s: float | None = None
                ) -> contextlib.AbstractContextManager[ToolRuntime]:
        return self.new_runtime(self.config(task, limit_s))

    @contextlib.contextmanager
    def restored(self, task: Task, snapshot: Path, limit_s: float | None = None
                 ) -> Iterator[ToolRuntime]:
        """The saved layer and log under this run's config: its limits, ports and
        mounts, and the image and layers where they live on this machine."""
        config = self.config(task, limit_s)
        with Sandbox.restore(snapshot, **{f.name: getattr(config, f.name)
                                          for f in fields(config)}) as sb:
            rt = SandboxRuntime(sb)
            try:
                yield rt
            finally:
                rt.close()

    def discard(self, snapshot: Path) -> None:
        Path(snapshot).unlink(missing_ok=True)

    def with_access(self, ports: tuple[int, ...], binds: tuple[Bind, ...]) -> SandboxRuntimes:
        return replace(self, base=replace(self.base, allow_ports=ports, binds=binds))
