"""Shared fixtures and helpers for tidal.tree tests: real SQLite ledgers, real calls."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from tests.tree.synth import SynthWriter
from tidal.ledger.store import LedgerStore
from tidal.ledger.types import Call, PromptDelta, StoredCall


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LedgerStore]:
    with LedgerStore(tmp_path / "ledger.db") as st:
        yield st


@pytest.fixture
def writer(store: LedgerStore) -> SynthWriter:
    return SynthWriter(store, seed=7)


def stored(  # noqa: PLR0917
    seq: int,
    sid: str,
    cid: str,
    base: str | None,
    prefix_len: int,
    suffix: Sequence[int],
    out: Sequence[int],
    *,
    role: str = "main",
    parent_call: str | None = None,
    parent_session: str | None = None,
    logprob: float = -0.5,
    version: int = 0,
) -> StoredCall:
    """A StoredCall as the store would return it, with a chosen (maybe misleading or
    malformed) prompt delta."""
    call = Call(
        session_id=sid, call_id=cid, role=role, prompt_ids=np.zeros(0, np.int32),
        output_ids=np.asarray(out, np.int32),
        output_logprobs=np.full(len(out), logprob, np.float32),
        output_text=f"text of {cid}", policy_version=version, finish_reason="stop",
        started_at=float(seq), ended_at=float(seq), parent_call_id=parent_call,
        parent_session_id=parent_session,
    )
    return StoredCall(seq, call, PromptDelta(base, prefix_len, np.asarray(suffix, np.int32)), "")
