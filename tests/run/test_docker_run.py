"""`tidal run` with `rollout.sandbox = "docker"`: Harbor tasks as their authors wrote
them (harbor's own `tasks init` template and Terminal-Bench 2's hello-world shape), each
built by the container engine from its Dockerfile (FROM mapped to the engine's local
base image), the agent's tools run in the task's container, graded by its own test.sh in
a fresh container of the pristine image. Two RL steps with the tiny model, `tidal
verify` clean; then the same run SIGKILLed mid-step and resumed from its containers'
snapshots. Nothing the runs made (containers, snapshot images) outlives them.

Skipped, saying why, where no container engine answers (`make test` starts one:
.ci/podman.sh)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.agent.harbor_tasks import (
    BASE,
    HARBOR_TEMPLATE,
    engine_problem,
    from_harbor_template,
    write_task,
)
from tests.run.loop_runs import live_at_stop, resume_to_the_end, run_and_kill_mid_step
from tidal.ledger import LedgerStore
from tidal.run.config import parse_config
from tidal.run.loop import run

pytestmark = [
    pytest.mark.skipif(engine_problem() is not None, reason=str(engine_problem())),
    pytest.mark.skipif(HARBOR_TEMPLATE is None,
                       reason=".venv-harbor does not exist: run .ci/harbor-venv.sh"),
]

# TB2's checks, then a random reward: the tiny model solves nothing, and a group whose
# rewards are all equal trains nothing
NOISY_TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
python3 /tests/test_outputs.py > /logs/verifier/checks.txt
python3 -c "import random; print(random.random())" > /logs/verifier/reward.txt
"""


def _tasks(root: Path) -> Path:
    from_harbor_template(root)
    for i in range(2):
        write_task(root, f"hello-{i}", test_sh=NOISY_TEST_SH)
    return root


def _config(tasks: Path, **over: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "tasks": {"source": str(tasks), "heldout_size": 1, "train_size": 2},
        "environment": {"images": {"ubuntu:24.04": BASE}},
        "rollout": {"sandbox": "docker", "group_size": 2, "tasks_per_step": 2,
                    "max_tokens": 24, "max_turns": 3, "snapshot_every": 1,
                    "tools": ["bash", "write_file", "finish"]},
        "warmstart": {"steps": 0},
        "rl": {"steps": 2, "max_tokens_per_stream": 2048},
        "schedule": {"policy": "colocated", "devices": 2},
        "eval": {"every": 5, "samples": 1},
    }
    for k, v in over.items():
        cfg[k].update(v)
    return cfg


def _left_by(run: Path) -> tuple[list[str], list[str]]:
    """What the engine still holds of the runs that wrote `run`: containers started by
    this process or by one that is gone (the runs' own, in process or killed), and
    snapshot images whose file was under `run`. Other tests' containers and images (the
    suite runs test files side by side on one engine) are not counted."""
    from tidal.agent.containers import OWNER, SNAPSHOT_OF, SNAPSHOT_REPO, connect, owner_alive

    client = connect()
    me = f":{os.getpid()}:"
    containers = [c["Id"][:12] for c in client.api.containers(
        all=True, filters={"label": [f"{OWNER}"]})
        if me in c["Labels"][OWNER] or not owner_alive(c["Labels"][OWNER])]
    images = [i["Id"][:19] for i in client.api.images(name=SNAPSHOT_REPO)
              if str((i.get("Labels") or {}).get(SNAPSHOT_OF, "")).startswith(str(run))]
    return containers, images


@pytest.mark.slow
def test_a_run_on_containers_trains_harbor_tasks_and_verifies(tmp_path: Path) -> None:
    from tidal.agent.containers import connect, reap_orphans

    reap_orphans(connect())  # what earlier killed runs left
    out = tmp_path / "run"
    summary = run(parse_config(_config(_tasks(tmp_path / "tasks"))), out)
    assert summary["steps"] == 2 and summary["verify_ok"] and summary["drift_tokens"] == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    assert all(r["grader_errors"] == 0 and "infra_error" not in r["statuses"] for r in rl), rl
    assert sum(r["snapshots"] for r in rl) > 0  # the containers were snapshotted as they ran
    assert sum(r.get("tokens", 0) for r in rl) > 0  # something was trained
    with LedgerStore(out / "ledger.db", readonly=True) as store:
        assert store.check() == []
        outcomes = store.outcomes()
        rl_main = [s.session_id for s in store.sessions()
                   if s.session_id.startswith("rl-") and s.parent_session_id is None]
        assert len(rl_main) == 8  # 2 steps x 2 tasks x 2 episodes
        for sid in rl_main:  # graded by the task's test.sh in a fresh container
            grader = outcomes[sid].details["grader"]
            assert isinstance(grader, dict) and grader["verifier_env"] == \
                "pristine, carrying /app", grader
    assert _left_by(out) == ([], [])  # no container, no snapshot image left


@pytest.mark.slow
def test_a_killed_run_on_containers_resumes_from_its_snapshots(tmp_path: Path) -> None:
    cfg = _config(_tasks(tmp_path / "tasks"), rl={"steps": 3},
                  rollout={"max_turns": 6, "max_tokens": 16})
    out = tmp_path / "run"
    cmd = run_and_kill_mid_step(parse_config(cfg), tmp_path, out)
    snapshotted = bool(list((out / "live").glob("*/*.tar")))
    at_stop, live = live_at_stop(out)
    assert live, "no session was live at the kill"
    resume_to_the_end(cmd, out, at_stop, live, steps=3)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    (resume,) = [r for r in rows if r["phase"] == "resume"]
    assert (resume["snapshots"] >= 1) == snapshotted, (resume, snapshotted)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verify_ok"] and summary["drift_tokens"] == 0
    # the killed process's containers (and any image it committed without writing the
    # snapshot's file) went when the resumed run started (`reap_orphans`), and the
    # snapshots once their groups were done
    assert _left_by(out) == ([], [])
