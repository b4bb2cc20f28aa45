"""The whole loop, small: the pieces connect (test_loop_repro.py: one seed, one result;
test_loop_resume.py: a killed run resumes, each session trained once).

Runs the real thing end to end (tiny model, gateway over HTTP, bubblewrap sandboxes,
tree processor, tree trainer) for two RL steps. The warm start imitates the
`tools` set's demonstrations long enough that the model, sampling at a low temperature,
spawns subagents; a tiny
context budget makes the harness compact every session.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from tests.run.loop_runs import small_config
from tidal.ledger import LedgerStore
from tidal.run.checkpoint import find_checkpoint, load_state
from tidal.run.config import parse_config
from tidal.run.loop import RunError, rl_task_pool, run, warm_start_batches
from tidal.run.report import render_report
from tidal.tree import TRAIN_REWARDS, process_store


@pytest.mark.slow
def test_loop_connects_every_piece(tmp_path: Path) -> None:
    out = tmp_path / "run"
    summary = run(parse_config(small_config(rl={"kl_coef": 0.05})), out)
    assert summary["steps"] == 2 and summary["policy_version"] == 3  # warm start + 2 steps
    assert summary["drift_tokens"] == 0 and summary["verify_ok"]
    assert summary["peak_rss_mb"] > 200  # torch, a model and an engine at least
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
        # every session is recorded with its phase, step, task, sample and parent
        meta = store.session_meta()
        assert set(meta) >= {s.session_id for s in infos}
        for s in infos:
            m, top = meta[s.session_id], meta[root(s.session_id)]
            assert m.parent == s.parent_session_id
            assert (m.phase, m.step, m.task_id, m.sample) == (top.phase, top.step, top.task_id,
                                                              top.sample)
        assert sorted({(m.phase, m.step) for m in meta.values()}) == [
            ("evalend", 2), ("evalstart", 0), ("rl", 1), ("rl", 2)]
        for sid in rl_main:
            m = meta[sid]
            assert sid.startswith(f"rl-{m.step}-{m.task_id}-{m.sample}-"), (sid, m)
        assert {meta[s].sample for s in rl_main} == {0, 1}  # groups of 2
        versions = {sc.call.policy_version for sid in rl_sessions
                    for sc in store.call_log(sid).calls}
        assert versions == {1, 2}  # each step sampled with the weights of the step before
        # tool calls per episode, beside success: what each step's recorded calls made
        for r in rl:
            sids = [sid for sid in rl_sessions if meta[sid].step == r["step"]]
            made = sum(len(sc.call.tool_calls or ()) for sid in sids
                       for sc in store.call_log(sid).calls)
            main = [sid for sid in sids if meta[sid].parent is None]
            assert r["tool_calls_per_episode"] == pytest.approx(made / len(main)), r
        assert any(r["tool_calls_per_episode"] > 0 for r in rl)
        result = process_store(store, rl_sessions, strict=False)
    edges: dict[str, int] = {}
    for ep in result.episodes:
        for k, v in ep.edges.items():
            edges[k] = edges.get(k, 0) + v
    assert edges.get("subagent", 0) > 0, edges
    assert edges.get("compaction", 0) > 0, edges
    assert result.trees, "nothing to train"


def test_bad_run_dir(tmp_path: Path) -> None:
    with pytest.raises(RunError, match="nothing to resume"):
        run(parse_config(small_config()), tmp_path / "none", resume=True)


def test_warm_start_batches_are_uniform_or_spread_over_the_families() -> None:
    families = ["a"] * 30 + ["b"] * 6 + ["c"] * 4  # a skewed set, as a small draw is
    plan = {"steps": 20, "batch_size": 6}
    uniform = warm_start_batches(families, parse_config(small_config(warmstart=plan)))
    rng = random.Random(0)  # `seed`'s default: the draws rng.sample made before
    assert uniform == tuple(tuple(rng.sample(range(40), 6)) for _ in range(20))
    assert any(Counter(families[i] for i in b)["a"] > 2 for b in uniform)
    balanced = warm_start_batches(
        families, parse_config(small_config(warmstart={**plan, "sampling": "balanced"})))
    assert len(balanced) == 20
    for b in balanced:
        assert len(set(b)) == 6
        assert Counter(families[i] for i in b) == {"a": 2, "b": 2, "c": 2}
    everything = warm_start_batches(
        families[:4], parse_config(small_config(warmstart={**plan, "sampling": "balanced"})))
    assert all(sorted(b) == [0, 1, 2, 3] for b in everything)  # fewer than a batch: all


def test_rl_task_pool_leaves_out_what_the_warm_start_imitated() -> None:
    from tidal.agent.tasks import load_taskset

    tasks = list(load_taskset("tools").train[:5])
    ids = [t.task_id for t in tasks]
    assert rl_task_pool(tasks, ids[:2], "all") == tasks
    assert [t.task_id for t in rl_task_pool(tasks, ids[:2], "undemonstrated")] == ids[2:]
    with pytest.raises(RunError, match="imitated all 5 training tasks"):
        rl_task_pool(tasks, ids, "undemonstrated")


@pytest.mark.slow
def test_undemonstrated_rl_tasks_are_those_the_warm_start_did_not_imitate(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    run(parse_config(small_config(tasks={"train_size": 6},
                             warmstart={"steps": 1, "batch_size": 2},
                             rollout={"task_pool": "undemonstrated", "tasks_per_step": 4},
                             rl={"steps": 1})), out)
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    imitated = set(state["demonstrated"])
    assert len(imitated) == 2
    with LedgerStore(out / "ledger.db", readonly=True) as store:
        rolled = {s.task_id for s in store.sessions() if s.session_id.startswith("rl-")}
    assert len(rolled) == 4 and not rolled & imitated, (rolled, imitated)


@pytest.mark.slow
def test_dynamic_sampling_rolls_groups_that_scored_alike_again(tmp_path: Path) -> None:
    """`rollout.dynamic_sampling`: a group whose samples all scored alike is rolled again
    on a fresh task of its family; the batch stays whole, the replaced sessions are
    recorded (with outcomes) and never trained. The model is not warm-started, so at a low
    temperature its groups mostly fail alike. Alike under what trains: with `rl.reward =
    "success"` two partial scores of a group that solved nothing are alike. (The
    families' advantages are balanced on the way: `rl.advantage_balance`; both reward
    transforms are tested in tests/tree/test_rewards.py.)"""
    out = tmp_path / "run"
    cfg = small_config(tasks={"name": "digits", "train_size": 12, "heldout_size": 1},
                       warmstart={"steps": 0},
                       rl={"steps": 1, "advantage_balance": "family", "reward": "success"},
                       rollout={"dynamic_sampling": 2, "tasks_per_step": 2, "max_turns": 2,
                                "tools": ["write_file", "finish"]})
    run(parse_config(cfg), out)
    (row,) = [r for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text()
                          .splitlines()) if r["phase"] == "rl"]
    ckpt = find_checkpoint(out)
    assert ckpt is not None
    state = load_state(ckpt)
    with LedgerStore(out / "ledger.db", readonly=True) as store:
        meta = store.session_meta()
        outcomes = store.outcomes()
    main = [sid for sid, m in meta.items() if m.phase == "rl" and m.parent is None]
    trained = [sid for sid in main if sid in state.trained_sessions]
    replaced = [sid for sid in main if sid in state.dropped_sessions]
    assert row["groups_replaced"] >= 1, row
    assert len(replaced) == 2 * row["groups_replaced"]  # groups of two
    assert len(trained) == 2 * 2 and not set(trained) & set(replaced)  # a whole batch
    assert set(main) == set(trained) | set(replaced)
    groups: dict[str, list[float]] = {}
    for sid in replaced:  # each replaced group scored alike, and was graded
        groups.setdefault(meta[sid].task_id, []).append(outcomes[sid].reward)
    success = TRAIN_REWARDS["success"]
    assert all(len({success(r) for r in rewards}) == 1 for rewards in groups.values()), groups
