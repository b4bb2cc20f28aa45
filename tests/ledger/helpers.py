"""Builders for ledger tests: valid call dicts that a test then breaks one field at a time."""

from __future__ import annotations

from typing import Any

import numpy as np

from tidal.ledger import Call, make_call


def call_dict(session_id: str = "s1", call_id: str = "c0", **over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "type": "call",
        "session_id": session_id,
        "call_id": call_id,
        "role": "main",
        "parent_call_id": None,
        "parent_session_id": None,
        "prompt_ids": [1, 2, 3],
        "output_ids": [4, 5],
        "output_logprobs": [-0.5, -0.25],
        "output_text": "hi",
        "raw_tool_calls": None,
        "tool_calls": None,
        "policy_version": 0,
        "finish_reason": "stop",
        "started_at": 100.0,
        "ended_at": 101.5,
    }
    d.update(over)
    return d


def mk_call(session_id: str = "s1", call_id: str = "c0", **over: Any) -> Call:
    return make_call(call_dict(session_id, call_id, **over))


def growing_session(
    session_id: str, n_calls: int, out_len: int = 7, tool_len: int = 11, seed: int = 0
) -> list[Call]:
    """A linear agent session: each prompt = previous prompt + output + a tool result."""
    rng = np.random.default_rng(seed)
    ctx = rng.integers(0, 150_000, 50).astype(np.int32)
    calls = []
    for i in range(n_calls):
        out = rng.integers(0, 150_000, out_len).astype(np.int32)
        calls.append(
            mk_call(
                session_id, f"c{i}", prompt_ids=ctx, output_ids=out,
                output_logprobs=-rng.random(out_len).astype(np.float32),
                started_at=float(i), ended_at=float(i) + 0.5,
            )
        )
        ctx = np.concatenate([ctx, out, rng.integers(0, 150_000, tool_len).astype(np.int32)])
    return calls
