"""bench/engine_replay.py: a run's recorded calls, replayed against an engine alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benches import load_bench
from tidal.engine.embedded import EmbeddedEngine
from tidal.ledger import Call, LedgerStore, make_call


def _call(sid: str, cid: str, span: tuple[float, float], prompt: list[int],
          out: list[int]) -> Call:
    start, end = span
    return make_call({
        "session_id": sid, "call_id": cid, "role": "main", "prompt_ids": prompt,
        "output_ids": out, "output_logprobs": [-0.1] * len(out), "output_text": "x",
        "policy_version": 0, "finish_reason": "stop", "started_at": start, "ended_at": end,
        "sampling": {"seed": 7, "max_tokens": 96},
    })


def _ledger(path: Path) -> None:
    with LedgerStore(path) as st:
        # rl-1's first session: its second call extends the first's prompt and output, its
        # third starts over (a prompt that does not extend the history)
        st.append_call(_call("rl-1-a-0", "a0", (100.0, 101.0), [1, 2, 3, 4], [5, 6]))
        st.append_call(_call("rl-1-a-0", "a1", (101.5, 102.0), [1, 2, 3, 4, 5, 6, 7, 8], [9]))
        st.append_call(_call("rl-1-a-0", "a2", (102.25, 103.0), [1, 2, 30], [31, 32, 33]))
        # a session that started 2 s into the phase
        st.append_call(_call("rl-1-b-1", "b0", (102.0, 104.0), [1, 2, 3, 10, 11], [12]))
        # another phase's session: not replayed
        st.append_call(_call("rl-2-c-0", "c0", (200.0, 201.0), [1, 2], [3]))


def test_a_phase_becomes_its_sessions_calls_with_their_gaps(tmp_path: Path) -> None:
    bench = load_bench("engine_replay")
    _ledger(tmp_path / "ledger.db")
    with LedgerStore(tmp_path / "ledger.db", readonly=True) as st:
        sessions, span, generated = bench.phase_sessions(st, "rl-1")
        with pytest.raises(SystemExit, match="no session of phase 'eval-6'"):
            bench.phase_sessions(st, "eval-6")
    assert span == pytest.approx(4.0) and generated == 7
    a, b = sorted(sessions, key=len, reverse=True)
    assert [(c.delay_s, c.appended, c.restart, c.max_tokens) for c in a] == [
        (0.0, (1, 2, 3, 4), True, 2),  # the first call: all of its prompt
        (0.5, (7, 8), False, 1),  # what the run appended after the first call's output
        (0.25, (1, 2, 30), True, 3),
    ]
    assert a[0].seed == 7
    assert [(c.delay_s, c.appended) for c in b] == [(2.0, (1, 2, 3, 10, 11))]


def test_a_replay_sends_the_runs_prompt_lengths_and_samples_its_tokens(tmp_path: Path) -> None:
    bench = load_bench("engine_replay")
    _ledger(tmp_path / "ledger.db")
    with LedgerStore(tmp_path / "ledger.db", readonly=True) as st:
        sessions, _span, generated = bench.phase_sessions(st, "rl-1")
    with EmbeddedEngine("tiny", seed=0) as eng:
        r = bench.replay(eng, sessions)
    # as many tokens as the run sampled, each prompt as long as the run's (the replayed
    # outputs stand in for the recorded ones), and no sooner than the recorded gaps allow
    assert r.generated == generated
    assert sorted(r.prompt_lengths, key=len, reverse=True) == [[4, 8, 3], [5]]
    assert r.seconds >= 2.0
