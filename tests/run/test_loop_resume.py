"""A run on the elastic schedule, SIGKILLed mid-step and resumed: the sessions live at the
kill continue from their snapshots and every session is trained once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.run.loop_runs import live_at_stop, resume_to_the_end, run_and_kill_mid_step, small_config
from tidal.run.config import parse_config


@pytest.mark.slow
def test_sigkill_then_resume_trains_each_session_once(tmp_path: Path) -> None:
    """Elastic on 2 devices, killed mid-step: the sessions live at the kill continue from
    their snapshots (each model call recorded once), every session is trained once, a
    device moves to training while the other keeps rolling out, and every trained group
    is at most rl.max_staleness versions old."""
    cfg = small_config(rl={"steps": 4, "max_staleness": 1},
                  warmstart={"steps": 3, "teacher": "mixed"},
                  tasks={"name": "digits", "train_size": 8, "heldout_size": 2},
                  rollout={"context_budget": 4096, "snapshot_every": 1, "tasks_per_step": 2},
                  schedule={"policy": "elastic", "devices": 2})
    out = tmp_path / "run"
    cmd = run_and_kill_mid_step(parse_config(cfg), tmp_path, out)
    # an episode may have finished between the check and the kill (its snapshot removed)
    snapshotted = bool(list((out / "live").glob("*/*.tar")))
    before, live = live_at_stop(out)
    assert live, "no session was live at the kill"
    resume_to_the_end(cmd, out, before, live, steps=4)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    (resume,) = [r for r in rows if r["phase"] == "resume"]
    assert (resume["snapshots"] >= 1) == snapshotted, (resume, snapshotted)
    summary = json.loads((out / "summary.json").read_text())
    sched = summary["schedule"]
    assert sched["schedule_policy"] == "elastic" and summary["policy_version"] == 5
    assert sched["role_switches"]["to_train"] >= 1, sched
    trained_staleness = [s for r in rows if r["phase"] == "rl" for s in r["staleness"]]
    assert trained_staleness and max(trained_staleness) <= 1, trained_staleness
