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
  record repeated by later calls of the session counts once).
- `ok`: every model token is verbatim and the store's own integrity check passes.

Deliberately simplified: the audit materialises each call's prompt from the ledger's
prefix deltas (O(calls x prompt length) per session); fine for audits, not a hot path.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tidal.gateway.drift import drift_key
from tidal.ledger.store import LedgerStore


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


def _starts_with(a: np.ndarray, prefix: np.ndarray) -> bool:
    n = int(prefix.shape[0])
    return int(a.shape[0]) >= n and bool(np.array_equal(a[:n], prefix))


def verify_store(store: LedgerStore) -> VerifyReport:
    problems = list(store.check())
    drift: Counter[str] = Counter()
    calls = model_tokens = verbatim = 0
    for sid in store.session_ids():
        log = store.call_log(sid)
        order = [sc.call_id for sc in log.calls]
        prompts = {cid: np.asarray(log.prompt_ids(cid)) for cid in order}
        outputs = {sc.call_id: np.asarray(sc.call.output_ids) for sc in log.calls}
        bad: set[str] = set()
        seen_drift: set[tuple[Any, ...]] = set()
        for pos, sc in enumerate(log.calls):
            cid, meta = sc.call_id, sc.call.metadata
            calls += 1
            for d in meta.get("drift", []) if isinstance(meta, dict) else []:
                key = drift_key(d)
                if key not in seen_drift:  # one event, however many calls carried it
                    seen_drift.add(key)
                    drift[str(d.get("kind"))] += 1
            prompt = prompts[cid]
            tito = meta.get("tito") if isinstance(meta, dict) else None
            earlier = order[:pos]
            if isinstance(tito, dict):
                for rid, _idx, off, n in tito.get("spliced", []):
                    if rid not in outputs or rid not in earlier:
                        problems.append(f"{sid}/{cid}: spliced turn {rid!r} is not an earlier call")
                        continue
                    if not np.array_equal(prompt[off : off + n], outputs[rid]):
                        bad.add(rid)
                        problems.append(
                            f"{sid}/{cid}: the tokens at {off}..{off + n} differ from the "
                            f"output of {rid!r} it claims to carry"
                        )
                cont = tito.get("continues")
                if cont is not None and cont in outputs:
                    ctx = np.concatenate([prompts[cont], outputs[cont]])
                    if not _starts_with(prompt, ctx):
                        bad.add(cont)
                        problems.append(
                            f"{sid}/{cid}: claims to continue {cont!r} but that call's context "
                            "is not a prefix of its prompt"
                        )
                continue
            # No gateway metadata: find the conversation this prompt extends.
            best: list[str] = []
            best_len = -1
            for rid in earlier:
                rp = prompts[rid]
                plen = int(rp.shape[0])
                if plen >= int(prompt.shape[0]) or plen < best_len:
                    continue
                if _starts_with(prompt, rp):
                    if plen > best_len:
                        best, best_len = [rid], plen
                    else:
                        best.append(rid)
            if best and not any(_starts_with(prompt[best_len:], outputs[r]) for r in best):
                bad.update(best)
                problems.append(
                    f"{sid}/{cid}: extends the prompt of {best[-1]!r} but carries none of the "
                    "sampled continuations of that prompt (a re-rendered history)"
                )
        for sc in log.calls:
            n = int(sc.call.output_ids.shape[0])
            model_tokens += n
            if sc.call_id not in bad:
                verbatim += n
    ok = verbatim == model_tokens and not problems
    return VerifyReport(calls, model_tokens, verbatim, dict(sorted(drift.items())), ok, problems)
