"""Session state: the sessions a gateway holds in memory, and how a request finds its own.

Each session's recorded turns (`SessionTurns`: what token-in-token-out splices back) are
kept until the session is forgotten; a session this process does not hold is rebuilt
from the ledger on its first use (`load`). Beside them, which session owns each recorded
call (how a subagent's parent call is resolved), and, for automatic sessions (a request
without a session id), each tool-call id and assistant turn it produced (how its next
request finds it). Thread-safe.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable

from tidal.gateway.messages import RequestError, shown
from tidal.gateway.tito import SessionTurns
from tidal.ledger.store import LedgerStore


class Sessions:
    """The sessions held in memory; `load(session_id, turns)` rebuilds one from the
    ledger on its first use."""

    def __init__(self, store: LedgerStore, load: Callable[[str, SessionTurns], None]) -> None:
        self._store = store
        self._load = load
        self._lock = threading.Lock()
        self._turns: dict[str, SessionTurns] = {}
        self._tool_owner: dict[str, str] = {}  # tool-call id -> session (automatic ones)
        self._key_owner: dict[str, str] = {}  # turn key -> session (automatic ones)
        self._call_owner: dict[str, str] = {}  # call id -> session

    def __len__(self) -> int:
        with self._lock:
            return len(self._turns)

    def __contains__(self, session_id: object) -> bool:
        with self._lock:
            return session_id in self._turns

    def kept(self, session_id: str) -> SessionTurns | None:
        """The session's turns if this process holds them (nothing is loaded)."""
        with self._lock:
            return self._turns.get(session_id)

    def turns(self, session_id: str) -> SessionTurns:
        """The session's turns, rebuilt from the ledger on first use."""
        with self._lock:
            t = self._turns.get(session_id)
            if t is None:
                t = self._turns[session_id] = SessionTurns()
        t.load_once(lambda turns: self._load(session_id, turns))
        return t

    def find(self, keys: Iterable[str], tool_ids: Iterable[str]) -> str:
        """The automatic session that produced one of `tool_ids` or of the assistant turns
        `keys`, else a fresh `auto-...` id."""
        with self._lock:
            for t in tool_ids:
                if t in self._tool_owner:
                    return self._tool_owner[t]
            for k in keys:
                if k in self._key_owner:
                    return self._key_owner[k]
        return f"auto-{uuid.uuid4().hex[:16]}"

    def parent(self, parent_call: str | None, parent_session: str | None,
               session_id: str) -> tuple[str | None, str | None]:
        """The (parent call, parent session) a call of `session_id` is recorded with: the
        parent call's session is looked up when not named (here, else in the ledger); a
        parent call of the session itself (the first call after a compaction) links
        inside the session, with no parent session."""
        if parent_call is None:
            return None, parent_session
        with self._lock:
            psid = parent_session or self._call_owner.get(parent_call)
        if psid is None:
            psid = self._store.session_of_call(parent_call)  # before a restart, or elsewhere
        if psid is None or (psid not in self
                            and parent_call not in self._store.call_log(psid)):
            raise RequestError(
                f"parent call {shown(parent_call)} is not a call this gateway recorded; name "
                "its session with X-Tidal-Parent-Session if another process wrote it",
                param="parent_call_id", code="invalid_parent_call_id")
        if psid == session_id:
            return parent_call, None
        return parent_call, psid

    def own_calls(self, session_id: str, call_ids: Iterable[str]) -> None:
        with self._lock:
            self._call_owner.update(dict.fromkeys(call_ids, session_id))

    def remember(self, session_id: str, call_id: str, *, tool_ids: Iterable[str] = (),
                 key: str | None = None) -> None:
        """A call of the session is recorded; an automatic session's tool-call ids and
        turn key find it again."""
        with self._lock:
            self._call_owner[call_id] = session_id
            for t in tool_ids:
                self._tool_owner[t] = session_id
            if key is not None:
                self._key_owner[key] = session_id

    def forget(self, session_id: str) -> bool:
        """Drop the session's turns and what finds it; whether it was held."""
        with self._lock:
            known = self._turns.pop(session_id, None) is not None
            for index in (self._tool_owner, self._key_owner, self._call_owner):
                for k in [k for k, v in index.items() if v == session_id]:
                    del index[k]
        return known


def check_session_row(turns: SessionTurns, session_id: str, task_id: str | None,
                      parent_session: str | None) -> None:
    """Refuse, before generating, a call whose task (or parent session) differs from its
    session's: the ledger binds a session to its first call's (409)."""
    row = turns.row
    if row is None:
        return
    for label, asked, kept, code in (
        ("task", task_id, row[0], "task_conflict"),
        ("parent session", parent_session, row[1], "parent_session_conflict"),
    ):
        if asked is not None and kept is not None and asked != kept:
            raise RequestError(
                f"session {shown(session_id)} belongs to {label} {shown(kept)}, not "
                f"{shown(asked)}: a session keeps the {label} of its first call; start "
                f"a new session for another {label}",
                param="task_id" if label == "task" else "parent_session_id",
                code=code, status=409)
