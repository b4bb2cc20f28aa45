"""The command log behind exactly-once replay, for any runtime that takes snapshots.

A runtime appends every operation it runs (its kind, its arguments hashed into a key,
a readable summary and its result) to an `OpLog`. A snapshot keeps the log beside the
files; a runtime restored from it starts with the log in replay mode: as the harness
asks for the logged operations again (in any order among identical ones), `replayed`
hands back each logged result once, so nothing non-idempotent runs twice and every
earlier observation comes back unchanged. An operation that is not in the log while
logged ones are still waiting is a `ReplayDivergenceError` (strict) or runs live (not
strict). Once every logged operation was asked for again, operations run live.

Used by the bubblewrap sandbox (`tidal.sandbox.Sandbox`) and the container runtime
(`tidal.agent.containers.ContainerRuntime`). Thread-safe.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from tidal.sandbox.types import ReplayDivergenceError

T = TypeVar("T")


@dataclass(frozen=True)
class LogEntry:
    """One operation and its result. `key` identifies the operation (op + arguments,
    hashed); `args` is a readable summary; `result` is op-specific JSON."""

    seq: int
    op: str
    key: str
    args: Mapping[str, Any]
    result: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "op": self.op, "key": self.key, "args": self.args,
                "result": self.result}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LogEntry:
        return cls(seq=d["seq"], op=d["op"], key=d["key"], args=d["args"], result=d["result"])


def op_key(op: str, args: Mapping[str, Any]) -> str:
    """The key of an operation: its kind and arguments, canonical JSON, hashed."""
    blob = json.dumps({"op": op, **args}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


class OpLog:
    """A runtime's operations with their results; after `restored`, in replay mode."""

    def __init__(self) -> None:
        self._entries: list[LogEntry] = []
        self._lock = threading.Lock()
        self._replay: dict[str, deque[LogEntry]] = {}
        self._left = 0
        self._strict = True

    @classmethod
    def restored(cls, entries: Iterable[Mapping[str, Any]], *, strict: bool = True,
                 where: str) -> OpLog:
        """A log holding `entries` (as `LogEntry.to_dict` wrote them), every one waiting
        to be asked for again. ValueError names `where` when they are damaged."""
        try:
            parsed = [LogEntry.from_dict(d) for d in entries]
        except (KeyError, TypeError) as err:
            raise ValueError(f"{where} has a damaged command log") from err
        if [e.seq for e in parsed] != list(range(len(parsed))):
            raise ValueError(f"{where} has a damaged command log")
        log = cls()
        log._entries = parsed
        for e in parsed:
            log._replay.setdefault(e.key, deque()).append(e)
        log._left = len(parsed)
        log._strict = strict
        return log

    @property
    def entries(self) -> tuple[LogEntry, ...]:
        with self._lock:
            return tuple(self._entries)

    @property
    def pending(self) -> int:
        """Logged operations not yet asked for again since the restore."""
        return self._left

    def replayed(self, op: str, key: str, args: Mapping[str, Any]) -> LogEntry | None:
        """The logged entry that answers this operation, or None when it runs live."""
        with self._lock:
            if not self._left:
                return None
            q = self._replay.get(key)
            if q:
                self._left -= 1
                return q.popleft()
            if not self._strict:
                return None
            waiting = min((e for q in self._replay.values() for e in q), key=lambda e: e.seq)
        raise ReplayDivergenceError(
            f"{op} {json.dumps(args)} is not in the restored command log, while "
            f"{self._left} logged operation(s) have not been asked for again; the next "
            f"logged one is #{waiting.seq}: {waiting.op} {json.dumps(waiting.args)}. A restored "
            "sandbox must be driven through the same operations first.")

    def append(self, op: str, key: str, args: Mapping[str, Any],
               result: Mapping[str, Any]) -> None:
        with self._lock:
            self._entries.append(LogEntry(len(self._entries), op, key, dict(args), dict(result)))

    def once(self, op: str, args: Mapping[str, Any], run: Callable[[], T],
             encode: Callable[[T], Mapping[str, Any]],
             decode: Callable[[Mapping[str, Any]], T], *,
             errors: Mapping[str, type[Exception]]) -> T:
        """An operation run exactly once: answered from the log while a restored
        runtime replays it, else run and logged with its result. An exception of one of
        `errors`' types (by name; an instance of none exactly goes under the first it is
        an instance of) is logged too, and raised again as that type when replayed."""
        key = op_key(op, args)
        hit = self.replayed(op, key, args)
        if hit is not None:
            if "error" in hit.result:
                raise _logged_error(hit.result["error"], errors)
            return decode(hit.result)
        try:
            value = run()
        except tuple(errors.values()) as e:
            self.append(op, key, args, {"error": _error_entry(e, errors)})
            raise
        self.append(op, key, args, encode(value))
        return value


def _error_entry(e: Exception, errors: Mapping[str, type[Exception]]) -> dict[str, Any]:
    name = next((n for n, t in errors.items() if type(e) is t), None) or next(
        n for n, t in errors.items() if isinstance(e, t))
    err = getattr(e, "errno", None)
    msg = getattr(e, "strerror", None) if err is not None else None
    return {"type": name, "errno": err, "message": msg or str(e)}


def _logged_error(e: Mapping[str, Any], errors: Mapping[str, type[Exception]]) -> Exception:
    cls = errors.get(e["type"], OSError)
    if issubclass(cls, OSError) and e.get("errno") is not None:
        return cls(e["errno"], e["message"])
    return cls(e["message"])
