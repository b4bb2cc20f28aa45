"""swe-mini, the built-in set of small repositories to fix: every task's oracle earns 1 and
its untouched repository less (through the same `tidal tasks check` a user runs), and
the set is as varied as it claims."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tidal.agent.environment import Environments
from tidal.agent.harbor import HARBOR_SETS, VerifierScript, load_tasks
from tidal.agent.sandboxed import sandboxed_runtime
from tidal.agent.taskcheck import SandboxRuntimes, check_tasks
from tidal.sandbox import Limits, SandboxConfig

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
        Environments({}, None, tmp_path / "envs"), sandboxed_runtime,
        SandboxConfig(limits=Limits(cpu_s=600.0))))
    broken = {r.task: r.problems for r in results if not r.ok}
    assert not broken, broken
    assert all(r.oracle_reward == 1.0 for r in results)
    untouched = [r.untouched_reward for r in results]
    assert all(u is not None and 0.0 <= u < 1.0 for u in untouched)
    assert sum(u is not None and u > 0 for u in untouched) >= len(results) // 2  # partial credit
