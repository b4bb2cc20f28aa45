"""Tasks in the Harbor format (Terminal-Bench 2), read directly from their directories.

The format is the ecosystem's standard (SkyRL, rLLM, verifiers/prime-rl, TRL and
tinker-cookbook load it). One directory per task; its name is the task id:

    <task>/instruction.md          what the agent is told
    <task>/task.toml               [task] name, description; [metadata] (free);
                                   [verifier] timeout_sec, env, environment_mode,
                                   reward_key, carry_paths (tidal's); [verifier.environment]
                                   (the schema of [environment]); [agent] timeout_sec;
                                   [solution] env; [environment] workdir, docker_image,
                                   cpus, memory_mb, storage_mb, network_mode,
                                   allowed_hosts, env,
                                   build_timeout_sec (older files: memory = "4G", ...);
                                   artifacts = ["/app/out.txt", {source = ...}]
    <task>/environment/Dockerfile  and its build context (tidal.sandbox.build)
    <task>/tests/test.sh           the verifier, run after the agent ends
    <task>/solution/solve.sh       the oracle (optional)
    <task>/solution/tool_calls.json  tidal's own, optional: the solution as tool calls,
                                   turn by turn (`[[{"name": "bash", "arguments":
                                   {"command": "..."}}], [{"name": "finish", ...}]]`),
                                   from which the warm start's demonstrations are built

`load_tasks(DIR)` reads a directory of task directories (or one task directory) and
refuses a malformed task with the task, the file and what is wrong. The grader of a
Harbor task is `VerifierScript`: when the agent has ended, every process it left is
killed and the verifier gets an environment chosen by `[verifier] environment_mode`
(`Task.verifier_carry`, `Task.separate_verifier`; the verdict says which: `verifier_env`
in the grade):

- "pristine", tidal's default: a fresh sandbox from the task's pristine image holding
  only the agent's working directory as the agent left it (`[verifier] carry_paths =
  ["/app", "/data"]`, tidal's own key, names other paths);
- "shared" (Harbor's default): the agent's whole environment;
- "separate" (or a `[verifier.environment]` table, which implies it and conflicts with
  the other modes): as Harbor, a fresh environment of the verifier's own holding only
  the task's declared `artifacts` (top-level; paths, or tables whose `source` is one)
  and /logs/artifacts, each at its own path (plus `carry_paths`). Its image is
  `[verifier.environment] docker_image`, else tests/Dockerfile built with tests/ as its
  context, else the task's own; its resources and network `[verifier.environment]`'s,
  else the task's `[environment]`'s. An image of the verifier's own brings /tests
  itself (Harbor uploads no tests/ to it; tests/test.sh is then not required here).
  Bubblewrap sandboxes give only the task's own image (`SandboxRuntimes` refuses the
  rest by name); the container runtime builds both. In the other modes `artifacts`
  are checked, and unused.

Then tests/ is copied to /tests (unless the image brings them) and `/tests/test.sh`
runs by its shebang in the environment's working directory, within `[verifier]
timeout_sec`; the reward is read from /logs/verifier as Harbor reads it, reward.json
first, then reward.txt (`read_reward`: a dict is kept whole, and the rule for the
number that trains is there).

A script that writes neither, an unreadable or non-finite number, or a run past the
timeout is a grader error: the session is masked and counted, never a crash. The
harness's status does not enter the reward (a timed-out agent is graded on what it
left). Refused by name: Harbor's multi-step tasks (`[[steps]]`, `steps/`), a
docker-compose verifier (tests/docker-compose.yaml), an artifact of another compose
`service` or with `exclude` patterns (tidal carries an artifact whole); docker-compose
environments are not read. `network_mode` is read (the older `allow_internet` where it
is unset) and reported, never granted on bubblewrap.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
import shlex
import tomllib
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from importlib.resources import files
from pathlib import Path, PurePosixPath
from typing import Any

from tidal.agent.runtime import ToolRuntime
from tidal.agent.tasks import (
    EnvironmentSpec,
    Grade,
    Oracle,
    SeparateVerifier,
    Step,
    Task,
    TaskError,
    TaskSet,
)
from tidal.agent.tools import ALL_TOOLS, FINISH

TASK_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
# built-in task sets in this format, by name: data shipped beside the code (src/tidal_tasksets/)
HARBOR_SETS: dict[str, Path] = {"swe-mini": Path(str(files("tidal_tasksets") / "swe_mini"))}
# built-in sets generated on first use (into the cache), with their own train/ and
# heldout/ splits: name -> the function that returns the set's directory
def _shell_skills() -> Path:
    from tidal.agent.shellskills import ensure_shell_skills

    return ensure_shell_skills()


GENERATED_SETS: dict[str, Callable[[], Path]] = {"shell-skills": _shell_skills}
SPLITS = ("train", "heldout")


def set_root(name_or_path: Path | str) -> Path:
    """The directory of a built-in set's name, or the path itself."""
    name = str(name_or_path)
    if name in GENERATED_SETS:
        return GENERATED_SETS[name]()
    return HARBOR_SETS.get(name, Path(name_or_path))


def split_dirs(root: Path) -> tuple[Path, Path] | None:
    """`(root/train, root/heldout)` when `root` holds a split set, else None."""
    train, heldout = (root / s for s in SPLITS)
    return (train, heldout) if train.is_dir() and heldout.is_dir() else None
VERIFIER_DIR = "/logs/verifier"
ARTIFACTS_DIR = "/logs/artifacts"  # Harbor's convention: always handed to a separate verifier
NO_BUNDLED_TESTS = ("the verifier's image has no /tests/test.sh (its tests are bundled: an "
                    "image of its own brings them, as Harbor runs it, and tests/ is not "
                    "uploaded)")
DEFAULT_TIMEOUT_S = 600.0  # Harbor's default for [agent] and [verifier] timeout_sec
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.I)


class HarborTaskError(TaskError):
    """A Harbor task directory is malformed; names the task, the file and the problem."""

    def __init__(self, task: str, file: str, problem: str) -> None:
        super().__init__(f"task {task!r}: {file}: {problem}")
        self.task, self.file, self.problem = task, file, problem


class RewardError(ValueError):
    """The verifier's reward files say nothing usable."""


# --------------------------------------------------------------------------- rewards


def read_reward(reward_txt: str | None, reward_json: str | None, *,
                reward_key: str | None = None) -> tuple[float, dict[str, float], str]:
    """(the reward that trains, every number reported, which rule chose it) from the text
    of reward.txt and reward.json (None: the file is missing), read as Harbor reads them:
    reward.json first, then reward.txt. Raises RewardError saying what is wrong.

    reward.json is a number or an object of numbers, kept whole (`extra["rewards"]`).
    The number that trains is its `"reward"` key; else the key the task names in
    `[verifier] reward_key` (tidal's own); else its only number; else the mean of its
    numbers (Harbor keeps a dict's keys apart; the mean is right for sub-scores on one
    scale, and `reward_key` says otherwise)."""
    if reward_json is not None:
        return _reward_json(reward_json, reward_key)
    if reward_txt is None:
        raise RewardError(f"test.sh wrote no reward ({VERIFIER_DIR}/reward.txt or reward.json)")
    text = reward_txt.strip()
    if not text:
        raise RewardError("reward.txt is empty")
    try:
        value = float(text)
    except ValueError:
        raise RewardError(f"reward.txt holds {text[:80]!r}, not a number") from None
    if not math.isfinite(value):
        raise RewardError(f"reward.txt holds {text!r}, not a finite number")
    return value, {"reward": value}, "reward.txt"


def _reward_json(text: str, reward_key: str | None) -> tuple[float, dict[str, float], str]:
    if not text.strip():
        raise RewardError("reward.json is empty")
    try:
        data = json.loads(text)
    except ValueError as e:
        raise RewardError(f"reward.json is not JSON: {e}") from None
    if not isinstance(data, dict):
        data = {"reward": data}
    numbers = {}
    for k, v in data.items():
        if not isinstance(v, int | float):  # a bool is a number, as Harbor reads it
            raise RewardError(f"reward.json's {k!r} is {v!r}, not a number")
        if not math.isfinite(v):
            raise RewardError(f"reward.json's {k!r} is not a finite number")
        numbers[str(k)] = float(v)
    if not numbers:
        raise RewardError("reward.json holds no numbers")
    if "reward" in numbers:
        return numbers["reward"], numbers, "reward.json: reward"
    if reward_key is not None:
        if reward_key not in numbers:
            raise RewardError(f"reward.json has no {reward_key!r} ([verifier] reward_key), "
                              f"only {sorted(numbers)}")
        return numbers[reward_key], numbers, f"reward.json: {reward_key}"
    if len(numbers) == 1:
        key = next(iter(numbers))
        return numbers[key], numbers, f"reward.json: {key}"
    return (math.fsum(numbers.values()) / len(numbers), numbers,
            f"reward.json: the mean of {len(numbers)} numbers")


@dataclass(frozen=True)
class VerifierScript:
    """A task's tests/test.sh as its grader (see the module docstring)."""

    tests: Path
    timeout_s: float = DEFAULT_TIMEOUT_S
    env: Mapping[str, str] = field(default_factory=dict)
    reward_key: str | None = None  # `[verifier] reward_key` (see `read_reward`)
    bundled: bool = False  # the verifier's own image holds /tests: tests/ is not uploaded

    def grade(self, runtime: ToolRuntime, *, finished: bool | None = None) -> Grade:
        if self.bundled:
            setup = (f"test -f /tests/test.sh || {{ echo {shlex.quote(NO_BUNDLED_TESTS)} >&2; "
                     f"exit 127; }}; rm -rf {VERIFIER_DIR}")
        else:
            # tests/ goes to a fresh staging directory first and replaces /tests in the
            # same command that runs them, so nothing the agent left in /tests or
            # /logs/verifier survives, at the cost of one command
            staging = f"/tmp/.tidal-tests-{uuid.uuid4().hex[:12]}"
            runtime.upload(self.tests, staging)
            setup = f"rm -rf /tests {VERIFIER_DIR} && mv {staging} /tests"
        run = runtime.exec(
            f"{setup} && mkdir -p {VERIFIER_DIR} && chmod +x /tests/test.sh && exec "
            f"/tests/test.sh >{VERIFIER_DIR}/test-stdout.txt 2>{VERIFIER_DIR}/test-stderr.txt",
            self.timeout_s, env=self.env)
        out = (_read(runtime, f"{VERIFIER_DIR}/test-stdout.txt") or "")[-2000:]
        err = (_read(runtime, f"{VERIFIER_DIR}/test-stderr.txt") or run.stderr)[-2000:]
        extra: dict[str, Any] = {"exit_code": run.exit_code, "output": out + err}
        if run.timed_out:
            return _grader_error(f"test.sh did not finish within {self.timeout_s:g} s", extra)
        try:
            reward, numbers, rule = read_reward(
                _read(runtime, f"{VERIFIER_DIR}/reward.txt"),
                _read(runtime, f"{VERIFIER_DIR}/reward.json"), reward_key=self.reward_key)
        except RewardError as e:
            return _grader_error(f"{e} (test.sh exited with {run.exit_code})", extra)
        extra["rewards"] = numbers
        extra["reward_from"] = rule
        return Grade(reward=reward, partial_score=reward, details={"tests pass": reward >= 1.0},
                     by_kind={"tests": reward}, extra=extra)


def _read(runtime: ToolRuntime, path: str) -> str | None:
    try:
        return runtime.read_file(path)
    except FileNotFoundError:
        return None


def _grader_error(why: str, extra: dict[str, Any] | None = None) -> Grade:
    return Grade(reward=0.0, partial_score=0.0, details={}, error=why, extra=extra or {})


def run_oracle(task: Task, runtime: ToolRuntime, *, timeout_s: float | None = None) -> str | None:
    """Run the task's solution/solve.sh in a prepared runtime (Harbor's oracle agent: the
    solution copied to /solution, run from the working directory). Returns None, or what
    went wrong."""
    if task.oracle is None:
        return "the task has no solution/solve.sh"
    runtime.upload(task.oracle.directory, "/solution")
    r = runtime.exec("bash /solution/solve.sh", timeout_s or task.time_limit_s or
                     DEFAULT_TIMEOUT_S, env=task.oracle.env)
    if r.timed_out:
        return "solve.sh did not finish in time"
    if r.exit_code != 0:
        how = (f"was killed by signal {r.exit_code - 128}" if r.exit_code > 128
               else f"exited with {r.exit_code}")
        return f"solve.sh {how}: {(r.stderr or r.stdout).strip()[-300:] or '(no output)'}"
    return None


# --------------------------------------------------------------------------- task.toml


def _table(data: Mapping[str, Any], key: str, err: Any) -> dict[str, Any]:
    v = data.get(key, {})
    if not isinstance(v, dict):
        err(f"[{key}] must be a table, got {type(v).__name__}")
    return v


def _number(table: Mapping[str, Any], key: str, where: str, default: float | None,
            err: Any) -> float | None:
    v = table.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        err(f"{where}.{key} must be a positive number, got {v!r}")
    return float(v)


def _env(table: Mapping[str, Any], where: str, err: Any) -> dict[str, str]:
    env = table.get("env", {})
    if not isinstance(env, dict):
        err(f"{where}.env must be a table of strings")
    out = {}
    for k, v in env.items():
        if not isinstance(v, str | int | float) or isinstance(v, bool) or not k or "=" in k:
            err(f"{where}.env.{k} must be a string")
        out[str(k)] = str(v)
    return out


ENVIRONMENT_MODES = ("pristine", "separate", "shared")
NETWORK_MODES = ("no-network", "public", "allowlist")  # Harbor's; public is its default


def _network(env: Mapping[str, Any], where: str, err: Any) -> tuple[str, tuple[str, ...]]:
    """`network_mode` and `allowed_hosts` of an environment table, as Harbor reads them:
    the older `allow_internet` (true: public, false: no-network) only where network_mode
    is unset."""
    mode = env.get("network_mode")
    if mode is None:
        internet = env.get("allow_internet", True)
        if not isinstance(internet, bool):
            err(f"{where}.allow_internet must be true or false, got {internet!r}")
        mode = "public" if internet else "no-network"
    if mode not in NETWORK_MODES:
        err(f"{where}.network_mode must be one of {', '.join(NETWORK_MODES)}, got {mode!r}")
    hosts = env.get("allowed_hosts", [])
    if not isinstance(hosts, list) or not all(isinstance(h, str) and h for h in hosts):
        err(f"{where}.allowed_hosts must be a list of host names, got {hosts!r}")
    if hosts and mode != "allowlist":
        err(f"{where}.allowed_hosts is only valid with network_mode = \"allowlist\"")
    return str(mode), tuple(hosts)


def _size_mb(table: Mapping[str, Any], key_mb: str, legacy: str, where: str,
             err: Any) -> int | None:
    """`memory_mb = 2048`, or the older `memory = "2G"` (K, M, G, T; a bare number is MB)."""
    if key_mb in table:
        v = _number(table, key_mb, where, None, err)
        return int(v) if v is not None else None
    if legacy not in table:
        return None
    raw = table[legacy]
    m = _SIZE.match(str(raw))
    if m is None:
        err(f"{where}.{legacy} = {raw!r} is not a size such as \"4G\" or \"512M\"")
        return None
    scale = {"": 1, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}[m.group(2).upper()]
    return max(1, int(float(m.group(1)) * scale))


def _environment(env: Mapping[str, Any], where: str, err: Any) -> EnvironmentSpec:
    """An environment table (`[environment]`, or `[verifier.environment]`: the same
    schema) as a spec without its Dockerfile (the caller knows the directory)."""
    workdir = env.get("workdir")
    if workdir is not None and (not isinstance(workdir, str) or not workdir.startswith("/")):
        err(f"{where}.workdir must be an absolute path, got {workdir!r}")
    image = env.get("docker_image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        err(f"{where}.docker_image must be an image reference, got {image!r}")
    network, hosts = _network(env, where, err)
    build_timeout = _number(env, "build_timeout_sec", where, 600.0, err)
    assert build_timeout is not None
    return EnvironmentSpec(
        docker_image=image, workdir=workdir, env=_env(env, where, err),
        cpus=_number(env, "cpus", where, None, err),
        memory_mb=_size_mb(env, "memory_mb", "memory", where, err),
        storage_mb=_size_mb(env, "storage_mb", "storage", where, err),
        network_mode=network, allowed_hosts=hosts, build_timeout_s=build_timeout)


def _verifier_mode(verifier: Mapping[str, Any], err: Any) -> str:
    """`[verifier] environment_mode`, as Harbor resolves it but for the default (tidal's
    is "pristine", Harbor's "shared"): a `[verifier.environment]` table means
    "separate" and conflicts with any other mode."""
    mode = verifier.get("environment_mode")
    own = "environment" in verifier
    if mode is None:
        return "separate" if own else "pristine"
    if mode not in ENVIRONMENT_MODES:
        err(f"[verifier].environment_mode must be one of {', '.join(ENVIRONMENT_MODES)}, "
            f"got {mode!r}")
    if own and mode != "separate":
        err(f"[verifier].environment_mode = {mode!r} conflicts with [verifier.environment]: "
            "a verifier environment of its own is the separate mode (set environment_mode = "
            "\"separate\", or leave it out)")
    return str(mode)


def _artifacts(data: Mapping[str, Any], err: Any) -> tuple[str, ...]:
    """The top-level `artifacts` list: what the agent's environment hands a separate
    verifier, each to its own source path. An entry is a path or a table with `source`;
    `destination` only places Harbor's host copy (tidal keeps none) and is read for its
    type; a `service` other than "main" and `exclude` patterns are refused by name."""
    raw = data.get("artifacts", [])
    if not isinstance(raw, list):
        err(f"artifacts must be a list of paths or {{source = ...}} tables, got {raw!r}")
    out: list[str] = []
    for i, entry in enumerate(raw):
        where = f"artifacts[{i}]"
        source = entry
        if isinstance(entry, dict):
            source = entry.get("source")
            where += ".source"
            service = entry.get("service")
            if service not in (None, "main"):
                err(f"artifacts[{i}].service = {service!r} is not supported: tidal runs a task "
                    "in one container (no docker-compose services); leave it out or say "
                    "\"main\"")
            if entry.get("exclude"):
                err(f"artifacts[{i}].exclude is not supported: tidal carries an artifact "
                    "whole (name the paths to carry instead)")
            if not isinstance(entry.get("destination", ""), str):
                err(f"artifacts[{i}].destination must be a relative path, got "
                    f"{entry['destination']!r}")
        if not isinstance(source, str) or not source.startswith("/") or "\0" in source \
                or ".." in PurePosixPath(source).parts:
            err(f"{where} must be an absolute path without '..', got {source!r}")
        path = posixpath.normpath(source)
        if path in ("/", "//"):
            err(f"{where} = {source!r} would hand the verifier everything: use "
                "[verifier] environment_mode = \"shared\"")
        out.append(path)
    return tuple(out)


def _verifier_carry(verifier: Mapping[str, Any], mode: str, artifacts: tuple[str, ...],
                    err: Any) -> tuple[str, ...] | None:
    """What the verifier sees of the agent's environment (`Task.verifier_carry`): all of
    it when shared; the declared artifacts and /logs/artifacts when separate (as Harbor
    hands them over); else the working directory, () (tidal's pristine mode). tidal's
    `carry_paths` names more paths (pristine: those instead of the working directory)."""
    paths = verifier.get("carry_paths", [])
    if not isinstance(paths, list) or not all(
            isinstance(p, str) and p.startswith("/") and "\0" not in p for p in paths):
        err(f"[verifier].carry_paths must be a list of absolute paths, got {paths!r}")
    if mode == "shared":
        if paths:
            err("[verifier].carry_paths means nothing with environment_mode = \"shared\": the "
                "verifier sees all of the agent's environment")
        return None
    if mode == "separate":
        return tuple(dict.fromkeys((*artifacts, ARTIFACTS_DIR, *paths)))
    return tuple(paths)


def _parse_toml(task_id: str, path: Path) -> dict[str, Any]:
    def err(problem: str) -> None:
        raise HarborTaskError(task_id, "task.toml", problem)

    if not path.is_file():
        err("missing (every task needs one, even if only `version = \"1.0\"`)")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise HarborTaskError(task_id, "task.toml", f"not valid TOML: {e}") from None
    task, meta = _table(data, "task", err), _table(data, "metadata", err)
    verifier, agent = _table(data, "verifier", err), _table(data, "agent", err)
    solution, env = _table(data, "solution", err), _table(data, "environment", err)
    own = verifier.get("environment")
    if own is not None and not isinstance(own, dict):
        err(f"[verifier.environment] must be a table, got {type(own).__name__}")
    reward_key = verifier.get("reward_key")
    if reward_key is not None and (not isinstance(reward_key, str) or not reward_key):
        err(f"[verifier].reward_key must name a key of reward.json, got {reward_key!r}")
    mode = _verifier_mode(verifier, err)
    return {
        "name": str(task.get("name", task_id)), "description": str(task.get("description", "")),
        "metadata": meta, "version": str(data.get("version", "")),
        "verifier_timeout": _number(verifier, "timeout_sec", "[verifier]", DEFAULT_TIMEOUT_S, err),
        "verifier_env": _env(verifier, "[verifier]", err), "reward_key": reward_key,
        "verifier_mode": mode,
        "verifier_carry": _verifier_carry(verifier, mode, _artifacts(data, err), err),
        "verifier_environment": None if own is None else _environment(
            own, "[verifier.environment]", err),
        "agent_timeout": _number(agent, "timeout_sec", "[agent]", DEFAULT_TIMEOUT_S, err),
        "solution_env": _env(solution, "[solution]", err),
        "environment": _environment(env, "[environment]", err),
    }


def _separate_verifier(tid: str, tests: Path, environment: EnvironmentSpec,
                       own: EnvironmentSpec | None) -> tuple[SeparateVerifier, bool]:
    """The environment a separate verifier runs in and whether its image brings the tests
    (Harbor's `resolve_verifier_environment_definition`): `[verifier.environment]
    docker_image`; else tests/Dockerfile, built with tests/ as its context; else the
    task's own image. Its resources are `[verifier.environment]`'s, else a copy of the
    task's `[environment]`. The first two bring /tests themselves (Harbor uploads no
    tests/ to them)."""
    if own is not None and own.docker_image is not None:
        return SeparateVerifier(own, f"docker_image {own.docker_image}"), True
    if (tests / "docker-compose.yaml").is_file():
        raise HarborTaskError(tid, "tests/docker-compose.yaml", "a docker-compose verifier "
                              "environment is not supported: tidal runs a verifier in one "
                              "container (give it a tests/Dockerfile or a [verifier."
                              "environment] docker_image)")
    if (tests / "Dockerfile").is_file():
        spec = replace(own or environment, dockerfile=tests / "Dockerfile", context=tests,
                       docker_image=None)
        return SeparateVerifier(spec, "tests/Dockerfile", "tests/Dockerfile"), True
    if own is not None:
        spec = replace(own, dockerfile=environment.dockerfile, context=environment.context,
                       docker_image=environment.docker_image)
        return SeparateVerifier(spec, "[verifier.environment] on the task's image"), False
    return SeparateVerifier(), False


# --------------------------------------------------------------------------- loading


MULTI_STEP = ("a multi-step task ([[steps]], steps/): tidal runs single-step tasks only, one "
              "instruction and one verifier an episode; split it into one task a step")


def _declares_steps(toml: Path) -> bool:
    """Whether task.toml has Harbor's `[[steps]]` (a broken file says nothing here: its
    own check names it)."""
    try:
        return "steps" in tomllib.loads(toml.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return False


def looks_like_task(path: Path) -> bool:
    return (path / "task.toml").is_file() or (path / "instruction.md").is_file()


def load_task(path: Path) -> Task:
    """One Harbor task directory as a `Task`; HarborTaskError names what is wrong."""
    path = Path(path)
    tid = path.name
    if not TASK_ID.match(tid):
        raise HarborTaskError(tid, "(directory name)", "a task directory's name is its id: "
                              "letters, digits, '.', '_' and '-' only")
    if (path / "steps").is_dir() or _declares_steps(path / "task.toml"):
        raise HarborTaskError(tid, "task.toml", MULTI_STEP)
    instruction = path / "instruction.md"
    if not instruction.is_file():
        raise HarborTaskError(tid, "instruction.md", "missing")
    try:
        prompt = instruction.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise HarborTaskError(tid, "instruction.md", "not UTF-8 text") from None
    if not prompt:
        raise HarborTaskError(tid, "instruction.md", "empty")
    cfg = _parse_toml(tid, path / "task.toml")
    dockerfile = path / "environment" / "Dockerfile"
    env: EnvironmentSpec = cfg["environment"]
    if not dockerfile.is_file() and env.docker_image is None:
        raise HarborTaskError(tid, "environment/Dockerfile", "missing, and task.toml names no "
                              "[environment] docker_image: say what the task runs in")
    if dockerfile.is_file():
        env = replace(env, dockerfile=dockerfile, context=dockerfile.parent)
    separate, bundled = None, False
    if cfg["verifier_mode"] == "separate":
        separate, bundled = _separate_verifier(tid, path / "tests", env,
                                               cfg["verifier_environment"])
    if not bundled and not (path / "tests" / "test.sh").is_file():
        raise HarborTaskError(tid, "tests/test.sh", "missing: the verifier that writes "
                              f"{VERIFIER_DIR}/reward.txt or reward.json")
    solve = path / "solution" / "solve.sh"
    calls = path / "solution" / "tool_calls.json"
    return Task(
        task_id=tid, prompt=prompt,
        grader=VerifierScript(path / "tests", cfg["verifier_timeout"], cfg["verifier_env"],
                              cfg["reward_key"], bundled),
        family=str(cfg["metadata"].get("category", "")), environment=env,
        time_limit_s=cfg["agent_timeout"], source=path, verifier_carry=cfg["verifier_carry"],
        separate_verifier=separate,
        oracle=Oracle(solve.parent, cfg["solution_env"]) if solve.is_file() else None,
        solution=read_tool_calls(tid, calls) if calls.is_file() else (),
        metadata={"name": cfg["name"], "description": cfg["description"],
                  "metadata": cfg["metadata"], "version": cfg["version"]},
    )


def read_tool_calls(tid: str, path: Path) -> tuple[tuple[Step, ...], ...]:
    """A task's `solution/tool_calls.json`: a list of turns, each a non-empty list of
    `{"name": <built-in tool>, "arguments": {<string>: <string>}}`, the last turn a single
    `finish`."""
    file = "solution/tool_calls.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise HarborTaskError(tid, file, f"not valid JSON: {e}") from None
    if not isinstance(data, list) or not data:
        raise HarborTaskError(tid, file, "must be a non-empty list of turns")
    turns = []
    for i, turn in enumerate(data):
        if not isinstance(turn, list) or not turn:
            raise HarborTaskError(tid, file, f"turn {i} must be a non-empty list of calls")
        steps = []
        for j, call in enumerate(turn):
            where = f"turn {i} call {j}"
            if not isinstance(call, dict) or set(call) - {"name", "arguments"}:
                raise HarborTaskError(tid, file, f"{where} must be an object with name and "
                                      "arguments only")
            name, args = call.get("name"), call.get("arguments", {})
            if name not in ALL_TOOLS:
                raise HarborTaskError(tid, file, f"{where}: {name!r} is not a built-in tool "
                                      f"({', '.join(ALL_TOOLS)})")
            if not isinstance(args, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in args.items()):
                raise HarborTaskError(tid, file, f"{where}: arguments must map strings to "
                                      "strings")
            steps.append(Step(str(name), dict(args)))
        turns.append(tuple(steps))
    if [s.name for s in turns[-1]] != [FINISH]:
        raise HarborTaskError(tid, file, "the last turn must be one finish call")
    return tuple(turns)


def task_dirs(root: Path | str) -> list[Path]:
    """The task directories under `root` (or `root` itself when it is one, or a built-in
    set's name: `HARBOR_SETS`), by name."""
    root = set_root(root)
    if not root.is_dir():
        raise TaskError(f"task directory {str(root)!r} does not exist")
    if looks_like_task(root):
        return [root]
    split = split_dirs(root)
    if split is not None:
        return task_dirs(split[0]) + task_dirs(split[1])
    dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    found = [p for p in dirs if looks_like_task(p)]
    if not found:
        raise TaskError(f"{str(root)!r} holds no Harbor tasks (no subdirectory with a "
                        "task.toml or an instruction.md)")
    return found


def load_tasks(root: Path | str) -> list[Task]:
    """Every task under `root`; the first malformed one is refused (`tidal tasks check`
    lists them all)."""
    return [load_task(p) for p in task_dirs(root)]


def load_split(root: Path | str) -> TaskSet | None:
    """A set with its own split (`train/` and `heldout/` task directories, as the
    generated `shell-skills`) as a `TaskSet`; None when `root` has no such split."""
    path = set_root(root)
    split = split_dirs(path)
    if split is None:
        return None
    return TaskSet(str(root) if str(root) in GENERATED_SETS else path.name,
                   train=tuple(load_tasks(split[0])), heldout=tuple(load_tasks(split[1])))
