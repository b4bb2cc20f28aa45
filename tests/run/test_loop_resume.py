"""A run on the elastic schedule, SIGKILLed mid-step and resumed: the sessions live at the
kill continue from their snapshots and every session is trained once."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.run.loop_runs import run_and_kill_mid_step, small_config
from tidal.ledger import LedgerStore
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
    with LedgerStore(out / "ledger.db", readonly=True) as store:
        before = {sc.call_id for sc in store.iter_calls()}
        done = store.outcomes()
        live = [s.session_id for s in store.sessions() if s.session_id.startswith("rl-")
                and s.parent_session_id is None and s.session_id not in done]
    assert live, "no session was live at the kill"
    r = subprocess.run([*cmd[:-2], "--out", str(out), "--resume"], capture_output=True,
                       text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    final = json.loads((out / "checkpoint" / "state.json").read_text())
    trained = final["trained_sessions"]
    assert final["step"] == 4
    assert len(trained) == len(set(trained)), "a session was trained twice"
    with LedgerStore(out / "ledger.db", readonly=True) as store:
        assert store.check() == []
        after = {sc.call_id for sc in store.iter_calls()}
        outcomes = store.outcomes()
        main_rl = [s.session_id for s in store.sessions()
                   if s.session_id.startswith("rl-") and s.parent_session_id is None]
    assert before <= after  # every call committed before the kill is still there
    for sid in main_rl:  # every committed RL session was trained or closed as infra_error
        assert sid in trained or outcomes[sid].status.value == "infra_error", sid
    for sid in live:  # resumed, not thrown away
        assert outcomes[sid].details.get("error") != "the run was killed mid-session", sid
        assert sid in trained or sid in final["dropped_sessions"], sid
        with LedgerStore(out / "ledger.db", readonly=True) as store:
            log = store.call_log(sid)
            prompts = [tuple(log.prompt_ids(sc.call_id).tolist()) for sc in log.calls]
        assert len(prompts) == len(set(prompts)), f"{sid}: a call was sampled twice"
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    (resume,) = [r for r in rows if r["phase"] == "resume"]
    assert resume["episodes"] >= len(live)
    assert (resume["snapshots"] >= 1) == snapshotted, (resume, snapshotted)
    summary = json.loads((out / "summary.json").read_text())
    sched = summary["schedule"]
    assert sched["schedule_policy"] == "elastic" and summary["policy_version"] == 5
    assert sched["role_switches"]["to_train"] >= 1, sched
    trained_staleness = [s for r in rows if r["phase"] == "rl" for s in r["staleness"]]
    assert trained_staleness and max(trained_staleness) <= 1, trained_staleness
