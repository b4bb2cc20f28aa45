"""The one place where `tidal run` chooses its components by name.

Every seam a user may fill resolves here, from a built-in name or `module:attr` (an
importable module and an attribute path in it), so a user extends tidal without
editing it:

- task source (`tasks.source`, `tasks.heldout_source`): files, digits, tools, mixed,
  swe-mini, shell-skills, or a directory of Harbor tasks (with its own split when it
  holds train/ and heldout/ task directories); module:attr is a list of `Task`s or a
  `TaskSet`, or a callable returning one;
- harness (`agent.harness`): builtin, command; module:attr is fn(EpisodeContext) ->
  HarnessResult | None, or an object (or class) with `.run(ctx)`;
- where episodes run (`rollout.sandbox`, `make_runtimes`): bwrap, docker (a container
  engine), local; module:attr is fn(SandboxConfig) -> a context manager yielding a
  `ToolRuntime`;
- engine (`engine.kind`): embedded, vllm (servers started or attached); module:attr is
  fn(weights_dir, **options) -> Engine;
- scheduler backend (`schedule.backend`): local, ray (rollout devices on a Ray
  cluster: `tidal.run.hosts`); module:attr is fn(devices, slots) -> Backend;
- trainer (`[train]`): one process, or FSDP2 ranks launched here, on Ray, or by
  torchrun (`make_trainer`).

The config validates names when it is read (`check_*`); objects are imported and built
when the run starts (`make_*`), with errors that name the key.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tidal.agent.environment import RuntimeFactory, SandboxRuntimes, TaskRuntimes
from tidal.agent.episode import FunctionHarness, Harness
from tidal.agent.harbor import GENERATED_SETS, HARBOR_SETS, load_split, load_tasks
from tidal.agent.runtime import ToolRuntime
from tidal.agent.tasks import TASK_SETS, Task, TaskError, TaskSet, load_taskset
from tidal.engine.base import Engine
from tidal.run.names import (
    BUILTIN_TASK_SOURCES,
    ComponentError,
    is_attr,
    load_attr,
)
from tidal.sandbox import SandboxConfig

if TYPE_CHECKING:
    from tidal.agent.environment import Environments
    from tidal.agent.harness import AgentConfig
    from tidal.run.config import RunConfig, TasksConfig
    from tidal.schedule.backend import Migrator, SwitchHook
    from tidal.schedule.scheduler import RolloutScheduler
    from tidal.train.group import TrainerGroup, TrainerSpec


# --------------------------------------------------------------------------- checks


def check_task_source(value: str, key: str) -> None:
    """At run start: a task source that is no built-in set nor module:attr must be an
    existing directory."""
    if value in BUILTIN_TASK_SOURCES or is_attr(value):
        return
    try:
        found = Path(value).is_dir()
    except OSError as e:  # a path the system refuses to look at (too long)
        raise ComponentError(f"{key}: {e.strerror}") from None
    if not found:
        raise ComponentError(f"{key} {value!r} is not a built-in task set "
                             f"({', '.join(BUILTIN_TASK_SOURCES)}), an existing directory of "
                             "Harbor tasks, nor module:attr")


# --------------------------------------------------------------------------- tasks


def load_task_source(value: str, *, seed: int, key: str) -> TaskSet | list[Task]:
    """The tasks behind a `tasks.source` value: a built-in set (its own train/held-out
    split), a directory of Harbor tasks, or what `module:attr` gives."""
    if value in TASK_SETS:
        return load_taskset(value, seed=seed)
    if value in HARBOR_SETS:
        return load_tasks(value)
    split = load_split(value) if value in GENERATED_SETS or Path(value).is_dir() else None
    if split is not None:  # a generated set, or a directory with train/ and heldout/
        return split
    if is_attr(value):
        obj = load_attr(value, key)
        if callable(obj) and not isinstance(obj, TaskSet):
            try:  # a factory: given the run's seed, so a seeded set draws alike on resume
                obj = obj(seed=seed)
            except TypeError as e:
                raise ComponentError(f"{key} {value!r}: calling it as factory(seed=...) "
                                     f"failed: {e}") from e
        if isinstance(obj, TaskSet):
            return obj
        tasks = list(obj) if isinstance(obj, list | tuple) else None
        if not tasks or not all(isinstance(t, Task) for t in tasks):
            raise ComponentError(f"{key} {value!r} must give a TaskSet or a non-empty list of "
                                 f"Task, got {type(obj).__name__}")
        return tasks
    return load_tasks(Path(value))


@dataclass(frozen=True)
class Tasks:
    train: tuple[Task, ...]
    heldout: tuple[Task, ...]


def select_tasks(cfg: TasksConfig, seed: int) -> Tasks:
    """Training and held-out tasks: from `heldout_source` when given, else the source's
    own split (built-in sets), else a split of `heldout_size` tasks drawn with `seed`;
    then the first `train_size` / `heldout_size` of each."""
    for key, value in (("tasks.source", cfg.source),
                       ("tasks.heldout_source", cfg.heldout_source)):
        if key == "tasks.source" or value:
            check_task_source(value, key)
    src = load_task_source(cfg.source, seed=seed, key="tasks.source")
    if cfg.heldout_source:
        held = load_task_source(cfg.heldout_source, seed=seed, key="tasks.heldout_source")
        train = list(src.train if isinstance(src, TaskSet) else src)
        heldout = list(held.heldout if isinstance(held, TaskSet) else held)
        both = {t.task_id for t in train} & {t.task_id for t in heldout}
        if both:
            raise ComponentError(f"tasks {sorted(both)[:3]} are in both tasks.source and "
                                 "tasks.heldout_source: held-out tasks must not be trained on")
    elif isinstance(src, TaskSet):
        train, heldout = list(src.train), list(src.heldout)
    else:
        if len(src) <= cfg.heldout_size:
            raise ComponentError(f"tasks.source {cfg.source!r} has {len(src)} tasks: a held-out "
                                 f"split of tasks.heldout_size = {cfg.heldout_size} leaves none "
                                 "to train on (lower heldout_size or give tasks.heldout_source)")
        order = sorted(src, key=lambda t: t.task_id)
        random.Random(seed).shuffle(order)
        heldout, train = order[: cfg.heldout_size], order[cfg.heldout_size:]
    return Tasks(tuple(train[: cfg.train_size]), tuple(heldout[: cfg.heldout_size]))


# --------------------------------------------------------------------------- harness


def agent_config(cfg: RunConfig) -> AgentConfig:
    """The built-in harness's settings, from `[rollout]` and `tasks.time_limit_s`."""
    from tidal.agent.harness import AgentConfig

    r = cfg.rollout
    return AgentConfig(max_turns=r.max_turns, time_limit_s=cfg.tasks.time_limit_s,
                       context_budget_tokens=r.context_budget, max_tokens=r.max_tokens,
                       temperature=r.temperature, tools=r.tools)


def make_harness(cfg: RunConfig, agent_cfg: AgentConfig) -> Harness:
    from tidal.agent.command import CommandHarness
    from tidal.agent.harness import BuiltinHarness

    name = cfg.agent.harness
    if name == "builtin":
        return BuiltinHarness(agent_cfg)
    if name == "command":
        return CommandHarness(cfg.agent.command, env=dict(cfg.agent.env))
    obj = load_attr(name, "agent.harness")
    if isinstance(obj, type):
        obj = obj()
    if isinstance(obj, Harness):
        return obj
    if callable(obj):
        return FunctionHarness(obj)
    raise ComponentError(f"agent.harness {name!r} is neither a callable nor has .run(ctx)")


# --------------------------------------------------------------------------- runtimes


@contextlib.contextmanager
def local_runtime(config: SandboxConfig) -> Iterator[ToolRuntime]:
    """A plain temporary directory: NOT isolated; for trusted tasks and tests only. It
    cannot give a task its environment (image, layers, binds), so it refuses one."""
    import tempfile

    from tidal.agent.runtime import LocalDirRuntime

    if config.image is not None or config.layers or config.binds:
        raise TaskError("rollout.sandbox = \"local\" cannot build a task's environment "
                        "(image, layers, mounts): use \"bwrap\"")
    with tempfile.TemporaryDirectory(prefix="tidal-ep-") as d:
        yield LocalDirRuntime(Path(d))


def make_runtime_factory(kind: str) -> RuntimeFactory:
    from tidal.agent.sandboxed import sandboxed_runtime

    if kind == "bwrap":
        return sandboxed_runtime
    if kind == "local":
        return local_runtime
    obj = load_attr(kind, "rollout.sandbox")
    if not callable(obj):
        raise ComponentError(f"rollout.sandbox {kind!r} is not callable")
    factory: Callable[[SandboxConfig], contextlib.AbstractContextManager[object]] = obj

    @contextlib.contextmanager
    def checked(config: SandboxConfig) -> Iterator[ToolRuntime]:
        with factory(config) as runtime:
            if not isinstance(runtime, ToolRuntime):
                missing = [m for m in ("exec", "read_file", "write_file", "list", "upload",
                                       "can_snapshot", "snapshot", "end_agent")
                           if not hasattr(runtime, m)]
                raise ComponentError(
                    f"rollout.sandbox = {kind!r} gave a {type(runtime).__name__}, not a "
                    f"ToolRuntime (tidal.agent.runtime): it lacks {', '.join(missing)}")
            yield runtime

    return checked


def make_runtimes(cfg: RunConfig) -> TaskRuntimes:
    """Where the run's episodes run (`rollout.sandbox`): containers on the engine that
    `tidal.agent.containers.connect` finds (it must answer now), with `[environment]
    images` mapping references to engine images; else sandboxes of the named factory,
    with the environments tidal builds."""
    if cfg.rollout.sandbox == "docker":
        from tidal.agent.containers import ContainerEnvironments, ContainerRuntimes, connect

        env = cfg.environment
        return ContainerRuntimes(ContainerEnvironments(
            connect(), dict(env.images), default_image=env.default_image or None))
    return SandboxRuntimes(make_runtime_factory(cfg.rollout.sandbox),
                           environments=make_environments(cfg))


def make_environments(cfg: RunConfig) -> Environments:
    from tidal.agent.environment import Environments
    from tidal.engine.tiny import default_cache_root

    env = cfg.environment
    return Environments(dict(env.images), env.fallback or None,
                        Path(env.cache_dir) if env.cache_dir else default_cache_root() / "envs")


# --------------------------------------------------------------------------- engine


def check_engine(cfg: RunConfig) -> None:
    """What can be checked of the engine before anything loads: vLLM importable by
    `engine.vllm_python` (servers to start), or every attached URL answering."""
    if cfg.engine.kind != "vllm":
        return
    import sys

    import httpx

    from tidal.engine.base import EngineError
    from tidal.engine.servers import check_vllm

    if not cfg.engine.urls:
        try:
            check_vllm(cfg.engine.vllm_python or sys.executable)
        except EngineError as e:
            raise ComponentError(f"engine.kind = \"vllm\": {e}") from None
    for url in cfg.engine.urls:
        try:
            httpx.get(f"{url.rstrip('/')}/v1/models", timeout=10).raise_for_status()
        except httpx.HTTPError as e:
            raise ComponentError(f"engine.urls: {url} does not answer /v1/models: {e}") from None


def make_engine(cfg: RunConfig, weights_dir: Path, *, device: str, policy_version: int,
                model_name: str, tokenizer_dir: Path, run_dir: Path) -> Engine:
    """The engine `tidal run` samples with. vLLM servers are started (or attached to) and
    checked here, before anything else runs: an error names the key."""
    if cfg.engine.kind == "vllm":
        import sys

        from tidal.engine.base import EngineError
        from tidal.engine.servers import ServerPool, ServerSpec

        e = cfg.engine
        try:
            if e.urls:
                return ServerPool.attach(e.urls, model_name, policy_version=policy_version)
            # LoRA: the servers serve the trainer's adapters over the base checkpoint
            # (`tokenizer_dir` is it; `weights_dir` is the merged one on a resume)
            lora = cfg.train.lora
            spec = ServerSpec(python=e.vllm_python or sys.executable, tokenizer_dir=tokenizer_dir,
                              served_name=model_name, log_dir=run_dir / "vllm",
                              max_model_len=e.max_model_len, device=device,
                              args=tuple(e.vllm_args), start_timeout_s=e.start_timeout_s,
                              lora_rank=lora.r if lora is not None else 0,
                              lora_base=tokenizer_dir if lora is not None else None)
            return ServerPool.start(spec, e.servers, weights_dir, policy_version=policy_version)
        except EngineError as err:
            raise ComponentError(f"engine.kind = \"vllm\": {err}") from None
    if cfg.engine.kind == "embedded":
        from tidal.engine.base import EngineError
        from tidal.engine.embedded import EmbeddedEngine

        try:
            return EmbeddedEngine(weights_dir, device=device, policy_version=policy_version,
                                  model_name=model_name, seed=cfg.seed,
                                  numerics=cfg.rl.numerics,
                                  prefix_cache_mb=cfg.rollout.prefix_cache_mb,
                                  max_batch_size=cfg.engine.max_batch_size,
                                  matmul_dtype=cfg.engine.matmul_dtype,
                                  kv_dtype=cfg.engine.kv_dtype)
        except EngineError as err:
            raise ComponentError(f"engine.kind = \"embedded\": {err}") from None
    factory = load_attr(cfg.engine.kind, "engine.kind")
    engine = factory(weights_dir, device=device, policy_version=policy_version,
                     model_name=model_name, seed=cfg.seed, numerics=cfg.rl.numerics,
                     prefix_cache_mb=cfg.rollout.prefix_cache_mb)
    if not isinstance(engine, Engine):
        missing = [m for m in ("model_name", "policy_version", "max_context", "generate",
                               "forget", "metrics", "close", "update_weights")
                   if not hasattr(engine, m)]
        raise ComponentError(f"engine.kind = {cfg.engine.kind!r} made a "
                             f"{type(engine).__name__}, not an Engine (tidal.engine.base."
                             f"Engine): it lacks {', '.join(missing)}")
    return engine


# --------------------------------------------------------------------------- scheduler


def make_scheduler(cfg: RunConfig, *, mean_group_s: float = 10.0,
                   on_switch: SwitchHook | None = None, switch_s: float = 0.0,
                   migrator: Migrator | None = None) -> RolloutScheduler:
    """What runs `rollout.tasks_per_step` task groups a step on `schedule.devices` devices
    of `schedule.backend`, staleness bound `rl.max_staleness`. Colocated on the local
    backend is a plain loop (`Colocated`: roll out a batch, then train it); the elastic and
    async policies, and any policy on another backend, get the elastic scheduler. On the
    local backend a role switch moves no model (the engine and the trainer are both in
    this process) unless `on_switch(device, role)` does (vLLM servers sleep while their
    device trains and restart when it returns, `switch_s` seconds); `mean_group_s` scales
    the elastic policy's time constants. With `schedule.migration`, `migrator` moves live
    task groups off a device that switches to training."""
    from tidal.schedule.backend import Backend
    from tidal.schedule.colocated import Colocated
    from tidal.schedule.local import LocalBackend
    from tidal.schedule.policy import policy_named
    from tidal.schedule.scheduler import Scheduler
    from tidal.schedule.types import MIGRATE_S, PoolConfig

    s = cfg.schedule
    # on a Ray cluster the scheduler runs here too: its devices are the hosts
    # (`tidal.run.hosts`), each group handed to one from a thread of this process
    if s.backend in ("local", "ray") and s.policy == "colocated":
        return Colocated(s.devices, s.groups_per_device, cfg.rollout.tasks_per_step,
                         max_staleness=cfg.rl.max_staleness, on_switch=on_switch)
    if s.backend in ("local", "ray"):
        backend: Backend = LocalBackend(s.devices, s.groups_per_device, mode="thread",
                                        on_switch=on_switch,
                                        migrator=migrator if s.migration else None)
    else:
        backend = load_attr(s.backend, "schedule.backend")(s.devices, s.groups_per_device)
    config = PoolConfig(
        n_devices=s.devices, batch_size=cfg.rollout.tasks_per_step,
        slots_per_device=s.groups_per_device, max_staleness=cfg.rl.max_staleness,
        rollout_to_train_s=0.0, train_to_rollout_s=switch_s, rate_window_s=mean_group_s / 4,
        # what one live group's migration costs here (bench/preempt.py)
        migration=s.migration and migrator is not None, migrate_s=MIGRATE_S,
    )
    return Scheduler(backend, policy_named(s.policy, train_devices=s.train_devices,
                                           mean_group_s=mean_group_s), config)


# --------------------------------------------------------------------------- trainer


def resolve_device(name: str) -> str:
    """`model.device`: "auto" is CUDA when there is one, else the CPU."""
    if name == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def trainer_spec(cfg: RunConfig, weights_dir: Path, ckpt: Path | None, *,
                 device: str) -> TrainerSpec:
    """The trainer every rank builds: `[train]` (ranks, LoRA, activation checkpointing)
    and `[rl]` (loss, learning rate, stream size), from `weights_dir`, continuing the
    training state of `ckpt` when it has one."""
    import os

    from tidal.train.group import TRAIN_STATE, TrainerSpec
    from tidal.train.lora import LoraSpec
    from tidal.train.loss import LossConfig

    t = cfg.train
    state = ckpt / TRAIN_STATE if ckpt is not None else None
    threads = t.threads or max(1, (os.cpu_count() or 1) // t.world_size)
    lora = LoraSpec(r=t.lora.r, alpha=t.lora.alpha, dropout=t.lora.dropout,
                    targets=t.lora.targets) if t.lora is not None else None
    return TrainerSpec(
        weights_dir=str(weights_dir.resolve()), device=device, lr=cfg.rl.lr,
        loss=LossConfig(clip_low=cfg.rl.clip_eps, clip_high=cfg.rl.clip_eps,
                        correction=cfg.rl.correction, kl_coef=cfg.rl.kl_coef),
        max_tokens=cfg.rl.max_tokens_per_stream,
        attention="consistent" if cfg.rl.numerics == "consistent" else "auto",
        world_size=t.world_size, nodes=t.nodes, lora=lora,
        activation_checkpointing=t.activation_checkpointing,
        state_dir=str(state.resolve()) if state is not None and state.exists() else None,
        threads=threads if t.world_size > 1 else t.threads, matmul_dtype=t.matmul_dtype)


def check_trainer(cfg: RunConfig, weights_dir: Path, *, device: str) -> None:
    """What the machine must have for `[train]`, checked before anything starts: as
    many devices (CUDA) or cores (CPU) as ranks on this node, bf16 matmuls where
    `train.matmul_dtype = "bfloat16"`, and LoRA targets that the model has (on a skeleton
    of it: nothing loads)."""
    import os

    t = cfg.train
    per_node = t.world_size // t.nodes
    if t.nodes == 1 and t.world_size > 1:
        if device.startswith("cuda"):
            import torch

            n = torch.cuda.device_count()
            if per_node > n:
                raise ComponentError(f"train.world_size = {t.world_size} needs {per_node} "
                                     f"GPUs on this machine; it has {n}")
        elif per_node > (os.cpu_count() or 1):
            raise ComponentError(f"train.world_size = {t.world_size} ranks exceed this "
                                 f"machine's {os.cpu_count()} CPU cores (one rank per core)")
    if t.matmul_dtype == "bfloat16" and t.nodes == 1:
        import torch

        from tidal.train.precision import resolve_matmul_dtype

        try:
            resolve_matmul_dtype(t.matmul_dtype, torch.device(device.partition(":")[0]))
        except ValueError as e:
            raise ComponentError(str(e)) from None
    if t.lora is not None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from tidal.train.lora import LoraError, LoraSpec, check_targets

        config = AutoConfig.from_pretrained(weights_dir)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
        try:
            check_targets(skeleton, LoraSpec(r=t.lora.r, alpha=t.lora.alpha,
                                             dropout=t.lora.dropout, targets=t.lora.targets))
        except LoraError as e:
            raise ComponentError(str(e)) from None


def make_trainer(spec: TrainerSpec, *, run_dir: Path) -> TrainerGroup:
    """The trainer's ranks, started: one in this process, or `train.world_size` with
    FSDP2 (processes here when `train.nodes = 1`, Ray actors when more; under torchrun
    the ranks it started). Rank logs go to RUN_DIR/trainer/."""
    import os

    from tidal.train.group import TrainerGroup

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and spec.world_size > 1:
        if int(os.environ["WORLD_SIZE"]) != spec.world_size:
            raise ComponentError(f"train.world_size = {spec.world_size} but torchrun started "
                                 f"{os.environ['WORLD_SIZE']} ranks")
        launch = "attached"
    else:
        launch = "ray" if spec.nodes > 1 else "processes"
    return TrainerGroup(spec, launch=launch, log_dir=run_dir / "trainer").start()
