"""One config, one seed, one result: with rl.numerics = "consistent" a `tidal run` and a
second one SIGKILLed during its second RL step and resumed sample the same tokens with
the same logprobs (their ledgers equal session by session), train the same steps and
write the same checkpoint bytes. Both are processes of their own, as a user runs them:
nothing a test before them left in this process's torch can tell them apart."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.run.loop_runs import (
    REPRO,
    ledger_of,
    run_and_kill_mid_step,
    small_config,
    tidal_run_command,
    trained_of,
    weights_of,
)
from tidal.run.config import parse_config


@pytest.mark.slow
def test_consistent_runs_of_one_seed_match_bit_for_bit(tmp_path: Path) -> None:
    """The resumed run continues its live sessions from their snapshots, so equal ledgers
    say both that a seed fixes every sampled token and that resuming replays none and
    changes none. Every trained token's recomputed logprob is the engine's, exactly."""
    cfg = parse_config(small_config(**REPRO))
    first, killed = tmp_path / "a", tmp_path / "killed"
    done = subprocess.run(tidal_run_command(cfg, tmp_path, first), capture_output=True,
                          text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rl = trained_of(first)
    assert len(rl) == 2 and any(r["tokens"] for r in rl), "no step had signal to train"
    for r in rl:
        assert r["max_abs_logprob_diff"] in (0.0, None) and r["token_kl"] in (0.0, None), r
    cmd = run_and_kill_mid_step(cfg, tmp_path, killed)
    r = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=900,
                       check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in (killed / "metrics.jsonl").read_text().splitlines()]
    (resume,) = [r for r in rows if r["phase"] == "resume"]
    assert resume["episodes"] >= 1  # a live episode continued from its snapshot
    assert ledger_of(killed) == ledger_of(first)
    assert trained_of(killed) == trained_of(first)
    assert weights_of(killed) == weights_of(first)
