"""shell-skills: the generated set loads as Harbor tasks, is byte-identical on rerun, keeps
its held-out pools apart from training, and its graders give exactly the partial credit
they promise (test.sh, solve.sh and the tool-call solutions run directly, no sandbox)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tidal.agent.containers import from_references
from tidal.agent.harbor import load_tasks
from tidal.agent.shellskills import (
    _POOLS,
    BASE_IMAGE,
    COMPLETE_MARKER,
    MAX_FILE_BYTES,
    SHELL_SKILLS_VERSION,
    SKILLS,
    SPLITS,
    _Table,
    ensure_shell_skills,
    generate,
)
from tidal.sandbox.dockerfile import parse_dockerfile

ANSWER_SKILLS = [s for s in SKILLS if s not in ("fix-config", "rename-ext")]
COUNTS = {"train": 30, "heldout": 8}
# two tasks per skill and split: the first and the last
SAMPLE = [(split, skill, i) for split in SPLITS for skill in SKILLS
          for i in (0, COUNTS[split] - 1)]
SAMPLE_IDS = [f"{skill}-{split}-{i}" for split, skill, i in SAMPLE]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shellskills") / "set"
    generate(out)
    return out


@pytest.fixture(scope="module")
def fast_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PATH entry whose python3 is this interpreter (not a slow pyenv shim)."""
    d = tmp_path_factory.mktemp("bin")
    (d / "python3").symlink_to(os.path.realpath(sys.executable))
    return d


def _task(root: Path, split: str, skill: str, i: int) -> Path:
    return root / split / f"{skill}-{split}-{i:03d}"


def _expected(task: Path) -> dict[str, Any]:
    return json.loads((task / "tests" / "expected.json").read_text())


def _commands(task: Path) -> list[str]:
    turns = json.loads((task / "solution" / "tool_calls.json").read_text())
    return [c["arguments"]["command"] for turn in turns for c in turn if c["name"] == "bash"]


class App:
    """A copy of a task's environment/files as a stand-in /app, graded by the real
    tests/test.sh through the SHELL_SKILLS_* overrides."""

    def __init__(self, task: Path, tmp: Path, fast_bin: Path) -> None:
        self.task, self.dir = task, tmp / "app"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(task / "environment" / "files", self.dir)
        self.reward_file = tmp / "logs" / "reward.txt"
        self.env = {**os.environ, "PATH": f"{fast_bin}{os.pathsep}{os.environ['PATH']}",
                    "SHELL_SKILLS_APP": str(self.dir),
                    "SHELL_SKILLS_TESTS": str(task / "tests"),
                    "SHELL_SKILLS_REWARD": str(self.reward_file)}

    def bash(self, script: str) -> None:
        r = subprocess.run(["bash", "-c", script], cwd=self.dir, env=self.env,
                           capture_output=True, text=True, timeout=30, check=False)
        assert r.returncode == 0, (script, r.stderr)

    def reward(self) -> float:
        self.reward_file.unlink(missing_ok=True)
        r = subprocess.run(["bash", str(self.task / "tests" / "test.sh")], cwd=self.dir,
                           env=self.env, capture_output=True, text=True, timeout=30,
                           check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "grader error" not in r.stdout, r.stdout
        return float(self.reward_file.read_text())


# --------------------------------------------------------------------------- the set


def test_the_set_loads_as_harbor_tasks_with_every_skill(root: Path) -> None:
    for split in SPLITS:
        tasks = load_tasks(root / split)
        assert len(tasks) == len(SKILLS) * COUNTS[split]
        assert Counter(t.family for t in tasks) == dict.fromkeys(SKILLS, COUNTS[split])
        for t in tasks:
            assert re.fullmatch(rf"({'|'.join(SKILLS)})-{split}-\d{{3}}", t.task_id)
            assert t.task_id.startswith(t.family + "-")
            assert t.metadata["name"] == f"tidal/shell-skills-{t.task_id}"
            meta = t.metadata["metadata"]
            assert meta["split"] == split and meta["category"] == t.family
            assert meta["tags"] == ["shell", t.family] and meta["difficulty"] == "easy"
            env = t.environment
            assert env is not None and env.workdir == "/app" and env.memory_mb == 512
            assert env.network_mode == "no-network" and t.time_limit_s == 180.0
            assert t.oracle is not None
            assert 10 <= len(t.prompt.split()) <= 45, t.prompt
            assert "answer.txt" in t.prompt or t.family in ("fix-config", "rename-ext")
    assert f"shell-skills v{SHELL_SKILLS_VERSION}" in (root / "README.md").read_text()


def test_answers_stay_out_of_the_environment_and_solutions_match(root: Path) -> None:
    dockerfile = ('FROM python:3.11-slim-bookworm\nLABEL tidal.image="default"\nWORKDIR /app\n'
                  "COPY files/ /app/\n")
    assert from_references(dockerfile) == [BASE_IMAGE] == ["python:3.11-slim-bookworm"]
    assert parse_dockerfile(dockerfile, "Dockerfile").declares_default_image
    for task in sorted(p for split in SPLITS for p in (root / split).iterdir()):
        env = task / "environment"
        assert (env / "Dockerfile").read_text() == dockerfile
        assert sorted(p.name for p in env.iterdir()) == ["Dockerfile", "files"]
        for f in (env / "files").rglob("*"):
            assert f.name not in ("answer.txt", "expected.json"), f
            assert not f.is_file() or f.stat().st_size <= MAX_FILE_BYTES, f
        turns = json.loads((task / "solution" / "tool_calls.json").read_text())
        assert turns[-1] == [{"name": "finish", "arguments": {"answer": "done"}}]
        assert 2 <= len(turns) <= 3 and all(len(t) == 1 for t in turns)
        assert all(isinstance(v, str) for t in turns for c in t for v in c["arguments"].values())
        solve = (task / "solution" / "solve.sh").read_text().splitlines()
        assert solve[-len(turns) + 1:] == _commands(task)
        assert os.access(task / "solution" / "solve.sh", os.X_OK)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_generation_is_byte_identical_for_a_seed(root: Path, tmp_path: Path) -> None:
    generate(tmp_path / "again")
    assert _tree(tmp_path / "again") == _tree(root)
    generate(tmp_path / "other", seed=1, train_per_skill=2, heldout_per_skill=1)
    other, base = _tree(tmp_path / "other"), _tree(root)
    assert sum(other[k] != base.get(k) for k in other if "expected" in k) >= 8
    with pytest.raises(FileExistsError):
        generate(tmp_path / "again")


# --------------------------------------------------------------------------- held-out


def _pool_names(skill: str, pool: Any) -> set[str]:
    """The names a held-out task may not share with training: files, dirs, searched
    words, codes, column names, row keys, JSON and config keys, extensions, stems."""
    if isinstance(pool, tuple) and isinstance(pool[0], _Table):
        return {x for t in pool for x in (*t.files, t.key, *t.keys, *t.columns)}
    names: set[str] = set()
    for k, v in pool.items():
        if k == "sections":
            names |= set(v) | {key for keys in v.values() for key in keys}
        elif k == "subsections":
            names |= {x for sub, keys in v.values() for x in (sub, *keys)}
        elif k == "keys":
            names |= set(v)
        elif k == "pairs":
            names |= {e for pair in v for e in pair}
        else:
            names |= set(v)
    assert names, skill
    return names


def test_heldout_pools_share_nothing_with_training() -> None:
    for skill in SKILLS:
        train = _pool_names(skill, _POOLS["train"][skill])
        heldout = _pool_names(skill, _POOLS["heldout"][skill])
        assert not train & heldout, (skill, train & heldout)


def _facts(task: Path) -> dict[str, set[str]]:
    facts = _expected(task)["facts"]
    return {k: set(map(str, v)) if isinstance(v, list) else {str(v)} for k, v in facts.items()}


def test_heldout_tasks_differ_from_training_and_vary(root: Path) -> None:
    for skill in SKILLS:
        seen: dict[str, dict[str, set[str]]] = {s: {} for s in SPLITS}
        outcomes: list[str] = []
        for split in SPLITS:
            for i in range(COUNTS[split]):
                task = _task(root, split, skill, i)
                for k, v in _facts(task).items():
                    seen[split].setdefault(k, set()).update(v)
                if split == "heldout":
                    outcomes.append((task / "tests" / "expected.json").read_text())
        assert seen["train"].keys() == seen["heldout"].keys()
        for k, train in seen["train"].items():
            assert not train & seen["heldout"][k], (skill, k, train & seen["heldout"][k])
        assert len(set(outcomes)) == len(outcomes), skill  # no two held-out tasks alike
        if skill in ANSWER_SKILLS:
            answers = Counter(json.loads(o)["answer"] for o in outcomes)
            assert len(answers) >= 4, (skill, answers)  # no constant answer gets far


# --------------------------------------------------------------------------- graders


@pytest.mark.parametrize("case", SAMPLE, ids=SAMPLE_IDS)
def test_graders_give_the_promised_partial_credit(root: Path, fast_bin: Path, tmp_path: Path,
                                                  case: tuple[str, str, int]) -> None:
    task = _task(root, *case)
    skill = case[1]
    exp = _expected(task)
    app = App(task, tmp_path / "a", fast_bin)
    untouched = app.reward()
    app.bash(f"bash {task / 'solution' / 'solve.sh'}")
    assert app.reward() == 1.0
    if skill in ANSWER_SKILLS:
        assert untouched == 0.0
        (app.dir / "answer.txt").write_text("not it\n")
        assert app.reward() == 0.25
        (app.dir / "answer.txt").write_text(f"  {exp['answer']}\n\n")
        assert app.reward() == 1.0
        if skill == "find-file":
            for prefix in ("./", "/app/"):
                (app.dir / "answer.txt").write_text(prefix + exp["answer"] + "\n")
                assert app.reward() == 1.0
        (app.dir / "answer.txt").unlink()
        assert app.reward() == 0.0
    elif skill == "fix-config":
        assert untouched == 0.0  # doing nothing earns nothing
        conf = app.dir / exp["file"]
        lines = conf.read_text().splitlines(keepends=True)
        other = next(n for n, line in enumerate(lines) if not line.startswith(exp["key"] + "="))
        conf.write_text("".join(lines[:other] + lines[other + 1:]))
        assert app.reward() == 0.6
        conf.unlink()
        assert app.reward() == 0.0
    else:
        n, moved = len(exp["files"]), sorted(f for f in exp["files"]
                                             if f.endswith("." + exp["from"]))
        others = n - len(moved)
        assert untouched == 0.0  # doing nothing earns nothing
        half = App(task, tmp_path / "b", fast_bin)
        for name in moved[: len(moved) // 2 + 1]:
            src = half.dir / exp["dir"] / name
            src.rename(src.with_suffix("." + exp["to"]))
        done = len(moved) // 2 + 1
        assert half.reward() == pytest.approx(done / len(moved), abs=1e-5)
        (half.dir / exp["dir"] / moved[0]).write_text("overwritten\n")  # a stray copy left
        assert half.reward() == pytest.approx((done - 1) / len(moved), abs=1e-5)
        if others:
            other = next(f for f in exp["files"] if not f.endswith("." + exp["from"]))
            (half.dir / exp["dir"] / other).unlink()  # a file it should have left alone
            assert half.reward() == pytest.approx(
                (done - 1) / len(moved) * (others - 1) / others, abs=1e-5)


@pytest.mark.parametrize("case", SAMPLE, ids=SAMPLE_IDS)
def test_tool_call_solutions_reach_full_reward(root: Path, fast_bin: Path, tmp_path: Path,
                                               case: tuple[str, str, int]) -> None:
    task = _task(root, *case)
    app = App(task, tmp_path / "a", fast_bin)
    for command in _commands(task):  # each call starts in /app, as the harness's bash does
        app.bash(command)
    assert app.reward() == 1.0


# --------------------------------------------------------------------------- the cache


def test_ensure_generates_once_and_then_returns_at_once(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "x"
    assert ensure_shell_skills(target) == target
    marker = target / COMPLETE_MARKER
    stamp = marker.stat().st_mtime_ns
    assert len(list((target / "train").iterdir())) == 240
    assert len(list((target / "heldout").iterdir())) == 64
    assert ensure_shell_skills(target) == target and marker.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["x"]  # no .partial-<pid> left behind

    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    default = ensure_shell_skills()
    assert default == tmp_path / "cache" / "tasksets" / f"shell-skills-v{SHELL_SKILLS_VERSION}"
    assert (default / COMPLETE_MARKER).is_file()
    assert _tree(default) == _tree(target)


# --------------------------------------------------------------------------- in the sandbox


@pytest.mark.parametrize("skill", SKILLS)
def test_in_the_real_sandbox_the_demonstration_earns_full_reward(
        root: Path, tmp_path: Path, skill: str) -> None:
    """One held-out task per skill, as an episode gets it: the sandbox built from its
    environment/, graded by its test.sh. Untouched it earns 0; the demonstration's tool
    calls, run there by the harness's own tool code (what the warm start trains on),
    earn 1.0 and see the real outputs."""
    from tidal.agent.environment import Environments
    from tidal.agent.sandboxed import sandboxed_runtime
    from tidal.agent.tasks import demonstrations, prepare
    from tidal.sandbox import Limits, SandboxConfig
    from tidal.sandbox.build import build_environment

    (task,) = load_tasks(_task(root, "heldout", skill, 0))
    envs = Environments({}, None, tmp_path / "cache")
    env = envs.environment(task)  # on the default image, as its LABEL declares: no mapping
    assert env is not None and env.image is None and env.declared_for == BASE_IMAGE
    old = tmp_path / "old" / "Dockerfile"  # what the set said before it named BASE_IMAGE
    old.parent.mkdir()
    old.write_text("FROM tidal/default\nWORKDIR /app\nCOPY files/ /app/\n")
    assert task.environment is not None and task.environment.context is not None
    before = build_environment(old, context=task.environment.context, images={},
                               fallback=None, cache_dir=tmp_path / "cache")
    assert (before.key, before.layers, before.built) == (env.key, env.layers, False)
    limits = Limits(memory_bytes=256 << 20, cpu_s=60.0, wall_s=60.0, disk_bytes=64 << 20)
    config = envs.sandbox_config(task, SandboxConfig(limits=limits))
    with sandboxed_runtime(config) as rt:
        prepare(task, rt)
        grade = task.grader.grade(rt)
        assert grade.error is None and grade.reward == 0.0, grade
    with sandboxed_runtime(config) as rt:
        prepare(task, rt)
        (demo,) = demonstrations(task, runtime=rt)
        grade = task.grader.grade(rt)
        assert grade.error is None and grade.reward == 1.0, grade.extra
    results = [m["content"] for m in demo.messages if m["role"] == "tool"]
    assert results and all(r.startswith("exit code 0") for r in results), results
    if skill in ("csv-field", "sum-column"):  # the header it looked at first
        assert results[0].splitlines()[1].count(",") >= 2
