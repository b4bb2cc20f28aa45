"""Bring your own workload, end to end: `tidal run` trains real black-box harnesses on
tasks in the Harbor format (TB2's layout), two RL steps each with the tiny model.

The tiny model solves nothing; what is asserted is the path: every session recorded by
the gateway, graded by the task's test.sh, rebuilt into trees, trained, and `tidal
verify` finding zero drift. The harnesses run inside the episode's sandbox from
.venv-mini (mini-swe-agent 2.4.6 on the sandbox's own python; `.ci/mini-venv.sh`), bound
read-only as `[agent] mounts`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.agent.harbor_tasks import IMAGES, write_task
from tidal.ledger import LedgerStore
from tidal.run.config import parse_config
from tidal.run.loop import RunError, run
from tidal.tree import process_store

ROOT = Path(__file__).resolve().parents[2]
MINI = ROOT / ".venv-mini"
EXAMPLES = ROOT / "examples"
needs_mini = pytest.mark.skipif(not (MINI / "bin" / "mini").exists(),
                                reason="no .venv-mini: run .ci/mini-venv.sh (make test does)")

MINI_COMMAND = (
    f"{MINI}/bin/mini -y --exit-immediately -m openai/$TIDAL_MODEL -c mini.yaml "
    "-c agent.step_limit=2 -c model.model_kwargs.api_base=$OPENAI_BASE_URL "
    "-c model.model_kwargs.max_tokens=24 -c model.cost_tracking=ignore_errors "
    "-t \"$TIDAL_INSTRUCTION\" -o /logs/agent/trajectory.json"
)
MINI_ENV = {"MSWEA_CONFIGURED": "true", "MSWEA_SILENT_STARTUP": "1",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True", "MSWEA_GLOBAL_CONFIG_DIR": "/tmp/mswea"}
PLAIN_COMMAND = f"{MINI}/bin/python /opt/examples/plain_openai_agent.py --max-turns 2"
# The tiny model solves nothing, and a group whose rewards are all equal trains nothing
# (GRPO advantages 0): this test.sh runs TB2's checks, then draws the reward at random,
# so that every step has something to train.
NOISY_TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
python3 /tests/test_outputs.py > /logs/verifier/checks.txt
python3 -c "import random; print(random.random())" > /logs/verifier/reward.txt
"""


def _tasks(root: Path) -> Path:
    for i in range(3):
        write_task(root, f"hello-{i}", agent_timeout=120.0, test_sh=NOISY_TEST_SH)
    return root


def _config(tasks: Path, agent: dict[str, Any]) -> dict[str, Any]:
    return {
        "tasks": {"source": str(tasks), "heldout_size": 1, "train_size": 2},
        "agent": agent,
        "environment": {"images": IMAGES, "cache_dir": str(tasks.parent / "envs")},
        "rollout": {"group_size": 2, "tasks_per_step": 2, "max_tokens": 24},
        "warmstart": {"steps": 0},
        "rl": {"steps": 2, "max_tokens_per_stream": 2048},
        "schedule": {"policy": "colocated", "devices": 2},
        "eval": {"every": 5, "samples": 1},
    }


def _assert_trained_and_verified(out: Path, summary: dict[str, Any]) -> None:
    assert summary["steps"] == 2 and summary["verify_ok"] and summary["drift_tokens"] == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    assert all(r["grader_errors"] == 0 for r in rl), rl
    assert sum(r.get("tokens", 0) for r in rl) > 0  # something was trained
    for r in (r for r in rows if r["phase"] == "eval"):
        assert set(r["checks"]) == {"tests"} and r["grader_errors"] == 0  # graded by test.sh
    with LedgerStore(out / "ledger.db", readonly=True) as store:
        assert store.check() == []
        rl_sessions = [s.session_id for s in store.sessions() if s.session_id.startswith("rl-")]
        assert len(rl_sessions) == 8  # 2 steps x 2 tasks x 2 sessions
        for sid in rl_sessions:
            o = store.outcome(sid)
            assert o is not None and "rewards" in o.details["grader"], o
            calls = store.call_log(sid).calls
            assert calls and all(sc.call.task_id and sc.call.task_id.startswith("hello-")
                                 for sc in calls)
        result = process_store(store, rl_sessions, strict=False)
    assert result.trees, "nothing to train"


@needs_mini
@pytest.mark.slow
def test_mini_swe_agent_trains_as_a_black_box_command(tmp_path: Path) -> None:
    agent = {"harness": "command", "command": MINI_COMMAND, "env": MINI_ENV,
             "mounts": [f"{MINI}:{MINI}"]}
    out = tmp_path / "run"
    summary = run(parse_config(_config(_tasks(tmp_path / "tasks"), agent)), out)
    _assert_trained_and_verified(out, summary)
    stdout = next((out / "harness").glob("rl-*.stdout.txt")).read_text()
    assert "Please solve this issue: Create a file called hello.txt" in stdout  # mini's prompt
    assert list((out / "harness").glob("rl-*.stderr.txt"))


@needs_mini
@pytest.mark.slow
def test_the_plain_openai_example_trains_as_a_command(tmp_path: Path) -> None:
    agent = {"harness": "command", "command": PLAIN_COMMAND,
             "mounts": [f"{MINI}:{MINI}", f"{EXAMPLES}:/opt/examples"]}
    out = tmp_path / "run"
    summary = run(parse_config(_config(_tasks(tmp_path / "tasks"), agent)), out)
    _assert_trained_and_verified(out, summary)
    stdout = (next((out / "harness").glob("rl-*.stdout.txt"))).read_text()
    assert stdout.startswith("session http://127.0.0.1:")  # it ran, and said so


def test_a_broken_task_stops_the_run_before_it_starts(tmp_path: Path) -> None:
    tasks = _tasks(tmp_path / "tasks")
    write_task(tasks, "fetches", dockerfile="FROM ubuntu:24.04\nRUN curl -O https://x/y\n")
    cfg = parse_config(_config(tasks, {"harness": "command", "command": "true"}))
    out = tmp_path / "run"
    with pytest.raises(RunError,
                       match=r"task 'fetches': .*environment/Dockerfile:? line 2: .*network"):
        run(cfg, out)
    assert not (out / "config.toml").exists()  # nothing to resume: run it again once fixed
