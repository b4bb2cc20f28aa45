"""`tidal verify`: the audit must pass on what the gateway writes and fail on a
re-rendered history (what a text-based recorder produces)."""

from __future__ import annotations

import itertools
import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from tidal.gateway.verify import verify_store
from tidal.ledger.store import LedgerStore
from tidal.ledger.types import Call


def mk(
    sid: str,
    cid: str,
    prompt: list[int],
    out: list[int],
    meta: dict[str, Any] | None = None,
) -> Call:
    return Call(
        session_id=sid,
        call_id=cid,
        role="main",
        prompt_ids=np.asarray(prompt, dtype=np.int32),
        output_ids=np.asarray(out, dtype=np.int32),
        output_logprobs=np.zeros(len(out), dtype=np.float32),
        output_text="",
        policy_version=0,
        finish_reason="stop",
        started_at=1.0,
        ended_at=2.0,
        metadata=meta or {},
    )


def run_cli(path: Path) -> tuple[int, dict[str, Any]]:
    p = subprocess.run(
        [sys.executable, "-m", "tidal.cli", "verify", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return p.returncode, json.loads(p.stdout)


def test_rerendered_history_fails(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "bad.db"
    sampled = [*tokenizer.encode("Hel"), *tokenizer.encode("lo"), 151645]
    retok = [*tokenizer.encode("Hello"), 151645]
    prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    more = tokenizer.encode("\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")
    with LedgerStore(path) as s:
        s.append_call(mk("s", "c1", prompt, sampled))
        s.append_call(mk("s", "c2", prompt + retok + more, [9, 151645]))  # re-rendered
        s.append_call(mk("t", "d1", prompt, [5, 151645]))
        s.append_call(mk("t", "d2", [*prompt, 5, 151645, *more], [7, 151645]))  # faithful
        rep = verify_store(s)
    assert not rep.ok
    assert rep.model_tokens == len(sampled) + 2 + 2 + 2
    assert rep.model_tokens_verbatim == rep.model_tokens - len(sampled)
    assert any("re-rendered" in p for p in rep.problems)
    code, d = run_cli(path)
    assert code == 1 and d["ok"] is False and d["calls"] == 4


def test_false_splice_claim_fails(tmp_path: Path) -> None:
    with LedgerStore(tmp_path / "claim.db") as s:
        s.append_call(mk("s", "c1", [1, 2, 3], [4, 5]))
        meta = {
            "tito": {"spliced": [["c1", 1, 3, 2]], "continues": "c1", "foreign_turns": 0},
            "drift": [{"kind": "whitespace"}],
        }
        s.append_call(mk("s", "c2", [1, 2, 3, 4, 6, 7], [8], meta))
        rep = verify_store(s)
    assert not rep.ok and rep.model_tokens_verbatim == 1
    assert rep.drift == {"whitespace": 1}


def test_gateway_store_passes_cli(
    tmp_path: Path, client_for: Any, engine: Any, store: LedgerStore
) -> None:
    from tests.gateway.test_http_drift import TOOLS, USER, tag_call

    c = client_for("v1")
    engine.push(tag_call("weather", '{"city":"Oslo"}'))
    r = c.chat.completions.create(model="scripted", messages=[USER], tools=TOOLS)
    msg = r.choices[0].message.model_dump(exclude_none=True, exclude={"refusal"})
    msg["tool_calls"][0]["function"]["arguments"] = '{"city": "Oslo"}'
    c.chat.completions.create(
        model="scripted",
        tools=TOOLS,
        messages=[
            USER,
            msg,
            {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "x"},
        ],
    )
    code, d = run_cli(store.path)
    assert code == 0 and d["ok"] is True
    assert d["calls"] == 2 and d["model_tokens"] == d["model_tokens_verbatim"] > 0
    assert d["drift"] == {"whitespace": 1}


def test_a_drifted_turn_is_one_event_and_headers_stay_flat(
    client_for: Any, engine: Any, store: LedgerStore
) -> None:
    """The client sends a drifted turn back with every later request: the ledger stores
    the drift once, later calls list no spliced turns inside the call they continue, and
    their headers do not grow with the session."""
    from tests.gateway.test_http_drift import TOOLS, USER, tag_call

    c = client_for("long")
    engine.push(tag_call("set_switch", '{"name": "beta", "on": false}'))
    r = c.chat.completions.create(model="scripted", messages=[USER], tools=TOOLS)
    msg = r.choices[0].message.model_dump(exclude_none=True, exclude={"refusal"})
    msg["tool_calls"][0]["function"]["arguments"] = "{'name': 'beta', 'on': False}"
    history: list[Any] = [
        USER, msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "ok"},
    ]
    for i in range(5):
        engine.push(f"Done {i}.")
        r = c.chat.completions.create(model="scripted", messages=history, tools=TOOLS)
        history += [{"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": f"again {i}"}]
    log = store.call_log("long")
    calls = [log.full_call(sc.call_id) for sc in log.calls]
    assert [len(x.metadata["drift"]) for x in calls] == [0, 1, 0, 0, 0, 0]
    for prev, cur in itertools.pairwise(calls):
        assert cur.metadata["tito"]["continues"] == prev.call_id
        assert cur.metadata["tito"]["spliced"] == []
    with sqlite3.connect(store.path) as db:
        sizes = [n for (n,) in db.execute(
            "SELECT length(header) FROM calls WHERE session_id='long' ORDER BY seq")]
    assert max(sizes[2:]) - min(sizes[2:]) <= 8, sizes  # counters and times, not the history
    rep = verify_store(store)
    assert rep.ok and rep.drift == {"json_literal": 1}


def test_repeated_drift_records_count_once(tmp_path: Path) -> None:
    """Ledgers written before drift was stored once per session repeat a drifted turn's
    record in every later call: the audit counts the event once."""
    rec = {"kind": "whitespace", "message_index": 1, "call_id": "c1", "client": "a",
           "recorded": "b", "trainer_sees": "recorded_tokens", "detail": ""}
    with LedgerStore(tmp_path / "old.db") as s:
        s.append_call(mk("s", "c1", [1, 2, 3], [4, 5]))
        for k, cid in enumerate(("c2", "c3", "c4")):
            prev = ["c1", "c2", "c3"][k]
            prompt = [1, 2, 3, 4, 5, *range(10, 12 + 2 * k)]
            meta = {"tito": {"spliced": [["c1", 1, 3, 2]], "continues": prev,
                             "foreign_turns": 0}, "drift": [rec]}
            s.append_call(mk("s", cid, prompt, [], meta))
        rep = verify_store(s)
    assert rep.drift == {"whitespace": 1}
