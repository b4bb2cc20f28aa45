"""The embedded ledger store: one append-only SQLite file (WAL mode).

What it does, and what it deliberately keeps simple:
- Every record (call or outcome) is written in its own transaction as it completes, and
  is never updated or deleted (SQLite triggers refuse both). Each carries a SHA-256 of
  its content and a chain hash over all earlier records of its table, so
  `check()` finds an altered, reordered or removed record and names it.
- Prompts are stored as `PromptDelta`s against the best of a few candidate earlier
  calls of the same session (the caller's hint, then the most recent calls). The
  candidates' contexts are cached in memory as prefixes of shared growable buffers
  (`_Tape`): a call that continues the latest context is appended in place, so a
  500-call session never copies or stores its growing prompt 500 times, and choosing a
  base is one vectorised comparison per candidate. A prompt that shares more with an
  older, uncached call is still stored correctly, only less compactly; `tidal.tree`
  rebuilds the exact prefix tree either way.
- Per session, the store also remembers its `sessions` row once it has read or written
  it (rows are never updated, so that knowledge cannot go stale). Duplicate call ids
  are refused by the table's UNIQUE constraint rather than looked up first.
- Many writers (threads or processes) may append at once: each append is one
  `BEGIN IMMEDIATE` transaction with a busy timeout. WAL with synchronous=NORMAL
  survives a killed process with every committed record intact.
- Readers open the file with `mode=ro`; where SQLite cannot create the WAL index beside
  it (a read-only directory or mount), with `immutable=1`, exact while no `-wal` file
  holds records (otherwise the error says what reading needs).
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tidal.ledger.types import (
    Call,
    IdArray,
    LedgerError,
    Outcome,
    PromptDelta,
    RequestDelta,
    SessionMeta,
    Status,
    StoredCall,
    call_to_dict,
    validate_call,
)

SCHEMA_VERSION = 1
_EMPTY_IDS: IdArray = np.zeros(0, np.int32)
_CANDIDATES = 4  # most recent calls of a session compared against a new prompt
_CACHED_SESSIONS = 512
_MIN_TAPE = 256  # tokens: smallest buffer a tape starts with

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    task_id TEXT,
    parent_session_id TEXT,
    parent_call_id TEXT,
    first_seq INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS calls (
    seq INTEGER PRIMARY KEY,
    session_id TEXT NOT NULL,
    call_id TEXT NOT NULL,
    role TEXT NOT NULL,
    base_call_id TEXT,
    prefix_len INTEGER NOT NULL,
    prompt_len INTEGER NOT NULL,
    output_len INTEGER NOT NULL,
    suffix_ids BLOB NOT NULL,
    output_ids BLOB NOT NULL,
    output_logprobs BLOB NOT NULL,
    header TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    chain_hash TEXT NOT NULL,
    UNIQUE (session_id, call_id)
);
CREATE TABLE IF NOT EXISTS outcomes (
    seq INTEGER PRIMARY KEY,
    session_id TEXT NOT NULL UNIQUE,
    body TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    chain_hash TEXT NOT NULL
);
-- what a run records of each session it starts (phase, step, task, sample, parent)
CREATE TABLE IF NOT EXISTS session_meta (
    session_id TEXT PRIMARY KEY,
    phase TEXT NOT NULL,
    step INTEGER NOT NULL,
    task_id TEXT NOT NULL,
    sample INTEGER NOT NULL,
    parent_session_id TEXT
);
CREATE TRIGGER IF NOT EXISTS session_meta_no_update BEFORE UPDATE ON session_meta
    BEGIN SELECT RAISE(ABORT, 'ledger is append-only: session metadata cannot be updated'); END;
-- a call's session by its id alone (subagent parents, a restarted gateway's lookups)
CREATE INDEX IF NOT EXISTS calls_by_call_id ON calls (call_id);
CREATE TRIGGER IF NOT EXISTS calls_no_update BEFORE UPDATE ON calls
    BEGIN SELECT RAISE(ABORT, 'ledger is append-only: calls cannot be updated'); END;
CREATE TRIGGER IF NOT EXISTS calls_no_delete BEFORE DELETE ON calls
    BEGIN SELECT RAISE(ABORT, 'ledger is append-only: calls cannot be deleted'); END;
CREATE TRIGGER IF NOT EXISTS outcomes_no_update BEFORE UPDATE ON outcomes
    BEGIN SELECT RAISE(ABORT, 'ledger is append-only: outcomes cannot be updated'); END;
CREATE TRIGGER IF NOT EXISTS outcomes_no_delete BEFORE DELETE ON outcomes
    BEGIN SELECT RAISE(ABORT, 'ledger is append-only: outcomes cannot be deleted'); END;
CREATE TRIGGER IF NOT EXISTS sessions_no_update BEFORE UPDATE ON sessions
    BEGIN SELECT RAISE(ABORT, 'ledger is append-only: sessions cannot be updated'); END;
"""

_GENESIS = "0" * 64
# What `mode=ro` reports when it cannot create the WAL index beside a store: a read-only
# directory (READONLY_DIRECTORY), a read-only mount (CANTOPEN).
_NO_WAL_INDEX = ("SQLITE_READONLY_DIRECTORY", "SQLITE_CANTOPEN")

_CANONICAL = json.JSONEncoder(sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def canonical_json(obj: Any) -> str:
    """Sorted keys, no ASCII escaping, no spaces: the bytes the content hashes cover (one
    shared encoder: `json.dumps` would build a new one per call)."""
    return _CANONICAL.encode(obj)


def _sha(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


def _chain(prev: str, content_hash: str) -> str:
    return hashlib.sha256((prev + content_hash).encode()).hexdigest()


_ARRAY_FIELDS = ("type", "prompt_ids", "output_ids", "output_logprobs", "messages", "tools")


def _call_header(call: Call, delta: PromptDelta, request: RequestDelta | None) -> str:
    """Every scalar field of the call (the JSONL contract's, minus the token arrays and
    the request) plus the prompt delta and the request's (`request`, only when the call
    has one), as canonical JSON: what the content hash covers with the blobs."""
    fields = {k: v for k, v in call_to_dict(call, as_lists=False).items()
              if k not in _ARRAY_FIELDS}
    return canonical_json({
        **fields,
        "base_call_id": delta.base_call_id,
        "prefix_len": delta.prefix_len,
        "prompt_len": delta.prompt_len,
        "output_len": int(call.output_ids.shape[0]),
        **({"request": request.to_dict()} if request is not None else {}),
    })


Request = tuple[list[dict[str, Any]], list[dict[str, Any]] | None]  # messages, tools


def _request_delta(call: Call, base_id: str | None, base: Request | None) -> RequestDelta:
    """`call`'s messages and tools as a delta against `base` (the request of `base_id`)."""
    assert call.messages is not None
    if base_id is None or base is None:
        return RequestDelta(None, 0, call.messages, False, call.tools)
    old, old_tools = base
    keep = 0
    for a, b in zip(old, call.messages, strict=False):
        if a is not b and a != b:
            break
        keep += 1
    same = old_tools == call.tools
    return RequestDelta(base_id, keep, call.messages[keep:], same, None if same else call.tools)


def _call_hash(header: str, suffix: bytes, output: bytes, logprobs: bytes) -> str:
    return _sha(header.encode(), suffix, output, logprobs)


# ------------------------------------------------------------------ prefix arithmetic


_IN_CHUNK = 500  # ids per `IN (...)` query (SQLite allows 999 parameters before 3.32)


class _Tape:
    """A growable token buffer shared by cached contexts: each context is a prefix
    `ids[:n]` of one tape. Only positions at or past `used` are ever written, so every
    context handed out stays valid; the buffer is replaced (not resized) when it fills."""

    __slots__ = ("ids", "used")

    def __init__(self, capacity: int) -> None:
        self.ids: IdArray = np.empty(max(capacity, _MIN_TAPE), np.int32)
        self.used = 0


Context = tuple[_Tape, int]  # (tape, length): the tokens tape.ids[:length]


def _extend(base: Context | None, keep: int, *parts: IdArray) -> Context:
    """The context `base[:keep] + parts`. Written in place after `base` when `base` ends
    its tape (`keep` is then its whole length) and the tape has room: the usual
    continuation of a conversation. Otherwise a new tape, with half as much again as
    room for later continuations, gets a copy of the kept prefix: a branch, a trimmed
    prefix or a full tape costs one copy, the same order of work as the comparison that
    chose the base. Memory: a linear session's cached contexts share one tape (up to 1.5x
    its context); each branch among them has its own."""
    n = keep + sum(int(p.shape[0]) for p in parts)
    tape = base[0] if base is not None else None
    if tape is None or tape.used != keep or tape.ids.shape[0] < n:
        new = _Tape(n + n // 2)
        if tape is not None:
            new.ids[:keep] = tape.ids[:keep]
        tape = new
    pos = keep
    for p in parts:
        tape.ids[pos : pos + p.shape[0]] = p
        pos += int(p.shape[0])
    tape.used = n
    return tape, n


def _view(tape: _Tape, start: int, stop: int) -> IdArray:
    """A read-only view of tape tokens (what `StoredCall` hands back: no copies)."""
    v = tape.ids[start:stop]
    v.flags.writeable = False
    return v


def common_prefix_len(a: IdArray, b: IdArray) -> int:
    """Length of the longest common prefix of two 1-D arrays."""
    m = min(a.shape[0], b.shape[0])
    if m == 0:
        return 0
    diff = a[:m] != b[:m]
    if not diff.any():
        return int(m)
    return int(np.argmax(diff))


# ------------------------------------------------------------------------- read side


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    task_id: str | None
    parent_session_id: str | None
    parent_call_id: str | None
    n_calls: int


class CallLog:
    """All calls of one session, prompts kept as deltas; materialises on demand.

    Memory is about the size of the stored arrays (suffixes, outputs, logprobs), not
    the sum of prompt lengths.
    """

    def __init__(self, session_id: str, calls: Sequence[StoredCall]) -> None:
        self.session_id = session_id
        self.calls: tuple[StoredCall, ...] = tuple(calls)
        self._by_id = {c.call_id: c for c in self.calls}
        self._requests: dict[str, Request | None] = {}

    def __len__(self) -> int:
        return len(self.calls)

    def __getitem__(self, call_id: str) -> StoredCall:
        return self._by_id[call_id]

    def __contains__(self, call_id: object) -> bool:
        return call_id in self._by_id

    def _chain(self, call_id: str) -> list[StoredCall]:
        chain = [self._by_id[call_id]]
        seen = {call_id}
        while (base := chain[-1].prompt.base_call_id) is not None:
            if base in seen or base not in self._by_id:
                raise LedgerError(
                    f"session {self.session_id!r}: call {chain[-1].call_id!r} has a broken "
                    f"prefix reference to {base!r}"
                )
            seen.add(base)
            chain.append(self._by_id[base])
        return chain

    def context_ids(self, call_id: str) -> IdArray:
        """The call's prompt followed by its output."""
        return self._build(call_id, with_output=True)

    def prompt_ids(self, call_id: str) -> IdArray:
        return self._build(call_id, with_output=False)

    def _build(self, call_id: str, *, with_output: bool) -> IdArray:
        chain = self._chain(call_id)
        cap = max(c.context_len for c in chain)  # >= final: the chain head is one of them
        buf = np.empty(cap, np.int32)
        n = 0
        for i, sc in enumerate(reversed(chain)):
            n = sc.prompt.prefix_len
            s = sc.prompt.suffix_ids
            buf[n : n + s.shape[0]] = s
            n += int(s.shape[0])
            if with_output or i < len(chain) - 1:
                o = sc.call.output_ids
                buf[n : n + o.shape[0]] = o
                n += int(o.shape[0])
        return buf[:n].copy() if n < cap // 2 else buf[:n]

    def request(self, call_id: str) -> Request | None:
        """The call's request messages and tools (None: it recorded none). Rebuilt from
        the deltas once per call and kept, so reading a session in order costs what its
        messages do."""
        if call_id in self._requests:
            return self._requests[call_id]
        first = self._by_id[call_id]
        if first.request is None:
            self._requests[call_id] = None
            return None
        pending = [first]
        seen = {call_id}
        while True:
            d = pending[-1].request
            assert d is not None
            b = d.base_call_id
            if b is None or b in self._requests:
                break
            sc = self._by_id.get(b)
            if b in seen or sc is None or sc.request is None:
                raise LedgerError(f"session {self.session_id!r}: call {pending[-1].call_id!r} "
                                  f"has a broken request reference to {b!r}")
            seen.add(b)
            pending.append(sc)
        base = None if b is None else self._requests[b]
        if b is not None and base is None:
            raise LedgerError(f"session {self.session_id!r}: call {pending[-1].call_id!r} "
                              f"has a request reference to {b!r}, which recorded none")
        for sc in reversed(pending):
            d = sc.request
            assert d is not None
            if base is None or d.base_call_id is None:
                got: Request = (list(d.new), d.tools)
            else:
                got = (base[0][:d.keep] + d.new, base[1] if d.tools_from_base else d.tools)
            self._requests[sc.call_id] = base = got
        return base

    def full_call(self, call_id: str) -> Call:
        """The call with its full prompt and request, as it was appended."""
        sc = self._by_id[call_id]
        req = self.request(call_id)
        return replace(sc.call, prompt_ids=self.prompt_ids(call_id),
                       messages=None if req is None else req[0],
                       tools=None if req is None else req[1])


# ------------------------------------------------------------------------------ store


class _SessionState:
    """What a store remembers of one session between appends (under its lock): the
    contexts of its latest calls, and its `sessions` row (task_id, parent_session_id)
    once known. Dropped whole when a transaction that touched the session rolls back."""

    __slots__ = ("contexts", "requests", "row")

    def __init__(self) -> None:
        self.contexts: OrderedDict[str, Context] = OrderedDict()
        self.requests: OrderedDict[str, Request | None] = OrderedDict()
        self.row: tuple[str | None, str | None] | None = None


class LedgerStore:
    """An append-only ledger in one SQLite file. Safe to share between threads.

    Open one per process; several processes may open the same file at once.
    """

    def __init__(self, path: str | Path, *, readonly: bool = False) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise LedgerError(
                f"{self.path} is a directory, not a ledger store (a store is one SQLite file, "
                f"e.g. {self.path / 'ledger.db'})"
            )
        self._db = self._open_readonly() if readonly else self._open_writable()
        self._lock = threading.RLock()
        self._sessions: OrderedDict[str, _SessionState] = OrderedDict()
        self.rows_read = 0  # call and outcome rows read back so far (`tidal run`'s step rows)

    def _connect(self, query: str) -> sqlite3.Connection:
        uri = f"{self.path.absolute().as_uri()}?{query}"
        db = sqlite3.connect(
            uri, uri=True, timeout=60.0, isolation_level=None, check_same_thread=False
        )
        db.execute("PRAGMA busy_timeout = 60000")
        return db

    def _open_readonly(self) -> sqlite3.Connection:
        """`mode=ro`; where SQLite cannot create the WAL index (`-shm`) beside the store (a
        read-only directory or mount), `immutable=1`, which is exact only while no `-wal`
        file holds records: then the message says what reading needs."""
        if not self.path.exists():
            raise LedgerError(f"no ledger store at {self.path}")
        try:
            return self._checked(self._connect("mode=ro"))
        except sqlite3.DatabaseError as e:
            if getattr(e, "sqlite_errorname", "") not in _NO_WAL_INDEX:
                raise self._unreadable(e) from e
        wal = Path(f"{self.path}-wal")
        if wal.exists() and wal.stat().st_size > 0:
            raise LedgerError(
                f"cannot read {self.path}: its write-ahead log {wal.name} holds records, and "
                f"reading them needs {self.path.name}-shm, which cannot be created in "
                f"{self.path.parent.absolute()}; give write access to that directory, or copy "
                f"{self.path.name} with {wal.name} to a writable one"
            )
        try:
            return self._checked(self._connect("mode=ro&immutable=1"))
        except sqlite3.DatabaseError as e:
            raise self._unreadable(e) from e

    def _open_writable(self) -> sqlite3.Connection:
        parent = self.path.parent
        new = not self.path.exists()
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            blocker = next((p for p in (parent, *parent.parents) if p.exists()), parent)
            why = f"{blocker} is a file" if not blocker.is_dir() else e.strerror
            raise LedgerError(
                f"cannot create store {self.path}: cannot create its directory {parent} "
                f"({why})"
            ) from e
        if new and not os.access(parent, os.W_OK):
            raise LedgerError(
                f"cannot create store {self.path}: directory {parent.absolute()} is not writable"
            )
        db: sqlite3.Connection | None = None
        try:
            db = self._connect("mode=rwc")
            if not new and db.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchone():
                self._checked(db)  # a foreign or newer database is refused untouched
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = NORMAL")
            db.executescript(_SCHEMA)
            db.execute(
                "INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', ?)",
                (str(SCHEMA_VERSION),),
            )
            return self._checked(db)
        except BaseException as e:
            if db is not None:
                db.close()
            if not isinstance(e, sqlite3.DatabaseError):
                raise
            readonly = getattr(e, "sqlite_errorname", "").startswith("SQLITE_READONLY")
            if readonly or not (os.access(self.path, os.W_OK) and os.access(parent, os.W_OK)):
                raise LedgerError(
                    f"cannot write to {self.path}: {e}; appending needs write access to the "
                    f"file and to its directory {parent.absolute()} (SQLite keeps "
                    f"{self.path.name}-wal and -shm there)"
                ) from e
            raise self._unreadable(e) from e

    def _unreadable(self, e: sqlite3.DatabaseError) -> LedgerError:
        return LedgerError(f"{self.path} is not a readable tidal ledger store: {e}")

    def _checked(self, db: sqlite3.Connection) -> sqlite3.Connection:
        """`db` once it holds the schema version this code reads (closed otherwise)."""
        try:
            row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except BaseException:
            db.close()
            raise
        if row is None or row[0] != str(SCHEMA_VERSION):
            db.close()
            raise LedgerError(
                f"{self.path}: unsupported ledger schema version {row[0] if row else None}"
            )
        return db

    # ---------------------------------------------------------------- housekeeping
    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> LedgerStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------- writes
    def append_call(self, call: Call, *, base_hint: str | None = None) -> StoredCall:
        """Validate and commit one call. `base_hint` names a call whose context the prompt
        probably extends (the gateway knows it); it is checked, never trusted."""
        return self.append_calls([call], base_hints=[base_hint])[0]

    def append_calls(
        self, calls: Sequence[Call], *, base_hints: Sequence[str | None] | None = None
    ) -> list[StoredCall]:
        """Commit several calls in one transaction: all of them or none."""
        calls = [validate_call(c) for c in calls]
        hints = list(base_hints) if base_hints is not None else [None] * len(calls)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                out = [self._insert_call(c, h) for c, h in zip(calls, hints, strict=True)]
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                self._forget([c.session_id for c in calls])
                raise
        return out

    def append_outcome(self, outcome: Outcome) -> None:
        """Commit a session's outcome. A session has at most one."""
        self.append_outcomes([outcome])

    def append_outcomes(self, outcomes: Sequence[Outcome]) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for o in outcomes:
                    self._insert_outcome(o)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def append_records(self, calls: Sequence[Call], outcomes: Sequence[Outcome]) -> None:
        """Commit calls then outcomes in one transaction (the JSONL importer's path)."""
        calls = [validate_call(c) for c in calls]
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for c in calls:
                    self._insert_call(c, None)
                for o in outcomes:
                    self._insert_outcome(o)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                self._forget([c.session_id for c in calls])
                raise

    def _forget(self, session_ids: Iterable[str]) -> None:
        """Drop what a rolled-back transaction may have taught the caches."""
        for s in set(session_ids):
            self._sessions.pop(s, None)

    def _session_state(self, session_id: str) -> _SessionState:
        state = self._sessions.get(session_id)
        if state is None:
            state = _SessionState()
            # Another process may have written this session: seed with its latest call.
            row = self._db.execute(
                "SELECT call_id FROM calls WHERE session_id=? ORDER BY seq DESC LIMIT 1",
                (session_id,),
            ).fetchone()
            if row is not None:
                log = self.call_log(session_id)
                state.contexts[row[0]] = _extend(None, 0, log.context_ids(row[0]))
            self._sessions[session_id] = state
            while len(self._sessions) > _CACHED_SESSIONS:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(session_id)
        return state

    def _context(self, state: _SessionState, session_id: str, call_id: str) -> Context | None:
        if call_id in state.contexts:
            return state.contexts[call_id]
        row = self._db.execute(
            "SELECT 1 FROM calls WHERE session_id=? AND call_id=?", (session_id, call_id)
        ).fetchone()
        if row is None:
            return None
        return _extend(None, 0, self.call_log(session_id).context_ids(call_id))

    # long by design: one SQLite transaction: the checks, prefix search and inserts stay inside it
    def _insert_call(self, call: Call, hint: str | None) -> StoredCall:  # noqa: PLR0915
        db = self._db
        where = f"call {call.call_id!r} of session {call.session_id!r}"
        self._check_parent(call, where)
        state = self._session_state(call.session_id)
        sess = state.row
        if sess is None:
            sess = state.row = db.execute(
                "SELECT task_id, parent_session_id FROM sessions WHERE session_id=?",
                (call.session_id,),
            ).fetchone()
        if sess is not None:
            if call.task_id is not None and sess[0] is not None and call.task_id != sess[0]:
                raise LedgerError(
                    f"{where}: task_id {call.task_id!r} differs from the session's {sess[0]!r}"
                )
            if (
                call.parent_session_id is not None
                and sess[1] is not None
                and call.parent_session_id != sess[1]
            ):
                raise LedgerError(
                    f"{where}: parent_session_id {call.parent_session_id!r} differs from the "
                    f"session's {sess[1]!r}"
                )

        # Choose the base: the hint, then the session's most recent calls.
        cache = state.contexts
        candidates: list[tuple[str, Context]] = []
        if hint is not None:
            ctx = self._context(state, call.session_id, hint)
            if ctx is not None:
                candidates.append((hint, ctx))
        for cid in reversed(list(cache.keys())[-_CANDIDATES:]):
            if cid != hint:
                candidates.append((cid, cache[cid]))
        prompt = call.prompt_ids
        best_id: str | None = None
        best_len = 0
        best_ctx: Context | None = None
        for cid, (tape, length) in candidates:
            if length <= best_len:
                continue  # cannot beat the best match so far
            n = common_prefix_len(prompt, tape.ids[:length])
            if n > best_len:
                best_id, best_len, best_ctx = cid, n, (tape, length)
        plen, olen = int(prompt.shape[0]), int(call.output_ids.shape[0])
        tape, end = _extend(best_ctx, best_len, prompt[best_len:], call.output_ids)
        suffix, output = _view(tape, best_len, plen), _view(tape, plen, end)
        delta = PromptDelta(best_id, best_len, suffix)
        request = None
        if call.messages is not None:
            base_req = (self._request_of(state, call.session_id, best_id)
                        if best_id is not None else None)
            request = _request_delta(call, best_id, base_req)

        header = _call_header(call, delta, request)
        sb, ob, lb = suffix.tobytes(), output.tobytes(), call.output_logprobs.tobytes()
        content = _call_hash(header, sb, ob, lb)
        prev = db.execute("SELECT chain_hash FROM calls ORDER BY seq DESC LIMIT 1").fetchone()
        chain = _chain(prev[0] if prev else _GENESIS, content)
        try:
            cur = db.execute(
                "INSERT INTO calls (session_id, call_id, role, base_call_id, prefix_len,"
                " prompt_len, output_len, suffix_ids, output_ids, output_logprobs, header,"
                " content_hash, chain_hash) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    call.session_id, call.call_id, call.role, best_id, best_len, plen, olen,
                    sb, ob, lb, header, content, chain,
                ),
            )
        except sqlite3.IntegrityError as e:
            if "UNIQUE" not in str(e):  # only UNIQUE (session_id, call_id) means a duplicate
                raise
            raise LedgerError(
                f"{where}: already in the ledger (call ids are unique per session)"
            ) from e
        seq = int(cur.lastrowid or 0)
        if sess is None:
            db.execute(
                "INSERT INTO sessions (session_id, task_id, parent_session_id, parent_call_id,"
                " first_seq) VALUES (?,?,?,?,?)",
                (call.session_id, call.task_id, call.parent_session_id, call.parent_call_id, seq),
            )
            state.row = (call.task_id, call.parent_session_id)
        cache[call.call_id] = (tape, end)
        while len(cache) > 2 * _CANDIDATES:
            cache.popitem(last=False)
        state.requests[call.call_id] = (None if call.messages is None
                                        else (call.messages, call.tools))
        while len(state.requests) > 2 * _CANDIDATES:
            state.requests.popitem(last=False)
        stored_call = replace(call, prompt_ids=_EMPTY_IDS, output_ids=output, messages=None,
                              tools=None)
        return StoredCall(seq=seq, call=stored_call, prompt=delta, content_hash=content,
                          request=request)

    def _request_of(self, state: _SessionState, session_id: str, call_id: str,
                    ) -> Request | None:
        """The request of an earlier call of the session: remembered, else rebuilt from
        the store (once after a restart; then remembered)."""
        if call_id in state.requests:
            return state.requests[call_id]
        rows = self._db.execute(
            f"SELECT {self._CALL_COLS} FROM calls WHERE session_id=? ORDER BY seq",
            (session_id,)).fetchall()
        log = CallLog(session_id, [self._row_to_stored(r) for r in rows])
        got = log.request(call_id) if call_id in log else None
        state.requests[call_id] = got
        return got

    def _check_parent(self, call: Call, where: str) -> None:
        if call.parent_call_id is not None:
            psid = call.parent_session_id or call.session_id
            if not self._db.execute(
                "SELECT 1 FROM calls WHERE session_id=? AND call_id=?",
                (psid, call.parent_call_id),
            ).fetchone():
                raise LedgerError(
                    f"{where}: parent call {call.parent_call_id!r} of session {psid!r} is not "
                    "in the ledger (dangling parent); write the parent first"
                )
        elif call.parent_session_id is not None and not self._db.execute(
            "SELECT 1 FROM sessions WHERE session_id=?", (call.parent_session_id,)
        ).fetchone():
            raise LedgerError(
                f"{where}: parent session {call.parent_session_id!r} is not in the ledger "
                "(dangling parent)"
            )

    def _insert_outcome(self, o: Outcome) -> None:
        where = f"outcome of session {o.session_id!r}"
        if self._db.execute(
            "SELECT 1 FROM outcomes WHERE session_id=?", (o.session_id,)
        ).fetchone():
            raise LedgerError(f"{where}: the session already has an outcome (append-only)")
        recorded = o.recorded_at or time.time()
        body = canonical_json(
            {
                "session_id": o.session_id,
                "status": o.status.value,
                "reward": o.reward,
                "partial_score": o.partial_score,
                "details": o.details,
                "recorded_at": recorded,
            }
        )
        content = _sha(body.encode())
        prev = self._db.execute(
            "SELECT chain_hash FROM outcomes ORDER BY seq DESC LIMIT 1"
        ).fetchone()
        self._db.execute(
            "INSERT INTO outcomes (session_id, body, content_hash, chain_hash) VALUES (?,?,?,?)",
            (o.session_id, body, content, _chain(prev[0] if prev else _GENESIS, content)),
        )

    # ----------------------------------------------------------------------- reads
    _CALL_COLS = (
        "seq, session_id, call_id, base_call_id, prefix_len, prompt_len, output_len,"
        " suffix_ids, output_ids, output_logprobs, header, content_hash"
    )

    @staticmethod
    def _row_to_stored(row: Sequence[Any]) -> StoredCall:
        (seq, _sid, _cid, base, prefix_len, _plen, _olen, sb, ob, lb, header, content) = row
        h = json.loads(header)
        suffix = np.frombuffer(sb, dtype=np.int32)
        call = Call(
            session_id=h["session_id"],
            call_id=h["call_id"],
            role=h["role"],
            prompt_ids=_EMPTY_IDS,
            output_ids=np.frombuffer(ob, dtype=np.int32),
            output_logprobs=np.frombuffer(lb, dtype=np.float32),
            output_text=h["output_text"],
            policy_version=h["policy_version"],
            finish_reason=h["finish_reason"],
            started_at=h["started_at"],
            ended_at=h["ended_at"],
            raw_tool_calls=h["raw_tool_calls"],
            tool_calls=h["tool_calls"],
            parent_call_id=h["parent_call_id"],
            parent_session_id=h["parent_session_id"],
            task_id=h["task_id"],
            sampling=h["sampling"],
            metadata=h["metadata"],
        )
        req = h.get("request")
        return StoredCall(
            seq=int(seq), call=call, prompt=PromptDelta(base, int(prefix_len), suffix),
            content_hash=content, request=None if req is None else RequestDelta.from_dict(req),
        )

    def session_ids(self) -> list[str]:
        with self._lock:
            rows = self._db.execute("SELECT session_id FROM sessions ORDER BY first_seq").fetchall()
        return [r[0] for r in rows]

    def has_session(self, session_id: str) -> bool:
        with self._lock:
            return self._db.execute(
                "SELECT 1 FROM sessions WHERE session_id=?", (session_id,)
            ).fetchone() is not None

    def session_info(self, session_id: str) -> SessionInfo | None:
        """The session's row (task, parent, calls), or None when it has no call."""
        with self._lock:
            row = self._db.execute(
                "SELECT s.session_id, s.task_id, s.parent_session_id, s.parent_call_id,"
                " (SELECT COUNT(*) FROM calls c WHERE c.session_id = s.session_id)"
                " FROM sessions s WHERE s.session_id=?", (session_id,)
            ).fetchone()
        return None if row is None else SessionInfo(*row)

    def session_of_call(self, call_id: str) -> str | None:
        """The session that holds call `call_id` (the first, should two sessions reuse an
        id), or None."""
        with self._lock:
            row = self._db.execute(
                "SELECT session_id FROM calls WHERE call_id=? ORDER BY seq LIMIT 1", (call_id,)
            ).fetchone()
        return None if row is None else str(row[0])

    def child_sessions(self, session_id: str) -> list[str]:
        """Sessions whose calls name `session_id` as their parent session (subagents),
        in commit order."""
        with self._lock:
            rows = self._db.execute(
                "SELECT session_id FROM sessions WHERE parent_session_id=? ORDER BY first_seq",
                (session_id,),
            ).fetchall()
        return [r[0] for r in rows]

    def episode_sessions(self, session_id: str) -> list[str]:
        """`session_id` and every session linked below it (subagents, theirs, ...),
        breadth first: the recorded sessions of one episode."""
        return list(self.episode_tree(session_id))

    def episode_tree(self, session_id: str) -> dict[str, str | None]:
        """`episode_sessions`, each with its parent session (None for `session_id`)."""
        out: dict[str, str | None] = {session_id: None}
        order, i = [session_id], 0
        while i < len(order):
            for c in self.child_sessions(order[i]):
                if c not in out:
                    out[c] = order[i]
                    order.append(c)
            i += 1
        return out

    def sessions(self) -> list[SessionInfo]:
        with self._lock:
            rows = self._db.execute(
                "SELECT s.session_id, s.task_id, s.parent_session_id, s.parent_call_id,"
                " (SELECT COUNT(*) FROM calls c WHERE c.session_id = s.session_id)"
                " FROM sessions s ORDER BY s.first_seq"
            ).fetchall()
        return [SessionInfo(*r) for r in rows]

    def call_log(self, session_id: str) -> CallLog:
        """Every call of the session in commit order."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {self._CALL_COLS} FROM calls WHERE session_id=? ORDER BY seq",
                (session_id,),
            ).fetchall()
            self.rows_read += len(rows)
        return CallLog(session_id, [self._row_to_stored(r) for r in rows])

    def iter_calls(self) -> Iterator[StoredCall]:
        """Every call in commit order, prompts as deltas."""
        with self._lock:
            cur = self._db.execute(f"SELECT {self._CALL_COLS} FROM calls ORDER BY seq")
            rows = cur.fetchall()
        for r in rows:
            yield self._row_to_stored(r)

    def iter_full_calls(self) -> Iterator[Call]:
        """Every call in commit order with its full prompt (for export and audits)."""
        for sid in self.session_ids():
            log = self.call_log(sid)
            for sc in log.calls:
                yield log.full_call(sc.call_id)

    def record_meta(self, metas: Mapping[str, SessionMeta]) -> None:
        """Record sessions' metadata (`SessionMeta`) by session id; a session that has
        some keeps it (recording it again, a resumed run's, changes nothing)."""
        rows = [(sid, m.phase, m.step, m.task_id, m.sample, m.parent)
                for sid, m in metas.items()]
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany(
                    "INSERT OR IGNORE INTO session_meta VALUES (?, ?, ?, ?, ?, ?)", rows)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def session_meta(self, session_ids: Iterable[str] | None = None) -> dict[str, SessionMeta]:
        """Sessions' metadata by id: every session's, or only these (those recorded)."""
        query = "SELECT session_id, phase, step, task_id, sample, parent_session_id " \
                "FROM session_meta"
        try:
            with self._lock:
                if session_ids is None:
                    rows = self._db.execute(query).fetchall()
                else:
                    ids, rows = list(dict.fromkeys(session_ids)), []
                    for i in range(0, len(ids), _IN_CHUNK):
                        chunk = ids[i:i + _IN_CHUNK]
                        rows += self._db.execute(
                            f"{query} WHERE session_id IN ({','.join('?' * len(chunk))})",
                            chunk).fetchall()
        except sqlite3.OperationalError as e:  # a ledger written before the table existed
            if "no such table" not in str(e):
                raise
            return {}
        return {r[0]: SessionMeta(r[1], int(r[2]), r[3], int(r[4]), r[5]) for r in rows}

    def outcome(self, session_id: str) -> Outcome | None:
        with self._lock:
            row = self._db.execute(
                "SELECT body FROM outcomes WHERE session_id=?", (session_id,)
            ).fetchone()
            self.rows_read += row is not None
        return _outcome_from_body(row[0]) if row else None

    def outcomes(self, session_ids: Iterable[str] | None = None) -> dict[str, Outcome]:
        """Every outcome by session, in commit order; with `session_ids`, only theirs (a
        read that costs what those sessions hold, not what the ledger does)."""
        if session_ids is None:
            with self._lock:
                rows = self._db.execute("SELECT body FROM outcomes ORDER BY seq").fetchall()
        else:
            ids, rows = list(dict.fromkeys(session_ids)), []
            with self._lock:
                for i in range(0, len(ids), _IN_CHUNK):
                    chunk = ids[i:i + _IN_CHUNK]
                    rows += self._db.execute(
                        "SELECT seq, body FROM outcomes WHERE session_id IN "
                        f"({','.join('?' * len(chunk))})", chunk).fetchall()
            rows = [(body,) for _seq, body in sorted(rows)]
        self.rows_read += len(rows)
        out = [_outcome_from_body(r[0]) for r in rows]
        return {o.session_id: o for o in out}

    def orphan_outcomes(self) -> list[tuple[int, str, str]]:
        """`(seq, session_id, status)` of each outcome whose session has no calls, in
        commit order. A run records one (`infra_error`) when an episode's sandbox fails
        before its first call; readers of sessions skip them."""
        with self._lock:
            rows = self._db.execute(
                "SELECT o.seq, o.session_id, o.body FROM outcomes o WHERE NOT EXISTS"
                " (SELECT 1 FROM calls c WHERE c.session_id = o.session_id) ORDER BY o.seq"
            ).fetchall()
        out = []
        for seq, sid, body in rows:
            try:
                status = str(json.loads(body).get("status"))
            except (ValueError, AttributeError):
                status = "?"  # an unreadable body: `check` names it
            out.append((int(seq), str(sid), status))
        return out

    def count_calls(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM calls").fetchone()[0])

    # ------------------------------------------------------------------ integrity
    # long by design: one pass over the store's tables under one lock
    def check(self) -> list[str]:  # noqa: PLR0915
        """Re-verify every hash, chain link and prefix reference. Returns the problems
        found (empty when the store is sound), each naming its record."""
        problems: list[str] = []
        with self._lock:
            ic = self._db.execute("PRAGMA quick_check").fetchall()
            if [r[0] for r in ic] != ["ok"]:
                problems.extend(f"sqlite: {r[0]}" for r in ic)
            rows = self._db.execute(f"SELECT {self._CALL_COLS}, chain_hash, role FROM calls"
                                    " ORDER BY seq").fetchall()
            orows = self._db.execute(
                "SELECT seq, session_id, body, content_hash, chain_hash FROM outcomes ORDER BY seq"
            ).fetchall()
        prev = _GENESIS
        ctx_len: dict[tuple[str, str], int] = {}
        n_messages: dict[tuple[str, str], int] = {}  # of calls with a request
        for r in rows:
            seq, sid, cid, base, prefix_len, plen, olen, sb, ob, lb, header, content = r[:12]
            chain, role = r[12], r[13]
            name = f"call {cid!r} of session {sid!r} (seq {seq})"
            try:
                h = json.loads(header)
            except json.JSONDecodeError:
                problems.append(f"{name}: header is not valid JSON")
                h = {}
            if _call_hash(header, sb, ob, lb) != content:
                problems.append(f"{name}: content hash mismatch (record altered)")
            if _chain(prev, content) != chain:
                problems.append(f"{name}: chain hash mismatch (a record before it was altered, "
                                "removed or reordered)")
            prev = chain
            if h and (
                h.get("session_id") != sid or h.get("call_id") != cid or h.get("role") != role
                or h.get("base_call_id") != base or h.get("prefix_len") != prefix_len
                or h.get("prompt_len") != plen or h.get("output_len") != olen
            ):
                problems.append(f"{name}: indexed columns disagree with the hashed header")
            if len(sb) % 4 or len(ob) % 4 or len(lb) != len(ob):
                problems.append(f"{name}: token blobs have inconsistent sizes")
            elif prefix_len + len(sb) // 4 != plen or len(ob) // 4 != olen:
                problems.append(f"{name}: prompt/output lengths disagree with stored tokens")
            if base is not None:
                blen = ctx_len.get((sid, base))
                if blen is None:
                    problems.append(f"{name}: prefix reference to {base!r}, which is not an "
                                    "earlier call of the session")
                elif prefix_len > blen:
                    problems.append(f"{name}: prefix length {prefix_len} exceeds the context "
                                    f"length {blen} of base call {base!r}")
            elif prefix_len != 0:
                problems.append(f"{name}: prefix length {prefix_len} without a base call")
            pcid = h.get("parent_call_id")
            if pcid is not None and (h.get("parent_session_id") or sid, pcid) not in ctx_len:
                problems.append(f"{name}: parent call {pcid!r} is not an earlier call")
            problems += _request_problems(name, h.get("request"), sid, n_messages)
            ctx_len[(sid, cid)] = plen + olen
            req = h.get("request")
            if isinstance(req, dict) and isinstance(req.get("keep"), int):
                n_messages[(sid, cid)] = req["keep"] + len(req.get("new") or ())
        oprev = _GENESIS
        for seq, sid, body, content, chain in orows:
            name = f"outcome of session {sid!r} (seq {seq})"
            if _sha(body.encode()) != content:
                problems.append(f"{name}: content hash mismatch (record altered)")
            if _chain(oprev, content) != chain:
                problems.append(f"{name}: chain hash mismatch")
            oprev = chain
            try:
                _outcome_from_body(body)
            except (LedgerError, ValueError, KeyError) as e:
                problems.append(f"{name}: invalid body: {e}")
        return problems

    # ------------------------------------------------------------------- stats
    def stats(self) -> dict[str, int]:
        """Sizes of the store. `unique_tokens` counts stored tokens (prompt suffixes plus
        outputs); `prompt_tokens_total` is what storing full prompts would have cost."""
        with self._lock:
            sessions, calls, suffix, prompt, output = self._db.execute(
                "SELECT (SELECT COUNT(*) FROM sessions), COUNT(*),"
                " COALESCE(SUM(prompt_len - prefix_len), 0), COALESCE(SUM(prompt_len), 0),"
                " COALESCE(SUM(output_len), 0) FROM calls"
            ).fetchone()
            outcomes = self._db.execute("SELECT COUNT(*) FROM outcomes").fetchone()[0]
        size = sum(
            p.stat().st_size
            for p in (self.path, Path(f"{self.path}-wal"))
            if p.exists()
        )
        return {
            "sessions": int(sessions),
            "calls": int(calls),
            "outcomes": int(outcomes),
            "unique_tokens": int(suffix + output),
            "prompt_tokens_total": int(prompt),
            "output_tokens": int(output),
            "bytes": int(size),
        }


def _request_problems(name: str, req: Any, sid: str,
                      n_messages: Mapping[tuple[str, str], int]) -> list[str]:
    """What is wrong with a call's stored request delta (`check`)."""
    if req is None:
        return []
    if (not isinstance(req, dict) or not isinstance(req.get("new"), list)
            or not isinstance(req.get("keep"), int) or req.get("keep", -1) < 0):
        return [f"{name}: its request delta is malformed"]
    base = req.get("base")
    if base is None:
        return [f"{name}: keeps {req['keep']} messages without a base call"] if req["keep"] else []
    n = n_messages.get((sid, base))
    if n is None:
        return [f"{name}: request reference to {base!r}, which is not an earlier call of the "
                "session with a request"]
    if req["keep"] > n:
        return [f"{name}: keeps {req['keep']} messages of {base!r}, which has {n}"]
    return []


def _outcome_from_body(body: str) -> Outcome:
    d = json.loads(body)
    return Outcome(
        session_id=d["session_id"],
        status=Status(d["status"]),
        reward=float(d["reward"]),
        partial_score=float(d["partial_score"]),
        details=d["details"],
        recorded_at=float(d["recorded_at"]),
    )
