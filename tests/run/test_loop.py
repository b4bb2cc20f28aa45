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
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tidal.ledger import LedgerStore
from tidal.run.config import RunConfig, parse_config
from tidal.run.loop import RunError, rl_task_pool, run, warm_start_batches
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
    summary = run(parse_config(_config(rl={"kl_coef": 0.05})), out)
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
    # the KL reference is the warm-started policy: step 1 trains it, step 2 has moved off
    assert (out / "reference" / "model.safetensors").exists()
    assert rl[0]["ref_kl"] == 0.0 and rl[1]["ref_kl"] != 0.0, rl
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


REPRO = {"rl": {"steps": 2, "numerics": "consistent"},
         "warmstart": {"steps": 20, "teacher": "mixed"},
         "tasks": {"name": "digits", "train_size": 4, "heldout_size": 1},
         "rollout": {"context_budget": 4096, "temperature": 1.0, "group_size": 4,
                     "tasks_per_step": 2, "max_turns": 3, "snapshot_every": 1}}


def _ledger(out: Path) -> dict[str, object]:
    """What a run sampled and scored, by session seed key (ids without their random
    part): every call's prompt and output ids, logprobs, text, tool calls, version."""
    from tidal.run.rollout import seed_key

    with LedgerStore(out / "ledger.db", readonly=True) as store:
        outcomes = store.outcomes()
        got: dict[str, object] = {}
        for info in store.sessions():
            log = store.call_log(info.session_id)
            calls = [(tuple(log.prompt_ids(sc.call_id).tolist()),
                      tuple(sc.call.output_ids.tolist()),
                      sc.call.output_logprobs.tobytes(), sc.call.output_text,
                      json.dumps(sc.call.tool_calls), sc.call.policy_version)
                     for sc in log.calls]
            o = outcomes.get(info.session_id)
            got[seed_key(info.session_id)] = (calls, o and (o.status.value, o.reward))
    return got


def _weights(out: Path) -> dict[str, bytes]:
    """The checkpoint's files, bytes: the weights, and the trainer state's shards. Left
    out: state.json (it names sessions by id) and torch.distributed.checkpoint's
    .metadata (it holds a random save id)."""
    ck = out / "checkpoint"
    got = {str(f.relative_to(ck)): f.read_bytes() for f in sorted(ck.rglob("*"))
           if f.is_file() and f.name not in ("state.json", ".metadata")}
    assert any(k.endswith(".distcp") for k in got) and any(k.endswith(".safetensors")
                                                          for k in got), sorted(got)
    return got


def _trained(out: Path) -> list[dict[str, object]]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    keep = ("loss", "tokens", "grad_norm", "max_abs_logprob_diff", "token_kl", "reward_mean")
    return [{k: r.get(k) for k in keep} for r in rows if r["phase"] == "rl"]


def _run_and_kill_mid_step(cfg: RunConfig, tmp_path: Path, out: Path) -> list[str]:
    """`tidal run` of `cfg` in a process of its own, SIGKILLed once a step is
    checkpointed and a live episode of a later step has a sandbox snapshot. Returns the
    command (append `--resume` to continue it)."""
    from tidal.run.config import dump_config

    conf = tmp_path / "c.toml"
    conf.write_text(dump_config(cfg))
    cmd = [sys.executable, "-m", "tidal.cli", "run", str(conf), "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    state = out / "checkpoint" / "state.json"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if (state.exists() and json.loads(state.read_text())["step"] >= 1
                and list((out / "live").glob("*/*.tar"))):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return cmd


def test_consistent_runs_of_one_seed_match_bit_for_bit(tmp_path: Path) -> None:
    """rl.numerics = "consistent", one config and seed: two runs sample the same tokens
    with the same logprobs (ledgers equal by session), train the same steps and write
    the same checkpoint bytes; a third, SIGKILLed during its second step and resumed,
    finishes with that checkpoint too. Every trained token's recomputed logprob is the
    engine's, exactly."""
    cfg = parse_config(_config(**REPRO))
    first, second, killed = (tmp_path / n for n in ("a", "b", "killed"))
    run(cfg, first)
    run(cfg, second)
    rl = _trained(first)
    assert len(rl) == 2 and any(r["tokens"] for r in rl), "no step had signal to train"
    for r in rl:
        assert r["max_abs_logprob_diff"] in (0.0, None) and r["token_kl"] in (0.0, None), r
    assert _ledger(first) == _ledger(second)
    assert _trained(first) == _trained(second)
    assert _weights(first) == _weights(second)
    cmd = _run_and_kill_mid_step(cfg, tmp_path, killed)
    r = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=900,
                       check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in (killed / "metrics.jsonl").read_text().splitlines()]
    (resume,) = [r for r in rows if r["phase"] == "resume"]
    assert resume["episodes"] >= 1  # a live episode continued from its snapshot
    assert _trained(killed) == _trained(first)
    assert _weights(killed) == _weights(first)


def test_bad_run_dir(tmp_path: Path) -> None:
    with pytest.raises(RunError, match="nothing to resume"):
        run(parse_config(_config()), tmp_path / "none", resume=True)


def test_warm_start_batches_are_uniform_or_spread_over_the_families() -> None:
    families = ["a"] * 30 + ["b"] * 6 + ["c"] * 4  # a skewed set, as a small draw is
    plan = {"steps": 20, "batch_size": 6}
    uniform = warm_start_batches(families, parse_config(_config(warmstart=plan)))
    rng = random.Random(0)  # `seed`'s default: the draws rng.sample made before
    assert uniform == tuple(tuple(rng.sample(range(40), 6)) for _ in range(20))
    assert any(Counter(families[i] for i in b)["a"] > 2 for b in uniform)
    balanced = warm_start_batches(
        families, parse_config(_config(warmstart={**plan, "sampling": "balanced"})))
    assert len(balanced) == 20
    for b in balanced:
        assert len(set(b)) == 6
        assert Counter(families[i] for i in b) == {"a": 2, "b": 2, "c": 2}
    everything = warm_start_batches(
        families[:4], parse_config(_config(warmstart={**plan, "sampling": "balanced"})))
    assert all(sorted(b) == [0, 1, 2, 3] for b in everything)  # fewer than a batch: all


def test_rl_task_pool_leaves_out_what_the_warm_start_imitated() -> None:
    from tidal.agent.tasks import load_taskset

    tasks = list(load_taskset("tools").train[:5])
    ids = [t.task_id for t in tasks]
    assert rl_task_pool(tasks, ids[:2], "all") == tasks
    assert [t.task_id for t in rl_task_pool(tasks, ids[:2], "undemonstrated")] == ids[2:]
    with pytest.raises(RunError, match="imitated all 5 training tasks"):
        rl_task_pool(tasks, ids, "undemonstrated")


def test_undemonstrated_rl_tasks_are_those_the_warm_start_did_not_imitate(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    run(parse_config(_config(tasks={"train_size": 6},
                             warmstart={"steps": 1, "batch_size": 2},
                             rollout={"task_pool": "undemonstrated", "tasks_per_step": 4},
                             rl={"steps": 1})), out)
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    imitated = set(state["demonstrated"])
    assert len(imitated) == 2
    with LedgerStore(out / "ledger.db", readonly=True) as store:
        rolled = {s.task_id for s in store.sessions() if s.session_id.startswith("rl-")}
    assert len(rolled) == 4 and not rolled & imitated, (rolled, imitated)


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
    cmd = _run_and_kill_mid_step(parse_config(cfg), tmp_path, out)
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
