"""Who may call into which session: API keys scoped to episodes.

The harness inside a sandbox is untrusted, and the gateway is reachable from it. Without
keys, a harness could post calls into any session id (another task's, a sibling
sample's) and the gateway would record them. `SessionKeys` closes that:

- `open(root_session_id)` mints a secret for one episode (`tidal run` gives it to the
  harness as its API key: `OPENAI_API_KEY` and `ANTHROPIC_API_KEY` alike). With it, calls
  are accepted for the episode's root session and for subagent sessions opened under a
  session the key already owns (the subagent URL names its parent session). `close(key)`
  ends the episode: later calls with the key are refused, so nothing a harness left
  running after its episode can add to the ledger.
- `add(key)` registers a standing key (`tidal serve --api-key`): the operator's, which
  reaches every session (a gateway that requires a key without scoping sessions).
- Anything else is refused with 403 and a reason, before anything is generated or
  recorded: a missing or unknown key, a closed episode's key, a session owned by another
  key, a new root session under an episode key, a session chosen by the gateway (no id
  in the URL or headers).

`OPEN` (the default of a `Gateway`) checks nothing: `tidal serve` for a user's own harness
works without keys unless asked to require them. The key arrives as `Authorization:
Bearer KEY` (the openai SDK) or `x-api-key: KEY` (the anthropic SDK).
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from typing import Protocol

from tidal.gateway.messages import RequestError, shown
from tidal.ledger.store import SessionInfo

Recorded = Callable[[str], SessionInfo | None]


class Access(Protocol):
    """The gateway's check of a call's key against the session it names (None: one the
    gateway would choose) and that session's parent, before the call runs; raises a 403
    `RequestError`. `recorded` looks a session up in the ledger (read only when the
    in-memory owners do not decide)."""

    def check(self, key: str | None, session_id: str | None, parent_session_id: str | None,
              recorded: Recorded) -> None: ...


class _Open:
    def check(self, key: str | None, session_id: str | None, parent_session_id: str | None,
              recorded: Recorded) -> None:
        return None


OPEN: Access = _Open()


def denied(reason: str) -> RequestError:
    return RequestError(reason, type_="permission_error", code="forbidden", status=403)


class SessionKeys:
    """Episode keys and standing keys, and the sessions each owns (module docstring).
    Thread-safe: the gateway checks from its request threads while the rollout opens and
    closes episodes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._episodes: dict[str, str] = {}  # open episode key -> its root session
        self._standing: set[str] = set()
        self._owner: dict[str, str] = {}  # session id -> the key that owns it
        self._closed: set[str] = set()

    def open(self, root_session_id: str) -> str:
        """A fresh secret for the episode whose main session is `root_session_id`."""
        key = "tidal-ep-" + secrets.token_urlsafe(24)
        with self._lock:
            owner = self._owner.get(root_session_id)
            if owner is not None and owner not in self._closed:
                raise ValueError(f"session {root_session_id!r} already belongs to an open episode")
            self._episodes[key] = root_session_id
            self._owner[root_session_id] = key
        return key

    def close(self, key: str) -> None:
        """End an episode: its key is refused from now on (its sessions stay its own)."""
        with self._lock:
            if self._episodes.pop(key, None) is not None:
                self._closed.add(key)

    def add(self, key: str) -> None:
        """A standing key, which reaches every session."""
        if not key:
            raise ValueError("an API key must be non-empty")
        with self._lock:
            self._standing.add(key)

    def check(self, key: str | None, session_id: str | None, parent_session_id: str | None,
              recorded: Recorded) -> None:
        if not key:
            raise denied("this gateway requires an API key (Authorization: Bearer KEY or "
                         "x-api-key: KEY); none was sent")
        with self._lock:
            if key in self._closed:
                raise denied("this API key's episode has ended: no more calls are accepted")
            if key in self._standing:
                return
            if key not in self._episodes:
                raise denied("unknown API key")
            if session_id is None:
                raise denied("name the session in the URL (/sessions/{id}/v1) or the "
                             "X-Tidal-Session header: a key reaches only its own sessions")
            owner = self._owner.get(session_id)
            if owner == key:
                return
            if owner is not None:
                raise denied(f"session {shown(session_id)} belongs to another API key")
            info = recorded(session_id)  # a session of the ledger keeps its recorded parent
            parent = parent_session_id if info is None else info.parent_session_id
            if parent is not None:
                if self._owner.get(parent) != key:
                    raise denied(f"session {shown(session_id)} is under session {shown(parent)}, "
                                 "which this API key does not own")
            else:
                raise denied(f"session {shown(session_id)} is not this API key's: an episode's "
                             "key reaches its own session and the subagent sessions under it")
            self._owner[session_id] = key
