"""The whole loop, small: the pieces connect, and a killed run resumes exactly once.

Runs the real thing end to end (tiny model, gateway over HTTP, bubblewrap sandboxes,
tree processor, tree trainer) for two RL steps. The warm start imitates the
`tools` set's demonstrations long enough that the model, sampling at a low temperature,
spawns subagents; a tiny
context budget makes the harness compact every session.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tidal.ledger import LedgerStore
from tidal.run.config import parse_config
from tidal.run.loop import RunError, run
from tidal.run.report import render_report
from tidal.tree import process_store

SMALL = {
    "tasks": {"name": "tools", "train_size": 3, "heldout_size": 1, "time_limit_s": 120},
    "rollout": {"group_size": 2, "tasks_per_step": 3, "max_turns": 4,
                "max_tokens": 64, "context_budget": 64, "temperature": 0.2,
                "tools": ["bash", "read_file", "write_file", "spawn_subagent", "finish"]},
    # the exact teacher: the sloppy copies of `mixed` would halve each demonstration's
    # share of these 30 steps (the SIGKILL/resume test runs the default, mixed)
    "warmstart": {"steps": 30, "batch_size": 4, "lr": 0.003, "teacher": "exact"},
    "rl": {"steps": 2, "max_tokens_per_stream": 2048},
    "schedule": {"policy": "colocated", "devices": 2, "groups_per_device": 1},
    "eval": {"every": 5, "samples": 1},
}


def _config(**over: dict[str, object]) -> dict[str, object]:
    cfg = json.loads(json.dumps(SMALL))
    cfg["rollout"]["sandbox"] = "bwrap"  # the real sandbox: CI installs bubblewrap
    for k, v in over.items():
        cfg[k].update(v)
    return cfg


def test_loop_connects_every_piece(tmp_path: Path) -> None:
    out = tmp_path / "run"
    summary = run(parse_config(_config()), out)
    assert summary["steps"] == 2 and summary["policy_version"] == 3  # warm start + 2 steps
    assert summary["drift_tokens"] == 0 and summary["verify_ok"]
    curve = summary["heldout_curve"]  # start (step 0) and end (step 2) evaluations
    assert [step for step, _ in curve] == [0, 2]
    assert (curve[0][1], curve[-1][1]) == (summary["success_rate_start"],
                                          summary["success_rate_end"])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    assert all("k3_kl" in r and "tree_token_ratio" in r for r in rl)
    # colocated: each step, both devices switch to training, and back while work is
    # left (not after the last step); nothing is stale
    sched = summary["schedule"]
    assert sched["schedule_policy"] == "colocated"
    assert sched["role_switches"] == {"to_train": 4, "to_rollout": 2}, sched
    assert 0.0 < sched["device_utilization"] <= 1.0
    assert all(r["staleness"] == [0, 0, 0] for r in rl)
    assert {r["phase"] for r in rows} == {"warmstart", "eval", "rl"}
    for r in (r for r in rows if r["phase"] == "eval"):  # what held-out episodes got right
        assert set(r["checks"]) == {"exists", "equals", "finished"}, r["checks"]
        assert all(0.0 <= v <= 1.0 for v in r["checks"].values())
    assert (out / "tb").is_dir() and (out / "summary.json").exists()
    assert list((out / "trees").glob("*.html")), "no sample tree pages for the report"
    page = render_report(out)
    assert page.count("<svg") >= 3 and 'href="trees/' in page
    assert "check: equals" in page  # the held-out chart draws each kind of check
    with LedgerStore(out / "ledger.db", readonly=True) as store:
        assert store.check() == []
        infos = store.sessions()
        rl_main = [s.session_id for s in infos if s.session_id.startswith("rl-")]
        assert len(rl_main) >= 6
        parent = {s.session_id: s.parent_session_id for s in infos}

        def root(sid: str) -> str:  # subagents (sub-...) belong to their main session
            while parent.get(sid):
                sid = parent[sid] or sid
            return sid

        rl_sessions = [s.session_id for s in infos if root(s.session_id).startswith("rl-")]
        versions = {sc.call.policy_version for sid in rl_sessions
                    for sc in store.call_log(sid).calls}
        assert versions == {1, 2}  # each step sampled with the weights of the step before
        result = process_store(store, rl_sessions, strict=False)
    edges: dict[str, int] = {}
    for ep in result.episodes:
        for k, v in ep.edges.items():
            edges[k] = edges.get(k, 0) + v
    assert edges.get("subagent", 0) > 0, edges
    assert edges.get("compaction", 0) > 0, edges
    assert result.trees, "nothing to train"


def test_consistent_numerics_leave_no_mismatch(tmp_path: Path) -> None:
    """rl.numerics = "consistent", colocated (nothing stale): through the gateway, the
    ledger, the tree processor and merging, every trained token's recomputed
    log-probability is the one the engine recorded, exactly."""
    # one step, sampled with the warm-started weights the engine got from the trainer;
    # groups of 6 at temperature 1: a group whose members all score alike trains nothing
    # (with groups of 2 every group of a run could: seen once in CI)
    cfg = _config(rl={"steps": 1, "numerics": "consistent"},
                  rollout={"context_budget": 4096, "temperature": 1.0, "group_size": 6})
    out = tmp_path / "run"
    summary = run(parse_config(cfg), out)
    assert summary["steps"] == 1 and summary["verify_ok"]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["phase"] == "rl" and r.get("tokens", 0) > 0]
    assert trained, "no step had signal to train"
    for r in trained:
        assert r["max_abs_logprob_diff"] == 0.0 and r["token_kl"] == 0.0, r


def test_bad_run_dir(tmp_path: Path) -> None:
    with pytest.raises(RunError, match="nothing to resume"):
        run(parse_config(_config()), tmp_path / "none", resume=True)


def test_sigkill_then_resume_trains_each_session_once(tmp_path: Path) -> None:
    """Elastic on 2 devices, killed mid-step: the sessions live at the kill continue from
    their snapshots (each model call recorded once), every session is trained once, a
    device moves to training while the other keeps rolling out, and every trained group
    is at most rl.max_staleness versions old."""
    cfg = _config(rl={"steps": 4, "max_staleness": 1},
                  warmstart={"steps": 3, "teacher": "mixed"},
                  tasks={"name": "digits", "train_size": 8, "heldout_size": 2},
                  rollout={"context_budget": 4096, "snapshot_every": 1, "tasks_per_step": 2},
                  schedule={"policy": "elastic", "devices": 2})
    out = tmp_path / "run"
    conf = tmp_path / "c.toml"
    from tidal.run.config import dump_config

    conf.write_text(dump_config(parse_config(cfg)))
    cmd = [sys.executable, "-m", "tidal.cli", "run", str(conf), "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    state = out / "checkpoint" / "state.json"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        # after a step, once some live episode has a sandbox snapshot: kill mid-step
        if (state.exists() and json.loads(state.read_text())["step"] >= 1
                and list((out / "live").glob("*/*.tar"))):
            break
        time.sleep(0.1)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
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
    assert resume["episodes"] >= len(live) and resume["snapshots"] >= 1
    summary = json.loads((out / "summary.json").read_text())
    sched = summary["schedule"]
    assert sched["schedule_policy"] == "elastic" and summary["policy_version"] == 5
    assert sched["role_switches"]["to_train"] >= 1, sched
    trained_staleness = [s for r in rows if r["phase"] == "rl" for s in r["staleness"]]
    assert trained_staleness and max(trained_staleness) <= 1, trained_staleness
