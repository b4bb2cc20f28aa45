"""Small runs of the whole loop for the tests of tests/run: the config they share, and
what a finished run left (its ledger, checkpoint and trained steps), read back to compare
runs. `run_and_kill_mid_step` runs `tidal run` in a process and SIGKILLs it mid-step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tidal.ledger import LedgerStore
from tidal.run.config import RunConfig

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


def small_config(**over: dict[str, object]) -> dict[str, object]:
    cfg = json.loads(json.dumps(SMALL))
    cfg["rollout"]["sandbox"] = "bwrap"  # the real sandbox: CI installs bubblewrap
    for k, v in over.items():
        cfg[k].update(v)
    return cfg


REPRO = {"rl": {"steps": 2, "numerics": "consistent"},
         "warmstart": {"steps": 20, "teacher": "mixed"},
         "tasks": {"name": "digits", "train_size": 4, "heldout_size": 1},
         "rollout": {"context_budget": 4096, "temperature": 1.0, "group_size": 4,
                     "tasks_per_step": 2, "max_turns": 3, "snapshot_every": 1}}


def ledger_of(out: Path) -> dict[str, object]:
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


def weights_of(out: Path) -> dict[str, bytes]:
    """The checkpoint's files, bytes: the weights, and the trainer state's shards. Left
    out: state.json (it names sessions by id) and torch.distributed.checkpoint's
    .metadata (it holds a random save id)."""
    ck = out / "checkpoint"
    got = {str(f.relative_to(ck)): f.read_bytes() for f in sorted(ck.rglob("*"))
           if f.is_file() and f.name not in ("state.json", ".metadata")}
    assert any(k.endswith(".distcp") for k in got) and any(k.endswith(".safetensors")
                                                          for k in got), sorted(got)
    return got


def trained_of(out: Path) -> list[dict[str, object]]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    keep = ("loss", "tokens", "grad_norm", "max_abs_logprob_diff", "token_kl", "reward_mean")
    return [{k: r.get(k) for k in keep} for r in rows if r["phase"] == "rl"]


def tidal_run_command(cfg: RunConfig, tmp_path: Path, out: Path) -> list[str]:
    """The `tidal run` command line of `cfg` (written to tmp_path/c.toml) into `out`."""
    from tidal.run.config import dump_config

    conf = tmp_path / "c.toml"
    conf.write_text(dump_config(cfg))
    return [sys.executable, "-m", "tidal.cli", "run", str(conf), "--out", str(out)]


def has_snapshot(live: Path) -> bool:
    """Whether a live episode's sandbox snapshot is on disk under `live`. The run removes
    an episode's folder when the episode ends, so a folder listed may be gone by the
    time it is read."""
    try:
        return any(live.glob("*/*.tar"))
    except FileNotFoundError:
        return False


def run_and_kill_mid_step(cfg: RunConfig, tmp_path: Path, out: Path) -> list[str]:
    """`tidal run` of `cfg` in a process of its own, SIGKILLed once a step is
    checkpointed and a live episode of a later step has a sandbox snapshot. Returns the
    command (append `--resume` to continue it)."""
    cmd = tidal_run_command(cfg, tmp_path, out)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    state = out / "checkpoint" / "state.json"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if (state.exists() and json.loads(state.read_text())["step"] >= 1
                and has_snapshot(out / "live")):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return cmd


def live_at_stop(out: Path) -> tuple[set[str], list[str]]:
    """After a run was stopped: the ids of every call committed, and its RL main sessions
    with no outcome (live at the stop)."""
    with LedgerStore(out / "ledger.db", readonly=True) as store:
        before = {sc.call_id for sc in store.iter_calls()}
        done = store.outcomes()
        live = [s.session_id for s in store.sessions() if s.session_id.startswith("rl-")
                and s.parent_session_id is None and s.session_id not in done]
    return before, live


def resume_to_the_end(cmd: list[str], out: Path, before: set[str], live: list[str],
                      steps: int) -> dict[str, object]:
    """`--resume` the stopped run of `cmd` to its end and check what it left: `steps`
    steps, every session trained once, every call committed before the stop kept, the
    sessions `live` at the stop resumed (not closed as infra_error, no call sampled
    twice). Returns the final state.json."""
    r = subprocess.run([*cmd[:-2], "--out", str(out), "--resume"], capture_output=True,
                       text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    final = json.loads((out / "checkpoint" / "state.json").read_text())
    trained = final["trained_sessions"]
    assert final["step"] == steps
    assert len(trained) == len(set(trained)), "a session was trained twice"
    with LedgerStore(out / "ledger.db", readonly=True) as store:
        assert store.check() == []
        assert before <= {sc.call_id for sc in store.iter_calls()}
        outcomes = store.outcomes()
        main_rl = [s.session_id for s in store.sessions()
                   if s.session_id.startswith("rl-") and s.parent_session_id is None]
        for sid in main_rl:  # every committed RL session trained or closed as infra_error
            assert sid in trained or outcomes[sid].status.value == "infra_error", sid
        for sid in live:  # resumed, not thrown away
            assert outcomes[sid].details.get("error") != "the run was killed mid-session", sid
            assert sid in trained or sid in final["dropped_sessions"], sid
            log = store.call_log(sid)
            prompts = [tuple(log.prompt_ids(sc.call_id).tolist()) for sc in log.calls]
            assert len(prompts) == len(set(prompts)), f"{sid}: a call was sampled twice"
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    (resume,) = [r for r in rows if r["phase"] == "resume"]
    assert resume["episodes"] >= len(live)
    return final
