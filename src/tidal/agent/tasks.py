"""Tasks, the grader seam, built-in task sets, and demonstrations for a warm start.

A `Task` is a prompt, files to place in the runtime before the episode (`setup_files`),
a `Grader` that turns the runtime the episode left into a `Grade`, optionally the
environment its sandbox is built from (`environment`, for tasks in the Harbor format:
`tidal.agent.harbor`), and an ideal solution (the tool calls, turn by turn) from which
`demonstrations` builds the supervised warm-start conversations.

Graders (the `Grader` protocol: `grade(runtime, finished=...) -> Grade`):
- `FileChecks`, the built-in sets' grader: it inspects only the runtime's files after
  the episode: reward = fraction of checks passed, so a session that times out or is
  truncated keeps the credit for what it did (e.g. the file exists but holds the wrong
  text: 0.5);
- `tidal.agent.harbor.TestScript`: a task's tests/test.sh, run in the episode's sandbox.
A grader that cannot grade (a test script that writes no reward) returns a `Grade` with
`error` set: the session is masked, never punished, and counted.

Built-in sets (`load_taskset(name)`):
- `files` (the default): "Write 7 to cat.txt.": one `write_file` call, then `finish`.
  A digit and a file name (16 one-token words), 160 combinations; held-out
  combinations are unseen in training while each digit and name is seen. The skill is
  two independent slot look-ups (the only digit, the only name in the prompt): meant as
  the easiest structure that transfers to held-out tasks. Measured (docs/agent.md): a
  random-initialised tiny model learns the call format in 25-50 supervised steps, but
  the content was still at chance after 150 steps of 8 demonstrations. Partial credit:
  the right file with the wrong digit earns 0.5. The word is a different token in the
  prompt (" cat") than in the path ("cat"), while a digit is the same token in both:
  the name is the hard half (docs/agent.md, "Why RL plateaus").
- `digits`: copy a 3-digit number, reverse it, or write its largest digit ("Write 471
  reversed to answer.txt."); held-out numbers never appear in training. Qwen's
  tokenizer splits numbers into digits, so this is positional copying of digit tokens
  (not learnt by the tiny model after 800 demonstrations either); for larger models.
- `tools`: small tasks that need bash (count lines of a file), a subagent (ask a helper,
  write its answer) or many steps (write several files in parallel calls; with a small
  context budget this exercises compaction). A tiny model will rarely solve them: they
  exist to run every code path end to end, and for real models.
- `mixed`: `files` with the `tools` tasks added to training (held-out is `files`).

Teachers (`taught`): the warm start imitates the tasks' solutions as given (`exact`),
or (`mixed`, the default of `tidal run`) also a sloppy copy of each whose written files
end with a period. The sloppy copy leaves the warm-started model a habit that costs
reward on every task alike, so that RL has a decision to learn that transfers to
held-out tasks; on `files` with the exact teacher alone, RL gains little (docs/agent.md).

Deliberately simplified:
- Checks are file checks (exists / equals after stripping surrounding whitespace /
  contains), plus, for episodes run by the harness, whether the agent called `finish`
  (a session that runs out of turns or time keeps the credit of its files). The `finish`
  answer's content is not graded, so that partial progress is always visible in the
  files.
- Demonstrations of tools tasks are single conversations without compaction; the
  subagent's own conversation is returned as a separate demonstration.
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from tidal.agent.runtime import LocalDirRuntime, ToolRuntime
from tidal.agent.tools import (
    ALL_TOOLS,
    BASH,
    FINISH,
    SPAWN_SUBAGENT,
    WRITE_FILE,
    ToolCall,
    run_runtime_tool,
)

DEFAULT_SYSTEM_PROMPT = "You are an agent. Use the tools to do the task, then call finish."
SUBAGENT_TOOLS: tuple[str, ...] = tuple(t for t in ALL_TOOLS if t != SPAWN_SUBAGENT)


class TaskError(ValueError):
    """A task or task set is malformed, or an unknown task set was asked for."""


# --------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class FileExists:
    path: str
    kind: ClassVar[str] = "exists"

    def describe(self) -> str:
        return f"{self.path} exists"


@dataclass(frozen=True)
class FileEquals:
    """The file's text, stripped of surrounding whitespace, equals `expected`."""

    path: str
    expected: str
    kind: ClassVar[str] = "equals"

    def describe(self) -> str:
        return f"{self.path} == {self.expected!r}"


@dataclass(frozen=True)
class FileContains:
    path: str
    substring: str
    kind: ClassVar[str] = "contains"

    def describe(self) -> str:
        return f"{self.path} contains {self.substring!r}"


Check = FileExists | FileEquals | FileContains


@dataclass(frozen=True)
class Step:
    """One ideal tool call. `result` overrides the tool result in demonstrations (used
    for `spawn_subagent`, whose result is the helper's answer)."""

    name: str
    arguments: Mapping[str, str]
    result: str | None = None


@dataclass(frozen=True)
class Grade:
    """reward = partial_score = what the grader gave (for file checks: the fraction of
    checks passed); details: check -> passed; by_kind: fraction passed of each kind of
    check (exists, equals, contains, finished; `tests` for a test script), which says
    across tasks what an agent gets right and what it misses. `error`, when set, says
    why the grader could not grade (the session is then masked); `extra` holds what the
    grader reported beyond the reward (a test script's reward.json numbers, its output)."""

    reward: float
    partial_score: float
    details: dict[str, bool]
    by_kind: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def success(self) -> bool:
        return self.error is None and all(self.details.values()) and self.reward >= 1.0


@runtime_checkable
class Grader(Protocol):
    """Grades an episode from the runtime it left. `finished` says whether the agent
    ended the session itself (the built-in harness's `finish`; None when unknown);
    graders that judge only the outcome ignore it. Never raises for what the agent did:
    a grader that cannot grade returns a `Grade` with `error` set."""

    def grade(self, runtime: ToolRuntime, *, finished: bool | None = None) -> Grade: ...


@dataclass(frozen=True)
class EnvironmentSpec:
    """How a task's sandbox is made (the Harbor `[environment]` table and `environment/`
    directory): a Dockerfile and its build context, or a prebuilt `docker_image`
    reference (mapped to a local image directory by the run's `[environment] images`);
    the working directory of every command (None: the Dockerfile's last WORKDIR, else
    /app) and their variables; resources and network policy (bubblewrap sandboxes have
    no network whatever the task asks: the verdict says so)."""

    dockerfile: Path | None = None
    context: Path | None = None
    docker_image: str | None = None
    workdir: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    network_mode: str = "no-network"  # Harbor's: no-network, public or allowlist
    allowed_hosts: tuple[str, ...] = ()  # what allowlist lets through
    build_timeout_s: float = 600.0


@dataclass(frozen=True)
class SeparateVerifier:
    """Harbor's separate verifier (`[verifier] environment_mode = "separate"`, or a
    `[verifier.environment]` table): the grader runs in a fresh environment of its own,
    which holds of the agent's only `Task.verifier_carry` (the task's declared artifacts).
    `environment` is that environment's own image and resources (a tests/Dockerfile
    built with tests/ as its context, or `[verifier.environment]`); None: a fresh copy of
    the task's own environment. `origin` says which, for a verdict; `file` is where it is
    declared, for a refusal."""

    environment: EnvironmentSpec | None = None
    origin: str = "a fresh copy of the task's environment"
    file: str = "task.toml"

    def describe(self) -> str:
        """What a verdict says the verifier ran in: "separate (tests/Dockerfile)"."""
        return f"separate ({self.origin})"


@dataclass(frozen=True)
class Oracle:
    """A task's reference solution as a script: `directory/solve.sh`, run from the
    working directory with `env` (Harbor's solution/ and `[solution] env`)."""

    directory: Path
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Task:
    """One task. `time_limit_s`, when set, is the task's own wall-clock limit for the
    agent (Harbor's `[agent] timeout_sec`); `oracle` its reference solution script;
    `source` the directory it was read from. `verifier_carry` is what the grader sees
    of the agent's environment (`ToolRuntime.end_agent`): None all of it (the built-in
    file checks, which only read files), else a fresh environment from the pristine
    image with only these paths carried over, () for the working directory (a Harbor
    task's default: its test.sh runs commands). `separate_verifier`, when set, is the
    environment that fresh one is made from instead (Harbor's separate mode)."""

    task_id: str
    prompt: str
    grader: Grader
    setup_files: Mapping[str, str] = field(default_factory=dict)
    solution: tuple[tuple[Step, ...], ...] = ()  # turns of ideal tool calls; last is finish
    family: str = ""
    environment: EnvironmentSpec | None = None
    time_limit_s: float | None = None
    oracle: Oracle | None = None
    source: Path | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    verifier_carry: tuple[str, ...] | None = None
    separate_verifier: SeparateVerifier | None = None

    def __post_init__(self) -> None:
        if not self.task_id or not self.prompt.strip():
            raise TaskError(f"task {self.task_id!r}: task_id and prompt must be non-empty")
        if not isinstance(self.grader, Grader):
            raise TaskError(f"task {self.task_id!r}: grader {self.grader!r} has no grade()")
        if self.solution and [s.name for s in self.solution[-1]] != [FINISH]:
            raise TaskError(f"task {self.task_id!r}: the solution's last turn must be finish")
        if self.separate_verifier is not None and self.verifier_carry is None:
            raise TaskError(f"task {self.task_id!r}: a separate verifier needs verifier_carry "
                            "(the paths it gets of the agent's environment)")


@dataclass(frozen=True)
class TaskSet:
    name: str
    train: tuple[Task, ...]
    heldout: tuple[Task, ...]

    def __post_init__(self) -> None:
        ids = [t.task_id for t in self.train + self.heldout]
        if len(set(ids)) != len(ids):
            raise TaskError(f"task set {self.name!r}: task ids are not unique")
        if not self.train or not self.heldout:
            raise TaskError(f"task set {self.name!r}: train and heldout must be non-empty")


def prepare(task: Task, runtime: ToolRuntime) -> None:
    """Place the task's setup files in a fresh runtime."""
    for path, text in task.setup_files.items():
        runtime.write_file(path, text)


def _read(runtime: ToolRuntime, path: str) -> str | None:
    try:
        return runtime.read_file(path)
    except FileNotFoundError:
        return None


def check_passes(check: Check, runtime: ToolRuntime) -> bool:
    text = _read(runtime, check.path)
    if text is None:
        return False
    if isinstance(check, FileEquals):
        return text.strip() == check.expected.strip()
    if isinstance(check, FileContains):
        return check.substring in text
    return True


FINISHED = "called finish"


@dataclass(frozen=True)
class FileChecks:
    """The built-in grader: file checks, and with `finished` (did the agent end the
    session by calling finish?) one more check. Without it, a policy loses nothing by
    never finishing, and RL learns to let sessions run out of turns."""

    checks: tuple[Check, ...]

    def __post_init__(self) -> None:
        if not self.checks:
            raise TaskError("FileChecks needs at least one check")

    def grade(self, runtime: ToolRuntime, *, finished: bool | None = None) -> Grade:
        passed = [(c.kind, c.describe(), check_passes(c, runtime)) for c in self.checks]
        if finished is not None:
            passed.append(("finished", FINISHED, finished))
        details = {name: ok for _, name, ok in passed}
        kinds: dict[str, list[bool]] = {}
        for kind, _, ok in passed:
            kinds.setdefault(kind, []).append(ok)
        score = sum(details.values()) / len(details)
        return Grade(
            reward=score,
            partial_score=score,
            details=details,
            by_kind={k: sum(v) / len(v) for k, v in kinds.items()},
        )


def grade(task: Task, runtime: ToolRuntime, *, finished: bool | None = None) -> Grade:
    """Grade an episode with its task's grader."""
    return task.grader.grade(runtime, finished=finished)


# --------------------------------------------------------------------------- demonstrations


@dataclass(frozen=True)
class Demonstration:
    """One ideal session as chat messages (OpenAI format; tool-call arguments as JSON
    objects, as chat templates render them), with the tools that session is offered.

    Render with `tokenizer.apply_chat_template(messages, tools=tool_schemas(tools))`:
    Qwen2.5's template then writes each call as
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, the text the
    gateway parses (see `tools.format_tool_call_text`).
    """

    role: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[str, ...]


def _assistant(turn: Sequence[Step], first_id: int) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": f"call_{first_id + i}",
                "type": "function",
                "function": {"name": s.name, "arguments": dict(s.arguments)},
            }
            for i, s in enumerate(turn)
        ],
    }


def _conversation(
    prompt: str,
    solution: Sequence[Sequence[Step]],
    setup_files: Mapping[str, str],
    system_prompt: str,
    runtime: ToolRuntime | None = None,
) -> tuple[dict[str, Any], ...]:
    if runtime is None:
        with tempfile.TemporaryDirectory(prefix="tidal-demo-") as tmp:
            return _conversation(prompt, solution, setup_files, system_prompt,
                                 LocalDirRuntime(Path(tmp)))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": prompt},
    ]
    n = 0
    for path, text in setup_files.items():
        runtime.write_file(path, text)
    for turn in solution:
        messages.append(_assistant(turn, n))
        for i, step in enumerate(turn):
            if step.name == FINISH:
                break
            if step.result is not None:
                result = step.result
            else:
                call = ToolCall(f"call_{n + i}", step.name, dict(step.arguments))
                result = run_runtime_tool(call, runtime, timeout_s=10.0, output_cap=8000)
            messages.append({"role": "tool", "tool_call_id": f"call_{n + i}", "content": result})
        n += len(turn)
    return tuple(messages)


def demonstrations(task: Task, system_prompt: str = DEFAULT_SYSTEM_PROMPT,
                   runtime: ToolRuntime | None = None) -> list[Demonstration]:
    """The ideal sessions for a task: the main session first, then one per subagent.

    Tool results are real: the solution runs through the same tool code as the harness,
    in `runtime` (a fresh one made from the task's environment, as its episodes get:
    `tidal.run.rollout.Rollouts.demonstrations`) or, without one, in a scratch
    `LocalDirRuntime` holding the task's setup files, so the warm start sees the texts
    the agent will see.
    """
    if not task.solution:
        raise TaskError(f"task {task.task_id!r} has no solution to demonstrate")
    demos = [
        Demonstration(
            "main",
            _conversation(task.prompt, task.solution, task.setup_files, system_prompt, runtime),
            ALL_TOOLS,
        )
    ]
    for turn in task.solution:
        for step in turn:
            if step.name == SPAWN_SUBAGENT and step.result is not None:
                sub = ((Step(FINISH, {"answer": step.result}),),)
                demos.append(
                    Demonstration(
                        "subagent",
                        _conversation(step.arguments["task_description"], sub, {}, system_prompt),
                        SUBAGENT_TOOLS,
                    )
                )
    return demos


TEACHERS: tuple[str, ...] = ("exact", "mixed")


def with_trailing_period(task: Task) -> Task:
    """The task as a sloppy teacher solves it: every file it writes ends with a period
    ("7." for "7"), which a `FileEquals` check does not accept."""
    solution = tuple(
        tuple(
            replace(s, arguments={**s.arguments, "content": s.arguments["content"] + "."})
            if s.name == WRITE_FILE
            else s
            for s in turn
        )
        for turn in task.solution
    )
    return replace(task, solution=solution)


def taught(tasks: Sequence[Task], teacher: str) -> list[Task]:
    """The tasks whose solutions the warm start imitates.

    - `exact`: every task once, solved as its checks require.
    - `mixed`: every task twice, once exactly and once by the sloppy teacher of
      `with_trailing_period`. The warm-started model then ends what it writes with a
      period about half the time, on every task alike: a decision that RL can learn from
      any training task and that carries over to held-out ones unchanged
      (docs/agent.md, "The mixed teacher").
    """
    if teacher not in TEACHERS:
        raise TaskError(f"unknown teacher {teacher!r}; known: {list(TEACHERS)}")
    if teacher == "exact":
        return list(tasks)
    return list(tasks) + [with_trailing_period(t) for t in tasks]


# --------------------------------------------------------------------------- built-in sets

DIGIT_FAMILIES: dict[str, tuple[str, Any]] = {
    "copy": ("Write {n} to answer.txt.", lambda s: s),
    "reverse": ("Write {n} reversed to answer.txt.", lambda s: s[::-1]),
    "max": ("Write the largest digit of {n} to answer.txt.", max),
}


def _answer_task(task_id: str, prompt: str, answer: str, family: str) -> Task:
    return Task(
        task_id=task_id,
        prompt=prompt,
        grader=FileChecks((FileExists("answer.txt"), FileEquals("answer.txt", answer))),
        solution=(
            (Step(WRITE_FILE, {"path": "answer.txt", "content": answer}),),
            (Step(FINISH, {"answer": answer}),),
        ),
        family=family,
    )


def digits_tasks(numbers: Sequence[str], families: Sequence[str]) -> list[Task]:
    tasks = []
    for fam in families:
        if fam not in DIGIT_FAMILIES:
            raise TaskError(f"unknown digits family {fam!r}; known: {list(DIGIT_FAMILIES)}")
        template, fn = DIGIT_FAMILIES[fam]
        for n in numbers:
            tasks.append(_answer_task(f"{fam}-{n}", template.format(n=n), fn(n), fam))
    return tasks


def digits_taskset(
    *,
    seed: int = 0,
    n_heldout_numbers: int = 30,
    families: Sequence[str] = tuple(DIGIT_FAMILIES),
) -> TaskSet:
    """All 3-digit numbers 100-999, split by number: held-out numbers never appear in
    training prompts (for any family)."""
    numbers = [str(i) for i in range(100, 1000)]
    random.Random(seed).shuffle(numbers)
    if not 0 < n_heldout_numbers < len(numbers):
        raise TaskError(f"n_heldout_numbers must be in 1..{len(numbers) - 1}")
    held, train = numbers[:n_heldout_numbers], numbers[n_heldout_numbers:]
    return TaskSet(
        "digits",
        train=tuple(digits_tasks(train, families)),
        heldout=tuple(digits_tasks(held, families)),
    )


FILE_WORDS: tuple[str, ...] = (
    "cat", "dog", "sun", "map", "box", "red", "car", "pen",
    "cup", "key", "hat", "bed", "bag", "egg", "fox", "ink",
)  # fmt: skip  # each is one token both as " cat" (prompt) and "cat" (in the JSON path)


def files_taskset(*, seed: int = 0, heldout_fraction: float = 0.2) -> TaskSet:
    """ "Write 7 to cat.txt.": a digit and a file name, 10 x 16 combinations. Held-out
    combinations are unseen, while every digit and every name occurs in training."""
    combos = [(d, w) for d in "0123456789" for w in FILE_WORDS]
    rng = random.Random(seed)
    while True:
        rng.shuffle(combos)
        k = max(1, round(heldout_fraction * len(combos)))
        held, train = combos[:k], combos[k:]
        if {d for d, _ in train} == set("0123456789") and {w for _, w in train} == set(FILE_WORDS):
            break

    def make(d: str, w: str) -> Task:
        path = f"{w}.txt"
        return Task(
            task_id=f"file-{w}-{d}",
            prompt=f"Write {d} to {path}.",
            grader=FileChecks((FileExists(path), FileEquals(path, d))),
            solution=(
                (Step(WRITE_FILE, {"path": path, "content": d}),),
                (Step(FINISH, {"answer": d}),),
            ),
            family="file",
        )

    return TaskSet(
        "files",
        train=tuple(make(d, w) for d, w in train),
        heldout=tuple(make(d, w) for d, w in held),
    )


def count_lines_task(task_id: str, n_lines: int) -> Task:
    data = "".join(f"row {i}\n" for i in range(n_lines))
    return Task(
        task_id=task_id,
        prompt="Count the lines in data.txt and write the count to answer.txt.",
        grader=FileChecks((FileExists("answer.txt"), FileEquals("answer.txt", str(n_lines)))),
        setup_files={"data.txt": data},
        solution=(
            (Step(BASH, {"command": "wc -l < data.txt"}),),
            (Step(WRITE_FILE, {"path": "answer.txt", "content": str(n_lines)}),),
            (Step(FINISH, {"answer": str(n_lines)}),),
        ),
        family="bash",
    )


def subagent_task(task_id: str, number: str) -> Task:
    answer = number[::-1]
    sub = f"Reply with {number} reversed."
    return Task(
        task_id=task_id,
        prompt=f"Ask a helper for {number} reversed, then write its answer to answer.txt.",
        grader=FileChecks((FileExists("answer.txt"), FileEquals("answer.txt", answer))),
        solution=(
            (Step(SPAWN_SUBAGENT, {"task_description": sub}, result=answer),),
            (Step(WRITE_FILE, {"path": "answer.txt", "content": answer}),),
            (Step(FINISH, {"answer": answer}),),
        ),
        family="subagent",
    )


def many_files_task(task_id: str, n_files: int) -> Task:
    """Several files, written in parallel tool calls; partial credit per file."""
    names = [f"f{i}.txt" for i in range(1, n_files + 1)]
    return Task(
        task_id=task_id,
        prompt=f"Create files f1.txt to f{n_files}.txt, each holding its own number.",
        grader=FileChecks(tuple(FileEquals(n, str(i)) for i, n in enumerate(names, 1))),
        solution=(
            tuple(Step(WRITE_FILE, {"path": n, "content": str(i)}) for i, n in enumerate(names, 1)),
            (Step(FINISH, {"answer": "done"}),),
        ),
        family="steps",
    )


def tools_taskset(seed: int = 0) -> TaskSet:
    rng = random.Random(seed)
    train: list[Task] = []
    heldout: list[Task] = []
    for split, k in ((train, 8), (heldout, 3)):
        tag = "train" if split is train else "heldout"
        for i in range(k):
            split.append(count_lines_task(f"bash-{tag}-{i}", rng.randint(2, 9)))
            split.append(subagent_task(f"subagent-{tag}-{i}", str(rng.randint(100, 999))))
            split.append(many_files_task(f"steps-{tag}-{i}", rng.randint(3, 6)))
    return TaskSet("tools", train=tuple(train), heldout=tuple(heldout))


def mixed_taskset(seed: int = 0) -> TaskSet:
    files, tools = files_taskset(seed=seed), tools_taskset(seed=seed)
    return TaskSet("mixed", train=files.train + tools.train, heldout=files.heldout)


TASK_SETS: dict[str, Callable[..., TaskSet]] = {
    "files": files_taskset,
    "digits": digits_taskset,
    "tools": tools_taskset,
    "mixed": mixed_taskset,
}


DEFAULT_TASKSET = "files"


def load_taskset(name: str = DEFAULT_TASKSET, seed: int = 0) -> TaskSet:
    if name not in TASK_SETS:
        raise TaskError(f"unknown task set {name!r}; built-in sets: {sorted(TASK_SETS)}")
    return TASK_SETS[name](seed=seed)
