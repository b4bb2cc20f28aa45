"""Hostile harnesses through `tidal run` (issue 51): a command harness that never solves
its task and attacks what stands between it and reward. Each test asserts that the
attack gets nothing: reward no higher than the task left untouched, and no session
recorded that is not one of the run's own episodes (or their subagents).

The harnesses live in tests/run/hostile/, bound read-only into every sandbox."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.agent.harbor_tasks import IMAGES, TB2_TOML, write_task
from tidal.ledger import LedgerStore
from tidal.run.config import parse_config
from tidal.run.loop import run

HOSTILE = Path(__file__).resolve().parent / "hostile"
# the run's own session ids: `{phase}-{step}-{task}-{k}-{6 hex}` (tidal.run.rollout)
EPISODE_ID = re.compile(r"^(rl|evalstart|evalend)-\d+-hello-\d+-\d+-[0-9a-f]{6}$")


def hostile_run(tmp_path: Path, script: str, *, steps: int = 1,
                toml: str | None = None) -> tuple[Path, dict[str, Any]]:
    tasks = tmp_path / "tasks"
    for i in range(3):
        write_task(tasks, f"hello-{i}", agent_timeout=60.0, toml=toml)
    cfg = {
        "tasks": {"source": str(tasks), "heldout_size": 1, "train_size": 2},
        "agent": {"harness": "command", "command": f"python3 /opt/hostile/{script}",
                  "mounts": [f"{HOSTILE}:/opt/hostile"]},
        "environment": {"images": IMAGES, "cache_dir": str(tmp_path / "envs")},
        "rollout": {"group_size": 2, "tasks_per_step": 2, "max_tokens": 8},
        "warmstart": {"steps": 0},
        "rl": {"steps": steps, "max_tokens_per_stream": 1024},
        "schedule": {"policy": "colocated", "devices": 2},
        "eval": {"every": 5, "samples": 1},
    }
    out = tmp_path / "run"
    return out, run(parse_config(cfg), out)


@pytest.mark.slow
def test_a_harness_cannot_write_into_sessions_not_its_own(tmp_path: Path) -> None:
    out, summary = hostile_run(tmp_path, "forge.py")
    assert summary["verify_ok"]
    reports = sorted((out / "harness").glob("*.stdout.txt"))
    assert len(reports) >= 4 + 1  # 2 tasks x 2 sessions, and the held-out evaluation
    for path in reports:
        attempts = json.loads(path.read_text().strip().splitlines()[-1])
        assert attempts.pop("own session") == 200, path.name
        assert attempts and all(code == 403 for code in attempts.values()), (path.name, attempts)
    with LedgerStore(out / "ledger.db", readonly=True) as store:
        ids = store.session_ids()
        assert ids and all(EPISODE_ID.match(s) for s in ids), ids
        assert all(len(store.call_log(s).calls) == 1 for s in ids)  # its own call only
        rewards = [o.reward for o in store.outcomes().values()]
    assert rewards and max(rewards) == 0.0  # the task untouched scores 0


def _verdicts(out: Path) -> dict[int, list[tuple[float, str]]]:
    """Per task (hello-<i>): each graded episode's reward and what its verifier ran in."""
    with LedgerStore(out / "ledger.db", readonly=True) as store:
        outcomes = store.outcomes()
    by_task: dict[int, list[tuple[float, str]]] = {}
    for sid, o in outcomes.items():
        task = int(sid.split("-hello-")[1].split("-")[0])
        by_task.setdefault(task, []).append((o.reward, o.details["grader"]["verifier_env"]))
    return by_task


@pytest.mark.slow
def test_the_verifier_never_runs_what_the_agent_planted_or_left_running(tmp_path: Path) -> None:
    """tests/run/hostile/tamper.py: fake grep/python3 first on PATH (hello-0), over the
    real ones (hello-1), a reward rewriter and a tests rewriter left running (hello-2).
    By default the verifier runs in a fresh sandbox from the task's image with only /app
    carried over: every attack earns what the untouched task earns, 0. The same run with
    `environment_mode = "shared"` shows the attacks are real: the planted programs earn
    1.0 there, while what was left running is still killed before the verifier starts."""
    out, summary = hostile_run(tmp_path / "pristine", "tamper.py")
    assert summary["verify_ok"]
    verdicts = _verdicts(out)
    assert sorted(verdicts) == [0, 1, 2], verdicts
    assert all(v == (0.0, "pristine, carrying /app") for vs in verdicts.values() for v in vs), \
        verdicts

    shared = TB2_TOML.format(agent_timeout=60.0, verifier_timeout=60.0).replace(
        "[verifier]\n", '[verifier]\nenvironment_mode = "shared"\n')
    out, summary = hostile_run(tmp_path / "shared", "tamper.py", toml=shared)
    assert summary["verify_ok"]
    verdicts = _verdicts(out)
    assert sorted(verdicts) == [0, 1, 2], verdicts
    assert {t: set(vs) for t, vs in verdicts.items()} == {
        0: {(1.0, "shared")}, 1: {(1.0, "shared")}, 2: {(0.0, "shared")}}, verdicts
