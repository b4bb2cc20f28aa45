"""`tidal run` with the trainer across ranks (FSDP2 on gloo, real processes), LoRA, and
the layouts that cannot work.

- world_size = 2 for two RL steps: every step row carries the world size and each
  rank's peak memory, the checkpoint's training state is sharded, `tidal verify` ok;
- SIGKILL of a trainer rank ends the run at the next step with an error naming the rank,
  before anything of that step is checkpointed; `--resume` at world_size = 1 finishes
  the run from the sharded checkpoint and no session is trained twice;
- under torchrun the same command runs with the ranks torchrun started; with LoRA only
  the adapters train and the engine (and the checkpoint) get merged weights;
- impossible layouts are refused before anything starts, naming the key.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tidal.engine.tiny import ensure_tiny
from tidal.ledger import LedgerStore
from tidal.run.config import ConfigError, dump_config, parse_config
from tidal.run.loop import RunError, run

BASE: dict[str, Any] = {
    "tasks": {"name": "digits", "train_size": 4, "heldout_size": 2},
    "rollout": {"group_size": 2, "tasks_per_step": 2, "max_turns": 3, "max_tokens": 48,
                "context_budget": 4096, "sandbox": "bwrap"},
    "warmstart": {"steps": 30, "batch_size": 4, "lr": 0.003, "teacher": "exact"},
    "rl": {"steps": 3},
    "schedule": {"policy": "colocated", "devices": 1, "groups_per_device": 2},
    "eval": {"every": 5, "samples": 1},
    "train": {"world_size": 2},
}


def _config(**over: dict[str, Any]) -> dict[str, Any]:
    cfg = json.loads(json.dumps(BASE))
    for k, v in over.items():
        cfg.setdefault(k, {}).update(v)
    return cfg


def _rows(out: Path, phase: str = "rl") -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == phase]


@pytest.mark.slow
def test_two_ranks_two_steps(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # a warm start long enough that some groups' rewards differ, so that steps with
    # signal train across ranks (15 steps at 5e-3: both steps train two streams); it is
    # most of the test's time, as each of its steps syncs the two ranks over gloo
    cfg = _config(warmstart={"steps": 15, "lr": 0.005}, rl={"steps": 2})
    summary = run(parse_config(cfg), out)
    assert summary["steps"] == 2 and summary["verify_ok"] and summary["drift_tokens"] == 0
    rl = _rows(out)
    assert [r["step"] for r in rl] == [1, 2]
    for r in rl:
        assert r["world_size"] == 2
        assert len(r["peak_memory_mb_per_rank"]) == 2
        assert all(mb > 0 for mb in r["peak_memory_mb_per_rank"])
    assert any(r["tokens"] > 0 and r["streams"] >= 2 for r in rl), "no step trained"
    shards = sorted(p.name for p in (out / "checkpoint" / "train_state").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own
    assert (out / "trainer" / "rank-1.log").exists()


def _trainer_ranks(pid: int) -> list[int]:
    """Pids of the trainer-rank processes under `pid`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"tidal.train.group" in cmd:
            found.append(int(proc.name))
    return found


@pytest.mark.slow
def test_rank_sigkill_then_resume_at_another_world_size(tmp_path: Path) -> None:
    cfg = _config(warmstart={"steps": 0}, rl={"steps": 3})
    out, conf = tmp_path / "run", tmp_path / "c.toml"
    conf.write_text(dump_config(parse_config(cfg)))
    cmd = [sys.executable, "-m", "tidal.cli", "run", str(conf), "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, text=True)
    state = out / "checkpoint" / "state.json"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if state.exists() and json.loads(state.read_text())["step"] >= 1:
            break
        time.sleep(0.2)
    ranks = _trainer_ranks(proc.pid)
    assert proc.poll() is None and len(ranks) == 1, "the run ended before its rank was killed"
    killed_at = json.loads(state.read_text())["step"]
    os.kill(ranks[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-2000:]
    assert "trainer rank 1 was killed by SIGKILL" in err, err[-2000:]
    assert "--resume" in err
    after_kill = json.loads(state.read_text())
    assert after_kill["step"] in (killed_at, killed_at + 1)  # whole steps only
    assert not (out / "checkpoint.tmp").exists() or not (out / "checkpoint.tmp" /
                                                          "state.json").exists()
    # resume on one rank: the two ranks' sharded state loads at world_size = 1
    one = tmp_path / "one.toml"
    one.write_text(dump_config(parse_config(_config(warmstart={"steps": 0},
                                                    train={"world_size": 1}))))
    r = subprocess.run([*cmd[:4], str(one), "--out", str(out), "--resume"],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    final = json.loads(state.read_text())
    assert final["step"] == 3
    trained = final["trained_sessions"]
    assert len(trained) == len(set(trained)), "a session was trained twice"
    assert set(after_kill["trained_sessions"]) <= set(trained)
    with LedgerStore(out / "ledger.db", readonly=True) as store:
        assert store.check() == []
    assert [r["world_size"] for r in _rows(out)][-1] == 1


@pytest.mark.slow
def test_torchrun_starts_lora_ranks_and_the_engine_gets_merged_weights(tmp_path: Path) -> None:
    """Under torchrun, `tidal run` trains on the ranks torchrun started, here LoRA
    adapters (peft): the warm start and the RL step train the adapters only, and the
    engine and the checkpoint get the merged weights (only the targets' differ)."""
    out, conf = tmp_path / "run", tmp_path / "c.toml"
    lora = {"r": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"]}
    conf.write_text(dump_config(parse_config(_config(
        warmstart={"steps": 6}, rl={"steps": 1}, train={"lora": lora}))))
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "-m", "tidal.cli", "run", str(conf), "--out", str(out)],
        capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-2])["verify_ok"]
    assert [row["world_size"] for row in _rows(out)] == [2]
    shards = sorted(p.name for p in (out / "checkpoint" / "train_state").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    assert not (out / "trainer").exists()  # torchrun started the ranks, not tidal
    base = load_file(ensure_tiny(seed=0) / "model.safetensors")
    merged = load_file(out / "checkpoint" / "model.safetensors")
    assert merged.keys() == base.keys()
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed, "the warm start trained nothing"
    assert all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed), changed


@pytest.mark.parametrize(("over", "key"), [
    ({"rollout": {"tasks_per_step": 1}}, "rollout.tasks_per_step"),
    ({"warmstart": {"batch_size": 1}}, "warmstart.batch_size"),
    ({"rl": {"numerics": "consistent"}}, "train.world_size"),
    ({"rl": {"kl_coef": 0.1}}, "rl.kl_coef"),
    ({"train": {"world_size": 3, "nodes": 2}}, "train.nodes"),
    ({"train": {"lora": {"r": 0}}}, "train.lora.r"),
])
def test_impossible_layouts_are_config_errors(over: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_config(_config(**over))


def test_machine_limits_are_checked_before_anything_starts(tmp_path: Path) -> None:
    cores = os.cpu_count() or 1
    too_many = _config(train={"world_size": cores + 1},
                       rollout={"tasks_per_step": cores + 1})
    with pytest.raises(RunError, match=r"train\.world_size = \d+ ranks exceed"):
        run(parse_config(too_many), tmp_path / "a")
    assert not (tmp_path / "a" / "config.toml").exists()
    bad = _config(train={"world_size": 1, "lora": {"targets": ["nope_proj"]}})
    with pytest.raises(RunError, match=r"train\.lora\.targets.*nope_proj"):
        run(parse_config(bad), tmp_path / "b")
    assert not (tmp_path / "b" / "config.toml").exists()
