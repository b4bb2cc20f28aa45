"""From a task's environment to the sandbox its episodes run in.

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

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from tidal.agent.tasks import Task, TaskError
from tidal.sandbox import SandboxConfig, SandboxError
from tidal.sandbox.build import Environment, build_environment, image_environment
from tidal.sandbox.dockerfile import DockerfileError

MiB = 1 << 20


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
