"""The token ledger: every LLM call stored exactly and verifiably (see docs/ledger.md)."""

from tidal.ledger.store import CallLog, LedgerStore, SessionInfo
from tidal.ledger.types import (
    Call,
    LedgerError,
    Outcome,
    PromptDelta,
    Role,
    SessionMeta,
    Status,
    StoredCall,
    make_call,
    make_outcome,
)

__all__ = [
    "Call",
    "CallLog",
    "LedgerError",
    "LedgerStore",
    "Outcome",
    "PromptDelta",
    "Role",
    "SessionInfo",
    "SessionMeta",
    "Status",
    "StoredCall",
    "make_call",
    "make_outcome",
]
