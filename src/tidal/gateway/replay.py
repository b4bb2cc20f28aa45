"""Replay: a resumed session's recorded calls answered from the ledger, not sampled again.

A preempted session (killed, migrated) resumes by running its harness again from the
start. Its model calls up to the preemption are already in the ledger: sampling them again
would record each twice and train on answers the first run never saw. In replay mode the
gateway answers a call of a replayed session whose prompt token ids equal, exactly, those
of a recorded call of that session with the recorded output (ids, logprobs, text, tool
calls and their ids, call id, policy version) and records nothing. The first call that
matches no recorded prompt (the harness saw something new: a command whose output
changed, or it is past the last recorded call) is sampled and recorded as usual.

    replay = Replay(store.call_log(session_id))
    hit = replay.take(prompt_ids)      # the recorded call, or None: go live
    replay.left                        # recorded calls never asked for again

Keyed by session and exact prompt ids: a prompt that differs by one token is a new call.
Identical prompts recorded twice in one session are served in the order recorded. Recorded
calls never asked for again (`left`, after the session ended) are those of a branch the
resumed session did not take: the caller says so in the session's outcome
(`details.abandoned_calls`) and the tree processor leaves them out.

Pure bookkeeping over a `CallLog`: no HTTP, no engine.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tidal.ledger.store import CallLog
from tidal.ledger.types import Call


@dataclass(frozen=True)
class ReplayStatus:
    """How far a replayed session got: recorded calls served from the ledger, and those
    never asked for again (in record order)."""

    session_id: str
    served: int
    left: tuple[str, ...]


class Replay:
    """The recorded calls of one session, waiting to be asked for again."""

    def __init__(self, log: CallLog) -> None:
        self.session_id = log.session_id
        self._log = log
        self._lock = threading.Lock()
        self._by_len: dict[int, deque[str]] = {}  # prompt length -> call ids, record order
        for sc in log.calls:
            self._by_len.setdefault(sc.prompt.prompt_len, deque()).append(sc.call_id)
        self._served: list[str] = []

    def take(self, prompt_ids: npt.NDArray[np.integer]) -> Call | None:
        """The first recorded call not yet served whose prompt is exactly `prompt_ids`
        (with its prompt materialised), marked served; None when there is none."""
        n = int(prompt_ids.shape[0])
        with self._lock:
            waiting = self._by_len.get(n)
            if not waiting:
                return None
            for call_id in waiting:
                if np.array_equal(self._log.prompt_ids(call_id), prompt_ids):
                    waiting.remove(call_id)
                    self._served.append(call_id)
                    return self._log.full_call(call_id)
        return None

    @property
    def pending(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._by_len.values())

    def status(self) -> ReplayStatus:
        with self._lock:
            left = {c for q in self._by_len.values() for c in q}
            return ReplayStatus(self.session_id, len(self._served),
                                tuple(sc.call_id for sc in self._log.calls if sc.call_id in left))
