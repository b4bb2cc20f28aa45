"""`tidal verify` on one long session: time and peak memory of the audit.

The session is `bench/ledger.py`'s: 500 calls growing to 1M tokens, each prompt the
previous context plus a tool result. It is audited twice: as an imported store (no
gateway metadata: each call's conversation is found by prefix) and as the gateway writes
it (each call says which call it continues). The audit should cost about the stored
tokens, not calls x prompt length: for this session the prompts add up to ~250M tokens
(1 GB of ids), which an audit that materialises them would have to build and compare.
Prints JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path
from typing import Any

from ledger import synthetic_session
from tidal.gateway.verify import verify_store
from tidal.ledger import LedgerStore


def audit(path: Path) -> dict[str, Any]:
    with LedgerStore(path, readonly=True) as store:
        t0 = time.perf_counter()
        rep = verify_store(store)
        seconds = time.perf_counter() - t0
        tracemalloc.start()
        verify_store(store)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return {
        "verify_s": round(seconds, 3),
        "verify_peak_mb": round(peak / 2**20, 1),
        "ok": rep.ok,
        "model_tokens": rep.model_tokens,
        "verbatim": rep.model_tokens_verbatim,
    }


def run(n_calls: int, total_tokens: int) -> dict[str, Any]:
    calls = synthetic_session(n_calls, total_tokens)
    gateway = [calls[0]] + [
        replace(c, metadata={"tito": {"spliced": [], "continues": prev.call_id,
                                      "foreign_turns": 0}})
        for prev, c in itertools.pairwise(calls)
    ]
    out: dict[str, Any] = {
        "bench": "verify_long_session",
        "calls": n_calls,
        "prompt_tokens_total": int(sum(c.prompt_ids.shape[0] for c in calls)),
    }
    with tempfile.TemporaryDirectory() as d:
        for name, batch in (("imported", calls), ("gateway", gateway)):
            path = Path(d) / f"{name}.db"
            with LedgerStore(path) as store:
                for c in batch:
                    store.append_call(c)
                out["unique_tokens"] = store.stats()["unique_tokens"]
            out[name] = audit(path)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--tokens", type=int, default=1_000_000)
    a = p.parse_args()
    print(json.dumps(run(a.calls, a.tokens), indent=2))


if __name__ == "__main__":
    main()
