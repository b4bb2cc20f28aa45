"""swe-mini, the built-in set of small repositories to fix: every task's oracle earns 1 and
its untouched repository less (through the same `tidal tasks check` a user runs), and
the set is as varied as it claims."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest

from tidal.agent.containers import from_references
from tidal.agent.environment import Environments, SandboxRuntimes
from tidal.agent.harbor import HARBOR_SETS, VerifierScript, load_task, load_tasks
from tidal.agent.sandboxed import sandboxed_runtime
from tidal.agent.taskcheck import check_tasks
from tidal.agent.tasks import TaskError
from tidal.sandbox import Limits, Sandbox, SandboxConfig
from tidal.sandbox.build import build_environment
from tidal.sandbox.dockerfile import DEFAULT_IMAGE_REF, parse_dockerfile

SWE_MINI = HARBOR_SETS["swe-mini"]


def test_swe_mini_is_varied_and_well_formed() -> None:
    tasks = load_tasks("swe-mini")
    assert len(tasks) >= 30
    kinds = Counter(t.metadata["metadata"]["tags"][1] for t in tasks)
    for kind in ("off-by-one", "wrong-condition", "missing-edge-case", "api-misuse", "parsing",
                 "state", "implement"):
        assert kinds[kind] >= 4, kinds
    for t in tasks:
        assert isinstance(t.grader, VerifierScript) and t.oracle is not None
        assert t.environment is not None and t.environment.workdir == "/app"
        repo = SWE_MINI / t.task_id / "environment" / "repo"
        lines = sum(len(p.read_text().splitlines()) for p in repo.rglob("*.py"))
        assert 30 <= lines <= 300, (t.task_id, lines)
        assert list((repo / "tests").glob("test_*.py")), t.task_id  # its own tests


@pytest.mark.slow
def test_every_swe_mini_oracle_earns_1_and_no_untouched_repository_does(tmp_path: Path) -> None:
    results = check_tasks("swe-mini", SandboxRuntimes(
        sandboxed_runtime, SandboxConfig(limits=Limits(cpu_s=600.0)),
        Environments({}, None, tmp_path / "envs")))
    broken = {r.task: r.problems for r in results if not r.ok}
    assert not broken, broken
    assert all(r.oracle_reward == 1.0 for r in results)
    untouched = [r.untouched_reward for r in results]
    assert all(u is not None and 0.0 <= u < 1.0 for u in untouched)
    assert sum(u is not None and u > 0 for u in untouched) >= len(results) // 2  # partial credit


# --------------------------------------------------------------------------- the image

BASE_IMAGE = "python:3.11-slim-bookworm"  # the set's README, "The image"
OLD_DOCKERFILE = "FROM tidal/default\nWORKDIR /app\nCOPY repo/ /app/\n"  # before issue 50


def test_every_dockerfile_names_a_pinned_real_image_and_declares_the_default() -> None:
    dockerfiles = sorted(SWE_MINI.glob("*/environment/Dockerfile"))
    assert len(dockerfiles) == len(load_tasks("swe-mini"))
    for path in dockerfiles:
        text = path.read_text()
        assert from_references(text) == [BASE_IMAGE], path  # what Docker pulls
        df = parse_dockerfile(text, str(path))
        assert df.base == BASE_IMAGE and df.declares_default_image, path
        assert DEFAULT_IMAGE_REF not in text, path
    name, _, tag = BASE_IMAGE.partition(":")
    assert name == "python" and tag and tag != "latest"


def test_tidal_builds_the_set_on_its_default_image_as_before(tmp_path: Path) -> None:
    """With no [environment] images at all, every task builds on tidal's default image,
    into the very layer `FROM tidal/default` built (same cache key), and a sandbox of it
    holds the repository under /app."""
    envs = Environments({}, None, tmp_path / "envs")
    for task in load_tasks("swe-mini"):
        assert task.environment is not None and task.environment.context is not None
        env = envs.environment(task)
        assert env is not None and env.image is None and env.layers
        assert (env.declared_for, env.fallback_for) == (BASE_IMAGE, None)
        old = tmp_path / "old" / task.task_id / "Dockerfile"
        old.parent.mkdir(parents=True)
        old.write_text(OLD_DOCKERFILE)
        before = build_environment(old, context=task.environment.context, images={},
                                   fallback=None, cache_dir=tmp_path / "envs")
        assert (before.key, before.layers, before.workdir) == (env.key, env.layers, env.workdir)
        assert not before.built  # found: the same layer
    task = load_tasks("swe-mini")[0]
    (note,) = SandboxRuntimes(sandboxed_runtime, environments=envs).notes(task)
    assert note.startswith(f"built on tidal's default image for {BASE_IMAGE!r}")
    repo = SWE_MINI / task.task_id / "environment" / "repo"
    files = sorted(str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file())
    with Sandbox(envs.sandbox_config(task, SandboxConfig())) as sb:
        r = sb.exec("cd /app && find . -type f | cut -c3- | LC_ALL=C sort && python3 -V")
    assert r.ok, r.stderr
    *listed, version = r.stdout.splitlines()
    assert listed == sorted(files, key=lambda s: s.encode()) and version.startswith("Python 3.11")


def test_the_same_from_without_the_label_is_not_put_on_the_default_image(
        tmp_path: Path) -> None:
    """A third-party task saying `FROM python:3.11-slim-bookworm` without the set's LABEL
    is refused unmapped and built on the fallback only as a fallback (which the verdict
    notes); a run that maps the reference itself gets its mapping, not the declaration."""
    src = SWE_MINI / "cart-total-stale"
    third = tmp_path / "tasks" / "third-party"
    shutil.copytree(src, third)
    (third / "environment" / "Dockerfile").write_text(
        f"FROM {BASE_IMAGE}\nWORKDIR /app\nCOPY repo/ /app/\n")
    task = load_task(third)
    with pytest.raises(TaskError, match=r"'python:3\.11-slim-bookworm' is not mapped"):
        Environments({}, None, tmp_path / "envs").environment(task)
    env = Environments({}, "default", tmp_path / "envs").environment(task)
    assert env is not None and (env.fallback_for, env.declared_for) == (BASE_IMAGE, None)
    mapped = Environments({BASE_IMAGE: "default"}, None, tmp_path / "envs")
    env = mapped.environment(load_task(src))
    assert env is not None and (env.fallback_for, env.declared_for) == (None, None)
