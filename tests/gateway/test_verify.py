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


def _reference_verify(store: LedgerStore) -> tuple[int, int, set[str]]:
    """The audit done the slow, obvious way (every prompt materialised, every earlier
    prompt compared): (model tokens, verbatim tokens, problems). The oracle for
    `verify_store`'s trie-based checks."""

    def starts(a: np.ndarray, p: np.ndarray) -> bool:
        return a.shape[0] >= p.shape[0] and bool(np.array_equal(a[: p.shape[0]], p))

    problems: set[str] = set(store.check())
    total = verbatim = 0
    for sid in store.session_ids():
        log = store.call_log(sid)
        order = [sc.call_id for sc in log.calls]
        prompts = {c: np.asarray(log.prompt_ids(c)) for c in order}
        outs = {sc.call_id: np.asarray(sc.call.output_ids) for sc in log.calls}
        bad: set[str] = set()
        for pos, cid in enumerate(order):
            prompt, tito = prompts[cid], log[cid].call.metadata.get("tito")
            if tito is not None:
                for rid, _i, off, n in tito["spliced"]:
                    if rid not in order[:pos]:
                        problems.add(f"{sid}/{cid}: spliced turn {rid!r} is not an earlier call")
                    elif not np.array_equal(prompt[off : off + n], outs[rid]):
                        bad.add(rid)
                        problems.add(f"{sid}/{cid}: the tokens at {off}..{off + n} differ from "
                                     f"the output of {rid!r} it claims to carry")
                cont = tito["continues"]
                if cont in outs and not starts(prompt, np.concatenate([prompts[cont],
                                                                       outs[cont]])):
                    bad.add(cont)
                    problems.add(f"{sid}/{cid}: claims to continue {cont!r} but that call's "
                                 "context is not a prefix of its prompt")
                continue
            cands = [r for r in order[:pos]
                     if len(prompts[r]) < len(prompt) and starts(prompt, prompts[r])]
            if cands:
                longest = max(len(prompts[r]) for r in cands)
                best = [r for r in cands if len(prompts[r]) == longest]
                if not any(starts(prompt[longest:], outs[r]) for r in best):
                    bad.update(best)
                    problems.add(f"{sid}/{cid}: extends the prompt of {best[-1]!r} but carries "
                                 "none of the sampled continuations of that prompt (a "
                                 "re-rendered history)")
        for sc in log.calls:
            n = len(sc.call.output_ids)
            total += n
            verbatim += 0 if sc.call_id in bad else n
    return total, verbatim, problems


def _random_session(rng: np.random.Generator, s: LedgerStore, sid: str, n_calls: int) -> None:
    """Calls that continue, branch, retry, re-render or cut an earlier conversation, with
    gateway metadata (true or false claims) on some of them."""
    ctx: dict[str, list[int]] = {}
    prompts: dict[str, list[int]] = {}
    for i in range(n_calls):
        cid = f"{sid}-c{i}"
        kinds = ["fresh", "extend", "branch", "retry", "rerender"]
        kind = rng.choice(kinds, p=[0.1, 0.67, 0.08, 0.12, 0.03]) if ctx else "fresh"
        base = str(rng.choice(sorted(ctx))) if ctx else None
        new = [int(x) for x in rng.integers(0, 50, int(rng.integers(1, 5)))]
        if kind == "fresh" or base is None:
            prompt = [1000 + i, *new]  # its own conversation
        elif kind == "extend":
            prompt = ctx[base] + new
        elif kind == "branch":
            prompt = prompts[base][: int(rng.integers(0, len(prompts[base]) + 1))] + new
        elif kind == "retry":
            prompt = list(prompts[base])
        else:  # the base's output re-tokenised: one token changed
            c = list(ctx[base])
            j = int(rng.integers(len(prompts[base]), len(c))) if len(c) > len(prompts[base]) \
                else len(c) - 1
            c[j] = (c[j] + 1) % 50
            prompt = c + new
        if not prompt:
            prompt = new
        out = [int(x) for x in rng.integers(0, 50, int(rng.integers(0, 4)))]
        meta: dict[str, Any] = {}
        claim = 0.5 if kind in ("extend", "rerender") else 0.05  # mostly true claims
        if base is not None and rng.random() < claim:
            off = len(prompts[base]) + (int(rng.integers(-1, 2)) if rng.random() < 0.1 else 0)
            n = len(ctx[base]) - len(prompts[base])
            rid = base if rng.random() < 0.97 else "ghost"  # a turn no call produced
            meta = {"tito": {"spliced": [[rid, 1, off, n]],
                             "continues": base if rng.random() < 0.8 else None,
                             "foreign_turns": 0}}
        s.append_call(mk(sid, cid, prompt, out, meta))
        prompts[cid], ctx[cid] = prompt, prompt + out


def test_trie_audit_matches_the_materialising_one(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    failing = 0
    for k in range(40):
        with LedgerStore(tmp_path / f"r{k}.db") as s:
            for j in range(3):
                _random_session(rng, s, f"s{j}", int(rng.integers(1, 12)))
            rep = verify_store(s)
            total, verbatim, problems = _reference_verify(s)
        assert (rep.model_tokens, rep.model_tokens_verbatim) == (total, verbatim), k
        assert set(rep.problems) == problems, k
        assert rep.ok == (verbatim == total and not problems)
        failing += not rep.ok
    assert 5 < failing < 35  # both outcomes are exercised


def test_a_broken_prefix_reference_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "broken.db"
    with LedgerStore(path) as s:
        s.append_call(mk("s", "c1", [1, 2, 3], [4, 5]))
        s.append_call(mk("s", "c2", [1, 2, 3, 4, 5, 6], [7]))
        s.append_call(mk("t", "d1", [1], [2]))
    with sqlite3.connect(path) as db:  # tampering: lift the append-only guard first
        for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='trigger'").fetchall():
            db.execute(f"DROP TRIGGER {name}")
        db.execute("UPDATE calls SET base_call_id='gone' WHERE call_id='c2'")
    with LedgerStore(path) as s:
        rep = verify_store(s)
    assert not rep.ok and rep.calls == 3 and rep.model_tokens == 4
    assert rep.model_tokens_verbatim == 1  # session t only: nothing of s is provable
    assert any(p.startswith("s: cannot rebuild the session") for p in rep.problems)
