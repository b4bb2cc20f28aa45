"""`tidal verify`: audit a ledger store for token fidelity.

Definitions (all counted over output tokens, i.e. tokens the engine sampled):
- `model_tokens`: the sum of every call's output length.
- A call R's output is *verbatim* unless a later call of the same session continues R's
  conversation and does not carry R's sampled tokens unchanged at their position:
  * a later call C whose gateway metadata lists R among its spliced turns must hold
    R's output ids exactly at the recorded offset of C's prompt; and if C says it
    continues R, R's whole context (prompt + output) must be a prefix of C's prompt
    (the turns spliced inside that context are then R's own, checked at R: the gateway
    lists only the turns spliced after it);
  * a later call without gateway metadata (imported, or from `/v1/completions`) whose
    prompt strictly extends R's prompt (the longest such R) continues R's conversation;
    it must start with the context of R or of a sibling sampled from the same prompt. A history
    re-rendered from text breaks this, which is the failure the audit exists to catch.
  A call nobody continues (the session's last output, a branch the client abandoned, a
  turn the client edited) is verbatim: it is trained as the end of its own path.
- `model_tokens_verbatim`: the output tokens of verbatim calls.
- `drift`: counts by kind of the drift events the gateway stored in call metadata (a
  record repeated by later calls of the session counts once), `special_token_text`
  included: client text holding a special token's text, tokenized as plain text.
- `ok`: every model token is verbatim and the store's own integrity check passes.

How: the audit never materialises a prompt. Each session's calls go into the exact
prefix trie of `tidal.tree.trie` (built from the ledger's prompt deltas, linear in the
stored tokens), where every call's prompt and context end at a node end. "Context of R is
a prefix of C's prompt" is then "R's context node lies on C's prompt path", a walk up
the trie (a few nodes when C continues a recent call); a spliced turn's tokens are read
from the nodes covering its offsets. So an audit costs about the stored tokens plus a
walk per check, not calls x prompt length (`bench/verify.py`: a 500-call, 1M-token
session). A session the trie cannot be rebuilt from (a broken prefix reference) is a
problem, and none of its tokens count as verbatim.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tidal.gateway.drift import drift_key
from tidal.ledger.store import LedgerStore
from tidal.tree.trie import CallPlace, SessionTrie, TreeError, build_trie


@dataclass(frozen=True)
class VerifyReport:
    calls: int
    model_tokens: int
    model_tokens_verbatim: int
    drift: dict[str, int]
    ok: bool
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "model_tokens": self.model_tokens,
            "model_tokens_verbatim": self.model_tokens_verbatim,
            "drift": self.drift,
            "ok": self.ok,
            "problems": self.problems[:100],
            "problem_count": len(self.problems),
        }


def verify_store(store: LedgerStore) -> VerifyReport:
    problems = list(store.check())
    drift: Counter[str] = Counter()
    calls = model_tokens = verbatim = 0
    for sid in store.session_ids():
        log = store.call_log(sid)
        calls += len(log)
        sizes = {sc.call_id: int(sc.call.output_ids.shape[0]) for sc in log.calls}
        model_tokens += sum(sizes.values())
        try:
            trie = build_trie(sid, log.calls)
        except TreeError as e:  # a broken prefix reference: no token of it is provable
            problems.append(f"{sid}: cannot rebuild the session: {e}")
            continue
        bad = _audit_session(trie, drift, problems)
        verbatim += sum(n for cid, n in sizes.items() if cid not in bad)
    ok = verbatim == model_tokens and not problems
    return VerifyReport(calls, model_tokens, verbatim, dict(sorted(drift.items())), ok, problems)


def _audit_session(trie: SessionTrie, drift: Counter[str], problems: list[str]) -> set[str]:
    """Check one session's calls in commit order; returns the ids of calls whose output
    a later call does not carry unchanged (see the module docstring)."""
    sid = trie.session_id
    index = {p.call_id: p.index for p in trie.places}
    bad: set[str] = set()
    seen_drift: set[tuple[Any, ...]] = set()
    prompt_ends: dict[int, list[int]] = {}  # node -> earlier calls whose prompt ends there
    for pos, (sc, place) in enumerate(zip(trie.calls, trie.places, strict=True)):
        cid, meta = sc.call_id, sc.call.metadata
        for d in meta.get("drift", []) if isinstance(meta, dict) else []:
            key = drift_key(d)
            if key not in seen_drift:  # one event, however many calls carried it
                seen_drift.add(key)
                drift[str(d.get("kind"))] += 1
        tito = meta.get("tito") if isinstance(meta, dict) else None
        if isinstance(tito, dict):
            for rid, _idx, off, n in tito.get("spliced", []):
                r = index.get(rid)
                if r is None or r >= pos:
                    problems.append(f"{sid}/{cid}: spliced turn {rid!r} is not an earlier call")
                    continue
                carried = _path_slice(trie, place.prompt_end, off, min(off + n, place.prompt_len))
                if not np.array_equal(carried, trie.calls[r].call.output_ids):
                    bad.add(rid)
                    problems.append(
                        f"{sid}/{cid}: the tokens at {off}..{off + n} differ from the "
                        f"output of {rid!r} it claims to carry"
                    )
            cont = tito.get("continues")
            r = index.get(cont) if isinstance(cont, str) else None
            if r is not None and not _context_prefixes(trie, r, place):
                bad.add(str(cont))
                problems.append(
                    f"{sid}/{cid}: claims to continue {cont!r} but that call's context "
                    "is not a prefix of its prompt"
                )
        else:
            # No gateway metadata: the deepest earlier prompt that this one strictly
            # extends; the calls that share it are the conversation this call continues.
            best = _deepest_earlier_prompt(trie, place, prompt_ends)
            if best and not any(_context_prefixes(trie, b, place) for b in best):
                bad.update(trie.places[b].call_id for b in best)
                problems.append(
                    f"{sid}/{cid}: extends the prompt of {trie.places[best[-1]].call_id!r} but "
                    "carries none of the sampled continuations of that prompt (a re-rendered "
                    "history)"
                )
        prompt_ends.setdefault(place.prompt_end, []).append(pos)
    return bad


def _context_prefixes(trie: SessionTrie, r: int, place: CallPlace) -> bool:
    """Is call `r`'s whole context (prompt + output) a prefix of `place`'s prompt?"""
    rp = trie.places[r]
    return rp.context_len <= place.prompt_len and trie.is_ancestor(
        rp.context_end, place.prompt_end
    )


def _deepest_earlier_prompt(
    trie: SessionTrie, place: CallPlace, prompt_ends: dict[int, list[int]]
) -> list[int]:
    """The earlier calls with the longest prompt that is a proper prefix of `place`'s."""
    node = place.prompt_end
    while node != -1:
        node = trie.nodes[node].parent  # prompts ending at prompt_end itself are equal
        if node in prompt_ends:
            return prompt_ends[node]
    return []


def _path_slice(trie: SessionTrie, node: int, start: int, stop: int) -> np.ndarray:
    """Tokens `start:stop` of the path from the root to the end of `node`."""
    parts = []
    while node != -1 and trie.nodes[node].end > start:
        n = trie.nodes[node]
        if n.depth < stop:
            parts.append(n.token_ids[max(start, n.depth) - n.depth : min(stop, n.end) - n.depth])
        node = n.parent
    return np.concatenate(parts[::-1]) if parts else np.zeros(0, np.int32)
