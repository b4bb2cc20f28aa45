"""`tidal tasks check`: does every task in a directory grade what it should?

For each task directory: it must load (instruction.md, task.toml, tests/test.sh, a
Dockerfile or a docker_image), its environment must build (tidal's own builder takes a
subset of Dockerfiles; the container engine takes them as written), its untouched
environment must earn less than 1 (else the tests pass without any agent), and its
oracle (solution/solve.sh, when the task has one) must earn exactly 1. Each check runs
in a fresh runtime built exactly as an episode's is, through the seam episodes use
(`tidal.agent.environment.TaskRuntimes`): a bubblewrap sandbox (`SandboxRuntimes`) or a
container (`tidal.agent.containers.ContainerRuntimes`), and is graded as an episode is,
after `end_agent`: a note says what the verifier ran in ("verifier: pristine, carrying
/app"). A problem names the file at fault.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tidal.agent.environment import TaskRuntimes
from tidal.agent.harbor import HarborTaskError, load_task, run_oracle, task_dirs
from tidal.agent.tasks import Grade, TaskError, prepare


@dataclass(frozen=True)
class Problem:
    file: str
    problem: str

    def to_dict(self) -> dict[str, str]:
        return {"file": self.file, "problem": self.problem}


@dataclass(frozen=True)
class TaskCheck:
    """One task's verdict: the two rewards (None when not measured) and its problems."""

    task: str
    oracle_reward: float | None = None
    untouched_reward: float | None = None
    problems: tuple[Problem, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, object]:
        return {"task": self.task, "ok": self.ok, "oracle_reward": self.oracle_reward,
                "untouched_reward": self.untouched_reward,
                "problems": [p.to_dict() for p in self.problems], "notes": list(self.notes)}


def _graded(grade: Grade, what: str) -> tuple[float | None, list[Problem]]:
    if grade.error is not None:
        return None, [Problem("tests/test.sh", f"{what}: {grade.error}")]
    return grade.reward, []


def check_task(path: Path, runtimes: TaskRuntimes) -> TaskCheck:
    """Load, build and grade one task directory twice: untouched and after the oracle."""
    try:
        task = load_task(path)
    except HarborTaskError as e:
        return TaskCheck(path.name, problems=(Problem(e.file, e.problem),))
    try:
        notes = runtimes.notes(task)
    except HarborTaskError as e:  # what the task declares and this runtime cannot give
        return TaskCheck(task.task_id, problems=(Problem(e.file, e.problem),))
    except TaskError as e:
        return TaskCheck(task.task_id, problems=(Problem("environment/Dockerfile",
                         str(e).removeprefix(f"task {task.task_id!r}: ")),))
    problems: list[Problem] = []
    with runtimes.runtime(task) as rt:
        prepare(task, rt)
        verifier = rt.end_agent(task.verifier_carry)
        untouched, found = _graded(task.grader.grade(rt), "untouched environment")
    problems += found
    if untouched is not None and untouched >= 1.0:
        problems.append(Problem("tests/test.sh", f"the untouched environment earns {untouched:g}: "
                                "the tests pass without any agent"))
    oracle = None
    if task.oracle is None:
        notes.append("no solution/solve.sh: the oracle is not checked")
    else:
        with runtimes.runtime(task) as rt:
            prepare(task, rt)
            why = run_oracle(task, rt)
            if why is not None:
                problems.append(Problem("solution/solve.sh", why))
            else:
                rt.end_agent(task.verifier_carry)  # graded as an agent's episode is
                oracle, found = _graded(task.grader.grade(rt), "after the oracle")
                problems += found
        if oracle is not None and oracle != 1.0:
            problems.append(Problem("tests/test.sh", f"the oracle earns {oracle:g}, not 1: the "
                                    "solution or the tests are wrong"))
    notes.append(f"verifier: {verifier}")
    return TaskCheck(task.task_id, oracle, untouched, tuple(problems), tuple(notes))


def check_tasks(root: Path | str, runtimes: TaskRuntimes, *, jobs: int = 2) -> list[TaskCheck]:
    """`check_task` for every task directory under `root`, `jobs` at a time, by name."""
    dirs: Sequence[Path] = task_dirs(root)
    with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="taskcheck") as pool:
        return list(pool.map(lambda p: check_task(p, runtimes), dirs))
