"""Workload models: the long-tail lognormal and a recorded run's ledger."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tidal.ledger import LedgerStore, make_call
from tidal.schedule.compare import Scenario, compare
from tidal.schedule.workload import EmpiricalWorkload, LognormalWorkload, SessionTable


def test_default_lognormal_has_a_2h_mean_and_a_p99_over_4h() -> None:
    wl = LognormalWorkload()
    assert wl.quantile(0.99) > 4 * 3600
    d, tok = wl.draw(np.random.default_rng(0), 200_000)
    assert d.mean() == pytest.approx(7200, rel=0.01)
    assert np.quantile(d, 0.99) == pytest.approx(wl.quantile(0.99), rel=0.03)
    assert tok.mean() == pytest.approx(7200 * 120, rel=0.02)


def test_sigma_from_a_target_p99() -> None:
    wl = LognormalWorkload.from_p99(7200, 5 * 3600)
    assert wl.quantile(0.99) == pytest.approx(5 * 3600)
    with pytest.raises(ValueError, match="no lognormal"):
        LognormalWorkload.from_p99(7200, 7200 * 100)


def _call(sid: str, cid: str, start: float, end: float, *, prompt: list[int], out: list[int],
          parent: str | None = None):
    return make_call({
        "session_id": sid, "call_id": cid, "role": "main" if parent is None else "subagent",
        "prompt_ids": prompt, "output_ids": out, "output_logprobs": [-0.1] * len(out),
        "output_text": "x", "policy_version": 0, "finish_reason": "stop",
        "started_at": start, "ended_at": end, "parent_session_id": parent,
    })


def make_ledger(path: Path) -> None:
    with LedgerStore(path) as st:
        # session a: two calls, 0..30 s; the second prompt extends the first context
        st.append_call(_call("a", "a0", 0.0, 10.0, prompt=[1, 2, 3], out=[4, 5]))
        st.append_call(_call("a", "a1", 20.0, 30.0, prompt=[1, 2, 3, 4, 5, 6, 7], out=[8]))
        # its subagent runs 25..50 s: folded into a
        st.append_call(_call("a-sub", "s0", 25.0, 50.0, prompt=[9, 9], out=[9], parent="a"))
        # session b: one call 100..160 s
        st.append_call(_call("b", "b0", 100.0, 160.0, prompt=[1] * 10, out=[2] * 5))


def test_ledger_workload_uses_session_spans_and_unique_tokens(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    make_ledger(path)
    wl = EmpiricalWorkload.from_ledger(path)
    pairs = sorted(zip(wl.durations_s, wl.tokens, strict=True))
    # a: 0..50 s with its subagent; tokens 3+2 (a0) + 2+1 (a1: suffix 6,7 and output 8)
    #    + 2+1 (the subagent) = 11. b: 60 s, 10 + 5 = 15 tokens.
    assert pairs == [(50.0, 11), (60.0, 15)]
    scaled = EmpiricalWorkload.from_ledger(path, mean_s=7200)
    d, _ = scaled.draw(np.random.default_rng(0), 1000)
    assert set(np.round(d)) == {round(50 * 7200 / 55), round(60 * 7200 / 55)}
    flat = EmpiricalWorkload.from_ledger(path, include_subagents=False)
    assert sorted(flat.durations_s) == [30.0, 60.0]


def test_simulator_replays_a_ledger_workload(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    make_ledger(path)
    wl = EmpiricalWorkload.from_ledger(path, mean_s=3600)
    r = compare(Scenario(n_devices=8, slots_per_device=2, steps=3, workload=wl,
                         train_s_per_token=10.0))
    assert r["workload"]["kind"] == "empirical"
    assert {"colocated", "async", "elastic"} <= set(r["policies"])


def test_fixed_session_table() -> None:
    t = SessionTable.fixed([1.0, 2.0], 5)
    t.ensure(2)
    with pytest.raises(ValueError, match="only 2 sessions"):
        t.ensure(3)
